"""`jax_paged.kernels.layer_norm` (Pallas kernel, interpret mode on CPU) against plain XLA and
flax."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jax_paged.kernels import layer_norm as ln
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


def _numpy_total(x, parts, parts_bias):
  """x + sum(parts) + parts_bias rounded to x's dtype, float64."""
  total = np.asarray(x, np.float64) + np.asarray(parts, np.float64).sum(0)
  if parts_bias is not None:
    total += np.asarray(parts_bias, np.float64)
  return np.asarray(jnp.asarray(total, jnp.float32).astype(x.dtype), np.float64)


def _numpy_rms_norm(x, weight, epsilon):
  x = np.asarray(x, np.float64)
  return x / np.sqrt((x ** 2).mean(-1, keepdims=True) + epsilon) * np.asarray(weight,
                                                                              np.float64)


@pytest.mark.parametrize("rms", [False, True])
@pytest.mark.parametrize("shape,dtype,splits,with_bias", [
    ((5, 96), jnp.float32, 3, True), ((3, 7, 768), jnp.bfloat16, 4, True),
    ((2, 80), jnp.float16, 1, False), ((1059, 64), jnp.float32, 8, True),
])
def test_add_norm_matches_numpy(shape, dtype, splits, with_bias, rms, monkeypatch):
  """`add_layer_norm` / `add_rms_norm`: the kernel (interpret mode) and plain XLA."""
  monkeypatch.setattr(ln.triton_backend, "sm_count", lambda: 4)  # pack rows at small sizes
  x, scale, bias = _inputs(shape, dtype, seed=sum(shape) + splits)
  rng = np.random.default_rng(splits)
  parts = jnp.asarray(rng.standard_normal((splits,) + shape), jnp.float32)
  parts_bias = jnp.asarray(rng.standard_normal(shape[-1]), dtype) if with_bias else None
  want_total = _numpy_total(x, parts, parts_bias)
  want = (_numpy_rms_norm(want_total, scale, 1e-5) if rms
          else _numpy_layer_norm(want_total, scale, bias, 1e-5))
  for interpret in (True, None):  # the kernel; plain XLA (this machine has no GPU)
    if rms:
      total, got = ln.add_rms_norm(x, parts, scale, parts_bias=parts_bias, epsilon=1e-5,
                                   interpret=interpret)
    else:
      total, got = ln.add_layer_norm(x, parts, scale, bias, parts_bias=parts_bias,
                                     interpret=interpret)
    chex.assert_shape((total, got), shape)
    assert total.dtype == got.dtype == dtype
    chex.assert_tree_all_finite((total, got))
    np.testing.assert_allclose(np.asarray(total, np.float64), want_total, rtol=_TOL[dtype],
                               atol=_TOL[dtype])
    np.testing.assert_allclose(np.asarray(got, np.float64), want, rtol=_TOL[dtype],
                               atol=_TOL[dtype])


def test_add_layer_norm_rejects_bad_input():
  x, scale, bias = _inputs((4, 64), jnp.float32, seed=5)
  parts = jnp.ones((2, 4, 64), jnp.float32)
  with pytest.raises(ValueError, match=r"parts must have shape \[S >= 1, \*x.shape\]"):
    ln.add_layer_norm(x, parts[:, :3], scale, bias)
  with pytest.raises(ValueError, match="parts must have shape"):
    ln.add_layer_norm(x, parts[0], scale, bias)
  with pytest.raises(ValueError, match="parts must be a floating"):
    ln.add_layer_norm(x, parts.astype(jnp.int32), scale, bias)
  with pytest.raises(ValueError, match="parts_bias must have shape"):
    ln.add_layer_norm(x, parts, scale, bias, parts_bias=bias[:8])
  with pytest.raises(ValueError, match="scale and bias must have shape"):
    ln.add_layer_norm(x, parts, scale[:8], bias)


@pytest.mark.gpu
def test_add_layer_norm_on_gpu():
  x, scale, bias = _inputs((128, 768), jnp.bfloat16, seed=6)
  rng = np.random.default_rng(6)
  parts = jnp.asarray(rng.standard_normal((4, 128, 768)), jnp.float32)
  parts_bias = jnp.asarray(rng.standard_normal(768), jnp.bfloat16)
  fn = jax.jit(lambda *a: ln.add_layer_norm(*a, parts_bias=parts_bias))
  assert "add_layer_norm" in fn.lower(x, parts, scale, bias).as_text()
  total, got = fn(x, parts, scale, bias)
  want_total = _numpy_total(x, parts, parts_bias)
  want = _numpy_layer_norm(want_total, scale, bias, 1e-5)
  np.testing.assert_allclose(np.asarray(total, np.float64), want_total, rtol=2e-2, atol=2e-2)
  np.testing.assert_allclose(np.asarray(got, np.float64), want, rtol=2e-2, atol=2e-2)


