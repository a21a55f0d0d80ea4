"""Flax NNX layers for models whose KV cache lives in a `KVPool`.

`PagedAttention` is a multi-head (MHA / GQA / MQA) self-attention layer that a model drops
in place of its usual attention: it projects q/k/v for the new tokens, writes k/v into its
layer's pages of the pool (`pool.write_kv`; at decode `pool.project_write_kv`, where on a
GPU the projection kernel stores them itself; quantized on write for an int8 / float8
pool) and attends

* over the new tokens with a causal mask for a prompt (`prefill`), or, for the rest of a
  prompt after a cached prefix or earlier chunks, over its pages (`prefill(start=...)`),
  and
* over the sequence's pages with the paged decode kernel for one new token (`decode`).

The caller reserves the slots (`pool.reserve`) once per step for all layers and passes
them in; the layer never allocates.

Position information, where a model has it in attention, comes from a `RotaryEmbedding`
(RoPE: default, "linear" and "llama3" frequencies) applied by the layer to q and k before
K is cached, or from ALiBi (`alibi_slopes`: BLOOM's, MPT's linear biases on the logits,
each head's slope times the key's distance); a `sliding_window` limits every token to the
last W positions, a `logits_soft_cap` C caps the attention logits to C * tanh(logits /
C) (Gemma 2's), and `sinks` adds a learned logit per head to every softmax (GPT-OSS's
attention sinks), prompt and decode alike.

`project_add_norm` is a pre-LN block's "x = x + proj(h); h = norm(x)" with the
projection's split-K reduction, the residual add and the norm in one kernel at decode's
few rows (the attention layer's `project=False` leaves its output projection to it), for a
`LayerNorm` or an `RMSNorm` (one kernel each where XLA runs two);
`project_add` the same without the norm (for a norm of the model's own), and
`dense` an `nnx.Linear` (+ activation) as one GEMM-with-epilogue kernel at those rows
(`jax_paged.kernels.linear`). Each of them, and the attention layer, takes an int8
`weight_quant.Int8Linear` as well as an `nnx.Linear`, and the rows' LoRA slots
(`adapters`) for a projection with slots (`jax_paged.lora`).

`GroupedLinear` is a stack of linears applied to rows sorted by group (a mixture's
experts), through `jax_paged.grouped_matmul`; `jax_paged.tensor_parallel` splits it like a
linear (column- or row-parallel, every group alike).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Callable, Literal, NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jax_paged.kernels import grouped_matmul
from jax_paged.kernels import kv_quant
from jax_paged.kernels import layer_norm
from jax_paged.kernels import linear
from jax_paged.kernels import paged_attention
from jax_paged.kernels import paged_prefill
from jax_paged import lora
from jax_paged import pool as pool_lib
from jax_paged import weight_quant
from jax_paged.weight_quant import Linear
from jax_paged.kernels import reference
from jax_paged.kernels import triton_backend
from jax_paged.kernels import validation

DecodeImpl = Literal["auto", "kernel", "reference"]


def _cudnn_supports(q: jax.Array) -> bool:
  """Whether cuDNN's fused attention takes q [B, T, H, D] here (a GPU, 16-bit, D <= 128
  and a multiple of 8: its flash-attention kernels' limits)."""
  return (jax.default_backend() == "gpu" and q.dtype in (jnp.bfloat16, jnp.float16)
          and q.shape[-1] % 8 == 0 and q.shape[-1] <= 128)


def prompt_attention(q: jax.Array, k: jax.Array, v: jax.Array, lengths: jax.Array, *,
                     scale: float, sliding_window: int | None = None) -> jax.Array:
  """Causal self-attention over right-padded prompts.

  Args:
    q: [B, T, H, D]; k, v: [B, T, Hkv, D] with H % Hkv == 0.
    lengths: int32 [B] in [1, T], real tokens per row.
    scale: logit scale.
    sliding_window: W > 0 lets the token at position i attend to positions (i - W, i]
      only (Hugging Face Mistral's mask, and the decode kernel's [L - W, L)); None = all
      earlier positions.

  Returns:
    [B, T, H, D] in q's dtype; rows at or past a prompt's length are 0.

  On a GPU in bf16 / f16 this is cuDNN's fused flash attention, which never materialises
  the [B, H, T, T] logits (XLA's path writes and rereads them in f32 at every layer: most
  of a long prompt's attention time); elsewhere XLA's `jax.nn.dot_product_attention`.
  """
  # jax's window is inclusive on both sides: keys [i - left, i + right].
  window = None if sliding_window is None else (sliding_window - 1, 0)
  if _cudnn_supports(q):
    y = jax.nn.dot_product_attention(q, k, v, scale=scale, is_causal=True,
                                     query_seq_lengths=lengths,
                                     key_value_seq_lengths=lengths, local_window_size=window,
                                     implementation="cudnn")
  else:
    # Padded queries attend to the real keys before them (or, past a window, to none:
    # XLA's finite mask value keeps that row finite), so no row is NaN.
    y = jax.nn.dot_product_attention(q, k, v, scale=scale, is_causal=True,
                                     key_value_seq_lengths=lengths, local_window_size=window)
  # Zero padding rows whatever the backend left there, so that nothing downstream (their
  # K/V at the next layer, masked but still multiplied) can carry a non-finite value.
  real = jnp.arange(q.shape[1])[None, :] < lengths[:, None]
  return jnp.where(real[:, :, None, None], y, 0).astype(q.dtype)


def alibi_slopes(num_heads: int, max_bias: float = 8.0) -> np.ndarray:
  """ALiBi's head slopes (Press et al., 2022), float32 [num_heads]: for n heads the
  geometric sequence 2^(-max_bias / n), 2^(-2 max_bias / n), ... where n is a power of
  two; otherwise those of the largest power of two below, then every other slope of twice
  that many (the paper's code, BLOOM's `build_alibi_tensor`, MPT's `gen_slopes` with its
  alibi_bias_max = max_bias, which all agree)."""
  if not isinstance(num_heads, (int, np.integer)) or num_heads < 1:
    raise ValueError(f"num_heads must be a positive int, got {num_heads!r}")
  closest = 1 << (int(num_heads).bit_length() - 1)  # the largest power of two <= num_heads
  slopes = 2.0 ** (-max_bias / closest * np.arange(1, closest + 1))
  extra = 2.0 ** (-max_bias / (2 * closest) * np.arange(1, 2 * (num_heads - closest), 2))
  return np.concatenate([slopes, extra]).astype(np.float32)


