"""OPT on the paged pool against Hugging Face transformers' OPTForCausalLM (CPU, f32),
loaded from its `save_pretrained` directory and from OPTModel's tensor names (the Hub's
OPT checkpoints: no "model." prefix).

The HF model is random, its LayerNorms and biases too: 4 heads of 16, a ReLU MLP 96 wide,
the learned positions offset by two rows. Tolerance as test_llama's: 1e-4 on the logits.
"""

import json

import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers
from safetensors.numpy import load_file, save_file

import jax_paged
from models import opt
from tests.test_llama import (VOCAB, assert_bf16_tracks_hf,
                              assert_generate_and_engines_give_hfs_tokens,
                              assert_installed_cli_gives_hfs_tokens,
                              assert_kernels_give_references_and_hfs_tokens,
                              assert_logits_track_hf, assert_lora_adapters_match_peft,
                              randomised)

CONFIG = dict(vocab_size=VOCAB, hidden_size=64, word_embed_proj_dim=64, num_hidden_layers=2,
              num_attention_heads=4, ffn_dim=96, max_position_embeddings=64, init_std=0.1,
              bos_token_id=None, eos_token_id=None, pad_token_id=None,
              attn_implementation="eager")


def _hf_model(**overrides):
  torch.manual_seed(0)
  return randomised(transformers.OPTForCausalLM(
      transformers.OPTConfig(**{**CONFIG, **overrides})), norm="layer_norm")


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
  """(HF model, its save_pretrained directory)."""
  hf = _hf_model()
  path = tmp_path_factory.mktemp("opt")
  hf.save_pretrained(path)
  return hf, path


def test_prefill_and_decode_logits_match_hf(saved, tmp_path):
  """Logits over a prefill and decode steps; the same model from OPTModel's names."""
  hf, path = saved
  model = opt.from_pretrained(path)
  assert isinstance(model, jax_paged.PagedModel)
  assert model.wpe.embedding[...].shape == (64 + 2, 64)
  assert_logits_track_hf(hf, model, [3, 8, 13], 7)
  tensors = {k.removeprefix("model."): v for k, v in load_file(path / "model.safetensors")
             .items() if k != "lm_head.weight"}
  save_file(tensors, tmp_path / "model.safetensors", metadata={"format": "pt"})
  (tmp_path / "config.json").write_text((path / "config.json").read_text())
  assert_logits_track_hf(hf, opt.from_pretrained(tmp_path), [5], 2)


def test_pytorch_checkpoints_load(saved, tmp_path):
  """pytorch_model.bin (the Hub's OPT checkpoints have no safetensors), one file or shards
  under pytorch_model.bin.index.json, bf16 tensors kept exactly; a truncated file named."""
  hf, path = saved
  (tmp_path / "config.json").write_text((path / "config.json").read_text())
  state = {k: v.contiguous() for k, v in hf.state_dict().items() if k != "lm_head.weight"}
  torch.save(state, tmp_path / "pytorch_model.bin")
  assert_logits_track_hf(hf, opt.from_pretrained(tmp_path), [5], 2)
  shards = tmp_path / "shards"
  shards.mkdir()
  (shards / "config.json").write_text((path / "config.json").read_text())
  names = sorted(state)
  weight_map = {}
  for i, part in enumerate((names[::2], names[1::2])):
    file = f"pytorch_model-0000{i + 1}-of-00002.bin"
    torch.save({k: state[k].to(torch.bfloat16) for k in part}, shards / file)
    weight_map.update(dict.fromkeys(part, file))
  (shards / "pytorch_model.bin.index.json").write_text(json.dumps({"weight_map": weight_map}))
  half = opt.from_pretrained(shards, dtype=jnp.bfloat16)
  np.testing.assert_array_equal(
      np.asarray(half.wte.embedding[...], np.float32),
      state["model.decoder.embed_tokens.weight"].to(torch.bfloat16).float().numpy())
  (shards / "pytorch_model-00002-of-00002.bin").write_bytes(b"not a zip")
  with pytest.raises(ValueError, match="pytorch_model-00002-of-00002.bin: not a readable "
                                       "PyTorch checkpoint"):
    opt.from_pretrained(shards)


def test_generate_and_engine_give_hfs_tokens(saved):
  hf, path = saved
  assert_generate_and_engines_give_hfs_tokens(hf, opt.from_pretrained(path))


def test_lora_adapters_match_peft(tmp_path):
  """PEFT adapters on q / k / v / out_proj, fc1 and fc2 (PEFT's names)."""
  assert_lora_adapters_match_peft(_hf_model, opt.from_pretrained,
                                  ["q_proj", "k_proj", "v_proj", "out_proj", "fc1", "fc2"],
                                  tmp_path)


def test_config_reads_hf_and_its_defaults(saved):
  """A saved config, an empty one (HF's defaults: OPT-125M), OPT-350M's refused."""
  hf, _ = saved
  c = opt.OPTConfig.from_dict(hf.config.to_dict())
  assert (c.n_embd, c.n_layer, c.n_head, c.n_inner, c.n_positions, c.activation_function,
          c.initializer_range) == (64, 2, 4, 96, 64, "relu", 0.1)
  d = opt.OPTConfig.from_dict({})
  want = transformers.OPTConfig()
  assert d == opt.OPTConfig.from_dict(want.to_dict())
  assert (d.vocab_size, d.n_embd, d.n_layer, d.n_head, d.n_inner, d.n_positions,
          d.eos_token_id) == (want.vocab_size, want.hidden_size, want.num_hidden_layers,
                              want.num_attention_heads, want.ffn_dim,
                              want.max_position_embeddings, want.eos_token_id)
  opt_350m = {"hidden_size": 1024, "word_embed_proj_dim": 512, "do_layer_norm_before": False}
  with pytest.raises(ValueError, match="do_layer_norm_before=False .* is not supported"):
    opt.OPTConfig.from_dict(opt_350m)
  with pytest.raises(ValueError, match="word_embed_proj_dim=512 .* is not supported"):
    opt.OPTConfig.from_dict({**opt_350m, "do_layer_norm_before": True})
  with pytest.raises(ValueError, match="enable_bias=False"):
    opt.OPTConfig.from_dict({"enable_bias": False})


def test_bf16_tracks_hf(saved):
  hf, path = saved
  assert_bf16_tracks_hf(hf, opt.from_pretrained(path, dtype=jnp.bfloat16))


def test_cli_finds_the_model_type(saved, capsys):
  hf, path = saved
  assert_installed_cli_gives_hfs_tokens(hf, path, capsys, seed=15)


@pytest.mark.gpu
def test_triton_kernels_give_the_references_and_hfs_tokens_on_gpu(tmp_path):
  """f32 on a GPU at head dim 64: the kernels give the reference path's and HF's tokens."""
  hf = _hf_model(hidden_size=256, word_embed_proj_dim=256)
  hf.save_pretrained(tmp_path)
  assert_kernels_give_references_and_hfs_tokens(
      hf, lambda **kw: opt.from_pretrained(tmp_path, **kw))
