"""BLOOM on the paged pool against Hugging Face transformers' BloomForCausalLM (CPU, f32),
loaded from its `save_pretrained` directory (4 heads saved in shards; 6 heads, whose ALiBi
slopes are not one geometric sequence, in one file; and BloomModel's tensors alone, as
BLOOM's own checkpoints hold them).

The HF model is random, its LayerNorms' weights and every bias too. Tolerance as
test_llama's: 1e-4 on the logits.
"""

import json

import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers
from transformers.models.bloom import modeling_bloom
from transformers.models.mpt import modeling_mpt

import jax_paged
from jax_paged import nn
from models import bloom
from tests.test_llama import (_COMMON, assert_bf16_tracks_hf,
                              assert_generate_and_engines_give_hfs_tokens,
                              assert_installed_cli_gives_hfs_tokens,
                              assert_kernels_give_references_and_hfs_tokens,
                              assert_logits_track_hf, assert_lora_adapters_match_peft,
                              randomised)

CONFIG = dict(vocab_size=_COMMON["vocab_size"], hidden_size=64, n_layer=2, n_head=4,
              layer_norm_epsilon=1e-4, initializer_range=0.1, bos_token_id=None,
              eos_token_id=None, attn_implementation="eager")
SHARDS = dict(max_shard_size="40KB")


def _hf_model(**overrides):
  torch.manual_seed(0)
  return randomised(transformers.BloomForCausalLM(transformers.BloomConfig(
      **{**CONFIG, **overrides})), norm="layernorm")


@pytest.fixture(scope="module", params=["four", "six", "base"])
def saved(request, tmp_path_factory):
  """(HF model, its save_pretrained directory): 4 heads in shards, 6 heads of 16, and
  BloomModel's tensors without the "transformer." prefix (BLOOM's checkpoints')."""
  heads = 6 if request.param == "six" else 4
  hf = _hf_model(n_head=heads, hidden_size=16 * heads)
  path = tmp_path_factory.mktemp(request.param)
  if request.param == "base":
    hf.transformer.save_pretrained(path)
  else:
    hf.save_pretrained(path, **(SHARDS if request.param == "four" else {}))
  return hf, path


@pytest.mark.parametrize("heads", list(range(1, 41)) + [64, 71, 112])
def test_alibi_slopes_are_blooms_and_mpts(heads):
  """`nn.alibi_slopes` is HF BLOOM's slopes and MPT's (alibi_bias_max 8 and 16), powers
  of two of heads and not."""
  np.testing.assert_allclose(nn.alibi_slopes(heads),
                             modeling_bloom._get_alibi_slopes(heads, "cpu").numpy(),
                             rtol=1e-6)
  for max_bias in (8, 16):
    mpt = -modeling_mpt.build_mpt_alibi_tensor(heads, 2, max_bias)[:, 0, 0].numpy()
    np.testing.assert_allclose(nn.alibi_slopes(heads, max_bias), mpt, rtol=1e-6)


def test_prefill_and_decode_logits_match_hf(saved):
  """Logits over a prefill and decode steps: ALiBi's biases in the prompt's attention and
  the decode kernel's, the embeddings' LayerNorm, query_key_value's head-by-head rows."""
  hf, path = saved
  model = bloom.from_pretrained(path)
  assert isinstance(model, jax_paged.PagedModel)
  assert not hasattr(model, "wpe")
  np.testing.assert_array_equal(model.h[1].attn.alibi_slopes[...],
                                nn.alibi_slopes(hf.config.n_head))
  assert_logits_track_hf(hf, model, [3, 8, 13], 7)


def test_generate_and_engine_give_hfs_tokens(saved):
  """Greedy tokens: `generate`, a preempting engine, and one with a cached prefix (whose
  suffix attends to it through the pages with ALiBi's offsets) and chunked prefill."""
  hf, path = saved
  assert_generate_and_engines_give_hfs_tokens(hf, bloom.from_pretrained(path))


def test_lora_adapters_match_peft(tmp_path):
  """PEFT adapters on query_key_value (its B columns where the load put its rows), dense
  and the MLP: the served model's tokens are those of the adapter merged into HF's."""
  assert_lora_adapters_match_peft(
      _hf_model, bloom.from_pretrained,
      ["query_key_value", "dense", "dense_h_to_4h", "dense_4h_to_h"], tmp_path)