class QueryTemperature(NamedTuple):
  """A query scale growing with the position p (Llama 4's temperature tuning of its NoPE
  layers; Mistral 3's llama_4_scaling on every layer): 1 + beta * log(1 + floor((p +
  offset) / floor_scale))."""

  floor_scale: int
  beta: float
  offset: int = 0

  def check(self) -> "QueryTemperature":
    """Itself, with its fields checked (ValueError naming the one out of range)."""
    validation.check_positive_int("query_temperature's floor_scale", self.floor_scale)
    validation.check_positive_number("query_temperature's beta", self.beta)
    if not isinstance(self.offset, (int, np.integer)) or self.offset < 0:
      raise ValueError(f"query_temperature's offset must be an int >= 0, got {self.offset!r}")
    return self

  def __call__(self, positions: jax.Array) -> jax.Array:
    """Positions int [...] -> the scales, float32 [...]."""
    steps = jnp.floor((positions.astype(jnp.float32) + self.offset) / self.floor_scale)
    return 1.0 + self.beta * jnp.log1p(steps)


class Constant(nnx.Variable):
  """A layer's fixed array (not a trained parameter, never loaded from a checkpoint):
  `PagedAttention.alibi_slopes`. A Variable rather than a static attribute, so that
  `jax_paged.tensor_parallel` can give each device its heads' rows."""


RopeType = Literal["default", "linear", "llama3", "yarn", "longrope"]
ROPE_TYPES = ("default", "linear", "llama3", "yarn", "longrope")


