"""Shared pages at work: prefix caching, parallel sampling and chunked prefill.

GPT-2 124M with random weights, bf16, EOS ignored; compilation excluded: workloads 1-2
report the median (by time) of three identical runs after an untimed one, workload 3 one
run after two untimed ones. Three workloads, each run both ways in the same process:

1. shared system prompt: 256 requests = one 768-token system prompt + a unique 64-token
   suffix, 128 new tokens each (greedy); prefix caching on vs off. Mean time to first
   token, throughput, peak pages in use; tokens compared.
2. parallel sampling: 64 prompts of 512 tokens, n = 8 samples each, 128 new tokens
   (temperature 1); `Request(n=8)` (the samples share the prompt's pages) vs 512 separate
   requests seeded as the samples are (`sample_seed`) with prefix caching off. Peak pages
   and throughput; tokens compared.
3. chunked prefill: 64 requests (64-token prompts, 900 new tokens) decoding when 16
   prompts of 1000 tokens arrive (0.1 s in); the worst and median per-token gap of the 64
   running requests (a device call's tokens arrive together: each token of a call counts
   the time since the request's previous call over that call's tokens), with the prefill split into
   calls of 1024 or 512 tokens vs one call for everything (`max_prefill_tokens`).

    PYTHONPATH=. python benchmarks/bench_prefix.py          # on the GPU
    PYTHONPATH=. python benchmarks/bench_prefix.py --tiny   # smoke test on CPU
"""

from __future__ import annotations

import argparse
import collections
import os
import time

import jax.numpy as jnp
import numpy as np
from flax import nnx

from benchmarks import bench_generate
from benchmarks import common
from jax_paged import Engine, Request
from jax_paged.kernels import kv_quant
from jax_paged.serving.request import sample_seed
from models import gpt2


def timed_generate(engine: Engine, requests: list[Request], runs: int = 3,
                   warm_up: list[Request] | None = None):
  """(outputs, report, seconds) of the median (by time) of `runs` identical runs after an
  untimed one (`bench_generate.timed`): a run of workload 1 takes ~0.3 s, and its mean
  TTFT (~30 ms) varies by ~20% from run to run. Each run starts on an empty prefix cache,
  or on what an untimed run of `warm_up` cached."""
  def before():
    engine.reset_prefix_cache()  # the last run's pages would serve every prompt
    if warm_up:
      engine.generate(warm_up)

  (outputs, report), seconds = bench_generate.timed(lambda: engine.generate(requests),
                                                    before=before, runs=runs)
  return outputs, report, seconds


def agreement(a: list[list[int]], b: list[list[int]]) -> str:
  """'identical', or how many of the requests' tokens match and at which new token the
  others first differ. In bf16 the same K/V computed in calls of other shapes (a prompt
  whole, or its suffix over cached pages) rounds differently, and the random-weight model's
  near-tied greedy choices can flip (the f32 tests assert identical tokens)."""
  if a == b:
    return "identical"
  first = [m for m, p, q in zip(common.matched_prefix(a, b), a, b) if p != q]
  return (f"{len(a) - len(first)} of {len(a)} requests identical, the others first differ at "
          f"new token {min(first)} (median {int(np.median(first))})")


def token_gaps(events: list[tuple[float, int]]) -> np.ndarray:
  """Per-token gaps of one request from its (time, count) per device call: each token of a
  call counts (its time - the previous call's) / its count; the first call has none."""
  gaps = []
  for (t0, *_), (t1, n, *_) in zip(events, events[1:]):
    gaps += [(t1 - t0) / n] * n
  return np.asarray(gaps)


