"""Llama 4 on the paged pool against Hugging Face transformers' Llama4ForCausalLM (CPU,
f32), loaded from its `save_pretrained` directory.

The HF model is random, its norms too: GQA 8 q heads over 2 kv heads of 16; layer 0 a RoPE
layer (interleaved pairs, reordered at load) with chunked attention (chunks of 8 tokens:
the prompts and decodes cross several) and weightless q / k norms, and a dense MLP of 96;
layer 1 a NoPE layer over the whole context whose queries' temperature grows every 4
positions (floor_scale 4), with 4 experts 32 wide (2 per token, their inputs scaled by the
router's sigmoids) beside a shared expert. Tolerance as test_llama's: 1e-4 on the logits.
"""

import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers

import jax_paged
from jax_paged import tensor_parallel
from models import llama4
from tests.test_llama import (_COMMON, assert_bf16_tracks_hf,
                              assert_generate_and_engines_give_hfs_tokens,
                              assert_installed_cli_gives_hfs_tokens,
                              assert_kernels_give_references_and_hfs_tokens,
                              assert_logits_track_hf, randomised)

CONFIG = dict(_COMMON, intermediate_size=32, intermediate_size_mlp=96,
              num_attention_heads=8, num_key_value_heads=2, head_dim=16,
              num_local_experts=4, num_experts_per_tok=2, interleave_moe_layer_step=2,
              no_rope_layers=[1, 0], attention_chunk_size=8, floor_scale=4, attn_scale=0.3,
              pad_token_id=None, rope_parameters={"rope_type": "default", "rope_theta": 1e4})


def _hf_model(**overrides):
  torch.manual_seed(0)
  return randomised(transformers.Llama4ForCausalLM(
      transformers.Llama4TextConfig(**{**CONFIG, **overrides})))


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
  """(HF model, its save_pretrained directory)."""
  hf = _hf_model()
  path = tmp_path_factory.mktemp("llama4")
  hf.save_pretrained(path)
  return hf, path


def test_prefill_and_decode_logits_match_hf(saved):
  """Logits over a prefill and decode steps that cross chunks: the chunked RoPE layer, the
  tempered NoPE layer, the dense MLP and the experts."""
  hf, path = saved
  model = llama4.from_pretrained(path)
  assert isinstance(model, jax_paged.PagedModel)
  rope_layer, nope_layer = (layer.self_attn for layer in model.layers)
  assert (rope_layer.attention_chunk, rope_layer.query_temperature) == (8, None)
  assert isinstance(rope_layer.q_norm, llama4.L2Norm) and rope_layer.qk_norm_after_rope
  assert nope_layer.rope is None and nope_layer.attention_chunk is None
  assert nope_layer.query_temperature == (4, 0.3, 1) and nope_layer.q_norm is None
  assert isinstance(model.layers[1].mlp, llama4.Llama4MoE)
  assert model.layers[0].mlp.down.in_features == 96
  np.testing.assert_array_equal(
      np.asarray(model.layers[1].mlp.gate_up.kernel[...]),
      hf.model.layers[1].feed_forward.experts.gate_up_proj.detach().numpy())
  assert_logits_track_hf(hf, model, [3, 8, 13], 7)


def test_generate_and_engine_give_hfs_tokens(saved):
  hf, path = saved
  assert_generate_and_engines_give_hfs_tokens(hf, llama4.from_pretrained(path))


def test_each_part_changes_the_logits(saved):
  """The chunks, the temperature and the input-scaled experts each matter here: the model
  without one gives other logits than HF's (so the tests above would catch a dropped
  part)."""
  hf, path = saved
  for change in (dict(attention_chunk_size=None), dict(attn_temperature_tuning=False),
                 dict(num_experts_per_tok=1)):
    other = _hf_model(**change)
    prompt = torch.arange(1, 25)[None]
    with torch.no_grad():
      diff = (other(prompt).logits - hf(prompt).logits).abs().max()
    assert diff > 1e-2, change


