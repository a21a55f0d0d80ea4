"""Where a GPT-2 decode step's GPU time goes: a per-kernel breakdown from a profiler trace.

Runs the engine's on-device decode loop (`steps` decode steps in one jitted call, as in
`jax_paged.Engine`) at a fixed batch and context under `jax.profiler`, then reads the
Perfetto trace and prints, per kernel name: launches per step, µs per step and share of
the GPU's busy time, plus the step's wall time vs the summed kernel time (the gap is time
the GPU sat idle: launch latency and host waits).

    PYTHONPATH=. python benchmarks/profile_decode_step.py [--batch 128] [--context 512]
        [--steps 32] [--top 40]
"""

from __future__ import annotations

import argparse
import collections
import glob
import gzip
import json
import os
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from benchmarks import bench_decode_step
from benchmarks.bench_decode_step import decode_chunk
from benchmarks import common
from models import gpt2


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


def main():
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--batch", type=int, default=128)
  parser.add_argument("--context", type=int, default=512)
  parser.add_argument("--steps", type=int, default=32)
  parser.add_argument("--calls", type=int, default=3, help="profiled device calls")
  parser.add_argument("--top", type=int, default=40)
  parser.add_argument("--hlo", help="also write the decode loop's optimized HLO here")
  args = parser.parse_args()

  config = gpt2.GPT2Config()
  model = gpt2.GPT2LMHeadModel(config, dtype=jnp.bfloat16, rngs=nnx.Rngs(0))
  graphdef, params = nnx.split(model)
  ps = bench_decode_step.PAGE_SIZE
  total_steps = (args.calls + 2) * args.steps
  pages_per_seq = -(-(args.context + total_steps) // ps)
  fresh_pool = lambda: bench_decode_step.filled_pool(
      model, args.batch, args.context, args.batch * pages_per_seq, pages_per_seq, seed=0)
  kv = fresh_pool()
  if args.hlo:
    with open(args.hlo, "w") as f:
      f.write(jax.jit(lambda p, kv: decode_chunk(graphdef, p, kv, args.batch, args.steps))
              .lower(params, kv).compile().as_text())
  for _ in range(2):  # compile, warm up
    out, kv = decode_chunk(graphdef, params, kv, args.batch, args.steps)
  out.block_until_ready()
  # Time and profile from `context` tokens, so the mean context is context + calls * steps / 2.
  kv = fresh_pool()
  times = []
  for _ in range(args.calls):
    start = time.perf_counter()
    out, kv = decode_chunk(graphdef, params, kv, args.batch, args.steps)
    out.block_until_ready()
    times.append((time.perf_counter() - start) / args.steps)
  wall = float(np.median(times))

  kv = fresh_pool()
  trace_dir = tempfile.mkdtemp(dir=common.out_dir())
  with jax.profiler.trace(trace_dir, create_perfetto_trace=True):
    for _ in range(args.calls):
      out, kv = decode_chunk(graphdef, params, kv, args.batch, args.steps)
    out.block_until_ready()
  events = gpu_kernel_events(trace_dir)
  steps = args.calls * args.steps
  by_name = collections.defaultdict(lambda: [0, 0.0])
  for e in events:
    by_name[e["name"]][0] += 1
    by_name[e["name"]][1] += e["dur"]
  busy = sum(d for _, d in by_name.values()) / steps
  span = (max(e["ts"] + e["dur"] for e in events) - min(e["ts"] for e in events)) / steps

  print(f"# decode step profile: batch {args.batch}, context {args.context} to "
        f"{args.context + args.calls * args.steps}, {args.steps} steps per call, "
        f"{common.header()}")
  print(f"wall per step (unprofiled, median of {args.calls} calls): {wall * 1e6:.0f} us; profiled span "
        f"per step {span:.0f} us; summed kernel time per step {busy:.0f} us; "
        f"kernels per step {len(events) / steps:.1f}")
  print("| kernel | per step | us per step | % of kernel time |")
  print("|---|---|---|---|")
  ranked = sorted(by_name.items(), key=lambda kv: -kv[1][1])
  for name, (count, dur) in ranked[:args.top]:
    print(f"| {name[:90]} | {count / steps:.1f} | {dur / steps:.1f} | "
          f"{100 * dur / steps / busy:.1f} |")


if __name__ == "__main__":
  main()
