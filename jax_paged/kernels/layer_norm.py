"""Layer normalisation in one Pallas-Triton kernel, optionally fused with a residual add.

XLA runs a layer norm as two kernels: a reduction for the row statistics, then an
elementwise kernel that normalises. In a GPT-2 124M decode step at batch 128 those are 24
pairs of ~1.4 + ~1.6 µs on an H200 (benchmarks/LOG.md, "Layer norm"), for 196 KB of
activations each: launch-bound work. This kernel reads each row once, keeps it in registers for both
statistics and writes the normalised row: one launch per layer norm.

`add_layer_norm` also adds the partial sums of a split-K projection (and its bias) to the
residual stream first, writing both the new stream and its normalised rows (vLLM's
fused_add_rms_norm, for layer norm). A projection at decode's few rows runs as a split-K
GEMM whose partials XLA reduces in a kernel of its own; handing the partials to this
kernel instead folds that reduction, the residual add and the next layer norm into one
launch.

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

from jax_paged.kernels import triton_backend

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


def add_layer_norm_reference(x: jax.Array, parts: jax.Array, scale: jax.Array,
                             bias: jax.Array, *, parts_bias: jax.Array | None = None,
                             epsilon: float, out_dtype=None) -> tuple[jax.Array, jax.Array]:
  """Plain-XLA `add_layer_norm`."""
  total = x.astype(jnp.float32) + jnp.sum(parts.astype(jnp.float32), axis=0)
  if parts_bias is not None:
    total += parts_bias.astype(jnp.float32)
  total = total.astype(x.dtype)
  return total, layer_norm_reference(total, scale, bias, epsilon=epsilon, out_dtype=out_dtype)


def _layer_norm_kernel(*refs, rows: int, features: int, block_rows: int, block_f: int,
                       epsilon: float, num_parts: int, has_parts_bias: bool):
  """Refs: x [rows, features]; with num_parts > 0, parts [num_parts, rows, features] and
  (has_parts_bias) parts_bias [features]; scale, bias [features]; outputs: with
  num_parts > 0, the sum [rows, features]; the normalised rows [rows, features]."""
  x_ref, *refs = refs
  if num_parts:
    parts_ref, *refs = refs
    if has_parts_bias:
      parts_bias_ref, *refs = refs
  scale_ref, bias_ref, *out_refs = refs
  r = pl.program_id(0) * block_rows + jnp.arange(block_rows)
  cols = jnp.arange(block_f)
  col_mask = cols < features
  mask = (r[:, None] < rows) & col_mask[None, :]
  idx = (r[:, None], cols[None, :])
  # Loaded first: Triton keeps loads in program order around the reductions' barriers, so
  # loaded where they are used they added a memory latency after the last barrier.
  scale = plgpu.load(scale_ref.at[cols], mask=col_mask, other=0.0).astype(jnp.float32)
  bias = plgpu.load(bias_ref.at[cols], mask=col_mask, other=0.0).astype(jnp.float32)
  x = plgpu.load(x_ref.at[idx], mask=mask, other=0.0).astype(jnp.float32)
  if num_parts:
    sum_ref, o_ref = out_refs
    for part in range(num_parts):  # few (split-K splits): unrolled
      x += plgpu.load(parts_ref.at[(part,) + idx], mask=mask, other=0.0).astype(jnp.float32)
    if has_parts_bias:
      x += plgpu.load(parts_bias_ref.at[cols], mask=col_mask, other=0.0).astype(
          jnp.float32)[None, :]
    # Normalise the stream as stored (rounded to its dtype), as an unfused add would.
    total = x.astype(sum_ref.dtype)
    plgpu.store(sum_ref.at[idx], total, mask=mask)
    x = total.astype(jnp.float32)
  else:
    o_ref, = out_refs
  mean = jnp.sum(x, axis=1) / features
  centred = jnp.where(mask, x - mean[:, None], 0.0)
  var = jnp.sum(centred * centred, axis=1) / features
  y = centred * jax.lax.rsqrt(var + epsilon)[:, None] * scale[None, :] + bias[None, :]
  plgpu.store(o_ref.at[idx], y.astype(o_ref.dtype), mask=mask)


@functools.partial(jax.jit, static_argnames=["epsilon", "out_dtype", "interpret"])
def _layer_norm_pallas(x, scale, bias, parts=None, parts_bias=None, *, epsilon: float,
                       out_dtype, interpret: bool):
  """The kernel over x's rows; with `parts`, (sum, normalised sum) of `add_layer_norm`."""
  features = x.shape[-1]
  x2 = x.reshape(-1, features)
  rows = x2.shape[0]
  num_parts = 0 if parts is None else parts.shape[0]
  block_f = pl.next_power_of_2(features)
  # About four programs per SM before rows are packed together.
  block_rows = min(_MAX_BLOCK_ROWS, _MAX_BLOCK_VALUES // block_f,
                   pl.next_power_of_2(max(1, rows // (4 * triton_backend.sm_count()))))
  # One warp per 128 values (4 per thread), 1..8 warps. A decode step's 768-value rows
  # (GPT-2, one row per program) took 2.3 µs per add_layer_norm at 8 warps, 2.7 at 4, 2.3
  # at 16, 3.2 at 1 and 4.7 at 2 (H200, LOG.md "Layer norm").
  num_warps = max(1, min(8, block_rows * block_f // 128))
  kernel = functools.partial(_layer_norm_kernel, rows=rows, features=features,
                             block_rows=block_rows, block_f=block_f, epsilon=epsilon,
                             num_parts=num_parts, has_parts_bias=parts_bias is not None)
  out_shape = jax.ShapeDtypeStruct((rows, features), out_dtype)
  inputs = [x2]
  if num_parts:
    out_shape = (jax.ShapeDtypeStruct((rows, features), x.dtype), out_shape)
    inputs.append(parts.reshape(num_parts, rows, features))
    if parts_bias is not None:
      inputs.append(parts_bias)
  out = pl.pallas_call(
      kernel,
      grid=(pl.cdiv(rows, block_rows),),
      out_shape=out_shape,
      compiler_params=triton_backend.compiler_params(num_warps=num_warps, num_stages=1),
      interpret=interpret,
      name="add_layer_norm" if num_parts else "layer_norm",
  )(*inputs, scale, bias)
  return jax.tree.map(lambda y: y.reshape(x.shape), out)


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
  _check_norm_args(x, scale, bias)
  out_dtype = jnp.dtype(x.dtype if out_dtype is None else out_dtype)
  mode = triton_backend.kernel_mode(interpret, supported=_takes(x))
  if mode is None:
    return layer_norm_reference(x, scale, bias, epsilon=epsilon, out_dtype=out_dtype)
  return _layer_norm_pallas(x, scale, bias, epsilon=float(epsilon), out_dtype=out_dtype,
                            interpret=mode)


def add_layer_norm(x: jax.Array, parts: jax.Array, scale: jax.Array, bias: jax.Array, *,
                   parts_bias: jax.Array | None = None, epsilon: float = 1e-5,
                   out_dtype=None, interpret: bool | None = None
                   ) -> tuple[jax.Array, jax.Array]:
  """A residual add and the layer norm of its result, in one kernel.

  total = x + sum(parts, axis=0) + parts_bias (summed in f32, stored in x's dtype), and
  layer_norm(total). For a pre-LN transformer block: x is the residual stream and `parts`
  the split-K partial products of the projection being added (`parts_bias` its bias); the
  result is the new stream and the next sub-layer's normalised input.

  Args:
    x: [..., F], f32 / bf16 / f16.
    parts: [S, ..., F] (S >= 1), any float dtype; f32 partial sums keep their precision.
    scale, bias: [F], the layer norm's.
    parts_bias: [F] or None.
    epsilon: added to the variance.
    out_dtype: the normalised result's dtype (default x's).
    interpret: as `layer_norm`.

  Returns:
    (total [..., F] in x's dtype, layer_norm(total) [..., F] in `out_dtype`).
  """
  _check_norm_args(x, scale, bias)
  if parts.ndim != x.ndim + 1 or parts.shape[1:] != x.shape or parts.shape[0] < 1:
    dims = ", ".join(map(str, x.shape))
    raise ValueError(f"parts must have shape [S >= 1, *x.shape] = [S, {dims}], got "
                     f"{parts.shape}")
  if not jnp.issubdtype(parts.dtype, jnp.floating):
    raise ValueError(f"parts must be a floating dtype, got {parts.dtype}")
  if parts_bias is not None and parts_bias.shape != x.shape[-1:]:
    raise ValueError(f"parts_bias must have shape {x.shape[-1:]} (x's last axis), got "
                     f"{parts_bias.shape}")
  out_dtype = jnp.dtype(x.dtype if out_dtype is None else out_dtype)
  mode = triton_backend.kernel_mode(interpret, supported=_takes(x))
  if mode is None:
    return add_layer_norm_reference(x, parts, scale, bias, parts_bias=parts_bias,
                                    epsilon=epsilon, out_dtype=out_dtype)
  return _layer_norm_pallas(x, scale, bias, parts, parts_bias, epsilon=float(epsilon),
                            out_dtype=out_dtype, interpret=mode)


def _takes(x: jax.Array) -> bool:
  """Whether the kernel takes x: non-empty, rows of at most 16384 features."""
  return x.size > 0 and x.shape[-1] <= _MAX_FEATURES


def _check_norm_args(x: jax.Array, scale: jax.Array, bias: jax.Array) -> None:
  if x.ndim < 1 or x.shape[-1] < 1:
    raise ValueError(f"x must have a non-empty last (feature) axis, got shape {x.shape}")
  if scale.shape != x.shape[-1:] or bias.shape != x.shape[-1:]:
    raise ValueError(f"scale and bias must have shape {x.shape[-1:]} (x's last axis), got "
                     f"{scale.shape} and {bias.shape}")
  if not jnp.issubdtype(x.dtype, jnp.floating):
    raise ValueError(f"x must be a floating dtype, got {x.dtype}")