@dataclasses.dataclass(frozen=True)
class RotaryEmbedding:
  """Rotary position embeddings (RoPE) in the rotate-half layout of Hugging Face's Llama:
  the two halves of a head, x1 = x[..., :D/2] and x2 = x[..., D/2:], rotate as the pairs
  (x1[i], x2[i]) by the angle position * inv_freq[i]. With `rotary_dim` R < head_dim
  (HF's partial_rotary_factor: GPT-NeoX's, Pythia's), only the first R features rotate
  so (D = R below), the rest pass unchanged.

  Frequencies inv_freq[i] = theta ** (-2i / D), then by `rope_type`:
    "default": as they are;
    "linear": divided by `factor` (positions interpolated `factor` times);
    "llama3": Llama 3.1's: wavelengths above original_max_position_embeddings /
      low_freq_factor divided by `factor`, below original_max_position_embeddings /
      high_freq_factor kept, and smoothly interpolated between (with the two factors
      equal, Llama 4's, no band between: each kept or divided);
    "yarn": YaRN's (Qwen's and DeepSeek's long contexts): the pairs turning fewer than
      `beta_slow` times over original_max_position_embeddings divided by `factor`, those
      turning more than `beta_fast` times kept, a linear ramp between (over pair indices,
      its ends rounded outwards with `truncate`);
    "longrope": LongRoPE's (Phi-3 / Phi-3.5 / Phi-4-mini): each divided by its own
      `ext_factors[i]` (a config's short_factor or long_factor: which one is the model's
      choice, fixed for every position, `models.llama.rotary`).
  They are computed in float32 in Hugging Face's order of operations (`inv_freq`), so
  float32 models reproduce its angles. The rotated values are multiplied by
  `attention_factor` (YaRN's and LongRoPE's cos / sin scaling, so q.k by its square; 1
  elsewhere). With `reverse` each pair turns by minus its angle (NanoChat's rotate_half,
  (x2, -x1)).

  Frozen and hashable: a layer holds it as static configuration, not as parameters.
  """

  head_dim: int
  theta: float = 10000.0
  rope_type: RopeType = "default"
  factor: float = 1.0
  low_freq_factor: float = 1.0
  high_freq_factor: float = 4.0
  original_max_position_embeddings: int = 8192
  beta_fast: float = 32.0
  beta_slow: float = 1.0
  truncate: bool = True
  attention_factor: float = 1.0
  rotary_dim: int | None = None  # None: head_dim
  ext_factors: tuple[float, ...] = ()  # longrope's, one per rotated pair
  reverse: bool = False

  def __post_init__(self):
    if not (isinstance(self.head_dim, int) and self.head_dim > 0 and self.head_dim % 2 == 0):
      raise ValueError(f"head_dim must be a positive even int, got {self.head_dim!r}")
    if self.rotary_dim is not None and not (
        isinstance(self.rotary_dim, int) and 0 < self.rotary_dim <= self.head_dim
        and self.rotary_dim % 2 == 0):
      raise ValueError(f"rotary_dim must be a positive even int <= head_dim="
                       f"{self.head_dim}, got {self.rotary_dim!r}")
    if not self.theta > 0:
      raise ValueError(f"theta must be > 0, got {self.theta!r}")
    if self.rope_type not in ROPE_TYPES:
      raise ValueError(f"rope_type must be one of {ROPE_TYPES}, got {self.rope_type!r}")
    if not self.factor > 0:
      raise ValueError(f"factor must be > 0, got {self.factor!r}")
    if not (math.isfinite(self.attention_factor) and self.attention_factor > 0):
      raise ValueError(f"attention_factor must be a positive finite number, got "
                       f"{self.attention_factor!r}")
    if self.rope_type == "yarn" and not (0 < self.beta_slow < self.beta_fast
                                         and self.original_max_position_embeddings > 0):
      raise ValueError("yarn rope needs 0 < beta_slow < beta_fast and "
                       f"original_max_position_embeddings > 0, got {self.beta_slow}, "
                       f"{self.beta_fast}, {self.original_max_position_embeddings}")
    if self.rope_type == "llama3" and not (
        0 < self.low_freq_factor <= self.high_freq_factor
        and self.original_max_position_embeddings > 0):
      raise ValueError("llama3 rope needs 0 < low_freq_factor <= high_freq_factor and "
                       f"original_max_position_embeddings > 0, got {self.low_freq_factor}, "
                       f"{self.high_freq_factor}, {self.original_max_position_embeddings}")
    pairs = (self.rotary_dim or self.head_dim) // 2
    if self.rope_type == "longrope" and not (
        isinstance(self.ext_factors, tuple) and len(self.ext_factors) == pairs
        and all(isinstance(f, (int, float)) and math.isfinite(f) and f > 0
                for f in self.ext_factors)):
      raise ValueError(f"longrope needs ext_factors: a tuple of {pairs} positive finite "
                       f"numbers (one per rotated pair), got {self.ext_factors!r}")
    if self.rope_type != "longrope" and self.ext_factors:
      raise ValueError(f"ext_factors are longrope's; rope_type is {self.rope_type!r}")

  def inv_freq(self) -> np.ndarray:
    """float32 [rotary_dim // 2], the rotation frequency of each pair."""
    d = self.rotary_dim or self.head_dim
    f32 = np.float32
    # theta ** (2i / d) with the f32 exponent, rounded to f32 from float64 as torch's pow
    # (HF's) rounds it: numpy's own float32 pow (numpy 2.4) is off by an ulp in some
    # entries, an angle error that grows with the position (5e-3 rad at 131071).
    exponent = np.arange(0, d, 2).astype(f32) / f32(d)
    power = np.power(np.float64(self.theta), exponent.astype(np.float64)).astype(f32)
    inv_freq = f32(1.0) / power
    if self.rope_type == "linear":
      inv_freq = inv_freq / f32(self.factor)
    elif self.rope_type == "llama3":
      old = self.original_max_position_embeddings
      low_freq_wavelen = old / self.low_freq_factor
      high_freq_wavelen = old / self.high_freq_factor
      wavelen = f32(2 * math.pi) / inv_freq
      inv_freq = np.where(wavelen > low_freq_wavelen, inv_freq / f32(self.factor), inv_freq)
      if self.high_freq_factor > self.low_freq_factor:
        smooth = ((f32(old) / wavelen - f32(self.low_freq_factor))
                  / f32(self.high_freq_factor - self.low_freq_factor))
        smoothed = (1 - smooth) * inv_freq / f32(self.factor) + smooth * inv_freq
        medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
        inv_freq = np.where(medium, smoothed, inv_freq)
    elif self.rope_type == "yarn":
      # The pair index at which a frequency turns `rotations` times over the original
      # context (YaRN's correction dims), in float64 as HF's Python math.
      def pair(rotations):
        old = self.original_max_position_embeddings
        return d * math.log(old / (rotations * 2 * math.pi)) / (2 * math.log(self.theta))
      low, high = pair(self.beta_fast), pair(self.beta_slow)
      if self.truncate:
        low, high = math.floor(low), math.ceil(high)
      low, high = max(low, 0), min(high, d - 1)
      if low == high:
        high += 0.001  # (HF's guard against a zero-width ramp)
      ramp = np.clip((np.arange(d // 2, dtype=f32) - f32(low)) / f32(high - low), 0, 1)
      keep = f32(1) - ramp.astype(f32)  # 1: the original frequency, 0: interpolated
      interpolated = f32(1.0) / (f32(self.factor) * power)
      inv_freq = interpolated * (f32(1) - keep) + inv_freq * keep
    elif self.rope_type == "longrope":
      inv_freq = f32(1.0) / (np.asarray(self.ext_factors, f32) * power)
    return inv_freq.astype(f32)

  def __call__(self, x: jax.Array, positions: jax.Array) -> jax.Array:
    """Rotates x [..., heads, head_dim] at positions [...] (integer, broadcast against
    x.shape[:-2]); computed in float32, returned in x's dtype."""
    if x.shape[-1] != self.head_dim:
      raise ValueError(f"x must end in head_dim={self.head_dim}, got shape {x.shape}")
    angles = positions.astype(jnp.float32)[..., None, None] * jnp.asarray(self.inv_freq())
    cos, sin = jnp.cos(angles), jnp.sin(angles)  # [..., 1, D/2]
    if self.attention_factor != 1.0:
      cos, sin = cos * self.attention_factor, sin * self.attention_factor
    if self.reverse:  # (cos is even)
      sin = -sin
    rotated = self.rotary_dim or self.head_dim
    x1, x2 = jnp.split(x[..., :rotated].astype(jnp.float32), 2, axis=-1)
    y = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1).astype(x.dtype)
    return y if rotated == self.head_dim else jnp.concatenate([y, x[..., rotated:]], axis=-1)


class LayerNorm(nnx.Module):
  """`nnx.LayerNorm` (scale and bias, same parameter names and shapes) computed by
  `jax_paged.layer_norm`: one kernel on a GPU where XLA runs two.

  Args:
    num_features: the normalised (last) axis.
    epsilon: added to the variance.
    dtype: the output dtype (default: the input's).
    param_dtype: scale and bias dtype.
    use_bias: False: no bias parameter (`bias` None; Cohere's LayerNorms).
  """

  def __init__(self, num_features: int, *, epsilon: float = 1e-6, dtype=None,
               param_dtype=jnp.float32, use_bias: bool = True, rngs: nnx.Rngs | None = None):
    del rngs  # ones and zeros: nothing random; accepted for nnx.LayerNorm's signature
    self.epsilon = epsilon
    self.dtype = dtype
    self.scale = nnx.Param(jnp.ones((num_features,), param_dtype))
    self.bias = nnx.Param(jnp.zeros((num_features,), param_dtype)) if use_bias else None

  def _bias(self) -> jax.Array:
    return jnp.zeros_like(self.scale[...]) if self.bias is None else self.bias[...]

  def __call__(self, x: jax.Array) -> jax.Array:
    """x [..., num_features] -> the same shape, in `dtype` (default x's)."""
    return layer_norm.layer_norm(x, self.scale[...], self._bias(), epsilon=self.epsilon,
                                 out_dtype=self.dtype or x.dtype)

  def add(self, x: jax.Array, parts: jax.Array, parts_bias: jax.Array | None,
          interpret: bool | None) -> tuple[jax.Array, jax.Array]:
    """(x + sum(parts) + parts_bias, its norm): `layer_norm.add_layer_norm`."""
    return layer_norm.add_layer_norm(x, parts, self.scale[...], self._bias(),
                                     parts_bias=parts_bias, epsilon=self.epsilon,
                                     out_dtype=self.dtype or x.dtype, interpret=interpret)


class HeadLayerNorm(nnx.Module):
  """A LayerNorm of each head's features with a weight of its own per head and no bias
  (HF's StableLmLayerNormPerHead: StableLM 2 12B's q / k norms, a `PagedAttention`'s
  q_norm / k_norm). Statistics and the scale in f32, the result in x's dtype.

  Parameter: scale [num_heads, head_dim] (split by head under tensor parallelism).
  """

  def __init__(self, num_heads: int, *, head_dim: int, epsilon: float = 1e-5,
               param_dtype=jnp.float32):
    self.epsilon = epsilon
    self.scale = nnx.Param(jnp.ones((num_heads, head_dim), param_dtype))

  def __call__(self, x: jax.Array) -> jax.Array:
    """x [..., num_heads, head_dim] -> the same shape and dtype."""
    return layer_norm.layer_norm_reference(x, self.scale[...], jnp.zeros((), jnp.float32),
                                           epsilon=self.epsilon)


class RMSNorm(nnx.Module):
  """Hugging Face's LlamaRMSNorm (a `weight` of the same name and shape): x / rms(x) in
  float32, rounded to x's dtype, times `weight`; with `unit_offset` GemmaRMSNorm's: times
  1 + `weight` in float32, then rounded. Computed by `jax_paged.layer_norm.rms_norm`, one
  kernel on a GPU where XLA runs two.

  Args:
    num_features: the normalised (last) axis.
    epsilon: added to the mean square.
    param_dtype: the weight's dtype. The output's is x's and the weight's promoted
      (`unit_offset`: x's).
    unit_offset: Gemma's norm, whose weight starts at 0 (Llama's at 1).
  """

  def __init__(self, num_features: int, *, epsilon: float = 1e-6, param_dtype=jnp.float32,
               unit_offset: bool = False):
    self.epsilon = epsilon
    self.unit_offset = unit_offset
    init = jnp.zeros if unit_offset else jnp.ones
    self.weight = nnx.Param(init((num_features,), param_dtype))

  def __call__(self, x: jax.Array) -> jax.Array:
    """x [..., num_features] -> the same shape."""
    return layer_norm.rms_norm(x, self.weight[...], epsilon=self.epsilon,
                               unit_offset=self.unit_offset)

  def add(self, x: jax.Array, parts: jax.Array, parts_bias: jax.Array | None,
          interpret: bool | None, parts_norm: "RMSNorm | None" = None
          ) -> tuple[jax.Array, jax.Array]:
    """(x + sum(parts) + parts_bias, its norm): `layer_norm.add_rms_norm`; with
    `parts_norm` (a norm of the same kind and epsilon) the parts' sum is normalised by it
    before the add."""
    return layer_norm.add_rms_norm(
        x, parts, self.weight[...], parts_bias=parts_bias, epsilon=self.epsilon,
        interpret=interpret, unit_offset=self.unit_offset,
        parts_weight=None if parts_norm is None else parts_norm.weight[...])


def _operands(proj: Linear, h: jax.Array) -> tuple[jax.Array, jax.Array, dict]:
  """(h, kernel, keywords) as the kernels take them: h and a float kernel in the module's
  compute dtype (nnx.Linear computes in its dtype, or the inputs' common dtype); an
  `Int8Linear`'s kernel as stored, with the keywords that read it (`weight_quant.weights`:
  its scales and layout; {} for a float kernel)."""
  kernel, quant = weight_quant.weights(proj)
  dtype = proj.dtype or jnp.result_type(h, weight_quant.param_dtype(proj))
  return h.astype(dtype), (kernel if quant else kernel.astype(dtype)), quant


def attend_argmax(embed: nnx.Embed, h: jax.Array) -> jax.Array:
  """int32 [...] argmax over the vocabulary of `embed.attend(h)` (h [..., features]), an
  LM head's greedy tokens, without writing the logits (`linear.argmax_attend`); h and the
  table in the dtype `nnx.Embed.attend` computes in."""
  embedding = embed.embedding[...]
  dtype = embed.dtype or jnp.result_type(h, embedding)
  return linear.argmax_attend(h.astype(dtype), embedding.astype(dtype))


def dense(proj: Linear, h: jax.Array, *, activation=None,
          sections: Sequence[int] | None = None, interpret: bool | None = None,
          adapters: jax.Array | None = None) -> jax.Array | tuple[jax.Array, ...]:
  """activation(proj(h)), as one kernel at decode's few rows on a GPU.

  Up to 256 rows, `jax_paged.linear.linear` runs the GEMM with the bias and activation
  applied to its f32 accumulator (where XLA adds a reduction kernel after a split-K
  GEMM); elsewhere, the plain module and activation.

  Args:
    proj: an `nnx.Linear` (kernel [K, N], optional bias [N]) or a
      `weight_quant.Int8Linear` (int8 weights, read as stored).
    h: [..., K].
    activation: an elementwise function (hashable, e.g. a module-level partial) or None.
    sections: column widths summing to N: return that many arrays (e.g. q, k, v of a
      fused projection), written separately by the kernel instead of sliced (copied).
    interpret: None = the kernel on a GPU, plain modules elsewhere; True = the kernel in
      Pallas interpret mode (tests).
    adapters: int32 [B], each row's LoRA slot (-1: none) for a projection with slots
      (`jax_paged.lora`); None = none. The update joins the GEMM's output before the
      activation.

  Returns:
    [..., N] in the module's compute dtype, or with `sections` a tuple of [..., width].
  """
  h_c, kernel, quant = _operands(proj, h)
  mode = triton_backend.kernel_mode(interpret, supported=linear.takes(h_c, kernel))
  if mode is not None:  # (a LoRA update as one more step of the kernel's product)
    return linear.linear(h_c, kernel, None if proj.bias is None else proj.bias[...],
                         activation=activation, sections=sections, interpret=mode,
                         low_rank=lora.low_rank(proj, h, adapters), **quant)
  y = projection(proj, h, adapters=adapters)
  y = y if activation is None else activation(y)
  return y if sections is None else linear.split_sections(y, sections)


def _reduce_axis(proj: Linear) -> str | None:
  """The mesh axis a row-parallel projection sums over (`jax_paged.tensor_parallel`
  marks them in a model's per-device copy), or None."""
  return getattr(proj, "reduce_axis", None)


def _row_parallel(proj: Linear, h: jax.Array, interpret: bool | None,
                  adapters: jax.Array | None) -> jax.Array:
  """float32 [..., N]: proj(h) of a row-parallel projection under `jax.shard_map`: this
  device's rows of the kernel times its features of h, summed over the mesh axis (one
  all-reduce), then the (replicated) bias once.

  The all-reduce carries the compute dtype, as Megatron-LM's and vLLM's do: each device's
  f32 partial product is rounded to it first. In bf16 that is half the bytes of an f32 sum
  (two H200s, Llama-3.1-8B shape, batch 256: a TP 2 step 9.67 -> 9.07 ms) for one more
  rounding of the partial sums (a float32 model's sum stays float32). A LoRA update
  (`adapters`) is linear in h too: each device adds its partial before the sum."""
  h_c, kernel, quant = _operands(proj, h)
  mode = triton_backend.kernel_mode(interpret, supported=linear.takes(h_c, kernel))
  if mode is None:
    y = linear.scaled_product(h_c, kernel, **quant)
    update = lora.delta(proj, h, adapters)
    y = y if update is None else y + update
  else:
    y = jnp.sum(linear.linear_partials(h_c, kernel, interpret=mode, **quant,
                                       low_rank=lora.low_rank(proj, h, adapters)), axis=0)
  y = jax.lax.psum(y.astype(h_c.dtype), _reduce_axis(proj)).astype(jnp.float32)
  return y if proj.bias is None else y + proj.bias[...].astype(jnp.float32)


def projection(proj: Linear, h: jax.Array, *, interpret: bool | None = None,
               adapters: jax.Array | None = None) -> jax.Array:
  """proj(h) plus the rows' LoRA updates (`dense`'s `adapters`), summed over the mesh
  axis for a row-parallel projection (in its compute dtype either way)."""
  if _reduce_axis(proj) is not None:
    return _row_parallel(proj, h, interpret, adapters).astype(_operands(proj, h)[0].dtype)
  y = proj(h)
  update = lora.delta(proj, h, adapters)
  return y if update is None else (y.astype(jnp.float32) + update).astype(y.dtype)


def project_add_norm(proj: Linear, h: jax.Array, residual: jax.Array,
                     norm: LayerNorm | RMSNorm, *, interpret: bool | None = None,
                     adapters: jax.Array | None = None, parts_norm: RMSNorm | None = None
                     ) -> tuple[jax.Array, jax.Array]:
  """x = residual + proj(h) and norm(x), as one kernel after the projection's GEMM (with
  `parts_norm`, x = residual + parts_norm(proj(h)): Gemma's post-norms).

  On a GPU with at most 256 rows, `proj` runs as a split-K GEMM
  (`jax_paged.linear.linear_partials`) whose f32 partial sums go straight to
  `layer_norm.add_layer_norm` / `add_rms_norm` (sum + bias + residual, then the norm): no
  reduction kernel for the projection and no separate norm. Elsewhere, the plain modules.

  Args:
    proj: the projection added to the residual stream (kernel [K, N], optional bias [N]),
      float or `weight_quant.Int8Linear`.
    h: [..., K], its input.
    residual: [..., N], the residual stream.
    norm: the layer norm or RMS norm applied to the new stream.
    interpret: None = the kernel on a GPU, plain modules elsewhere; True = the kernel in
      Pallas interpret mode (tests).
    adapters: the rows' LoRA slots (`dense`), or None: their updates join the kernel's
      f32 partial sums.
    parts_norm: None, or an RMS norm (of `norm`'s kind and epsilon) of the projection
      before the add, in the same kernel.

  Returns:
    (x [..., N] in the stream's dtype, norm(x)).
  """
  if parts_norm is not None and not (isinstance(norm, RMSNorm)
                                     and isinstance(parts_norm, RMSNorm)):
    raise ValueError(f"parts_norm goes with RMS norms (norm and parts_norm both RMSNorm), "
                     f"got {type(norm).__name__} and {type(parts_norm).__name__}")
  # (The fused kernel applies norm's epsilon and offset to both.)
  if parts_norm is not None and (parts_norm.epsilon, parts_norm.unit_offset) != (
      norm.epsilon, norm.unit_offset):
    raise ValueError(f"parts_norm must have norm's epsilon and unit_offset "
                     f"({norm.epsilon}, {norm.unit_offset}), got ({parts_norm.epsilon}, "
                     f"{parts_norm.unit_offset})")
  if _reduce_axis(proj) is not None:  # tensor parallel: the sum first, then the norms
    y = _row_parallel(proj, h, interpret, adapters)
    if parts_norm is not None:
      y = parts_norm(y.astype(residual.dtype)).astype(jnp.float32)
    x = (residual.astype(jnp.float32) + y).astype(residual.dtype)
    return x, norm(x)
  h_c, kernel, quant = _operands(proj, h)
  mode = triton_backend.kernel_mode(interpret, supported=linear.takes(h_c, kernel))
  if mode is None:
    y = projection(proj, h, adapters=adapters)
    x = residual + (y if parts_norm is None else parts_norm(y))
    return x, norm(x)
  parts = linear.linear_partials(h_c, kernel, interpret=mode, **quant,
                                 low_rank=lora.low_rank(proj, h, adapters))
  bias = None if proj.bias is None else proj.bias[...]
  if parts_norm is None:
    return norm.add(residual, parts, bias, mode)
  return norm.add(residual, parts, bias, mode, parts_norm=parts_norm)


def project_add(proj: Linear, h: jax.Array, residual: jax.Array, *,
                interpret: bool | None = None, adapters: jax.Array | None = None
                ) -> jax.Array:
  """residual + proj(h), for a projection with a long K at decode's few rows.

  On a GPU with at most 256 rows, `proj` runs split-K (`jax_paged.linear.linear_partials`)
  and XLA sums the f32 partials, the bias and the residual in one fusion (which a norm
  after it can join). The whole-K `dense` kernel would run one program per 64 output
  columns and row block: 32 programs for a [8192, 2048] down projection at 64 rows, too
  few to keep HBM busy. Elsewhere, the plain module.

  Args:
    proj: the projection added to the residual stream (kernel [K, N], optional bias [N]),
      float or `weight_quant.Int8Linear`.
    h: [..., K], its input.
    residual: [..., N], the residual stream.
    interpret: None = the kernel on a GPU, plain modules elsewhere; True = the kernel in
      Pallas interpret mode (tests).
    adapters: the rows' LoRA slots (`dense`), or None.

  Returns:
    [..., N] in the residual's dtype.
  """
  if _reduce_axis(proj) is not None:  # tensor parallel
    return (residual.astype(jnp.float32) + _row_parallel(proj, h, interpret, adapters)
            ).astype(residual.dtype)
  h_c, kernel, quant = _operands(proj, h)
  mode = triton_backend.kernel_mode(interpret, supported=linear.takes(h_c, kernel))
  if mode is None:
    return residual + projection(proj, h, adapters=adapters)
  y = jnp.sum(linear.linear_partials(h_c, kernel, interpret=mode, **quant,
                                     low_rank=lora.low_rank(proj, h, adapters)), axis=0)
  if proj.bias is not None:
    y += proj.bias[...].astype(jnp.float32)
  return (residual.astype(jnp.float32) + y).astype(residual.dtype)


class GroupedLinear(nnx.Module):
  """Linear maps, one per group, over rows sorted by group: a mixture of experts'
  projections (`models.moe`).

  Attributes:
    kernel: [groups, in_features, out_features] in `param_dtype`; after `quantize_int8`
      int8 [groups, out_features, in_features] (`transposed`).
    bias: None, or with `use_bias` [groups, out_features] in `param_dtype` (GPT-OSS's
      experts'), each row getting its group's.
    kernel_scale: None, or for int8 weights f32 [groups, out_features] (each group's
      column steps, as `weight_quant.Int8Linear`'s).
    transposed: whether the kernel is stored [groups, out_features, in_features] (int8).
    dtype: the compute dtype (None: the inputs').
    reduce_axis: None, or under tensor parallelism the mesh axis a row-parallel stack's
      partial outputs are summed over (set by `jax_paged.tensor_parallel`; the caller sums,
      after combining the rows, where it is cheapest, and adds a bias once after the sum:
      the call then leaves it out).
  """

  reduce_axis: str | None = None
  kernel_scale: nnx.Param | None = None
  transposed: bool = False

  def __init__(self, groups: int, in_features: int, out_features: int, *,
               use_bias: bool = False, kernel_init=nnx.initializers.lecun_normal(),
               dtype=None, param_dtype=jnp.float32, rngs: nnx.Rngs):
    for name, value in (("groups", groups), ("in_features", in_features),
                        ("out_features", out_features)):
      validation.check_positive_int(name, value)
    self.kernel = nnx.Param(kernel_init(rngs.params(), (groups, in_features, out_features),
                                        param_dtype))
    self.bias = nnx.Param(jnp.zeros((groups, out_features), param_dtype)) if use_bias else None
    self.in_features, self.out_features = in_features, out_features
    self.dtype = dtype

  def __call__(self, x: jax.Array, group_sizes: jax.Array, *,
               interpret: bool | None = None) -> jax.Array:
    """x [rows, in_features] sorted by group, group_sizes int32 [groups] -> float32 [rows,
    out_features]: each group's rows times its kernel (`grouped_matmul`: on a GPU only
    the groups with rows are read), plus its bias (not under row parallelism:
    `reduce_axis`); rows past the groups' total are zero."""
    dtype = self.dtype or x.dtype
    scale = None if self.kernel_scale is None else self.kernel_scale[...]
    kernel = self.kernel[...] if scale is not None else self.kernel[...].astype(dtype)
    y = grouped_matmul.grouped_matmul(x.astype(dtype), kernel, group_sizes, scale=scale,
                                      transposed=self.transposed, interpret=interpret)
    if self.bias is None or self.reduce_axis is not None:
      return y
    # Each row's group: the number of groups ending at or before it (groups past the last
    # row's: no bias, as the rows past the total are zero).
    ends = jnp.cumsum(group_sizes)
    group = jnp.sum(jnp.arange(x.shape[0])[:, None] >= ends[None, :], axis=1)
    bias = jnp.take(self.bias[...].astype(jnp.float32), group, axis=0, mode="fill",
                    fill_value=0.0)
    return y + bias

  def quantize_int8(self) -> bool:
    """Makes the weights int8, in place: per group and output column (`weight_quant`'s
    scheme), stored [groups, out_features, in_features]. False if they already were."""
    if self.kernel_scale is not None:
      return False
    q, scale = jax.vmap(weight_quant.quantize)(self.kernel[...])
    self.kernel = nnx.Param(jnp.swapaxes(q, 1, 2))
    self.kernel_scale = nnx.Param(scale)
    self.transposed = True
    return True


def pool_query(q: jax.Array, kv: pool_lib.KVPool) -> jax.Array:
  """q as the attention kernels take it over `kv`'s pages: in a float pool's dtype; over a
  quantized pool in the compute dtype, which the kernels dequantize the pages into."""
  return q if kv.quantized else q.astype(kv.dtype)


def prefill_pages(slots: jax.Array, lengths: jax.Array, page_size: int,
                  start: jax.Array | None, page_table: jax.Array | None
                  ) -> tuple[jax.Array, jax.Array, jax.Array]:
  """(start, page_table, lengths) over which a prefill's new tokens attend through the
  pages: as given after a cached prefix (`start` set; ValueError without the batch's
  `page_table` rows), or for fresh prompts (start None) their own pages just written,
  whose ids their slots give (token t at slot page * page_size + t % page_size), a row not
  written (slots -1: no room in the pool) with length 0 (it attends to nothing)."""
  if start is not None:
    if page_table is None:
      raise ValueError("prefill with start needs the batch's page_table rows")
    return start, page_table, lengths
  return (jnp.zeros_like(lengths), jnp.maximum(slots[:, ::page_size], 0) // page_size,
          jnp.where(slots[:, 0] >= 0, lengths, 0))


class PagedAttention(nnx.Module):
  """Self-attention with a paged KV cache.

  Parameters: `qkv`, one fused projection [in_features, (num_heads + 2 * num_kv_heads) *
  head_dim] whose output is q, then k, then v, each head-major (GPT-2's `c_attn` layout);
  `out` [num_heads * head_dim, in_features].

  Attributes:
    rope: a `RotaryEmbedding` applied to q and k (K is cached rotated), or None (a model
      with learned or no positions).
    q_norm, k_norm: norms of [head_dim] applied to each head of q and of k before RoPE
      (Qwen3's, Gemma 3's; K is cached normalised), made by `head_norm(head_dim)`, or
      None (`head_norm` None); with `qk_norm_all_heads`, norms of all of q's heads
      together ([num_heads * head_dim]) and of all of k's ([num_kv_heads * head_dim]):
      OLMo's. A model may set its own modules of [..., heads, head_dim] instead
      (`HeadLayerNorm`: a weight per head, StableLM's). (A norm across heads cannot run
      on a tensor parallel device's heads alone: `jax_paged.tensor_parallel` refuses such
      a layer.)
    qk_norm_after_rope: whether each head's q / k norm applies after RoPE instead of
      before (Hunyuan's query_layernorm / key_layernorm).
    sliding_window: W > 0 limits each token to the last W positions, itself included
      (Mistral's window), at prefill and decode; None = every earlier position.
    attention_chunk: C > 0 limits the token at position p to the earlier positions of its
      chunk of C, [floor(p / C) * C, p] (Llama 4's chunked local attention), at prefill
      and decode; None = no chunks.
    query_temperature: a `QueryTemperature` scaling the query at each position (after
      RoPE and the q norm), at prefill and decode, or None.
    logits_soft_cap: C > 0 caps the attention logits to C * tanh(logits / C) before the
      softmax (Gemma 2's soft-capping), at prefill and decode; None = no cap.
    alibi_slopes: a `Constant` of float32 [num_heads] (`alibi_slopes(num_heads)`), or
      None: ALiBi adds head h's slope times (key position - query position) to its
      logits (after a cap), at prefill and decode.
    clip_qkv: c > 0 clamps the q / k / v projection's outputs to [-c, c] before any norm
      or RoPE (OLMo's, MPT's), or None.
    sinks: an `nnx.Param` [num_heads] in param_dtype (made zero with `sinks=True`: a
      checkpoint fills it), or None: attention sinks (GPT-OSS's), a learned logit per head
      that each softmax also counts, without a value (its weights then sum to less than
      1), at prefill and decode.
    decode_impl: "kernel" (`jax_paged.paged_attention`: the Triton kernel on a GPU, plain
      XLA elsewhere), "reference" (`jax_paged.reference`, for comparisons) or "auto" (the
      kernel where it supports the head dim and page size, else the reference).
  """

  def __init__(self, in_features: int, num_heads: int, head_dim: int, *,
               num_kv_heads: int | None = None, scale: float | None = None,
               qkv_bias: bool = True, out_bias: bool = True,
               rope: RotaryEmbedding | None = None, sliding_window: int | None = None,
               attention_chunk: int | None = None,
               query_temperature: QueryTemperature | None = None,
               logits_soft_cap: float | None = None,
               alibi_slopes: Sequence[float] | np.ndarray | None = None,
               clip_qkv: float | None = None, sinks: bool = False,
               head_norm: Callable[[int], RMSNorm] | None = None,
               qk_norm_all_heads: bool = False, qk_norm_after_rope: bool = False,
               decode_impl: DecodeImpl = "auto",
               kernel_init: nnx.Initializer = nnx.initializers.lecun_normal(),
               dtype=None, param_dtype=jnp.float32, rngs: nnx.Rngs):
    num_kv_heads = num_heads if num_kv_heads is None else num_kv_heads
    if num_heads % num_kv_heads:
      raise ValueError(f"num_heads ({num_heads}) must be a multiple of num_kv_heads "
                       f"({num_kv_heads})")
    if decode_impl not in ("auto", "kernel", "reference"):
      raise ValueError(f"decode_impl must be 'auto', 'kernel' or 'reference', got "
                       f"{decode_impl!r}")
    if rope is not None and (not isinstance(rope, RotaryEmbedding) or rope.head_dim != head_dim):
      raise ValueError(f"rope must be a RotaryEmbedding of head_dim={head_dim} or None, got "
                       f"{rope!r}")
    self.num_heads = num_heads
    self.num_kv_heads = num_kv_heads
    self.head_dim = head_dim
    self.scale = head_dim ** -0.5 if scale is None else scale
    self.rope = rope
    self.sliding_window = validation.check_positive_int("sliding_window", sliding_window,
                                                        optional=True)
    self.attention_chunk = validation.check_positive_int("attention_chunk", attention_chunk,
                                                         optional=True)
    if query_temperature is not None and not isinstance(query_temperature, QueryTemperature):
      raise ValueError(f"query_temperature must be a QueryTemperature or None, got "
                       f"{query_temperature!r}")
    self.query_temperature = None if query_temperature is None else query_temperature.check()
    self.logits_soft_cap = validation.check_positive_number("logits_soft_cap",
                                                          logits_soft_cap, optional=True)
    if alibi_slopes is not None:
      alibi_slopes = np.asarray(alibi_slopes, np.float32)
      if alibi_slopes.shape != (num_heads,) or not np.isfinite(alibi_slopes).all():
        raise ValueError(f"alibi_slopes must be {num_heads} finite numbers (one per head), "
                         f"got {alibi_slopes}")
      alibi_slopes = Constant(jnp.asarray(alibi_slopes))
    self.alibi_slopes = alibi_slopes
    self.clip_qkv = validation.check_positive_number("clip_qkv", clip_qkv, optional=True)
    self.sinks = nnx.Param(jnp.zeros((num_heads,), param_dtype)) if sinks else None
    self.decode_impl = decode_impl
    self.qk_norm_all_heads = bool(qk_norm_all_heads)
    if self.qk_norm_all_heads and head_norm is None:
      raise ValueError("qk_norm_all_heads needs a head_norm to make the norms")
    self.qk_norm_after_rope = bool(qk_norm_after_rope)
    if self.qk_norm_after_rope and (head_norm is None or self.qk_norm_all_heads):
      raise ValueError("qk_norm_after_rope needs a head_norm of each head (not "
                       "qk_norm_all_heads)")
    q_width, k_width = ((num_heads * head_dim, num_kv_heads * head_dim)
                        if self.qk_norm_all_heads else (head_dim, head_dim))
    self.q_norm = None if head_norm is None else head_norm(q_width)
    self.k_norm = None if head_norm is None else head_norm(k_width)
    self.qkv = nnx.Linear(in_features, (num_heads + 2 * num_kv_heads) * head_dim,
                          use_bias=qkv_bias, kernel_init=kernel_init, dtype=dtype,
                          param_dtype=param_dtype, rngs=rngs)
    self.out = nnx.Linear(num_heads * head_dim, in_features, use_bias=out_bias,
                          kernel_init=kernel_init, dtype=dtype, param_dtype=param_dtype,
                          rngs=rngs)

  def _project(self, x: jax.Array, positions: jax.Array | None = None,
               adapters: jax.Array | None = None
               ) -> tuple[jax.Array, jax.Array, jax.Array]:
    """x [..., in_features] -> q [..., H, D], k and v [..., Hkv, D], with q and k each
    head (or all heads together: `qk_norm_all_heads`) normalised when the layer has
    `q_norm` / `k_norm` (after a `clip_qkv` clamp), then rotated to `positions`
    (int [...], required with a `rope`) when it has a `rope` (with
    `qk_norm_after_rope`, rotated first, then normalised), and the rows' LoRA updates
    (`adapters`, see `dense`)."""
    h, hkv, d = self.num_heads, self.num_kv_heads, self.head_dim
    q, k, v = dense(self.qkv, x, sections=(h * d, hkv * d, hkv * d), adapters=adapters)
    if self.clip_qkv is not None:
      q, k, v = (jnp.clip(t, -self.clip_qkv, self.clip_qkv) for t in (q, k, v))
    lead = x.shape[:-1]
    if self.qk_norm_all_heads:
      q, k = self.q_norm(q).astype(q.dtype), self.k_norm(k).astype(k.dtype)
    q, k, v = q.reshape(lead + (h, d)), k.reshape(lead + (hkv, d)), v.reshape(lead + (hkv, d))
    head_norms = self.q_norm is not None and not self.qk_norm_all_heads
    if head_norms and not self.qk_norm_after_rope:
      q, k = self.q_norm(q).astype(q.dtype), self.k_norm(k).astype(k.dtype)
    if self.rope is not None:
      if positions is None:
        raise ValueError("a layer with a rope needs the tokens' positions")
      q, k = self.rope(q, positions), self.rope(k, positions)
    if head_norms and self.qk_norm_after_rope:
      q, k = self.q_norm(q).astype(q.dtype), self.k_norm(k).astype(k.dtype)
    return self._temper(q, positions), k, v

  def _temper(self, q: jax.Array, positions: jax.Array | None) -> jax.Array:
    """q [..., H, D] at `positions` (int [...]) scaled by its `query_temperature` (in
    float32, rounded back to q's dtype, as Hugging Face's Llama 4), or q itself."""
    if self.query_temperature is None:
      return q
    if positions is None:
      raise ValueError("a layer with a query_temperature needs the tokens' positions")
    return (q * self.query_temperature(positions)[..., None, None]).astype(q.dtype)

  def prefill(self, x: jax.Array, kv: pool_lib.KVPool, layer: int, slots: jax.Array,
              lengths: jax.Array, *, start: jax.Array | None = None,
              page_table: jax.Array | None = None, project: bool = True,
              adapters: jax.Array | None = None) -> tuple[jax.Array, pool_lib.KVPool]:
    """New tokens of several sequences: a prompt, or the rest of one after a cached prefix
    (prefix caching) or earlier chunks (chunked prefill).

    With a quantized pool (int8 / float8_e4m3fn) the prompt attends to its K/V as the pool
    stores them, quantized and dequantized (`kv_quant.fake_quantize`, the values the
    pages and scales hold), not to the unquantized projections: every attention then sees
    the same cache, so a prompt's logits are those decoding it token by token over the
    pages would give, a prefix read back from the pool (a cached prefix, a prompt
    recomputed after preemption) gives what its first prefill gave, and the accuracy
    bound measured for the quantized cache covers the prompt too. It costs one
    elementwise pass over the prompt's K/V; the attention itself is unchanged.

    Args:
      x: [B, T, in_features], the new tokens right-padded to T.
      kv: the pool.
      layer: this layer's index in the pool.
      slots: int32 [B, T] from `reserve`; -1 at padding, which is never written.
      lengths: int32 [B], real new tokens per row (the rest is padding).
      start: None for fresh sequences (attention over the new tokens only: cuDNN's flash
        attention on a GPU; with a soft cap, ALiBi or sinks, or on a GPU where cuDNN does
        not take q, the paged prefill kernel over the pages they were just written to:
        `_prompt_through_pages`); or int32 [B], tokens each sequence already holds in its
        pages, which the new ones (at positions start + t) attend to along with
        themselves, read from the pages.
      page_table: int32 [B, max_pages_per_seq], the rows of `kv.page_table` of the batch
        (needed with `start`).
      project: False returns the attention output before the `out` projection, [B, T,
        num_heads * head_dim], for a caller that fuses it (`project_add_norm`).
      adapters: int32 [B], each row's LoRA slot (-1: none), or None (`jax_paged.lora`).

    Returns:
      (y [B, T, in_features], pool with this layer's K/V written). Rows past a prompt's
      length are garbage.
    """
    # New token t of a row sits at position start + t.
    positions = jnp.arange(x.shape[1])[None, :] + (0 if start is None else start[:, None])
    q, k, v = self._project(x, positions, adapters)
    kv = pool_lib.write_kv(kv, layer, slots, k, v)
    if kv.quantized:
      k, v = kv_quant.fake_quantize(k, kv.dtype), kv_quant.fake_quantize(v, kv.dtype)
    if start is None and not self._prompt_through_pages(q, kv):
      y = prompt_attention(q, k, v, lengths, scale=self.scale,
                           sliding_window=self.sliding_window)
    else:
      start, page_table, lengths = prefill_pages(slots, lengths, kv.page_size, start,
                                                 page_table)
      # The Triton kernel on a GPU (XLA's reference elsewhere), reading the layer in place
      # (a quantized pool's narrow pages dequantized in registers).
      y = paged_prefill.paged_prefill_attention(
          pool_query(q, kv), kv.k_pages, kv.v_pages, page_table,
          start, lengths, layer=layer, k_scales=kv.k_scales, v_scales=kv.v_scales,
          scale=self.scale, logits_soft_cap=self.logits_soft_cap,
          sliding_window=self.sliding_window, alibi_slopes=self._slopes(),
          sinks=self._sinks(), attention_chunk=self.attention_chunk).astype(q.dtype)
    y = y.reshape(x.shape[:2] + (-1,))
    return (projection(self.out, y, adapters=adapters) if project else y), kv

  def _slopes(self) -> jax.Array | None:
    return None if self.alibi_slopes is None else self.alibi_slopes[...]

  def _sinks(self) -> jax.Array | None:
    return None if self.sinks is None else self.sinks[...].astype(jnp.float32)

  def _prompt_through_pages(self, q: jax.Array, kv: pool_lib.KVPool) -> bool:
    """Whether fresh prompts (q [B, T, H, D]) attend through the paged prefill kernel
    over the pages just written rather than `prompt_attention`: with a soft cap, ALiBi,
    sinks or chunks, which neither cuDNN's nor XLA's fused attention applies (XLA's would
    take ALiBi as a [B, H, T, T] bias, chunks as a [T, T] mask); and on a GPU where cuDNN
    does not take q (head dims past 128, f32) but the kernel does, rather than XLA's
    attention, which writes [B, H, T, T] f32 logits."""
    return (self.logits_soft_cap is not None or self.alibi_slopes is not None
            or self.sinks is not None or self.attention_chunk is not None) or (
        jax.default_backend() == "gpu" and not _cudnn_supports(q)
        and validation.kernel_supports(self.head_dim, kv.page_size))

  def decode(self, x: jax.Array, kv: pool_lib.KVPool, layer: int, slots: jax.Array,
             page_table: jax.Array, lengths: jax.Array, *, project: bool = True,
             adapters: jax.Array | None = None) -> tuple[jax.Array, pool_lib.KVPool]:
    """One new token per sequence, attending to everything in its pages.

    Args:
      x: [B, in_features].
      kv: the pool.
      layer: this layer's index in the pool (a Python int).
      slots: int32 [B] the new tokens' slots from `reserve`; -1 = inactive row, not written.
      page_table: int32 [B, max_pages_per_seq], the rows of `kv.page_table` of the batch.
      lengths: int32 [B] tokens to attend to, the new one included (0 for an inactive row,
        whose output is then 0); the new token sits at position lengths - 1.
      project: False returns the attention output before the `out` projection, [B,
        num_heads * head_dim] (see `prefill`).
      adapters: int32 [B], each row's LoRA slot (-1: none), or None (`jax_paged.lora`).

    Returns:
      (y [B, in_features], pool with the new tokens' K/V written).
    """
    b = x.shape[0]
    d = self.head_dim
    if self.rope is None and self.k_norm is None and self.clip_qkv is None and (
        adapters is None or not lora.attached(self.qkv)):
      x_c, kernel, quant = _operands(self.qkv, x)
      # On a GPU one kernel: the projection, K and V stored straight into the pages.
      q, kv = pool_lib.project_write_kv(
          kv, layer, slots, x_c, kernel,
          None if self.qkv.bias is None else self.qkv.bias[...], q_width=self.num_heads * d,
          **quant)
      q = self._temper(q.reshape(b, -1, d), jnp.maximum(lengths - 1, 0))
    else:
      # K must be clamped, normalised, rotated or get its LoRA update before it is stored,
      # which the fused kernel cannot do.
      q, k, v = self._project(x, jnp.maximum(lengths - 1, 0), adapters)
      kv = pool_lib.write_kv(kv, layer, slots, k, v)
    use_kernel = self.decode_impl == "kernel" or (
        self.decode_impl == "auto" and validation.kernel_supports(d, kv.page_size))
    if self.decode_impl == "auto":
      validation.warn_if_reference_on_gpu("paged decode attention", d, kv.page_size)
    attend = (paged_attention.paged_decode_attention if use_kernel
              else reference.paged_decode_attention)
    # The whole pool with `layer`: the kernel reads the layer in place.
    q = q.reshape(b, -1, d)
    y = attend(pool_query(q, kv), kv.k_pages, kv.v_pages,
               page_table, lengths, layer=layer, k_scales=kv.k_scales, v_scales=kv.v_scales,
               scale=self.scale, logits_soft_cap=self.logits_soft_cap,
               sliding_window=self.sliding_window, alibi_slopes=self._slopes(),
               sinks=self._sinks(), attention_chunk=self.attention_chunk)
    y = y.reshape(b, -1).astype(x.dtype)
    return (projection(self.out, y, adapters=adapters) if project else y), kv
