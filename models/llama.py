"""Llama (and Mistral, Ministral, Ministral 3, Qwen2, Qwen3, Phi-3, Granite, SmolLM3, Seed-OSS,
InternLM3, IQuest-Coder, CWM) in Flax NNX, decoding from a paged KV cache (`jax_paged.KVPool`).

The model is Hugging Face's `LlamaForCausalLM`: token embeddings, pre-RMSNorm blocks whose
attention rotates q and k (RoPE) and shares each kv head among a group of q heads (GQA),
a SwiGLU MLP, and an LM head (its own matrix, or tied to the embedding). The attention is
`jax_paged.nn.PagedAttention`, so the K/V cache lives in the pool's pages. Its relatives
differ in configuration and checkpoint names: Mistral attends within a sliding window
(Ministral, Ministral-8B, on the layers its layer_types name),
Qwen2 has q/k/v biases (and optionally a sliding window on its upper layers), Qwen3
RMS-normalises each head of q and k before RoPE (q_norm, k_norm), Phi-3 (Phi-3-mini
/ medium, Phi-3.5-mini, Phi-4, Phi-4-mini) stores q/k/v as one qkv_proj and gate / up as
one gate_up_proj, optionally attending within a sliding window on every layer (LongRoPE and
RoPE on part of each head: any of these configs may have them), Granite (IBM's Granite
3.x) scales the embeddings, the attention's scores, each residual branch and the logits
by four multipliers of its config (Granite SWA, "granite_swa", also attends within a
window on the layers its layer_types name, with a learned sink logit per head and a RoPE
base per layer, 0 for a NoPE layer: layer_rope_theta), SmolLM3 leaves RoPE out of the
layers its no_rope_layers marks 0 (every fourth by default: NoPE layers), and Seed-OSS (ByteDance's
Seed-OSS-36B) has q/k/v biases and, apart from them, optionally o's (attention_out_bias);
InternLM3 (internlm3-8b-instruct: HF serves it as Llama) names Llama's attention_bias
qkv_bias and its mlp_bias bias, IQuest-Coder (HF serves it as Llama too) is Llama of its
own default shape, CWM (Meta's Code World Model) attends within a window on three of
every four layers (layer_types), and Ministral 3 scales each query by its position
(llama_4_scaling_beta); an image-text "mistral3" config (Ministral 3, Mistral Small 3.x)
gives its text_config's model, the vision tower not loaded.

It meets `jax_paged.PagedModel`: `spec` gives the pool's shape, `prefill` and `decode` are
the forwards over the pool that `jax_paged`'s runner jits. Serve it with
`jax_paged.Engine` or `jax_paged.generate`; `FAMILY` is how the CLI finds it (the
`jax_paged.models` entry point).

`from_pretrained` loads Hugging Face checkpoint directories: config.json and
model.safetensors, or shards listed by model.safetensors.index.json (or PyTorch's
pytorch_model.bin, or its shards). HF's q_proj, k_proj and v_proj (torch Linear
weights, [out, in]) are transposed and concatenated into
`PagedAttention.qkv`'s [in, (H + 2 Hkv) D] kernel, gate_proj and up_proj into the MLP's
one `gate_up` kernel (Phi-3's fused qkv_proj and gate_up_proj are that layout already).
The eos ids are `generation_config.json`'s where it names them (what HF's `generate`
stops on: Phi-3's chat turns end with <|end|>, which config.json does not list).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import os
from typing import Any, Callable, ClassVar, Mapping

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
from flax import nnx

from jax_paged import lora
from jax_paged import nn as paged_nn
from jax_paged import pool as pool_lib
from jax_paged import tensor_parallel
from jax_paged import weight_quant
from jax_paged.kernels import validation
from jax_paged.paged_model import ModelFamily, ModelSpec, last_tokens

# config.json `model_type` values this module loads.
MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3", "phi3", "granite", "smollm3", "seed_oss",
               "internlm3", "ministral", "iquestcoder", "cwm", "ministral3", "mistral3",
               "granite_swa")
# Model types with Granite's multipliers (`LlamaConfig.embedding_multiplier`...).
_GRANITES = ("granite", "granitemoe", "granitemoeshared", "granite_swa", "granitemoe_swa")
# Granites with windows (layer_types), attention sinks and per-layer RoPE bases.
_GRANITE_SWAS = ("granite_swa", "granitemoe_swa")
# HF's config defaults of the model types whose shape is not `LlamaConfig`'s, which a
# config.json omitting a field gets there too: Seed-OSS-36B's, internlm3-8b's,
# IQuest-Coder's, CWM's (Meta's Code World Model: llama3 RoPE unless a config gives one).
_HF_DEFAULTS = {
    "seed_oss": dict(
        vocab_size=155136, hidden_size=4096, intermediate_size=27648, num_hidden_layers=64,
        num_attention_heads=80, num_key_value_heads=8, head_dim=128,
        max_position_embeddings=524288, rms_norm_eps=1e-6, bos_token_id=0, eos_token_id=2,
        attention_bias=True),
    "internlm3": dict(
        vocab_size=128512, hidden_size=4096, intermediate_size=10240, num_hidden_layers=48,
        num_attention_heads=32, num_key_value_heads=2, head_dim=128,
        max_position_embeddings=32768, rms_norm_eps=1e-5, bos_token_id=1, eos_token_id=2),
    "iquestcoder": dict(
        vocab_size=76800, hidden_size=5120, intermediate_size=27648, num_hidden_layers=80,
        num_attention_heads=40, num_key_value_heads=8, head_dim=128,
        max_position_embeddings=131072, rms_norm_eps=1e-5, bos_token_id=1, eos_token_id=2),
    "cwm": dict(
        vocab_size=128256, hidden_size=6144, intermediate_size=21504, num_hidden_layers=64,
        num_attention_heads=48, num_key_value_heads=8, head_dim=128,
        max_position_embeddings=131072, rms_norm_eps=1e-5, bos_token_id=128000,
        sliding_window=8192),
    "ministral3": dict(
        vocab_size=131072, hidden_size=4096, intermediate_size=14336, num_hidden_layers=34,
        num_attention_heads=32, num_key_value_heads=8, head_dim=128,
        max_position_embeddings=262144, rms_norm_eps=1e-5, bos_token_id=1, eos_token_id=2),
    # (HF's Granite classes scale the scores by their attention_multiplier, default 1.)
    **{t: dict(attention_multiplier=1.0) for t in _GRANITES if t not in _GRANITE_SWAS},
    **{t: dict(attention_multiplier=1.0, sliding_window=128) for t in _GRANITE_SWAS},
}
# HF's Ministral3Config RoPE for a config without one: YaRN, and the llama_4_scaling of
# the queries (`LlamaConfig.llama_4_scaling_beta`).
_MINISTRAL3_ROPE = {"rope_type": "yarn", "rope_theta": 1_000_000.0, "factor": 16.0,
                    "original_max_position_embeddings": 16384, "beta_fast": 32.0,
                    "beta_slow": 1.0, "mscale_all_dim": 1.0, "mscale": 1.0,
                    "llama_4_scaling_beta": 0.1}
_CWM_ROPE = {"rope_type": "llama3", "rope_theta": 1_000_000.0, "factor": 16.0,
             "high_freq_factor": 4.0, "low_freq_factor": 1.0,
             "original_max_position_embeddings": 8192}
_CWM_EOS = [128001, 128008, 128009]  # (HF's CwmConfig gives these for a null eos_token_id)
_LAYER_TYPES = ("full_attention", "sliding_attention")


def rotary(head_dim: int, theta: float, scaling: Any, max_position_embeddings: int,
           rotary_dim: int | None = None, max_model_len: int | None = None
           ) -> paged_nn.RotaryEmbedding:
  """The rotary embedding of a base `theta` and HF's `scaling` (a dict or its sorted
  items; None: none) over the first `rotary_dim` features of each head (None: all), for a
  model serving sequences of up to `max_model_len` positions (None: max_position_embeddings;
  it picks LongRoPE's factors, `longrope_scaling`); ValueError for a type or setting it
  does not support."""
  scaling = dict(scaling or ())
  rope_type = scaling.pop("rope_type", scaling.pop("type", "default"))
  if rope_type not in paged_nn.ROPE_TYPES:
    raise ValueError(f"rope_scaling type {rope_type!r} is not supported; use one of "
                     f"{paged_nn.ROPE_TYPES}")
  # (v5 configs repeat these here: `theta` and `rotary_dim` hold them)
  scaling.pop("rope_theta", None)
  scaling.pop("partial_rotary_factor", None)
  if rope_type in ("llama3", "yarn", "longrope"):
    scaling.setdefault("original_max_position_embeddings", max_position_embeddings)
  if rope_type == "yarn":
    scaling.update(yarn_scaling(scaling, max_position_embeddings))
  if rope_type == "longrope":
    scaling.update(longrope_scaling(scaling, max_position_embeddings,
                                    max_model_len or max_position_embeddings))
  known = {"factor", "low_freq_factor", "high_freq_factor",
           "original_max_position_embeddings", "beta_fast", "beta_slow", "truncate",
           "attention_factor", "ext_factors"}
  return paged_nn.RotaryEmbedding(
      head_dim, theta=float(theta), rope_type=rope_type, rotary_dim=rotary_dim,
      **{k: v for k, v in scaling.items() if k in known and v is not None})


def longrope_scaling(scaling: Mapping[str, Any], max_position_embeddings: int,
                     max_model_len: int) -> dict[str, Any]:
  """HF's LongRoPE settings (Phi-3's `rope_scaling` "longrope", or "su"), resolved as HF
  resolves them, with the factors chosen once for the whole model as vLLM chooses them:
  `long_factor` if it serves sequences longer than original_max_position_embeddings
  (max_model_len above it), else `short_factor`. (HF switches per forward pass, by the
  longest position in it, and re-prefills a sequence that grows past the original
  context; one set for every position keeps cached pages valid for every sequence that
  reads them, so the tokens are HF's for every sequence of the chosen regime.)
  `attention_factor`, when None: sqrt(1 + log(factor) / log(original)), where factor (when
  None) is max_position_embeddings / original_max_position_embeddings."""
  original = scaling["original_max_position_embeddings"]
  chosen = "long_factor" if max_model_len > original else "short_factor"
  factors = scaling.get(chosen)
  if not isinstance(factors, (list, tuple)):
    raise ValueError(f"longrope rope_scaling needs a {chosen} list (one factor per rotated "
                     f"pair), got {factors!r}")
  factor = scaling.get("factor")
  if factor is None:
    factor = max_position_embeddings / original
  attention_factor = scaling.get("attention_factor")
  if attention_factor is None:
    attention_factor = 1.0 if factor <= 1 else math.sqrt(1 + math.log(factor)
                                                          / math.log(original))
  return dict(ext_factors=tuple(float(f) for f in factors),
              attention_factor=float(attention_factor))


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
  """YaRN's magnitude scaling for a context `factor` (1 at or below 1)."""
  return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def yarn_scaling(scaling: Mapping[str, Any], max_position_embeddings: int) -> dict[str, Any]:
  """HF's YaRN settings resolved as HF resolves them: `factor` (when None, the ratio of
  max_position_embeddings to original_max_position_embeddings: DeepSeek-V3's) and
  `attention_factor` (when None, from factor and DeepSeek's mscale / mscale_all_dim, or
  from factor alone); beta_fast / beta_slow of 0 or None are YaRN's 32 / 1."""
  factor = scaling.get("factor")
  if factor is None:
    factor = max_position_embeddings / scaling["original_max_position_embeddings"]
  attention_factor = scaling.get("attention_factor")
  if attention_factor is None:
    mscale, mscale_all_dim = scaling.get("mscale"), scaling.get("mscale_all_dim")
    attention_factor = (yarn_mscale(factor, mscale) / yarn_mscale(factor, mscale_all_dim)
                        if mscale and mscale_all_dim else yarn_mscale(factor))
  return dict(factor=float(factor), attention_factor=float(attention_factor),
              beta_fast=float(scaling.get("beta_fast") or 32),
              beta_slow=float(scaling.get("beta_slow") or 1),
              truncate=bool(scaling.get("truncate", True)))


def per_layer_type_rope(rope: Any) -> tuple[dict[str, Any], dict[str, Any]]:
  """(the sliding layers', the full layers') RoPE dicts of transformers 5's per-layer-type
  rope_parameters (Gemma 3's, OLMo 3's); ValueError unless it holds a dict for each layer
  type, or if the sliding layers' is not the default RoPE."""
  if not (isinstance(rope, Mapping) and all(isinstance(rope.get(t), Mapping)
                                            for t in _LAYER_TYPES)):
    raise ValueError(f"rope_parameters must hold a dict for each of {_LAYER_TYPES}, "
                     f"got {rope!r}")
  sliding, full = dict(rope["sliding_attention"]), dict(rope["full_attention"])
  if hf_rope_scaling({"rope_type": "default", **sliding}) is not None:
    raise ValueError(f"the sliding layers' rope_type {sliding['rope_type']!r} is not "
                     "supported; use default")
  return sliding, full


def hf_head_dim(config: Mapping[str, Any], config_class: type) -> int:
  """An HF config dict's head_dim, or (absent or null) hidden_size // num_attention_heads,
  rounded down as HF's attention modules read it (defaults: `config_class`'s)."""
  if config.get("head_dim") is not None:
    return config["head_dim"]
  return (config.get("hidden_size", config_class.hidden_size)
          // config.get("num_attention_heads", config_class.num_attention_heads))


def hf_text_config(config: Mapping[str, Any], model_type: str | None = None
                   ) -> dict[str, Any]:
  """An image-text config dict's text_config (HF's defaults, {}, when absent) with the top
  level's eos / bos ids and tie_word_embeddings where it has them (HF's generate and weight
  tying read those), its model_type `model_type` where given (else text_config's own);
  ValueError unless text_config is a dict."""
  text = config.get("text_config")
  text = {} if text is None else text
  if not isinstance(text, Mapping):
    raise ValueError(f"text_config must be a dict, got {text!r}")
  top = {k: config[k] for k in ("eos_token_id", "bos_token_id", "tie_word_embeddings")
         if k in config}
  return {**text, **top, **({} if model_type is None else {"model_type": model_type})}


def hf_rope_scaling(scaling: Any) -> Any:
  """A config.json's RoPE scaling dict as `rotary` takes it: None for HF's "default" type
  (no scaling)."""
  if isinstance(scaling, Mapping) and scaling.get("rope_type",
                                                  scaling.get("type")) == "default":
    return None
  return scaling


def check_type_and_heads(config, model_types: tuple[str, ...]) -> None:
  """Raises ValueError unless `config.model_type` is one of `model_types` and its q heads
  are a multiple of its kv heads."""
  if config.model_type not in model_types:
    raise ValueError(f"model_type {config.model_type!r} is not supported; use one of "
                     f"{model_types}")
  if config.num_attention_heads % config.num_key_value_heads:
    raise ValueError(f"num_attention_heads ({config.num_attention_heads}) must be a multiple "
                     f"of num_key_value_heads ({config.num_key_value_heads})")


@dataclasses.dataclass(frozen=True)
class LlamaConfig:
  """Llama hyperparameters under Hugging Face's field names (defaults: Llama 2 7B's).

  Attributes beyond HF's LlamaConfig:
    model_type: "llama", "mistral", "ministral", "ministral3", "qwen2", "qwen3", "phi3",
      "granite", "smollm3", "seed_oss", "internlm3", "iquestcoder" or "cwm" (a "mistral3"
      config reads as its text_config's type), which decides the
      biases, Qwen3's q / k norms and the checkpoint's names: Llama's, Qwen3's, Granite's, SmolLM3's and InternLM3's
      `attention_bias` puts one on q, k, v and o; Qwen2 always has q/k/v biases and none
      on o; Seed-OSS's attention_bias is q/k/v's and attention_out_bias o's; Mistral and
      Phi-3 (and Ministral, CWM) have none.
    embedding_multiplier, residual_multiplier, attention_multiplier, logits_scaling:
      Granite's (HF's GraniteConfig; 1.0 and None elsewhere): the token embeddings are
      multiplied by embedding_multiplier, each attention and MLP output by
      residual_multiplier before its residual add, the attention scores by
      attention_multiplier (None: 1 / sqrt(head_dim)), and the logits divided by
      logits_scaling.
    sliding_window: W > 0 limits each token to the last W positions (Mistral, Phi-3;
      Qwen2 / Qwen3 / SmolLM3 with use_sliding_window), on the layers `layer_types` names
      "sliding_attention" (all of them when layer_types is None).
    no_rope_layers: SmolLM3's, one 1 (RoPE) or 0 (no position encoding: a NoPE layer)
      per layer, or None (RoPE on every layer).
    layer_rope_theta: Granite SWA's RoPE base per layer (0: a NoPE layer; rope_scaling
      applies to every base), or None (rope_theta on every layer).
    clip_qkv: c > 0 clamps q, k and v to [-c, c] after their projection, or None (OLMo's:
      `models.olmo` sets it; `from_dict` reads none).
    llama_4_scaling_beta: Ministral 3's (from its RoPE dict): each query at position p
      scaled by 1 + beta * log(1 + floor(p / the RoPE's original_max_position_embeddings))
      (`query_temperature`), or None.
    rope_scaling: HF's dict ({"rope_type": "linear" | "llama3" | "yarn" | "longrope",
      "factor": ...}) or None, kept as a sorted tuple of (key, value) pairs (lists as
      tuples) so that the config is hashable (a model's static structure).
    partial_rotary_factor: the fraction of each head's features RoPE rotates (the first
      int(head_dim * it), a positive even number: Phi-4-mini's 0.75).
    max_model_len: the longest sequence (prompt + new tokens) the model serves, at most
      max_position_embeddings; None: max_position_embeddings, or with LongRoPE
      original_max_position_embeddings (vLLM's default: the short factors, as HF below
      it). With LongRoPE it picks the factors (`longrope_scaling`): a max_model_len above
      the original context takes the long ones for every sequence.

  Class attribute `model_types`: the model_type values the config takes (a subclass's
  own: `models.moe`).
  """

  vocab_size: int = 32000
  hidden_size: int = 4096
  intermediate_size: int = 11008
  num_hidden_layers: int = 32
  num_attention_heads: int = 32
  num_key_value_heads: int | None = None  # None: num_attention_heads (MHA)
  head_dim: int | None = None  # None: hidden_size // num_attention_heads
  hidden_act: str = "silu"
  max_position_embeddings: int = 2048
  rms_norm_eps: float = 1e-6
  rope_theta: float = 10000.0
  rope_scaling: Any = None
  partial_rotary_factor: float = 1.0
  max_model_len: int | None = None
  tie_word_embeddings: bool = False
  attention_bias: bool = False
  mlp_bias: bool = False
  sliding_window: int | None = None
  layer_types: tuple[str, ...] | None = None
  no_rope_layers: tuple[int, ...] | None = None
  layer_rope_theta: tuple[float, ...] | None = None
  model_type: str = "llama"
  initializer_range: float = 0.02
  bos_token_id: int | None = 1
  eos_token_id: int | tuple[int, ...] | None = 2
  embedding_multiplier: float = 1.0
  residual_multiplier: float = 1.0
  attention_multiplier: float | None = None
  logits_scaling: float = 1.0
  clip_qkv: float | None = None
  attention_out_bias: bool = False  # (Seed-OSS's o bias)
  llama_4_scaling_beta: float | None = None

  model_types: ClassVar[tuple[str, ...]] = MODEL_TYPES
  # hidden_act -> the MLP's activation (a subclass's own: `models.starcoder2`'s GELUs).
  activations: ClassVar[Mapping[str, Callable[[jax.Array], jax.Array]]] = {
      "silu": jax.nn.silu}
  # Whether the MLP is `PlainMLP` (StarCoder2's, GPT-NeoX's) rather than SwiGLU's `MLP`.
  plain_mlp: ClassVar[bool] = False

  def __post_init__(self):
    set_ = functools.partial(object.__setattr__, self)
    if self.num_key_value_heads is None:
      set_("num_key_value_heads", self.num_attention_heads)
    if self.head_dim is None:
      if self.hidden_size % self.num_attention_heads:
        raise ValueError(f"hidden_size ({self.hidden_size}) must be a multiple of "
                         f"num_attention_heads ({self.num_attention_heads}) when head_dim "
                         "is not given")
      set_("head_dim", self.hidden_size // self.num_attention_heads)
    if isinstance(self.rope_scaling, Mapping):
      set_("rope_scaling", tuple(sorted(
          (k, tuple(v) if isinstance(v, list) else v) for k, v in self.rope_scaling.items())))
    if not (isinstance(self.partial_rotary_factor, (int, float))
            and 0 < self.partial_rotary_factor <= 1):
      raise ValueError(f"partial_rotary_factor must be in (0, 1], got "
                       f"{self.partial_rotary_factor!r}")
    scaling = dict(self.rope_scaling or ())
    if self.max_model_len is None:
      longrope = scaling.get("rope_type", scaling.get("type")) == "longrope"
      set_("max_model_len", min(scaling.get("original_max_position_embeddings",
                                            self.max_position_embeddings),
                                self.max_position_embeddings) if longrope
           else self.max_position_embeddings)
    elif validation.check_positive_int("max_model_len",
                                       self.max_model_len) > self.max_position_embeddings:
      raise ValueError(f"max_model_len must be at most max_position_embeddings="
                       f"{self.max_position_embeddings}, got {self.max_model_len}")
    if isinstance(self.eos_token_id, list):
      set_("eos_token_id", tuple(self.eos_token_id))
    if self.layer_types is not None:
      set_("layer_types", tuple(self.layer_types))
    if self.no_rope_layers is not None:
      set_("no_rope_layers", tuple(self.no_rope_layers))
      if (len(self.no_rope_layers) < self.num_hidden_layers
          or any(x not in (0, 1) for x in self.no_rope_layers)):
        raise ValueError(f"no_rope_layers must give 1 (RoPE) or 0 (NoPE) for each of the "
                         f"{self.num_hidden_layers} layers, got {self.no_rope_layers}")
    if self.layer_rope_theta is not None:
      set_("layer_rope_theta", tuple(self.layer_rope_theta))
      if (len(self.layer_rope_theta) != self.num_hidden_layers
          or any(not (isinstance(t, (int, float)) and t >= 0) for t in self.layer_rope_theta)):
        raise ValueError(f"layer_rope_theta must give a RoPE base >= 0 (0: NoPE) for each of "
                         f"the {self.num_hidden_layers} layers, got {self.layer_rope_theta}")
    check_type_and_heads(self, self.model_types)
    for name in ("embedding_multiplier", "residual_multiplier", "logits_scaling"):
      set_(name, validation.check_positive_number(name, getattr(self, name)))
    set_("attention_multiplier", validation.check_positive_number(
        "attention_multiplier", self.attention_multiplier, optional=True))
    set_("clip_qkv", validation.check_positive_number("clip_qkv", self.clip_qkv,
                                                      optional=True))
    if self.residual_multiplier != 1.0 and (self.attention_bias or self.mlp_bias):
      # (The branches are scaled at the projections' inputs, which would miss a bias.)
      raise ValueError(f"residual_multiplier {self.residual_multiplier} with attention_bias "
                       "or mlp_bias is not supported (Granite's checkpoints have no biases)")
    if self.hidden_act not in self.activations:
      raise ValueError(f"hidden_act {self.hidden_act!r} is not supported; use one of "
                       f"{tuple(self.activations)}")
    if self.layer_types is not None and (
        len(self.layer_types) != self.num_hidden_layers
        or any(t not in _LAYER_TYPES for t in self.layer_types)):
      raise ValueError(f"layer_types must list one of {_LAYER_TYPES} per layer "
                       f"({self.num_hidden_layers}), got {self.layer_types}")
    self.rope  # validates rope_theta and rope_scaling
    self.query_temperature  # validates llama_4_scaling_beta

  @property
  def rotary_dim(self) -> int:
    """The features of each head RoPE rotates (the first ones), as HF counts them."""
    return int(self.head_dim * self.partial_rotary_factor)

  @property
  def rope(self) -> paged_nn.RotaryEmbedding:
    """The rotary embedding of rope_theta and rope_scaling over `rotary_dim` features, for
    sequences of up to max_model_len; ValueError naming partial_rotary_factor where
    `rotary_dim` is not a positive even number."""
    return self._rope_of(self.rope_theta)

  def _rope_of(self, theta: float) -> paged_nn.RotaryEmbedding:
    """`rope` with the base `theta`."""
    dim = self.rotary_dim
    if dim < 2 or dim % 2:
      raise ValueError(f"partial_rotary_factor {self.partial_rotary_factor} of head_dim "
                       f"{self.head_dim} rotates {dim} features; RoPE needs a positive even "
                       "number")
    return rotary(self.head_dim, theta, self.rope_scaling,
                  self.max_position_embeddings, rotary_dim=None if dim == self.head_dim
                  else dim, max_model_len=self.max_model_len)

  def layer_rope(self, layer: int) -> paged_nn.RotaryEmbedding | None:
    """Layer `layer`'s rotary embedding (None: a NoPE layer of SmolLM3's or Granite
    SWA's)."""
    if self.no_rope_layers is not None and not self.no_rope_layers[layer]:
      return None
    if self.layer_rope_theta is not None:
      theta = self.layer_rope_theta[layer]
      return self._rope_of(theta) if theta else None
    return self.rope

  @property
  def query_temperature(self) -> paged_nn.QueryTemperature | None:
    """The queries' scale by position (`llama_4_scaling_beta`), or None."""
    if self.llama_4_scaling_beta is None:
      return None
    original = dict(self.rope_scaling or ()).get("original_max_position_embeddings")
    if original is None:
      raise ValueError("llama_4_scaling_beta needs the RoPE's "
                       "original_max_position_embeddings")
    return paged_nn.QueryTemperature(original, self.llama_4_scaling_beta).check()

  def window(self, layer: int) -> int | None:
    """Layer `layer`'s sliding window (None: full causal attention)."""
    if self.layer_types is not None and self.layer_types[layer] != "sliding_attention":
      return None
    return self.sliding_window

  @property
  def qkv_bias(self) -> bool:
    return self.model_type == "qwen2" or self.attention_bias

  @property
  def alibi_slopes(self) -> np.ndarray | None:
    """ALiBi's per-head slopes on the attention logits (`nn.PagedAttention`), or None (a
    subclass's own: Falcon-RW's)."""
    return None

  @property
  def attention_sinks(self) -> bool:
    """Whether each attention head has a learned sink logit (`nn.PagedAttention(sinks=)`:
    Granite SWA's; a subclass's own: GPT-OSS's)."""
    return self.model_type in _GRANITE_SWAS

  @property
  def out_bias(self) -> bool:
    if self.model_type == "seed_oss":
      return self.attention_out_bias
    return self.attention_bias and self.model_type in ("llama", "qwen3", "qwen3_moe", "olmoe",
                                                       "smollm3", "internlm3", *_GRANITES)

  def make_norm(self, param_dtype) -> paged_nn.RMSNorm | paged_nn.LayerNorm:
    """A new norm over hidden_size of the blocks' kind: RMSNorm(rms_norm_eps) (a
    subclass's own: StarCoder2's and GPT-NeoX's LayerNorms)."""
    return paged_nn.RMSNorm(self.hidden_size, epsilon=self.rms_norm_eps,
                            param_dtype=param_dtype)

  def make_head_norm(self, width: int, param_dtype) -> paged_nn.RMSNorm | paged_nn.LayerNorm:
    """A new q / k norm over `width` features (`qk_norm`): RMSNorm(rms_norm_eps) (a
    subclass's own: Persimmon's LayerNorms)."""
    return paged_nn.RMSNorm(width, epsilon=self.rms_norm_eps, param_dtype=param_dtype)

  @property
  def activation(self) -> Callable[[jax.Array], jax.Array]:
    """The MLP's activation (SwiGLU's gate's: silu)."""
    return self.activations[self.hidden_act]

  @property
  def qk_norm(self) -> bool:
    """Whether q and k are RMS-normalised before RoPE: each head (Qwen3), or all heads
    together (`qk_norm_all_heads`: OLMoE)."""
    return self.model_type in ("qwen3", "qwen3_moe", "olmoe")

  @property
  def qk_norm_after_rope(self) -> bool:
    """Whether the q / k norms of each head apply after RoPE (`models.hunyuan`'s)."""
    return False

  @property
  def qk_norm_all_heads(self) -> bool:
    """Whether the q / k norms span all heads together (OLMoE's) rather than each head."""
    return self.model_type == "olmoe"

  @classmethod
  def from_dict(cls, config: dict[str, Any]) -> "LlamaConfig":
    """From a Hugging Face config dict (transformers 4's rope_theta / rope_scaling or 5's
    rope_parameters); fields this model does not use are ignored, and each model_type's
    are read as its HF class reads them."""
    config = dict(config)
    model_type = config.setdefault("model_type", cls.model_type)
    if model_type not in cls.model_types:
      raise ValueError(f"model_type {model_type!r} is not supported; use one of "
                       f"{cls.model_types}")
    if model_type == "mistral3":  # (Mistral Small 3.x, Ministral 3: the vision tower unread)
      config = hf_text_config(config)
      model_type = config.setdefault("model_type", "mistral")  # (HF's Mistral3Config's)
      if model_type not in ("mistral", "ministral3"):
        raise ValueError(f"mistral3's text_config model_type must be 'mistral' or "
                         f"'ministral3', got {model_type!r}")
    config = {**_HF_DEFAULTS.get(model_type, {}), **config}
    if model_type == "ministral3" and not any(
        config.get(k) is not None for k in ("rope_parameters", "rope_scaling", "rope_theta")):
      config["rope_parameters"] = _MINISTRAL3_ROPE
    if model_type == "cwm":
      if not any(config.get(k) is not None
                 for k in ("rope_parameters", "rope_scaling", "rope_theta")):
        config["rope_parameters"] = _CWM_ROPE
      if config.get("eos_token_id") is None:
        config["eos_token_id"] = _CWM_EOS
      if config.get("layer_types") is None:  # HF's: every fourth layer full, from layer 0
        config["layer_types"] = ["full_attention" if i % 4 == 0 else "sliding_attention"
                                 for i in range(config["num_hidden_layers"])]
      config["sliding_window"] = config.get("sliding_window") or None
    if model_type in _GRANITE_SWAS and config.get("layer_types") is None:
      # HF's: every fourth layer full, from layer 0
      config["layer_types"] = ["full_attention" if i % 4 == 0 else "sliding_attention"
                               for i in range(config.get("num_hidden_layers", 32))]
    if model_type not in _GRANITE_SWAS:
      config.pop("layer_rope_theta", None)
    if model_type == "iquestcoder":  # (HF's IQuestCoderConfig refuses both)
      for name in ("clip_qkv", "use_sliding_window"):
        if config.get(name):
          raise ValueError(f"{name} {config[name]!r} is not supported for IQuest-Coder")
    rope = config.pop("rope_parameters", None)
    if rope is not None:  # transformers 5: theta and scaling in one dict
      if not isinstance(rope, Mapping) or not isinstance(rope.get("rope_type", ""), str):
        raise ValueError(f"rope_parameters must be one dict (per-layer RoPE is not "
                         f"supported), got {rope!r}")
      config.setdefault("rope_theta", rope.get("rope_theta", 10000.0))
      config["rope_scaling"] = rope
    scaling = config.get("rope_scaling")
    if isinstance(scaling, Mapping):
      scaling = dict(scaling)
      if model_type == "ministral3":  # (HF's Ministral 3 attention reads it there)
        config["llama_4_scaling_beta"] = scaling.pop("llama_4_scaling_beta", None)
      scaling.pop("max_position_embeddings", None)  # (Ministral 3's copy of the config's)
      if scaling.get("partial_rotary_factor") is not None:  # (transformers 5 keeps it here)
        config["partial_rotary_factor"] = scaling["partial_rotary_factor"]
      # HF's order: rope_type, else the older "type", else "default".
      legacy = scaling.pop("type", "default")
      rope_type = scaling.get("rope_type", legacy)
      if model_type == "phi3" and rope_type in ("su", "yarn"):
        rope_type = "longrope"  # (HF's Phi3Config reads Phi-3's early names so)
      scaling["rope_type"] = rope_type
      # A config's own original context (Phi-3's, beside rope_scaling) wins, as in HF.
      if (rope_type in ("llama3", "yarn", "longrope")
          and config.get("original_max_position_embeddings") is not None):
        scaling["original_max_position_embeddings"] = config["original_max_position_embeddings"]
    if config.get("partial_rotary_factor") is None:
      config.pop("partial_rotary_factor", None)
    config["rope_scaling"] = hf_rope_scaling(scaling)
    if model_type == "qwen3":
      config.setdefault("head_dim", 128)  # HF's Qwen3Config default, not hidden / heads
    if model_type == "internlm3":  # its names (HF's attribute_map) for the biases
      for theirs, ours in (("qkv_bias", "attention_bias"), ("bias", "mlp_bias")):
        if theirs in config:
          config[ours] = config.pop(theirs)
      if config.get("attention_bias", False) != config.get("mlp_bias", False):
        raise ValueError("InternLM3 with qkv_bias different from bias is not supported "
                         "(HF's Llama model gives q / k / v / o and the MLP one setting each, "
                         "and refuses them apart)")
    if model_type == "smollm3":
      # HF's SmolLM3Config defaults: its own RoPE base; a NoPE layer every
      # no_rope_layer_interval layers; windows (with use_sliding_window) on NoPE layers.
      config.setdefault("rope_theta", 2000000.0)
      config.setdefault("tie_word_embeddings", True)
      layers = config.get("num_hidden_layers", 32)
      if config.get("no_rope_layers") is None:
        interval = config.get("no_rope_layer_interval", 4)
        config["no_rope_layers"] = [int((i + 1) % interval != 0) for i in range(layers)]
      if config.get("layer_types") is None:
        config["layer_types"] = [
            "sliding_attention" if config.get("sliding_window") is not None
            and not config["no_rope_layers"][i] else "full_attention" for i in range(layers)]
    # Windows: Llama has none; Mistral, Phi-3 and Mixtral one on every layer (if any),
    # Ministral on its layer_types' sliding layers (without them, every layer);
    # Qwen2 / Qwen3 one with use_sliding_window, from max_window_layers on (Qwen2-MoE's
    # layer_types: `models.moe`); Qwen3-MoE one with use_sliding_window, on every layer.
    if model_type in ("llama", "internlm3", "iquestcoder", *_GRANITES) and (
        model_type not in _GRANITE_SWAS):
      config.pop("sliding_window", None)
    if model_type not in _GRANITES:  # (their HF classes have no such fields)
      for name in ("embedding_multiplier", "residual_multiplier", "attention_multiplier",
                   "logits_scaling"):
        config.pop(name, None)
    config.pop("clip_qkv", None)  # (OLMo's: `models.olmo`)
    if (model_type in ("qwen2", "qwen2_moe", "qwen3", "qwen3_moe", "smollm3")
        and not config.get("use_sliding_window", False)):
      config["sliding_window"] = None
    if model_type not in ("qwen2", "qwen2_moe", "qwen3", "smollm3", "ministral", "cwm",
                          *_GRANITE_SWAS):
      config.pop("layer_types", None)
    elif (model_type not in ("ministral", "cwm", *_GRANITE_SWAS)
          and config.get("layer_types") is None
          and config.get("sliding_window") is not None):
      first = config.get("max_window_layers", 28)
      config["layer_types"] = ["sliding_attention" if i >= first else "full_attention"
                               for i in range(config.get("num_hidden_layers", 32))]
    # Biases: Mistral, Ministral, Phi-3 and Mixtral have none; Qwen2 always q/k/v's, never
    # o's (`qkv_bias`, `out_bias`); the others attention_bias's.
    if model_type in ("mistral", "ministral", "ministral3", "cwm", "phi3", "mixtral", "qwen2"):
      config.pop("attention_bias", None)
    if model_type != "ministral3":
      config.pop("llama_4_scaling_beta", None)
    names = {f.name for f in dataclasses.fields(cls)}
    return cls(**{k: v for k, v in config.items() if k in names})


class MLP(nnx.Module):
  """SwiGLU: down(silu(gate(x)) * up(x)) (GeGLU with a config whose `activation` is
  gelu), gate and up as one [hidden, 2 * intermediate] projection (`gate_up`: gate's
  columns, then up's)."""

  def __init__(self, config: LlamaConfig, *, dtype, param_dtype, rngs: nnx.Rngs):
    self.activation = config.activation
    init = nnx.initializers.normal(config.initializer_range)
    self.gate_up = nnx.Linear(config.hidden_size, 2 * config.intermediate_size,
                              use_bias=config.mlp_bias, kernel_init=init, dtype=dtype,
                              param_dtype=param_dtype, rngs=rngs)
    self.down = nnx.Linear(config.intermediate_size, config.hidden_size, use_bias=config.mlp_bias,
                           kernel_init=init, dtype=dtype, param_dtype=param_dtype, rngs=rngs)

  def hidden(self, x: jax.Array, adapters: jax.Array | None = None) -> jax.Array:
    """silu(gate(x)) * up(x) [..., intermediate] (with the rows' LoRA `adapters`); the
    block applies `down` with its residual add (`jax_paged.nn.project_add_norm`)."""
    # The width from the kernel: a tensor parallel device holds its share of it.
    width = weight_quant.columns(self.gate_up) // 2
    gate, up = paged_nn.dense(self.gate_up, x, sections=(width, width), adapters=adapters)
    return self.activation(gate) * up


class PlainMLP(nnx.Module):
  """c_proj(activation(c_fc(x))): the ungated MLP of StarCoder2 and GPT-NeoX (HF's c_fc /
  c_proj, dense_h_to_4h / dense_4h_to_h), biases with mlp_bias."""

  def __init__(self, config: LlamaConfig, *, dtype, param_dtype, rngs: nnx.Rngs):
    self.activation = config.activation
    linear = functools.partial(nnx.Linear, use_bias=config.mlp_bias,
                               kernel_init=nnx.initializers.normal(config.initializer_range),
                               dtype=dtype, param_dtype=param_dtype, rngs=rngs)
    self.c_fc = linear(config.hidden_size, config.intermediate_size)
    self.c_proj = linear(config.intermediate_size, config.hidden_size)

  @property
  def down(self) -> nnx.Linear:
    """The projection a block adds to the stream (`DecoderLayer`'s name, as `MLP`'s)."""
    return self.c_proj

  def hidden(self, x: jax.Array, adapters: jax.Array | None = None) -> jax.Array:
    """activation(c_fc(x)) [..., intermediate] (one kernel at decode's few rows,
    `nn.dense`; with the rows' LoRA `adapters`); the block applies `c_proj` with its
    residual add and the next norm."""
    return paged_nn.dense(self.c_fc, x, activation=self.activation, adapters=adapters)


# attend(attention layer, normalised x, pool, layer index) -> (attention output before
# the layer's `out` projection, pool)
Attend = Callable[[paged_nn.PagedAttention, jax.Array, pool_lib.KVPool, int],
                  tuple[jax.Array, pool_lib.KVPool]]


class DecoderLayer(nnx.Module):
  """A pre-norm block: attention, then an MLP (`_make_mlp`'s: a subclass's own, as
`models.moe`'s experts), each added to the residual stream; the config's norms
(`LlamaConfig.make_norm`)."""

  def __init__(self, config: LlamaConfig, layer: int, *, dtype, param_dtype,
               decode_impl: paged_nn.DecodeImpl, rngs: nnx.Rngs):
    self.input_layernorm = config.make_norm(param_dtype)
    self.self_attn = self._make_attention(config, layer, decode_impl=decode_impl,
                                          dtype=dtype, param_dtype=param_dtype, rngs=rngs)
    self.post_attention_layernorm = config.make_norm(param_dtype)
    self.mlp = self._make_mlp(config, layer, dtype=dtype, param_dtype=param_dtype,
                              rngs=rngs)
    self.residual_multiplier = config.residual_multiplier

  def _make_attention(self, config: LlamaConfig, layer: int, *, decode_impl, param_dtype,
                      **kwargs) -> nnx.Module:
    """Layer `layer`'s attention (`nn.PagedAttention`; a subclass's own takes its
    `prefill` / `decode` and has an `out` projection; kwargs: dtype, rngs)."""
    return paged_nn.PagedAttention(
        config.hidden_size, config.num_attention_heads, config.head_dim,
        num_kv_heads=config.num_key_value_heads, scale=config.attention_multiplier,
        qkv_bias=config.qkv_bias, out_bias=config.out_bias, rope=config.layer_rope(layer),
        sliding_window=config.window(layer), alibi_slopes=config.alibi_slopes,
        clip_qkv=config.clip_qkv, sinks=config.attention_sinks,
        head_norm=(functools.partial(config.make_head_norm, param_dtype=param_dtype)
                   if config.qk_norm else None),
        qk_norm_all_heads=config.qk_norm_all_heads,
        qk_norm_after_rope=config.qk_norm_after_rope,
        query_temperature=config.query_temperature, decode_impl=decode_impl,
        kernel_init=nnx.initializers.normal(config.initializer_range),
        param_dtype=param_dtype, **kwargs)

  def _make_mlp(self, config: LlamaConfig, layer: int, **kwargs) -> nnx.Module:
    """Layer `layer`'s MLP (`MLP`, or `PlainMLP` with the config's plain_mlp; kwargs:
    dtype, param_dtype, rngs)."""
    del layer
    return (PlainMLP if config.plain_mlp else MLP)(config, **kwargs)

  def __call__(self, x: jax.Array, h: jax.Array, kv: pool_lib.KVPool, layer: int,
               attend: Attend, next_norm: paged_nn.RMSNorm,
               adapters: jax.Array | None = None
               ) -> tuple[jax.Array, jax.Array, pool_lib.KVPool]:
    """x [..., hidden] the residual stream and h = input_layernorm(x) -> (the new stream,
    its `next_norm` (the next layer's input_layernorm, or the final norm), the pool). Each
    residual add is fused with the projection before it and the norm after it
    (`project_add_norm`); `adapters`: the rows' LoRA slots, or None."""
    a, kv = attend(self.self_attn, h, kv, layer)
    x, h = paged_nn.project_add_norm(self.self_attn.out, self._scaled(a), x,
                                     self.post_attention_layernorm, adapters=adapters)
    x, h = self._mlp_add_norm(x, h, next_norm, adapters)
    return x, h, kv

  def _mlp_add_norm(self, x: jax.Array, h: jax.Array, next_norm: paged_nn.RMSNorm,
                    adapters: jax.Array | None) -> tuple[jax.Array, jax.Array]:
    """(x + mlp(h), its next_norm), `down`'s reduction, the add and the norm fused."""
    return paged_nn.project_add_norm(self.mlp.down, self._scaled(self.mlp.hidden(h, adapters)),
                                     x, next_norm, adapters=adapters)

  def _scaled(self, a: jax.Array) -> jax.Array:
    """a times residual_multiplier (Granite's): a residual branch's output projection's
    input, so that its output (LoRA updates included) is scaled alike, in the kernels that
    add it to the stream."""
    return _times(a, self.residual_multiplier)


def _times(x: jax.Array, factor: float) -> jax.Array:
  """x * factor in x's dtype (Granite's multipliers; x itself where the factor is 1)."""
  return x if factor == 1.0 else x * jnp.asarray(factor, x.dtype)


def mlp_splits(mlp: MLP) -> list[tuple[nnx.Linear, tensor_parallel.Split]]:
  """A SwiGLU MLP's tensor parallel splits: gate_up column-parallel with gate and up each
  split (a device gets the matching columns of both), down row-parallel."""
  return [(mlp.gate_up, tensor_parallel.Split("column", (mlp.down.in_features,) * 2)),
          (mlp.down, tensor_parallel.ROW)]


class LlamaForCausalLM(nnx.Module):
  """Llama / Mistral / Qwen2 / Qwen3 / Phi-3 / Granite / SmolLM3 with an LM head, attending
  through a `KVPool`.

  Args:
    config: the hyperparameters.
    dtype: compute dtype (activations; the pool should match it).
    param_dtype: parameter storage dtype; defaults to `dtype`.
    decode_impl: the decode attention, see `jax_paged.nn.PagedAttention`.
    rngs: initialisation randomness (normal(initializer_range) weights, as HF does).
  """

  # The blocks (a subclass's own: `models.gemma3`).
  decoder_layer = DecoderLayer
  # The pool layer of the first block (`jax_paged.PagedModel`: a draft model's sit after
  # its target's).
  pool_layer_offset = 0

  def __init__(self, config: LlamaConfig, *, dtype=jnp.float32, param_dtype=None,
               decode_impl: paged_nn.DecodeImpl = "auto", rngs: nnx.Rngs):
    param_dtype = dtype if param_dtype is None else param_dtype
    self.config = config
    self.dtype = dtype
    init = nnx.initializers.normal(config.initializer_range)
    embed = functools.partial(nnx.Embed, config.vocab_size, config.hidden_size,
                              embedding_init=init, dtype=dtype, param_dtype=param_dtype,
                              rngs=rngs)
    self.embed_tokens = embed()
    self.layers = nnx.List([self.decoder_layer(config, i, dtype=dtype,
                                               param_dtype=param_dtype,
                                               decode_impl=decode_impl, rngs=rngs)
                            for i in range(config.num_hidden_layers)])
    self.norm = self._make_norm(config, param_dtype)
    # HF's lm_head weight is [vocab, hidden], an embedding table's layout: `attend` and
    # the greedy kernel take it as it is, tied or not.
    self.lm_head = None if config.tie_word_embeddings else embed()

  def _make_norm(self, config: LlamaConfig, param_dtype
                 ) -> paged_nn.RMSNorm | paged_nn.LayerNorm:
    """The final norm: the config's kind (`LlamaConfig.make_norm`; a subclass's own:
    `models.gemma3`'s)."""
    return config.make_norm(param_dtype)

  @property
  def spec(self) -> ModelSpec:
    """The pool's shape, the vocabulary and the context limit (`jax_paged.PagedModel`)."""
    c = self.config
    return ModelSpec(num_layers=c.num_hidden_layers, num_kv_heads=c.num_key_value_heads,
                     head_dim=c.head_dim, vocab_size=c.vocab_size,
                     max_positions=c.max_model_len, dtype=self.dtype,
                     eos_token_id=c.eos_token_id)

  def tensor_parallel_splits(self) -> list[tuple[nnx.Linear, tensor_parallel.Split]]:
    """The MLP's gate_up column-parallel (gate and up each split, so that a device gets
    the matching columns of both) and down row-parallel; a `PlainMLP`'s c_fc
    column-parallel and c_proj row-parallel (`jax_paged.PagedModel`; the attention is
    split by head by `jax_paged.tensor_parallel` itself). Layers whose MLP is neither are
    a subclass's to add (`models.moe` adds its experts')."""
    splits = []
    for layer in self.layers:
      if isinstance(layer.mlp, MLP):
        splits += mlp_splits(layer.mlp)
      elif isinstance(layer.mlp, PlainMLP):
        splits += [(layer.mlp.c_fc, tensor_parallel.COLUMN),
                   (layer.mlp.c_proj, tensor_parallel.ROW)]
    return splits

  def lora_targets(self) -> dict[str, lora.Target]:
    """Hugging Face module name -> where its LoRA update lands (`jax_paged.PagedModel`):
    q_proj, k_proj and v_proj in our fused qkv's columns, gate_proj and up_proj in
    gate_up's (Phi-3's qkv_proj and gate_up_proj: all of them), o_proj and down_proj
    whole, a `PlainMLP`'s c_fc and c_proj whole; the attention's only where the MLP is
    neither (`models.moe`'s experts)."""
    c = self.config
    q, kv = c.num_attention_heads * c.head_dim, c.num_key_value_heads * c.head_dim
    targets = {}
    for i, layer in enumerate(self.layers):
      attn, mlp = layer.self_attn, layer.mlp
      if c.model_type == "phi3":
        found = [("self_attn.qkv_proj", lora.Target(attn.qkv))]
      else:
        found = [("self_attn.q_proj", lora.Target(attn.qkv, 0, q)),
                 ("self_attn.k_proj", lora.Target(attn.qkv, q, kv)),
                 ("self_attn.v_proj", lora.Target(attn.qkv, q + kv, kv))]
      found.append(("self_attn.o_proj", lora.Target(attn.out)))
      if isinstance(mlp, MLP):
        width = c.intermediate_size
        found += ([("mlp.gate_up_proj", lora.Target(mlp.gate_up))] if c.model_type == "phi3"
                  else [("mlp.gate_proj", lora.Target(mlp.gate_up, 0, width)),
                        ("mlp.up_proj", lora.Target(mlp.gate_up, width, width))])
        found.append(("mlp.down_proj", lora.Target(mlp.down)))
      elif isinstance(mlp, PlainMLP):
        found += [("mlp.c_fc", lora.Target(mlp.c_fc)), ("mlp.c_proj", lora.Target(mlp.c_proj))]
      for name, target in found:
        targets[f"model.layers.{i}.{name}"] = target
    return targets

  def _forward(self, tokens: jax.Array, kv: pool_lib.KVPool, attend: Attend,
               adapters: jax.Array | None) -> tuple[jax.Array, pool_lib.KVPool]:
    """-> (the final norm of the residual stream, pool). Positions enter through the
    attention's rotary embedding only."""
    x = self._embed(tokens)
    norms = [block.input_layernorm for block in self.layers] + [self.norm]
    h = norms[0](x)
    for layer, block in enumerate(self.layers):
      x, h, kv = block(x, h, kv, self.pool_layer_offset + layer, attend, norms[layer + 1],
                       adapters)
    return h, kv

  def _embed(self, tokens: jax.Array) -> jax.Array:
    return _times(self.embed_tokens(tokens), self.config.embedding_multiplier)

  def _head(self) -> nnx.Embed:
    return self.embed_tokens if self.lm_head is None else self.lm_head

  def logits(self, h: jax.Array) -> jax.Array:
    """float32 logits [..., vocab] of final hidden states h [..., hidden_size]
    (`prefill_hidden`'s), divided by logits_scaling (the greedy argmax, `_greedy`, needs
    no division: it is positive)."""
    logits = self._head().attend(h).astype(jnp.float32)
    # (Gemma's config, on these blocks, has no logits_scaling.)
    scale = getattr(self.config, "logits_scaling", 1.0)
    return logits if scale == 1.0 else logits / scale

  def _greedy(self, h: jax.Array) -> jax.Array:
    """int32 argmax of `logits(h)` without writing the logits."""
    return paged_nn.attend_argmax(self._head(), h)

  def prefill_hidden(self, tokens: jax.Array, kv: pool_lib.KVPool, slots: jax.Array,
                     lengths: jax.Array, *, start: jax.Array | None = None,
                     page_table: jax.Array | None = None, adapters: jax.Array | None = None
                     ) -> tuple[jax.Array, pool_lib.KVPool]:
    """New tokens of several sequences (`jax_paged.PagedModel.prefill_hidden`).

    Args:
      tokens: int32 [B, T], right-padded.
      kv: the pool, with slots reserved.
      slots: int32 [B, T] from `reserve`, -1 at padding.
      lengths: int32 [B] >= 1, the new tokens per row.
      start: None for fresh sequences, or int32 [B] tokens already in each sequence's
        pages (a cached prefix, earlier chunks): the new tokens sit at positions start + t
        (the attention rotates them there).
      page_table: int32 [B, max_pages_per_seq], the batch's rows (with `start`).
      adapters: int32 [B], each row's LoRA slot (-1: none), or None (`jax_paged.lora`).

    Returns:
      (the final norm of every new token [B, T, hidden_size] in the compute dtype, pool).
    """
    return self._forward(
        tokens, kv,
        lambda attn, h, kv, layer: attn.prefill(h, kv, layer, slots, lengths, start=start,
                                                page_table=page_table, project=False,
                                                adapters=adapters),
        adapters)

  def prefill(self, tokens: jax.Array, kv: pool_lib.KVPool, slots: jax.Array,
              lengths: jax.Array, *, start: jax.Array | None = None,
              page_table: jax.Array | None = None, adapters: jax.Array | None = None
              ) -> tuple[jax.Array, pool_lib.KVPool]:
    """`prefill_hidden`, then float32 logits [B, vocab] of each row's last new token
    (`jax_paged.PagedModel.prefill`)."""
    h, kv = self.prefill_hidden(tokens, kv, slots, lengths, start=start,
                                page_table=page_table, adapters=adapters)
    return self.logits(last_tokens(h, lengths)), kv

  def decode(self, tokens: jax.Array, positions: jax.Array, kv: pool_lib.KVPool,
             slots: jax.Array, page_table: jax.Array, lengths: jax.Array, *,
             greedy: bool = False, adapters: jax.Array | None = None
             ) -> tuple[jax.Array, pool_lib.KVPool]:
    """One token per sequence (`jax_paged.PagedModel.decode`).

    Args:
      tokens: int32 [B].
      positions: int32 [B], unused: the attention rotates to lengths - 1, the same.
      kv: the pool, with slots reserved.
      slots: int32 [B] from `reserve`, -1 for inactive rows.
      page_table: int32 [B, max_pages_per_seq], the batch's rows of `kv.page_table`.
      lengths: int32 [B], tokens to attend to including the new one (0 = inactive).
      greedy: return the argmax tokens instead of the logits.
      adapters: int32 [B], each row's LoRA slot (-1: none), or None (`jax_paged.lora`).

    Returns:
      (float32 logits [B, vocab], or with `greedy` their int32 argmax [B], pool).
    """
    del positions
    h, kv = self._forward(
        tokens, kv,
        lambda attn, h, kv, layer: attn.decode(h, kv, layer, slots, page_table, lengths,
                                               project=False, adapters=adapters),
        adapters)
    return (self._greedy(h) if greedy else self.logits(h)), kv


# ----------------------------------------------------------------- checkpoints
class _TorchFile:
  """A PyTorch checkpoint file's tensors (`torch.load`, weights only), as a safetensors
  handle offers them: `keys()`, `get_tensor(name)` (a jax array, bfloat16 kept)."""

  def __init__(self, file: str):
    import torch  # an optional dependency: imported when used
    try:
      state = torch.load(file, map_location="cpu", weights_only=True)
    except Exception as e:  # pickle, zip and OS errors alike
      raise ValueError(f"{file}: not a readable PyTorch checkpoint ({e})") from e
    if not isinstance(state, dict) or not all(isinstance(t, torch.Tensor)
                                              for t in state.values()):
      raise ValueError(f"{file}: not a PyTorch state dict of tensors")
    self.tensors = {name: (t.view(torch.int16).numpy().view(ml_dtypes.bfloat16)
                           if t.dtype == torch.bfloat16 else t.numpy())
                    for name, t in state.items()}

  def keys(self) -> list[str]:
    return list(self.tensors)

  def get_tensor(self, name: str) -> jax.Array:
    return jnp.asarray(self.tensors[name])


class _Checkpoint:
  """The tensors of a safetensors checkpoint directory, one file or shards, read lazily
  (each by name, as jax arrays: numpy has no bfloat16); or of a PyTorch one
  (pytorch_model.bin or its shards, each file read whole: `_TorchFile`).

  With `fp8_block` (a checkpoint of Hugging Face's "fp8" quantization: DeepSeek-V3's,
  Qwen3's *-FP8), a float8_e4m3fn weight is returned dequantized, in float32: each
  [fp8_block] block of it times its entry of the `<name>_scale_inv` tensor beside it.
  With `mxfp4` (HF's "mxfp4": GPT-OSS's expert weights), a tensor stored as
  `<name>_blocks` and `<name>_scales` is returned dequantized (`_mxfp4_weight`)."""

  def __init__(self, path: str, fp8_block: tuple[int, int] | None = None,
               mxfp4: bool = False):
    self.fp8_block = fp8_block
    self.mxfp4 = mxfp4
    from safetensors import safe_open  # an optional dependency: imported when used
    for kind, stem in (("safetensors", "model.safetensors"),
                       ("PyTorch", "pytorch_model.bin")):
      single = os.path.join(path, stem)
      index = os.path.join(path, f"{stem}.index.json")
      if os.path.isfile(single) or os.path.isfile(index):
        break
    else:
      raise FileNotFoundError(f"no weights in {path}: expected model.safetensors or "
                              "model.safetensors.index.json with its shards (or "
                              "pytorch_model.bin, or pytorch_model.bin.index.json with its)")
    if os.path.isfile(single):
      weight_map = None
      files = [single]
    else:
      try:
        with open(index, encoding="utf-8") as f:
          weight_map = {name: os.path.join(path, file)
                        for name, file in json.load(f)["weight_map"].items()}
      except (OSError, UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError,
              AttributeError) as e:
        raise ValueError(f"{index}: not a {kind} index (JSON with a \"weight_map\" of "
                         f"tensor name -> file) ({type(e).__name__}: {e})") from e
      files = sorted(set(weight_map.values()))
    if kind == "PyTorch" and (fp8_block is not None or mxfp4):
      raise ValueError(f"{path}: a quantized checkpoint (fp8 / mxfp4) must be safetensors")
    self.handles = {}
    self.where: dict[str, str] = {}  # tensor name -> its file
    for file in files:
      if not os.path.isfile(file):
        raise FileNotFoundError(f"{file}: listed in {index} but missing")
      if kind == "PyTorch":
        self.handles[file] = _TorchFile(file)
      else:
        try:
          self.handles[file] = safe_open(file, framework="flax")
        except Exception as e:  # SafetensorError and OSError: truncated, corrupt, unreadable
          raise ValueError(f"{file}: not a readable safetensors file ({e})") from e
      self.where.update(dict.fromkeys(self.handles[file].keys(), file))
    # fp8: each file's header (tensor dtypes and byte ranges) read once.
    self.headers = ({file: _safetensors_header(file) for file in files}
                    if fp8_block is not None else {})
    for name, file in (weight_map or {}).items():
      if self.where.get(name) != file:
        raise ValueError(f"{index} places {name!r} in {file}, which does not hold it")

  def get(self, name: str) -> jax.Array:
    """The tensor `name` ("model.layers.0....", "lm_head.weight"), as a causal LM's
    checkpoint names it, a base model's (without "model." or "transformer.": BLOOM's
    checkpoints hold BloomModel's tensors) or an image-text model's language model's
    ("language_model.model.layers.0...." as transformers saves it,
    "model.language_model.layers.0...." as its modules name it)."""
    rest = name.removeprefix("model.").removeprefix("transformer.")
    for key in (name, rest, f"language_model.{name}", f"model.language_model.{rest}"):
      if key in self.where:
        file = self.where[key]
        if self.fp8_block is not None and self.headers[file][0][key]["dtype"] == "F8_E4M3":
          return self._fp8_weight(file, key)
        try:
          return self.handles[file].get_tensor(key)
        except Exception as e:  # a tensor past a truncated file's end
          raise ValueError(f"{file}: tensor {key!r} cannot be read ({e})") from e
      if self.mxfp4 and f"{key}_blocks" in self.where:
        return self._mxfp4_weight(key)
    raise KeyError(name)

  def _mxfp4_weight(self, key: str) -> jax.Array:
    """The MXFP4 tensor `key`, float32, as HF's `convert_moe_packed_tensors` makes it:
    `key`_blocks uint8 [E, rows, G, 16] holds 32 e2m1 values per row group (two per byte,
    the low nibble first), `key`_scales uint8 [E, rows, G] each group's power of two
    (2^(s - 127)); the [E, rows, G * 32] values are returned [E, G * 32, rows] (torch's
    transposed parameter layout: gate_up_proj [E, hidden, 2 * intermediate])."""
    blocks = self.get(f"{key}_blocks")
    scale_name = f"{key}_scales"
    try:
      scales = self.get(scale_name)
    except KeyError:
      raise ValueError(f"{self.where[f'{key}_blocks']}: MXFP4 tensor {key!r} has no "
                       f"{scale_name!r} beside its blocks") from None
    if (blocks.dtype != jnp.uint8 or scales.dtype != jnp.uint8 or blocks.ndim != 4
        or blocks.shape[-1] != 16 or scales.shape != blocks.shape[:-1]):
      raise ValueError(f"MXFP4 tensor {key!r}: expected uint8 blocks [E, rows, G, 16] and "
                       f"scales [E, rows, G], got {blocks.dtype} {tuple(blocks.shape)} and "
                       f"{scales.dtype} {tuple(scales.shape)}")
    values = jnp.take(_FP4_VALUES, jnp.stack([blocks & 0xF, blocks >> 4], axis=-1)
                      .astype(jnp.int32))  # [E, rows, G, 16, 2]
    values = jnp.ldexp(values, scales.astype(jnp.int32)[..., None, None] - 127)
    e, rows, groups, _ = blocks.shape
    return jnp.swapaxes(values.reshape(e, rows, groups * 32), 1, 2)

  def _fp8_weight(self, file: str, key: str) -> jax.Array:
    """The float8_e4m3fn weight `key` of `file` times its blocks' scales, float32."""
    scale_name = f"{key}_scale_inv"
    if scale_name not in self.where:
      raise ValueError(f"{file}: float8 weight {key!r} has no {scale_name!r} beside it (an "
                       "fp8 checkpoint's block scales)")
    scales = self.get(scale_name).astype(jnp.float32)
    # (safetensors' numpy reader has no float8: the bytes are read as ml_dtypes' type.)
    header, data = self.headers[file]
    begin, end = header[key]["data_offsets"]
    with open(file, "rb") as f:
      f.seek(data + begin)
      raw = f.read(end - begin)
    if len(raw) != end - begin:
      raise ValueError(f"{file}: tensor {key!r} cannot be read (the file ends early)")
    w = np.frombuffer(raw, ml_dtypes.float8_e4m3fn).reshape(header[key]["shape"])
    w = jnp.asarray(w.astype(np.float32))
    rows, cols = self.fp8_block
    want = (-(-w.shape[0] // rows), -(-w.shape[-1] // cols))
    if w.ndim != 2 or scales.shape != want:
      raise ValueError(f"{file}: {scale_name} has shape {scales.shape}, expected {want} for "
                       f"{key} {w.shape} in blocks of {self.fp8_block}")
    blocks = jnp.repeat(jnp.repeat(scales, rows, axis=0), cols, axis=1)
    return w * blocks[:w.shape[0], :w.shape[1]]


# e2m1's 16 values by code (MXFP4's elements: sign, 2 exponent bits, 1 mantissa bit).
_FP4_VALUES = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0,
                        -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0], np.float32)


def _safetensors_header(file: str) -> tuple[dict[str, Any], int]:
  """(a safetensors file's header: tensor name -> dtype, shape, data_offsets; the byte
  offset of its data)."""
  with open(file, "rb") as f:
    size = int.from_bytes(f.read(8), "little")
    return json.loads(f.read(size)), 8 + size


# Our fused projections and the HF modules concatenated into them (along the outputs).
_FUSED = {"self_attn.qkv": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
          "self_attn.out": ("self_attn.o_proj",),
          "mlp.gate_up": ("mlp.gate_proj", "mlp.up_proj"),
          "mlp.down": ("mlp.down_proj",),
          # (`PlainMLP`'s, StarCoder2's names.)
          "mlp.c_fc": ("mlp.c_fc",), "mlp.c_proj": ("mlp.c_proj",)}
# Phi-3 fuses them as we do (q, k, v; gate, up): one module each.
_PHI3_FUSED = {**_FUSED, "self_attn.qkv": ("self_attn.qkv_proj",),
               "mlp.gate_up": ("mlp.gate_up_proj",)}


# `nn.LayerNorm`'s parameters under HF's names (an RMS norm's weight is HF's as it is).
_NORM_PARAMS = {"scale": "weight"}


# Sources(nnx state path, config) -> (the HF tensor names a parameter is made of, the
# function making it of those tensors, in order).
Sources = Callable[[tuple[str, ...], Any],
                   tuple[list[str], Callable[[list[jax.Array]], jax.Array]]]


def linear_rows(parts: list[jax.Array]) -> jax.Array:
  """torch Linear weights [out, in] concatenated along out, as a kernel [in, sum(out)]."""
  return jnp.concatenate(parts, axis=0).T


def whole(parts: list[jax.Array]) -> jax.Array:
  """The one tensor of `parts`, as it is."""
  (part,) = parts
  return part


def deinterleave(rows: int, rotated: int, period: int, *, first: bool = False
                 ) -> np.ndarray:
  """The row order turning each block of `period` rows whose last `rotated` (with
  `first`, first `rotated`: GPT-J's) are interleaved pairs (x0, x1, x2, x3, ...) into
  rotate-half order (x0, x2, ..., x1, x3, ...); `rows` is a multiple of `period`. (RoPE
  over interleaved pairs is rotate-half RoPE over the rows so reordered, q's and k's
  alike: their dot products are unchanged.)"""
  at = 0 if first else period - rotated
  block = np.arange(period)
  block[at:at + rotated] = at + np.concatenate(
      [np.arange(0, rotated, 2), np.arange(1, rotated, 2)])
  return (np.arange(0, rows, period)[:, None] + block).reshape(-1)


def hf_sources(path: tuple[str, ...], config: Any
               ) -> tuple[list[str], Callable[[list[jax.Array]], jax.Array]]:
  """This module's `Sources`: a parameter's HF tensors (our fused projections are
  their modules' weights concatenated)."""
  if path == ("embed_tokens", "embedding"):
    return ["model.embed_tokens.weight"], whole
  if path == ("lm_head", "embedding"):
    return ["lm_head.weight"], whole
  if path[0] == "norm":  # the final norm (a LayerNorm's scale is HF's weight)
    return [f"model.norm.{_NORM_PARAMS.get(path[1], path[1])}"], whole
  _, layer, *module, param = path  # ("layers", i, ..., "kernel" | "bias" | "weight")
  prefix = f"model.layers.{layer}."
  module = ".".join(module)
  fused = _PHI3_FUSED if config.model_type == "phi3" else _FUSED
  if module not in fused:  # the norms
    return [f"{prefix}{module}.{_NORM_PARAMS.get(param, param)}"], whole
  if param == "kernel":
    return [f"{prefix}{hf}.weight" for hf in fused[module]], linear_rows
  return ([f"{prefix}{hf}.bias" for hf in fused[module]],
          functools.partial(jnp.concatenate, axis=0))


def _read_json(file: str) -> dict[str, Any]:
  """A JSON object file's contents; ValueError naming the file if it is not one."""
  try:
    with open(file, encoding="utf-8") as f:
      value = json.load(f)
  except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
    raise ValueError(f"{file}: not a readable JSON file ({e})") from e
  if not isinstance(value, dict):
    raise ValueError(f"{file}: not a JSON object")
  return value


def from_pretrained(path: str | os.PathLike, *, dtype=jnp.float32, param_dtype=None,
                    decode_impl: paged_nn.DecodeImpl = "auto",
                    max_model_len: int | None = None) -> LlamaForCausalLM:
  """Loads a Hugging Face Llama, Mistral, Qwen2, Qwen3, Phi-3, Granite, SmolLM3 or Seed-OSS
  checkpoint directory (`load_pretrained`).

  Args:
    path: as `load_pretrained`'s.
    dtype, param_dtype, decode_impl: as for `LlamaForCausalLM`.
    max_model_len: the longest sequence served (`LlamaConfig.max_model_len`; None: the
      config's context, or a LongRoPE model's original one: pass more, up to
      max_position_embeddings, for its long factors).
  """
  return load_pretrained(path, LlamaConfig.from_dict, functools.partial(
      LlamaForCausalLM, dtype=dtype, param_dtype=param_dtype, decode_impl=decode_impl),
      max_model_len=max_model_len)


def loader(config_class: type, model_class: type, sources: Sources = hf_sources, *,
           max_model_len: bool = True) -> Callable[..., nnx.Module]:
  """A models/ module's `from_pretrained` over `load_pretrained`: (path, *, dtype=
  jnp.float32, param_dtype=None, decode_impl="auto", max_model_len=None) -> a
  `model_class` of the Hugging Face checkpoint directory at path (its config read by
  `config_class.from_dict`, its tensors by `sources`); without `max_model_len` (a model
  of learned positions: GPT-2's relatives serve up to their table) no such argument."""

  def load(path, dtype, param_dtype, decode_impl, **context) -> nnx.Module:
    return load_pretrained(path, config_class.from_dict, functools.partial(
        model_class, dtype=dtype, param_dtype=param_dtype, decode_impl=decode_impl),
        sources, **context)

  if max_model_len:
    def from_pretrained(path: str | os.PathLike, *, dtype=jnp.float32, param_dtype=None,
                        decode_impl: paged_nn.DecodeImpl = "auto",
                        max_model_len: int | None = None) -> nnx.Module:
      return load(path, dtype, param_dtype, decode_impl, max_model_len=max_model_len)
  else:
    def from_pretrained(path: str | os.PathLike, *, dtype=jnp.float32, param_dtype=None,
                        decode_impl: paged_nn.DecodeImpl = "auto") -> nnx.Module:
      return load(path, dtype, param_dtype, decode_impl)

  context = ("\n    max_model_len: as `models.llama.from_pretrained`'s." if max_model_len
             else "")
  from_pretrained.__doc__ = f"""Loads a Hugging Face checkpoint directory as a
  `{model_class.__name__}` (`models.llama.load_pretrained`: its files, errors and eos
  ids; config.json read by `{config_class.__name__}.from_dict`).

  Args:
    path: as `models.llama.load_pretrained`'s.
    dtype, param_dtype, decode_impl: as for `models.llama.LlamaForCausalLM`.{context}
  """
  return from_pretrained


def family(name: str, model_types: tuple[str, ...],
           from_pretrained: Callable[..., nnx.Module], *, max_model_len: bool = True
           ) -> ModelFamily:
  """The CLI's `ModelFamily` of a models/ module on this loader: `from_pretrained` (a
  `loader`'s) takes max_model_len where `max_model_len`; no random-weight presets."""
  return ModelFamily(name=name, model_types=model_types, presets={},
                     max_model_len=max_model_len,
                     from_pretrained=lambda path, dtype, **options: from_pretrained(
                         path, dtype=dtype, **options))


def load_pretrained(path: str | os.PathLike, config_of: Callable[[dict], Any],
                    model_of: Callable[..., nnx.Module],
                    sources: Sources = hf_sources,
                    max_model_len: int | None = None) -> nnx.Module:
  """Loads a Hugging Face checkpoint directory of this module's layout (Llama's tensor
  names, our fused projections; a model of models/ built on it, as Gemma 3's).

  Args:
    path: a directory with config.json and model.safetensors, or shards listed in
      model.safetensors.index.json, as `transformers`' `save_pretrained` writes them;
      generation_config.json's eos_token_id, where present, replaces config.json's. A
      checkpoint of HF's block-scaled fp8 (quantization_config quant_method "fp8") or
      MXFP4 ("mxfp4") loads dequantized (`_Checkpoint`).
    config_of: config.json's dict -> the model's config (ValueError if unsupported); it
      has a `model_type`.
    model_of: (config, rngs=) -> the model, whose parameters the checkpoint fills.
    sources: where each parameter comes from (`hf_sources`: Llama's names; a model with
      other parameters, as Mixtral's experts, passes its own). ALiBi's slopes (no
      tensor) are the config's `alibi_slopes`.
    max_model_len: the config's max_model_len (`LlamaConfig`'s; None: its default).

  Raises:
    FileNotFoundError: the directory's config.json, its weights or a listed shard is
      missing.
    ValueError: a file is unreadable, an index names a file that lacks the tensor, the
      model_type or a setting is unsupported or the checkpoint is pre-quantized other than
      as block-scaled fp8 or MXFP4 (each naming the file), or a weight is missing from the
      checkpoint or has the wrong shape.
  """
  path = os.fspath(path)
  config_file = os.path.join(path, "config.json")
  if not os.path.isfile(config_file):
    raise FileNotFoundError(f"no config.json in {path}")
  config = _read_json(config_file)
  fp8_block = None
  quantization = config.get("quantization_config")
  method = quantization.get("quant_method") if isinstance(quantization, dict) else None
  if quantization is not None and method != "mxfp4":
    # Their weights are stored narrow beside scales (or packed) under the same names: read
    # as floats they would load without error and compute nonsense. Block-scaled fp8
    # (HF's "fp8": DeepSeek-V3's and Qwen3's FP8 checkpoints) and MXFP4 (GPT-OSS's
    # experts, under names of their own) load dequantized.
    # (HF's FineGrainedFP8Config: blocks of 128 x 128 unless weight_block_size says.)
    block = quantization.get("weight_block_size", [128, 128]) if method == "fp8" else None
    if not (isinstance(block, (list, tuple)) and len(block) == 2
            and all(isinstance(x, int) and x > 0 for x in block)):
      raise ValueError(f"{config_file}: pre-quantized checkpoints (quantization_config, "
                       f"quant_method {method!r}) are not supported but block-scaled fp8's "
                       "(quant_method 'fp8' with a weight_block_size of two sizes) and "
                       "mxfp4's; load the float checkpoint (int8 serving quantizes it: "
                       "--quantization int8)")
    fp8_block = tuple(block)
  generation_file = os.path.join(path, "generation_config.json")
  if os.path.isfile(generation_file):
    eos = _read_json(generation_file).get("eos_token_id")
    if eos is not None:
      config = {**config, "eos_token_id": eos}
  if max_model_len is not None:
    config = {**config, "max_model_len": max_model_len}
  try:
    config = config_of(config)
  except (TypeError, ValueError, AttributeError) as e:
    raise ValueError(f"{config_file}: {e}") from e
  checkpoint = _Checkpoint(path, fp8_block, mxfp4=method == "mxfp4")

  # Shapes only: the checkpoint supplies every value, so nothing is initialised twice.
  abstract = nnx.eval_shape(lambda: model_of(config, rngs=nnx.Rngs(0)))
  graphdef, state = nnx.split(abstract)

  def load(key_path, spec: jax.ShapeDtypeStruct) -> jax.Array:
    names = tuple(str(k.key) for k in key_path if isinstance(k, jax.tree_util.DictKey))
    if names[-1] == "alibi_slopes":  # (`nn.PagedAttention`'s, made from the config)
      names, assemble = [], lambda _: config.alibi_slopes
    else:
      names, assemble = sources(names, config)
    parts = []
    for name in names:
      try:
        parts.append(checkpoint.get(name))
      except KeyError:
        raise ValueError(f"{path}: weight {name!r} is missing from the checkpoint (needed "
                         f"for a parameter of shape {spec.shape})") from None
    which = " + ".join(f"{n} {tuple(p.shape)}" for n, p in zip(names, parts))
    try:
      value = assemble(parts)
    except (TypeError, ValueError) as e:  # parts whose shapes do not fit together
      raise ValueError(f"{path}: weight {which} cannot make a parameter of shape "
                       f"{spec.shape} ({e})") from None
    if value.shape != spec.shape:
      raise ValueError(f"{path}: weight {which} gives shape {value.shape}, expected "
                       f"{spec.shape} for config.json's hyperparameters")
    return value.astype(spec.dtype)

  return nnx.merge(graphdef, jax.tree_util.tree_map_with_path(load, state))


# Random-weight configurations for runs without a checkpoint (the CLI's --model).
PRESETS = {
    # Byte-level (vocabulary 256+), GQA 4 q heads over 2 kv heads of 64, llama3 RoPE.
    "tiny-llama": LlamaConfig(
        vocab_size=320, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
        rope_theta=500000.0, tie_word_embeddings=True, bos_token_id=None, eos_token_id=None,
        rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                      "high_freq_factor": 4.0, "original_max_position_embeddings": 128}),
}


def _random_model(config: LlamaConfig, dtype, seed: int) -> LlamaForCausalLM:
  return LlamaForCausalLM(config, dtype=dtype, rngs=nnx.Rngs(seed))


FAMILY = ModelFamily(
    name="llama",
    model_types=MODEL_TYPES,
    from_pretrained=lambda path, dtype, **options: from_pretrained(path, dtype=dtype, **options),
    presets={name: functools.partial(_random_model, config) for name, config in PRESETS.items()},
    max_model_len=True,
)
