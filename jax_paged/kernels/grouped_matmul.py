"""Grouped matmul: rows sorted by group, each group's rows times its own weight matrix.

A mixture-of-experts layer (`models.moe`) sends each token to a few of its experts: with the
token-expert pairs sorted by expert, the experts' products are one grouped matmul, x [M,
K] times weights [G, K, N] with group g's rows the g-th run of `group_sizes`. At decode
there are few rows and the product is bound by reading the weights of the experts hit; XLA's
`lax.ragged_dot` on a GPU reads every expert's weights whatever the rows (Mixtral-8x7B's
experts layer, 1 token on an H200: 4.2x the bytes of the two experts it needs) and past a
few hundred rows computes every group densely (benchmarks/LOG.md, "thirty-first").

This kernel's programs each own one row tile of one group and `block_n` output columns:
a group's rows are split into tiles of `block_m` from its first row, so a tile never mixes
groups, and tiles past the last one exit at once, so an expert no row chose is never read.
Each program finds its tile's (group, first row, end row) from `group_sizes` itself (two
cumulative sums over the groups, in registers); rows past the groups' total come out zero
(as `lax.ragged_dot`'s). Few rows give few tiles: the K range is then split over more
programs, whose f32 partials XLA sums.

Weights may be int8 with one f32 scale per group and output column (weight-only, as
`jax_paged.weight_quant`'s linears): the kernel converts each int8 tile to x's dtype after
its load and scales the f32 accumulator; stored [groups, N, K] (`transposed`) the int8
tiles are K-contiguous, the layout that reaches the tensor cores at speed.

Grid (tiles, N / block_n, K splits); f32 accumulation, the weights streamed from HBM
(`linear.matmul_rows`).
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu
import jax.numpy as jnp
import numpy as np

from jax_paged.kernels import linear
from jax_paged.kernels import triton_backend
from jax_paged.kernels import validation

# Tiles, tuned on an H200 at Mixtral-8x7B's and Qwen3-30B-A3B's expert shapes
# (benchmarks/LOG.md, "thirty-second"). Few rows per group (decode): 16-row tiles (the
# smallest tensor-core tile) or 32 / 64 as groups grow, 128 columns, 64-deep K steps, 4
# warps, 4 stages (within 1-3% of the best of 5 tiles x 4 splits swept at 1 and 4 tokens).
# Groups of 128 rows and more (prefill): 128 x 256 tiles, 8 warps, 3 stages (Mixtral's
# gate/up at 2048 tokens 1,747 us vs 2,370 with 64 x 128 tiles; Qwen3's 395 vs 485).
_BLOCK_N, _BLOCK_K, _NUM_WARPS, _NUM_STAGES = 128, 64, 4, 4
_MIN_BLOCK_M, _MAX_BLOCK_M = 16, 128
_LARGE_BLOCK_N, _LARGE_NUM_WARPS, _LARGE_NUM_STAGES = 256, 8, 3
# Int8 weights ([groups, N, K]) up to 32-row tiles: 64 columns of 128-deep K steps (the
# most even of 12 tiles swept at 1 / 4 / 64 tokens of the shapes above: 2-6% faster than
# 128 columns in 9 of 12 cases, 1.7% slower in one).
_INT8_BLOCK_N, _INT8_BLOCK_K, _INT8_FEW_ROWS = 64, 128, 32
# Programs per streaming multiprocessor to aim for when K splits are chosen.
_PROGRAMS_PER_SM = 4


class Tiles(NamedTuple):
  """The kernel's program shape: rows, columns and K depth per step, warps, stages."""

  block_m: int
  block_n: int
  block_k: int
  num_warps: int
  num_stages: int


