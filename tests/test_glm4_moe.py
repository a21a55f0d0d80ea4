"""GLM-4.5 on the paged pool against Hugging Face transformers' Glm4MoeForCausalLM (CPU,
f32), loaded from its `save_pretrained` directory (the experts as the released
checkpoints store them: one tensor per expert and projection).

The HF model is random, its biases, norms and the router's correction bias too; 8 experts
of which 2 run per token, layer 0 dense. Two variants: "air" as GLM-4.5-Air (q/k/v biases,
one expert group, no q / k norms) and "grouped" (q / k norms, 4 groups of which 2 are
kept, unnormalised weights scaled by 2.5). Tolerance as test_llama's: 1e-4 on the logits.
"""

import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers

import jax_paged
from jax_paged import tensor_parallel
from jax_paged import weight_quant
from models import deepseek
from models import glm4_moe
from tests.test_llama import (VOCAB, assert_bf16_tracks_hf,
                              assert_generate_and_engines_give_hfs_tokens,
                              assert_installed_cli_gives_hfs_tokens,
                              assert_kernels_give_references_and_hfs_tokens,
                              assert_logits_track_hf, randomised)

# GQA 8 q heads of 16 over 2 kv heads (RoPE on 8 of the 16); 8 experts 32 wide, 2 per
# token, one shared expert; a dense MLP 96 wide on layer 0.
CONFIG = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
              num_hidden_layers=2, num_attention_heads=8, num_key_value_heads=2, head_dim=16,
              n_routed_experts=8, num_experts_per_tok=2, n_shared_experts=1,
              first_k_dense_replace=1, max_position_embeddings=64, initializer_range=0.1,
              bos_token_id=None, eos_token_id=None, attn_implementation="eager")
VARIANTS = {
    "air": dict(attention_bias=True),
    "grouped": dict(use_qk_norm=True, n_group=4, topk_group=2, routed_scaling_factor=2.5,
                    norm_topk_prob=False, rope_parameters={
                        "rope_type": "default", "rope_theta": 5000.0,
                        "partial_rotary_factor": 0.75}),
}


def _randomise_correction_bias(hf):
  """`hf` with random routers' correction biases (HF's zeros would hide them)."""
  with torch.no_grad():
    for name, b in hf.named_buffers():
      if "e_score_correction_bias" in name:
        b.normal_(0.0, 0.1)
  return hf


def _hf_model(**overrides):
  torch.manual_seed(0)
  return _randomise_correction_bias(randomised(transformers.Glm4MoeForCausalLM(
      transformers.Glm4MoeConfig(**{**CONFIG, **overrides}))))


@pytest.fixture(scope="module", params=list(VARIANTS))
def saved(request, tmp_path_factory):
  """(variant name, HF model, its save_pretrained directory)."""
  hf = _hf_model(**VARIANTS[request.param])
  path = tmp_path_factory.mktemp(request.param)
  hf.save_pretrained(path)
  return request.param, hf, path


def test_prefill_and_decode_logits_match_hf(saved):
  """Logits over a prefill and decode steps: the partial RoPE, the biases or q / k norms,
  the dense layer 0, the grouped sigmoid router with its correction bias, the shared
  expert."""
  name, hf, path = saved
  model = glm4_moe.from_pretrained(path)
  assert isinstance(model, jax_paged.PagedModel)
  assert isinstance(model.layers[0].mlp, glm4_moe.llama.MLP)
  experts = model.layers[1].mlp
  assert isinstance(experts, deepseek.DeepseekMoE) and experts.shared is not None
  np.testing.assert_array_equal(
      experts.correction_bias[...],
      hf.model.layers[1].mlp.gate.e_score_correction_bias.numpy())
  attn = model.layers[1].self_attn
  assert (attn.q_norm is not None) == (name == "grouped")
  assert_logits_track_hf(hf, model, [3, 8, 13], 7)


def test_generate_and_engine_give_hfs_tokens(saved):
  _, hf, path = saved
  assert_generate_and_engines_give_hfs_tokens(hf, glm4_moe.from_pretrained(path))


