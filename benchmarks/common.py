"""Timing helpers shared by the GPU benchmarks (run with the device tool)."""

from __future__ import annotations

import datetime
import glob
import gzip
import json
import os
import shutil
import statistics
import tempfile
import time
from typing import Callable

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


def time_in_jit(fn, arg_sets, shared=(), *, calls: int = 3, reps: int = 15) -> float:
  """Median seconds per `fn` call, with the calls issued back to back from one program.

  One jitted program calls `fn(*args, *shared)` once for each tuple `args` of `arg_sets`
  (distinct inputs, so XLA cannot merge the calls), so a kernel of tens of µs is timed as
  it runs inside a model's jitted step, without a Python dispatch per call. `shared`
  arguments (a large K/V pool) are passed once: every argument costs the host dispatch
  time, and a dispatch slower than the program would be timed instead of the GPU. The
  program is dispatched `calls` times per block (the host enqueues the next while the GPU
  runs one), `reps` blocks.
  """
  many = jax.jit(lambda sets, shared: [fn(*args, *shared) for args in sets])
  return time_fn(many, list(arg_sets), tuple(shared), calls=calls, reps=reps) / len(arg_sets)


def gpu_kernel_events(trace_dir: str) -> list[dict]:
  """Complete ('X') events on the GPU's CUDA stream threads ("Stream #N...") of the
  Perfetto trace in `trace_dir` (not its "XLA Modules" / "XLA Ops" summary threads)."""
  path, = glob.glob(os.path.join(trace_dir, "**", "perfetto_trace.json.gz"), recursive=True)
  with gzip.open(path) as f:
    trace = json.load(f)
  events = trace["traceEvents"] if isinstance(trace, dict) else trace
  processes, threads = {}, {}
  for e in events:
    if e.get("ph") == "M" and e.get("name") == "process_name":
      processes[e["pid"]] = e["args"]["name"]
    if e.get("ph") == "M" and e.get("name") == "thread_name":
      threads[e["pid"], e["tid"]] = e["args"]["name"]
  streams = {key for key, name in threads.items()
             if "GPU" in processes.get(key[0], "") and name.startswith("Stream")}
  if not streams:
    raise RuntimeError(f"no GPU stream in the trace: processes {sorted(processes.values())}, "
                       f"threads {sorted(set(threads.values()))[:20]}")
  return [e for e in events if e.get("ph") == "X" and (e.get("pid"), e.get("tid")) in streams
          and e.get("dur", 0) > 0]


def kernel_seconds(fn, *args, calls: int = 20) -> float:
  """GPU kernel time per `fn` call: the summed durations of its kernels in a profiler
  trace of `calls` calls (the device's own timestamps, like CUDA events around each
  kernel; launch gaps and host dispatch excluded), divided by `calls`."""
  jax.block_until_ready(fn(*args))
  trace_dir = tempfile.mkdtemp(dir=out_dir())
  with jax.profiler.trace(trace_dir, create_perfetto_trace=True):
    for _ in range(calls):
      out = fn(*args)
    jax.block_until_ready(out)
  events = gpu_kernel_events(trace_dir)
  shutil.rmtree(trace_dir, ignore_errors=True)
  return sum(e["dur"] for e in events) * 1e-6 / calls


def read_ceiling_gbs(kernel: bool = False) -> float:
  """HBM read ceiling: jnp.sum(x, dtype=f32) over a 4 GiB bf16 array, in GB/s; timed by
  the host around back-to-back calls, or with `kernel` by its GPU kernel time (the
  hardware's read rate: 4598-4677 GB/s on the H200s measured).

  Host timing spreads a block's start and end latency (~0.3 ms) over its calls: blocks of
  64 calls (~60 ms, as long as a decode-loop call). Blocks of 5 measured 4294 GB/s on the
  same H200 where the trace showed the sums running back to back at 4580
  (benchmarks/LOG.md, "Measurement method")."""
  x = jax.random.normal(jax.random.key(0), (1 << 31,), jnp.bfloat16)
  total = jax.jit(lambda x: jnp.sum(x, dtype=jnp.float32))
  seconds = (kernel_seconds(total, x, calls=10) if kernel
             else time_fn(total, x, calls=64, reps=5))
  del x
  return (1 << 32) / seconds / 1e9


def matched_prefix(a, b) -> list[int]:
  """Per pair of token sequences (a[i], b[i]): how many leading tokens they share, i.e.
  where they first differ (the shorter one's length if one starts the other)."""
  return [next((i for i, (x, y) in enumerate(zip(p, q)) if x != y), min(len(p), len(q)))
          for p, q in zip(a, b)]


def header() -> str:
  dev = jax.devices()[0]
  return (f"{datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC, "
          f"{dev.device_kind}, jax {jax.__version__}")


def out_dir() -> str:
  return os.environ.get("OUT", ".")


def emitter(lines: list[str]) -> Callable[..., None]:
  """emit(*new_lines): appends each line to `lines` (the markdown a benchmark writes at its
  end) and prints it at once."""
  def emit(*new_lines: str) -> None:
    for line in new_lines:
      lines.append(line)
      print(line, flush=True)
  return emit
