"""ERNIE 4.5 MoE on the paged pool against Hugging Face transformers'
Ernie4_5_MoeForCausalLM (CPU, f32), loaded from its `save_pretrained` directory (one
tensor per expert and projection, as the released checkpoints).

The HF model is random, its norms and the router's correction bias too; GQA 8 q heads of
16 over 2 kv heads, RoPE over all 16 interleaved; 8 experts 32 wide of which 2 run per
token. Two variants: "a3b" as ERNIE-4.5-21B-A3B (layer 0 dense, experts on the rest, one
shared expert, tied embeddings) and "interval" (experts on every second layer from 0 to 2:
layer 1 only; no shared expert, its own LM head). Tolerance as test_llama's: 1e-4 on the
logits.
"""

import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers

import jax_paged
from jax_paged import tensor_parallel
from models import ernie4_5_moe
from models import llama
from tests.test_glm4_moe import _randomise_correction_bias
from tests.test_llama import (VOCAB, assert_bf16_tracks_hf,
                              assert_generate_and_engines_give_hfs_tokens,
                              assert_installed_cli_gives_hfs_tokens,
                              assert_kernels_give_references_and_hfs_tokens,
                              assert_logits_track_hf, assert_lora_adapters_match_peft,
                              randomised)

CONFIG = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
              num_attention_heads=8, num_key_value_heads=2, head_dim=16, moe_num_experts=8,
              moe_k=2, max_position_embeddings=64, initializer_range=0.1, pad_token_id=None,
              bos_token_id=None, eos_token_id=None, attn_implementation="eager")
VARIANTS = {
    "a3b": dict(num_hidden_layers=3, moe_layer_start_index=1, moe_num_shared_experts=1,
                tie_word_embeddings=True),
    "interval": dict(num_hidden_layers=4, moe_layer_start_index=0, moe_layer_end_index=2,
                     moe_layer_interval=2, moe_num_shared_experts=0,
                     tie_word_embeddings=False),
}
SPARSE = {"a3b": [False, True, True], "interval": [False, True, False, False]}


def _hf_model(variant: str, **overrides):
  torch.manual_seed(0)
  config = transformers.Ernie4_5_MoeConfig(**{**CONFIG, **VARIANTS[variant], **overrides})
  return _randomise_correction_bias(randomised(transformers.Ernie4_5_MoeForCausalLM(config)))


@pytest.fixture(scope="module", params=list(VARIANTS))
def saved(request, tmp_path_factory):
  """(variant, HF model, its save_pretrained directory)."""
  hf = _hf_model(request.param)
  path = tmp_path_factory.mktemp(request.param)
  hf.save_pretrained(path)
  return request.param, hf, path


def test_prefill_and_decode_logits_match_hf(saved):
  """Logits over a prefill and decode steps: the reordered q / k rows, the layer schedule,
  the softmax router with its correction bias, the shared expert."""
  variant, hf, path = saved
  model = ernie4_5_moe.from_pretrained(path)
  assert isinstance(model, jax_paged.PagedModel)
  assert [isinstance(layer.mlp, ernie4_5_moe.ErnieMoE) for layer in model.layers
          ] == SPARSE[variant]
  assert all(isinstance(layer.mlp, llama.MLP) for layer, sparse
             in zip(model.layers, SPARSE[variant]) if not sparse)
  experts = model.layers[1].mlp
  assert (experts.shared is not None) == (variant == "a3b")
  np.testing.assert_array_equal(
      experts.correction_bias[...],
      hf.model.layers[1].mlp.gate.moe_statics.e_score_correction_bias.numpy()[0])
  assert model.layers[0].self_attn.rope.rotary_dim is None  # (all 16 features)
  assert_logits_track_hf(hf, model, [3, 8, 13], 7)


def test_generate_and_engine_give_hfs_tokens(saved):
  _, hf, path = saved
  assert_generate_and_engines_give_hfs_tokens(hf, ernie4_5_moe.from_pretrained(path))


def test_lora_adapters_match_peft(tmp_path):
  """PEFT adapters on the attention and the dense MLPs: the served model's greedy tokens
  are those of the adapter merged into HF's weights (q_proj's and k_proj's B columns where
  the RoPE reorder put their rows)."""
  assert_lora_adapters_match_peft(
      lambda: _hf_model("interval"), ernie4_5_moe.from_pretrained,
      ["q_proj", "k_proj", "v_proj", "o_proj"], tmp_path)


