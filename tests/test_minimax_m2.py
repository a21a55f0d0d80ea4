"""MiniMax-M2 on the paged pool against Hugging Face transformers' MiniMaxM2ForCausalLM
(CPU, f32), loaded from its `save_pretrained` directory (Mixtral's expert names, one
tensor per expert and projection).

The HF model is random, its norms and the routers' correction biases too: GQA 8 q heads
over 2 kv heads of 16 with q / k normalised across all heads and RoPE on 8 of each
head's 16 features; on both layers 4 experts 32 wide of which 2 run per token. Tolerance
as test_llama's: 1e-4 on the logits.
"""

import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers

import jax_paged
from models import deepseek
from models import minimax_m2
from tests.test_glm4_moe import _randomise_correction_bias
from tests.test_llama import (_COMMON, assert_bf16_tracks_hf,
                              assert_generate_and_engines_give_hfs_tokens,
                              assert_installed_cli_gives_hfs_tokens,
                              assert_kernels_give_references_and_hfs_tokens,
                              assert_logits_track_hf, randomised)

CONFIG = dict(_COMMON, intermediate_size=32, num_attention_heads=8, num_key_value_heads=2,
              head_dim=16, rotary_dim=8, num_local_experts=4, num_experts_per_tok=2,
              rope_theta=10000.0)


def _hf_model(**overrides):
  torch.manual_seed(0)
  return _randomise_correction_bias(randomised(transformers.MiniMaxM2ForCausalLM(
      transformers.MiniMaxM2Config(**{**CONFIG, **overrides}))))


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
  """(HF model, its save_pretrained directory)."""
  hf = _hf_model()
  path = tmp_path_factory.mktemp("minimax_m2")
  hf.save_pretrained(path)
  return hf, path


def test_prefill_and_decode_logits_match_hf(saved):
  """Logits over a prefill and decode steps: the all-heads q / k norms, the partial RoPE,
  the sigmoid router with its correction bias."""
  hf, path = saved
  model = minimax_m2.from_pretrained(path)
  assert isinstance(model, jax_paged.PagedModel)
  experts, attention = model.layers[0].mlp, model.layers[0].self_attn
  assert isinstance(experts, deepseek.DeepseekMoE) and experts.shared is None
  np.testing.assert_array_equal(experts.correction_bias[...],
                                hf.model.layers[0].mlp.e_score_correction_bias.numpy())
  assert attention.qk_norm_all_heads and attention.q_norm.weight.shape == (128,)
  assert attention.rope.rotary_dim == 8
  assert_logits_track_hf(hf, model, [3, 8, 13], 7)


def test_generate_and_engine_give_hfs_tokens(saved):
  hf, path = saved
  assert_generate_and_engines_give_hfs_tokens(hf, minimax_m2.from_pretrained(path))


def test_config_reads_hf_and_its_defaults(saved):
  """A saved config; MiniMax-M2's config.json fields; an empty one (HF's defaults);
  errors."""
  hf, _ = saved
  c = minimax_m2.MiniMaxM2Config.from_dict(hf.config.to_dict())
  assert (c.rotary_dim, c.num_local_experts, c.expert_width, c.sparse(0), c.qk_norm_all_heads
          ) == (8, 4, 32, True, True)
  m2 = minimax_m2.MiniMaxM2Config.from_dict({
      "architectures": ["MiniMaxM2ForCausalLM"], "attn_type_list": [1] * 62,
      "bos_token_id": None, "eos_token_id": None, "head_dim": 128, "hidden_act": "silu",
      "hidden_size": 3072, "intermediate_size": 1536, "max_position_embeddings": 196608,
      "model_type": "minimax_m2", "num_attention_heads": 48, "num_experts_per_tok": 8,
      "num_hidden_layers": 62, "num_key_value_heads": 8, "num_local_experts": 256,
      "partial_rotary_factor": 0.5, "qk_norm_type": "per_layer", "rms_norm_eps": 1e-06,
      "rope_theta": 5000000, "rotary_dim": 64, "scoring_func": "sigmoid",
      "shared_intermediate_size": 0, "tie_word_embeddings": False, "use_qk_norm": True,
      "use_routing_bias": True, "vocab_size": 200064})
  assert (m2.rotary_dim, m2.num_local_experts, m2.num_experts_per_tok, m2.expert_width,
          m2.shared_expert_intermediate_size, m2.eos_token_id) == (
              64, 256, 8, 1536, None, None)
  d = minimax_m2.MiniMaxM2Config.from_dict({})
  hf_default = transformers.MiniMaxM2Config()
  assert d == minimax_m2.MiniMaxM2Config.from_dict(hf_default.to_dict())
  assert (d.vocab_size, d.hidden_size, d.num_hidden_layers, d.num_local_experts,
          d.num_experts_per_tok, d.expert_width, d.head_dim, d.rotary_dim, d.rope_theta,
          d.bos_token_id, d.eos_token_id) == (
              hf_default.vocab_size, hf_default.hidden_size, hf_default.num_hidden_layers,
              hf_default.num_local_experts, hf_default.num_experts_per_tok,
              hf_default.intermediate_size, hf_default.head_dim, hf_default.head_dim,
              hf_default.rope_parameters["rope_theta"], hf_default.bos_token_id,
              hf_default.eos_token_id)
  with pytest.raises(ValueError, match="model_type 'mixtral' is not supported"):
    minimax_m2.MiniMaxM2Config.from_dict({"model_type": "mixtral"})


def test_bf16_tracks_hf(saved):
  hf, path = saved
  assert_bf16_tracks_hf(hf, minimax_m2.from_pretrained(path, dtype=jnp.bfloat16),
                        f32_params=("'router'", "'correction_bias'"))


def test_cli_finds_the_model_type(saved, capsys):
  hf, path = saved
  assert_installed_cli_gives_hfs_tokens(hf, path, capsys, seed=16)


@pytest.mark.gpu
def test_triton_kernels_give_the_references_and_hfs_tokens_on_gpu(tmp_path):
  """f32 on a GPU at head dim 64 (RoPE on 32): the decode and prefill kernels, the grouped
  expert matmuls and the fused GEMMs give the reference path's and HF's tokens."""
  hf = _hf_model(hidden_size=128, head_dim=64, rotary_dim=32)
  hf.save_pretrained(tmp_path)
  assert_kernels_give_references_and_hfs_tokens(
      hf, lambda **kw: minimax_m2.from_pretrained(tmp_path, **kw))
