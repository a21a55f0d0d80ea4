"""GPT-OSS on the paged pool against Hugging Face transformers' GptOssForCausalLM (CPU,
f32), loaded from its `save_pretrained` directory, and from an MXFP4 checkpoint (the
released models' format) whose values HF's own `convert_moe_packed_tensors` gives.

The HF model is random, its biases, norms and sinks too (sinks in [0, 3], where HF's
initialisation leaves them near 0 and their effect small); 4 experts, 2 per token, a
window of 5 positions on layer 0. The "clamped" variant's swiglu_limit of 0.3 clamps most
gate and up values (HF's 7 clamps none of a random model's). Tolerance as test_llama's:
1e-4 on the logits.
"""

import json
import os

import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers
from safetensors.numpy import load_file, save_file
from transformers.integrations import mxfp4

import jax_paged
from jax_paged import tensor_parallel
from jax_paged import weight_quant
from models import gpt_oss
from tests.test_llama import (VOCAB, assert_bf16_tracks_hf,
                              assert_generate_and_engines_give_hfs_tokens,
                              assert_installed_cli_gives_hfs_tokens,
                              assert_kernels_give_references_and_hfs_tokens,
                              assert_logits_track_hf, randomised)

# GQA 8 q heads of 16 over 2 kv heads; 4 experts 48 wide, 2 per token.
CONFIG = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=48, num_hidden_layers=2,
              num_attention_heads=8, num_key_value_heads=2, head_dim=16, num_local_experts=4,
              num_experts_per_tok=2, sliding_window=5, max_position_embeddings=64,
              initializer_range=0.1, bos_token_id=None, eos_token_id=None,
              attn_implementation="eager")
VARIANTS = {"default": {}, "clamped": dict(swiglu_limit=0.3, swiglu_alpha=1.2)}


def _hf_model(**overrides):
  torch.manual_seed(0)
  hf = randomised(transformers.GptOssForCausalLM(transformers.GptOssConfig(
      **{**CONFIG, **overrides})))
  with torch.no_grad():
    for name, p in hf.named_parameters():
      if name.endswith("sinks"):
        p.uniform_(0.0, 3.0)
  return hf


@pytest.fixture(scope="module", params=list(VARIANTS))
def saved(request, tmp_path_factory):
  """(HF model, its save_pretrained directory)."""
  hf = _hf_model(**VARIANTS[request.param])
  path = tmp_path_factory.mktemp(request.param)
  hf.save_pretrained(path)
  return hf, path


def test_prefill_and_decode_logits_match_hf(saved):
  """Logits over a prefill and decode steps: sinks in the prompt and decode kernels' paths,
  the window on layer 0, YaRN, the biased router's top-k softmax, the experts' biases and
  clamped unit, gate and up deinterleaved."""
  hf, path = saved
  model = gpt_oss.from_pretrained(path)
  assert isinstance(model, jax_paged.PagedModel)
  attn = [layer.self_attn for layer in model.layers]
  assert [a.sliding_window for a in attn] == [5, None]
  np.testing.assert_array_equal(attn[1].sinks[...],
                                hf.model.layers[1].self_attn.sinks.detach().numpy())
  assert_logits_track_hf(hf, model, [3, 8, 13], 7)


def test_generate_and_engine_give_hfs_tokens(saved):
  hf, path = saved
  assert_generate_and_engines_give_hfs_tokens(hf, gpt_oss.from_pretrained(path))


