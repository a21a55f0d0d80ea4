"""Phi-MoE on the paged pool against Hugging Face transformers' PhimoeForCausalLM (CPU,
f32), loaded from its `save_pretrained` directory (Mixtral's expert names).

The HF model is random, its LayerNorms and biases too (the LM head's included): GQA 8 q
heads over 2 kv heads of 8, a window of 5 positions on every layer, 4 experts 32 wide,
SparseMixer's top 2 with a jitter threshold wide enough (0.3) to leave several experts in
each softmax, LongRoPE's short factors with its short_mscale. Tolerance as test_llama's:
1e-4 on the logits.
"""

import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers
from flax import nnx

import jax_paged
from models import phimoe
from tests.test_llama import (_COMMON, assert_bf16_tracks_hf,
                              assert_generate_and_engines_give_hfs_tokens,
                              assert_installed_cli_gives_hfs_tokens,
                              assert_kernels_give_references_and_hfs_tokens,
                              assert_logits_track_hf, randomised)

ROPE = {"rope_type": "longrope", "rope_theta": 10000.0, "short_factor": [1.0, 1.5, 2.0, 3.0],
        "long_factor": [2.0, 4.0, 8.0, 16.0], "short_mscale": 1.3, "long_mscale": 1.5,
        "original_max_position_embeddings": 48}
CONFIG = dict(_COMMON, intermediate_size=32, num_attention_heads=8, num_key_value_heads=2,
              num_local_experts=4, num_experts_per_tok=2, router_jitter_noise=0.3,
              attention_bias=True, lm_head_bias=True, sliding_window=5, pad_token_id=None,
              rope_parameters=ROPE)


def _hf_model(**overrides):
  torch.manual_seed(0)
  return randomised(transformers.PhimoeForCausalLM(
      transformers.PhimoeConfig(**{**CONFIG, **overrides})))


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
  """(HF model, its save_pretrained directory)."""
  hf = _hf_model()
  path = tmp_path_factory.mktemp("phimoe")
  hf.save_pretrained(path)
  return hf, path


def test_prefill_and_decode_logits_match_hf(saved):
  """Logits over a prefill and decode steps: SparseMixer's weights, the LayerNorms, the
  biased head, the window, LongRoPE's short_mscale."""
  hf, path = saved
  model = phimoe.from_pretrained(path)
  assert isinstance(model, jax_paged.PagedModel)
  assert model.layers[0].self_attn.rope.attention_factor == pytest.approx(1.3)
  assert model.lm_head_bias is not None
  assert_logits_track_hf(hf, model, [3, 8, 13], 7)


def test_sparsemixer_is_hfs():
  """`PhimoeMoE.route` against HF's `sparsemixer` on random logits (ties and far ones)."""
  from transformers.models.phimoe import modeling_phimoe  # pylint: disable=import-outside-toplevel
  model = phimoe.PhimoeMoE(phimoe.PhimoeConfig.from_dict(CONFIG), dtype=jnp.float32,
                           param_dtype=jnp.float32, rngs=nnx.Rngs(0))
  x = np.random.default_rng(0).standard_normal((64, 64)).astype(np.float32)
  weights, experts = model.route(jnp.asarray(x))
  scores = torch.from_numpy(x @ np.asarray(model.router[...]))
  want_w, want_e = modeling_phimoe.sparsemixer(scores, jitter_eps=0.3, training=False)
  np.testing.assert_array_equal(np.asarray(experts), want_e.numpy())
  np.testing.assert_allclose(np.asarray(weights), want_w.numpy(), rtol=1e-6)
  assert (np.asarray(weights) < 0.999).any()  # softmaxes over several experts


def test_generate_and_engine_give_hfs_tokens(saved):
  hf, path = saved
  assert_generate_and_engines_give_hfs_tokens(hf, phimoe.from_pretrained(path))


def test_config_reads_hf_and_its_defaults(saved):
  """A saved config, an empty one (HF's defaults: Phi-3.5-MoE's shape), the long regime's
  mscale, errors."""
  hf, _ = saved
  c = phimoe.PhimoeConfig.from_dict(hf.config.to_dict())
  assert (c.num_local_experts, c.expert_width, c.router_jitter_noise, c.lm_head_bias,
          c.qkv_bias, c.out_bias, c.window(1)) == (4, 32, 0.3, True, True, True, 5)
  long = phimoe.PhimoeConfig.from_dict({**hf.config.to_dict(), "max_model_len": 64})
  assert long.rope.attention_factor == pytest.approx(1.5)
  assert long.rope.ext_factors == (2.0, 4.0, 8.0, 16.0)
  d = phimoe.PhimoeConfig.from_dict({})
  want = transformers.PhimoeConfig()
  assert d == phimoe.PhimoeConfig.from_dict(want.to_dict())
  assert (d.vocab_size, d.hidden_size, d.intermediate_size, d.num_local_experts,
          d.rope_theta, d.router_jitter_noise) == (
              want.vocab_size, want.hidden_size, want.intermediate_size,
              want.num_local_experts, want.rope_parameters["rope_theta"],
              want.router_jitter_noise)
  with pytest.raises(ValueError, match="num_experts_per_tok 1 is not supported"):
    phimoe.PhimoeConfig.from_dict({"num_experts_per_tok": 1})


def test_bf16_tracks_hf(saved):
  hf, path = saved
  assert_bf16_tracks_hf(hf, phimoe.from_pretrained(path, dtype=jnp.bfloat16))


def test_cli_finds_the_model_type(saved, capsys):
  hf, path = saved
  assert_installed_cli_gives_hfs_tokens(hf, path, capsys, seed=15)


@pytest.mark.gpu
def test_triton_kernels_give_the_references_and_hfs_tokens_on_gpu(tmp_path):
  """f32 on a GPU at head dim 64: the kernels and grouped expert matmuls give the
  reference path's and HF's tokens."""
  hf = _hf_model(hidden_size=512, rope_parameters={**ROPE, "short_factor": [1.0] * 32,
                                                   "long_factor": [2.0] * 32})
  hf.save_pretrained(tmp_path)
  assert_kernels_give_references_and_hfs_tokens(
      hf, lambda **kw: phimoe.from_pretrained(tmp_path, **kw))
