"""`jax_paged.kernels.linear`: the GEMM-with-epilogue and split-K kernels vs plain jnp."""

import functools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jax_paged.kernels import linear

_GELU = functools.partial(jax.nn.gelu, approximate=True)
_GELU_EXACT = functools.partial(jax.nn.gelu, approximate=False)  # erf: not in the kernel
_TOL = {jnp.float32: dict(rtol=1e-5, atol=1e-5), jnp.bfloat16: dict(rtol=2e-2, atol=2e-2),
        jnp.float16: dict(rtol=1e-2, atol=1e-2)}


def _inputs(rows, depth, cols, dtype, seed):
  rng = np.random.default_rng(seed)
  x = jnp.asarray(rng.standard_normal((rows, depth)), dtype)
  w = jnp.asarray(rng.standard_normal((depth, cols)) / np.sqrt(depth), dtype)
  b = jnp.asarray(rng.standard_normal(cols), dtype)
  return x, w, b


def _numpy_linear(x, w, b=None, activation=None):
  y = np.asarray(x, np.float64) @ np.asarray(w, np.float64)
  if b is not None:
    y += np.asarray(b, np.float64)
  return y if activation is None else np.asarray(activation(jnp.asarray(y, jnp.float32)))


# rows: one, a few, non-powers of two, GPT-2's 128, the most the kernel takes; depth/cols:
# multiples of the blocks and ragged tails.
@pytest.mark.parametrize("rows,depth,cols,dtype", [
    (1, 64, 32, jnp.float32), (5, 100, 70, jnp.float32), (33, 256, 96, jnp.bfloat16),
    (128, 768, 160, jnp.bfloat16), (200, 96, 48, jnp.float16), (256, 130, 64, jnp.float32)])
@pytest.mark.parametrize("bias,activation", [(False, None), (True, _GELU), (True, _GELU_EXACT)])
def test_linear_matches_numpy(rows, depth, cols, dtype, bias, activation):
  x, w, b = _inputs(rows, depth, cols, dtype, rows + depth)
  b = b if bias else None
  y = linear.linear(x, w, b, activation=activation, interpret=True)
  chex.assert_shape(y, (rows, cols))
  assert y.dtype == dtype
  y64 = np.asarray(y, np.float64)
  assert not np.isnan(y64).any()
  np.testing.assert_allclose(y64, _numpy_linear(x, w, b, activation), **_TOL[dtype])


# Default splits: 4 work units per column block (8 for a K over 1024 into fewer than
# 2048 columns), 64-row blocks first.
@pytest.mark.parametrize("rows,depth,cols,splits,want_splits", [
    (7, 768, 96, None, 4), (128, 3072, 128, None, 4), (200, 768, 64, None, 1),
    (9, 2048, 2048, None, 4),
    (3, 100, 40, 4, 4), (16, 48, 32, 2, 2), (9, 40, 16, 8, 3), (130, 96, 32, 2, 2)])
def test_linear_partials_sum_to_product(rows, depth, cols, splits, want_splits):
  x, w, _ = _inputs(rows, depth, cols, jnp.float32, depth)
  parts = linear.linear_partials(x, w, splits=splits, interpret=True)
  chex.assert_shape(parts, (want_splits, rows, cols))
  assert parts.dtype == jnp.float32
  np.testing.assert_allclose(np.asarray(parts, np.float64).sum(0), _numpy_linear(x, w),
                             rtol=1e-5, atol=1e-5)
  # The same K ranges as the plain-XLA path (CPU default).
  chex.assert_trees_all_close(parts, linear.linear_partials(x, w, splits=splits),
                              rtol=1e-5, atol=1e-5)


def test_whole_k_tiles_widen_the_grid_at_a_long_k():
  """GPT-2's K (768) keeps 64-column programs of 8 warps; a long K (2048) takes 32 columns
  (qkv-wide outputs) or 64 columns of 64-deep steps (>= 8192 columns), 4 warps, narrowed
  to whole divisors of the sections, or the columns a caller fixes."""
  assert linear.whole_k_tiles(128, 768, 2304, 2, (768,) * 3) == (64, 64, 128, 8)
  assert linear.whole_k_tiles(64, 2048, 3072, 2, (2048, 512, 512)) == (64, 32, 128, 4)
  assert linear.whole_k_tiles(64, 2048, 16384, 2, (8192, 8192)) == (64, 64, 64, 4)
  assert linear.whole_k_tiles(64, 2048, 16384, 2, (8192, 8160, 32)) == (64, 32, 128, 4)
  assert linear.whole_k_tiles(256, 2048, 16384, 2, block_n=64) == (64, 64, 128, 4)


