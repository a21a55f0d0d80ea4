"""OLMo 2 in Flax NNX, decoding from a paged KV cache (`jax_paged.KVPool`).

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
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, ClassVar

import jax
from flax import nnx

from jax_paged import nn as paged_nn
from jax_paged import pool as pool_lib
from models import llama

MODEL_TYPES = ("olmo2",)
# Hugging Face's Olmo2Config defaults (transformers 5.x) where they differ from
# `llama.LlamaConfig`'s, which a config.json omitting the field gets there too.
_HF_DEFAULTS = dict(vocab_size=50304, rms_norm_eps=1e-5, bos_token_id=None,
                    eos_token_id=50279)


@dataclasses.dataclass(frozen=True)
class Olmo2Config(llama.LlamaConfig):
  """OLMo 2 hyperparameters under Hugging Face's field names (`llama.LlamaConfig`'s;
  attention_bias puts biases on q, k, v and o; q / k normalised across all heads)."""

  vocab_size: int = 50304
  rms_norm_eps: float = 1e-5
  bos_token_id: int | None = None
  eos_token_id: int | tuple[int, ...] | None = 50279
  model_type: str = "olmo2"

  model_types: ClassVar[tuple[str, ...]] = MODEL_TYPES

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
    """`llama.LlamaConfig.from_dict`, with Hugging Face's Olmo2Config defaults for the
    fields a config.json omits."""
    return llama.LlamaConfig.from_dict.__func__(cls, {**_HF_DEFAULTS, **config})


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
    post = self.post_feedforward_layernorm
    x, _ = paged_nn.project_add_norm(self.mlp.down, self.mlp.hidden(x, adapters), x, post,
                                     adapters=adapters, parts_norm=post)
    return x, next_norm(x), kv


class Olmo2ForCausalLM(llama.LlamaForCausalLM):
  """OLMo 2 with an LM head, attending through a `KVPool`: `LlamaForCausalLM`'s forwards,
  pool, loader names and LoRA targets over OLMo 2's blocks (its Args)."""

  decoder_layer = DecoderLayer


from_pretrained = llama.loader(Olmo2Config, Olmo2ForCausalLM)

FAMILY = llama.family("olmo2", MODEL_TYPES, from_pretrained)
