"""Apertus on the paged pool against Hugging Face transformers' ApertusForCausalLM (CPU,
f32), loaded from its `save_pretrained` directory.

The HF model is random, its norms and xIELU scalars too (each layer's own): GQA 8 q heads
over 2 kv heads of 8, each q / k head RMS-normalised before RoPE, llama3 RoPE at a small
original context (the positions tested reach it), biases on q / k / v / o. Tolerance as
test_llama's: 1e-4 on the logits.
"""

import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers

import jax_paged
from models import apertus
from tests.test_llama import (_COMMON, assert_bf16_tracks_hf,
                              assert_generate_and_engines_give_hfs_tokens,
                              assert_installed_cli_gives_hfs_tokens,
                              assert_kernels_give_references_and_hfs_tokens,
                              assert_logits_track_hf, assert_lora_adapters_match_peft,
                              randomised)

CONFIG = dict(_COMMON, num_attention_heads=8, num_key_value_heads=2, attention_bias=True,
              pad_token_id=None, rope_parameters={
                  "rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0,
                  "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                  "original_max_position_embeddings": 16})


def _hf_model(**overrides):
  torch.manual_seed(0)
  hf = randomised(transformers.ApertusForCausalLM(
      transformers.ApertusConfig(**{**CONFIG, **overrides})))
  with torch.no_grad():  # xIELU's scalars away from their shared initial values
    for layer in hf.model.layers:
      layer.mlp.act_fn.alpha_p.uniform_(-1.0, 1.0)
      layer.mlp.act_fn.alpha_n.uniform_(-1.0, 1.0)
  return hf


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
  """(HF model, its save_pretrained directory)."""
  hf = _hf_model()
  path = tmp_path_factory.mktemp("apertus")
  hf.save_pretrained(path)
  return hf, path


def test_prefill_and_decode_logits_match_hf(saved):
  """Logits over a prefill and decode steps: the per-head q / k norms, xIELU with each
  layer's scalars, the renamed pre-norms."""
  hf, path = saved
  model = apertus.from_pretrained(path)
  assert isinstance(model, jax_paged.PagedModel)
  act = model.layers[1].mlp.act_fn
  assert isinstance(act, apertus.Xielu)
  np.testing.assert_array_equal(np.asarray(act.alpha_p[...]),
                                hf.model.layers[1].mlp.act_fn.alpha_p.detach().numpy())
  assert model.layers[0].self_attn.q_norm is not None
  assert_logits_track_hf(hf, model, [3, 8, 13], 7)


def test_xielu_is_hfs():
  """xIELU of random scalars over both branches (and near eps) against HF's."""
  from transformers.activations import XIELUActivation  # pylint: disable=import-outside-toplevel
  torch.manual_seed(3)
  theirs = XIELUActivation(dtype=torch.float32)
  with torch.no_grad():
    theirs.alpha_p.fill_(0.3)
    theirs.alpha_n.fill_(-0.7)
  ours = apertus.Xielu(param_dtype=jnp.float32)
  ours.alpha_p[...] = jnp.full((1,), 0.3)
  ours.alpha_n[...] = jnp.full((1,), -0.7)
  x = np.concatenate([np.linspace(-6, 6, 101), [-1e-7, 0.0, 1e-7]]).astype(np.float32)
  with torch.no_grad():
    want = theirs(torch.from_numpy(x)).numpy()
  np.testing.assert_allclose(np.asarray(ours(jnp.asarray(x))), want, rtol=1e-6, atol=1e-7)


def test_generate_and_engine_give_hfs_tokens(saved):
  hf, path = saved
  assert_generate_and_engines_give_hfs_tokens(hf, apertus.from_pretrained(path))


def test_lora_adapters_match_peft(tmp_path):
  """PEFT adapters on q / k / v / o_proj, up_proj and down_proj (PEFT's names)."""
  assert_lora_adapters_match_peft(_hf_model, apertus.from_pretrained,
                                  ["q_proj", "k_proj", "v_proj", "o_proj", "up_proj",
                                   "down_proj"], tmp_path)


def test_config_reads_hf_and_its_defaults(saved):
  """A saved config, an empty one (HF's defaults: its llama3 RoPE), errors."""
  hf, _ = saved
  c = apertus.ApertusConfig.from_dict(hf.config.to_dict())
  assert (c.num_key_value_heads, c.head_dim, c.qk_norm, c.qkv_bias, c.out_bias,
          c.rope.rope_type) == (2, 8, True, True, True, "llama3")
  d = apertus.ApertusConfig.from_dict({})
  want = transformers.ApertusConfig()
  assert d == apertus.ApertusConfig.from_dict(want.to_dict())
  assert (d.vocab_size, d.hidden_size, d.intermediate_size, d.rope_theta,
          dict(d.rope_scaling)["factor"], d.max_position_embeddings) == (
              want.vocab_size, want.hidden_size, want.intermediate_size,
              want.rope_parameters["rope_theta"], want.rope_parameters["factor"],
              want.max_position_embeddings)
  with pytest.raises(ValueError, match="mlp_bias is not supported"):
    apertus.ApertusConfig.from_dict({"mlp_bias": True})
  with pytest.raises(ValueError, match="hidden_act 'silu' is not supported"):
    apertus.ApertusConfig.from_dict({"hidden_act": "silu"})


def test_bf16_tracks_hf(saved):
  hf, path = saved
  assert_bf16_tracks_hf(hf, apertus.from_pretrained(path, dtype=jnp.bfloat16))


def test_cli_finds_the_model_type(saved, capsys):
  hf, path = saved
  assert_installed_cli_gives_hfs_tokens(hf, path, capsys, seed=15)


@pytest.mark.gpu
def test_triton_kernels_give_the_references_and_hfs_tokens_on_gpu(tmp_path):
  """f32 on a GPU at head dim 64: the kernels give the reference path's and HF's tokens."""
  hf = _hf_model(hidden_size=512)
  hf.save_pretrained(tmp_path)
  assert_kernels_give_references_and_hfs_tokens(
      hf, lambda **kw: apertus.from_pretrained(tmp_path, **kw))
