"""Gemma 3 (text) in Flax NNX, decoding from a paged KV cache (`jax_paged.KVPool`).

Hugging Face's `Gemma3ForCausalLM` (`model_type` "gemma3_text": Gemma 3 1B, and text-only
exports of the larger ones), also the language model of an image-text
`Gemma3ForConditionalGeneration` checkpoint (`model_type` "gemma3": Gemma 3 4B, 12B and
27B; its `text_config`, decoding text only: the vision tower is not loaded), is Llama's
decoder (`models.llama`: GQA through
`jax_paged.nn.PagedAttention`, a gated MLP, the same checkpoint names and loader) with
Gemma's differences:

* RMS norms of weights centred on 0, which scale by 1 + weight in f32
  (`nn.RMSNorm(unit_offset=True)`), four per block: the attention's and the MLP's outputs
  are normalised before their residual adds (post_attention_layernorm,
  post_feedforward_layernorm), their inputs after (input_layernorm,
  pre_feedforward_layernorm);
* each head of q and k normalised so before RoPE (q_norm, k_norm), and attention scores
  scaled by query_pre_attn_scalar^-1/2;
* sliding-window layers (five of every six by default) with RoPE of base
  rope_local_base_freq, the others attending to everything with base rope_theta (and
  rope_scaling);
* a GeGLU MLP (tanh-approximated gelu), embeddings scaled by sqrt(hidden_size) (rounded
  to the weights' dtype), a head tied to the embedding by default.

`Gemma3Config`'s soft caps (`attn_logit_softcapping`, `final_logit_softcapping`) are
Gemma 2's (`models.gemma2`, on these modules); a Gemma 3 config setting them is refused
by name, as HF's Gemma 3 checkpoints never do.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, ClassVar, Mapping

import jax
import jax.numpy as jnp
from flax import nnx

from jax_paged import nn as paged_nn
from jax_paged import pool as pool_lib
from jax_paged.kernels import validation
from jax_paged.paged_model import ModelFamily
from models import llama

MODEL_TYPES = ("gemma3_text", "gemma3")
_LAYER_TYPES = ("full_attention", "sliding_attention")


@dataclasses.dataclass(frozen=True)
class Gemma3Config:
  """Gemma 3 hyperparameters under Hugging Face's field names and defaults
  (Gemma3TextConfig's).

  Attributes beyond HF's Gemma3TextConfig:
    rope_scaling: the full-attention layers' RoPE scaling (HF's dict, e.g. {"rope_type":
      "linear", "factor": 8.0}) or None, kept as sorted (key, value) pairs (hashable).
    layer_types: "sliding_attention" / "full_attention" per layer; None: every
      sliding_window_pattern-th layer full, the others sliding (HF's default).
    model_type: "gemma3_text", or "gemma3" for an image-text checkpoint's language model.

  Class attributes (Gemma 2's config, a subclass, sets them otherwise): `model_types`, the
  model_type values the config takes; `qk_norm`, whether q and k are each head normalised.
  """

  vocab_size: int = 262208
  hidden_size: int = 2304
  intermediate_size: int = 9216
  num_hidden_layers: int = 26
  num_attention_heads: int = 8
  num_key_value_heads: int = 4
  head_dim: int = 256
  hidden_activation: str = "gelu_pytorch_tanh"
  max_position_embeddings: int = 131072
  rms_norm_eps: float = 1e-6
  rope_theta: float = 1_000_000.0
  rope_scaling: Any = None
  rope_local_base_freq: float = 10_000.0
  query_pre_attn_scalar: float = 256
  sliding_window: int | None = 4096
  sliding_window_pattern: int = 6
  layer_types: tuple[str, ...] | None = None
  tie_word_embeddings: bool = True
  attention_bias: bool = False
  initializer_range: float = 0.02
  attn_logit_softcapping: float | None = None
  final_logit_softcapping: float | None = None
  bos_token_id: int | None = 2
  eos_token_id: int | tuple[int, ...] | None = 1
  model_type: str = "gemma3_text"

  model_types: ClassVar[tuple[str, ...]] = MODEL_TYPES
  qk_norm: ClassVar[bool] = True

  @property
  def post_norms(self) -> bool:
    """Whether each branch's output is normalised before its residual add
    (post_attention_layernorm, post_feedforward_layernorm: Gemma 2's and 3's; not
    VaultGemma's, `models.gemma2`)."""
    return True

  def __post_init__(self):
    set_ = functools.partial(object.__setattr__, self)
    if isinstance(self.rope_scaling, Mapping):
      set_("rope_scaling", tuple(sorted(self.rope_scaling.items())))
    if isinstance(self.eos_token_id, list):
      set_("eos_token_id", tuple(self.eos_token_id))
    if self.layer_types is None:
      set_("layer_types", tuple("full_attention" if (i + 1) % self.sliding_window_pattern == 0
                                else "sliding_attention"
                                for i in range(self.num_hidden_layers)))
    set_("layer_types", tuple(self.layer_types))
    if (len(self.layer_types) != self.num_hidden_layers
        or any(t not in _LAYER_TYPES for t in self.layer_types)):
      raise ValueError(f"layer_types must list one of {_LAYER_TYPES} per layer "
                       f"({self.num_hidden_layers}), got {self.layer_types}")
    llama.check_type_and_heads(self, self.model_types)
    for name in ("attn_logit_softcapping", "final_logit_softcapping"):
      validation.check_positive_number(name, getattr(self, name), optional=True)
    if self.hidden_activation != "gelu_pytorch_tanh":
      raise ValueError(f"hidden_activation {self.hidden_activation!r} is not supported; "
                       "Gemma 3's MLP is GeGLU ('gelu_pytorch_tanh')")
    if "sliding_attention" in self.layer_types:
      validation.check_positive_int("sliding_window (of sliding layers)", self.sliding_window)
    for layer in range(self.num_hidden_layers):
      self.rope(layer)  # validates rope_theta and rope_scaling

  # What `models.llama`'s modules read (Gemma has no biases but attention_bias's).
  mlp_bias = False

  @property
  def max_model_len(self) -> int:
    """The longest sequence served: the whole context (`llama.LlamaConfig`'s name)."""
    return self.max_position_embeddings

  @property
  def qkv_bias(self) -> bool:
    return self.attention_bias

  @property
  def out_bias(self) -> bool:
    return self.attention_bias

  @property
  def activation(self):
    """The MLP's gate activation: HF's gelu_pytorch_tanh."""
    return functools.partial(jax.nn.gelu, approximate=True)

  def rope(self, layer: int) -> paged_nn.RotaryEmbedding:
    """Layer `layer`'s rotary embedding: local (sliding) or global (full attention)."""
    if self.layer_types[layer] == "sliding_attention":
      return llama.rotary(self.head_dim, self.rope_local_base_freq, None,
                          self.max_position_embeddings)
    return llama.rotary(self.head_dim, self.rope_theta, self.rope_scaling,
                        self.max_position_embeddings)

  def window(self, layer: int) -> int | None:
    """Layer `layer`'s sliding window (None: full causal attention)."""
    return self.sliding_window if self.layer_types[layer] == "sliding_attention" else None

  @classmethod
  def from_dict(cls, config: dict[str, Any]) -> "Gemma3Config":
    """From a Hugging Face config dict (transformers 4's rope_theta / rope_local_base_freq
    / rope_scaling or 5's rope_parameters per layer type); fields this model does not use
    are ignored, settings it does not support refused by name. An image-text config
    ("gemma3") gives its text_config's model, with the top level's eos / bos ids and
    tie_word_embeddings where it has them (HF's generate and weight tying read those)."""
    config = cls._hf_common(config)
    if config["model_type"] == "gemma3":
      config = cls._hf_common(llama.hf_text_config(config, "gemma3"))
    for name in ("final_logit_softcapping", "attn_logit_softcapping"):
      if config.get(name) is not None:
        raise ValueError(f"{name} (Gemma 2's soft-capping) is not supported in Gemma 3")
    rope = config.pop("rope_parameters", None)
    if rope is not None:  # transformers 5: one dict per layer type
      local, full = llama.per_layer_type_rope(rope)
      config["rope_local_base_freq"] = local.get("rope_theta", 10_000.0)
      config["rope_theta"] = full.get("rope_theta", 1_000_000.0)
      config["rope_scaling"] = full
    return cls._from_hf_fields(config)

  @classmethod
  def _hf_common(cls, config: Mapping[str, Any]) -> dict[str, Any]:
    """A copy of an HF config dict with its model_type checked (default: this class's),
    bidirectional attention refused and hidden_act read as hidden_activation."""
    config = dict(config)
    config.setdefault("model_type", cls.model_type)
    if config["model_type"] not in cls.model_types:
      raise ValueError(f"model_type {config['model_type']!r} is not supported; use one of "
                       f"{cls.model_types}")
    if config.get("use_bidirectional_attention"):
      raise ValueError("use_bidirectional_attention is not supported (decoding is causal)")
    if "hidden_activation" not in config and "hidden_act" in config:
      config["hidden_activation"] = config["hidden_act"]
    return config

  @classmethod
  def _from_hf_fields(cls, config: dict[str, Any]) -> "Gemma3Config":
    """The config of an HF dict's fields (RoPE scaling read by `llama.hf_rope_scaling`,
    other fields ignored)."""
    scaling = config.get("rope_scaling")
    partial = config.get("partial_rotary_factor")
    if isinstance(scaling, Mapping):
      partial = scaling.get("partial_rotary_factor", partial)
    if partial not in (None, 1, 1.0):
      raise ValueError(f"partial_rotary_factor {partial} (RoPE on part of each head) is not "
                       "supported in Gemma")
    config["rope_scaling"] = llama.hf_rope_scaling(scaling)
    names = {f.name for f in dataclasses.fields(cls)}
    return cls(**{k: v for k, v in config.items() if k in names})


class DecoderLayer(nnx.Module):
  """A Gemma 3 (or 2) block: Llama's attention and MLP, each output normalised before its
  residual add."""

  def __init__(self, config: Gemma3Config, layer: int, *, dtype, param_dtype,
               decode_impl: paged_nn.DecodeImpl, rngs: nnx.Rngs):
    norm_of = functools.partial(paged_nn.RMSNorm, epsilon=config.rms_norm_eps,
                                param_dtype=param_dtype, unit_offset=True)
    norm = functools.partial(norm_of, config.hidden_size)
    self.input_layernorm = norm()
    self.self_attn = paged_nn.PagedAttention(
        config.hidden_size, config.num_attention_heads, config.head_dim,
        num_kv_heads=config.num_key_value_heads, scale=config.query_pre_attn_scalar ** -0.5,
        qkv_bias=config.qkv_bias, out_bias=config.out_bias, rope=config.rope(layer),
        sliding_window=config.window(layer), logits_soft_cap=config.attn_logit_softcapping,
        head_norm=norm_of if config.qk_norm else None, decode_impl=decode_impl,
        kernel_init=nnx.initializers.normal(config.initializer_range), dtype=dtype,
        param_dtype=param_dtype, rngs=rngs)
    self.post_attention_layernorm = norm() if config.post_norms else None
    self.pre_feedforward_layernorm = norm()
    self.mlp = llama.MLP(config, dtype=dtype, param_dtype=param_dtype, rngs=rngs)
    self.post_feedforward_layernorm = norm() if config.post_norms else None

  def __call__(self, x: jax.Array, h: jax.Array, kv: pool_lib.KVPool, layer: int,
               attend: llama.Attend, next_norm: paged_nn.RMSNorm,
               adapters: jax.Array | None = None
               ) -> tuple[jax.Array, jax.Array, pool_lib.KVPool]:
    """As `models.llama.DecoderLayer`'s: x the residual stream, h = input_layernorm(x) ->
    (the new stream, its `next_norm`, the pool). Each projection's post-norm, residual
    add and the next norm are one kernel after it (`project_add_norm`'s `parts_norm`)."""
    a, kv = attend(self.self_attn, h, kv, layer)
    x, h = paged_nn.project_add_norm(self.self_attn.out, a, x, self.pre_feedforward_layernorm,
                                     adapters=adapters,
                                     parts_norm=self.post_attention_layernorm)
    x, h = paged_nn.project_add_norm(self.mlp.down, self.mlp.hidden(h, adapters), x,
                                     next_norm, adapters=adapters,
                                     parts_norm=self.post_feedforward_layernorm)
    return x, h, kv


class Gemma3ForCausalLM(llama.LlamaForCausalLM):
  """Gemma 3 (text) with an LM head, attending through a `KVPool`: `LlamaForCausalLM`'s
  forwards, pool and adapters over Gemma's blocks (its Args); logits soft-capped by a
  config's final_logit_softcapping (Gemma 2's)."""

  decoder_layer = DecoderLayer

  def _make_norm(self, config: Gemma3Config, param_dtype) -> paged_nn.RMSNorm:
    """Gemma's final norm: 1 + weight (`nn.RMSNorm(unit_offset=True)`)."""
    return paged_nn.RMSNorm(config.hidden_size, epsilon=config.rms_norm_eps,
                            param_dtype=param_dtype, unit_offset=True)

  def _embed(self, tokens: jax.Array) -> jax.Array:
    # sqrt(hidden_size) rounded to the weights' dtype, as HF's scaled embedding.
    x = self.embed_tokens(tokens)
    scale = jnp.asarray(self.config.hidden_size ** 0.5,
                        self.embed_tokens.embedding[...].dtype)
    return x * scale.astype(x.dtype)

  def logits(self, h: jax.Array) -> jax.Array:
    """float32 logits [..., vocab] of final hidden states h [..., hidden_size], capped to
    C * tanh(logits / C) with final_logit_softcapping C (the greedy argmax, `_greedy`,
    needs no cap: tanh is increasing)."""
    logits = super().logits(h)
    cap = self.config.final_logit_softcapping
    return logits if cap is None else cap * jnp.tanh(logits / cap)


def from_pretrained(path, *, dtype=jnp.float32, param_dtype=None,
                    decode_impl: paged_nn.DecodeImpl = "auto") -> Gemma3ForCausalLM:
  """Loads a Hugging Face Gemma 3 (text) checkpoint directory (`models.llama`'s
  `load_pretrained`: its files, errors and eos ids).

  Args:
    path: as `models.llama.load_pretrained`'s.
    dtype, param_dtype, decode_impl: as for `models.llama.LlamaForCausalLM`.
  """
  return llama.load_pretrained(path, Gemma3Config.from_dict, functools.partial(
      Gemma3ForCausalLM, dtype=dtype, param_dtype=param_dtype, decode_impl=decode_impl))


FAMILY = ModelFamily(
    name="gemma3",
    model_types=MODEL_TYPES,
    from_pretrained=lambda path, dtype: from_pretrained(path, dtype=dtype),
    presets={},
)
