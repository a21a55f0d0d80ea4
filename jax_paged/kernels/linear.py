"""Linear layers at decode's few rows: one Pallas-Triton GEMM with its epilogue fused.

A decode step projects one row per sequence (tens to a few hundred rows): the product is
bound by reading the weights and by latency, not by math. XLA runs it as a split-K GEMM
plus a second kernel that reduces the splits and applies the bias and any activation. At
GPT-2 124M's shapes and 128 rows on an H200, this kernel walks the whole K in each program
instead (one program per `block_n` output columns and 64 rows, 3-4 loads in flight per
program) and applies bias and activation to the f32 accumulator before the one store:
5.3-5.5 µs per product with cold weights where XLA's GEMM + reduction took 7.8-8.2
(benchmarks/LOG.md, "GEMMs / linear").

`linear_partials` keeps K split and returns the f32 partial products, for a consumer that
sums them anyway (`layer_norm.add_layer_norm` folds the sum into the residual add).
`argmax_attend` is a tied LM head's greedy token (argmax of x @ embedding.T) with the
argmax as the GEMM's epilogue, so the [rows, vocab] logits are never written.

Weights may be int8 with one f32 scale per output column (`jax_paged.weight_quant`,
weight-only W8A16): the kernels read the int8 tiles (half the bytes), convert them to x's
dtype for the tensor cores, and multiply the f32 accumulator by the columns' scales in
the epilogue, so the product is x @ (kernel * scale) with no dequantized copy anywhere.
A kernel may be stored transposed, [N, K] (`transposed=True`): the layout int8 tiles need
to reach the tensor cores at speed (K contiguous), with deeper K steps than bf16's tiles
(Llama-3.1-8B at 1 row on an H200, bf16 / int8 [K, N] / int8 [N, K]: gate/up 55 / 49 / 32
µs, down 33 / 45 / 17; benchmarks/LOG.md, "twenty-ninth").

Grid (N / block_n, splits, row blocks). A program owns output columns [n * block_n,
(n + 1) * block_n) of up to 64 rows (padded to a power of two >= 16, the smallest
tensor-core tile) and one contiguous K range; f32 accumulation. Rows, columns and K are
masked where they do not fill a block.
"""

from __future__ import annotations

import functools
import itertools
import math
from typing import Callable, NamedTuple, Sequence

import jax
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu
import jax.numpy as jnp

from jax_paged.kernels import triton_backend
from jax_paged.kernels import validation

# Rows the kernel takes; more (a prompt) go to XLA, whose GEMMs are then compute-bound.
MAX_ROWS = 256
# ... and of a weight of at least _LARGE_WEIGHT elements (Llama-3.2-1B's: 4M-34M; GPT-2
# 124M's are 0.6M-2.4M) only _LARGE_WEIGHT_ROWS: past one row block its whole-K programs
# lose to XLA's GEMM there (H200, cold weights, 160 rows: Llama-1B's qkv 29.6 vs 22.3 µs,
# down 58.6 vs 36.6; its decode step at batch 256 6,413 -> 5,673 µs, a speculative round
# of 32 x 5 tokens 0.56 -> 0.80x plain decoding; LOG.md, "twenty-fifth"), while GPT-2's
# smaller weights keep the kernel ahead up to 256 rows (its step at batch 128: 1,506 µs
# vs 1,655 with XLA's GEMMs).
_LARGE_WEIGHT, _LARGE_WEIGHT_ROWS = 1 << 22, 64
# Measured on an H200 at 128 rows (benchmarks/LOG.md, "GEMMs / linear"): 128-deep K steps and 4
# stages were the best or within 0.1 µs of it for K = 768 (N = 2304, 3072). Warps, in the
# decode step (LOG.md, "GEMMs / linear"): 8 for whole-K programs (64-column
# tiles; qkv + K/V write and c_fc 0.15 µs faster each than at 4), 4 for
# `linear_partials` (32 columns; 0.3 µs slower each at 8).
_BLOCK_K, _NUM_STAGES = 128, 4
_NUM_WARPS, _PARTIALS_NUM_WARPS = 8, 4
# Columns per whole-K program: 64 (qkv and c_fc of GPT-2 at 128 rows on an H200: 4.9 / 5.2
# µs vs 5.4 / 5.7 at 32; LOG.md, "GEMMs / linear"), or 32 where the output's
# sections (q / k / v, heads) are not whole blocks of 64. `linear_partials` keeps 32: 64
# was slower for the attention's out projection there (3.1 vs 2.7 µs).
_BLOCK_N, _NARROW_BLOCK_N = 64, 32
# A long K (Llama-3.2-1B's 2048 and 8192; LOG.md, "GEMMs / linear", 2026-11-25) makes each
# whole-K program's serial loop long, so the grid must fill the GPU: 4 warps, and 32-column
# programs (qkv's 3072 columns at 64 rows: 96 programs rather than 48), or for an output
# of at least _WIDE_N columns 64-column programs of 64-deep steps (H200, 2026-12-02, 64
# rows, cold weights, µs at 64 / 128 columns: K x N 2048 x 8192 14.5 / 15.9, 2560 x
# 10240 19.3 / 20.7, 3072 x 9216 21.5 / 22.8, 2048 x 11264 16.9 / 18.4, 2048 x 16384 20.1
# / 20.6, 6144 x 24576 74.1 / 75.7; int8 [N, K] kernels keep 128). `linear_partials` into
# 2048 columns and more takes 32 columns and 4 work units (`_partials_tiles`) where it
# took 64 and 8: each K split writes an f32 partial the consumer reads back. With both,
# the Llama decode step on an H200 ran 2325 -> 2200 µs at batch 64 and 6900 -> 6400 at
# batch 256.
_LONG_K, _WIDE_N = 2048, 8192
_LONG_K_NUM_WARPS = 4
_WIDE_BLOCK_N, _WIDE_BLOCK_K = 64, 64
_INT8_WIDE_BLOCK_N = 128
# Rows per program (H100, 128 rows, LOG.md "GEMMs / linear"): 64-row blocks
# made c_fc 0.4 µs faster than one 128-row block, and `linear_partials` splits rows before
# K, since every K split adds a partial for the consumer to read and a row block does not
# (attention out + add_layer_norm 4.9 vs 5.5 µs, c_proj 7.8 vs 8.9).
_ROW_BLOCK = 64
# Int8 kernels stored [N, K] (`jax_paged.weight_quant`) read K-contiguous int8 rows, half a
# bf16 tile's bytes per step, so their steps go deeper (H200, 1-64 rows, cold weights;
# LOG.md, "twenty-ninth"). Whole-K: 32-column programs of 256-deep steps (Llama-3.1-8B's
# q/k/v 12.3 vs 13.0 µs at 1 row; GPT-2's c_fc 2.8 vs 3.4, at 64 rows 4.1 vs 6.7), and for
# a wide output 128 columns of 128-deep steps up to 16 rows (8B gate/up 32.2 vs 46.5 µs),
# 64-deep past them (54.8 vs 69.6 at 64 rows); 4 warps. `linear_partials` at a long K: 4
# work units of 64 columns, 256 deep, up to 16 rows (8B down 17.4 vs 19.7 µs at 1 row;
# 8 units of 128-deep steps ran 17.2, but the norm after it reads every unit's partial),
# 8 units of 128 columns, 64 deep past them (28.8 vs 45.0 at 64 rows; 8B o 11.0 vs 16.2).
_INT8_BLOCK_K, _INT8_WIDE_BLOCK_K = 256, 128
_INT8_FEW_ROWS = 16
_INT8_PARTIALS_UNITS = 8
# `linear_partials` shrinks its K step toward even splits down to this depth, and below it
# only where rounding the splits up to whole steps would lose one.
_MIN_EVEN_BLOCK_K = 64
# Shared memory for the pipelined x and kernel tiles: an H100 / H200 SM has 227 KB, and
# Triton buffers num_stages - 1 copies of each (f32 at 128 rows, 128-deep K, 4 stages asked
# for 240 KB = 3 x 80 KB and failed to launch).
_SMEM_BYTES = 200 * 1024


