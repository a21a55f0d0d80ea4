"""Quantized KV cache dtypes: int8 and float8_e4m3fn pages with per-token scales.

A quantized pool stores each token's K (and V) of each kv head as `head_dim` narrow values
plus one float32 scale: x ~= q * scale with scale = max|x| / QMAX (QMAX = 127 for int8,
448 for e4m3, the largest finite value). The scale is computed from the token alone when
it is written, so a write never rescales the tokens already stored, pages are
self-contained (a page copied with its scales is a copy), and no calibration pass is
needed. Zero rows get scale 0 and quantize to 0.

float8_e4m3fn uses the same per-token-per-head scale as int8 rather than one scale per
layer and kv head: a per-layer scale would have to be known before the first write
(calibrated offline, or 1.0 as vLLM's uncalibrated default) because a running maximum
would rescale old tokens; per-token scaling needs neither and puts every token's largest
value at e4m3's top binade, away from its subnormals. The kernels run one dequantization
path for both dtypes.

Dequantization happens where the values are used: the decode kernel converts the narrow
tile to the query's dtype or to f16 (exact: int8 and e4m3 values are bf16 / f16 / f32
values) and folds the scales into the logits (K) and the probabilities (V), so no [tokens,
D] multiply is added; the reference and the XLA paths multiply in f32 (`dequantize`).

A quantized pool stores V token-minor, `v_pages` [..., num_pages, D, page_size] (K and
float pools keep [..., page_size, D]; `v_pages_shape`, `transpose_pages`). The decode
kernel's p.v dot contracts over tokens, and a 1-byte operand whose contracted axis is not
contiguous reaches the tensor cores as byte loads from shared memory (no ldmatrix
transpose exists for 8-bit tiles): with tokens contiguous the V tile streams like K's,
which took the quantized kernel from 0.60-0.80x to 0.54-0.60x the bf16 kernel's time on
GPT-2, GQA and MHA shapes (H100, benchmarks/LOG.md). vLLM's first paged attention kernel
stored V the same way ([blocks, heads, head_size, block_size]).

`quantize` is plain jnp made of operations Pallas-Triton lowers (abs, max, divide, floor,
min / max, select, converts: there is no lowering for `round`), so the write kernels run
this same function on their tiles.
"""

from __future__ import annotations

import math

import jax
from jax.experimental.pallas import triton as plgpu
import jax.numpy as jnp

INT8 = jnp.dtype(jnp.int8)
FP8 = jnp.dtype(jnp.float8_e4m3fn)
QUANTIZED_DTYPES = (INT8, FP8)
# The largest magnitude each dtype represents (e4m3fn: 1.75 * 2**8; no infinity).
QMAX = {INT8: 127.0, FP8: float(jnp.finfo(jnp.float8_e4m3fn).max)}
SCALE_DTYPE = jnp.dtype(jnp.float32)


def is_quantized(dtype) -> bool:
  """Whether a cache dtype stores scaled narrow values (int8, float8_e4m3fn)."""
  return jnp.dtype(dtype) in QUANTIZED_DTYPES


def bytes_per_head_token(head_dim: int, dtype) -> int:
  """Bytes one token's K (or V) of one kv head takes in a pool of `dtype`, its scale
  included."""
  dtype = jnp.dtype(dtype)
  return head_dim * dtype.itemsize + (SCALE_DTYPE.itemsize if is_quantized(dtype) else 0)


def v_pages_shape(k_pages_shape: tuple[int, ...], dtype) -> tuple[int, ...]:
  """The shape of `v_pages` beside `k_pages` of `k_pages_shape` ([..., page_size, D]) in a
  pool of cache dtype `dtype`: the same for float pools, [..., D, page_size] (token-minor)
  for int8 / float8_e4m3fn."""
  k_pages_shape = tuple(k_pages_shape)
  if not is_quantized(dtype):
    return k_pages_shape
  return k_pages_shape[:-2] + (k_pages_shape[-1], k_pages_shape[-2])


def transpose_pages(x: jax.Array) -> jax.Array:
  """Swaps the last two axes: token-major pages [..., page_size, D] <-> a quantized pool's
  token-minor V pages [..., D, page_size] (its own inverse)."""
  return jnp.swapaxes(x, -1, -2)


