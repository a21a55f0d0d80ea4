"""Solar Open on the paged pool against Hugging Face transformers' SolarOpenForCausalLM
(CPU, f32), loaded from its `save_pretrained` directory.

The HF model is random, its biases, norms and the routers' correction biases too: GQA 8 q
heads over 2 kv heads of 16 with RoPE over all of each, q / k / v biases; on both layers
8 experts 32 wide in 4 groups (2 kept), 2 per token, weights renormalised and scaled by
2.5, one shared expert. Tolerance as test_llama's: 1e-4 on the logits.
"""

import numpy as np
import pytest
import torch
import transformers

import jax_paged
from models import deepseek
from models import solar_open
from tests.test_glm4_moe import _randomise_correction_bias
from tests.test_llama import (VOCAB, assert_generate_and_engines_give_hfs_tokens,
                              assert_installed_cli_gives_hfs_tokens,
                              assert_kernels_give_references_and_hfs_tokens,
                              assert_logits_track_hf, randomised)

CONFIG = dict(vocab_size=VOCAB, hidden_size=64, moe_intermediate_size=32, num_hidden_layers=2,
              num_attention_heads=8, num_key_value_heads=2, head_dim=16, n_routed_experts=8,
              num_experts_per_tok=2, n_shared_experts=1, n_group=4, topk_group=2,
              routed_scaling_factor=2.5, attention_bias=True, max_position_embeddings=64,
              initializer_range=0.1, attn_implementation="eager")


def _hf_model(**overrides):
  torch.manual_seed(0)
  return _randomise_correction_bias(randomised(transformers.SolarOpenForCausalLM(
      transformers.SolarOpenConfig(**{**CONFIG, **overrides}))))


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
  """(HF model, its save_pretrained directory)."""
  hf = _hf_model()
  path = tmp_path_factory.mktemp("solar_open")
  hf.save_pretrained(path)
  return hf, path


def test_prefill_and_decode_logits_match_hf(saved):
  """Logits over a prefill and decode steps: experts on every layer (the grouped sigmoid
  router, its correction bias, the shared expert), whole-head RoPE, q / k / v biases."""
  hf, path = saved
  model = solar_open.from_pretrained(path)
  assert isinstance(model, jax_paged.PagedModel)
  assert all(isinstance(layer.mlp, deepseek.DeepseekMoE) for layer in model.layers)
  np.testing.assert_array_equal(model.layers[0].mlp.correction_bias[...],
                                hf.model.layers[0].mlp.gate.e_score_correction_bias.numpy())
  attention = model.layers[0].self_attn
  assert attention.rope.rotary_dim is None and attention.q_norm is None
  assert attention.qkv.bias is not None and attention.out.bias is None
  assert_logits_track_hf(hf, model, [3, 8, 13], 7)


def test_generate_and_engine_give_hfs_tokens(saved):
  hf, path = saved
  assert_generate_and_engines_give_hfs_tokens(hf, solar_open.from_pretrained(path))


def test_config_reads_hf_and_its_defaults(saved):
  """A saved config; an empty one (HF's SolarOpenConfig defaults); errors."""
  hf, _ = saved
  c = solar_open.SolarOpenConfig.from_dict(hf.config.to_dict())
  assert (c.num_local_experts, c.shared_expert_intermediate_size, c.n_group, c.sparse(0),
          c.qk_norm, c.rotary_dim) == (8, 32, 4, True, False, 16)
  d = solar_open.SolarOpenConfig.from_dict({})
  hf_default = transformers.SolarOpenConfig()
  assert (d.vocab_size, d.hidden_size, d.num_hidden_layers, d.num_attention_heads,
          d.num_key_value_heads, d.head_dim, d.rope_theta, d.num_local_experts,
          d.num_experts_per_tok, d.moe_intermediate_size, d.shared_expert_intermediate_size,
          d.norm_topk_prob, d.rotary_dim) == (
              hf_default.vocab_size, hf_default.hidden_size, hf_default.num_hidden_layers,
              hf_default.num_attention_heads, hf_default.num_key_value_heads,
              hf_default.head_dim, hf_default.rope_parameters["rope_theta"],
              hf_default.n_routed_experts, hf_default.num_experts_per_tok,
              hf_default.moe_intermediate_size,
              hf_default.moe_intermediate_size * hf_default.n_shared_experts,
              hf_default.norm_topk_prob, hf_default.head_dim)
  for bad, message in (({"n_group": 3}, "n_group dividing the 128 experts"),
                       ({"model_type": "glm4_moe"}, "model_type 'glm4_moe' is not supported")):
    with pytest.raises(ValueError, match=message):
      solar_open.SolarOpenConfig.from_dict(bad)


def test_cli_finds_the_model_type(saved, capsys):
  hf, path = saved
  assert_installed_cli_gives_hfs_tokens(hf, path, capsys, seed=17)


@pytest.mark.gpu
def test_triton_kernels_give_the_references_and_hfs_tokens_on_gpu(tmp_path):
  """f32 on a GPU at head dim 64: the decode and prefill kernels, the grouped expert
  matmuls and the fused GEMMs give the reference path's and HF's tokens."""
  hf = _hf_model(hidden_size=128, head_dim=64)
  hf.save_pretrained(tmp_path)
  assert_kernels_give_references_and_hfs_tokens(
      hf, lambda **kw: solar_open.from_pretrained(tmp_path, **kw))
