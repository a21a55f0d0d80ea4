"""Llama 4 in Flax NNX, decoding from a paged KV cache (`jax_paged.KVPool`).

Hugging Face's `Llama4ForCausalLM` (`model_type` "llama4_text") and the text half of
`Llama4ForConditionalGeneration` ("llama4": Meta's Llama-4-Scout-17B-16E,
Llama-4-Maverick-17B-128E; its text_config's model, decoding text only: the vision tower
is not loaded) are Llama's decoder with
- interleaved-pair RoPE (q_proj's and k_proj's rows reordered at load into rotate-half
  order: `glm.rope_reordered`) on three layers of four, whose attention is chunked (each
  token attends to the earlier tokens of its chunk of attention_chunk_size:
  `nn.PagedAttention(attention_chunk=)`, a mask of the kernels) and whose q and k heads
  are RMS-normalised without a weight after RoPE (use_qk_norm);
- NoPE layers between them (no_rope_layers 0), attending to the whole context, with their
  queries' temperature tuned by position (attn_temperature_tuning:
  `nn.QueryTemperature(floor_scale, attn_scale, offset=1)`);
- on the moe_layers (every layer of Scout's, every other of Maverick's) an MLP of
  num_local_experts SwiGLU experts of intermediate_size, each token run through its
  num_experts_per_tok best by the router's logits and its input scaled by the sigmoid of
  its logit (before the expert: `Llama4MoE`), beside an ungated shared expert of the same
  width; on the others a dense MLP of intermediate_size_mlp. Tensor parallelism splits
  them as the other MoEs (`moe.MoeForCausalLM`).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, ClassVar

import jax
import jax.numpy as jnp
from flax import nnx

from jax_paged import lora
from jax_paged import nn as paged_nn
from jax_paged.kernels import layer_norm
from jax_paged.kernels import validation
from models import glm
from models import llama
from models import moe

MODEL_TYPES = ("llama4_text", "llama4")


@dataclasses.dataclass(frozen=True)
class Llama4Config(moe.MoeConfig):
  """Llama 4 hyperparameters (defaults: HF's Llama4TextConfig's, Scout's shape).

  HF's intermediate_size (each expert's and the shared expert's width) is read as
  moe_intermediate_size and shared_expert_intermediate_size, its intermediate_size_mlp
  (a dense layer's MLP) as intermediate_size (`from_dict`).

  Attributes beyond `moe.MoeConfig`'s:
    moe_layers: the layers whose MLP is the experts.
    attention_chunk_size: C, the chunk of a chunked layer's attention (None: none).
    chunked_layers: 1 where a layer's attention is chunked, 0 where it is full (HF's
      layer_types "chunked_attention" / "full_attention"; by default its RoPE layers,
      with an attention_chunk_size).
    use_qk_norm: whether RoPE layers RMS-normalise each q and k head (weightless).
    attn_temperature_tuning, floor_scale, attn_scale: the NoPE layers' query temperature
      1 + attn_scale * log(1 + floor((position + 1) / floor_scale)).
  """

  vocab_size: int = 202048
  hidden_size: int = 5120
  intermediate_size: int = 16384
  num_hidden_layers: int = 48
  num_attention_heads: int = 40
  num_key_value_heads: int | None = 8
  head_dim: int | None = 128
  max_position_embeddings: int = 4096 * 32
  rms_norm_eps: float = 1e-5
  rope_theta: float = 500000.0
  num_local_experts: int = 16
  num_experts_per_tok: int = 1
  moe_intermediate_size: int | None = 8192
  shared_expert_intermediate_size: int | None = 8192
  moe_layers: tuple[int, ...] | None = None
  attention_chunk_size: int | None = 8192
  chunked_layers: tuple[int, ...] | None = None
  use_qk_norm: bool = True
  attn_temperature_tuning: bool = True
  floor_scale: int = 8192
  attn_scale: float = 0.1
  bos_token_id: int | None = 1
  eos_token_id: int | tuple[int, ...] | None = 2
  model_type: str = "llama4_text"

  model_types: ClassVar[tuple[str, ...]] = MODEL_TYPES

  def __post_init__(self):
    set_ = lambda name, value: object.__setattr__(self, name, value)
    n = self.num_hidden_layers
    if self.no_rope_layers is None:  # HF's: a NoPE layer every fourth
      set_("no_rope_layers", tuple(int((i + 1) % 4 != 0) for i in range(n)))
    if self.moe_layers is None:
      set_("moe_layers", tuple(range(n)))
    set_("moe_layers", tuple(self.moe_layers))
    if any(not 0 <= i < n for i in self.moe_layers):
      raise ValueError(f"moe_layers must be layers in [0, {n}), got {self.moe_layers}")
    set_("attention_chunk_size", validation.check_positive_int(
        "attention_chunk_size", self.attention_chunk_size, optional=True))
    if self.chunked_layers is None:
      set_("chunked_layers", tuple(int(bool(r) and self.attention_chunk_size is not None)
                                   for r in self.no_rope_layers[:n]))
    set_("chunked_layers", tuple(self.chunked_layers))
    if len(self.chunked_layers) != n or any(c not in (0, 1) for c in self.chunked_layers):
      raise ValueError(f"chunked_layers must give 1 (chunked) or 0 (full) for each of the "
                       f"{n} layers, got {self.chunked_layers}")
    if any(self.chunked_layers) and self.attention_chunk_size is None:
      raise ValueError("chunked layers need an attention_chunk_size")
    validation.check_positive_int("floor_scale", self.floor_scale)
    validation.check_positive_number("attn_scale", self.attn_scale)
    super().__post_init__()

  def sparse(self, layer: int) -> bool:
    return layer in self.moe_layers

  def chunk(self, layer: int) -> int | None:
    """Layer `layer`'s attention chunk (None: full causal attention)."""
    return self.attention_chunk_size if self.chunked_layers[layer] else None

  @classmethod
  def from_dict(cls, config: dict[str, Any]) -> "Llama4Config":
    """From a Hugging Face config dict: "llama4_text"'s, or an image-text "llama4"'s
    text_config (with the top level's eos / bos ids and tie_word_embeddings where it has
    them); HF's widths renamed (the class docstring), its layer_types read as
    chunked_layers, moe_layers from interleave_moe_layer_step without them (HF's),
    no_rope_layers from no_rope_layer_interval; attention biases and router jitter
    refused."""
    config = dict(config)
    if config.get("model_type") == "llama4":
      config = llama.hf_text_config(config, "llama4")
    config.setdefault("model_type", cls.model_type)
    for name in ("attention_bias", "router_jitter_noise"):
      if config.get(name):
        raise ValueError(f"{name} {config[name]!r} is not supported (Llama 4's "
                         "checkpoints have none)")
    layers = config.get("num_hidden_layers", cls.num_hidden_layers)
    if not config.get("no_rope_layers"):  # (HF's: [] or null -> every interval-th NoPE)
      interval = config.get("no_rope_layer_interval", 4)
      config["no_rope_layers"] = [int((i + 1) % interval != 0) for i in range(layers)]
    if config.get("moe_layers") is None:
      step = config.get("interleave_moe_layer_step", 1)
      config["moe_layers"] = list(range(step - 1, layers, step))
    layer_types = config.pop("layer_types", None)
    if layer_types is not None:
      if any(t not in ("chunked_attention", "full_attention") for t in layer_types):
        raise ValueError("layer_types must each be 'chunked_attention' or 'full_attention', "
                         f"got {layer_types}")
      config["chunked_layers"] = [int(t == "chunked_attention") for t in layer_types]
    width = config.get("intermediate_size", cls.moe_intermediate_size)
    config["moe_intermediate_size"] = config["shared_expert_intermediate_size"] = width
    config["intermediate_size"] = config.get("intermediate_size_mlp", cls.intermediate_size)
    config.pop("sliding_window", None)
    # (past MoeConfig.from_dict, which keeps the expert fields for the Qwens alone)
    return llama.LlamaConfig.from_dict.__func__(cls, config)


class L2Norm(nnx.Module):
  """HF's Llama4TextL2Norm: x / rms(x) in float32, rounded to x's dtype (no weight)."""

  def __init__(self, num_features: int, *, epsilon: float):
    self.num_features = num_features
    self.epsilon = epsilon

  def __call__(self, x: jax.Array) -> jax.Array:
    """x [..., num_features] -> the same shape and dtype."""
    return layer_norm.rms_norm(x, jnp.ones((self.num_features,), x.dtype),
                               epsilon=self.epsilon)


class Llama4MoE(moe.SparseMoE):
  """Llama 4's experts (HF's Llama4TextMoe): each token's top k experts by the router's
  logits, its input to each scaled by the sigmoid of that logit, their outputs summed
  with the shared expert's (`moe.SparseMoE`'s parameters)."""

  weights_scale_input: ClassVar[bool] = True

  def route(self, x: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Tokens x [tokens, hidden] in the compute dtype -> (float32 weights, int32 experts),
    each [tokens, top_k]: the router's top k logits (computed in x's dtype, as HF's) and
    their sigmoids, rounded to x's dtype (HF's scores)."""
    logits, experts = jax.lax.top_k(x @ self.router[...].astype(x.dtype), self.top_k)
    weights = jax.nn.sigmoid(logits.astype(jnp.float32)).astype(x.dtype)
    return weights.astype(jnp.float32), experts


class DecoderLayer(moe.DecoderLayer):
  """Llama's block with Llama 4's attention (chunked, q / k norms, temperature: by
  layer) and MLP (`Llama4MoE` on the moe_layers, a dense MLP elsewhere)."""

  def _make_attention(self, config: Llama4Config, layer: int, *, decode_impl, param_dtype,
                      **kwargs) -> nnx.Module:
    rope = config.layer_rope(layer)
    norm = rope is not None and config.use_qk_norm
    return paged_nn.PagedAttention(
        config.hidden_size, config.num_attention_heads, config.head_dim,
        num_kv_heads=config.num_key_value_heads, qkv_bias=False, out_bias=False, rope=rope,
        attention_chunk=config.chunk(layer),
        query_temperature=(
            paged_nn.QueryTemperature(config.floor_scale, config.attn_scale, offset=1)
            if rope is None and config.attn_temperature_tuning else None),
        head_norm=(lambda width: L2Norm(width, epsilon=config.rms_norm_eps)) if norm else None,
        qk_norm_after_rope=norm, decode_impl=decode_impl,
        kernel_init=nnx.initializers.normal(config.initializer_range),
        param_dtype=param_dtype, **kwargs)

  def _make_mlp(self, config: Llama4Config, layer: int, **kwargs) -> nnx.Module:
    if config.sparse(layer):
      return Llama4MoE(config, **kwargs)
    return llama.MLP(config, **kwargs)


class Llama4ForCausalLM(moe.MoeForCausalLM):
  """Llama 4 with an LM head: `moe.MoeForCausalLM` over these blocks (its Args)."""

  decoder_layer = DecoderLayer

  def lora_targets(self) -> dict[str, lora.Target]:
    """Hugging Face module name -> where its LoRA update lands: Llama's under HF's
    feed_forward names, q_proj's and k_proj's columns where the load's RoPE reorder put
    their rows (`glm.reordered_targets`)."""
    targets = glm.reordered_targets(self, super().lora_targets())
    return {name.replace(".mlp.", ".feed_forward."): target
            for name, target in targets.items()}


@glm.rope_reordered
def hf_sources(path: tuple[str, ...], config: Llama4Config
               ) -> tuple[list[str], Callable[[list[jax.Array]], jax.Array]]:
  """`llama.Sources` of Llama 4's checkpoints: the MLPs under feed_forward (the experts'
  fused gate_up_proj [experts, hidden, 2 x width] and down_proj [experts, width, hidden]
  as they are, the router's weight, the shared_expert's projections), q's and k's rows
  reordered (`glm.rope_reordered`), the rest as `llama.hf_sources` (no q / k norm
  weights)."""
  if path[2:3] != ("mlp",):
    return llama.hf_sources(path, config)
  prefix = f"model.layers.{path[1]}.feed_forward."
  if config.sparse(int(path[1])) and path[3] != "shared":
    if path[3] == "router":
      return [f"{prefix}router.weight"], llama.linear_rows
    return [f"{prefix}experts.{path[3]}_proj"], lambda parts: parts[0]
  shared = path[3:4] == ("shared",)
  names, assemble = llama.hf_sources(path[:3] + path[3 + shared:], config)
  return [n.replace(".mlp.", ".feed_forward.shared_expert." if shared else ".feed_forward.")
          for n in names], assemble


from_pretrained = llama.loader(Llama4Config, Llama4ForCausalLM, hf_sources)

FAMILY = llama.family("llama4", MODEL_TYPES, from_pretrained)
