"""Serving requests as they arrive: continuous batching vs a batch at a time.

GPT-2 124M with random weights, bf16, EOS ignored. One workload: N requests, prompts of
uniform length in [32, 512] tokens, uniform [16, 256] new tokens, arriving as a Poisson
process at each rate. Three ways to serve it, each on its own engine (256 slots, pages
enough for each to hold its longest request):

* continuous: each request is submitted with `Engine.add_request` when it arrives and
  joins the running batch at the next device call (`Engine.step`), at 16 or 128 decode
  steps per call (a call's length is how long an arrival may wait to join);
* a batch at a time: the requests that arrived while the previous batch ran go to one
  `Engine.generate` (continuous within it), so an arrival waits for the running batch's
  longest request.

Per rate and way: new tokens/s from the first arrival to the last token; time to first
token from each request's arrival (mean, p50, p99); time per output token after the first
(mean over requests); latency to the last token (mean); compilations during the timed run
(and their seconds, included above). A token counts when the host has it (a device
call's tokens arrive together). Each way first serves every rate's workload untimed until
a pass compiles nothing (at most `--max-warm-up` passes): the batches that form depend on
timing, and each new shape compiles on first use; with `--warmup` each engine first runs
`Engine.warmup()`, which compiles them up front. Every run starts on an empty prefix
cache.

    PYTHONPATH=. python benchmarks/bench_serving.py          # on the GPU
    PYTHONPATH=. python benchmarks/bench_serving.py --tiny   # smoke test on CPU
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from benchmarks import common
from jax_paged import Engine, Request
from models import gpt2


@dataclasses.dataclass
class Served:
  """When each request got its first and last token (seconds from the first arrival),
  and how many tokens."""

  arrivals: np.ndarray
  first: np.ndarray
  last: np.ndarray
  tokens: np.ndarray

  def row(self, name: str) -> str:
    ttft = (self.first - self.arrivals) * 1e3
    many = self.tokens > 1
    tpot = (self.last - self.first)[many] / (self.tokens[many] - 1) * 1e3
    seconds = self.last.max() - self.arrivals.min()
    return (f"| {name} | {self.tokens.sum() / seconds:,.0f} | {ttft.mean():.1f} | "
            f"{np.median(ttft):.1f} | {np.percentile(ttft, 99):.1f} | {tpot.mean():.2f} | "
            f"{(self.last - self.arrivals).mean() * 1e3:.0f} |")


class Clock:
  """Seconds since the first arrival; records each request's tokens as they come."""

  def __init__(self, arrivals: np.ndarray):
    self.start = time.perf_counter()
    n = len(arrivals)
    self.served = Served(arrivals, np.full(n, np.nan), np.zeros(n), np.zeros(n, np.int64))

  def now(self) -> float:
    return time.perf_counter() - self.start

  def wait_until(self, t: float) -> None:
    time.sleep(max(0.0, t - self.now()))

  def took(self, k: int, t: float) -> None:
    s = self.served
    if np.isnan(s.first[k]):
      s.first[k] = t
    s.last[k] = t
    s.tokens[k] += 1


def serve_continuous(engine: Engine, requests: list[Request], arrivals: np.ndarray) -> Served:
  """Each request submitted (`add_request`) as it arrives, between steps."""
  clock = Clock(arrivals)
  index = {}  # engine request id -> workload index (ids go on across runs)
  i = 0
  while i < len(requests) or engine.has_unfinished_requests():
    now = clock.now()
    while i < len(requests) and arrivals[i] <= now:
      index[engine.add_request(requests[i])] = i
      i += 1
    if not engine.has_unfinished_requests():
      clock.wait_until(arrivals[i])
      continue
    events = engine.step()
    t = clock.now()
    for event in events:
      clock.took(index[event.request_id], t)
  return clock.served


def serve_batched(engine: Engine, requests: list[Request], arrivals: np.ndarray) -> Served:
  """The requests that arrived while the previous batch ran (at most max_batch), as one
  `generate` (streamed)."""
  clock = Clock(arrivals)
  i = 0
  while i < len(requests):
    clock.wait_until(arrivals[i])
    now = clock.now()
    j = i
    while j < len(requests) and arrivals[j] <= now and j - i < engine.max_batch:
      j += 1
    for event in engine.stream(requests[i:j]):
      clock.took(i + event.request_id, clock.now())
    i = j
  return clock.served


def workload(rng: np.random.Generator, vocab_size: int, prompt_len: tuple[int, int],
             new_len: tuple[int, int], n_req: int, rate: float
             ) -> tuple[list[Request], np.ndarray]:
  """n_req requests of uniform random tokens, prompt and new lengths uniform in the
  ranges (inclusive), arriving as a Poisson process of `rate` per second (the first at 0)."""
  requests = [Request(rng.integers(0, vocab_size, rng.integers(*prompt_len, endpoint=True)),
                      int(rng.integers(*new_len, endpoint=True)))
              for _ in range(n_req)]
  arrivals = np.cumsum(rng.exponential(1.0 / rate, n_req))
  return requests, arrivals - arrivals[0]