# A low-rank update added to a GEMM's output (a LoRA adapter's, `jax_paged.lora`):
# (xa [..., W], b [W, N]), x's dtype, W a power of two >= 16; the GEMM adds xa @ b.
LowRank = tuple[jax.Array, jax.Array]


def _low_rank_product(low_rank: LowRank) -> jax.Array:
  xa, b = low_rank
  return jnp.einsum("...w,wn->...n", xa, b, precision=lax.Precision.HIGHEST,
                    preferred_element_type=jnp.float32)


def scaled_product(x: jax.Array, kernel: jax.Array, scale: jax.Array | None = None,
                   transposed: bool = False) -> jax.Array:
  """Plain XLA: f32 x @ kernel (kernel [K, N], or [N, K] `transposed`), an int8 kernel
  converted to x's dtype and the product times its per-column `scale` (f32 [N]; None for
  a float kernel)."""
  y = jnp.einsum("...k,nk->...n" if transposed else "...k,kn->...n", x,
                 kernel.astype(x.dtype), precision=lax.Precision.HIGHEST,
                 preferred_element_type=jnp.float32)
  return y if scale is None else y * scale


def linear_reference(x: jax.Array, kernel: jax.Array, bias: jax.Array | None = None, *,
                     activation: Callable[[jax.Array], jax.Array] | None = None,
                     out_dtype=None, low_rank: LowRank | None = None,
                     scale: jax.Array | None = None, transposed: bool = False) -> jax.Array:
  """Plain XLA: activation(x @ kernel (* scale) + bias (+ xa @ b)), f32 accumulation,
  cast to `out_dtype` (a `transposed` kernel stored [N, K])."""
  y = scaled_product(x, kernel, scale, transposed)
  if low_rank is not None:
    y += _low_rank_product(low_rank)
  if bias is not None:
    y += bias.astype(jnp.float32)
  if activation is not None:
    y = activation(y)
  return y.astype(x.dtype if out_dtype is None else out_dtype)


def tile_indices(m, n, *, rows: int, cols: int, block_m: int, block_n: int):
  """Inside a kernel: (row indices [block_m], column indices [block_n], row mask, column
  mask) of the output tile (m, n); a mask is None where the block is full."""
  r = m * block_m + jnp.arange(block_m)
  c = n * block_n + jnp.arange(block_n)
  return r, c, (r < rows if rows % block_m else None), (c < cols if cols % block_n else None)