def quantize(x: jax.Array, dtype) -> tuple[jax.Array, jax.Array]:
  """Symmetric quantization with one scale per vector along the last axis.

  Args:
    x: [..., D] of any float dtype (one token's K or V of one head per [D] vector).
    dtype: int8 or float8_e4m3fn.

  Returns:
    (q [..., D] in `dtype`, float32 scales [...]) with x ~= q * scales. int8 rounds the
    scaled value half up (floor(v + 0.5)), float8 to nearest even (the convert's). A
    vector holding NaN or inf gets a NaN or inf scale and zeros for those values: no NaN
    byte is ever stored (the decode kernel reads the unused slots of a page with zero
    weight), and the vector still reads as non-finite.
  """
  dtype = jnp.dtype(dtype)
  qmax = QMAX[dtype]
  x = x.astype(jnp.float32)
  absmax = jnp.max(jnp.abs(x), axis=-1)
  inv = jnp.where(absmax > 0, qmax / jnp.where(absmax > 0, absmax, 1.0), 0.0)
  y = x * inv[..., None]
  if dtype == INT8:
    y = jnp.floor(y + 0.5)
  # Products can land a rounding step past qmax; e4m3fn has no infinity (it would be NaN).
  y = jnp.minimum(jnp.maximum(y, -qmax), qmax)
  y = jnp.where(y == y, y, 0.0)  # NaN (x NaN or inf) -> 0: the scale says it
  return y.astype(dtype), absmax / qmax


def f16_rows(q: jax.Array) -> tuple[jax.Array, jax.Array]:
  """Inside a kernel, for dots in f16 (narrow pages convert to f16 cheaply: float8 by one
  convert per two values): q [M, D] bf16 as f16 exactly, each row divided by the power of
  two at or below its largest magnitude (its exponent bits; f16 has 3 more mantissa bits
  than bf16, so any bf16 row fits), and those powers f32 [M] (1 for an all-zero row), by
  which the row's logits are multiplied back."""
  q32 = q.astype(jnp.float32)
  exponent = jax.lax.bitcast_convert_type(jnp.max(jnp.abs(q32), axis=1),
                                          jnp.int32) & 0x7F800000
  row_pow2 = jax.lax.bitcast_convert_type(exponent, jnp.float32)
  row_pow2 = jnp.where(row_pow2 > 0, row_pow2, 1.0)
  return (q32 / row_pow2[:, None]).astype(jnp.float16), row_pow2


def f16_weight_scales(v_scales: jax.Array) -> tuple[jax.Array, jax.Array]:
  """Inside a kernel, for f16 probability weights (p * V scale) of a block: its V scales
  f32 [N] over their largest (so the weights stay in [0, 1]; tiny scales would make them
  f16 subnormals), and that largest (1 if all are 0), by which p.v is multiplied back."""
  v_max = jnp.max(v_scales)
  v_max = jnp.where(v_max > 0, v_max, 1.0)
  return v_scales / v_max, v_max


def load_v_block(v_ref, page_table_ref, b, first_page, end, *, head_page, head_dim: int,
                 page_size: int, pages_per_block: int, cols, col_mask,
                 eviction_policy: str | None = None) -> jax.Array:
  """Inside a kernel: a block of V [block_d, pages_per_block * page_size] (tokens
  contiguous) read as whole pages of a token-minor pool, v_ref [L * Hkv * num_pages * D,
  page_size] (row (head_page + page id) * D + d): pages first_page.. of sequence b's
  page table row, those starting at or past token `end` masked (None: all are used),
  `cols` [block_d] the head dims (`col_mask` None or cols < D).

  The masks are whole pages (constant along the tokens), so the loads stay 16-byte
  vectors; the slots of a used page that the caller does not attend to are read and must
  get zero weight (their scales load as 0), so they must be finite: `quantize` never
  stores a NaN."""
  page = first_page + jnp.arange(pages_per_block)
  used = None if end is None else page * page_size < end
  ids = plgpu.load(page_table_ref.at[b, page], mask=used, other=None if used is None else 0)
  block_d = cols.shape[0]
  shape = (block_d, pages_per_block, page_size)
  rows = ((head_page + ids) * head_dim)[None, :, None] + cols[:, None, None]
  mask = None if used is None else used[None, :, None]
  if col_mask is not None:
    mask = col_mask[:, None, None] if mask is None else mask & col_mask[:, None, None]
  offsets = jnp.broadcast_to(jnp.arange(page_size)[None, None, :], shape)
  v = plgpu.load(v_ref.at[jnp.broadcast_to(rows, shape), offsets],
                 mask=None if mask is None else jnp.broadcast_to(mask, shape),
                 other=None if mask is None else 0.0, eviction_policy=eviction_policy)
  return v.reshape(block_d, pages_per_block * page_size)