def test_config_reads_hf_and_its_defaults(saved):
  """A saved config, BLOOM's config.json names (n_embed, num_attention_heads), an empty
  one (HF's BloomConfig defaults), max_model_len, and errors."""
  hf, path = saved
  c = bloom.BloomConfig.from_dict(hf.config.to_dict())
  assert (c.n_embd, c.n_head, c.head_dim, c.n_layer, c.layer_norm_epsilon, c.n_positions,
          c.alibi) == (hf.config.hidden_size, hf.config.n_head, 16, 2, 1e-4, 2048, True)
  # bloom-560m's config.json fields.
  c = bloom.BloomConfig.from_dict({"model_type": "bloom", "n_embed": 1024, "n_layer": 24,
                                   "num_attention_heads": 16, "n_inner": None,
                                   "vocab_size": 250880, "eos_token_id": [2, 3]})
  assert (c.n_embd, c.n_layer, c.n_head, c.n_inner, c.eos_token_id) == (1024, 24, 16, None,
                                                                        (2, 3))
  d = bloom.BloomConfig.from_dict({"model_type": "bloom"})
  hf_d = transformers.BloomConfig()
  assert (d.vocab_size, d.n_embd, d.n_layer, d.n_head, d.bos_token_id, d.eos_token_id) == (
      hf_d.vocab_size, hf_d.hidden_size, hf_d.n_layer, hf_d.n_head, hf_d.bos_token_id,
      hf_d.eos_token_id)
  assert bloom.from_pretrained(path, max_model_len=100).spec.max_positions == 100
  for bad, message in (({"apply_residual_connection_post_layernorm": True},
                        "apply_residual_connection_post_layernorm"),
                       ({"tie_word_embeddings": False}, "tie_word_embeddings=False"),
                       ({"model_type": "gpt2"}, "model_type 'gpt2' is not supported")):
    with pytest.raises(ValueError, match=message):
      bloom.BloomConfig.from_dict(bad)
  with pytest.raises(ValueError, match="max_model_len must be a positive int"):
    bloom.from_pretrained(path, max_model_len=0)


def test_from_pretrained_names_a_missing_or_misshapen_weight(saved, tmp_path):
  """A checkpoint without weights, or with a config that does not fit its tensors: the
  error says which."""
  hf, path = saved
  (tmp_path / "config.json").write_text((path / "config.json").read_text())
  with pytest.raises(FileNotFoundError, match="model.safetensors"):
    bloom.from_pretrained(tmp_path)
  hf.save_pretrained(tmp_path / "wide")
  config = json.loads((tmp_path / "wide" / "config.json").read_text())
  config["hidden_size"] = 2 * config["hidden_size"]  # every weight misshapen
  (tmp_path / "wide" / "config.json").write_text(json.dumps(config))
  with pytest.raises(ValueError, match=r"weight transformer\.[\w.]+ \(\d+.* expected "
                                       r"\(\d+,?.* for config.json's hyperparameters"):
    bloom.from_pretrained(tmp_path / "wide")


def test_bf16_tracks_hf(saved):
  hf, path = saved
  assert_bf16_tracks_hf(hf, bloom.from_pretrained(path, dtype=jnp.bfloat16),
                        f32_params=("alibi_slopes",))


def test_cli_finds_the_model_type(saved, capsys):
  hf, path = saved
  assert_installed_cli_gives_hfs_tokens(hf, path, capsys, seed=7)


@pytest.mark.gpu
@pytest.mark.parametrize("heads", [4, 6])
def test_triton_kernels_give_the_references_and_hfs_tokens_on_gpu(tmp_path, heads):
  """f32 on a GPU at head dim 64: the decode and prefill kernels with ALiBi, the fused
  GEMMs and the LayerNorm-fused residual adds give the reference path's and HF's
  tokens."""
  hf = _hf_model(n_head=heads, hidden_size=64 * heads)
  hf.save_pretrained(tmp_path)
  assert_kernels_give_references_and_hfs_tokens(
      hf, lambda **kw: bloom.from_pretrained(tmp_path, **kw))
