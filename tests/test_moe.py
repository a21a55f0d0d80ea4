"""Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE and Granite-MoE on the paged pool against Hugging
Face transformers' models (CPU, f32), loaded from their `save_pretrained` directories.

The HF models are random (norms too); 4 experts, 2 per token, so that tokens of one batch
take different experts. Tolerance as test_llama's: 1e-4 on the logits.
"""

import functools
import json

import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers
from flax import nnx

import jax_paged
from jax_paged import tensor_parallel
from jax_paged import weight_quant
from models import llama
from models import moe
from tests.test_llama import (VOCAB, assert_bf16_tracks_hf,
                              assert_generate_and_engines_give_hfs_tokens,
                              assert_installed_cli_gives_hfs_tokens,
                              assert_kernels_give_references_and_hfs_tokens, assert_logits_track_hf)

# GQA 8 q heads over 2 kv heads; 4 experts, 2 per token.
CONFIG = dict(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=8,
              num_key_value_heads=2, num_experts_per_tok=2, max_position_embeddings=64,
              rope_theta=1000.0, initializer_range=0.1, bos_token_id=None,
              eos_token_id=None, attn_implementation="eager")
# model_type -> (HF model class, HF config class, the family's CONFIG fields): Mixtral's
# experts 48 wide, renormalised; Qwen3-MoE's 24 wide, not renormalised (norm_topk_prob
# False), layer 1 a dense MLP 40 wide (mlp_only_layers), q / k norms, biases on q/k/v/o.
VARIANTS = {
    "mixtral": (transformers.MixtralForCausalLM, transformers.MixtralConfig, dict(
        intermediate_size=48, num_local_experts=4)),
    # Qwen2-MoE: 24-wide experts renormalised, a shared expert 36 wide, q/k/v biases,
    # layer 0 windowed to 5 positions (HF's use_sliding_window below max_window_layers).
    "qwen2_moe": (transformers.Qwen2MoeForCausalLM, transformers.Qwen2MoeConfig, dict(
        intermediate_size=40, moe_intermediate_size=24, shared_expert_intermediate_size=36,
        num_experts=4, norm_topk_prob=True, use_sliding_window=True, sliding_window=5,
        max_window_layers=1)),
    "qwen3_moe": (transformers.Qwen3MoeForCausalLM, transformers.Qwen3MoeConfig, dict(
        intermediate_size=40, moe_intermediate_size=24, num_experts=4, head_dim=16,
        norm_topk_prob=False, mlp_only_layers=[1], attention_bias=True)),
    # OLMoE: 32-wide experts not renormalised, q and k each normalised over all heads.
    "olmoe": (transformers.OlmoeForCausalLM, transformers.OlmoeConfig, dict(
        intermediate_size=32, num_experts=4, norm_topk_prob=False)),
    # Granite-MoE: 32-wide experts in two tensors, its four multipliers (none 1).
    "granitemoe": (transformers.GraniteMoeForCausalLM, transformers.GraniteMoeConfig, dict(
        intermediate_size=32, num_local_experts=4, embedding_multiplier=6.0,
        residual_multiplier=0.3, attention_multiplier=0.2, logits_scaling=4.0)),
    # Granite-MoE-Shared: Granite-MoE's with an ungated shared expert 48 wide.
    "granitemoeshared": (transformers.GraniteMoeSharedForCausalLM,
                         transformers.GraniteMoeSharedConfig, dict(
        intermediate_size=32, num_local_experts=4, shared_intermediate_size=48,
        embedding_multiplier=6.0, residual_multiplier=0.3, attention_multiplier=0.2,
        logits_scaling=4.0)),
    # Granite-MoE-SWA: that with layer 1 windowed to 5 positions (HF's layer_types: every
    # fourth full from layer 0) and a NoPE layer (layer_rope_theta 0), attention sinks.
    "granitemoe_swa": (transformers.GraniteMoeSWAForCausalLM,
                       transformers.GraniteMoeSWAConfig, dict(
        intermediate_size=32, num_local_experts=4, shared_intermediate_size=48,
        embedding_multiplier=6.0, residual_multiplier=0.3, attention_multiplier=0.2,
        logits_scaling=4.0, sliding_window=5, layer_rope_theta=[10000.0, 0])),
}