def matmul_tile(x_ref, w_ref, *, m, n, split, rows: int, cols: int, depth: int, block_m: int,
                block_n: int, block_k: int, k_split: int, transposed: bool = False
                ) -> jax.Array:
  """Inside a kernel: f32 [block_m, block_n] = x[rows of block m, K range] @ kernel[K range,
  columns of block n], for K range `split` (k_split wide); with `transposed` the kernel is
  stored [cols, depth] (an embedding table used as a tied LM head). Rows, columns and K
  masked where they do not fill a block (`matmul_rows`)."""
  r, c, row_mask, col_mask = tile_indices(m, n, rows=rows, cols=cols, block_m=block_m,
                                          block_n=block_n)
  return matmul_rows(x_ref, w_ref, r, row_mask, c, col_mask, split=split, depth=depth,
                     block_k=block_k, k_split=k_split, transposed=transposed)


def matmul_rows(x_ref, w_ref, r, row_mask, c, col_mask, *, split, depth: int, block_k: int,
                k_split: int, transposed: bool = False, group=None) -> jax.Array:
  """Inside a kernel: f32 [R, C] = x[r, K range] @ kernel[K range, c] for rows r [R] and
  columns c [C] (masks: None where all are in range), K range `split` (k_split wide); the
  kernel [depth, cols] (`transposed`: [cols, depth]), or with `group` (a scalar) that
  group's of a stack [groups, ...] of them. The kernel's weights streamed (evict_first), an
  int8 kernel converted to x's dtype after its load (its scales are the caller's)."""
  lo = split * k_split
  hi = jnp.minimum(lo + k_split, depth)
  prefix = () if group is None else (group,)

  def body(i, acc):
    k = lo + i * block_k + jnp.arange(block_k)
    k_mask = k < hi if depth % k_split else None
    x_mask = triton_backend.and_masks(row_mask, k_mask)
    if transposed:
      w_idx, w_mask = (c[:, None], k[None, :]), triton_backend.and_masks(col_mask, k_mask)
    else:
      w_idx, w_mask = (k[:, None], c[None, :]), triton_backend.and_masks(k_mask, col_mask)
    xb = plgpu.load(x_ref.at[r[:, None], k[None, :]], mask=x_mask,
                    other=None if x_mask is None else 0.0)
    # Weights are read once per step: stream them, keep L2 for the activations.
    wb = plgpu.load(w_ref.at[prefix + w_idx], mask=w_mask,
                    other=None if w_mask is None else 0,
                    eviction_policy="evict_first").astype(xb.dtype)  # (int8 weights)
    return acc + lax.dot_general(xb, wb, (((1,), (1 if transposed else 0,)), ((), ())),
                                 precision=lax.Precision.HIGHEST,
                                 preferred_element_type=jnp.float32)

  return lax.fori_loop(0, pl.cdiv(k_split, block_k), body,
                       jnp.zeros((r.shape[0], c.shape[0]), jnp.float32))


def _linear_kernel(*refs, rows: int, cols: int, depth: int, block_m: int, block_n: int,
                   block_k: int, k_split: int, has_scale: bool, has_bias: bool,
                   has_low_rank: bool, activation: Callable[[jax.Array], jax.Array] | None,
                   partials: bool, sections: tuple[int, ...], transposed: bool):
  """Refs: x [rows, depth], kernel [depth, cols] (`transposed`: [cols, depth]),
  (has_scale) the int8 kernel's scale f32 [cols], (has_bias) bias [cols], (has_low_rank)
  xa [rows, W] and b [W, cols]; outputs: partials f32 [splits, rows, cols] (the low-rank
  product in split 0's), or y split by columns into `sections` arrays [rows, section] (one
  section: y [rows, cols])."""
  x_ref, w_ref, *refs = refs
  scale_ref = refs.pop(0) if has_scale else None
  bias_ref = refs.pop(0) if has_bias else None
  xa_ref, b_ref = (refs.pop(0), refs.pop(0)) if has_low_rank else (None, None)
  o_refs = refs
  n, split, m = pl.program_id(0), pl.program_id(1), pl.program_id(2)
  r, c, row_mask, col_mask = tile_indices(m, n, rows=rows, cols=cols, block_m=block_m,
                                          block_n=block_n)
  # Loaded before the K loop, so its memory latency hides under the loop's loads instead
  # of adding to the program's tail.
  if has_bias and not partials:
    bias = plgpu.load(bias_ref.at[c], mask=col_mask, other=None if col_mask is None else 0.0)
  if has_scale:
    scale = plgpu.load(scale_ref.at[c], mask=col_mask,
                       other=None if col_mask is None else 0.0)
  acc = matmul_tile(x_ref, w_ref, m=m, n=n, split=split, rows=rows, cols=cols, depth=depth,
                    block_m=block_m, block_n=block_n, block_k=block_k, k_split=k_split,
                    transposed=transposed)
  if has_scale:  # (before the low-rank update, whose B is not quantized)
    acc *= scale[None, :]
  if has_low_rank:  # one more step of the product, over the update's W columns
    j = jnp.arange(xa_ref.shape[1])
    xa = plgpu.load(xa_ref.at[r[:, None], j[None, :]],
                    mask=triton_backend.and_masks(row_mask, None),
                    other=None if row_mask is None else 0.0)
    b = plgpu.load(b_ref.at[j[:, None], c[None, :]],
                   mask=triton_backend.and_masks(None, col_mask),
                   other=None if col_mask is None else 0.0)
    update = lax.dot_general(xa, b, (((1,), (0,)), ((), ())), precision=lax.Precision.HIGHEST,
                             preferred_element_type=jnp.float32)
    acc += jnp.where(split == 0, update, 0.0) if partials else update
  mask = triton_backend.and_masks(row_mask, col_mask)
  if partials:
    plgpu.store(o_refs[0].at[split, r[:, None], c[None, :]], acc, mask=mask)
    return
  if has_bias:
    acc += bias.astype(jnp.float32)[None, :]
  if activation is not None:
    acc = activation(acc)
  if len(sections) == 1:
    plgpu.store(o_refs[0].at[r[:, None], c[None, :]], acc.astype(o_refs[0].dtype), mask=mask)
    return
  # Sections are whole column blocks: each program stores into exactly one of them.
  start = 0
  for o_ref, width in zip(o_refs, sections):
    @pl.when((n * block_n >= start) & (n * block_n < start + width))
    def _(o_ref=o_ref, start=start):
      plgpu.store(o_ref.at[r[:, None], c[None, :] - start], acc.astype(o_ref.dtype),
                  mask=row_mask if row_mask is None else row_mask[:, None])
    start += width