def test_config_reads_hf_and_its_defaults(saved):
  """A saved config; GLM-4.5-Air's config.json (transformers 4's names); an empty one
  (HF's Glm4MoeConfig defaults); bad fields named."""
  name, hf, _ = saved
  c = glm4_moe.Glm4MoeConfig.from_dict(hf.config.to_dict())
  assert (c.num_local_experts, c.shared_expert_intermediate_size, c.first_k_dense_replace,
          c.n_group, c.qk_norm, c.qkv_bias, c.out_bias) == (
              8, 32, 1, VARIANTS[name].get("n_group", 1), name == "grouped",
              name == "air", False)
  assert c.rotary_dim == (12 if name == "grouped" else 8)
  air = glm4_moe.Glm4MoeConfig.from_dict({
      "architectures": ["Glm4MoeForCausalLM"], "attention_bias": True,
      "attention_dropout": 0.0, "pad_token_id": 151329, "eos_token_id": [151329, 151336, 151338],
      "head_dim": 128, "hidden_act": "silu", "hidden_size": 4096, "partial_rotary_factor": 0.5,
      "initializer_range": 0.02, "intermediate_size": 10944, "max_position_embeddings": 131072,
      "model_type": "glm4_moe", "moe_intermediate_size": 1408, "norm_topk_prob": True,
      "num_attention_heads": 96, "n_group": 1, "topk_group": 1, "n_routed_experts": 128,
      "n_shared_experts": 1, "routed_scaling_factor": 1.0, "num_experts_per_tok": 8,
      "first_k_dense_replace": 1, "num_hidden_layers": 46, "num_key_value_heads": 8,
      "rms_norm_eps": 1e-05, "rope_scaling": None, "rope_theta": 1000000,
      "num_nextn_predict_layers": 1, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
      "use_cache": True, "use_qk_norm": False, "vocab_size": 151552})
  assert (air.head_dim, air.rotary_dim, air.rope_theta, air.num_local_experts,
          air.shared_expert_intermediate_size, air.eos_token_id, air.sparse(0),
          air.sparse(1), air.qkv_bias, air.out_bias) == (
              128, 64, 1000000, 128, 1408, (151329, 151336, 151338), False, True, True, False)
  hf_default = transformers.Glm4MoeConfig()
  # (HF's default shape has no whole head width: 4096 // 96 = 42, half of it odd)
  with pytest.raises(ValueError, match="head_dim 42 rotates 21 features"):
    glm4_moe.Glm4MoeConfig.from_dict({"model_type": "glm4_moe"})
  d = glm4_moe.Glm4MoeConfig.from_dict({"model_type": "glm4_moe", "head_dim": 128})
  assert (d.num_hidden_layers, d.num_local_experts, d.vocab_size, d.rope_theta,
          d.partial_rotary_factor, d.num_experts_per_tok, d.moe_intermediate_size,
          d.shared_expert_intermediate_size, d.head_dim) == (
              hf_default.num_hidden_layers, hf_default.num_local_experts,
              hf_default.vocab_size, hf_default.rope_parameters["rope_theta"],
              hf_default.rope_parameters["partial_rotary_factor"],
              hf_default.num_experts_per_tok, hf_default.moe_intermediate_size,
              hf_default.moe_intermediate_size * hf_default.n_shared_experts, 128)
  assert glm4_moe.Glm4MoeConfig.from_dict(
      {"n_shared_experts": 0, "head_dim": 128}).shared_expert_intermediate_size is None
  for bad, message in (({"n_group": 3}, "n_group dividing the 128 experts"),
                       ({"topk_group": 2}, "topk_group <= n_group"),
                       ({"first_k_dense_replace": -1}, "first_k_dense_replace must be"),
                       ({"routed_scaling_factor": 0}, "routed_scaling_factor must be"),
                       ({"model_type": "deepseek_v3"}, "model_type 'deepseek_v3' is not")):
    with pytest.raises(ValueError, match=message):
      glm4_moe.Glm4MoeConfig.from_dict({"head_dim": 128, **bad})


def test_bf16_tracks_hf(saved):
  _, hf, path = saved
  assert_bf16_tracks_hf(hf, glm4_moe.from_pretrained(path, dtype=jnp.bfloat16),
                        f32_params=("'router'", "'correction_bias'"))  # (HF's are f32)


def test_int8_weights_and_tensor_parallel_splits(saved):
  """int8 weights quantize the attention, the dense MLP and the experts; tensor
  parallelism splits the experts like a dense MLP and the shared expert as one."""
  _, _, path = saved
  model = glm4_moe.from_pretrained(path)
  experts = model.layers[1].mlp
  width = model.config.expert_width
  splits = dict((id(proj), split) for proj, split in model.tensor_parallel_splits())
  assert splits[id(experts.gate_up)] == tensor_parallel.Split("column", (width, width))
  assert splits[id(experts.down)] == tensor_parallel.ROW
  assert splits[id(experts.shared.down)] == tensor_parallel.ROW
  assert weight_quant.quantize_weights(model) > 0
  assert experts.gate_up.kernel[...].dtype == jnp.int8
  assert experts.router[...].dtype == jnp.float32  # (the router stays float, as HF's)
  prompt = [[5, 17, 3, 99, 41, 8]]
  float_tokens = jax_paged.generate(glm4_moe.from_pretrained(path), prompt, 6, page_size=8)
  assert jax_paged.generate(model, prompt, 6, page_size=8)[0][:2] == float_tokens[0][:2]


def test_cli_finds_the_model_type(saved, capsys):
  _, hf, path = saved
  assert_installed_cli_gives_hfs_tokens(hf, path, capsys, seed=7)


@pytest.mark.gpu
def test_triton_kernels_give_the_references_and_hfs_tokens_on_gpu(tmp_path):
  """f32 on a GPU at head dim 64 (RoPE on 32): the decode and prefill kernels, the grouped
  expert matmuls, the fused GEMMs and norms give the reference path's and HF's tokens."""
  hf = _hf_model(hidden_size=128, head_dim=64, use_qk_norm=True, attention_bias=True)
  hf.save_pretrained(tmp_path)
  assert_kernels_give_references_and_hfs_tokens(
      hf, lambda **kw: glm4_moe.from_pretrained(tmp_path, **kw))
