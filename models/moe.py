"""Mixture-of-experts decoders in Flax NNX, decoding from a paged KV cache
(`jax_paged.KVPool`): Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE and Granite-MoE.

Hugging Face's `MixtralForCausalLM` (`model_type` "mixtral": Mixtral 8x7B, 8x22B) is
Mistral's decoder (`models.llama`), `Qwen2MoeForCausalLM` ("qwen2_moe": Qwen1.5-MoE-A2.7B,
Qwen2-57B-A14B) Qwen2's (q/k/v biases), `Qwen3MoeForCausalLM` ("qwen3_moe":
Qwen3-30B-A3B, Qwen3-235B-A22B) Qwen3's (per-head q / k norms), `OlmoeForCausalLM`
("olmoe": OLMoE-1B-7B) Llama's with q and k each RMS-normalised over all heads together
(`nn.PagedAttention(qk_norm_all_heads=True)`; no tensor parallelism) and
`GraniteMoeForCausalLM` ("granitemoe": Granite-3.x-1B-A400M / 3B-A800M) Granite's (its
four multipliers, `llama.LlamaConfig`; every expert's weights in one tensor; with
`GraniteMoeSharedForCausalLM`, "granitemoeshared", an ungated shared expert of
shared_intermediate_size beside them; `GraniteMoeSWAForCausalLM`, "granitemoe_swa", that
with Granite SWA's attention: `models.llama`), whose MLP
is a sparse mixture of SwiGLU experts (the Qwens': on the layers decoder_sparse_step and
mlp_only_layers leave it, a dense MLP on the others): a router scores the experts for
each token (softmax in f32), the num_experts_per_tok best run on it, and its output is
their sum weighted by those scores (renormalised over the chosen ones: always for
Mixtral and Granite-MoE, with norm_topk_prob for the Qwens and OLMoE), plus for Qwen2-MoE
a shared expert's output gated by sigmoid(shared_expert_gate(x)).

The experts run as two grouped matmuls over the token-expert pairs sorted by expert
(`jax_paged.kernels.grouped_matmul`: on a GPU a Pallas-Triton kernel that reads only the
experts some token chose, once per step whatever the batch; `lax.ragged_dot` elsewhere,
which on a GPU reads every expert's: benchmarks/RESULTS.md), each a
`jax_paged.nn.GroupedLinear`. Under tensor parallelism they are split like a dense MLP:
every device holds its share of every expert's intermediate columns (gate_up by column,
down by row, one all-reduce of the combined output per layer);
`weight_quant.quantize_weights` makes them int8 with a scale per expert and output column
(`GroupedLinear.quantize_int8`). They are not LoRA targets (the attention's and dense
MLPs' projections are).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Callable, ClassVar

import jax
from jax import lax
import jax.numpy as jnp
from flax import nnx

from jax_paged import nn as paged_nn
from jax_paged import tensor_parallel
from jax_paged.kernels import validation
from models import llama

MODEL_TYPES = ("mixtral", "qwen2_moe", "qwen3_moe", "olmoe", "granitemoe", "granitemoeshared",
               "granitemoe_swa")
# Granite-MoEs with a shared_mlp of shared_intermediate_size (0: none).
_GRANITE_SHARED = ("granitemoeshared", "granitemoe_swa")


@dataclasses.dataclass(frozen=True)
class MoeConfig(llama.LlamaConfig):
  """Mixtral / Qwen2-MoE / Qwen3-MoE hyperparameters under Hugging Face's field names
  (`llama.LlamaConfig`'s and the experts'; defaults: Mixtral 8x7B's, HF's MixtralConfig).

  Attributes beyond LlamaConfig's:
    num_local_experts: experts per sparse layer (Qwen3-MoE's num_experts).
    num_experts_per_tok: experts run per token.
    moe_intermediate_size: each expert's width; None: intermediate_size (Mixtral's).
    norm_topk_prob: whether the chosen experts' scores are renormalised to sum to 1.
    shared_expert_intermediate_size: the width of a shared expert every token runs
      (Qwen2-MoE's, gated: `shared_expert_gated`; Granite-MoE-Shared's), or None: none.
    decoder_sparse_step, mlp_only_layers: layer i is sparse unless i is in
      mlp_only_layers or (i + 1) % decoder_sparse_step != 0 (Qwen3-MoE's), dense (an
      MLP of intermediate_size) otherwise.
  """

  intermediate_size: int = 14336
  num_key_value_heads: int | None = 8
  max_position_embeddings: int = 4096 * 32
  rms_norm_eps: float = 1e-5
  rope_theta: float = 1e6
  num_local_experts: int = 8
  num_experts_per_tok: int = 2
  moe_intermediate_size: int | None = None
  norm_topk_prob: bool = True
  shared_expert_intermediate_size: int | None = None
  decoder_sparse_step: int = 1
  mlp_only_layers: tuple[int, ...] = ()
  model_type: str = "mixtral"

  model_types: ClassVar[tuple[str, ...]] = MODEL_TYPES

  def __post_init__(self):
    object.__setattr__(self, "mlp_only_layers", tuple(self.mlp_only_layers))
    super().__post_init__()
    for name in ("num_local_experts", "num_experts_per_tok", "decoder_sparse_step",
                 "expert_width"):
      validation.check_positive_int(name, getattr(self, name))
    validation.check_positive_int("shared_expert_intermediate_size",
                                  self.shared_expert_intermediate_size, optional=True)
    if self.num_experts_per_tok > self.num_local_experts:
      raise ValueError(f"num_experts_per_tok ({self.num_experts_per_tok}) must be <= "
                       f"num_local_experts ({self.num_local_experts})")

  @property
  def shared_expert_gated(self) -> bool:
    """Whether a shared expert's output is scaled by a sigmoid gate (Qwen2-MoE's)."""
    return self.model_type == "qwen2_moe"

  @property
  def expert_width(self) -> int:
    """Each expert's intermediate width."""
    return self.intermediate_size if self.moe_intermediate_size is None else (
        self.moe_intermediate_size)

  def sparse(self, layer: int) -> bool:
    """Whether layer `layer`'s MLP is the experts (else a dense `llama.MLP`)."""
    return (layer not in self.mlp_only_layers
            and (layer + 1) % self.decoder_sparse_step == 0)

  @classmethod
  def from_dict(cls, config: dict) -> "MoeConfig":
    """`llama.LlamaConfig.from_dict`, with the Qwens' and OLMoE's num_experts read as
    num_local_experts and norm_topk_prob defaulting to HF's False (Mixtral always
    renormalises); OLMoE's clip_qkv refused unless null; Qwen2-MoE's q/k/v biases from
    qkv_bias (transformers 5; always in 4), its shared expert (HF's default width 5632)
    and, without layer_types, its windows as transformers 5 places them (with
    use_sliding_window: even layers below max_window_layers)."""
    config = dict(config)
    model_type = config.get("model_type")
    if model_type == "olmoe" and config.get("clip_qkv") is not None:
      raise ValueError(f"clip_qkv {config['clip_qkv']!r} is not supported (OLMoE's q/k/v "
                       "clamp); only null")
    if model_type in ("qwen2_moe", "qwen3_moe", "olmoe"):
      if "num_experts" in config:  # transformers 4's name (and 5's for Qwen2-MoE, OLMoE)
        config.setdefault("num_local_experts", config["num_experts"])
      config.setdefault("norm_topk_prob", False)
    else:
      for name in ("norm_topk_prob", "moe_intermediate_size", "decoder_sparse_step",
                   "mlp_only_layers"):
        config.pop(name, None)
    if model_type == "qwen2_moe":
      config["attention_bias"] = config.get("qkv_bias", True)
      config.setdefault("shared_expert_intermediate_size", 5632)
      if config.get("layer_types") is None and config.get("use_sliding_window", False):
        below = config.get("max_window_layers", 28)
        config["layer_types"] = ["sliding_attention" if i % 2 == 0 and i < below
                                 else "full_attention"
                                 for i in range(config.get("num_hidden_layers", 24))]
    elif model_type in _GRANITE_SHARED:  # (HF's 0: none)
      config["shared_expert_intermediate_size"] = config.get("shared_intermediate_size") or None
    else:
      config.pop("shared_expert_intermediate_size", None)
    return super().from_dict(config)


