"""Shared bits of the Pallas-Triton kernels: backend choice, compiler params, GPU size.

jax 0.11 deprecates the Pallas Triton backend and warns each time a Triton pallas_call is
lowered. Lowering happens when the enclosing `jax.jit` compiles, which may be a user's jit
long after our function returned, so a `catch_warnings` around our call cannot see it: the
filter below is process-wide but matches only that exact message.
"""

from __future__ import annotations

import contextlib
import functools
import math
import warnings

import jax
import jax.numpy as jnp
from jax.experimental.pallas import triton as plgpu

_TRITON_DEPRECATION = r"The Pallas Triton backend is deprecated"

# H100 / H200 SXM; used when the device does not report its multiprocessor count.
_DEFAULT_SM_COUNT = 132


def _silence_triton_deprecation() -> None:
  # Re-installed on every use (filterwarnings de-duplicates): `catch_warnings` blocks
  # such as pytest's restore the filter list when they exit.
  warnings.filterwarnings("ignore", message=_TRITON_DEPRECATION, category=DeprecationWarning)


def compiler_params(*, num_warps: int, num_stages: int) -> plgpu.CompilerParams:
  """Triton compiler params, with the backend's deprecation warning silenced."""
  _silence_triton_deprecation()
  with warnings.catch_warnings():
    warnings.filterwarnings("ignore", category=DeprecationWarning)
    return plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages)


def kernel_mode(interpret: bool | None, *, supported: bool = True) -> bool | None:
  """How a kernel runs: False (compile the Triton kernel), True (Pallas interpret mode) or
  None (no kernel: the caller uses its plain-XLA path).

  `interpret` is the public knob: None picks the kernel on a GPU and plain XLA elsewhere,
  so CPU users get XLA's speed, not the interpreter's. `supported` is the caller's verdict
  on the operands (shapes the kernel takes, a non-empty array): False always gives None.
  """
  if not supported:
    return None
  if interpret is None:
    interpret = False if jax.default_backend() == "gpu" else None
  if interpret is None:
    return None
  # Here too, not only in `compiler_params`: a kernel traced before (jit's cache) does not
  # call that again, and a `catch_warnings` block since (pytest's, per test) may have
  # dropped the filter before this call's lowering.
  _silence_triton_deprecation()
  return bool(interpret)


def cuda_lowering_context():
  """A context in which `.lower(lowering_platforms=("cuda",))` lowers a Triton kernel on a
  machine without a GPU. jax 0.10 falls back to compute capability 9.0 by itself; jax >=
  0.11 asks the device and, with no GPU, needs an abstract GPU device on the abstract mesh
  (an H100: 9.0 again). On a GPU this changes nothing."""
  if jax.default_backend() == "gpu":
    return contextlib.nullcontext()
  gpu = jax.sharding.AbstractDevice(device_kind="NVIDIA H100", num_cores=_DEFAULT_SM_COUNT,
                                    platform="gpu")
  mesh = jax.sharding.get_abstract_mesh()
  if mesh.empty:
    mesh = jax.sharding.AbstractMesh((1,), ("_triton_probe",))
  return jax.sharding.use_abstract_mesh(mesh.update(abstract_device=gpu))


@functools.cache
def sm_count() -> int:
  """Streaming multiprocessors on the default device (132 if it does not say)."""
  device = jax.devices()[0]
  return int(getattr(device, "core_count", 0) or _DEFAULT_SM_COUNT)


def and_masks(outer, inner, rank: int = 2):
  """outer [..] (rank - 1 dims) & inner [C] -> a mask broadcastable to rank dims."""
  if outer is None and inner is None:
    return None
  if inner is None:
    return outer[..., None]
  inner = inner.reshape((1,) * (rank - 1) + inner.shape)
  return inner if outer is None else outer[..., None] & inner


# Softmax in base 2: logits * LOG2_E, then `exp2`; a base-2 log-sum-exp * LN_2 is natural.
LOG2_E, LN_2 = math.log2(math.e), math.log(2.0)


def exp2(x: jax.Array, interpret: bool) -> jax.Array:
  """Inside a kernel: 2 ** x for f32 x as one `ex2.approx.ftz` per value (relative error
  ~2^-22; results below 2^-126 flush to 0; -inf -> 0), where jnp.exp / exp2 lower to
  libdevice's expf / exp2f, several instructions each; jnp.exp2 when interpreted."""
  if interpret:
    return jnp.exp2(x)
  return plgpu.elementwise_inline_asm(
      "ex2.approx.ftz.f32 $0, $1;", args=[x], constraints="=r,r", pack=1,
      result_shape_dtypes=[jax.ShapeDtypeStruct(x.shape, jnp.float32)])[0]
