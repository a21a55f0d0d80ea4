"""K-EXAONE (EXAONE MoE) on the paged pool against Hugging Face transformers'
ExaoneMoeForCausalLM (CPU, f32), loaded from its `save_pretrained` directory.

The HF model is random, its norms and the router's correction bias too: 4 layers of GQA
8 q heads over 2 kv heads of 16 with per-head q / k norms, layers 0-2 local (windows of 5
positions, with RoPE), layer 3 global (no RoPE); layers 0 and 2 dense, 1 and 3 with 8
experts in 4 groups (2 kept), 2 per token, scaled by 2.5, beside a shared expert.
Tolerance as test_llama's: 1e-4 on the logits.
"""

import numpy as np
import pytest
import torch
import transformers

import jax_paged
from models import deepseek
from models import exaone_moe
from models import llama
from tests.test_glm4_moe import _randomise_correction_bias
from tests.test_llama import (_COMMON, assert_generate_and_engines_give_hfs_tokens,
                              assert_installed_cli_gives_hfs_tokens,
                              assert_kernels_give_references_and_hfs_tokens,
                              assert_logits_track_hf, randomised)

CONFIG = dict(_COMMON, num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=2,
              head_dim=16, moe_intermediate_size=32, num_experts=8, num_experts_per_tok=2,
              num_shared_experts=1, n_group=4, topk_group=2, sliding_window=5,
              mlp_layer_types=["dense", "sparse", "dense", "sparse"], pad_token_id=None)


def _hf_model(**overrides):
  torch.manual_seed(0)
  return _randomise_correction_bias(randomised(transformers.ExaoneMoeForCausalLM(
      transformers.ExaoneMoeConfig(**{**CONFIG, **overrides}))))


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
  """(HF model, its save_pretrained directory)."""
  hf = _hf_model()
  path = tmp_path_factory.mktemp("exaone_moe")
  hf.save_pretrained(path)
  return hf, path


def test_prefill_and_decode_logits_match_hf(saved):
  """Logits over a prefill and decode steps past the window: EXAONE 4.0's attention in
  pre-norm blocks, the dense / sparse layers, the grouped sigmoid router with its
  correction bias, the shared expert."""
  hf, path = saved
  model = exaone_moe.from_pretrained(path)
  assert isinstance(model, jax_paged.PagedModel)
  attention = [layer.self_attn for layer in model.layers]
  assert [a.sliding_window for a in attention] == [5, 5, 5, None]
  assert [a.rope is None for a in attention] == [False, False, False, True]
  assert [type(layer.mlp) for layer in model.layers] == [
      llama.MLP, deepseek.DeepseekMoE, llama.MLP, deepseek.DeepseekMoE]
  np.testing.assert_array_equal(model.layers[1].mlp.correction_bias[...],
                                hf.model.layers[1].mlp.gate.e_score_correction_bias.numpy())
  assert_logits_track_hf(hf, model, [3, 8, 13], 7)


def test_generate_and_engine_give_hfs_tokens(saved):
  hf, path = saved
  assert_generate_and_engines_give_hfs_tokens(hf, exaone_moe.from_pretrained(path))


def test_config_reads_hf_and_its_defaults(saved):
  """A saved config; an empty one (HF's ExaoneMoeConfig defaults); errors."""
  hf, _ = saved
  c = exaone_moe.ExaoneMoeConfig.from_dict(hf.config.to_dict())
  assert (c.layer_types, c.num_local_experts, c.shared_expert_intermediate_size,
          [c.sparse(i) for i in range(4)], c.qk_norm) == (
              ("sliding_attention",) * 3 + ("full_attention",), 8, 32,
              [False, True, False, True], True)
  d = exaone_moe.ExaoneMoeConfig.from_dict({})
  hf_default = transformers.ExaoneMoeConfig()
  assert d == exaone_moe.ExaoneMoeConfig.from_dict(hf_default.to_dict())
  assert (d.vocab_size, d.hidden_size, d.num_hidden_layers, d.num_local_experts,
          d.num_experts_per_tok, d.moe_intermediate_size, d.shared_expert_intermediate_size,
          d.routed_scaling_factor, d.layer_types, [d.sparse(i) for i in range(32)],
          d.head_dim, d.eos_token_id) == (
              hf_default.vocab_size, hf_default.hidden_size, hf_default.num_hidden_layers,
              hf_default.num_experts, hf_default.num_experts_per_tok,
              hf_default.moe_intermediate_size,
              hf_default.moe_intermediate_size * hf_default.num_shared_experts,
              hf_default.routed_scaling_factor, tuple(hf_default.layer_types),
              [t == "sparse" for t in hf_default.mlp_layer_types],
              hf_default.hidden_size // hf_default.num_attention_heads,
              hf_default.eos_token_id)
  for bad, message in (
      ({"mlp_layer_types": ["dense"] * 31}, "mlp_layer_types must give 'dense' or 'sparse'"),
      ({"n_group": 3}, "n_group dividing the 64 experts"),
      ({"sliding_window_pattern": "LLLG"}, "sliding_window_pattern must be a positive int"),
      ({"model_type": "exaone4"}, "model_type 'exaone4' is not supported")):
    with pytest.raises(ValueError, match=message):
      exaone_moe.ExaoneMoeConfig.from_dict(bad)


def test_cli_finds_the_model_type(saved, capsys):
  hf, path = saved
  assert_installed_cli_gives_hfs_tokens(hf, path, capsys, seed=18)


@pytest.mark.gpu
def test_triton_kernels_give_the_references_and_hfs_tokens_on_gpu(tmp_path):
  """f32 on a GPU at head dim 64: the decode and prefill kernels with and without windows
  and RoPE, the grouped expert matmuls and the fused GEMMs give the reference path's and
  HF's tokens."""
  hf = _hf_model(hidden_size=128, head_dim=64)
  hf.save_pretrained(tmp_path)
  assert_kernels_give_references_and_hfs_tokens(
      hf, lambda **kw: exaone_moe.from_pretrained(tmp_path, **kw))
