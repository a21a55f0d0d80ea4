"""StarCoder2 on the paged pool against Hugging Face transformers' Starcoder2ForCausalLM
(CPU, f32), loaded from its `save_pretrained` directory.

The HF model is random, its LayerNorms' weights and every bias too (HF's ones and zeros
would hide a norm or bias applied wrongly or not at all). Tolerance as test_llama's: 1e-4
on the logits.
"""

import jax.numpy as jnp
import pytest
import torch
import transformers

import jax_paged
from models import starcoder2
from tests.test_llama import (_COMMON, assert_bf16_tracks_hf,
                              assert_generate_and_engines_give_hfs_tokens,
                              assert_installed_cli_gives_hfs_tokens,
                              assert_kernels_give_references_and_hfs_tokens, assert_logits_track_hf,
                              randomised)

# GQA 8 q heads over 2 kv heads of 8, every layer windowed to 6 positions (shorter than
# the sequences), linear RoPE, untied head.
CONFIG = dict(_COMMON, num_attention_heads=8, num_key_value_heads=2, sliding_window=6,
              rope_parameters={"rope_type": "linear", "factor": 2.0, "rope_theta": 500.0},
              tie_word_embeddings=False, norm_epsilon=1e-4)


def _hf_model(**overrides):
  torch.manual_seed(0)
  return randomised(transformers.Starcoder2ForCausalLM(transformers.Starcoder2Config(
      **{**CONFIG, **overrides})))


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
  """(HF model, its save_pretrained directory)."""
  hf = _hf_model()
  path = tmp_path_factory.mktemp("starcoder2")
  hf.save_pretrained(path)
  return hf, path


def test_prefill_and_decode_logits_match_hf(saved):
  """Logits over a prefill and decode steps: LayerNorms (weights and biases), the plain
  GELU MLP and biases on every projection, a window on every layer."""
  hf, path = saved
  model = starcoder2.from_pretrained(path)
  assert isinstance(model, jax_paged.PagedModel)
  block = model.layers[0]
  assert isinstance(block.input_layernorm, jax_paged.nn.LayerNorm)
  assert isinstance(model.norm, jax_paged.nn.LayerNorm)
  assert block.mlp.c_fc.bias is not None and block.self_attn.out.bias is not None
  assert [b.self_attn.sliding_window for b in model.layers] == [6, 6]
  assert_logits_track_hf(hf, model, [3, 8, 13], 7)


def test_generate_and_engine_give_hfs_tokens(saved):
  """generate; an engine preempting in a tiny pool; one whose prompts share a cached
  prefix and whose long prompt is prefilled in chunks: HF's greedy tokens."""
  hf, path = saved
  model = starcoder2.from_pretrained(path)
  assert_generate_and_engines_give_hfs_tokens(hf, model)


def test_config_reads_hf_and_its_defaults(saved):
  """A saved config, a config.json omitting fields (Hugging Face's Starcoder2Config
  defaults, as HF reads the same file), use_bias=False, and what is refused by name."""
  hf, _ = saved
  c = starcoder2.Starcoder2Config.from_dict(hf.config.to_dict())
  assert (c.num_key_value_heads, c.head_dim, c.norm_epsilon, c.sliding_window,
          c.rope.rope_type, c.tie_word_embeddings) == (2, 8, 1e-4, 6, "linear", False)
  hf_defaults = transformers.Starcoder2Config().to_dict()
  d = starcoder2.Starcoder2Config.from_dict({"model_type": "starcoder2"})
  assert d == starcoder2.Starcoder2Config.from_dict(hf_defaults)
  assert (d.vocab_size, d.hidden_size, d.num_key_value_heads, d.norm_epsilon,
          d.tie_word_embeddings, d.qkv_bias, d.out_bias, d.mlp_bias, d.sliding_window) == (
      49152, 3072, 2, 1e-5, True, True, True, True, None)
  plain = starcoder2.Starcoder2Config.from_dict({"use_bias": False})
  assert not (plain.qkv_bias or plain.out_bias or plain.mlp_bias)
  with pytest.raises(ValueError, match="hidden_act 'silu' is not supported; use one of "
                                       r"\('gelu_pytorch_tanh', 'gelu_new', 'gelu'\)"):
    starcoder2.Starcoder2Config.from_dict({"hidden_act": "silu"})
  with pytest.raises(ValueError, match="model_type 'llama' is not supported"):
    starcoder2.Starcoder2Config.from_dict({"model_type": "llama"})


def test_bf16_tracks_hf(saved):
  hf, path = saved
  assert_bf16_tracks_hf(hf, starcoder2.from_pretrained(path, dtype=jnp.bfloat16))


def test_cli_finds_the_model_type(saved, capsys):
  hf, path = saved
  assert_installed_cli_gives_hfs_tokens(hf, path, capsys, seed=6)


@pytest.mark.gpu
def test_triton_kernels_give_the_references_and_hfs_tokens_on_gpu(tmp_path):
  """f32 on a GPU at head dim 64: the decode / prefill kernels (windowed), the fused
  c_fc + GELU GEMM and the LayerNorm-fused residual adds give the reference path's and
  HF's tokens."""
  hf = _hf_model(hidden_size=256, num_attention_heads=4, num_key_value_heads=2,
                 sliding_window=20)
  hf.save_pretrained(tmp_path)
  assert_kernels_give_references_and_hfs_tokens(
      hf, lambda **kw: starcoder2.from_pretrained(tmp_path, **kw))