@pytest.mark.parametrize("rows,cols,sections", [(5, 96, (32, 32, 32)),
                                                (3, 8192, (4096, 4096))])
def test_long_k_tiles_match_numpy(rows, cols, sections):
  """The long-K tiles (narrow, and wide with 64-deep steps) in interpret mode."""
  x, w, b = _inputs(rows, 2048, cols, jnp.float32, cols)
  ys = linear.linear(x, w, b, activation=_GELU, sections=sections, interpret=True)
  np.testing.assert_allclose(np.concatenate([np.asarray(y, np.float64) for y in ys], -1),
                             _numpy_linear(x, w, b, _GELU), **_TOL[jnp.float32])


@pytest.mark.parametrize("sections", [(64, 64), (64, 32, 32), (40, 50, 38)])
def test_sections(sections):
  # Multiples of 64 / 32: one kernel of 64- / 32-column programs storing each section;
  # otherwise sliced from the output.
  x, w, b = _inputs(9, 80, 128, jnp.float32, 3)
  parts = linear.linear(x, w, b, activation=_GELU, sections=sections, interpret=True)
  assert [p.shape for p in parts] == [(9, n) for n in sections]
  want = _numpy_linear(x, w, b, _GELU)
  np.testing.assert_allclose(np.concatenate([np.asarray(p) for p in parts], -1), want,
                             rtol=1e-5, atol=1e-5)
  cpu = linear.linear(x, w, b, activation=_GELU, sections=sections)
  chex.assert_trees_all_close(cpu, parts, rtol=1e-5, atol=1e-5)


def test_lowers_in_kernel():
  assert linear.lowers_in_kernel(_GELU) and linear.lowers_in_kernel(jax.nn.silu)
  assert not linear.lowers_in_kernel(_GELU_EXACT)


def test_leading_dims_and_cpu_default():
  x, w, b = _inputs(12, 64, 48, jnp.float32, 0)
  x3 = x.reshape(3, 4, 64)
  y = linear.linear(x3, w, b, interpret=True)
  chex.assert_shape(y, (3, 4, 48))
  chex.assert_trees_all_close(y.reshape(12, 48), linear.linear(x, w, b), rtol=1e-5, atol=1e-5)
  chex.assert_shape(linear.linear_partials(x3, w, interpret=True), (4, 3, 4, 48))


def test_many_rows_take_xla(monkeypatch):
  monkeypatch.setattr(linear, "_linear_pallas", None)  # would raise if called
  x, w, b = _inputs(linear.MAX_ROWS + 1, 32, 16, jnp.float32, 1)
  np.testing.assert_allclose(np.asarray(linear.linear(x, w, b, interpret=True), np.float64),
                             _numpy_linear(x, w, b), rtol=1e-5, atol=1e-5)


def test_rows_past_a_large_weights_limit_take_xla(monkeypatch):
  x, w, b = _inputs(linear._LARGE_WEIGHT_ROWS + 1, 32, 16, jnp.float32, 2)
  monkeypatch.setattr(linear, "_LARGE_WEIGHT", w.size)  # w counts as large
  assert linear.takes(x[:-1], w) and not linear.takes(x, w)
  assert linear.takes(x, w[:, :-1])
  calls = []
  argmax_pallas = linear._argmax_pallas
  monkeypatch.setattr(linear, "_argmax_pallas",
                      lambda *a, **k: calls.append(1) or argmax_pallas(*a, **k))
  monkeypatch.setattr(linear, "_linear_pallas", None)  # would raise if called
  np.testing.assert_allclose(np.asarray(linear.linear(x, w, b, interpret=True), np.float64),
                             _numpy_linear(x, w, b), rtol=1e-5, atol=1e-5)
  # The greedy head keeps its own limit (MAX_ROWS): its 128-row programs read each tile once.
  linear.argmax_attend(x, w.T, interpret=True)
  assert calls


@pytest.mark.parametrize("args,name", [
    (dict(x=jnp.ones((4, 8), jnp.int32)), "x"),
    (dict(kernel=jnp.ones((9, 16))), "kernel"),
    (dict(kernel=jnp.ones((8, 16), jnp.bfloat16)), "kernel must have x's dtype"),
    (dict(bias=jnp.ones((15,))), "bias"),
])
def test_bad_inputs_raise(args, name):
  kwargs = dict(x=jnp.ones((4, 8)), kernel=jnp.ones((8, 16)), bias=jnp.ones((16,)))
  kwargs.update(args)
  with pytest.raises(ValueError, match=name):
    linear.linear(kwargs["x"], kwargs["kernel"], kwargs["bias"], interpret=True)
  with pytest.raises(ValueError, match="splits"):
    linear.linear_partials(jnp.ones((4, 8)), jnp.ones((8, 16)), splits=0)
  with pytest.raises(ValueError, match="sections"):
    linear.linear(jnp.ones((4, 8)), jnp.ones((8, 16)), sections=(8, 4))


