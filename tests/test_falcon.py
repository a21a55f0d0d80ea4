"""Falcon on the paged pool against Hugging Face transformers' FalconForCausalLM (CPU,
f32), loaded from its `save_pretrained` directory: Falcon-7B's block (multi-query, one
norm), Falcon-40B's (grouped kv heads, a norm per branch), Falcon2-11B's (grouped, one
norm), the sequential and multi-head variants, and Falcon-RW's (ALiBi, against HF's sdpa
attention: its eager path adds the biases twice).

The HF models are random, their LayerNorms' weights and every bias too. Tolerance as
test_llama's: 1e-4 on the logits.
"""

import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers

import jax_paged
from jax_paged import nn as paged_nn
from models import falcon
from tests.test_llama import (_COMMON, assert_bf16_tracks_hf,
                              assert_generate_and_engines_give_hfs_tokens,
                              assert_installed_cli_gives_hfs_tokens,
                              assert_kernels_give_references_and_hfs_tokens,
                              assert_logits_track_hf, assert_lora_adapters_match_peft,
                              randomised)

# Falcon-40B's block: 8 q heads of 8 over 2 kv heads (grouped query_key_value), ln_attn
# and ln_mlp, biases (made random), an untied head.
CONFIG = dict(vocab_size=_COMMON["vocab_size"], hidden_size=64, num_hidden_layers=2,
              num_attention_heads=8, num_kv_heads=2, new_decoder_architecture=True,
              ffn_hidden_size=96, bias=True, layer_norm_epsilon=1e-4, rope_theta=500.0,
              max_position_embeddings=64, initializer_range=0.1, tie_word_embeddings=False,
              bos_token_id=None, eos_token_id=None, attn_implementation="eager")
VARIANTS = {
    # Falcon-7B: multi-query, one norm for both parallel branches, tied, no biases.
    "7b": dict(new_decoder_architecture=False, multi_query=True, num_kv_heads=None,
               bias=False, tie_word_embeddings=True),
    # Falcon2-11B: grouped kv heads, one norm.
    "11b": dict(num_ln_in_parallel_attn=1),
    # Multi-head, [q, k, v] per head, sequential block.
    "mha-sequential": dict(new_decoder_architecture=False, multi_query=False,
                           num_kv_heads=None, parallel_attn=False),
    # Falcon-RW: ALiBi in place of RoPE, multi-head, sequential, tied.
    "rw": dict(alibi=True, new_decoder_architecture=False, multi_query=False,
               num_kv_heads=None, parallel_attn=False, tie_word_embeddings=True,
               attn_implementation="sdpa"),
}


def _hf_model(**overrides):
  torch.manual_seed(0)
  return randomised(transformers.FalconForCausalLM(transformers.FalconConfig(
      **{**CONFIG, **overrides})))


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
  """(HF model, its save_pretrained directory)."""
  hf = _hf_model()
  path = tmp_path_factory.mktemp("falcon")
  hf.save_pretrained(path)
  return hf, path


def test_prefill_and_decode_logits_match_hf(saved):
  """Logits over a prefill and decode steps: the grouped query_key_value reordered, a
  norm per parallel branch, biases."""
  hf, path = saved
  model = falcon.from_pretrained(path)
  assert isinstance(model, jax_paged.PagedModel)
  block = model.layers[0]
  assert block.norms == 2 and block.self_attn.num_kv_heads == 2 and model.lm_head is not None
  assert_logits_track_hf(hf, model, [3, 8, 13], 7)


@pytest.mark.parametrize("variant", VARIANTS)
def test_other_blocks_track_hf(variant, tmp_path):
  hf = _hf_model(**VARIANTS[variant])
  hf.save_pretrained(tmp_path)
  model = falcon.from_pretrained(tmp_path)
  attn = model.layers[0].self_attn
  assert model.layers[0].norms == {"7b": 1, "11b": 1, "mha-sequential": 0, "rw": 0}[variant]
  assert attn.num_kv_heads == {"7b": 1, "11b": 2, "mha-sequential": 8, "rw": 8}[variant]
  assert (attn.rope is None) == (attn.alibi_slopes is not None) == (variant == "rw")
  assert_logits_track_hf(hf, model, [3, 8, 13], 7)
  if variant == "rw":  # ALiBi through the engine: a cached prefix, chunks, preemption
    assert_generate_and_engines_give_hfs_tokens(hf, model)


