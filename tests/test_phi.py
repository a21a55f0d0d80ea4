"""Phi (phi-1 / 1.5 / 2) on the paged pool against Hugging Face transformers'
PhiForCausalLM (CPU, f32), loaded from its `save_pretrained` directory.

The HF model is random, its LayerNorms' weights and every bias too (the LM head's
included: HF's ones and zeros would hide a norm or bias applied wrongly or not at all).
Tolerance as test_llama's: 1e-4 on the logits.
"""

import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers

import jax_paged
from models import phi
from tests.test_llama import (_COMMON, assert_bf16_tracks_hf,
                              assert_generate_and_engines_give_hfs_tokens,
                              assert_installed_cli_gives_hfs_tokens,
                              assert_kernels_give_references_and_hfs_tokens,
                              assert_logits_track_hf, assert_lora_adapters_match_peft,
                              randomised)

# GQA 8 q heads over 2 kv heads of 8, RoPE on the first 4 features of each (as Phi-2 on
# 32 of 80), exact GELU, untied and biased head.
CONFIG = dict(_COMMON, num_attention_heads=8, num_key_value_heads=2,
              partial_rotary_factor=0.5, rope_theta=500.0, hidden_act="gelu",
              layer_norm_eps=1e-4, resid_pdrop=0.0, embd_pdrop=0.0)


def _hf_model(**overrides):
  torch.manual_seed(0)
  return randomised(transformers.PhiForCausalLM(transformers.PhiConfig(
      **{**CONFIG, **overrides})))


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
  """(HF model, its save_pretrained directory)."""
  hf = _hf_model()
  path = tmp_path_factory.mktemp("phi")
  hf.save_pretrained(path)
  return hf, path


def test_prefill_and_decode_logits_match_hf(saved):
  """Logits over a prefill and decode steps: the block's one LayerNorm feeding both
  parallel branches, RoPE on half of each head, biases everywhere (the head's too)."""
  hf, path = saved
  model = phi.from_pretrained(path)
  assert isinstance(model, jax_paged.PagedModel)
  block = model.layers[0]
  assert not hasattr(block, "post_attention_layernorm")
  assert block.self_attn.rope.rotary_dim == 4 and block.mlp.c_fc.bias is not None
  assert np.abs(model.lm_head_bias[...]).max() > 0.1
  assert_logits_track_hf(hf, model, [3, 8, 13], 7)


def test_generate_and_engine_give_hfs_tokens(saved):
  """generate (greedy: its argmax from the biased logits); an engine preempting in a
  tiny pool; one whose prompts share a cached prefix and whose long prompt is prefilled in
  chunks: HF's greedy tokens."""
  hf, path = saved
  assert_generate_and_engines_give_hfs_tokens(hf, phi.from_pretrained(path))


def test_lora_adapters_match_peft(tmp_path):
  """PEFT adapters on q / k / v, dense, fc1 and fc2 (PEFT's names for Phi): the served
  model's greedy tokens are those of the adapter merged into HF's weights."""
  assert_lora_adapters_match_peft(_hf_model, phi.from_pretrained,
                                  ["q_proj", "k_proj", "v_proj", "dense", "fc1", "fc2"], tmp_path)


def test_config_reads_hf_and_its_defaults(saved):
  """A saved config, a config.json omitting fields (Hugging Face's PhiConfig defaults, as
  HF reads the same file), and what is refused by name."""
  hf, _ = saved
  c = phi.PhiConfig.from_dict(hf.config.to_dict())
  assert (c.num_key_value_heads, c.head_dim, c.rotary_dim, c.layer_norm_eps, c.hidden_act,
          c.tie_word_embeddings) == (2, 8, 4, 1e-4, "gelu", False)
  d = phi.PhiConfig.from_dict({"model_type": "phi"})
  assert d == phi.PhiConfig.from_dict(transformers.PhiConfig().to_dict())
  assert (d.vocab_size, d.hidden_size, d.num_key_value_heads, d.rotary_dim, d.hidden_act,
          d.qkv_bias, d.out_bias, d.mlp_bias) == (51200, 2048, 32, 32, "gelu_new", True, True,
                                                  True)
  for bad, message in (({"qk_layernorm": True}, "qk_layernorm .* is not supported"),
                       ({"hidden_act": "swish"}, "hidden_act 'swish' is not supported"),
                       ({"model_type": "phi3"}, "model_type 'phi3' is not supported")):
    with pytest.raises(ValueError, match=message):
      phi.PhiConfig.from_dict(bad)


def test_bf16_tracks_hf(saved):
  hf, path = saved
  assert_bf16_tracks_hf(hf, phi.from_pretrained(path, dtype=jnp.bfloat16))


def test_cli_finds_the_model_type(saved, capsys):
  hf, path = saved
  assert_installed_cli_gives_hfs_tokens(hf, path, capsys, seed=7)


@pytest.mark.gpu
def test_triton_kernels_give_the_references_and_hfs_tokens_on_gpu(tmp_path):
  """f32 on a GPU at Phi-2's head dim 80, RoPE on 32 of its features: the decode /
  prefill kernels, the fused fc1 + GELU GEMM and the LayerNorm-fused residual adds give
  the reference path's and HF's tokens."""
  hf = _hf_model(hidden_size=320, num_attention_heads=4, num_key_value_heads=4,
                 partial_rotary_factor=0.4, hidden_act="gelu_new")
  hf.save_pretrained(tmp_path)
  assert_kernels_give_references_and_hfs_tokens(
      hf, lambda **kw: phi.from_pretrained(tmp_path, **kw))