def test_config_reads_hf_and_its_defaults(saved):
  """A saved config; ERNIE-4.5-21B-A3B-PT's config.json fields; an empty one (HF's
  defaults); errors."""
  variant, hf, _ = saved
  c = ernie4_5_moe.Ernie4_5MoeConfig.from_dict(hf.config.to_dict())
  assert [c.sparse(i) for i in range(c.num_hidden_layers)] == SPARSE[variant]
  assert (c.head_dim, c.rotary_dim, c.num_local_experts, c.num_experts_per_tok,
          c.shared_expert_intermediate_size, c.tie_word_embeddings, c.qkv_bias) == (
              16, 16, 8, 2, 32 if variant == "a3b" else None, variant == "a3b", False)
  a3b = ernie4_5_moe.Ernie4_5MoeConfig.from_dict({
      "architectures": ["Ernie4_5_MoeForCausalLM"], "bos_token_id": 1, "eos_token_id": 2,
      "hidden_act": "silu", "hidden_size": 2560, "intermediate_size": 12288,
      "max_position_embeddings": 131072, "model_type": "ernie4_5_moe",
      "num_attention_heads": 20, "num_key_value_heads": 4, "num_hidden_layers": 28,
      "pad_token_id": 0, "rms_norm_eps": 1e-05, "use_cache": False, "vocab_size": 103424,
      "rope_theta": 500000, "use_bias": False, "tie_word_embeddings": True,
      "moe_num_experts": 64, "moe_num_shared_experts": 2, "moe_layer_start_index": 1,
      "moe_layer_end_index": 27, "moe_intermediate_size": 1536, "moe_capacity": [64, 64, 64],
      "moe_gate": "topk", "moe_k": 6, "moe_layer_interval": 1, "moe_use_aux_free": True,
      "num_nextn_predict_layers": 1, "torch_dtype": "bfloat16"})
  assert (a3b.head_dim, a3b.num_local_experts, a3b.num_experts_per_tok,
          a3b.shared_expert_intermediate_size, a3b.sparse(0), a3b.sparse(1), a3b.sparse(27),
          a3b.rope_theta) == (128, 64, 6, 3072, False, True, True, 500000)
  d = ernie4_5_moe.Ernie4_5MoeConfig.from_dict({})
  hf_default = transformers.Ernie4_5_MoeConfig()
  assert (d.vocab_size, d.hidden_size, d.intermediate_size, d.num_hidden_layers,
          d.num_attention_heads, d.num_key_value_heads, d.rope_theta, d.num_local_experts,
          d.num_experts_per_tok, d.moe_intermediate_size, d.shared_expert_intermediate_size,
          d.moe_layer_start_index, d.moe_layer_end_index, d.moe_layer_interval,
          d.moe_norm_min, d.tie_word_embeddings, d.bos_token_id, d.eos_token_id) == (
              hf_default.vocab_size, hf_default.hidden_size, hf_default.intermediate_size,
              hf_default.num_hidden_layers, hf_default.num_attention_heads,
              hf_default.num_key_value_heads, hf_default.rope_parameters["rope_theta"],
              hf_default.num_experts, hf_default.num_experts_per_tok,
              hf_default.moe_intermediate_size,
              hf_default.moe_intermediate_size * hf_default.moe_num_shared_experts,
              hf_default.moe_layer_start_index, hf_default.moe_layer_end_index,
              hf_default.moe_layer_interval, hf_default.moe_norm_min,
              hf_default.tie_word_embeddings, hf_default.bos_token_id,
              hf_default.eos_token_id)
  assert d.head_dim == 2560 // 20
  for bad, message in (({"use_bias": True}, "use_bias true is not supported"),
                       ({"moe_layer_start_index": 28}, "moe_layer_start_index must be a"),
                       ({"moe_layer_end_index": -2}, "moe_layer_end_index must be a"),
                       ({"moe_layer_interval": 0}, "moe_layer_interval must be"),
                       ({"moe_norm_min": 0}, "moe_norm_min must be"),
                       ({"moe_k": 65}, "num_experts_per_tok \\(65\\) must be <="),
                       ({"model_type": "ernie4_5"}, "model_type 'ernie4_5' is not")):
    with pytest.raises(ValueError, match=message):
      ernie4_5_moe.Ernie4_5MoeConfig.from_dict(bad)


def test_bf16_tracks_hf(saved):
  _, hf, path = saved
  assert_bf16_tracks_hf(hf, ernie4_5_moe.from_pretrained(path, dtype=jnp.bfloat16),
                        f32_params=("'router'", "'correction_bias'"))  # (HF's are f32)


def test_tensor_parallel_splits_the_experts(saved):
  _, _, path = saved
  model = ernie4_5_moe.from_pretrained(path)
  experts, width = model.layers[1].mlp, model.config.expert_width
  splits = dict((id(proj), split) for proj, split in model.tensor_parallel_splits())
  assert splits[id(experts.gate_up)] == tensor_parallel.Split("column", (width, width))
  assert splits[id(experts.down)] == tensor_parallel.ROW


def test_cli_finds_the_model_type(saved, capsys):
  _, hf, path = saved
  assert_installed_cli_gives_hfs_tokens(hf, path, capsys, seed=5)


@pytest.mark.gpu
def test_triton_kernels_give_the_references_and_hfs_tokens_on_gpu(tmp_path):
  """f32 on a GPU at head dim 64 (RoPE over all of it): the decode and prefill kernels,
  the grouped expert matmuls, the fused GEMMs and norms give the reference path's and
  HF's tokens."""
  hf = _hf_model("a3b", hidden_size=128, head_dim=64)
  hf.save_pretrained(tmp_path)
  assert_kernels_give_references_and_hfs_tokens(
      hf, lambda **kw: ernie4_5_moe.from_pretrained(tmp_path, **kw))