def _hf_model(model_type: str, **overrides):
  model_class, config_class, fields = VARIANTS[model_type]
  torch.manual_seed(0)
  hf = model_class(config_class(**{**CONFIG, **fields, **overrides})).eval()
  with torch.no_grad():
    for name, p in hf.named_parameters():
      if "norm" in name:
        p.uniform_(0.5, 1.5)
      elif name.endswith("bias"):
        p.normal_(0.0, 0.5)
  return hf


@pytest.fixture(scope="module", params=list(VARIANTS))
def saved(request, tmp_path_factory):
  """(HF model, its save_pretrained directory) of each model type."""
  hf = _hf_model(request.param)
  path = tmp_path_factory.mktemp(request.param)
  hf.save_pretrained(path)
  return hf, path


def test_prefill_and_decode_logits_match_hf(saved):
  """Logits over a prefill and decode steps; the batch's tokens use every expert."""
  hf, path = saved
  model = moe.from_pretrained(path)
  assert isinstance(model, jax_paged.PagedModel)
  if model.config.model_type == "qwen3_moe":  # layer 1 dense, q / k norms
    assert isinstance(model.layers[1].mlp, llama.MLP)
    assert model.layers[0].self_attn.q_norm is not None
  seqs = assert_logits_track_hf(hf, model, [3, 8, 13], 7)  # to lengths 10, 15, 20
  layer = hf.model.layers[0]
  router = (layer.block_sparse_moe.router if hasattr(layer, "block_sparse_moe")
            else layer.mlp.gate)
  with torch.no_grad():
    _, _, chosen = router(hf.model.embed_tokens(torch.tensor(seqs[2])))
  assert set(chosen.flatten().tolist()) == set(range(4))


def test_generate_and_engine_give_hfs_tokens(saved):
  """generate; for Mixtral and Qwen2-MoE an engine whose prompts share a cached prefix and
  whose long prompt is prefilled in chunks, and one preempting in a tiny pool: HF's greedy
  tokens."""
  hf, path = saved
  model = moe.from_pretrained(path)
  # The engine's paths are the model's prefill and decode, which generate runs: the
  # engines run for Mixtral and for Qwen2-MoE (windows, a shared expert) only.
  assert_generate_and_engines_give_hfs_tokens(
      hf, model, engines=model.config.model_type in ("mixtral", "qwen2_moe"))


def test_config_reads_hf_and_refuses_what_it_lacks(saved):
  _, path = saved
  config = json.loads((path / "config.json").read_text())
  c = moe.MoeConfig.from_dict(config)
  assert (c.num_local_experts, c.num_experts_per_tok, c.rope_theta) == (4, 2, 1000.0)
  if c.model_type == "mixtral":
    assert (c.expert_width, c.norm_topk_prob, c.sparse(1)) == (48, True, True)
  elif c.model_type == "qwen2_moe":
    assert (c.expert_width, c.norm_topk_prob, c.sparse(1)) == (24, True, True)
    assert (c.shared_expert_intermediate_size, c.qkv_bias, c.out_bias) == (36, True, False)
    assert [c.window(i) for i in range(2)] == [5, None]  # HF's: even layers below 1
    # transformers 4: no qkv_bias field (q/k/v biases always), no layer_types.
    v4 = moe.MoeConfig.from_dict({k: v for k, v in config.items()
                                  if k not in ("qkv_bias", "layer_types")})
    assert v4.qkv_bias and [v4.window(i) for i in range(2)] == [5, None]
  elif c.model_type in ("granitemoe", "granitemoeshared", "granitemoe_swa"):
    assert (c.expert_width, c.norm_topk_prob, c.sparse(1)) == (32, True, True)
    assert (c.shared_expert_intermediate_size, c.shared_expert_gated) == (
        None if c.model_type == "granitemoe" else 48, False)
    if c.model_type == "granitemoe_swa":
      assert ([c.window(i) for i in range(2)], c.layer_rope(1), c.attention_sinks) == (
          [None, 5], None, True)
    assert (c.embedding_multiplier, c.residual_multiplier, c.attention_multiplier,
            c.logits_scaling) == (6.0, 0.3, 0.2, 4.0)
  elif c.model_type == "olmoe":
    assert (c.expert_width, c.norm_topk_prob, c.sparse(1)) == (32, False, True)
    assert c.qk_norm and c.qk_norm_all_heads
    with pytest.raises(ValueError, match="clip_qkv 8.0 is not supported"):
      moe.MoeConfig.from_dict({**config, "clip_qkv": 8.0})
  else:
    assert (c.expert_width, c.norm_topk_prob, c.sparse(1)) == (24, False, False)
    assert c.qk_norm and not c.qk_norm_all_heads
  if c.model_type not in ("mixtral", "granitemoe", "granitemoeshared", "granitemoe_swa"):
    # transformers 4's name for the experts' count; HF's default: no renormalisation.
    v4 = {k: v for k, v in config.items() if k not in ("num_local_experts",
                                                        "norm_topk_prob")}
    c = moe.MoeConfig.from_dict({**v4, "num_experts": 4})
    assert (c.num_local_experts, c.norm_topk_prob) == (4, False)
  d = moe.MoeConfig.from_dict({})  # HF's defaults: Mixtral 8x7B
  assert (d.num_local_experts, d.num_experts_per_tok, d.intermediate_size,
          d.num_key_value_heads, d.rms_norm_eps) == (8, 2, 14336, 8, 1e-5)
  for bad, message in (({"num_experts_per_tok": 5}, r"num_experts_per_tok \(5\) must be <="),
                       ({"num_local_experts": 0}, "num_local_experts must be a positive"),
                       ({"model_type": "llama"}, "model_type 'llama' is not supported"),
                       ({"hidden_act": "gelu"}, "hidden_act 'gelu'")):
    with pytest.raises(ValueError, match=message):
      moe.MoeConfig.from_dict({**config, **bad})


