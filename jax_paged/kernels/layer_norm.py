"""Layer and RMS normalisation in one Pallas-Triton kernel, optionally fused with a
residual add.

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
launch. `rms_norm` / `add_rms_norm` are the same kernel for Llama's RMSNorm (Hugging Face's
LlamaRMSNorm: no mean, no bias; the normalised row rounded to the stream's dtype before
the weight multiplies it): XLA ran the partials' sum with the residual add, the mean of
squares and the normalisation as three kernels of ~1.4 µs each (Llama-3.1-8B shape at
batch 1 on an H200, LOG.md "twenty-ninth").

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
# Partial values a fused add reads per row at most (parts x features); more take plain
# XLA, whose elementwise sum spreads them over every SM where the kernel's one program per
# row reads them alone. H200, add_rms_norm vs XLA, µs: 4096 features x 4 parts 2.3 / 2.9 /
# 4.9 vs 3.3 / 3.7 / 6.4 at 1 / 16 / 64 rows, x 8 parts 3.7 / 4.3 / 8.5 vs 3.3 / 3.1 / 5.8
# (4-32 warps alike; LOG.md, "twenty-ninth").
_MAX_PART_VALUES = 16384


def layer_norm_reference(x: jax.Array, scale: jax.Array, bias: jax.Array, *,
                         epsilon: float, out_dtype=None) -> jax.Array:
  """Plain-XLA layer norm over the last axis (f32 statistics); see `layer_norm`."""
  out_dtype = x.dtype if out_dtype is None else out_dtype
  x32 = x.astype(jnp.float32)
  mean = jnp.mean(x32, axis=-1, keepdims=True)
  var = jnp.mean(jnp.square(x32 - mean), axis=-1, keepdims=True)
  y = (x32 - mean) * jax.lax.rsqrt(var + epsilon) * scale.astype(jnp.float32)
  return (y + bias.astype(jnp.float32)).astype(out_dtype)


def rms_norm_reference(x: jax.Array, weight: jax.Array, *, epsilon: float,
                       out_dtype=None, unit_offset: bool = False) -> jax.Array:
  """Plain-XLA RMS norm over the last axis (Hugging Face's LlamaRMSNorm, or with
  `unit_offset` GemmaRMSNorm); see `rms_norm`."""
  out_dtype = _rms_out_dtype(x, weight, out_dtype, unit_offset)
  x32 = x.astype(jnp.float32)
  y = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + epsilon)
  if unit_offset:
    return (y * (1.0 + weight.astype(jnp.float32))).astype(out_dtype)
  return (weight * y.astype(x.dtype)).astype(out_dtype)


def _rms_out_dtype(x: jax.Array, weight: jax.Array, out_dtype, unit_offset: bool):
  """The RMS norm's result dtype: `out_dtype`, or by default x's (`unit_offset`: Gemma's
  product in f32 cast back) or x's and weight's promoted (Llama's product)."""
  if out_dtype is not None:
    return jnp.dtype(out_dtype)
  return jnp.dtype(x.dtype if unit_offset else jnp.promote_types(x.dtype, weight.dtype))


def _residual_sum(x: jax.Array, parts: jax.Array, parts_bias: jax.Array | None) -> jax.Array:
  """x + sum(parts) + parts_bias, summed in f32, in x's dtype."""
  total = x.astype(jnp.float32) + jnp.sum(parts.astype(jnp.float32), axis=0)
  if parts_bias is not None:
    total += parts_bias.astype(jnp.float32)
  return total.astype(x.dtype)


def add_layer_norm_reference(x: jax.Array, parts: jax.Array, scale: jax.Array,
                             bias: jax.Array, *, parts_bias: jax.Array | None = None,
                             epsilon: float, out_dtype=None) -> tuple[jax.Array, jax.Array]:
  """Plain-XLA `add_layer_norm`."""
  total = _residual_sum(x, parts, parts_bias)
  return total, layer_norm_reference(total, scale, bias, epsilon=epsilon, out_dtype=out_dtype)


def add_rms_norm_reference(x: jax.Array, parts: jax.Array, weight: jax.Array, *,
                           parts_bias: jax.Array | None = None, epsilon: float,
                           out_dtype=None, unit_offset: bool = False,
                           parts_weight: jax.Array | None = None
                           ) -> tuple[jax.Array, jax.Array]:
  """Plain-XLA `add_rms_norm`."""
  if parts_weight is None:
    total = _residual_sum(x, parts, parts_bias)
  else:  # the parts' sum normalised (in x's dtype) before the add
    y = _residual_sum(jnp.zeros(x.shape, jnp.float32), parts, parts_bias)
    y = rms_norm_reference(y, parts_weight, epsilon=epsilon, out_dtype=x.dtype,
                           unit_offset=unit_offset)
    total = (x.astype(jnp.float32) + y.astype(jnp.float32)).astype(x.dtype)
  return total, rms_norm_reference(total, weight, epsilon=epsilon, out_dtype=out_dtype,
                                   unit_offset=unit_offset)


def _rms(x: jax.Array, weight: jax.Array, *, features: int, epsilon: float,
         unit_offset: bool, dtype) -> jax.Array:
  """Inside a kernel: f32 rows x (masked columns 0) RMS-normalised and scaled by weight
  (f32 [features]) as LlamaRMSNorm (rounded to `dtype` first) or GemmaRMSNorm
  (`unit_offset`: by 1 + weight, rounded by the caller) do."""
  y = x * jax.lax.rsqrt(jnp.sum(x * x, axis=1) / features + epsilon)[:, None]
  if unit_offset:
    return y * (1.0 + weight[None, :])
  return y.astype(dtype).astype(jnp.float32) * weight[None, :]


def _layer_norm_kernel(*refs, rows: int, features: int, block_rows: int, block_f: int,
                       epsilon: float, num_parts: int, has_parts_bias: bool, rms: bool,
                       unit_offset: bool, has_parts_weight: bool):
  """Refs: x [rows, features]; with num_parts > 0, parts [num_parts, rows, features],
  (has_parts_bias) parts_bias [features] and (has_parts_weight) parts_weight [features]
  (the parts' sum RMS-normalised by it, rounded to x's dtype, before the add); scale
  [features] (`unit_offset`: the RMS norm multiplies by 1 + scale) and (not `rms`) bias
  [features]; outputs: with num_parts > 0, the sum [rows, features]; the normalised rows
  [rows, features]."""
  x_ref, *refs = refs
  if num_parts:
    parts_ref, *refs = refs
    if has_parts_bias:
      parts_bias_ref, *refs = refs
    if has_parts_weight:
      parts_weight_ref, *refs = refs
  scale_ref, *refs = refs
  bias_ref, *out_refs = (None, *refs) if rms else refs
  r = pl.program_id(0) * block_rows + jnp.arange(block_rows)
  cols = jnp.arange(block_f)
  col_mask = cols < features
  mask = (r[:, None] < rows) & col_mask[None, :]
  idx = (r[:, None], cols[None, :])
  # Loaded first: Triton keeps loads in program order around the reductions' barriers, so
  # loaded where they are used they added a memory latency after the last barrier.
  scale = plgpu.load(scale_ref.at[cols], mask=col_mask, other=0.0).astype(jnp.float32)
  if not rms:
    bias = plgpu.load(bias_ref.at[cols], mask=col_mask, other=0.0).astype(jnp.float32)
  if num_parts and has_parts_weight:
    parts_weight = plgpu.load(parts_weight_ref.at[cols], mask=col_mask, other=0.0).astype(
        jnp.float32)
  x = plgpu.load(x_ref.at[idx], mask=mask, other=0.0).astype(jnp.float32)
  if num_parts:
    sum_ref, o_ref = out_refs
    y = jnp.zeros_like(x)
    for part in range(num_parts):  # few (split-K splits): unrolled
      y += plgpu.load(parts_ref.at[(part,) + idx], mask=mask, other=0.0).astype(jnp.float32)
    if has_parts_bias:
      y += plgpu.load(parts_bias_ref.at[cols], mask=col_mask, other=0.0).astype(
          jnp.float32)[None, :]
    if has_parts_weight:  # (Gemma's post-norms: the projection normalised, then added)
      y = _rms(y, parts_weight, features=features, epsilon=epsilon, unit_offset=unit_offset,
               dtype=x_ref.dtype).astype(x_ref.dtype).astype(jnp.float32)
    x += y
    # Normalise the stream as stored (rounded to its dtype), as an unfused add would.
    total = x.astype(sum_ref.dtype)
    plgpu.store(sum_ref.at[idx], total, mask=mask)
    x = total.astype(jnp.float32)
  else:
    o_ref, = out_refs
  if rms:  # (masked columns are 0)
    y = _rms(x, scale, features=features, epsilon=epsilon, unit_offset=unit_offset,
             dtype=x_ref.dtype)
    plgpu.store(o_ref.at[idx], y.astype(o_ref.dtype), mask=mask)
    return
  mean = jnp.sum(x, axis=1) / features
  centred = jnp.where(mask, x - mean[:, None], 0.0)
  var = jnp.sum(centred * centred, axis=1) / features
  y = centred * jax.lax.rsqrt(var + epsilon)[:, None] * scale[None, :] + bias[None, :]
  plgpu.store(o_ref.at[idx], y.astype(o_ref.dtype), mask=mask)


@functools.partial(jax.jit, static_argnames=["epsilon", "out_dtype", "interpret",
                                             "unit_offset"])
def _layer_norm_pallas(x, scale, bias, parts=None, parts_bias=None, parts_weight=None, *,
                       epsilon: float, out_dtype, interpret: bool, unit_offset: bool = False):
  """The kernel over x's rows (bias None: the RMS norm, by 1 + scale with `unit_offset`);
  with `parts`, (sum, normalised sum) of `add_layer_norm` / `add_rms_norm` (the parts'
  sum normalised by `parts_weight` first unless it is None)."""
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
                             num_parts=num_parts, has_parts_bias=parts_bias is not None,
                             rms=bias is None, unit_offset=unit_offset,
                             has_parts_weight=parts_weight is not None)
  out_shape = jax.ShapeDtypeStruct((rows, features), out_dtype)
  inputs = [x2]
  if num_parts:
    out_shape = (jax.ShapeDtypeStruct((rows, features), x.dtype), out_shape)
    inputs.append(parts.reshape(num_parts, rows, features))
    if parts_bias is not None:
      inputs.append(parts_bias)
    if parts_weight is not None:
      inputs.append(parts_weight)
  out = pl.pallas_call(
      kernel,
      grid=(pl.cdiv(rows, block_rows),),
      out_shape=out_shape,
      compiler_params=triton_backend.compiler_params(num_warps=num_warps, num_stages=1),
      interpret=interpret,
      name=("add_" if num_parts else "") + ("rms_norm" if bias is None else "layer_norm"),
  )(*inputs, scale, *(() if bias is None else (bias,)))
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
    interpret: as `layer_norm`; more than 16384 partial values per row (S x F) always take
      plain XLA, faster there.

  Returns:
    (total [..., F] in x's dtype, layer_norm(total) [..., F] in `out_dtype`).
  """
  _check_norm_args(x, scale, bias)
  _check_parts(x, parts, parts_bias)
  out_dtype = jnp.dtype(x.dtype if out_dtype is None else out_dtype)
  mode = triton_backend.kernel_mode(interpret, supported=_takes(x, parts))
  if mode is None:
    return add_layer_norm_reference(x, parts, scale, bias, parts_bias=parts_bias,
                                    epsilon=epsilon, out_dtype=out_dtype)
  return _layer_norm_pallas(x, scale, bias, parts, parts_bias, epsilon=float(epsilon),
                            out_dtype=out_dtype, interpret=mode)


def rms_norm(x: jax.Array, weight: jax.Array, *, epsilon: float = 1e-6, out_dtype=None,
             interpret: bool | None = None, unit_offset: bool = False) -> jax.Array:
  """RMS norm over the last axis, as Hugging Face's LlamaRMSNorm: weight * (x /
  sqrt(mean(x^2) + epsilon)), the normalised x rounded to x's dtype before the product;
  with `unit_offset` as GemmaRMSNorm: (1 + weight) times the normalised x in f32, rounded
  once.

  Args:
    x: [..., F], f32 / bf16 / f16.
    weight: [F].
    epsilon: added to the mean square.
    out_dtype: the result's dtype (default: x's and weight's promoted, as the product's;
      with `unit_offset` x's).
    interpret: as `layer_norm`.
    unit_offset: Gemma's norm (its weights are centred on 0).

  Returns:
    [..., F] in `out_dtype`; the statistics in f32.
  """
  _check_norm_args(x, weight)
  out_dtype = _rms_out_dtype(x, weight, out_dtype, unit_offset)
  mode = triton_backend.kernel_mode(interpret, supported=_takes(x))
  if mode is None:
    return rms_norm_reference(x, weight, epsilon=epsilon, out_dtype=out_dtype,
                              unit_offset=unit_offset)
  return _layer_norm_pallas(x, weight, None, epsilon=float(epsilon), out_dtype=out_dtype,
                            interpret=mode, unit_offset=unit_offset)


def add_rms_norm(x: jax.Array, parts: jax.Array, weight: jax.Array, *,
                 parts_bias: jax.Array | None = None, epsilon: float = 1e-6,
                 out_dtype=None, interpret: bool | None = None, unit_offset: bool = False,
                 parts_weight: jax.Array | None = None) -> tuple[jax.Array, jax.Array]:
  """`add_layer_norm` with the RMS norm (`rms_norm`): vLLM's fused_add_rms_norm, with the
  split-K partials of the projection being added summed in the same kernel.

  Args:
    x, parts, parts_bias: as `add_layer_norm`'s.
    weight, epsilon, out_dtype, unit_offset: as `rms_norm`'s.
    interpret: as `add_layer_norm`.
    parts_weight: None, or [F]: the sum of the parts (and parts_bias) is first
      RMS-normalised by it (as by `weight`, rounded to x's dtype), then added to x:
      Gemma's post-norm of a projection before its residual add.

  Returns:
    (total [..., F] in x's dtype, rms_norm(total) [..., F] in `out_dtype`).
  """
  _check_norm_args(x, weight)
  _check_parts(x, parts, parts_bias)
  if parts_weight is not None:
    _check_norm_args(x, parts_weight, what="parts_weight")
  out_dtype = _rms_out_dtype(x, weight, out_dtype, unit_offset)
  mode = triton_backend.kernel_mode(interpret, supported=_takes(x, parts))
  if mode is None:
    return add_rms_norm_reference(x, parts, weight, parts_bias=parts_bias, epsilon=epsilon,
                                  out_dtype=out_dtype, unit_offset=unit_offset,
                                  parts_weight=parts_weight)
  return _layer_norm_pallas(x, weight, None, parts, parts_bias, parts_weight,
                            epsilon=float(epsilon), out_dtype=out_dtype, interpret=mode,
                            unit_offset=unit_offset)


def _takes(x: jax.Array, parts: jax.Array | None = None) -> bool:
  """Whether the kernel takes x (and parts): non-empty, rows of at most 16384 features
  (and 16384 partial values)."""
  return x.size > 0 and x.shape[-1] <= _MAX_FEATURES and (
      parts is None or parts.shape[0] * x.shape[-1] <= _MAX_PART_VALUES)


def _check_norm_args(x: jax.Array, scale: jax.Array, bias: jax.Array | None = None, *,
                     what: str = "weight") -> None:
  """Raises ValueError naming a bad argument (bias None: an RMS norm's `what`, which has
  no bias)."""
  if x.ndim < 1 or x.shape[-1] < 1:
    raise ValueError(f"x must have a non-empty last (feature) axis, got shape {x.shape}")
  if bias is None and scale.shape != x.shape[-1:]:
    raise ValueError(f"{what} must have shape {x.shape[-1:]} (x's last axis), got "
                     f"{scale.shape}")
  if bias is not None and (scale.shape != x.shape[-1:] or bias.shape != x.shape[-1:]):
    raise ValueError(f"scale and bias must have shape {x.shape[-1:]} (x's last axis), got "
                     f"{scale.shape} and {bias.shape}")
  if not jnp.issubdtype(x.dtype, jnp.floating):
    raise ValueError(f"x must be a floating dtype, got {x.dtype}")


def _check_parts(x: jax.Array, parts: jax.Array, parts_bias: jax.Array | None) -> None:
  if parts.ndim != x.ndim + 1 or parts.shape[1:] != x.shape or parts.shape[0] < 1:
    dims = ", ".join(map(str, x.shape))
    raise ValueError(f"parts must have shape [S >= 1, *x.shape] = [S, {dims}], got "
                     f"{parts.shape}")
  if not jnp.issubdtype(parts.dtype, jnp.floating):
    raise ValueError(f"parts must be a floating dtype, got {parts.dtype}")
  if parts_bias is not None and parts_bias.shape != x.shape[-1:]:
    raise ValueError(f"parts_bias must have shape {x.shape[-1:]} (x's last axis), got "
                     f"{parts_bias.shape}")