def test_generate_and_engine_give_hfs_tokens(saved):
  hf, path = saved
  assert_generate_and_engines_give_hfs_tokens(hf, falcon.from_pretrained(path))


@pytest.mark.parametrize("variant", ["40b", "mha-sequential"])
def test_lora_adapters_match_peft(variant, tmp_path):
  """PEFT adapters on query_key_value (its columns where the load put its rows), dense,
  dense_h_to_4h and dense_4h_to_h."""
  overrides = VARIANTS.get(variant, {})
  assert_lora_adapters_match_peft(lambda: _hf_model(**overrides), falcon.from_pretrained,
                                  ["query_key_value", "dense", "dense_h_to_4h",
                                   "dense_4h_to_h"], tmp_path)


def test_config_reads_hf_and_its_defaults(saved):
  """A saved config, a config.json omitting fields (HF's FalconConfig defaults, as HF
  reads the same file), and what is refused by name."""
  hf, _ = saved
  c = falcon.FalconConfig.from_dict(hf.config.to_dict())
  assert (c.num_key_value_heads, c.head_dim, c.intermediate_size, c.block_norms,
          c.qkv_bias, c.out_bias, c.mlp_bias) == (2, 8, 96, 2, True, True, True)
  d = falcon.FalconConfig.from_dict({"model_type": "falcon"})
  assert d == falcon.FalconConfig.from_dict(transformers.FalconConfig().to_dict())
  assert (d.vocab_size, d.hidden_size, d.num_attention_heads, d.num_key_value_heads,
          d.head_dim, d.intermediate_size, d.block_norms, d.tie_word_embeddings,
          d.eos_token_id) == (65024, 4544, 71, 1, 64, 18176, 1, True, 11)
  rw = falcon.FalconConfig.from_dict({"alibi": True, "num_attention_heads": 32,
                                      "hidden_size": 2048})
  # RW's slopes rounded to bfloat16 (2^(-i / 4) is not a bfloat16 for most i), over 8.
  exact = paged_nn.alibi_slopes(32)
  np.testing.assert_array_equal(rw.alibi_slopes,
                                exact.astype(jnp.bfloat16).astype(np.float32) / 8)
  assert np.abs(rw.alibi_slopes - exact / 8).max() > 1e-4
  assert rw.layer_rope(0) is None and d.alibi_slopes is None
  for bad, message in (({"new_decoder_architecture": True, "num_ln_in_parallel_attn": 3},
                        "num_ln_in_parallel_attn must be 1 or 2"),
                       ({"activation": "swish"}, "hidden_act 'swish'")):
    with pytest.raises(ValueError, match=message):
      falcon.FalconConfig.from_dict(bad)


def test_bf16_tracks_hf(saved):
  hf, path = saved
  assert_bf16_tracks_hf(hf, falcon.from_pretrained(path, dtype=jnp.bfloat16))


def test_cli_finds_the_model_type(saved, capsys):
  hf, path = saved
  assert_installed_cli_gives_hfs_tokens(hf, path, capsys, seed=7)


@pytest.mark.gpu
@pytest.mark.parametrize("variant", ["7b", "rw"])
def test_triton_kernels_give_the_references_and_hfs_tokens_on_gpu(tmp_path, variant):
  """f32 on a GPU at head dim 64, Falcon-7B's multi-query block and Falcon-RW's ALiBi:
  the decode / prefill kernels, the fused GELU GEMM and the LayerNorm-fused residual adds
  give the reference path's and HF's tokens."""
  hf = _hf_model(hidden_size=256, num_attention_heads=4, **VARIANTS[variant])
  hf.save_pretrained(tmp_path)
  assert_kernels_give_references_and_hfs_tokens(
      hf, lambda **kw: falcon.from_pretrained(tmp_path, **kw))