@functools.partial(jax.jit, static_argnames=[
    "activation", "out_dtype", "k_split", "sections", "tiles", "interpret", "transposed"])
def _linear_pallas(x, kernel, scale, bias, low_rank, *, activation, out_dtype,
                   k_split: int | None, sections: tuple[int, ...], tiles: Tiles,
                   interpret: bool, transposed: bool = False):
  """x [rows, K] @ kernel [K, N] (`transposed`: [N, K]) (* scale [N] for an int8 kernel,
  else None) (+ low_rank (xa [rows, W], b [W, N]) or None) -> a tuple of [rows, section]
  for `sections` of N (k_split None: whole-K programs), or f32 partials [cdiv(K,
  k_split), rows, N] (k_split a multiple of tiles.block_k)."""
  block_m, block_n, block_k, num_warps = tiles
  rows, depth = x.shape
  cols = columns(kernel, transposed)
  partials = k_split is not None
  if not partials:
    k_split = pl.cdiv(depth, block_k) * block_k
  splits = pl.cdiv(depth, k_split)
  kernel_fn = functools.partial(
      _linear_kernel, rows=rows, cols=cols, depth=depth, block_m=block_m,
      block_n=block_n, block_k=block_k, k_split=k_split, has_scale=scale is not None,
      has_bias=bias is not None, has_low_rank=low_rank is not None, activation=activation,
      partials=partials, sections=sections, transposed=transposed)
  out_shape = ((jax.ShapeDtypeStruct((splits, rows, cols), jnp.float32),) if partials
               else tuple(jax.ShapeDtypeStruct((rows, w), out_dtype) for w in sections))
  return pl.pallas_call(
      kernel_fn,
      grid=(pl.cdiv(cols, block_n), splits, pl.cdiv(rows, block_m)),
      out_shape=out_shape,
      compiler_params=compiler_params(num_warps),
      interpret=interpret,
      name="linear_partials" if partials else "linear",
  )(x, kernel, *(() if scale is None else (scale,)), *(() if bias is None else (bias,)),
    *(low_rank or ()))


class Tiles(NamedTuple):
  """A GEMM kernel's program shape: rows, columns and K depth per step, and warps."""

  block_m: int
  block_n: int
  block_k: int
  num_warps: int


def whole_k_tiles(rows: int, depth: int, cols: int, itemsize: int,
                  sections: Sequence[int] = (), block_n: int | None = None,
                  int8_transposed: bool = False) -> Tiles:
  """The tiles of whole-K programs (`linear`, or a kernel built on `matmul_tile`) for
  `rows` x `depth` inputs of `itemsize` bytes and `cols` output columns, of a kernel
  [K, N] in x's dtype or (`int8_transposed`) int8 [N, K]. Column blocks must each lie
  inside one of `sections` (widths): the block narrows to 64 or 32 columns until it
  divides each. `block_n` fixes the columns (a kernel whose epilogue needs it)."""
  block_m = _block_m(rows)
  max_k = _BLOCK_K
  if block_n is None:
    long_k = depth >= _LONG_K or int8_transposed
    wide_n = _INT8_WIDE_BLOCK_N if int8_transposed else _WIDE_BLOCK_N
    wide = long_k and cols >= _WIDE_N
    block_n = wide_n if wide else _NARROW_BLOCK_N if long_k else _BLOCK_N
    while block_n > _NARROW_BLOCK_N and any(w % block_n for w in sections):
      block_n //= 2
    if wide and block_n == wide_n:
      max_k = (_INT8_WIDE_BLOCK_K if int8_transposed and block_m <= _INT8_FEW_ROWS
               else _WIDE_BLOCK_K)
    elif int8_transposed and block_n == _NARROW_BLOCK_N:
      max_k = _INT8_BLOCK_K
  num_warps = _LONG_K_NUM_WARPS if depth >= _LONG_K or int8_transposed else _NUM_WARPS
  return Tiles(block_m, block_n, _block_k(block_m, depth, block_n, itemsize, max_k),
               num_warps)


def compiler_params(num_warps: int = _NUM_WARPS):
  """The Triton warps (default: a whole-K program's at a short K) and stages the tiles
  above are sized for."""
  return triton_backend.compiler_params(num_warps=num_warps, num_stages=_NUM_STAGES)


