"""Layer normalisation in one Pallas-Triton kernel.

XLA runs a layer norm as two kernels: a reduction for the row statistics, then an
elementwise kernel that normalises. In a GPT-2 124M decode step at batch 128 those are 24
pairs of ~1.4 + ~1.6 µs on an H200 (benchmarks/RESULTS.md), for 196 KB of activations each:
launch-bound work. This kernel reads each row once, keeps it in registers for both
statistics and writes the normalised row: one launch per layer norm.

Grid (rows / block_rows,): a program normalises `block_rows` rows of `features` values
(padded to a power of two and masked). Statistics in f32 (the mean, then the mean of
squared deviations: two passes over registers, where flax's `nnx.LayerNorm` by default
takes E[x^2] - E[x]^2), the affine in f32, the result cast to the output dtype.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from jax_paged import triton_backend

# Rows per program at most: a decode step has few rows (one per sequence) and wants one
# program per row to spread them over the SMs; a prompt of thousands of rows wants fewer,
# fuller programs.
_MAX_BLOCK_ROWS = 8
# Values one program holds: 64 f32 registers per thread at 8 warps. Rows are packed only
# up to this, and wider rows than this take plain XLA.
_MAX_BLOCK_VALUES = _MAX_FEATURES = 16384


def layer_norm_reference(x: jax.Array, scale: jax.Array, bias: jax.Array, *,
                         epsilon: float, out_dtype=None) -> jax.Array:
  """Plain-XLA layer norm over the last axis (f32 statistics); see `layer_norm`."""
  out_dtype = x.dtype if out_dtype is None else out_dtype
  x32 = x.astype(jnp.float32)
  mean = jnp.mean(x32, axis=-1, keepdims=True)
  var = jnp.mean(jnp.square(x32 - mean), axis=-1, keepdims=True)
  y = (x32 - mean) * jax.lax.rsqrt(var + epsilon) * scale.astype(jnp.float32)
  return (y + bias.astype(jnp.float32)).astype(out_dtype)


def _layer_norm_kernel(x_ref, scale_ref, bias_ref, o_ref, *, rows: int, features: int,
                       block_rows: int, block_f: int, epsilon: float):
  """Refs: x, o [rows, features]; scale, bias [features]."""
  r = pl.program_id(0) * block_rows + jnp.arange(block_rows)
  cols = jnp.arange(block_f)
  col_mask = cols < features
  mask = (r[:, None] < rows) & col_mask[None, :]
  idx = (r[:, None], cols[None, :])
  x = plgpu.load(x_ref.at[idx], mask=mask, other=0.0).astype(jnp.float32)
  mean = jnp.sum(x, axis=1) / features
  centred = jnp.where(mask, x - mean[:, None], 0.0)
  var = jnp.sum(centred * centred, axis=1) / features
  scale = plgpu.load(scale_ref.at[cols], mask=col_mask, other=0.0).astype(jnp.float32)
  bias = plgpu.load(bias_ref.at[cols], mask=col_mask, other=0.0).astype(jnp.float32)
  y = centred * jax.lax.rsqrt(var + epsilon)[:, None] * scale[None, :] + bias[None, :]
  plgpu.store(o_ref.at[idx], y.astype(o_ref.dtype), mask=mask)


@functools.partial(jax.jit, static_argnames=["epsilon", "out_dtype", "interpret"])
def _layer_norm_pallas(x, scale, bias, *, epsilon: float, out_dtype, interpret: bool):
  features = x.shape[-1]
  x2 = x.reshape(-1, features)
  rows = x2.shape[0]
  block_f = pl.next_power_of_2(features)
  # About four programs per SM before rows are packed together.
  block_rows = min(_MAX_BLOCK_ROWS, _MAX_BLOCK_VALUES // block_f,
                   pl.next_power_of_2(max(1, rows // (4 * triton_backend.sm_count()))))
  # One warp per 256 values (8 per thread: 16-byte bf16 vectors), 1..8 warps.
  num_warps = max(1, min(8, block_rows * block_f // 256))
  kernel = functools.partial(_layer_norm_kernel, rows=rows, features=features,
                             block_rows=block_rows, block_f=block_f, epsilon=epsilon)
  y = pl.pallas_call(
      kernel,
      grid=(pl.cdiv(rows, block_rows),),
      out_shape=jax.ShapeDtypeStruct((rows, features), out_dtype),
      compiler_params=triton_backend.compiler_params(num_warps=num_warps, num_stages=1),
      interpret=interpret,
      name="layer_norm",
  )(x2, scale, bias)
  return y.reshape(x.shape)


def layer_norm(x: jax.Array, scale: jax.Array, bias: jax.Array, *, epsilon: float = 1e-5,
               out_dtype=None, interpret: bool | None = None) -> jax.Array:
  """Layer norm over the last axis: (x - mean) / sqrt(var + epsilon) * scale + bias.

  Args:
    x: [..., F], f32 / bf16 / f16.
    scale, bias: [F].
    epsilon: added to the variance.
    out_dtype: the result's dtype (default x's).
    interpret: None = the Triton kernel on a GPU, plain XLA elsewhere; True = the kernel
      in Pallas interpret mode (tests); False = the kernel. Rows over 16384 features always
      take plain XLA.

  Returns:
    [..., F] in `out_dtype`. Statistics and the affine are computed in f32.
  """
  if x.ndim < 1 or x.shape[-1] < 1:
    raise ValueError(f"x must have a non-empty last (feature) axis, got shape {x.shape}")
  if scale.shape != x.shape[-1:] or bias.shape != x.shape[-1:]:
    raise ValueError(f"scale and bias must have shape {x.shape[-1:]} (x's last axis), got "
                     f"{scale.shape} and {bias.shape}")
  if not jnp.issubdtype(x.dtype, jnp.floating):
    raise ValueError(f"x must be a floating dtype, got {x.dtype}")
  out_dtype = jnp.dtype(x.dtype if out_dtype is None else out_dtype)
  mode = triton_backend.resolve_interpret(interpret)
  if mode is None or x.size == 0 or x.shape[-1] > _MAX_FEATURES:
    return layer_norm_reference(x, scale, bias, epsilon=epsilon, out_dtype=out_dtype)
  return _layer_norm_pallas(x, scale, bias, epsilon=float(epsilon), out_dtype=out_dtype,
                            interpret=mode)