def test_missing_or_misshapen_expert_is_named(saved, tmp_path):
  from safetensors.numpy import load_file, save_file
  _, path = saved
  tensors = load_file(path / "model.safetensors")
  up = [k for k in tensors if k.startswith("model.layers.0.") and "shared_mlp" not in k
        and k.endswith(("experts.3.w3.weight", "experts.3.up_proj.weight",
                        "input_linear.weight", "experts.gate_up_proj"))]  # (Granites':
  # every expert's gate and up in one tensor)
  assert len(up) == 1
  whole = tensors[up[0]]
  del tensors[up[0]]
  save_file(tensors, tmp_path / "model.safetensors", metadata={"format": "pt"})
  (tmp_path / "config.json").write_text((path / "config.json").read_text())
  with pytest.raises(ValueError, match=f"weight '{up[0]}' is missing"):
    moe.from_pretrained(tmp_path)
  # An expert's up projection of another width: named, with the shapes.
  tensors[up[0]] = whole[..., :5, :]
  save_file(tensors, tmp_path / "model.safetensors", metadata={"format": "pt"})
  shape = ", ".join(map(str, tensors[up[0]].shape))
  with pytest.raises(ValueError, match=f"{up[0]} \\({shape}\\).*(cannot make|gives shape)"):
    moe.from_pretrained(tmp_path)


def test_bf16_tracks_hf(saved):
  hf, path = saved
  assert_bf16_tracks_hf(hf, moe.from_pretrained(path, dtype=jnp.bfloat16))