WAYS = {"continuous-16": (serve_continuous, 16), "continuous-128": (serve_continuous, 128),
        "batched-128": (serve_batched, 128)}
WAY_NAMES = ("continuous, 16 steps per call", "continuous, 128 steps per call",
             "a batch at a time, 128 steps per call")


def main():
  p = argparse.ArgumentParser()
  p.add_argument("--tiny", action="store_true", help="a tiny model and workload (CPU smoke)")
  p.add_argument("--rates", type=float, nargs="+", default=[100.0, 300.0, 1000.0],
                 help="request arrival rates (requests/s)")
  p.add_argument("--requests", type=int, default=512, help="requests per rate")
  p.add_argument("--max-warm-up", type=int, default=4,
                 help="the most untimed passes over every rate before the timed one")
  p.add_argument("--warmup", action="store_true",
                 help="each engine's Engine.warmup() first (its seconds reported)")
  p.add_argument("--ways", nargs="+", choices=list(WAYS), default=list(WAYS),
                 help="which ways to serve")
  args = p.parse_args()
  if args.tiny:
    config = gpt2.GPT2Config(vocab_size=256, n_positions=128, n_embd=64, n_layer=2, n_head=4)
    dtype, page, max_batch, num_pages = jnp.float32, 8, 16, 512
    prompt_len, new_len, n_req, rates = (4, 32), (2, 16), 24, [50.0, 200.0]
  else:
    config = gpt2.GPT2Config()
    dtype, page, max_batch = jnp.bfloat16, 16, 256
    prompt_len, new_len, n_req, rates = (32, 512), (16, 256), args.requests, args.rates
    # Every slot can hold the longest request: no engine waits for pages or preempts.
    num_pages = max_batch * -(-(prompt_len[1] + new_len[1]) // page)
  model = gpt2.GPT2LMHeadModel(config, dtype=dtype, rngs=nnx.Rngs(0))
  ways = {name: WAYS[key] for key, name in zip(WAYS, WAY_NAMES) if key in args.ways}
  engines = {name: Engine(model, max_batch=max_batch, num_pages=num_pages, page_size=page,
                          steps_per_call=steps)
             for name, (_, steps) in ways.items()}
  lines = [f"# bench_serving: {common.header()}", "",
           f"GPT-2 {config.n_layer}L/{config.n_embd}, {jnp.dtype(dtype).name}, {max_batch} "
           f"slots, pages of {page}; {n_req} requests, prompts of {prompt_len[0]}-"
           f"{prompt_len[1]} tokens, {new_len[0]}-{new_len[1]} new, Poisson arrivals."]

  emit = common.emitter(lines)

  rng = np.random.default_rng(0)
  workloads = [workload(rng, config.vocab_size, prompt_len, new_len, n_req, rate)
               for rate in rates]
  compiles = []
  jax.monitoring.register_event_duration_secs_listener(
      lambda event, seconds, **_: compiles.append(seconds)
      if event == "/jax/core/compile/backend_compile_duration" else None)
  rows = {rate: [] for rate in rates}

  def serve_all(serve, engine) -> list[tuple[Served, list[float]]]:
    """Every rate's workload, each run's compilations (seconds each)."""
    runs = []
    for requests, arrivals in workloads:
      engine.reset_prefix_cache()
      compiles.clear()
      served = serve(engine, requests, arrivals)
      assert (served.tokens == [r.max_new_tokens for r in requests]).all()
      runs.append((served, list(compiles)))
    return runs

  for name, (serve, _) in ways.items():
    engine = engines[name]
    if args.warmup:
      start = time.perf_counter()
      compiles.clear()
      runs = engine.warmup(max_prompt_tokens=prompt_len[1])
      emit(f"{name}: warmup() {time.perf_counter() - start:.1f} s, {runs} runs, "
           f"{len(compiles)} compilations")
    # Untimed passes until one compiles nothing (at most max_warm_up): each batch
    # composition's shapes (decode widths, prefill rows and lengths, short-chunk loops)
    # compile once, on first use.
    warm_up = 0
    for warm_up in range(1, args.max_warm_up + 1):
      if not any(c for _, c in serve_all(serve, engine)):
        break
    for rate, (served, c) in zip(rates, serve_all(serve, engine)):
      rows[rate].append(served.row(name) + f" {len(c)} ({sum(c):.1f} s) | {warm_up} |")
  for rate, (_, arrivals) in zip(rates, workloads):
    emit("", f"## {rate:g} requests/s ({arrivals[-1]:.2f} s of arrivals)", "",
         "| serving | new tokens/s | TTFT mean (ms) | p50 | p99 | per output token (ms) | "
         "latency (ms) | compilations in the run | untimed passes |",
         "|---|---|---|---|---|---|---|---|---|",
         *rows[rate])
  with open(os.path.join(common.out_dir(), "bench_serving.md"), "w") as f:
    f.write("\n".join(lines) + "\n")


if __name__ == "__main__":
  main()
