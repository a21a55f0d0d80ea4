"""EXAONE 3.x on the paged pool against Hugging Face transformers' EXAONE (its
LlamaForCausalLM, CPU, f32), loaded from its `save_pretrained` directory (EXAONE's tensor
names: transformer.h.N.attn.attention.q_proj ...).

The HF model is random, its norms too: GQA 8 q heads over 2 kv heads of 8, EXAONE 3.5's
llama3 RoPE scaling at a small original context (the positions tested reach it). Tolerance
as test_llama's: 1e-4 on the logits.
"""

import json

import jax.numpy as jnp
import pytest
import torch
import transformers

import jax_paged
from models import exaone
from tests.test_llama import (_COMMON, assert_bf16_tracks_hf,
                              assert_generate_and_engines_give_hfs_tokens,
                              assert_installed_cli_gives_hfs_tokens,
                              assert_kernels_give_references_and_hfs_tokens,
                              assert_logits_track_hf, assert_lora_adapters_match_peft,
                              randomised)

CONFIG = dict(_COMMON, num_attention_heads=8, num_key_value_heads=2, pad_token_id=None,
              rope_parameters={"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0,
                               "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                               "original_max_position_embeddings": 16})


def _hf_model(**overrides):
  torch.manual_seed(0)
  return randomised(transformers.AutoModelForCausalLM.from_config(
      transformers.ExaoneConfig(**{**CONFIG, **overrides})))


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
  """(HF model, its save_pretrained directory)."""
  hf = _hf_model()
  path = tmp_path_factory.mktemp("exaone")
  hf.save_pretrained(path)
  return hf, path


def test_prefill_and_decode_logits_match_hf(saved):
  """EXAONE's tensor names on disk; logits over a prefill and decode steps."""
  hf, path = saved
  from safetensors import safe_open  # pylint: disable=import-outside-toplevel
  with safe_open(str(path / "model.safetensors"), "np") as f:
    assert "transformer.h.0.attn.attention.out_proj.weight" in f.keys()
  model = exaone.from_pretrained(path)
  assert isinstance(model, jax_paged.PagedModel)
  assert_logits_track_hf(hf, model, [3, 8, 13], 7)


def test_generate_and_engine_give_hfs_tokens(saved):
  hf, path = saved
  assert_generate_and_engines_give_hfs_tokens(hf, exaone.from_pretrained(path))


def test_lora_adapters_match_peft(tmp_path):
  """PEFT adapters over HF's modules (q / k / v / o_proj, gate / up / down_proj)."""
  assert_lora_adapters_match_peft(_hf_model, exaone.from_pretrained,
                                  ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj",
                                   "up_proj", "down_proj"], tmp_path)


def test_config_reads_hf_and_its_defaults(saved, tmp_path):
  """A saved config; EXAONE-3.5-2.4B-Instruct's config.json (its own field names, a tied
  head); an empty one (HF's defaults)."""
  hf, _ = saved
  c = exaone.ExaoneConfig.from_dict(hf.config.to_dict())
  assert (c.num_hidden_layers, c.num_key_value_heads, c.head_dim, c.rope.rope_type) == (
      2, 2, 8, "llama3")
  small = exaone.ExaoneConfig.from_dict({
      "activation_function": "silu", "architectures": ["ExaoneForCausalLM"],
      "attention_dropout": 0.0, "bos_token_id": 1, "embed_dropout": 0.0,
      "eos_token_id": 361, "head_dim": 80, "hidden_size": 2560, "initializer_range": 0.02,
      "intermediate_size": 7168, "layer_norm_epsilon": 1e-05,
      "max_position_embeddings": 32768, "model_type": "exaone", "num_attention_heads": 32,
      "num_key_value_heads": 8, "num_layers": 30, "pad_token_id": 0,
      "rope_scaling": {"factor": 8.0, "high_freq_factor": 4.0, "low_freq_factor": 1.0,
                       "original_max_position_embeddings": 8192, "rope_type": "llama3"},
      "rope_theta": 1000000.0, "tie_word_embeddings": True, "vocab_size": 102400})
  assert (small.num_hidden_layers, small.rms_norm_eps, small.head_dim, small.rope_theta,
          small.tie_word_embeddings, small.eos_token_id) == (
              30, 1e-5, 80, 1e6, True, 361)
  d = exaone.ExaoneConfig.from_dict({})
  want = transformers.ExaoneConfig()
  assert (d.vocab_size, d.intermediate_size, d.num_key_value_heads, d.rope_theta,
          d.eos_token_id, d.max_position_embeddings) == (
              want.vocab_size, want.intermediate_size, want.num_key_value_heads,
              want.rope_parameters["rope_theta"], want.eos_token_id,
              want.max_position_embeddings)
  with pytest.raises(ValueError, match="model_type 'llama' is not supported"):
    exaone.ExaoneConfig.from_dict({"model_type": "llama"})
  config = json.loads((saved[1] / "config.json").read_text())
  (tmp_path / "config.json").write_text(json.dumps(config))
  with pytest.raises(FileNotFoundError, match="no weights"):
    exaone.from_pretrained(tmp_path)


def test_bf16_tracks_hf(saved):
  hf, path = saved
  assert_bf16_tracks_hf(hf, exaone.from_pretrained(path, dtype=jnp.bfloat16))


def test_cli_finds_the_model_type(saved, capsys):
  hf, path = saved
  assert_installed_cli_gives_hfs_tokens(hf, path, capsys, seed=15)


@pytest.mark.gpu
def test_triton_kernels_give_the_references_and_hfs_tokens_on_gpu(tmp_path):
  """f32 on a GPU at head dim 64: the kernels give the reference path's and HF's tokens."""
  hf = _hf_model(hidden_size=512)
  hf.save_pretrained(tmp_path)
  assert_kernels_give_references_and_hfs_tokens(
      hf, lambda **kw: exaone.from_pretrained(tmp_path, **kw))
