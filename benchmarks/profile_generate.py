"""Where an engine run's wall time goes: GPU kernels vs the GPU idling on the host.

Runs `bench_generate`'s fixed workload (GPT-2 124M, random bf16 weights, batch 128, prompt
256, 256 new tokens, greedy) through `jax_paged.Engine` a few times, then once under
`jax.profiler`, and prints the run's wall time, the GPU's span and summed kernel time, the
idle gaps longer than 200 µs (host work between device calls: the scheduler planning the
next call, results read back) with the kernel each one precedes, and the kernels by total
time. Two trees' engines compare by running this from each tree's root.

    PYTHONPATH=. python benchmarks/profile_generate.py [--steps-per-call 128]
        [--no-prefix-caching] [--cache-dtype int8]
"""

from __future__ import annotations

import argparse
import collections
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from benchmarks import common
from jax_paged import Engine, Request
from models import gpt2


def main():
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--batch", type=int, default=128)
  parser.add_argument("--prompt", type=int, default=256)
  parser.add_argument("--new", type=int, default=256)
  parser.add_argument("--steps-per-call", type=int, default=128)
  parser.add_argument("--no-prefix-caching", action="store_true")
  parser.add_argument("--cache-dtype", help="the KV cache dtype (default: the model's, bf16)")
  parser.add_argument("--top", type=int, default=25)
  args = parser.parse_args()

  config = gpt2.GPT2Config()
  model = gpt2.GPT2LMHeadModel(config, dtype=jnp.bfloat16, rngs=nnx.Rngs(0))
  rng = np.random.default_rng(0)
  prompts = [rng.integers(0, config.vocab_size, args.prompt).tolist()
             for _ in range(args.batch)]
  page_size = 16
  # Defaults passed only when asked against: engines from before prefix caching (a
  # tree compared against) have no such argument.
  engine_kw = dict(prefix_caching=False) if args.no_prefix_caching else {}
  if args.cache_dtype:
    engine_kw["cache_dtype"] = jnp.dtype(args.cache_dtype)
  eng = Engine(model, max_batch=args.batch,
               num_pages=args.batch * -(-(args.prompt + args.new) // page_size),
               page_size=page_size, steps_per_call=args.steps_per_call, **engine_kw)
  run = lambda: eng.generate([Request(p, args.new) for p in prompts])
  walls = []
  for _ in range(4):  # the first compiles
    eng.reset_prefix_cache()  # else the last run's pages serve every prompt
    start = time.perf_counter()
    run()
    walls.append(time.perf_counter() - start)
  trace_dir = tempfile.mkdtemp(dir=common.out_dir())
  eng.reset_prefix_cache()
  with jax.profiler.trace(trace_dir, create_perfetto_trace=True):
    start = time.perf_counter()
    run()
    wall = time.perf_counter() - start
  events = sorted(common.gpu_kernel_events(trace_dir), key=lambda e: e["ts"])
  busy = sum(e["dur"] for e in events)
  span = events[-1]["ts"] + events[-1]["dur"] - events[0]["ts"]
  gaps = [(b["ts"] - (a["ts"] + a["dur"]), b["name"]) for a, b in zip(events, events[1:])]
  long_gaps = sorted((g for g in gaps if g[0] > 200), reverse=True)
  print(f"# profile_generate: {common.header()}; batch {args.batch}, prompt {args.prompt}, "
        f"{args.new} new, {args.steps_per_call} steps per call, prefix caching "
        f"{'off' if args.no_prefix_caching else 'on'}, {eng.cache_dtype.name} cache")
  print("unprofiled walls (ms):", [round(w * 1e3, 1) for w in walls])
  print(f"profiled wall {wall * 1e3:.1f} ms; GPU span {span / 1e3:.1f} ms; kernels "
        f"{busy / 1e3:.1f} ms ({len(events)}); gaps > 200 µs: "
        f"{sum(g for g, _ in long_gaps) / 1e3:.1f} ms")
  print("longest gaps (µs, the kernel after):",
        [(round(g), name[:40]) for g, name in long_gaps[:12]])
  total, count = collections.Counter(), collections.Counter()
  for e in events:
    total[e["name"][:60]] += e["dur"]
    count[e["name"][:60]] += 1
  for name, us in total.most_common(args.top):
    print(f"{us / 1e3:8.2f} ms {count[name]:6d}x {name}")


if __name__ == "__main__":
  main()