def _tile(size: int, limit: int) -> int:
  """A block covering `size`: a power of two >= 16 (the smallest tensor-core tile), at
  most `limit`."""
  return min(limit, max(16, pl.next_power_of_2(size)))


def _block_m(rows: int) -> int:
  """Rows per program: the rows padded to a tile, at most _ROW_BLOCK."""
  return _tile(rows, _ROW_BLOCK)


def _block_k(block_m: int, depth: int, block_n: int, itemsize: int,
             max_k: int = _BLOCK_K) -> int:
  """K per step: `max_k`, halved until every stage's x and kernel tiles fit the
  shared-memory budget (at 64-row blocks 128 fits every dtype at block_n 32 and 64; the
  budget guards other tile constants), never much deeper than K."""
  block_k = _tile(depth, max_k)
  while (block_k > 16 and
         (_NUM_STAGES - 1) * (block_m + block_n) * block_k * itemsize > _SMEM_BYTES):
    block_k //= 2
  return block_k


def _rows_of(low_rank: LowRank | None) -> LowRank | None:
  """low_rank with xa [..., W] as [rows, W]."""
  return None if low_rank is None else (low_rank[0].reshape(-1, low_rank[0].shape[-1]),
                                        low_rank[1])


def columns(kernel: jax.Array, transposed: bool = False) -> int:
  """N, the output columns of a kernel [K, N] (`transposed`: [N, K])."""
  return kernel.shape[0 if transposed else 1]


def _check_args(x: jax.Array, kernel: jax.Array, bias: jax.Array | None,
                low_rank: LowRank | None = None, scale: jax.Array | None = None,
                transposed: bool = False) -> int:
  """Raises ValueError naming a bad argument; returns N."""
  if x.ndim < 1 or not jnp.issubdtype(x.dtype, jnp.floating):
    raise ValueError(f"x must be a floating array [..., K], got {x.dtype}{list(x.shape)}")
  if kernel.ndim != 2 or kernel.shape[1 if transposed else 0] != x.shape[-1]:
    layout = "[N, K] (transposed)" if transposed else "[K, N]"
    raise ValueError(f"kernel must have shape {layout} with K = x.shape[-1] = "
                     f"{x.shape[-1]}, got {kernel.shape}")
  cols = columns(kernel, transposed)
  if kernel.dtype == jnp.int8:
    if scale is None or scale.shape != (cols,) or scale.dtype != jnp.float32:
      raise ValueError(f"an int8 kernel needs scale, float32 [N] = ({cols},), got "
                       + ("None" if scale is None else f"{scale.dtype}{list(scale.shape)}"))
  elif kernel.dtype != x.dtype:
    raise ValueError(f"kernel must have x's dtype {x.dtype} or be int8 (with scale), got "
                     f"{kernel.dtype}")
  elif scale is not None:
    raise ValueError(f"scale is for an int8 kernel; kernel is {kernel.dtype}")
  if bias is not None and bias.shape != (cols,):
    raise ValueError(f"bias must have shape [N] = ({cols},), got {bias.shape}")
  if low_rank is not None:
    xa, b = low_rank
    w = xa.shape[-1]
    if (xa.shape[:-1] != x.shape[:-1] or b.shape != (w, cols) or w < 16
        or w & (w - 1) or xa.dtype != x.dtype or b.dtype != x.dtype):
      raise ValueError(f"low_rank must be (xa [..., W], b [W, N]) with x's rows "
                       f"{list(x.shape[:-1])}, N = {cols}, W a power of two "
                       f">= 16 and x's dtype {x.dtype}; got xa {xa.dtype}{list(xa.shape)}, "
                       f"b {b.dtype}{list(b.shape)}")
  return cols


def takes(x: jax.Array, kernel: jax.Array) -> bool:
  """Whether the kernels take x [..., K] @ kernel [K, N]: decode's few rows (at most
  MAX_ROWS; for a kernel of _LARGE_WEIGHT elements or more, at most _LARGE_WEIGHT_ROWS)
  of non-empty operands. More rows (a prompt) go to XLA, whose GEMMs are then
  compute-bound."""
  limit = _LARGE_WEIGHT_ROWS if kernel.size >= _LARGE_WEIGHT else MAX_ROWS
  return x.size > 0 and kernel.size > 0 and math.prod(x.shape[:-1]) <= limit