class SparseMoE(nnx.Module):
  """Top-k routed SwiGLU experts (HF's MixtralSparseMoeBlock, Qwen2MoeSparseMoeBlock,
  Qwen3MoeSparseMoeBlock, OlmoeSparseMoeBlock).

  Parameters: `router` [hidden, experts]; `gate_up`, a `jax_paged.nn.GroupedLinear`
  [experts, hidden, 2 * intermediate] (each expert's gate columns, then up's); `down`, one
  [experts, intermediate, hidden]; with a shared expert, `shared` (a `llama.MLP`) and, if
  the config's `shared_expert_gated`, `shared_gate` [hidden, 1]; in `param_dtype`,
  computed in `dtype`.
  Under tensor parallelism gate_up is column-parallel (gate and up each split) and down
  row-parallel: each device holds every expert's share of the intermediate columns
  (`MoeForCausalLM.tensor_parallel_splits`).
  """

  # Whether the router and the experts' projections have biases (GPT-OSS's: `router_bias`,
  # `gate_up.bias`, `down.bias`).
  biases: ClassVar[bool] = False
  # Whether a token's routing weight scales its input to the expert rather than the
  # expert's output (Llama 4's).
  weights_scale_input: ClassVar[bool] = False

  def __init__(self, config: MoeConfig, *, dtype, param_dtype, rngs: nnx.Rngs):
    e, d, f = config.num_local_experts, config.hidden_size, config.expert_width
    init = nnx.initializers.normal(config.initializer_range)
    self.router = nnx.Param(init(rngs.params(), (d, e), param_dtype))
    self.router_bias = nnx.Param(jnp.zeros((e,), param_dtype)) if self.biases else None
    grouped = functools.partial(paged_nn.GroupedLinear, e, use_bias=self.biases,
                                kernel_init=init, dtype=dtype, param_dtype=param_dtype,
                                rngs=rngs)
    self.gate_up = grouped(d, 2 * f)
    self.down = grouped(f, d)
    shared = config.shared_expert_intermediate_size
    self.shared = None if shared is None else llama.MLP(
        dataclasses.replace(config, intermediate_size=shared), dtype=dtype,
        param_dtype=param_dtype, rngs=rngs)
    self.shared_gate = None if shared is None or not config.shared_expert_gated else nnx.Param(
        init(rngs.params(), (d, 1), param_dtype))
    self.top_k = config.num_experts_per_tok
    self.normalize = config.norm_topk_prob
    self.activation = config.activation
    self.dtype = dtype

  def __call__(self, h: jax.Array, *, interpret: bool | None = None) -> jax.Array:
    """h [..., hidden] -> float32 [..., hidden], the weighted sum of each token's experts'
    outputs (every row routed, padding too: its output is ignored downstream). The grouped
    matmuls run `grouped_matmul`'s kernel on a GPU (only the experts hit are read), XLA's
    `lax.ragged_dot` elsewhere; `interpret` True runs the kernel in interpret mode."""
    lead, d = h.shape[:-1], h.shape[-1]
    dtype = self.dtype or h.dtype
    x = h.reshape(-1, d).astype(dtype)
    num_experts = self.router.shape[1]
    weights, experts = self.route(x)
    # The token-expert pairs grouped by expert, for the grouped matmuls.
    order = jnp.argsort(experts.reshape(-1), stable=True)
    rows = order // self.top_k  # each sorted pair's token
    # Counted as one compare-and-sum (bincount's scatter-add copies a zeroed buffer first:
    # two more small kernels per layer on a GPU).
    sizes = jnp.sum(experts.reshape(-1, 1) == jnp.arange(num_experts), axis=0, dtype=jnp.int32)
    pair_weights = weights.reshape(-1)[order][:, None]
    inputs = x[rows]
    if self.weights_scale_input:
      inputs = inputs * pair_weights.astype(dtype)
    gate, up = jnp.split(self.gate_up(inputs, sizes, interpret=interpret), 2, axis=-1)
    y = self.down(self.glu(gate, up).astype(dtype), sizes, interpret=interpret)
    y = y.astype(dtype).astype(jnp.float32)
    if not self.weights_scale_input:
      y = y * pair_weights
    out = jnp.zeros((x.shape[0], d), jnp.float32).at[rows].add(y)
    if self.down.reduce_axis is not None:  # tensor parallel: each device's intermediate
      # columns' share, summed once per layer in the compute dtype (as nn's projections)
      out = lax.psum(out.astype(dtype), self.down.reduce_axis).astype(jnp.float32)
      if self.down.bias is not None:  # (left out of the partial sums: added once)
        bias = self.down.bias[...].astype(jnp.float32)[experts]  # [tokens, top_k, hidden]
        out += jnp.sum(weights[..., None] * bias, axis=1)
    if self.shared is not None:
      hidden = self.shared.hidden(x)
      # Row-parallel under tensor parallelism (summed over the devices), else the linear
      # kernel at decode's few rows: XLA runs a one-row product as a multiply and a
      # reduction (DeepSeek-V2-Lite's shared down at batch 1: 21 µs per layer, H200).
      shared = (paged_nn.projection(self.shared.down, hidden)
                if self.down.reduce_axis is not None
                else paged_nn.dense(self.shared.down, hidden))
      if self.shared_gate is not None:
        shared = jax.nn.sigmoid(x @ self.shared_gate[...].astype(dtype)) * shared
      out += shared.astype(jnp.float32)
    return out.reshape(lead + (d,))

  def glu(self, gate: jax.Array, up: jax.Array) -> jax.Array:
    """The gated unit of an expert's gate and up projections (float32 [rows, width]):
    activation(gate) * up (a subclass's own: GPT-OSS's clamped one)."""
    return self.activation(gate) * up

  def route(self, x: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Tokens x [tokens, hidden] in the compute dtype -> (float32 weights, int32 experts),
    each [tokens, top_k]: the softmax of the router's logits (computed in x's dtype, as
    HF's), its top k, renormalised with norm_topk_prob."""
    scores = jax.nn.softmax((x @ self.router[...].astype(x.dtype)).astype(jnp.float32),
                            axis=-1)
    weights, experts = lax.top_k(scores, self.top_k)
    if self.normalize:
      weights = weights / jnp.sum(weights, axis=-1, keepdims=True)
    return weights, experts


class DecoderLayer(llama.DecoderLayer):
  """Mistral's or Qwen3's block with `SparseMoE` for its MLP where the config's
  `sparse(layer)` says so."""

  def _make_mlp(self, config: MoeConfig, layer: int, **kwargs) -> nnx.Module:
    if config.sparse(layer):
      return SparseMoE(config, **kwargs)
    return super()._make_mlp(config, layer, **kwargs)

  def _mlp_add_norm(self, x: jax.Array, h: jax.Array, next_norm: paged_nn.RMSNorm,
                    adapters: jax.Array | None) -> tuple[jax.Array, jax.Array]:
    """(x + mlp(h), its next_norm): for the experts, the residual add and the norm in one
    kernel after them."""
    if isinstance(self.mlp, llama.MLP):
      return super()._mlp_add_norm(x, h, next_norm, adapters)
    return next_norm.add(x, self._scaled(self.mlp(h))[None], None, None)  # (no LoRA)


class MoeForCausalLM(llama.LlamaForCausalLM):
  """Mixtral / Qwen3-MoE with an LM head: `LlamaForCausalLM` over these blocks (its
  Args)."""

  decoder_layer = DecoderLayer

  def tensor_parallel_splits(self) -> list[tuple[nnx.Module, tensor_parallel.Split]]:
    """The dense MLPs' splits (`LlamaForCausalLM`'s), and the experts': gate_up
    column-parallel with gate and up each split, down row-parallel (every expert alike),
    and a shared expert's like a dense MLP's."""
    splits = super().tensor_parallel_splits()
    for layer in self.layers:
      mlp = layer.mlp
      if isinstance(mlp, SparseMoE):
        width = mlp.down.in_features
        splits += [(mlp.gate_up, tensor_parallel.Split("column", (width, width))),
                   (mlp.down, tensor_parallel.ROW)]
        if mlp.shared is not None:
          splits += llama.mlp_splits(mlp.shared)
    return splits


# model_type -> (the sparse block's HF module, the router's, each expert's gate, up and
# down projections, or None: every expert's in one tensor, `_FUSED_EXPERTS`')
QWEN_EXPERTS = ("mlp", "gate", ("gate_proj", "up_proj", "down_proj"))
MIXTRAL_EXPERTS = ("block_sparse_moe", "gate", ("w1", "w3", "w2"))
_HF_EXPERTS = {"mixtral": MIXTRAL_EXPERTS,
               "qwen2_moe": QWEN_EXPERTS, "qwen3_moe": QWEN_EXPERTS, "olmoe": QWEN_EXPERTS,
               "granitemoe": ("block_sparse_moe", "router.layer", None),
               "granitemoeshared": ("block_sparse_moe", "router.layer", None),
               "granitemoe_swa": ("block_sparse_moe", "router", None)}
# Every expert's weights in one tensor, [E, 2 I, H] (gate's rows, then up's) and [E, H, I]
# (torch Linear weights stacked): Granite-MoE's input_linear / output_linear,
# transformers 5's experts.gate_up_proj / down_proj (Granite-MoE-SWA's checkpoints).
_GRANITE_FUSED = {"gate_up": "input_linear.weight", "down": "output_linear.weight"}
_FUSED_EXPERTS = {"granitemoe": _GRANITE_FUSED, "granitemoeshared": _GRANITE_FUSED,
                  "granitemoe_swa": {"gate_up": "experts.gate_up_proj",
                                     "down": "experts.down_proj"}}


def hf_sources(path: tuple[str, ...], config: MoeConfig,
               experts_names: tuple[str, str, tuple[str, str, str] | None] | None = None,
               *, shared_name: str = "shared_expert"
               ) -> tuple[list[str], Callable[[list[jax.Array]], jax.Array]]:
  """`llama.Sources` of these models: the experts' HF tensors (the router's and each
  expert's gate, up and down torch Linear weights, `_HF_EXPERTS` of the model type, or
  `experts_names` of that form) stacked by expert, the rest (a dense layer's MLP, a
  shared expert as the MLP `shared_name`: Qwen2-MoE's shared_expert) as
  `llama.hf_sources`."""
  if path[2:4] == ("mlp", "shared") and config.model_type in _GRANITE_SHARED:
    # (the block's shared_mlp, gate and up fused in input_linear, no biases)
    return [f"model.layers.{path[1]}.shared_mlp.{_GRANITE_FUSED[path[4]]}"], (
        llama.linear_rows)
  if path[2:4] == ("mlp", "shared"):  # ("layers", i, "mlp", "shared", module, param)
    names, assemble = llama.hf_sources(path[:3] + path[4:], config)  # a dense MLP's
    return [n.replace(".mlp.", f".mlp.{shared_name}.") for n in names], assemble
  if path[2:3] != ("mlp",) or not config.sparse(int(path[1])):  # not a SparseMoE's
    return llama.hf_sources(path, config)
  block, router, per_expert = experts_names or _HF_EXPERTS[config.model_type]
  prefix = f"model.layers.{path[1]}.{block}."
  experts = range(config.num_local_experts)
  if path[3] == "router":
    return [f"{prefix}{router}.weight"], llama.linear_rows
  if path[3] == "shared_gate":
    return [f"{prefix}shared_expert_gate.weight"], llama.linear_rows
  if per_expert is None:  # every expert's in one tensor
    return ([f"{prefix}{_FUSED_EXPERTS[config.model_type][path[3]]}"],
            lambda parts: jnp.swapaxes(parts[0], 1, 2))
  gate, up, down = per_expert
  if path[3] == "gate_up":
    names = [f"{prefix}experts.{e}.{w}.weight" for e in experts for w in (gate, up)]
    return names, lambda parts: jnp.stack([llama.linear_rows(parts[2 * e:2 * e + 2])
                                           for e in experts])
  names = [f"{prefix}experts.{e}.{down}.weight" for e in experts]
  return names, lambda parts: jnp.stack([p.T for p in parts])


from_pretrained = llama.loader(MoeConfig, MoeForCausalLM, hf_sources)

FAMILY = llama.family("moe", MODEL_TYPES, from_pretrained)