def dequantize(q: jax.Array, scales: jax.Array, dtype=jnp.float32) -> jax.Array:
  """q [..., D] narrow values and their float32 scales [...] -> q * scales in `dtype`
  (computed in f32)."""
  return (q.astype(jnp.float32) * scales[..., None]).astype(dtype)


def fake_quantize(x: jax.Array, dtype) -> jax.Array:
  """x [..., D] as a pool of `dtype` stores it: quantized and dequantized, in x's dtype."""
  return dequantize(*quantize(x, dtype), dtype=x.dtype)


# jax's Pallas-Triton lowering forms a kernel operand's element offsets in 32 bits unless
# the operand exceeds 2**32 bytes, and Triton adds them to the pointer as signed values. A
# 1-byte operand of 2**31 to 2**32 elements (an int8 / float8 K or V pool of 2-4 GiB) is
# therefore addressed past element 2**31 - 1 with wrapped, negative offsets: an illegal
# memory access. Wider dtypes pass 2**32 bytes before 2**31 elements, so only 1-byte pools
# meet this window.
_I32_ELEMENTS = 2 ** 31
_I32_BYTES = 2 ** 32


def kernel_addressable(shape: tuple[int, ...], dtype) -> bool:
  """Whether compiled Pallas-Triton kernels address an array of this shape and dtype
  correctly (see above): fewer than 2**31 elements, or more than 2**32 bytes."""
  elements = math.prod(shape)
  return elements < _I32_ELEMENTS or elements * jnp.dtype(dtype).itemsize > _I32_BYTES


def max_addressable_pages(page_elements: int, dtype, num_pages: int) -> int:
  """The most pages, at most `num_pages`, of `page_elements` elements each that a page
  array of `dtype` may hold and stay `kernel_addressable`: num_pages itself, or for a 1-byte
  pool landing in 2**31..2**32 elements the largest count below 2**31 elements."""
  if kernel_addressable((num_pages, page_elements), dtype):
    return num_pages
  return (_I32_ELEMENTS - 1) // page_elements


def min_addressable_pages(page_elements: int, dtype, num_pages: int) -> int:
  """The fewest pages, at least `num_pages`, that stay `kernel_addressable`: num_pages
  itself, or for a 1-byte pool in the window the smallest count past 2**32 bytes."""
  if kernel_addressable((num_pages, page_elements), dtype):
    return num_pages
  return _I32_BYTES // page_elements + 1


def check_compiled(pages: jax.Array, what: str) -> None:
  """Raises ValueError for page arrays that compiled kernels cannot read or write: float8
  on a GPU below compute capability 8.9 (`check_fp8_device`), and 1-byte arrays in the
  window `kernel_addressable` excludes (pages: [L, Hkv, num_pages, ...], one layer
  without L)."""
  check_fp8_device(pages.dtype, what)
  if kernel_addressable(pages.shape, pages.dtype):
    return
  page_axis = len(pages.shape) - 3  # [..., num_pages, page_size, D] or token-minor V's [.., D, ps]
  page_elements = math.prod(pages.shape) // pages.shape[page_axis]
  below, above = (fn(page_elements, pages.dtype, pages.shape[page_axis])
                  for fn in (max_addressable_pages, min_addressable_pages))
  raise ValueError(
      f"{what} {pages.dtype} pages of {math.prod(pages.shape):,} elements: jax's Pallas-"
      "Triton kernels address a 1-byte array of 2**31 to 2**32 elements (2-4 GiB) with "
      "wrapped 32-bit offsets (an illegal memory access). Use at most "
      f"{below} pages or at least {above} (`pool.size_pool` sizes budgets below this "
      "window)")


def check_fp8_device(dtype, what: str) -> None:
  """Raises ValueError if `dtype` is float8_e4m3fn and the default device is a GPU whose
  Triton kernels cannot convert it (compute capability below 8.9: Ampere and older)."""
  if jnp.dtype(dtype) != FP8 or jax.default_backend() != "gpu":
    return
  device = jax.devices()[0]
  capability = getattr(device, "compute_capability", None)
  if capability is not None and tuple(map(int, str(capability).split("."))) < (8, 9):
    raise ValueError(f"{what} float8_e4m3fn needs a GPU of compute capability >= 8.9 (Ada, "
                     f"Hopper) for its Triton kernels; {device.device_kind} has {capability}: "
                     "use int8")