def linear(x: jax.Array, kernel: jax.Array, bias: jax.Array | None = None, *,
           activation: Callable[[jax.Array], jax.Array] | None = None, out_dtype=None,
           sections: Sequence[int] | None = None, interpret: bool | None = None,
           low_rank: LowRank | None = None, scale: jax.Array | None = None,
           transposed: bool = False) -> jax.Array | tuple[jax.Array, ...]:
  """activation(x @ kernel (* scale) + bias (+ xa @ b)) as one kernel: the GEMM with its
  epilogue.

  Args:
    x: [..., K] f32 / bf16 / f16; at most MAX_ROWS (256) rows take the kernel (64 for
      a kernel of 4M elements or more: `takes`), more rows plain XLA.
    kernel: [K, N] (`transposed`: [N, K]), x's dtype, or int8 with `scale`.
    bias: [N] or None.
    activation: an elementwise function of the f32 pre-activation (e.g. `jax.nn.gelu`),
      applied in the kernel where Pallas-Triton lowers it (`lowers_in_kernel`), else by
      XLA right after; None for none. Hashable (it is a static argument).
    out_dtype: the result's dtype (default x's).
    sections: column widths summing to N: return the output split into that many arrays
      (a fused q/k/v projection's q, k, v), each written by the kernel itself, where
      slicing one output would copy each part. Widths that are multiples of 32 keep it one
      kernel (of 64-column programs where all are multiples of 64); others are sliced from
      the whole output.
    interpret: None = the Triton kernel on a GPU, plain XLA elsewhere; True = the kernel
      in Pallas interpret mode (tests); False = the kernel.
    low_rank: None, or (xa [..., W], b [W, N]) in x's dtype, W a power of two >= 16: a
      low-rank update added before the bias (a LoRA adapter's, `jax_paged.lora`), as one
      more step of the kernel's product.
    scale: an int8 kernel's f32 [N] per-column scales (`jax_paged.weight_quant`), applied
      to the product before the low-rank update and the bias; None for a float kernel.
    transposed: the kernel is stored [N, K] (K contiguous: int8 weights' fast layout).

  Returns:
    [..., N] in `out_dtype`, or with `sections` a tuple of [..., width]; products
    accumulated, bias added and activation applied in f32.
  """
  cols = _check_args(x, kernel, bias, low_rank, scale, transposed)
  widths = (cols,) if sections is None else tuple(int(w) for w in sections)
  if sum(widths) != cols or min(widths) < 1:
    raise ValueError(f"sections must be positive widths summing to N = {cols}, got "
                     f"{sections!r}")
  out_dtype = jnp.dtype(x.dtype if out_dtype is None else out_dtype)
  mode = triton_backend.kernel_mode(interpret, supported=takes(x, kernel))
  if mode is None or (len(widths) > 1 and any(w % _NARROW_BLOCK_N for w in widths)):
    if mode is None:
      y = linear_reference(x, kernel, bias, activation=activation, out_dtype=out_dtype,
                           low_rank=low_rank, scale=scale, transposed=transposed)
    else:
      y = linear(x, kernel, bias, activation=activation, out_dtype=out_dtype,
                 interpret=mode, low_rank=low_rank, scale=scale, transposed=transposed)
    return y if sections is None else split_sections(y, widths)
  x2 = x.reshape(-1, x.shape[-1])
  fused = activation is None or lowers_in_kernel(activation)
  tiles = whole_k_tiles(*x2.shape, cols, x.dtype.itemsize, widths,
                        int8_transposed=transposed and kernel.dtype == jnp.int8)
  ys = _linear_pallas(x2, kernel, scale, bias, _rows_of(low_rank),
                      activation=activation if fused else None,
                      out_dtype=out_dtype if fused else jnp.float32, k_split=None,
                      sections=widths, tiles=tiles, interpret=mode, transposed=transposed)
  if not fused:  # XLA applies it to the f32 output, fused with the cast.
    ys = tuple(activation(y).astype(out_dtype) for y in ys)
  ys = tuple(y.reshape(x.shape[:-1] + (w,)) for y, w in zip(ys, widths))
  return ys[0] if sections is None else ys


def split_sections(y: jax.Array, sections: Sequence[int]) -> tuple[jax.Array, ...]:
  """y [..., sum(sections)] -> one array per section of its last axis, in order."""
  return tuple(jnp.split(y, list(itertools.accumulate(sections[:-1])), axis=-1))


@functools.cache
def lowers_in_kernel(activation: Callable[[jax.Array], jax.Array]) -> bool:
  """Whether Pallas-Triton can lower `activation` inside the kernel. Most elementwise jnp
  functions do (tanh, exp, logistic: tanh-gelu, silu, relu); erf does not (exact gelu),
  and `linear` then applies such an activation after the kernel. Decided once per
  activation by lowering a one-tile kernel for CUDA (no GPU needed)."""
  def kernel(x_ref, o_ref):
    o_ref[...] = activation(x_ref[...])

  probe = pl.pallas_call(kernel, out_shape=jax.ShapeDtypeStruct((16, 16), jnp.float32),
                         compiler_params=triton_backend.compiler_params(num_warps=1,
                                                                        num_stages=1))
  try:
    with triton_backend.cuda_lowering_context():
      jax.jit(probe).trace(jax.ShapeDtypeStruct((16, 16), jnp.float32)).lower(
          lowering_platforms=("cuda",))
  except NotImplementedError:
    return False
  return True