def _check_argmax_attend(rows, vocab, depth, dtype, interpret):
  x, _, _ = _inputs(rows, depth, 8, dtype, rows + vocab)
  rng = np.random.default_rng(vocab)
  embedding = jnp.asarray(rng.standard_normal((vocab, depth)) / np.sqrt(depth), dtype)
  # Exact ties: row 3 of the table duplicated at the end; the first index must win.
  embedding = embedding.at[vocab - 1].set(embedding[3])
  x = x.at[0].set(embedding[3] * 4)  # row 0's maximum is at 3 and at vocab - 1
  got = np.asarray(linear.argmax_attend(x, embedding, interpret=interpret))
  assert got.shape == (rows,) and got.dtype == np.int32
  assert got[0] == 3
  # Every pick is a maximum of the exact logits, to the logits' rounding.
  logits = np.asarray(x, np.float64) @ np.asarray(embedding, np.float64).T
  picked = logits[np.arange(rows), got]
  np.testing.assert_allclose(picked, logits.max(-1), rtol=_TOL[dtype]["rtol"], atol=1e-6)
  return got, x, embedding


# vocab: ragged and whole 128-column blocks; rows: one, a few, two row blocks (> 128).
@pytest.mark.parametrize("rows,vocab,depth,dtype", [
    (1, 97, 64, jnp.float32), (5, 300, 48, jnp.float32), (130, 1000, 64, jnp.bfloat16),
    (16, 256, 96, jnp.float16)])
def test_argmax_attend_matches_xla(rows, vocab, depth, dtype):
  got, x, embedding = _check_argmax_attend(rows, vocab, depth, dtype, interpret=True)
  np.testing.assert_array_equal(got, np.asarray(linear.argmax_attend(x, embedding)))
  x3 = x.reshape(1, rows, depth)
  chex.assert_shape(linear.argmax_attend(x3, embedding, interpret=True), (1, rows))


@pytest.mark.parametrize("x,embedding,name", [
    (jnp.ones((4, 8), jnp.int32), jnp.ones((16, 8), jnp.int32), "x"),
    (jnp.ones((4, 8)), jnp.ones((16, 9)), "embedding must have shape"),
    (jnp.ones((4, 8)), jnp.ones((16, 8), jnp.bfloat16), "embedding must have x's dtype")])
def test_argmax_attend_bad_inputs_raise(x, embedding, name):
  with pytest.raises(ValueError, match=name):
    linear.argmax_attend(x, embedding, interpret=True)


@pytest.mark.gpu
@pytest.mark.parametrize("rows,vocab,depth,dtype", [
    (128, 50257, 768, jnp.bfloat16), (256, 1000, 256, jnp.float32), (3, 500, 64, jnp.float16)])
def test_argmax_attend_compiled_gpu(rows, vocab, depth, dtype):
  _check_argmax_attend(rows, vocab, depth, dtype, interpret=False)


@pytest.mark.gpu
@pytest.mark.parametrize("rows,depth,cols,dtype", [
    (128, 768, 2304, jnp.bfloat16), (128, 768, 3072, jnp.float16), (37, 3072, 768, jnp.bfloat16),
    (256, 100, 70, jnp.float32), (128, 768, 192, jnp.float32), (256, 3072, 96, jnp.float32),
    (256, 768, 96, jnp.bfloat16), (64, 2048, 3072, jnp.bfloat16),
    (256, 2048, 16384, jnp.bfloat16), (64, 8192, 2048, jnp.bfloat16)])
def test_compiled_matches_numpy_gpu(rows, depth, cols, dtype):
  x, w, b = _inputs(rows, depth, cols, dtype, rows)
  for activation in (_GELU, _GELU_EXACT):  # in the kernel / by XLA after it
    y = linear.linear(x, w, b, activation=activation)
    np.testing.assert_allclose(np.asarray(y, np.float64), _numpy_linear(x, w, b, activation),
                               **_TOL[dtype])
  if cols % 96 == 0:  # q / k / v sections of a fused projection
    qkv = linear.linear(x, w, b, sections=(cols // 3,) * 3)
    np.testing.assert_allclose(np.concatenate([np.asarray(p, np.float64) for p in qkv], -1),
                               _numpy_linear(x, w, b), **_TOL[dtype])
  parts = linear.linear_partials(x, w)
  np.testing.assert_allclose(np.asarray(parts, np.float64).sum(0), _numpy_linear(x, w),
                             rtol=1e-4 if dtype == jnp.float32 else 1e-3, atol=1e-3)
