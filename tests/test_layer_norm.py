"""`jax_paged.layer_norm` (Pallas kernel, interpret mode on CPU) against plain XLA and flax."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jax_paged import layer_norm as ln
from jax_paged import nn

_TOL = {jnp.float32: 1e-5, jnp.bfloat16: 2e-2, jnp.float16: 2e-3}


def _inputs(shape, dtype, seed):
  rng = np.random.default_rng(seed)
  f = shape[-1]
  # An offset and spread per row, so the statistics matter.
  x = rng.standard_normal(shape) * rng.uniform(0.5, 4, shape[:-1] + (1,)) + rng.uniform(
      -3, 3, shape[:-1] + (1,))
  return (jnp.asarray(x, dtype), jnp.asarray(rng.uniform(0.5, 1.5, f), dtype),
          jnp.asarray(rng.standard_normal(f), dtype))


def _numpy_layer_norm(x, scale, bias, epsilon):
  x, scale, bias = (np.asarray(a, np.float64) for a in (x, scale, bias))
  mean = x.mean(-1, keepdims=True)
  var = ((x - mean) ** 2).mean(-1, keepdims=True)
  return (x - mean) / np.sqrt(var + epsilon) * scale + bias


@pytest.mark.parametrize("shape,dtype", [
    ((5, 96), jnp.float32), ((3, 7, 768), jnp.bfloat16), ((2, 80), jnp.float16),
    ((1059, 64), jnp.float32),  # several rows per program, the last program part-full
    ((70, 4100), jnp.float32),  # wide rows: fewer rows per program
])
def test_kernel_matches_numpy(shape, dtype, monkeypatch):
  monkeypatch.setattr(ln.triton_backend, "sm_count", lambda: 4)  # pack rows at small sizes
  x, scale, bias = _inputs(shape, dtype, seed=sum(shape))
  want = _numpy_layer_norm(x, scale, bias, 1e-5)
  for interpret in (True, None):  # the kernel; plain XLA (this machine has no GPU)
    got = ln.layer_norm(x, scale, bias, epsilon=1e-5, interpret=interpret)
    chex.assert_shape(got, shape)
    assert got.dtype == dtype
    chex.assert_tree_all_finite(got)
    np.testing.assert_allclose(np.asarray(got, np.float64), want, rtol=_TOL[dtype],
                               atol=_TOL[dtype])


def test_out_dtype():
  x, scale, bias = _inputs((4, 64), jnp.float32, seed=1)
  got = ln.layer_norm(x, scale, bias, out_dtype=jnp.bfloat16, interpret=True)
  assert got.dtype == jnp.bfloat16
  np.testing.assert_allclose(np.asarray(got, np.float64),
                             _numpy_layer_norm(x, scale, bias, 1e-5), rtol=2e-2, atol=2e-2)


def test_module_matches_flax_layer_norm():
  rngs = nnx.Rngs(0)
  ours = nn.LayerNorm(48, epsilon=1e-5, dtype=jnp.float32, rngs=rngs)
  flax_ln = nnx.LayerNorm(48, epsilon=1e-5, dtype=jnp.float32, rngs=rngs)
  x, scale, bias = _inputs((6, 48), jnp.float32, seed=2)
  for m in (ours, flax_ln):  # same parameter names: one state fits both
    m.scale[...], m.bias[...] = scale, bias
  assert jax.tree.structure(nnx.state(ours)) == jax.tree.structure(nnx.state(flax_ln))
  np.testing.assert_allclose(ours(x), flax_ln(x), rtol=1e-5, atol=1e-5)


def test_rejects_bad_input():
  x, scale, bias = _inputs((4, 64), jnp.float32, seed=3)
  with pytest.raises(ValueError, match="scale and bias must have shape"):
    ln.layer_norm(x, scale[:32], bias)
  with pytest.raises(ValueError, match="floating"):
    ln.layer_norm(jnp.ones((4, 64), jnp.int32), scale, bias)
  with pytest.raises(ValueError, match="last"):
    ln.layer_norm(jnp.ones(()), scale, bias)


@pytest.mark.gpu
@pytest.mark.parametrize("shape,dtype", [((128, 768), jnp.bfloat16), ((4096, 768), jnp.bfloat16),
                                         ((33, 80), jnp.float32), ((3000, 12288), jnp.bfloat16)])
def test_kernel_on_gpu(shape, dtype):
  x, scale, bias = _inputs(shape, dtype, seed=4)
  got = jax.jit(lambda *a: ln.layer_norm(*a, epsilon=1e-5))(x, scale, bias)
  assert "layer_norm" in jax.jit(lambda *a: ln.layer_norm(*a)).lower(x, scale, bias).as_text()
  chex.assert_tree_all_finite(got)
  np.testing.assert_allclose(np.asarray(got, np.float64),
                             _numpy_layer_norm(x, scale, bias, 1e-5), rtol=_TOL[dtype],
                             atol=_TOL[dtype])
