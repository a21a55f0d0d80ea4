"""OLMo 2 and OLMo 3 in Flax NNX, decoding from a paged KV cache (`jax_paged.KVPool`).

Hugging Face's `Olmo2ForCausalLM` (`model_type` "olmo2": AI2's OLMo 2 1B, 7B, 13B, 32B) is
Llama's model (`models.llama`: RoPE, GQA through `nn.PagedAttention`, a SwiGLU MLP, its
loader and adapters) with two changes:

* post-norms instead of pre-norms: a block adds post_attention_layernorm(attention(x))
  and post_feedforward_layernorm(mlp(x)) to the residual stream, each branch reading the
  stream itself (no input norm); the final norm as Llama's;
* q and k RMS-normalised across all heads together before RoPE (`nn.PagedAttention(...,
  qk_norm_all_heads=True)`, OLMoE's), so the attention is not split by tensor
  parallelism (refused by name).

Each residual add is fused with its branch's post-norm in one kernel after the
projection (`nn.project_add_norm`'s `parts_norm`), as Gemma's post-norms are; the norm
after the add is the next block's, which OLMo 2 does not have: the identity.

`Olmo3ForCausalLM` ("olmo3": OLMo 3 7B, 32B, their Instruct / Think models) is OLMo 2's
model with sliding-window layers (layer_types; HF's default three of every four, windows
of sliding_window) whose RoPE is always the default one (HF's per-layer-type
rope_parameters: a scaling such as the long-context YaRN applies to the full-attention
layers only).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, ClassVar

import jax
from flax import nnx

from jax_paged import nn as paged_nn
from jax_paged import pool as pool_lib
from jax_paged.kernels import validation
from models import llama

MODEL_TYPES = ("olmo2", "olmo3")
# Hugging Face's Olmo2Config defaults (transformers 5.x) where they differ from
# `llama.LlamaConfig`'s, which a config.json omitting the field gets there too; Olmo3Config's
# beyond them.
_HF_DEFAULTS = dict(vocab_size=50304, rms_norm_eps=1e-5, bos_token_id=None,
                    eos_token_id=50279)
_OLMO3_DEFAULTS = dict(rope_theta=500000.0, sliding_window=4096)


@dataclasses.dataclass(frozen=True)
class Olmo2Config(llama.LlamaConfig):
  """OLMo 2 / OLMo 3 hyperparameters under Hugging Face's field names
  (`llama.LlamaConfig`'s; attention_bias puts biases on q, k, v and o; q / k normalised
  across all heads). OLMo 3's sliding layers (layer_types) rotate by the default RoPE of
  base sliding_rope_theta (None: rope_theta), its full ones by rope_theta and
  rope_scaling."""

  vocab_size: int = 50304
  rms_norm_eps: float = 1e-5
  bos_token_id: int | None = None
  eos_token_id: int | tuple[int, ...] | None = 50279
  model_type: str = "olmo2"
  sliding_rope_theta: float | None = None

  model_types: ClassVar[tuple[str, ...]] = MODEL_TYPES

  def __post_init__(self):
    super().__post_init__()
    if self.model_type == "olmo2" and (self.layer_types or self.sliding_window):
      raise ValueError("OLMo 2 has no sliding-window layers (layer_types, sliding_window "
                       "are OLMo 3's)")
    if self.layer_types is not None and "sliding_attention" in self.layer_types:
      validation.check_positive_int("sliding_window (of sliding layers)", self.sliding_window)
    validation.check_positive_number("sliding_rope_theta", self.sliding_rope_theta,
                                     optional=True)

  def layer_rope(self, layer: int) -> paged_nn.RotaryEmbedding:
    """Layer `layer`'s rotary embedding: a sliding layer's default RoPE, else `rope`."""
    if self.layer_types is None or self.layer_types[layer] != "sliding_attention":
      return self.rope
    return llama.rotary(self.head_dim, self.sliding_rope_theta or self.rope_theta, None,
                        self.max_position_embeddings, max_model_len=self.max_model_len)

  @property
  def out_bias(self) -> bool:
    return self.attention_bias

  @property
  def qk_norm(self) -> bool:
    return True

  @property
  def qk_norm_all_heads(self) -> bool:
    return True

  @classmethod
  def from_dict(cls, config: dict[str, Any]) -> "Olmo2Config":
    """`llama.LlamaConfig.from_dict`, with Hugging Face's Olmo2Config / Olmo3Config
    defaults for the fields a config.json omits. OLMo 3's RoPE: transformers 5's
    rope_parameters per layer type (the sliding layers' of the default type), or 4's
    rope_theta and rope_scaling (the full layers' scaling); its layer_types, when absent,
    HF's (every fourth layer full, the rest sliding)."""
    config = {**_HF_DEFAULTS, **config}
    if config.setdefault("model_type", cls.model_type) != "olmo3":
      return llama.LlamaConfig.from_dict.__func__(cls, config)
    config = {**_OLMO3_DEFAULTS, **config}
    rope = config.pop("rope_parameters", None)
    if rope is not None:
      sliding, full = llama.per_layer_type_rope(rope)
      config["rope_theta"] = full.setdefault("rope_theta", config["rope_theta"])
      config["sliding_rope_theta"] = sliding.get("rope_theta", config["rope_theta"])
      config["rope_parameters"] = full
    config.setdefault("sliding_rope_theta", config["rope_theta"])
    layers = config.get("num_hidden_layers", 32)
    layer_types = config.pop("layer_types", None) or [
        "full_attention" if (i + 1) % 4 == 0 else "sliding_attention" for i in range(layers)]
    # (past Llama's from_dict, which keeps layer_types for the Qwens and SmolLM3 alone)
    return dataclasses.replace(llama.LlamaConfig.from_dict.__func__(cls, config),
                               layer_types=tuple(layer_types))


def _identity(x: jax.Array) -> jax.Array:
  return x


class DecoderLayer(llama.DecoderLayer):
  """An OLMo 2 block: Llama's attention and MLP on the stream itself, each output
  RMS-normalised before its residual add."""

  def __init__(self, config: Olmo2Config, layer: int, *, dtype, param_dtype,
               decode_impl: paged_nn.DecodeImpl, rngs: nnx.Rngs):
    norm = functools.partial(paged_nn.RMSNorm, config.hidden_size,
                             epsilon=config.rms_norm_eps, param_dtype=param_dtype)
    # No input norm: `LlamaForCausalLM`'s forward hands each block the stream as it is.
    self.input_layernorm = _identity
    self.self_attn = self._make_attention(config, layer, decode_impl=decode_impl,
                                          dtype=dtype, param_dtype=param_dtype, rngs=rngs)
    self.post_attention_layernorm = norm()
    self.mlp = self._make_mlp(config, layer, dtype=dtype, param_dtype=param_dtype,
                              rngs=rngs)
    self.post_feedforward_layernorm = norm()

  def __call__(self, x: jax.Array, h: jax.Array, kv: pool_lib.KVPool, layer: int,
               attend: llama.Attend, next_norm, adapters: jax.Array | None = None
               ) -> tuple[jax.Array, jax.Array, pool_lib.KVPool]:
    """As `models.llama.DecoderLayer`'s: x the residual stream and h = x (no input norm)
    -> (the new stream, its `next_norm`: the next block's identity, or the final norm;
    the pool). Each branch's post-norm and residual add are one kernel after its
    projection (whose norm of the sum, the block's not having one, goes unused)."""
    a, kv = attend(self.self_attn, h, kv, layer)
    post = self.post_attention_layernorm
    x, _ = paged_nn.project_add_norm(self.self_attn.out, a, x, post, adapters=adapters,
                                     parts_norm=post)
    x = self._mlp_add(x, adapters)
    return x, next_norm(x), kv

  def _mlp_add(self, x: jax.Array, adapters: jax.Array | None) -> jax.Array:
    """x + post_feedforward_layernorm(mlp(x)), the norm and the add one kernel after the
    down projection (a subclass's own: `models.flex_olmo`'s experts)."""
    post = self.post_feedforward_layernorm
    x, _ = paged_nn.project_add_norm(self.mlp.down, self.mlp.hidden(x, adapters), x, post,
                                     adapters=adapters, parts_norm=post)
    return x


class Olmo2ForCausalLM(llama.LlamaForCausalLM):
  """OLMo 2 / OLMo 3 with an LM head, attending through a `KVPool`: `LlamaForCausalLM`'s
  forwards, pool, loader names and LoRA targets over OLMo 2's blocks (its Args)."""

  decoder_layer = DecoderLayer


from_pretrained = llama.loader(Olmo2Config, Olmo2ForCausalLM)

FAMILY = llama.family("olmo2", MODEL_TYPES, from_pretrained)
