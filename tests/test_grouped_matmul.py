"""`jax_paged.kernels.grouped_matmul` in interpret mode vs a float64 loop and jax's
`lax.ragged_dot`."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jax_paged import weight_quant
from jax_paged.kernels import grouped_matmul as gm

_TOL = {jnp.float32: dict(rtol=1e-5, atol=1e-5), jnp.bfloat16: dict(rtol=2e-2, atol=2e-2),
        jnp.float16: dict(rtol=1e-2, atol=1e-2)}


def _inputs(rows, depth, cols, sizes, dtype, seed):
  rng = np.random.default_rng(seed)
  x = jnp.asarray(rng.standard_normal((rows, depth)), dtype)
  w = jnp.asarray(rng.standard_normal((len(sizes), depth, cols)) / np.sqrt(depth), dtype)
  return x, w, jnp.asarray(sizes, jnp.int32)


def _numpy_grouped(x, w, sizes):
  x, w = np.asarray(x, np.float64), np.asarray(w, np.float64)
  y = np.zeros((x.shape[0], w.shape[2]))
  start = 0
  for g, size in enumerate(np.asarray(sizes)):
    y[start:start + size] = x[start:start + size] @ w[g]
    start += size
  return y


# Sizes: empty groups (first, middle, last), one group with every row, a group longer than
# a row tile, rows past the groups' total (zero rows); K and N ragged against the blocks.
@pytest.mark.parametrize("sizes,depth,cols,dtype", [
    ((0, 3, 0, 9, 1), 96, 80, jnp.float32),
    ((7, 0, 0, 0), 64, 128, jnp.float32),
    ((2, 2), 200, 40, jnp.float32),
    ((20, 1, 0, 17, 5, 0), 48, 160, jnp.bfloat16),
    ((1, 4, 2), 130, 32, jnp.float16),
])
@pytest.mark.parametrize("tail", [0, 6])
def test_matches_numpy_and_ragged_dot(sizes, depth, cols, dtype, tail):
  rows = sum(sizes) + tail
  x, w, group_sizes = _inputs(rows, depth, cols, sizes, dtype, rows + depth)
  y = gm.grouped_matmul(x, w, group_sizes, interpret=True)
  chex.assert_shape(y, (rows, cols))
  assert y.dtype == jnp.float32
  y64 = np.asarray(y, np.float64)
  assert not np.isnan(y64).any()
  np.testing.assert_allclose(y64, _numpy_grouped(x, w, sizes), **_TOL[dtype])
  np.testing.assert_allclose(y, gm.grouped_matmul_reference(x, w, group_sizes), **_TOL[dtype])
  if tail:
    assert (y64[sum(sizes):] == 0).all()


def _int8(w):
  """Per group and column int8 weights [G, K, N] and f32 scales [G, N] of w."""
  q, s = zip(*(weight_quant.quantize(g) for g in w))
  return jnp.stack(q), jnp.stack(s)


@pytest.mark.parametrize("transposed", [False, True])
@pytest.mark.parametrize("sizes,depth,cols,dtype,tail", [
    ((0, 3, 0, 9, 1), 96, 80, jnp.float32, 0), ((2, 0, 5), 300, 40, jnp.bfloat16, 4),
    ((40, 1), 64, 48, jnp.float16, 0)])
def test_int8_weights_match_their_dequantized_product(sizes, depth, cols, dtype, tail,
                                                      transposed):
  rows = sum(sizes) + tail
  x, w, group_sizes = _inputs(rows, depth, cols, sizes, dtype, rows)
  q, scale = _int8(w)
  stored = jnp.swapaxes(q, 1, 2) if transposed else q
  want = _numpy_grouped(x, np.asarray(q, np.float64) * np.asarray(scale)[:, None, :], sizes)
  for interpret in (True, None):  # the kernel, and on CPU the reference
    y = gm.grouped_matmul(x, stored, group_sizes, scale=scale, transposed=transposed,
                          interpret=interpret)
    y64 = np.asarray(y, np.float64)
    assert not np.isnan(y64).any()
    np.testing.assert_allclose(y64, want, **_TOL[dtype])
    assert (y64[sum(sizes):] == 0).all()


@pytest.mark.parametrize("splits", [1, 2, 3, 5])
def test_k_splits_sum_to_the_product(splits):
  sizes = (3, 0, 5)
  x, w, group_sizes = _inputs(8, 520, 48, sizes, jnp.float32, splits)
  y = gm.grouped_matmul(x, w, group_sizes, splits=splits, interpret=True)
  np.testing.assert_allclose(np.asarray(y, np.float64), _numpy_grouped(x, w, sizes),
                             **_TOL[jnp.float32])


def test_traced_sizes_under_jit():
  """Sizes that only exist inside jit (a router's counts): same product; sizes past the
  rows are cut at them, negative ones count as 0 (what a traced value cannot refuse)."""
  x, w, _ = _inputs(12, 64, 48, (0, 0, 0), jnp.float32, 3)
  f = jax.jit(lambda x, w, s: gm.grouped_matmul(x, w, s, interpret=True))
  for sizes, effective in (((4, 0, 8), (4, 0, 8)), ((5, -2, 3), (5, 0, 3)),
                           ((6, 9, 9), (6, 6, 0))):
    y = f(x, w, jnp.asarray(sizes, jnp.int32))
    np.testing.assert_allclose(np.asarray(y, np.float64), _numpy_grouped(x, w, effective),
                               **_TOL[jnp.float32])


def _loops_outside_kernels(jaxpr) -> list[str]:
  """The while / scan loops of a jaxpr and its sub-jaxprs, not looking inside Pallas
  kernels (whose K loops run on the device)."""
  loops = []
  for eqn in jaxpr.eqns:
    if eqn.primitive.name == "pallas_call":
      continue
    if eqn.primitive.name in ("while", "scan"):
      loops.append(eqn.primitive.name)
    for sub in jax.core.jaxprs_in_params(eqn.params):
      loops += _loops_outside_kernels(sub)
  return loops


def test_no_loop_around_the_kernel():
  """No XLA loop around the kernel (each program finds its tile itself): a while loop on a
  GPU syncs with the host every iteration (a binary search over 128 experts' tiles cost
  ~50 µs of each Qwen3-MoE decode layer)."""
  x, w, _ = _inputs(8, 64, 48, (0,) * 128, jnp.bfloat16, 4)
  sizes = jnp.zeros((128,), jnp.int32).at[:8].set(1)
  jaxpr = jax.make_jaxpr(lambda x, w, s: gm.grouped_matmul(x, w, s, interpret=False))(
      x, w, sizes)
  assert "pallas_call" in str(jaxpr)
  assert _loops_outside_kernels(jaxpr.jaxpr) == []


def test_tiles_and_default_splits():
  # Mixtral's down projection at one token (2 rows, 2 experts hit): 16-row tiles, 32
  # column blocks per tile, so K is split; prefill's large groups take wide tiles and fill
  # the GPU alone; f32's stay narrower (shared memory).
  few = gm.tiles_for(2, 8, 14336, 4096, 2)
  assert few == gm.Tiles(16, 128, 64, 4, 4)
  splits = gm.default_splits(2, 8, 14336, 4096, few)
  assert splits > 1 and 2 * 32 * splits >= 4 * 132
  many = gm.tiles_for(8192, 8, 14336, 4096, 2)
  assert many == gm.Tiles(128, 256, 64, 8, 3)
  assert gm.default_splits(8192, 8, 14336, 4096, many) == 1
  assert gm.tiles_for(4096, 8, 512, 48, 4) == gm.Tiles(64, 64, 64, 4, 4)
  assert gm.tiles_for(2, 8, 14336, 4096, 2, int8=True) == gm.Tiles(16, 64, 128, 4, 4)


def test_max_tiles_bounds_every_split_of_the_rows():
  rng = np.random.default_rng(0)
  for _ in range(200):
    groups, block_m = int(rng.integers(1, 9)), int(rng.choice([16, 32, 64]))
    sizes = rng.multinomial(int(rng.integers(0, 300)), np.ones(groups) / groups)
    rows = int(sizes.sum() + rng.integers(0, 20))
    needed = sum(-(-int(s) // block_m) for s in sizes) + -(-(rows - sizes.sum()) // block_m)
    assert needed <= gm.max_tiles(rows, groups, block_m)


def test_errors_name_the_argument():
  x, w, sizes = _inputs(6, 32, 16, (2, 4), jnp.float32, 0)
  with pytest.raises(ValueError, match=r"x must have shape \[rows, K\]"):
    gm.grouped_matmul(x[0], w, sizes)
  with pytest.raises(ValueError, match=r"weights must have shape \[groups, K=32, N\]"):
    gm.grouped_matmul(x, w[:, :16], sizes)
  with pytest.raises(ValueError, match="weights dtype must be x's"):
    gm.grouped_matmul(x, w.astype(jnp.bfloat16), sizes)
  with pytest.raises(ValueError, match=r"group_sizes must be int32 of shape \[groups=2\]"):
    gm.grouped_matmul(x, w, sizes.astype(jnp.float32))
  with pytest.raises(ValueError, match="sum to at most rows=6, got \\[3, 4\\]"):
    gm.grouped_matmul(x, w, jnp.asarray([3, 4], jnp.int32))
  with pytest.raises(ValueError, match="must be >= 0"):
    gm.grouped_matmul(x, w, jnp.asarray([-1, 4], jnp.int32))
  with pytest.raises(ValueError, match="splits must be a positive int or None, got 0"):
    gm.grouped_matmul(x, w, sizes, splits=0)
  q, scale = _int8(w)
  with pytest.raises(ValueError, match="scale goes with int8 weights"):
    gm.grouped_matmul(x, q, sizes)
  with pytest.raises(ValueError, match="scale goes with int8 weights"):
    gm.grouped_matmul(x, w, sizes, scale=scale)
  with pytest.raises(ValueError, match=r"scale must be float32 \[groups=2, N=16\]"):
    gm.grouped_matmul(x, q, sizes, scale=scale[:, :8])
  with pytest.raises(ValueError, match=r"weights must have shape \[groups, N, K=32\]"):
    gm.grouped_matmul(x, q, sizes, scale=scale, transposed=True)


@pytest.mark.gpu
@pytest.mark.parametrize("sizes,depth,cols,dtype", [
    ((0, 1, 0, 0, 0, 1, 0, 0), 4096, 2048, jnp.bfloat16),  # one token, top 2 of 8
    ((40, 0, 3, 77, 1, 0, 9, 126), 1024, 3072, jnp.bfloat16),
    ((300, 0, 212, 1), 512, 768, jnp.float32),
    ((500, 0, 260, 9), 256, 1000, jnp.bfloat16),  # prefill's 128 x 256 tiles
    ((5, 6, 0), 100, 70, jnp.float16),
])
def test_compiled_matches_numpy_gpu(sizes, depth, cols, dtype):
  rows = sum(sizes) + 3
  x, w, group_sizes = _inputs(rows, depth, cols, sizes, dtype, depth)
  for splits in (None, 1, 3):
    y = np.asarray(gm.grouped_matmul(x, w, group_sizes, splits=splits), np.float64)
    np.testing.assert_allclose(y, _numpy_grouped(x, w, sizes), **_TOL[dtype])
    assert (y[sum(sizes):] == 0).all()
  q, scale = _int8(w)
  want = _numpy_grouped(x, np.asarray(q, np.float64) * np.asarray(scale)[:, None, :], sizes)
  for transposed in (False, True):
    y = gm.grouped_matmul(x, jnp.swapaxes(q, 1, 2) if transposed else q, group_sizes,
                          scale=scale, transposed=transposed)
    np.testing.assert_allclose(np.asarray(y, np.float64), want, **_TOL[dtype])
