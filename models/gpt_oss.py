"""GPT-OSS in Flax NNX, decoding from a paged KV cache (`jax_paged.KVPool`).

Hugging Face's `GptOssForCausalLM` (`model_type` "gpt_oss": OpenAI's gpt-oss-20b and
gpt-oss-120b) is a mixture-of-experts decoder on Llama's blocks (`models.moe`: its router,
grouped expert matmuls, loader, engine and tensor parallel splits) with:

* attention sinks: each head's softmax also counts a learned logit that has no value
  (`self_attn.sinks`, `nn.PagedAttention(sinks=True)`: inside the paged decode and
  prefill kernels), and biases on q, k, v and o;
* sliding-window attention (128 positions) on every other layer, full attention on the
  rest (`layer_types`), YaRN RoPE (factor 32 over 4096 positions, untruncated);
* a router with a bias whose top-k logits are softmaxed (the chosen experts' weights sum
  to 1), and experts with biases whose gated unit is clamped: gate <= limit, up in
  [-limit, limit], (up + 1) * gate * sigmoid(alpha * gate) (alpha 1.702, limit 7);
* checkpoints whose expert weights are MXFP4 (the released ones: quantization_config
  quant_method "mxfp4", `*_blocks` of packed 4-bit values with a power-of-two scale per 32,
  `*_scales`), dequantized on load as HF's `convert_moe_packed_tensors` does
  (`llama.load_pretrained`), or float ones as `save_pretrained` writes them. Loaded weights
  serve in the model's dtype; `weight_quant.quantize_weights` makes them int8.

HF's checkpoints interleave each expert's gate and up columns (gate_up_proj[..., ::2] is
gate's); they are loaded as our fused [gate | up] (`moe.SparseMoE`), so that tensor
parallelism splits each alike.
"""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar

import jax
from jax import lax
import jax.numpy as jnp

from jax_paged.kernels import validation
from models import llama
from models import moe

MODEL_TYPES = ("gpt_oss",)

# HF's GptOssConfig defaults for a config.json that omits them.
_DEFAULT_ROPE = {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0,
                 "truncate": False, "original_max_position_embeddings": 4096}


@dataclasses.dataclass(frozen=True)
class GptOssConfig(moe.MoeConfig):
  """GPT-OSS hyperparameters under Hugging Face's field names (`moe.MoeConfig`'s;
  defaults HF's GptOssConfig's: gpt-oss-120b's shape).

  Attributes beyond MoeConfig's:
    swiglu_alpha: the experts' sigmoid gate's slope.
    swiglu_limit: the clamp of the experts' gate (above) and up (both sides) projections.
  """

  vocab_size: int = 201088
  hidden_size: int = 2880
  intermediate_size: int = 2880
  num_hidden_layers: int = 36
  num_attention_heads: int = 64
  num_key_value_heads: int | None = 8
  head_dim: int | None = 64
  max_position_embeddings: int = 131072
  rms_norm_eps: float = 1e-5
  rope_theta: float = 150000.0
  rope_scaling: Any = tuple(sorted(_DEFAULT_ROPE.items()))
  attention_bias: bool = True
  sliding_window: int | None = 128
  num_local_experts: int = 128
  num_experts_per_tok: int = 4
  bos_token_id: int | None = None
  eos_token_id: int | tuple[int, ...] | None = None
  swiglu_alpha: float = 1.702
  swiglu_limit: float = 7.0
  model_type: str = "gpt_oss"

  model_types: ClassVar[tuple[str, ...]] = MODEL_TYPES

  def __post_init__(self):
    if self.layer_types is None:  # HF's: windows on the even layers
      object.__setattr__(self, "layer_types", tuple(
          "sliding_attention" if (i + 1) % 2 else "full_attention"
          for i in range(self.num_hidden_layers)))
    super().__post_init__()
    for name in ("swiglu_alpha", "swiglu_limit"):
      object.__setattr__(self, name, validation.check_positive_number(name,
                                                                      getattr(self, name)))
    if not self.norm_topk_prob:  # (HF softmaxes the top-k logits: always normalised)
      raise ValueError("norm_topk_prob False is not GPT-OSS's routing (the chosen "
                       "experts' weights are a softmax over their logits)")

  @property
  def attention_sinks(self) -> bool:
    return True

  @property
  def out_bias(self) -> bool:
    return self.attention_bias

  @classmethod
  def from_dict(cls, config: dict[str, Any]) -> "GptOssConfig":
    """`moe.MoeConfig.from_dict`, with GPT-OSS's layer_types kept (HF's alternation when
    absent), HF's YaRN scaling when a config gives none, and hidden_act ignored (HF's
    experts have their own unit)."""
    config = dict(config)
    config.pop("hidden_act", None)
    layer_types = config.pop("layer_types", None)
    if config.get("rope_scaling") is None and config.get("rope_parameters") is None:
      config["rope_scaling"] = dict(_DEFAULT_ROPE)
    parsed = super().from_dict(config)
    if layer_types is None:
      return parsed
    return dataclasses.replace(parsed, layer_types=tuple(layer_types))