def test_experts_under_quantization_lora_and_tensor_parallel(saved):
  """int8 weights quantize the attention, dense MLPs and experts (per expert and column);
  LoRA targets the attention's and dense MLPs' projections; tensor parallelism splits the
  experts like a dense MLP (gate_up by column, gate and up each; down by row)."""
  _, path = saved
  model = moe.from_pretrained(path)
  dense = [i for i, layer in enumerate(model.layers) if isinstance(layer.mlp, llama.MLP)]
  assert dense == ([1] if model.config.model_type == "qwen3_moe" else [])
  shared = [i for i, layer in enumerate(model.layers)
            if not isinstance(layer.mlp, llama.MLP) and layer.mlp.shared is not None]
  assert shared == ([0, 1] if model.config.model_type in ("qwen2_moe", "granitemoeshared",
                                                         "granitemoe_swa") else [])
  assert all((layer.mlp.shared_gate is not None) == (model.config.model_type == "qwen2_moe")
             for i, layer in enumerate(model.layers) if i in shared)
  # qkv and o per layer, gate_up and down per MLP: dense, shared expert or the experts'.
  assert weight_quant.quantize_weights(model) == 2 * 2 + 2 * 2 + 2 * len(shared)
  experts = model.layers[0].mlp.gate_up
  assert experts.kernel[...].dtype == jnp.int8 and experts.transposed
  assert experts.kernel_scale[...].shape == (model.config.num_local_experts,
                                              experts.out_features)
  assert weight_quant.quantize_weights(model) == 0
  attention = {"self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj",
               "self_attn.o_proj"}
  for i in range(2):
    names = {k.split(".", 3)[-1] for k in model.lora_targets() if k.split(".")[2] == str(i)}
    assert names == attention | ({"mlp.gate_proj", "mlp.up_proj", "mlp.down_proj"}
                                 if i in dense else set())
  mlps = [model.layers[i].mlp for i in dense]
  mlps += [mlp for layer in model.layers if isinstance(layer.mlp, moe.SparseMoE)
           for mlp in (layer.mlp, layer.mlp.shared) if mlp is not None]
  splits = model.tensor_parallel_splits()
  assert [proj for proj, _ in splits] == [m for mlp in mlps for m in (mlp.gate_up, mlp.down)]
  width = model.config.expert_width
  assert [split for proj, split in splits if proj is mlps[len(dense)].gate_up] == [
      tensor_parallel.Split("column", (width, width))]


def test_cli_finds_the_model_type(saved, capsys):
  hf, path = saved
  assert_installed_cli_gives_hfs_tokens(hf, path, capsys, seed=6)


def test_experts_match_a_dense_loop():
  """`SparseMoE` against every token's chosen experts run one by one (float64 numpy),
  with and without renormalised scores."""
  for normalize in (True, False):
    _check_experts_against_a_loop(normalize)
  _check_experts_against_a_loop(True, interpret=True)  # the grouped matmul kernel's


def _check_experts_against_a_loop(normalize: bool, interpret: bool | None = None):
  config = moe.MoeConfig(hidden_size=32, intermediate_size=24, num_local_experts=5,
                         num_experts_per_tok=3, num_attention_heads=4,
                         num_key_value_heads=2, initializer_range=0.2,
                         norm_topk_prob=normalize)
  experts = moe.SparseMoE(config, dtype=jnp.float32, param_dtype=jnp.float32,
                          rngs=nnx.Rngs(3))
  x = np.random.default_rng(0).standard_normal((2, 7, 32)).astype(np.float32)
  got = np.asarray(nnx.jit(lambda m, x: m(x, interpret=interpret))(
      experts, jnp.asarray(x))).reshape(-1, 32)
  r, gu, dn = (np.asarray(p[...], np.float64)
               for p in (experts.router, experts.gate_up.kernel, experts.down.kernel))
  silu = lambda v: v / (1 + np.exp(-v))
  used = set()
  for row, out in zip(x.reshape(-1, 32).astype(np.float64), got):
    scores = np.exp(row @ r)
    scores /= scores.sum()
    top = np.argsort(-scores)[:3]
    used.update(top.tolist())
    total = scores[top].sum() if normalize else 1.0
    want = sum(scores[e] / total
               * (silu(row @ gu[e, :, :24]) * (row @ gu[e, :, 24:])) @ dn[e] for e in top)
    np.testing.assert_allclose(out, want, rtol=1e-5, atol=1e-6)
  assert used == set(range(5))


@pytest.mark.gpu
@pytest.mark.parametrize("model_type", list(VARIANTS))
def test_triton_kernels_match_reference_and_hf_on_gpu(model_type, tmp_path):
  """f32 at head dim 64: the attention kernels and the experts' grouped matmul kernel
  give the reference path's and HF's greedy tokens."""
  # (OLMoE's q norm spans hidden_size: its heads of 64 from a wider model, not head_dim.)
  heads = dict(hidden_size=256) if model_type == "olmoe" else dict(head_dim=64)
  hf = _hf_model(model_type, num_attention_heads=4, num_key_value_heads=2, **heads)
  hf.save_pretrained(tmp_path)
  assert_kernels_give_references_and_hfs_tokens(hf, functools.partial(
      moe.from_pretrained, tmp_path))