def _partials_tiles(rows: int, depth: int, cols: int, itemsize: int,
                    int8_transposed: bool = False) -> tuple[Tiles, int]:
  """(tiles, work units per column block) of `linear_partials` for `rows` x `depth`
  inputs of `itemsize` bytes and `cols` outputs, of a kernel [K, N] in x's dtype or
  (`int8_transposed`) int8 [N, K]; the K step is the caller's (it divides the splits).
  A K over 1024 into fewer than _LONG_K columns (GPT-2's c_proj: 3072 x 768) has few
  column blocks, so it finds its programs in K splits: 64 columns, 8 units. Otherwise 32
  columns and 4 units: a short K needs no more (GPT-2's attention out, 768 x 768), and a
  wide output has its programs in columns, each K split writing one more f32 partial for
  the consumer to read (Llama-3.2-1B's 2048 columns: 64 blocks). An int8 [N, K] kernel at
  a long K: 64 columns of 256-deep steps in 4 units up to 16 rows, past them 128 columns
  in 8 units (_INT8_PARTIALS_UNITS)."""
  block_m = _block_m(rows)
  max_k = _BLOCK_K
  if int8_transposed and depth >= _LONG_K:
    if block_m <= _INT8_FEW_ROWS:
      block_n, units, max_k = 2 * _NARROW_BLOCK_N, 4, _INT8_BLOCK_K
    else:
      block_n, units, max_k = _INT8_WIDE_BLOCK_N, _INT8_PARTIALS_UNITS, _WIDE_BLOCK_K
  elif 1024 < depth and cols < _LONG_K:
    block_n, units = 2 * _NARROW_BLOCK_N, 8
  else:
    block_n, units = _NARROW_BLOCK_N, 4
  tiles = Tiles(block_m, block_n, _block_k(block_m, depth, block_n, itemsize, max_k),
                _PARTIALS_NUM_WARPS)
  return tiles, units