def main():
  p = argparse.ArgumentParser()
  p.add_argument("--tiny", action="store_true", help="a tiny model and workload (CPU smoke)")
  p.add_argument("--workloads", type=int, nargs="+", default=[1, 2, 3],
                 help="which of the three workloads to run")
  p.add_argument("--cache-dtype", default="auto", choices=["auto", "int8", "float8_e4m3fn"],
                 help="every engine's KV cache dtype (`Engine(cache_dtype=...)`; auto: the "
                 "model's dtype)")
  args = p.parse_args()
  if args.tiny:
    config = gpt2.GPT2Config(vocab_size=256, n_positions=256, n_embd=64, n_layer=2, n_head=4)
    dtype, page = jnp.float32, 8
    system_len, suffix_len, n_req, new1 = 48, 8, 16, 8
    n_prompts, prompt2, samples, new2 = 4, 32, 4, 8
    n_run, run_prompt, run_new, n_long, long_len, chunk, arrive = 8, 8, 60, 2, 120, 64, 0.3
  else:
    config = gpt2.GPT2Config()
    dtype, page = jnp.bfloat16, 16
    system_len, suffix_len, n_req, new1 = 768, 64, 256, 128
    n_prompts, prompt2, samples, new2 = 64, 512, 8, 128
    n_run, run_prompt, run_new, n_long, long_len, chunk, arrive = 64, 64, 900, 16, 1000, 1024, 0.1
  model = gpt2.GPT2LMHeadModel(config, dtype=dtype, rngs=nnx.Rngs(0))
  rng = np.random.default_rng(0)
  vocab = config.vocab_size
  cache_dtype = jnp.dtype(dtype if args.cache_dtype == "auto" else args.cache_dtype)
  lines = [f"# bench_prefix: {common.header()}", "",
           f"GPT-2 {config.n_layer}L/{config.n_embd}, {jnp.dtype(dtype).name}, pages of {page}, "
           f"{cache_dtype.name} KV cache."]

  emit = common.emitter(lines)

  # 1. A shared system prompt.
  if 1 in args.workloads:
    shared_system_prompt(model, cache_dtype, rng, emit, vocab, page, system_len, suffix_len,
                         n_req, new1)
  if 2 in args.workloads:
    parallel_sampling(model, cache_dtype, rng, emit, vocab, page, n_prompts, prompt2, samples,
                      new2)
  if 3 in args.workloads:
    chunked_prefill(model, cache_dtype, rng, emit, vocab, page, n_run, run_prompt, run_new,
                    n_long, long_len, chunk, arrive)
  with open(os.path.join(common.out_dir(), "bench_prefix.md"), "w") as f:
    f.write("\n".join(lines) + "\n")


def pool_pages(model, cache_dtype, page: int, needed: int) -> int:
  """`needed` pages, or for a 1-byte cache whose page arrays would fall in the window the
  kernels cannot address (`kv_quant.kernel_addressable`) the fewest past it."""
  spec = model.spec
  return kv_quant.min_addressable_pages(
      spec.num_layers * spec.num_kv_heads * page * spec.head_dim, cache_dtype, needed)