def tiles_for(rows: int, groups: int, depth: int, cols: int, itemsize: int,
              int8: bool = False) -> Tiles:
  """The tiles for `rows` rows in `groups` groups, K = depth, N = cols, inputs of
  `itemsize` bytes: row tiles of the mean group's rows as a power of two in 16..128, and
  at 128 (2-byte inputs) the wide columns of prefill's compute-bound products; `int8`
  weights take K steps twice as deep at few rows (half the bytes per step)."""
  block_m = min(_MAX_BLOCK_M, max(_MIN_BLOCK_M, pl.next_power_of_2(pl.cdiv(rows, groups))))
  few_int8 = int8 and block_m <= _INT8_FEW_ROWS
  block_k = min(_INT8_BLOCK_K if few_int8 else _BLOCK_K, max(16, pl.next_power_of_2(depth)))
  if block_m == _MAX_BLOCK_M and itemsize <= 2:
    block_n, num_warps, num_stages = _LARGE_BLOCK_N, _LARGE_NUM_WARPS, _LARGE_NUM_STAGES
  else:
    block_m = min(block_m, _MAX_BLOCK_M // 2)
    block_n = _INT8_BLOCK_N if few_int8 else _BLOCK_N
    num_warps, num_stages = _NUM_WARPS, _NUM_STAGES
  return Tiles(block_m, min(block_n, max(16, pl.next_power_of_2(cols))), block_k, num_warps,
               num_stages)


def _check_args(x: jax.Array, weights: jax.Array, group_sizes: jax.Array,
                scale: jax.Array | None, transposed: bool) -> int:
  """Validates grouped_matmul's arguments; returns N."""
  if len(getattr(x, "shape", ())) != 2:
    raise ValueError(f"x must have shape [rows, K], got shape {getattr(x, 'shape', ())}")
  layout = "[groups, N, K={}]" if transposed else "[groups, K={}, N]"
  shape = getattr(weights, "shape", ())
  if len(shape) != 3 or shape[2 if transposed else 1] != x.shape[1]:
    raise ValueError(f"weights must have shape {layout.format(x.shape[1])}, got shape "
                     f"{shape}")
  groups, cols = shape[0], shape[1 if transposed else 2]
  if jnp.dtype(x.dtype) not in validation.SUPPORTED_DTYPES:
    raise ValueError(f"x dtype must be float32, bfloat16 or float16, got {x.dtype}")
  int8 = jnp.dtype(weights.dtype) == jnp.dtype(jnp.int8)
  if not int8 and jnp.dtype(weights.dtype) != jnp.dtype(x.dtype):
    raise ValueError(f"weights dtype must be x's ({x.dtype}) or int8 with a scale, got "
                     f"{weights.dtype}")
  if int8 != (scale is not None):
    raise ValueError("scale goes with int8 weights (float32 [groups, N]) and only with "
                     f"them: got {weights.dtype} weights and "
                     f"{'a' if scale is not None else 'no'} scale")
  if scale is not None and (scale.shape != (groups, cols)
                            or jnp.dtype(scale.dtype) != jnp.dtype(jnp.float32)):
    raise ValueError(f"scale must be float32 [groups={groups}, N={cols}], got "
                     f"{scale.dtype}{list(scale.shape)}")
  if (getattr(group_sizes, "shape", None) != (groups,)
      or jnp.dtype(group_sizes.dtype) != jnp.dtype(jnp.int32)):
    raise ValueError(f"group_sizes must be int32 of shape [groups={groups}], got "
                     f"{getattr(group_sizes, 'dtype', type(group_sizes).__name__)} of shape "
                     f"{getattr(group_sizes, 'shape', ())}")
  if not isinstance(group_sizes, jax.core.Tracer):
    sizes = np.asarray(group_sizes)
    if (sizes < 0).any() or sizes.sum() > x.shape[0]:
      raise ValueError(f"group_sizes must be >= 0 and sum to at most rows={x.shape[0]}, got "
                       f"{sizes.tolist()}")
  return cols


def max_tiles(rows: int, groups: int, block_m: int) -> int:
  """How many row tiles `rows` rows in `groups` groups (and the rows past them) can make:
  every whole tile, plus one partial tile per non-empty group, plus the tail's."""
  return rows // block_m + min(groups, rows) + 1


def _row_tile(sizes_ref, t, *, groups: int, rows: int, block_m: int):
  """Inside the kernel: (group, first row, end row) of row tile t, from group_sizes int32
  [groups]: group g's rows [start_g, end_g) in tiles of block_m from start_g, then the rows
  past the groups as group `groups` (no weights: zero rows); past the last tile, first =
  end. Negative sizes count as 0 and groups are cut at `rows` (traced sizes cannot be
  checked). Every program scans the (few hundred) sizes itself: as XLA ops before the
  kernel, the cumulative sums and the search were ~5 small kernels, ~9 µs of a Qwen3-MoE
  decode layer's ~100 (benchmarks/LOG.md, "thirty-third")."""
  g = jnp.arange(pl.next_power_of_2(groups + 1))
  sizes = jnp.maximum(plgpu.load(sizes_ref.at[g], mask=g < groups, other=0), 0)
  total = jnp.cumsum(sizes)
  starts = jnp.minimum(total - sizes, rows)
  ends = jnp.where(g < groups, jnp.minimum(total, rows), jnp.where(g == groups, rows, starts))
  tiles = (ends - starts + block_m - 1) // block_m
  last_tile = jnp.cumsum(tiles)
  group = jnp.sum((last_tile <= t).astype(jnp.int32))
  pick = lambda v: jnp.sum(jnp.where(g == group, v, 0))  # v[group]; 0 past the table
  first = pick(starts) + (t - pick(last_tile - tiles)) * block_m
  return group, first, pick(ends)


def _grouped_matmul_kernel(sizes_ref, x_ref, w_ref, *refs, groups: int, rows: int, cols: int,
                           depth: int, block_m: int, block_n: int, block_k: int,
                           k_split: int, transposed: bool):
  """Refs: group_sizes int32 [groups], x [rows, depth], weights [groups, depth, cols]
  (`transposed`: [groups, cols, depth]), for int8 weights their scales f32 [groups, cols];
  output f32 partials [splits, rows, cols]."""
  *scale_ref, o_ref = refs
  t, n, split = pl.program_id(0), pl.program_id(1), pl.program_id(2)
  group, first, end = _row_tile(sizes_ref, t, groups=groups, rows=rows, block_m=block_m)
  r = first + jnp.arange(block_m)
  row_mask = r < end
  c = n * block_n + jnp.arange(block_n)
  col_mask = c < cols if cols % block_n else None
  mask = triton_backend.and_masks(row_mask, col_mask)

  @pl.when((first < end) & (group < groups))
  def _():
    acc = linear.matmul_rows(x_ref, w_ref, r, row_mask, c, col_mask, split=split,
                             depth=depth, block_k=block_k, k_split=k_split,
                             transposed=transposed, group=group)
    if scale_ref:
      scale = plgpu.load(scale_ref[0].at[group, c], mask=col_mask,
                         other=None if col_mask is None else 0.0)
      acc *= scale[None, :]
    plgpu.store(o_ref.at[split, r[:, None], c[None, :]], acc, mask=mask)

  @pl.when((first < end) & (group == groups))  # rows past the groups: zeros
  def _():
    plgpu.store(o_ref.at[split, r[:, None], c[None, :]],
                jnp.zeros((block_m, block_n), jnp.float32), mask=mask)


@functools.partial(jax.jit, static_argnames=["tiles", "splits", "interpret", "transposed"])
def _grouped_matmul_pallas(x, weights, group_sizes, scale, *, tiles: Tiles, splits: int,
                           interpret: bool, transposed: bool = False) -> jax.Array:
  block_m, block_n, block_k, num_warps, num_stages = tiles
  rows, depth = x.shape
  groups, cols = weights.shape[0], weights.shape[1 if transposed else 2]
  k_split = pl.cdiv(pl.cdiv(depth, splits), block_k) * block_k
  splits = pl.cdiv(depth, k_split)
  kernel = functools.partial(_grouped_matmul_kernel, groups=groups, rows=rows, cols=cols,
                             depth=depth, block_m=block_m, block_n=block_n, block_k=block_k,
                             k_split=k_split, transposed=transposed)
  parts = pl.pallas_call(
      kernel,
      grid=(max_tiles(rows, groups, block_m), pl.cdiv(cols, block_n), splits),
      out_shape=jax.ShapeDtypeStruct((splits, rows, cols), jnp.float32),
      compiler_params=triton_backend.compiler_params(num_warps=num_warps,
                                                     num_stages=num_stages),
      interpret=interpret,
      name="grouped_matmul",
  )(group_sizes, x, weights, *(() if scale is None else (scale,)))
  return parts[0] if splits == 1 else jnp.sum(parts, axis=0)


def default_splits(rows: int, groups: int, depth: int, cols: int, tiles: Tiles) -> int:
  """K splits for ~_PROGRAMS_PER_SM programs per SM: the tiles expected live (one per group
  hit while rows are few; rows / block_m past that) times the column blocks, times splits
  (powers of two, each split at least 4 K steps)."""
  block_m, block_n, block_k = tiles.block_m, tiles.block_n, tiles.block_k
  live = pl.cdiv(rows, block_m) if rows > groups * block_m else min(rows, groups)
  programs = live * pl.cdiv(cols, block_n)
  splits = 1
  while (programs * splits < _PROGRAMS_PER_SM * triton_backend.sm_count()
         and depth // (2 * splits) >= 4 * block_k):
    splits *= 2
  return splits


def grouped_matmul_reference(x: jax.Array, weights: jax.Array, group_sizes: jax.Array, *,
                             scale: jax.Array | None = None,
                             transposed: bool = False) -> jax.Array:
  """Plain XLA (`lax.ragged_dot`): f32 [rows, N], row i times the weights of its group (int8
  weights converted to x's dtype, the product times the group's column scales)."""
  w = weights.astype(x.dtype)
  y = lax.ragged_dot(x, jnp.swapaxes(w, 1, 2) if transposed else w, group_sizes,
                     precision=lax.Precision.HIGHEST, preferred_element_type=jnp.float32)
  if scale is None:
    return y
  # Each row's group (rows past the groups are zero rows: any group's scale keeps them 0).
  ends = jnp.cumsum(jnp.maximum(group_sizes, 0))
  group = jnp.searchsorted(ends, jnp.arange(x.shape[0]), side="right")
  return y * scale[jnp.minimum(group, scale.shape[0] - 1)]


def grouped_matmul(x: jax.Array, weights: jax.Array, group_sizes: jax.Array, *,
                   scale: jax.Array | None = None, transposed: bool = False,
                   splits: int | None = None, interpret: bool | None = None) -> jax.Array:
  """Each group's rows of x times that group's weights (`lax.ragged_dot`'s product).

  Args:
    x: [rows, K] f32 / bf16 / f16, sorted by group: group 0's rows first, then group 1's...
    weights: [groups, K, N] (`transposed`: [groups, N, K]), x's dtype, or int8 with `scale`.
    group_sizes: int32 [groups], >= 0, summing to at most rows (checked where concrete;
      traced, negative sizes count as 0 and the groups are cut at `rows`).
    scale: int8 weights' f32 [groups, N] scales (each group's per output column, as
      `jax_paged.weight_quant`'s), None for float weights.
    transposed: the weights are stored [groups, N, K] (K contiguous: int8's fast layout).
    splits: K splits (each a whole number of K steps; f32 partials summed by XLA); None =
      `default_splits`.
    interpret: None = the Triton kernel on a GPU, `lax.ragged_dot` elsewhere; True = the
      kernel in Pallas interpret mode (tests); False = the kernel.

  Returns:
    f32 [rows, N]: row i of group g is x[i] @ weights[g] (* scale[g]); rows past the groups'
    total are zero. A group with no rows reads none of its weights.
  """
  cols = _check_args(x, weights, group_sizes, scale, transposed)
  validation.check_positive_int("splits", splits, optional=True)
  rows, depth = x.shape
  groups = weights.shape[0]
  mode = triton_backend.kernel_mode(interpret, supported=x.size > 0 and cols > 0)
  if mode is None:
    return grouped_matmul_reference(x, weights, group_sizes, scale=scale,
                                    transposed=transposed)
  tiles = tiles_for(rows, groups, depth, cols, x.dtype.itemsize, int8=scale is not None)
  if splits is None:
    splits = default_splits(rows, groups, depth, cols, tiles)
  return _grouped_matmul_pallas(x, weights, group_sizes, scale, tiles=tiles, splits=splits,
                                interpret=mode, transposed=transposed)
