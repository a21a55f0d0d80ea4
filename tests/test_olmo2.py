"""OLMo 2 on the paged pool against Hugging Face transformers' Olmo2ForCausalLM (CPU, f32),
loaded from its `save_pretrained` directory.

The HF model is random, its norms' weights too (uniform in [0.5, 1.5], not HF's ones,
which would hide a norm applied wrongly or not at all), and its attention biases.
Tolerance as test_llama's: 1e-4 on the logits.
"""

import jax.numpy as jnp
import pytest
import torch
import transformers

import jax_paged
from models import olmo2
from tests.test_llama import (_COMMON, assert_bf16_tracks_hf,
                              assert_generate_and_engines_give_hfs_tokens,
                              assert_installed_cli_gives_hfs_tokens,
                              assert_kernels_give_references_and_hfs_tokens, assert_logits_track_hf,
                              randomised)

# GQA 8 q heads over 2 kv heads of 8, biases on q / k / v / o, linear RoPE, untied head.
CONFIG = dict(_COMMON, num_attention_heads=8, num_key_value_heads=2, attention_bias=True,
              rope_scaling={"rope_type": "linear", "factor": 2.0}, pad_token_id=None)


def _hf_model(**overrides):
  torch.manual_seed(0)
  return randomised(transformers.Olmo2ForCausalLM(transformers.Olmo2Config(
      **{**CONFIG, **overrides})))


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
  """(HF model, its save_pretrained directory)."""
  hf = _hf_model()
  path = tmp_path_factory.mktemp("olmo2")
  hf.save_pretrained(path)
  return hf, path


def test_prefill_and_decode_logits_match_hf(saved):
  """Logits over a prefill and decode steps; the blocks have post-norms only and the q /
  k norms span all heads (64 and 16 wide)."""
  hf, path = saved
  model = olmo2.from_pretrained(path)
  assert isinstance(model, jax_paged.PagedModel)
  attention = model.layers[0].self_attn
  assert attention.qk_norm_all_heads and attention.q_norm.weight.shape == (64,)
  assert attention.k_norm.weight.shape == (16,)
  assert attention.out.bias is not None
  assert_logits_track_hf(hf, model, [3, 8, 13], 7)


def test_generate_and_engine_give_hfs_tokens(saved):
  """generate; an engine preempting in a tiny pool; one whose prompts share a cached
  prefix and whose long prompt is prefilled in chunks: HF's greedy tokens."""
  hf, path = saved
  model = olmo2.from_pretrained(path)
  assert_generate_and_engines_give_hfs_tokens(hf, model)


def test_config_reads_hf_and_its_defaults(saved):
  """A saved config, and a config.json omitting fields: Hugging Face's Olmo2Config
  defaults, as HF reads the same file."""
  hf, _ = saved
  c = olmo2.Olmo2Config.from_dict(hf.config.to_dict())
  assert (c.num_key_value_heads, c.head_dim, c.out_bias, c.rope.rope_type) == (
      2, 8, True, "linear")
  hf_defaults = transformers.Olmo2Config().to_dict()
  d = olmo2.Olmo2Config.from_dict({"model_type": "olmo2"})
  assert d == olmo2.Olmo2Config.from_dict(hf_defaults)
  assert (d.vocab_size, d.rms_norm_eps, d.eos_token_id, d.bos_token_id) == (
      hf_defaults["vocab_size"], hf_defaults["rms_norm_eps"], hf_defaults["eos_token_id"],
      None)
  with pytest.raises(ValueError, match="model_type 'llama' is not supported"):
    olmo2.Olmo2Config.from_dict({"model_type": "llama"})


def test_bf16_tracks_hf(saved):
  hf, path = saved
  assert_bf16_tracks_hf(hf, olmo2.from_pretrained(path, dtype=jnp.bfloat16))


def test_cli_finds_the_model_type(saved, capsys):
  hf, path = saved
  assert_installed_cli_gives_hfs_tokens(hf, path, capsys, seed=6)


@pytest.mark.gpu
def test_triton_kernels_give_the_references_and_hfs_tokens_on_gpu(tmp_path):
  """f32 on a GPU at head dim 64: the decode / prefill kernels and the fused post-norm
  adds (`project_add_norm`'s parts_norm) give the reference path's and HF's tokens."""
  hf = _hf_model(hidden_size=256, num_attention_heads=4, num_key_value_heads=2)
  hf.save_pretrained(tmp_path)
  assert_kernels_give_references_and_hfs_tokens(
      hf, lambda **kw: olmo2.from_pretrained(tmp_path, **kw))