def shared_system_prompt(model, cache_dtype, rng, emit, vocab, page, system_len, suffix_len,
                         n_req, new1):
  system = rng.integers(0, vocab, system_len).tolist()
  requests = [Request(system + rng.integers(0, vocab, suffix_len).tolist(), new1)
              for _ in range(n_req)]
  pages = pool_pages(model, cache_dtype, page, n_req * -(-(system_len + suffix_len + new1) // page))
  emit("", f"## 1. Shared system prompt: {n_req} requests of {system_len} shared + "
       f"{suffix_len} unique tokens, {new1} new (greedy)", "",
       "| prefix caching | mean TTFT (ms) | new tokens/s | peak pages | prompt tokens from "
       "cache | time (s) |", "|---|---|---|---|---|---|")
  results = {}
  # Off; on, from an empty cache; on, the system prompt cached by an earlier run (the
  # cache outlives a run: a server's steady state).
  variants = {"off": (False, None), "on": (True, None),
              "on, system prompt cached by an earlier run": (True, [Request(system, 1)])}
  for name, (caching, warm_up) in variants.items():
    eng = Engine(model, cache_dtype=cache_dtype, max_batch=n_req, num_pages=pages,
                 page_size=page,
                 prefix_caching=caching)
    outs, r, sec = timed_generate(eng, requests, warm_up=warm_up)
    results[name] = (outs, r, sec)
    emit(f"| {name} | {1e3 * np.mean(r.ttft_s):.1f} | {r.generated_tokens / sec:,.0f} | "
         f"{r.peak_pages_in_use} | {r.prefix_hit_rate:.1%} | {sec:.2f} |")
  (o0, r0, s0), (o1, r1, s1), (o2, r2, _) = results.values()
  emit("", f"On / off: TTFT **{np.mean(r0.ttft_s) / np.mean(r1.ttft_s):.2f}x** lower "
       f"(target >= 5x), throughput **{s0 / s1:.2f}x** (target >= 1.5x), peak pages "
       f"**{r1.peak_pages_in_use / r0.peak_pages_in_use:.3f}** of off (target <= 1/3); "
       f"tokens vs off: {agreement(o0, o1)}. With the system prompt already cached: TTFT "
       f"**{np.mean(r0.ttft_s) / np.mean(r2.ttft_s):.2f}x** lower than off; tokens vs "
       f"off: {agreement(o0, o2)}; vs on: {agreement(o1, o2)}.", "", "```", str(r1), "```")



def parallel_sampling(model, cache_dtype, rng, emit, vocab, page, n_prompts, prompt2, samples,
                      new2):
  prompts = [rng.integers(0, vocab, prompt2).tolist() for _ in range(n_prompts)]
  batch = n_prompts * samples
  pages = pool_pages(model, cache_dtype, page, batch * -(-(prompt2 + new2) // page))
  emit("", f"## 2. Parallel sampling: {n_prompts} prompts of {prompt2} tokens, n = {samples}, "
       f"{new2} new (temperature 1)", "",
       "| run | new tokens/s | peak pages | time (s) |", "|---|---|---|---|")
  shared = Engine(model, cache_dtype=cache_dtype, max_batch=batch, num_pages=pages,
                  page_size=page)
  outs_n, rn, sn = timed_generate(shared, [Request(p, new2, temperature=1.0, seed=i,
                                                   n=samples)
                                           for i, p in enumerate(prompts)])
  emit(f"| Request(n={samples}): shared pages | {rn.generated_tokens / sn:,.0f} | "
       f"{rn.peak_pages_in_use} | {sn:.2f} |")
  alone = Engine(model, cache_dtype=cache_dtype, max_batch=batch, num_pages=pages,
                 page_size=page,
                 prefix_caching=False)
  outs_1, r1, s1 = timed_generate(alone, [
      Request(p, new2, temperature=1.0, seed=sample_seed(i, j))
      for i, p in enumerate(prompts) for j in range(samples)])
  emit(f"| {batch} separate requests, no sharing | {r1.generated_tokens / s1:,.0f} | "
       f"{r1.peak_pages_in_use} | {s1:.2f} |")
  same = agreement([o for group in outs_n for o in group], outs_1)
  emit("", f"Shared / separate: peak pages **{rn.peak_pages_in_use / r1.peak_pages_in_use:.3f}"
       f"** (target <= 1/4), throughput **{s1 / sn:.2f}x** (target >= 1.3x); tokens: "
       f"{same}.", "", "```", str(rn), "```")



def chunked_prefill(model, cache_dtype, rng, emit, vocab, page, n_run, run_prompt, run_new,
                    n_long,
                    long_len, chunk, arrive):
  running = [Request(rng.integers(0, vocab, run_prompt).tolist(), run_new)
             for _ in range(n_run)]
  arriving = [Request(rng.integers(0, vocab, long_len).tolist(), 8, arrival_s=arrive)
              for _ in range(n_long)]
  pages = pool_pages(model, cache_dtype, page, n_run * -(-(run_prompt + run_new) // page)
                     + n_long * -(-(long_len + 8) // page))
  emit("", f"## 3. Chunked prefill: {n_run} requests decoding ({run_prompt}-token prompts, "
       f"{run_new} new) when {n_long} prompts of {long_len} tokens arrive at {arrive} s", "",
       "| max_prefill_tokens | worst gap (ms) | median gap (ms) | worst / median | p99 / median "
       "| arrivals' mean TTFT (ms) |", "|---|---|---|---|---|---|")
  ratios = {}
  for max_prefill in (n_long * long_len * 2, chunk, chunk // 2):
    eng = Engine(model, cache_dtype=cache_dtype, max_batch=n_run + n_long, num_pages=pages,
                 page_size=page,
                 max_prefill_tokens=max_prefill)
    bursts = collections.defaultdict(list)
    first = {}
    calls = [0]
    execute = eng.runner.execute

    def counted(kv, plan):  # a device call's tokens share its number
      calls[0] += 1
      return execute(kv, plan)

    eng.runner.execute = counted

    def on_token(event):
      now = time.perf_counter()
      first.setdefault(event.request_id, now)
      if event.request_id < n_run:
        b = bursts[event.request_id]
        if b and b[-1][2] == calls[0]:
          b[-1] = (b[-1][0], b[-1][1] + 1, calls[0])
        else:
          b.append((now, 1, calls[0]))

    def run():
      eng.reset_prefix_cache()
      bursts.clear()
      first.clear()
      return time.perf_counter(), eng.generate(running + arriving, on_token=on_token)

    # Two untimed runs: the first one's compilations delay its calls against the arrival
    # time, so it plans differently, and the second may still compile shapes of its own.
    run()
    run()
    t0, _ = run()
    ttft = [first[n_run + i] - t0 - arrive for i in range(n_long)]
    gaps = np.concatenate([token_gaps(b) for b in bursts.values()])
    worst, median, p99 = gaps.max(), np.median(gaps), np.percentile(gaps, 99)
    ratios[max_prefill] = worst / median
    emit(f"| {max_prefill} | {1e3 * worst:.2f} | {1e3 * median:.3f} | {worst / median:.2f} | "
         f"{p99 / median:.2f} | {1e3 * np.mean(ttft):.1f} |")
  emit("", f"Chunked: worst gap **{ratios[chunk]:.2f}x** the median at {chunk} tokens per "
       f"call, **{ratios[chunk // 2]:.2f}x** at {chunk // 2} (target <= 3x).")


if __name__ == "__main__":
  main()