def test_config_reads_hf_and_its_defaults(saved):
  """A saved config; Scout's and Maverick's config.json text fields; an image-text
  "llama4" config; an empty one (HF's defaults); errors."""
  hf, _ = saved
  c = llama4.Llama4Config.from_dict(hf.config.to_dict())
  assert (c.intermediate_size, c.expert_width, c.shared_expert_intermediate_size,
          c.moe_layers, c.no_rope_layers, c.chunked_layers, c.attention_chunk_size) == (
              96, 32, 32, (1,), (1, 0), (1, 0), 8)
  scout = {"attention_chunk_size": 8192, "attn_scale": 0.1, "attn_temperature_tuning": 4,
           "floor_scale": 8192, "head_dim": 128, "hidden_size": 5120,
           "interleave_moe_layer_step": 1, "intermediate_size": 8192,
           "intermediate_size_mlp": 16384, "max_position_embeddings": 10485760,
           "model_type": "llama4_text", "no_rope_layers": [], "num_attention_heads": 40,
           "num_experts_per_tok": 1, "num_hidden_layers": 48, "num_key_value_heads": 8,
           "num_local_experts": 16, "rms_norm_eps": 1e-05,
           "rope_scaling": {"factor": 16.0, "high_freq_factor": 1.0, "low_freq_factor": 1.0,
                            "original_max_position_embeddings": 8192,
                            "rope_type": "llama3"},
           "rope_theta": 500000.0, "use_qk_norm": True, "vocab_size": 202048,
           "eos_token_id": [200001, 200007, 200008]}
  s = llama4.Llama4Config.from_dict({"model_type": "llama4", "text_config": scout,
                                     "eos_token_id": [200001, 200007, 200008]})
  assert (s.moe_layers, s.no_rope_layers[:4], s.chunked_layers[:4], s.eos_token_id,
          s.rope.rope_type, s.expert_width, s.intermediate_size) == (
              tuple(range(48)), (1, 1, 1, 0), (1, 1, 1, 0), (200001, 200007, 200008),
              "llama3", 8192, 16384)
  maverick = llama4.Llama4Config.from_dict(
      {**scout, "interleave_moe_layer_step": 2, "num_local_experts": 128, "use_qk_norm": False})
  assert maverick.moe_layers == tuple(range(1, 48, 2)) and not maverick.use_qk_norm
  d = llama4.Llama4Config.from_dict({})
  hf_default = transformers.Llama4TextConfig()
  assert d == llama4.Llama4Config.from_dict(hf_default.to_dict())
  assert (d.vocab_size, d.expert_width, d.intermediate_size, d.num_local_experts,
          d.rope_theta, d.chunked_layers[:4]) == (
              hf_default.vocab_size, hf_default.intermediate_size,
              hf_default.intermediate_size_mlp, hf_default.num_local_experts, 500000.0,
              (1, 1, 1, 0))
  for bad, message in (({"attention_bias": True}, "attention_bias True is not supported"),
                       ({"layer_types": ["sliding_attention"] * 48}, "layer_types must each"),
                       ({"moe_layers": [48]}, r"moe_layers must be layers in \[0, 48\)"),
                       ({"text_config": [], "model_type": "llama4"}, "text_config must be"),
                       ({"model_type": "llama"}, "model_type 'llama'")):
    with pytest.raises(ValueError, match=message):
      llama4.Llama4Config.from_dict(bad)


def test_scouts_llama3_rope_is_hfs():
  """Scout's llama3 RoPE scaling has low_freq_factor = high_freq_factor (no smoothed
  band): the frequencies are HF's."""
  from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
  rope = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 16.0,
          "low_freq_factor": 1.0, "high_freq_factor": 1.0,
          "original_max_position_embeddings": 8192}
  hf = transformers.Llama4TextConfig(rope_parameters=rope, head_dim=128)
  want, _ = ROPE_INIT_FUNCTIONS["llama3"](hf, "cpu")
  ours = llama4.Llama4Config.from_dict({"rope_parameters": rope}).rope.inv_freq()
  np.testing.assert_allclose(ours, want.numpy(), rtol=1e-6)
  assert (ours < want.numpy()[0]).any() and ours[0] == want.numpy()[0]  # some divided


def test_bf16_tracks_hf(saved):
  hf, path = saved
  assert_bf16_tracks_hf(hf, llama4.from_pretrained(path, dtype=jnp.bfloat16))


def test_tensor_parallel_splits_the_experts(saved):
  _, path = saved
  model = llama4.from_pretrained(path)
  experts, width = model.layers[1].mlp, model.config.expert_width
  splits = dict((id(proj), split) for proj, split in model.tensor_parallel_splits())
  assert splits[id(experts.gate_up)] == tensor_parallel.Split("column", (width, width))
  assert splits[id(experts.down)] == tensor_parallel.ROW
  assert splits[id(experts.shared.down)] == tensor_parallel.ROW
  assert splits[id(model.layers[0].mlp.down)] == tensor_parallel.ROW


def test_cli_finds_the_model_type(saved, capsys):
  hf, path = saved
  assert_installed_cli_gives_hfs_tokens(hf, path, capsys, seed=15)


@pytest.mark.gpu
def test_triton_kernels_give_the_references_and_hfs_tokens_on_gpu(tmp_path):
  """f32 on a GPU at head dim 64: the decode and prefill kernels' chunk masks, the grouped
  expert matmuls and the fused GEMMs give the reference path's and HF's tokens."""
  hf = _hf_model(hidden_size=128, head_dim=64)
  hf.save_pretrained(tmp_path)
  assert_kernels_give_references_and_hfs_tokens(
      hf, lambda **kw: llama4.from_pretrained(tmp_path, **kw))
