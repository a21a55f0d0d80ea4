"""Phi-MoE in Flax NNX, decoding from a paged KV cache (`jax_paged.KVPool`).

Hugging Face's `PhimoeForCausalLM` (`model_type` "phimoe": Microsoft's Phi-3.5-MoE-instruct,
Phi-mini-MoE) is Mixtral's model (`models.moe`: its experts under Mixtral's names, GQA,
a window on every layer with sliding_window) with
* LayerNorms (weights and biases) in place of the RMS norms;
* biases on q, k, v and o with attention_bias, and on the LM head with lm_head_bias
  (`phi.BiasedHead`);
* SparseMixer's routing at inference (`PhimoeMoE.route`): the best expert, weighted by the
  softmax of the router's logits within 2 router_jitter_noise (relative) of it, then the
  best other expert, weighted alike among the rest; top 2 only;
* LongRoPE scaled by the config's short_mscale or long_mscale (the regime the served
  length picks, as the factors: `models.llama.longrope_scaling`) in place of LongRoPE's
  computed attention factor.
HF's PhimoeConfig defaults (Phi-3.5-MoE's shape) for omitted fields.
"""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar

import jax
import jax.numpy as jnp
from flax import nnx

from jax_paged import nn as paged_nn
from jax_paged.kernels import validation
from models import llama
from models import moe
from models import phi

MODEL_TYPES = ("phimoe",)


@dataclasses.dataclass(frozen=True)
class PhimoeConfig(moe.MoeConfig):
  """Phi-MoE hyperparameters under Hugging Face's field names (`moe.MoeConfig`'s; defaults
  HF's PhimoeConfig's).

  Attributes beyond `moe.MoeConfig`'s:
    router_jitter_noise: SparseMixer's relative threshold (2x it) around each pick.
    lm_head_bias: whether the LM head has a bias.
  """

  vocab_size: int = 32064
  intermediate_size: int = 6400
  num_local_experts: int = 16
  router_jitter_noise: float = 0.01
  lm_head_bias: bool = False
  model_type: str = "phimoe"

  model_types: ClassVar[tuple[str, ...]] = MODEL_TYPES

  def __post_init__(self):
    super().__post_init__()
    if self.num_experts_per_tok != 2:
      raise ValueError(f"num_experts_per_tok {self.num_experts_per_tok} is not supported "
                       "(SparseMixer's routing picks 2)")
    validation.check_positive_number("router_jitter_noise", self.router_jitter_noise)

  @property
  def out_bias(self) -> bool:
    return self.attention_bias

  def make_norm(self, param_dtype) -> paged_nn.LayerNorm:
    """A LayerNorm (weight and bias) of rms_norm_eps, HF's."""
    return paged_nn.LayerNorm(self.hidden_size, epsilon=self.rms_norm_eps,
                              param_dtype=param_dtype)

  @property
  def rope(self) -> paged_nn.RotaryEmbedding:
    """`llama.LlamaConfig.rope`, LongRoPE's cos / sin scaled by short_mscale or
    long_mscale (the regime of its factors) where the config gives them."""
    rope = super().rope
    scaling = dict(self.rope_scaling or ())
    if rope.rope_type != "longrope":
      return rope
    original = scaling.get("original_max_position_embeddings", self.max_position_embeddings)
    regime = "long" if self.max_model_len > original else "short"
    mscale = scaling.get(f"{regime}_mscale")
    return rope if mscale is None else dataclasses.replace(rope,
                                                           attention_factor=float(mscale))

  @classmethod
  def from_dict(cls, config: dict[str, Any]) -> "PhimoeConfig":
    """`moe.MoeConfig.from_dict` (omitted fields: the class's defaults, HF's)."""
    return super().from_dict(dict(config))


class PhimoeMoE(moe.SparseMoE):
  """Mixtral's experts (`moe.SparseMoE`) routed by SparseMixer (`route`)."""

  def __init__(self, config: PhimoeConfig, *, dtype, param_dtype, rngs: nnx.Rngs):
    super().__init__(config, dtype=dtype, param_dtype=param_dtype, rngs=rngs)
    self.jitter = config.router_jitter_noise

  def route(self, x: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Tokens x [tokens, hidden] -> (float32 weights, int32 experts) [tokens, 2], HF's
    `sparsemixer` at inference: each pick the best remaining expert by the router's logits
    (computed in x's dtype), weighted by the softmax over the remaining experts within
    (pick - logit) / max(|logit|, pick) <= 2 jitter of it."""
    scores = (x @ self.router[...].astype(x.dtype)).astype(jnp.float32)
    weights, experts = [], []
    remaining = scores
    for _ in range(2):
      best = jnp.max(remaining, axis=-1, keepdims=True)
      expert = jnp.argmax(remaining, axis=-1)
      far = (best - scores) / jnp.maximum(jnp.abs(scores), best) > 2 * self.jitter
      gates = jax.nn.softmax(jnp.where(far, -jnp.inf, remaining), axis=-1)
      weights.append(jnp.take_along_axis(gates, expert[:, None], axis=-1)[:, 0])
      experts.append(expert)
      remaining = jnp.where(jnp.arange(scores.shape[-1]) == expert[:, None], -jnp.inf,
                            remaining)
    return (jnp.stack(weights, axis=-1).astype(x.dtype).astype(jnp.float32),
            jnp.stack(experts, axis=-1).astype(jnp.int32))


class DecoderLayer(moe.DecoderLayer):
  """Mixtral's block with `PhimoeMoE` (LayerNorms: the config's `make_norm`)."""

  def _make_mlp(self, config: PhimoeConfig, layer: int, **kwargs) -> nnx.Module:
    del layer
    return PhimoeMoE(config, **kwargs)


class PhimoeForCausalLM(phi.BiasedHead, moe.MoeForCausalLM):
  """Phi-MoE with an LM head (biased with lm_head_bias): `moe.MoeForCausalLM` over these
  blocks (its Args)."""

  decoder_layer = DecoderLayer


def hf_sources(path: tuple[str, ...], config: PhimoeConfig):
  """`moe.hf_sources` under Mixtral's names (the experts' w1 / w3 / w2), the LM head's bias
  (lm_head.bias)."""
  if path == ("lm_head_bias",):
    return ["lm_head.bias"], llama.whole
  return moe.hf_sources(path, config, moe.MIXTRAL_EXPERTS)


from_pretrained = llama.loader(PhimoeConfig, PhimoeForCausalLM, hf_sources)

FAMILY = llama.family("phimoe", MODEL_TYPES, from_pretrained)
