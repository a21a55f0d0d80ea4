"""Timing helpers shared by the GPU benchmarks (run with the device tool)."""

from __future__ import annotations

import datetime
import os
import statistics
import time

import jax
import jax.numpy as jnp


def time_fn(fn, *args, calls: int = 50, reps: int = 15) -> float:
  """Median seconds per call: `calls` back-to-back dispatches, one block, `reps` times."""
  jax.block_until_ready(fn(*args))  # compile + warm up
  times = []
  for _ in range(reps):
    start = time.perf_counter()
    for _ in range(calls):
      out = fn(*args)
    jax.block_until_ready(out)
    times.append((time.perf_counter() - start) / calls)
  return statistics.median(times)


def read_ceiling_gbs() -> float:
  """HBM read ceiling: jnp.sum(x, dtype=f32) over a 4 GiB bf16 array, in GB/s."""
  x = jax.random.normal(jax.random.key(0), (1 << 31,), jnp.bfloat16)
  seconds = time_fn(jax.jit(lambda x: jnp.sum(x, dtype=jnp.float32)), x, calls=5, reps=10)
  del x
  return (1 << 32) / seconds / 1e9


def header() -> str:
  dev = jax.devices()[0]
  return (f"{datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC, "
          f"{dev.device_kind}, jax {jax.__version__}")


def out_dir() -> str:
  return os.environ.get("OUT", ".")
