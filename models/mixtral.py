"""Mixtral in Flax NNX, decoding from a paged KV cache (`jax_paged.KVPool`).

Hugging Face's `MixtralForCausalLM` (`model_type` "mixtral": Mixtral 8x7B, 8x22B) is
Mistral's decoder (`models.llama`) whose MLP is a sparse mixture of SwiGLU experts: a
router scores the num_local_experts experts for each token (softmax in f32), the
num_experts_per_tok best run on it, and its output is their sum weighted by those scores
renormalised over the chosen ones.

The experts run as two grouped matmuls (`jax.lax.ragged_dot`) over the token-expert
pairs sorted by expert, so each expert's weights are read once per step whatever the
batch. They are kept whole on every device under tensor parallelism (the attention is
split), stay in the compute dtype under `weight_quant.quantize_weights` (only
`nnx.Linear`s are quantized), and are not LoRA targets (the attention's projections are).
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
from jax_paged.paged_model import ModelFamily
from models import llama

MODEL_TYPES = ("mixtral",)


@dataclasses.dataclass(frozen=True)
class MixtralConfig(llama.LlamaConfig):
  """Mixtral hyperparameters under Hugging Face's field names and defaults (MixtralConfig's:
  Mixtral 8x7B): `llama.LlamaConfig`'s, with intermediate_size each expert's width."""

  intermediate_size: int = 14336
  num_key_value_heads: int | None = 8
  max_position_embeddings: int = 4096 * 32
  rms_norm_eps: float = 1e-5
  rope_theta: float = 1e6
  num_local_experts: int = 8
  num_experts_per_tok: int = 2
  model_type: str = "mixtral"

  model_types: ClassVar[tuple[str, ...]] = MODEL_TYPES

  def __post_init__(self):
    super().__post_init__()
    for name in ("num_local_experts", "num_experts_per_tok"):
      value = getattr(self, name)
      if not (isinstance(value, int) and value > 0):
        raise ValueError(f"{name} must be a positive int, got {value!r}")
    if self.num_experts_per_tok > self.num_local_experts:
      raise ValueError(f"num_experts_per_tok ({self.num_experts_per_tok}) must be <= "
                       f"num_local_experts ({self.num_local_experts})")


class SparseMoE(nnx.Module):
  """Top-k routed SwiGLU experts (HF's MixtralSparseMoeBlock).

  Parameters: `router` [hidden, experts]; `gate_up` [experts, hidden, 2 *
  intermediate] (each expert's gate columns, then up's); `down` [experts, intermediate,
  hidden]; in `param_dtype`, computed in `dtype`.
  """

  def __init__(self, config: MixtralConfig, *, dtype, param_dtype, rngs: nnx.Rngs):
    e, d, f = config.num_local_experts, config.hidden_size, config.intermediate_size
    init = nnx.initializers.normal(config.initializer_range)
    self.router = nnx.Param(init(rngs.params(), (d, e), param_dtype))
    self.gate_up = nnx.Param(init(rngs.params(), (e, d, 2 * f), param_dtype))
    self.down = nnx.Param(init(rngs.params(), (e, f, d), param_dtype))
    self.top_k = config.num_experts_per_tok
    self.activation = config.activation
    self.dtype = dtype

  def __call__(self, h: jax.Array) -> jax.Array:
    """h [..., hidden] -> float32 [..., hidden], the weighted sum of each token's experts'
    outputs (every row routed, padding too: its output is ignored downstream)."""
    lead, d = h.shape[:-1], h.shape[-1]
    dtype = self.dtype or h.dtype
    x = h.reshape(-1, d).astype(dtype)
    num_experts = self.gate_up.shape[0]
    # HF: the router's logits in the compute dtype, their softmax in f32.
    scores = jax.nn.softmax((x @ self.router[...].astype(dtype)).astype(jnp.float32), axis=-1)
    weights, experts = lax.top_k(scores, self.top_k)  # [tokens, k]
    weights = weights / jnp.sum(weights, axis=-1, keepdims=True)
    # The token-expert pairs grouped by expert, for the grouped matmuls.
    order = jnp.argsort(experts.reshape(-1), stable=True)
    rows = order // self.top_k  # each sorted pair's token
    sizes = jnp.bincount(experts.reshape(-1), length=num_experts).astype(jnp.int32)
    gate_up = lax.ragged_dot(x[rows], self.gate_up[...].astype(dtype), sizes,
                             preferred_element_type=jnp.float32)
    gate, up = jnp.split(gate_up, 2, axis=-1)
    y = lax.ragged_dot((self.activation(gate) * up).astype(dtype),
                       self.down[...].astype(dtype), sizes,
                       preferred_element_type=jnp.float32)
    y = y.astype(dtype).astype(jnp.float32) * weights.reshape(-1)[order][:, None]
    out = jnp.zeros((x.shape[0], d), jnp.float32).at[rows].add(y)
    return out.reshape(lead + (d,))


class DecoderLayer(llama.DecoderLayer):
  """Mistral's block with `SparseMoE` for its MLP."""

  mlp_class = SparseMoE

  def _mlp_add_norm(self, x: jax.Array, h: jax.Array, next_norm: paged_nn.RMSNorm,
                    adapters: jax.Array | None) -> tuple[jax.Array, jax.Array]:
    """(x + experts(h), its next_norm): the residual add and the norm in one kernel."""
    del adapters  # the experts are not LoRA targets
    return next_norm.add(x, self.mlp(h)[None], None, None)


class MixtralForCausalLM(llama.LlamaForCausalLM):
  """Mixtral with an LM head: `LlamaForCausalLM` over Mixtral's blocks (its Args)."""

  decoder_layer = DecoderLayer


def hf_sources(path: tuple[str, ...], config: MixtralConfig
               ) -> tuple[list[str], Callable[[list[jax.Array]], jax.Array]]:
  """`llama.Sources` of Mixtral: the experts' HF tensors (block_sparse_moe.gate and each
  expert's w1 (gate), w3 (up), w2 (down) torch Linear weights) stacked by expert, the
  rest as `llama.hf_sources`."""
  if path[2:3] != ("mlp",):
    return llama.hf_sources(path, config)
  prefix = f"model.layers.{path[1]}.block_sparse_moe."
  experts = range(config.num_local_experts)
  if path[3] == "router":
    return [f"{prefix}gate.weight"], llama.linear_rows
  if path[3] == "gate_up":
    names = [f"{prefix}experts.{e}.{w}.weight" for e in experts for w in ("w1", "w3")]
    return names, lambda parts: jnp.stack([llama.linear_rows(parts[2 * e:2 * e + 2])
                                           for e in experts])
  names = [f"{prefix}experts.{e}.w2.weight" for e in experts]
  return names, lambda parts: jnp.stack([p.T for p in parts])


def from_pretrained(path, *, dtype=jnp.float32, param_dtype=None,
                    decode_impl: paged_nn.DecodeImpl = "auto") -> MixtralForCausalLM:
  """Loads a Hugging Face Mixtral checkpoint directory (`models.llama`'s
  `load_pretrained`: its files, errors and eos ids).

  Args:
    path: as `models.llama.load_pretrained`'s.
    dtype, param_dtype, decode_impl: as for `models.llama.LlamaForCausalLM`.
  """
  return llama.load_pretrained(path, MixtralConfig.from_dict, functools.partial(
      MixtralForCausalLM, dtype=dtype, param_dtype=param_dtype, decode_impl=decode_impl),
      hf_sources)


FAMILY = ModelFamily(
    name="mixtral",
    model_types=MODEL_TYPES,
    from_pretrained=lambda path, dtype: from_pretrained(path, dtype=dtype),
    presets={},
)