def default_splits(depth: int, cols: int, rows: int, int8_transposed: bool = False) -> int:
  """K splits of `linear_partials` for `rows` x `depth` inputs and `cols` outputs: its
  work units per column block (`_partials_tiles`; ~100 programs at GPT-2's widths, 256 at
  Llama-3.2-1B's; fewer and each walks a longer serial K loop), made of row blocks
  first, K splits for the rest."""
  _, units = _partials_tiles(rows, depth, cols, 2, int8_transposed)
  return max(1, units // pl.cdiv(rows, _block_m(rows)))


def linear_partials(x: jax.Array, kernel: jax.Array, *, splits: int | None = None,
                    interpret: bool | None = None, low_rank: LowRank | None = None,
                    scale: jax.Array | None = None, transposed: bool = False) -> jax.Array:
  """The split-K partial products of x @ kernel (* scale), for a consumer that sums them.

  Args:
    x: [..., K] f32 / bf16 / f16 (any number of rows; past `takes`' limit, plain XLA).
    kernel: [K, N] (`transposed`: [N, K]), x's dtype, or int8 with `scale` (as `linear`'s:
      each partial scaled).
    splits: K ranges (each rounded up to whole kernel steps; the last may be shorter);
      None = `default_splits(K, N, rows)`.
    interpret: as `linear`.
    low_rank: as `linear`'s: its product joins the first partial.

  Returns:
    f32 [S, ..., N] whose sum over the first axis is x @ kernel (* scale) (+ xa @ b); S =
    `splits` unless K is too short for that many (then fewer).
  """
  cols = _check_args(x, kernel, None, low_rank, scale, transposed)
  depth = x.shape[-1]
  rows = math.prod(x.shape[:-1])
  int8_transposed = transposed and kernel.dtype == jnp.int8
  splits = default_splits(depth, cols, rows, int8_transposed) if splits is None else splits
  validation.check_positive_int("splits", splits)
  tiles, _ = _partials_tiles(rows, depth, cols, x.dtype.itemsize, int8_transposed)
  block_k = tiles.block_k
  # A step no deeper than a split, and even splits (768 / 4 = 192: 3 steps of 64), but
  # below 64 deep only where rounding splits up to whole steps would lose one; else the
  # last split is shorter. Shallow steps were slow: Falcon-7B's attention out (4544 = 4 x
  # 1136 = 4 x 71 x 16) in 16-deep steps took 35.8 µs at 64 rows, 4x its bytes, in
  # 64-deep ones 18.8 (H200).
  per_split = depth // splits
  rounded_split = lambda block_k: pl.cdiv(pl.cdiv(depth, splits), block_k) * block_k

  def shrink(block_k: int) -> bool:
    if block_k > per_split:
      return True
    if per_split % block_k == 0:
      return False
    kept = pl.cdiv(depth, rounded_split(block_k)) == splits
    return block_k > _MIN_EVEN_BLOCK_K or not kept
  while block_k > 16 and shrink(block_k):
    block_k //= 2
  k_split = rounded_split(block_k)
  mode = triton_backend.kernel_mode(interpret, supported=takes(x, kernel))
  if mode is None:
    bounds = list(range(0, depth, k_split)) + [depth]
    parts = [scaled_product(x[..., a:b], kernel[:, a:b] if transposed else kernel[a:b], scale,
                            transposed) for a, b in zip(bounds[:-1], bounds[1:])]
    if low_rank is not None:
      parts[0] += _low_rank_product(low_rank)
    return jnp.stack(parts)
  parts, = _linear_pallas(x.reshape(rows, depth), kernel, scale, None, _rows_of(low_rank),
                          activation=None, out_dtype=jnp.float32, k_split=k_split,
                          sections=(cols,),
                          tiles=tiles._replace(block_k=block_k),
                          interpret=mode, transposed=transposed)
  return parts.reshape((parts.shape[0],) + x.shape[:-1] + (cols,))


# The tied LM head's greedy argmax (`argmax_attend`): the vocabulary is wide (GPT-2: 50257
# columns, 77 MB of bf16 weights), so programs take all rows (up to 128) to read each
# weight tile once, and 128 columns each (393 programs for GPT-2).
_ARGMAX_BLOCK_M, _ARGMAX_BLOCK_N, _ARGMAX_BLOCK_K = 128, 128, 64


def _argmax_kernel(x_ref, e_ref, val_ref, idx_ref, *, rows: int, vocab: int, depth: int,
                   block_m: int, block_n: int, block_k: int, logits_dtype):
  """Refs: x [rows, depth], embedding [vocab, depth]; outputs: the max [rows, blocks] f32
  and its first column [rows, blocks] int32 of each row over this program's columns."""
  m, n = pl.program_id(0), pl.program_id(1)
  acc = matmul_tile(x_ref, e_ref, m=m, n=n, split=0, rows=rows, cols=vocab, depth=depth,
                    block_m=block_m, block_n=block_n, block_k=block_k,
                    k_split=pl.cdiv(depth, block_k) * block_k, transposed=True)
  r, c, row_mask, col_mask = tile_indices(m, n, rows=rows, cols=vocab, block_m=block_m,
                                          block_n=block_n)
  # The logits a plain head computes are rounded to its dtype: ties broken the same way.
  logits = acc.astype(logits_dtype).astype(jnp.float32)
  if col_mask is not None:
    logits = jnp.where(col_mask[None, :], logits, -jnp.inf)
  plgpu.store(val_ref.at[r, n], jnp.max(logits, axis=1), mask=row_mask)
  plgpu.store(idx_ref.at[r, n], n * block_n + jnp.argmax(logits, axis=1).astype(jnp.int32),
              mask=row_mask)


@functools.partial(jax.jit, static_argnames=["interpret"])
def _argmax_pallas(x: jax.Array, embedding: jax.Array, *, interpret: bool) -> jax.Array:
  """x [rows, E], embedding [V, E] -> int32 [rows]."""
  rows, depth = x.shape
  vocab = embedding.shape[0]
  block_m = _tile(rows, _ARGMAX_BLOCK_M)
  block_k = _tile(depth, _ARGMAX_BLOCK_K)
  blocks = pl.cdiv(vocab, _ARGMAX_BLOCK_N)
  kernel_fn = functools.partial(
      _argmax_kernel, rows=rows, vocab=vocab, depth=depth, block_m=block_m,
      block_n=_ARGMAX_BLOCK_N, block_k=block_k, logits_dtype=x.dtype)
  values, indices = pl.pallas_call(
      kernel_fn,
      # Row blocks fastest: a second row block reads each weight tile right after the first.
      grid=(pl.cdiv(rows, block_m), blocks),
      # [rows, blocks]: XLA reduces each row's blocks in 2.2 µs where the [blocks, rows]
      # column reduction took 3.8 (GPT-2's 393 blocks at 128 rows, H200).
      out_shape=(jax.ShapeDtypeStruct((rows, blocks), jnp.float32),
                 jax.ShapeDtypeStruct((rows, blocks), jnp.int32)),
      compiler_params=compiler_params(),
      interpret=interpret,
      name="argmax_attend",
  )(x, embedding)
  # The first block holding the row max: the lowest column among equal maxima, as argmax.
  best = jnp.argmax(values, axis=1)
  return jnp.take_along_axis(indices, best[:, None], axis=1)[:, 0]


def argmax_attend(x: jax.Array, embedding: jax.Array, *,
                  interpret: bool | None = None) -> jax.Array:
  """Greedy tokens of a tied LM head, argmax over V of x @ embedding.T, without the logits.

  A decode step's LM head writes [rows, V] f32 logits (25.7 MB for GPT-2 at 128 rows)
  that greedy decoding reads once more for their argmax. Here one kernel computes each
  [rows, 128-column] tile of logits and keeps only its row maxima and their columns; a
  small reduction over the [rows, V / 128] maxima finishes.

  Args:
    x: [..., E] f32 / bf16 / f16 (over MAX_ROWS rows, or without a GPU: plain XLA).
    embedding: [V, E], x's dtype (`nnx.Embed.embedding`).
    interpret: as `linear`.

  Returns:
    int32 [...]: for each row, the first index of the maximum of the logits rounded to x's
    dtype, as `jnp.argmax(x @ embedding.T, -1)` computed in that dtype (f32 accumulation;
    near-ties may break differently from another GEMM's summation order).
  """
  if x.ndim < 1 or not jnp.issubdtype(x.dtype, jnp.floating):
    raise ValueError(f"x must be a floating array [..., E], got {x.dtype}{list(x.shape)}")
  if embedding.ndim != 2 or embedding.shape[1] != x.shape[-1] or embedding.shape[0] < 1:
    raise ValueError(f"embedding must have shape [V, E] with V >= 1 and E = x.shape[-1] = "
                     f"{x.shape[-1]}, got {embedding.shape}")
  if embedding.dtype != x.dtype:
    raise ValueError(f"embedding must have x's dtype {x.dtype}, got {embedding.dtype}")
  # Its own row limit: programs of 128 rows read each tile of the vocabulary once.
  rows = math.prod(x.shape[:-1])
  mode = triton_backend.kernel_mode(interpret, supported=x.size > 0 and rows <= MAX_ROWS)
  if mode is None:
    logits = jnp.einsum("...k,vk->...v", x, embedding, precision=lax.Precision.HIGHEST,
                        preferred_element_type=jnp.float32).astype(x.dtype)
    return jnp.argmax(logits, axis=-1).astype(jnp.int32)
  tokens = _argmax_pallas(x.reshape(-1, x.shape[-1]), embedding, interpret=mode)
  return tokens.reshape(x.shape[:-1])
