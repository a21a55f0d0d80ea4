"""Where a decode step's GPU time goes (GPT-2 124M, any `bench_llama --shape` of every
family, the Llama-3.1-8B shape of bench_tensor_parallel, or bench_moe's Mixtral-8x7B,
Qwen3-30B-A3B, DeepSeek-V2-Lite, gpt-oss-20b, GLM-4.5-Air and Llama-4-Scout shapes; bf16
or int8 weights): a per-kernel breakdown from a profiler trace.

Runs the engine's on-device decode loop (`steps` decode steps in one jitted call, as in
`jax_paged.Engine`) at a fixed batch and context under `jax.profiler`, then reads the
Perfetto trace and prints, per kernel name: launches per step, µs per step and share of
the GPU's busy time, plus the step's wall time vs the summed kernel time (the gap is time
the GPU sat idle: launch latency and host waits). `--layer` also prints one layer's kernels
in launch order with their mean durations over the layers (its GEMMs apart, where the
by-name table sums every "linear").

    PYTHONPATH=. python benchmarks/profile_decode_step.py
        [--model gpt2 | llama-3.2-1b | falcon-7b | ... (bench_llama's shapes) |
                 llama-3.1-8b | mixtral-8x7b | qwen3-30b-a3b | deepseek-v2-lite |
                 gpt-oss-20b | glm-4.5-air | llama-4-scout]
        [--layers N] [--quantization int8] [--kv-cache-dtype auto|int8|fp8] [--batch 128]
        [--context 512] [--steps 32]
        [--top 40] [--layer]
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from benchmarks import bench_decode_step
from benchmarks import bench_llama
from benchmarks import bench_moe
from benchmarks import bench_tensor_parallel
from benchmarks.bench_decode_step import decode_chunk
from benchmarks import common
from jax_paged import cli
from jax_paged import weight_quant
from jax_paged.serving import runner as runner_lib
from models import deepseek
from models import glm4_moe
from models import gpt2
from models import gpt_oss
from models import llama
from models import llama4
from models import moe

# name: (config, model class); bench_llama's shapes (every family) by their names.
MODELS = {name: (config_cls.from_dict(fields), model_cls)
          for name, (config_cls, model_cls, fields) in bench_llama.SHAPES.items()}
MODELS.update({
    "llama-3.1-8b": (bench_tensor_parallel.LLAMA_3_1_8B, llama.LlamaForCausalLM),
    "mixtral-8x7b": (bench_moe.MIXTRAL_8X7B, moe.MoeForCausalLM),
    "qwen3-30b-a3b": (bench_moe.QWEN3_30B_A3B, moe.MoeForCausalLM),
    "deepseek-v2-lite": (bench_moe.DEEPSEEK_V2_LITE, deepseek.DeepseekForCausalLM),
    "gpt-oss-20b": (bench_moe.GPT_OSS_20B, gpt_oss.GptOssForCausalLM),
    "glm-4.5-air": (bench_moe.GLM_4_5_AIR, glm4_moe.Glm4MoeForCausalLM),
    "llama-4-scout": (bench_moe.LLAMA_4_SCOUT, llama4.Llama4ForCausalLM)})


def with_layers(config, layers: int):
  """`config` cut to its first `layers` decoder layers: its per-layer tuples (layer
  types, NoPE and chunked layers...) to their first entries, its moe_layers to those
  below."""
  n = config.num_hidden_layers
  fields = {f.name: getattr(config, f.name)[:layers] for f in dataclasses.fields(config)
            if f.name != "eos_token_id" and isinstance(getattr(config, f.name), tuple)
            and len(getattr(config, f.name)) == n}
  if getattr(config, "moe_layers", None) is not None:
    fields["moe_layers"] = tuple(i for i in config.moe_layers if i < layers)
  return dataclasses.replace(config, num_hidden_layers=layers, **fields)


def main():
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--model", choices=("gpt2", *MODELS), default="gpt2",
                      help="random bf16 weights of this shape")
  parser.add_argument("--layers", type=int,
                      help="this many decoder layers instead of the model's (a Llama or MoE "
                           "shape: the per-layer figures are the same, the init shorter)")
  parser.add_argument("--quantization", choices=("none", "int8"), default="none",
                      help="int8: the linears' weights int8 (`weight_quant.quantize_weights`)")
  parser.add_argument("--kv-cache-dtype", choices=list(cli.KV_CACHE_DTYPES), default="auto",
                      help="the pool's dtype (auto: bf16, the compute dtype)")
  parser.add_argument("--batch", type=int, default=128)
  parser.add_argument("--context", type=int, default=512)
  parser.add_argument("--steps", type=int, default=32,
                      help="steps per device call")
  parser.add_argument("--calls", type=int, default=3, help="profiled device calls")
  parser.add_argument("--top", type=int, default=40)
  parser.add_argument("--layer", action="store_true",
                      help="also print one layer's kernels in launch order")
  parser.add_argument("--hlo", help="also write the decode loop's optimized HLO here")
  args = parser.parse_args()
  bench_decode_step.check_steps_per_call(parser, "--steps", args.steps)

  if args.layers is not None and (args.model == "gpt2" or args.layers < 1):
    parser.error(f"--layers must be a positive count for a Llama or MoE shape, got "
                 f"{args.layers} for {args.model}")
  if args.model == "gpt2":
    model = gpt2.GPT2LMHeadModel(gpt2.GPT2Config(), dtype=jnp.bfloat16, rngs=nnx.Rngs(0))
  else:
    config, model_class = MODELS[args.model]
    if args.layers is not None:
      config = with_layers(config, args.layers)
    model = model_class(config, dtype=jnp.bfloat16, rngs=nnx.Rngs(0))
  if args.quantization == "int8":
    weight_quant.quantize_weights(model)
  ps = bench_decode_step.PAGE_SIZE
  total_steps = (args.calls + 2) * args.steps
  pages_per_seq = -(-(args.context + total_steps) // ps)
  fresh_pool = lambda: bench_decode_step.filled_pool(
      model, args.batch, args.context, args.batch * pages_per_seq, pages_per_seq, seed=0,
      cache_dtype=cli.KV_CACHE_DTYPES[args.kv_cache_dtype])
  kv = fresh_pool()
  loop, leaves = bench_decode_step.engine_loop(runner_lib.ModelRunner(model))
  if args.hlo:
    # The call itself, lowered (`loop.lower` in place of `loop`): wrapping it in another
    # jit would not donate the pool, and that HLO would copy it.
    with open(args.hlo, "w") as f:
      f.write(decode_chunk(loop.lower, leaves, kv, args.batch, args.steps).compile().as_text())
  for _ in range(2):  # compile, warm up
    out, kv = decode_chunk(loop, leaves, kv, args.batch, args.steps)
  out.block_until_ready()
  # Time and profile from `context` tokens, so the mean context is context + calls * steps / 2.
  kv = fresh_pool()
  times = []
  for _ in range(args.calls):
    start = time.perf_counter()
    out, kv = decode_chunk(loop, leaves, kv, args.batch, args.steps)
    out.block_until_ready()
    times.append((time.perf_counter() - start) / args.steps)
  wall = float(np.median(times))

  kv = fresh_pool()
  trace_dir = tempfile.mkdtemp(dir=common.out_dir())
  with jax.profiler.trace(trace_dir, create_perfetto_trace=True):
    for _ in range(args.calls):
      out, kv = decode_chunk(loop, leaves, kv, args.batch, args.steps)
    out.block_until_ready()
  events = common.gpu_kernel_events(trace_dir)
  steps = args.calls * args.steps
  by_name = collections.defaultdict(lambda: [0, 0.0, 0.0])
  events.sort(key=lambda e: e["ts"])
  prev_end = None
  for e in events:
    by_name[e["name"]][0] += 1
    by_name[e["name"]][1] += e["dur"]
    # Idle GPU time just before this kernel (within a call: gaps over 1 ms are the host
    # between calls and are not charged to a kernel).
    if prev_end is not None and 0 < e["ts"] - prev_end < 1000:
      by_name[e["name"]][2] += e["ts"] - prev_end
    prev_end = max(prev_end or 0, e["ts"] + e["dur"])
  busy = sum(v[1] for v in by_name.values()) / steps
  idle = sum(v[2] for v in by_name.values()) / steps
  span = (max(e["ts"] + e["dur"] for e in events) - min(e["ts"] for e in events)) / steps

  layers = "" if args.layers is None else f", {args.layers} layers"
  print(f"# {args.model} ({args.quantization} weights{layers}, {args.kv_cache_dtype} KV "
        f"cache) decode step profile: batch "
        f"{args.batch}, context {args.context} to "
        f"{args.context + args.calls * args.steps}, {args.steps} steps per call, "
        f"{common.header()}")
  print(f"wall per step (unprofiled, median of {args.calls} calls): {wall * 1e6:.0f} us; "
        f"profiled span per step {span:.0f} us; summed kernel time per step {busy:.0f} us; "
        f"kernels per step {len(events) / steps:.1f}; idle gaps between kernels per step "
        f"{idle:.0f} us")
  print("| kernel | per step | us per step | % of kernel time | idle µs before it, per step |")
  print("|---|---|---|---|---|")
  ranked = sorted(by_name.items(), key=lambda kv: -kv[1][1])
  for name, (count, dur, gap) in ranked[:args.top]:
    print(f"| {name[:90]} | {count / steps:.1f} | {dur / steps:.1f} | "
          f"{100 * dur / steps / busy:.1f} | {gap / steps:.1f} |")
  print("\nKernels with the most idle GPU time just before them (µs per step):",
        ", ".join(f"{name[:40]} {gap / steps:.1f}" for name, (_, _, gap) in
                  sorted(by_name.items(), key=lambda kv: -kv[1][2])[:8]))
  if args.layer:
    print_layer(events)


def print_layer(events: list[dict]) -> None:
  """One layer's kernels in launch order, each with its mean duration over every window of
  the trace that launched the same names (the layers; not the step's head or sampling)."""
  names = [e["name"] for e in events]
  # A layer: from the middle of the trace on, the first window of at least 4 launch names
  # that repeats three times in a row (shorter ones are runs of copies).
  found = next(((start, k) for start in range(len(names) // 2, len(names))
                for k in range(4, 256) if start + 3 * k <= len(names)
                and names[start:start + k] == names[start + k:start + 2 * k]
                == names[start + 2 * k:start + 3 * k]), None)
  if found is None:
    print("\nno repeating layer in the trace")
    return
  start, period = found
  layer = names[start:start + period]
  starts, i = [], 0
  while i + period <= len(names):
    if names[i:i + period] == layer:
      starts.append(i)
      i += period
    else:
      i += 1
  print(f"\nOne layer's {period} kernels in launch order, mean µs over {len(starts)} layers:")
  for j, name in enumerate(layer):
    print(f"{j:4d} {np.mean([events[i + j]['dur'] for i in starts]):8.1f}  {name[:80]}")


if __name__ == "__main__":
  main()