def _hf_rms_norm(x, weight, epsilon, gemma: bool = False):
  """Hugging Face's LlamaRMSNorm (`gemma`: Gemma3RMSNorm) (torch) on x and weight, as
  float64 numpy."""
  import torch
  from transformers.models.gemma3.modeling_gemma3 import Gemma3RMSNorm
  from transformers.models.llama.modeling_llama import LlamaRMSNorm
  dtypes = {jnp.float32: torch.float32, jnp.bfloat16: torch.bfloat16,
            jnp.float16: torch.float16}
  norm = (Gemma3RMSNorm if gemma else LlamaRMSNorm)(x.shape[-1], eps=epsilon).to(
      dtypes[weight.dtype.type])
  with torch.no_grad():
    norm.weight.copy_(torch.tensor(np.asarray(weight, np.float32)))
    y = norm(torch.tensor(np.asarray(x, np.float32)).to(dtypes[x.dtype.type]))
  return y.float().numpy().astype(np.float64), y.dtype


@pytest.mark.parametrize("shape,dtype,weight_dtype", [
    ((5, 96), jnp.float32, jnp.float32), ((3, 7, 768), jnp.bfloat16, jnp.bfloat16),
    ((2, 80), jnp.bfloat16, jnp.float32),  # f32 weight: an f32 result, as the product's
    ((1059, 64), jnp.float16, jnp.float16),  # several rows per program
])
def test_rms_norm_matches_hugging_face(shape, dtype, weight_dtype, monkeypatch):
  """`rms_norm` (kernel in interpret mode, and plain XLA) and `nn.RMSNorm` against
  transformers' LlamaRMSNorm on the same inputs: its dtype, its values."""
  monkeypatch.setattr(ln.triton_backend, "sm_count", lambda: 4)  # pack rows at small sizes
  x, weight, _ = _inputs(shape, dtype, seed=sum(shape) + 7)
  weight = weight.astype(weight_dtype)
  want, want_dtype = _hf_rms_norm(x, weight, 1e-6)
  module = nn.RMSNorm(shape[-1], param_dtype=weight_dtype)
  module.weight[...] = weight
  for got in [ln.rms_norm(x, weight, interpret=interpret) for interpret in (True, None)] + [
      module(x)]:
    chex.assert_shape(got, shape)
    assert str(got.dtype) == str(want_dtype).removeprefix("torch.")
    chex.assert_tree_all_finite(got)
    tol = _TOL[jnp.dtype(got.dtype).type]
    np.testing.assert_allclose(np.asarray(got, np.float64), want, rtol=tol, atol=tol)


@pytest.mark.parametrize("shape,dtype,weight_dtype", [
    ((5, 96), jnp.float32, jnp.float32), ((3, 7, 768), jnp.bfloat16, jnp.bfloat16),
    ((2, 80), jnp.bfloat16, jnp.float32),  # f32 weight: still x's dtype, as Gemma's
])
def test_gemma_rms_norm_matches_hugging_face(shape, dtype, weight_dtype, monkeypatch):
  """`unit_offset` (kernel in interpret mode, plain XLA, `nn.RMSNorm(unit_offset=True)`,
  and the fused add's) against transformers' Gemma3RMSNorm: (1 + weight) in f32."""
  monkeypatch.setattr(ln.triton_backend, "sm_count", lambda: 4)
  x, weight, _ = _inputs(shape, dtype, seed=sum(shape) + 11)
  weight = (weight - 1.0).astype(weight_dtype)  # centred on 0, as Gemma's
  want, want_dtype = _hf_rms_norm(x, weight, 1e-6, gemma=True)
  module = nn.RMSNorm(shape[-1], param_dtype=weight_dtype, unit_offset=True)
  np.testing.assert_array_equal(module.weight[...], 0.0)  # the identity, as HF's init
  module.weight[...] = weight
  zero = jnp.zeros((1,) + shape, jnp.float32)  # the fused add of nothing: its norm alone
  for got in [ln.rms_norm(x, weight, interpret=i, unit_offset=True) for i in (True, None)] + [
      module(x)] + [ln.add_rms_norm(x, zero, weight, interpret=i, unit_offset=True)[1]
                    for i in (True, None)]:
    chex.assert_shape(got, shape)
    assert str(got.dtype) == str(want_dtype).removeprefix("torch.")
    tol = _TOL[jnp.dtype(got.dtype).type]
    np.testing.assert_allclose(np.asarray(got, np.float64), want, rtol=tol, atol=tol)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_add_rms_norm_of_a_normalised_sum(dtype, monkeypatch):
  """`parts_weight` (Gemma's post-norm before the residual add): the kernel in interpret
  mode and plain XLA against transformers' Gemma3RMSNorm applied to the parts' sum, added
  to x, then normalised again."""
  import torch
  from transformers.models.gemma3.modeling_gemma3 import Gemma3RMSNorm
  monkeypatch.setattr(ln.triton_backend, "sm_count", lambda: 4)
  x, w2, _ = _inputs((6, 96), dtype, seed=21)
  rng = np.random.default_rng(21)
  parts = jnp.asarray(rng.standard_normal((3, 6, 96)) * 4, jnp.float32)
  w1 = jnp.asarray(rng.standard_normal(96), dtype)
  w2 = (w2 - 1.0).astype(dtype)
  torch_dtype = torch.float32 if dtype == jnp.float32 else torch.bfloat16
  norms = []
  for w in (w1, w2):
    norms.append(Gemma3RMSNorm(96, eps=1e-6).to(torch_dtype))
    with torch.no_grad():
      norms[-1].weight.copy_(torch.tensor(np.asarray(w, np.float32)))
  with torch.no_grad():
    y = torch.tensor(np.asarray(parts, np.float64).sum(0), dtype=torch.float32)
    y = norms[0](y).to(torch_dtype)  # (Gemma's norm keeps its input's f32; then x's dtype)
    total = torch.tensor(np.asarray(x, np.float32)).to(torch_dtype) + y
    want = norms[1](total)
  tol = _TOL[jnp.dtype(dtype).type]
  for interpret in (True, None):
    got_total, got = ln.add_rms_norm(x, parts, w2, parts_weight=w1, unit_offset=True,
                                     interpret=interpret)
    assert got.dtype == dtype and got_total.dtype == dtype
    np.testing.assert_allclose(np.asarray(got_total, np.float64),
                               total.float().numpy(), rtol=tol, atol=tol)
    np.testing.assert_allclose(np.asarray(got, np.float64), want.float().numpy(),
                               rtol=tol, atol=tol)
  with pytest.raises(ValueError, match=r"parts_weight must have shape \(96,\)"):
    ln.add_rms_norm(x, parts, w2, parts_weight=w1[:8])