def _mxfp4_pack(w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
  """An expert stack w [E, in, out] (torch's parameter layout) as MXFP4 blocks uint8 [E,
  out, in / 32, 16] and scales uint8 [E, out, in / 32], as the released checkpoints store
  them: per 32 inputs of an output a power of two 2^(s - 127) with the largest |value|
  / 2^s <= 6, each value rounded to the nearest e2m1 code, two codes per byte (the
  even-indexed value in the low nibble)."""
  codes = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0,
                    -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0])
  e, k, n = w.shape
  groups = np.swapaxes(w, 1, 2).reshape(e, n, k // 32, 32).astype(np.float64)
  exp = np.ceil(np.log2(np.maximum(np.abs(groups).max(-1), 1e-30) / 6.0))
  scaled = groups / 2.0 ** exp[..., None]
  idx = np.abs(scaled[..., None] - codes).argmin(-1).astype(np.uint8)
  blocks = idx[..., 0::2] | (idx[..., 1::2] << 4)
  # (C order: safetensors' save_file writes an array's buffer whatever its strides)
  return np.ascontiguousarray(blocks), np.ascontiguousarray(exp + 127, np.uint8)


def test_mxfp4_checkpoint_loads_as_hf_dequantizes(tmp_path):
  """A checkpoint whose experts are MXFP4 (`*_blocks`, `*_scales`; quantization_config
  mxfp4, as the released gpt-oss-20b / 120b ship) gives the logits of HF's model holding
  the values HF's `convert_moe_packed_tensors` dequantizes them to."""
  hf = _hf_model(hidden_size=64, intermediate_size=64)  # (MXFP4 blocks of 32 inputs)
  hf.save_pretrained(tmp_path)
  tensors = load_file(os.path.join(tmp_path, "model.safetensors"))
  with torch.no_grad():
    for layer in range(CONFIG["num_hidden_layers"]):
      experts = hf.model.layers[layer].mlp.experts
      for name in ("gate_up_proj", "down_proj"):
        key = f"model.layers.{layer}.mlp.experts.{name}"
        blocks, scales = _mxfp4_pack(tensors.pop(key))
        tensors[f"{key}_blocks"], tensors[f"{key}_scales"] = blocks, scales
        values = mxfp4.convert_moe_packed_tensors(torch.from_numpy(blocks),
                                                  torch.from_numpy(scales),
                                                  dtype=torch.float32)
        assert (values != 0).float().mean() > 0.5  # (not a degenerate packing)
        getattr(experts, name).copy_(values)
  save_file(tensors, os.path.join(tmp_path, "model.safetensors"))
  config_file = os.path.join(tmp_path, "config.json")
  with open(config_file) as f:
    config = json.load(f)
  config["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": [
      "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens",
      "lm_head"]}
  with open(config_file, "w") as f:
    json.dump(config, f)
  assert_logits_track_hf(hf, gpt_oss.from_pretrained(tmp_path), [4, 11], 3)
  # A block without its scales is named.
  del tensors["model.layers.1.mlp.experts.down_proj_scales"]
  save_file(tensors, os.path.join(tmp_path, "model.safetensors"))
  with pytest.raises(ValueError, match="down_proj_scales"):
    gpt_oss.from_pretrained(tmp_path)


def test_config_reads_hf_and_its_defaults(saved):
  """A saved config; gpt-oss-20b's config.json fields (transformers 4's names); an empty
  one (HF's GptOssConfig defaults: 120b's shape, alternating windows, YaRN)."""
  hf, _ = saved
  c = gpt_oss.GptOssConfig.from_dict(hf.config.to_dict())
  assert (c.layer_types, c.sliding_window, c.swiglu_limit, c.swiglu_alpha, c.head_dim,
          c.num_local_experts, c.num_experts_per_tok, c.attention_sinks, c.out_bias) == (
              ("sliding_attention", "full_attention"), 5, hf.config.swiglu_limit,
              hf.config.swiglu_alpha, 16, 4, 2, True, True)
  twenty = gpt_oss.GptOssConfig.from_dict({
      "model_type": "gpt_oss", "attention_bias": True, "eos_token_id": 200002,
      "experts_per_token": 4, "head_dim": 64, "hidden_act": "silu", "hidden_size": 2880,
      "initial_context_length": 4096, "intermediate_size": 2880,
      "layer_types": ["sliding_attention", "full_attention"] * 12,
      "max_position_embeddings": 131072, "num_attention_heads": 64,
      "num_experts_per_tok": 4, "num_hidden_layers": 24, "num_key_value_heads": 8,
      "num_local_experts": 32, "rms_norm_eps": 1e-05, "rope_scaling": {
          "beta_fast": 32.0, "beta_slow": 1.0, "factor": 32.0,
          "original_max_position_embeddings": 4096, "rope_type": "yarn", "truncate": False},
      "rope_theta": 150000, "sliding_window": 128, "swiglu_limit": 7.0,
      "tie_word_embeddings": False, "vocab_size": 201088})
  assert (twenty.num_hidden_layers, twenty.num_local_experts, twenty.window(0),
          twenty.window(1), twenty.eos_token_id, twenty.rope_theta) == (
              24, 32, 128, None, 200002, 150000)
  rope = twenty.rope
  hf_default = transformers.GptOssConfig()
  d = gpt_oss.GptOssConfig.from_dict({"model_type": "gpt_oss"})
  assert (d.num_hidden_layers, d.num_local_experts, d.vocab_size, d.layer_types,
          d.rope_theta) == (hf_default.num_hidden_layers, hf_default.num_local_experts,
                            hf_default.vocab_size, tuple(hf_default.layer_types),
                            hf_default.rope_parameters["rope_theta"])
  assert dict(d.rope_scaling) == {k: v for k, v in hf_default.rope_parameters.items()
                                  if k != "rope_theta"}
  assert rope.rope_type == "yarn"
  for bad, message in (({"swiglu_limit": 0}, "swiglu_limit must be a positive"),
                       ({"model_type": "llama"}, "model_type 'llama' is not supported")):
    with pytest.raises(ValueError, match=message):
      gpt_oss.GptOssConfig.from_dict(bad)


def test_bf16_tracks_hf(saved):
  hf, path = saved
  assert_bf16_tracks_hf(hf, gpt_oss.from_pretrained(path, dtype=jnp.bfloat16))


def test_int8_weights_and_tensor_parallel_splits(saved):
  """int8 weights quantize the attention and the experts (their biases stay float);
  tensor parallelism splits the experts like a dense MLP, their biases with their
  columns."""
  hf, path = saved
  model = gpt_oss.from_pretrained(path)
  assert weight_quant.quantize_weights(model) == 2 * 2 + 2 * 2
  experts = model.layers[0].mlp
  assert experts.gate_up.kernel[...].dtype == jnp.int8
  assert experts.gate_up.bias[...].dtype == jnp.float32
  width = model.config.expert_width
  assert [split for proj, split in model.tensor_parallel_splits()
          if proj is experts.gate_up] == [tensor_parallel.Split("column", (width, width))]
  prompt = [[5, 17, 3, 99, 41, 8]]
  float_tokens = jax_paged.generate(gpt_oss.from_pretrained(path), prompt, 6, page_size=8)
  assert jax_paged.generate(model, prompt, 6, page_size=8)[0][:2] == float_tokens[0][:2]


def test_cli_finds_the_model_type(saved, capsys):
  hf, path = saved
  assert_installed_cli_gives_hfs_tokens(hf, path, capsys, seed=7)


@pytest.mark.gpu
def test_triton_kernels_give_the_references_and_hfs_tokens_on_gpu(tmp_path):
  """f32 on a GPU at head dim 64: the decode and prefill kernels with sinks and windows,
  the grouped expert matmuls with biases, the fused GEMMs and norms give the reference
  path's and HF's tokens."""
  hf = _hf_model(hidden_size=128, head_dim=64)
  hf.save_pretrained(tmp_path)
  assert_kernels_give_references_and_hfs_tokens(
      hf, lambda **kw: gpt_oss.from_pretrained(tmp_path, **kw))