class Experts(moe.SparseMoE):
  """GPT-OSS's MLP (HF's GptOssMLP): `moe.SparseMoE` with biases on the router and the
  experts, the top-k router logits softmaxed, and the clamped gated unit (`glu`)."""

  biases = True

  def __init__(self, config: GptOssConfig, **kwargs):
    super().__init__(config, **kwargs)
    self.alpha, self.limit = config.swiglu_alpha, config.swiglu_limit

  def glu(self, gate: jax.Array, up: jax.Array) -> jax.Array:
    """(up + 1) * gate * sigmoid(alpha * gate), gate clamped to <= limit and up to
    [-limit, limit] (HF's GptOssExperts._apply_gate)."""
    gate = jnp.minimum(gate, self.limit)
    up = jnp.clip(up, -self.limit, self.limit)
    return (up + 1.0) * gate * jax.nn.sigmoid(gate * self.alpha)

  def route(self, x: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Tokens x [tokens, hidden] in the compute dtype -> (float32 weights, int32 experts),
    each [tokens, top_k]: the top k of the router's logits (with its bias, in x's dtype
    as HF's), softmaxed."""
    logits = x @ self.router[...].astype(x.dtype) + self.router_bias[...].astype(x.dtype)
    top, experts = lax.top_k(logits.astype(jnp.float32), self.top_k)
    return jax.nn.softmax(top, axis=-1), experts


class DecoderLayer(moe.DecoderLayer):
  """Llama's block with sinks in its attention (`GptOssConfig.attention_sinks`) and
  `Experts` for its MLP."""

  def _make_mlp(self, config: GptOssConfig, layer: int, **kwargs) -> Experts:
    del layer
    return Experts(config, **kwargs)


class GptOssForCausalLM(moe.MoeForCausalLM):
  """GPT-OSS with an LM head: `moe.MoeForCausalLM` over these blocks (its Args)."""

  decoder_layer = DecoderLayer


# Our expert projections -> HF's GptOssExperts tensors.
_EXPERT_TENSORS = {"gate_up": "gate_up_proj", "down": "down_proj"}


def _gate_up_columns(parts: list[jax.Array]) -> jax.Array:
  """HF's gate_up_proj [E, H, 2 I] (or its bias [E, 2 I]), gate's and up's columns
  interleaved, as our [gate | up]."""
  (x,) = parts
  return jnp.concatenate([x[..., ::2], x[..., 1::2]], axis=-1)


def hf_sources(path: tuple[str, ...], config: GptOssConfig
               ) -> tuple[list[str], Any]:
  """`llama.Sources` of GPT-OSS: the router's weight (torch Linear [E, H]) and bias, each
  expert stack's weight ([E, in, out], as our kernels) and bias (gate_up's deinterleaved),
  the rest as `llama.hf_sources` (the attention's sinks too: `self_attn.sinks`)."""
  if path[2:3] != ("mlp",):
    return llama.hf_sources(path, config)
  prefix = f"model.layers.{path[1]}.mlp."
  if path[3] == "router":
    return [f"{prefix}router.weight"], llama.linear_rows
  if path[3] == "router_bias":
    return [f"{prefix}router.bias"], llama.whole
  name = f"{prefix}experts.{_EXPERT_TENSORS[path[3]]}"
  if path[-1] == "bias":
    name += "_bias"
  return [name], _gate_up_columns if path[3] == "gate_up" else llama.whole


from_pretrained = llama.loader(GptOssConfig, GptOssForCausalLM, hf_sources)

FAMILY = llama.family("gpt_oss", MODEL_TYPES, from_pretrained)