def test_add_norm_past_the_partial_values_limit_takes_xla(monkeypatch):
  """More than 16384 partial values per row (8 parts of 4096): plain XLA (there faster than
  the kernel's one program per row), even in interpret mode; 4 parts: the kernel."""
  calls = []
  kernel = ln._layer_norm_pallas
  monkeypatch.setattr(ln, "_layer_norm_pallas", lambda *a, **k: calls.append(1) or kernel(
      *a, **k))
  x, weight, bias = _inputs((2, 4096), jnp.float32, seed=10)
  parts = jnp.asarray(np.random.default_rng(10).standard_normal((8, 2, 4096)), jnp.float32)
  for rms in (False, True):
    args = (x, parts, weight) if rms else (x, parts, weight, bias)
    fused, reference = ((ln.add_rms_norm, ln.add_rms_norm_reference) if rms else
                        (ln.add_layer_norm, ln.add_layer_norm_reference))
    chex.assert_trees_all_equal(fused(*args, interpret=True),
                                reference(*args, epsilon=1e-6 if rms else 1e-5))
    assert not calls
    fused(x, parts[:4], *args[2:], interpret=True)
    assert calls == [1]
    calls.clear()


def test_rms_norm_rejects_bad_input():
  x, weight, _ = _inputs((4, 64), jnp.float32, seed=8)
  with pytest.raises(ValueError, match=r"weight must have shape \(64,\)"):
    ln.rms_norm(x, weight[:32])
  with pytest.raises(ValueError, match="floating"):
    ln.rms_norm(jnp.ones((4, 64), jnp.int32), weight)
  with pytest.raises(ValueError, match="parts must have shape"):
    ln.add_rms_norm(x, jnp.ones((4, 64)), weight)
  with pytest.raises(ValueError, match="weight must have shape"):
    ln.add_rms_norm(x, jnp.ones((2, 4, 64)), weight[:8])


@pytest.mark.gpu
def test_rms_norms_on_gpu():
  x, weight, _ = _inputs((64, 4096), jnp.bfloat16, seed=9)
  fn = jax.jit(lambda x, w: ln.rms_norm(x, w))
  assert "rms_norm" in fn.lower(x, weight).as_text()
  want, _ = _hf_rms_norm(x, weight, 1e-6)
  np.testing.assert_allclose(np.asarray(fn(x, weight), np.float64), want, rtol=2e-2, atol=2e-2)
  parts = jnp.asarray(np.random.default_rng(9).standard_normal((4, 64, 4096)), jnp.float32)
  fn = jax.jit(lambda *a: ln.add_rms_norm(*a))
  assert "add_rms_norm" in fn.lower(x, parts, weight).as_text()
  total, got = fn(x, parts, weight)
  want_total, want = ln.add_rms_norm_reference(x, parts, weight, epsilon=1e-6)
  np.testing.assert_allclose(np.asarray(total, np.float32), np.asarray(want_total, np.float32),
                             rtol=2e-2, atol=2e-2)
  np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32),
                             rtol=2e-2, atol=2e-2)
