"""GPT-2 124M decode step on the paged pool (GPU, bf16) against its bytes floor.

A decode step reads every weight once and every live K/V byte once, so its floor is
(weight bytes + live KV bytes) / read bandwidth, with the read ceiling measured in the
same run as the GPU kernel time of `jnp.sum(x, dtype=f32)` over 4 GiB of bf16: the rate
the hardware reads at (host timing charges each ~1 ms call its share of the dispatch
latency; blocks of 5 calls read ~6.5% low, benchmarks/LOG.md, "Measurement method"). All
sequences start at
`context` tokens (pages randomly permuted over the pool). The step is timed inside the
engine's device loop (`iters` steps per jitted call, how `jax_paged.Engine` decodes; each
timed call from a fresh pool at `context`, the floor at the mean context of its steps) and
as one jitted call per step (`ModelRunner.decode`, where the host's dispatch
shows), then again with a pool twice as large: nothing in the step may scale with the pool
(no copy of the donated pool), so the time must not change.

    PYTHONPATH=. python benchmarks/bench_decode_step.py [--batches 1 32 128]
        [--contexts 512 1024] [--iters 64]
"""

from __future__ import annotations

import argparse
import functools
import time
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from benchmarks import common
from jax_paged import pool as pool_lib
from jax_paged.kernels import paged_attention
from jax_paged.serving import runner as runner_lib
from models import gpt2

PAGE_SIZE = 16


def filled_pool(model: gpt2.GPT2LMHeadModel, batch: int, context: int, num_pages: int,
                max_pages_per_seq: int, seed: int, cache_dtype=None) -> pool_lib.KVPool:
  """A pool (of `cache_dtype`, None: the model's compute dtype) whose `batch` sequences
  already hold `context` tokens in random pages.

  K/V values are zeros: the step's time does not depend on them.
  """
  kv = model.spec.create_pool(num_pages=num_pages, page_size=PAGE_SIZE, max_seqs=batch,
                              max_pages_per_seq=max_pages_per_seq, dtype=cache_dtype)
  used = -(-context // PAGE_SIZE)
  perm = np.random.default_rng(seed).permutation(num_pages).astype(np.int32)
  table = np.zeros((batch, max_pages_per_seq), np.int32)
  table[:, :used] = perm[:batch * used].reshape(batch, used)
  free = perm[batch * used:]
  return kv.replace(page_table=jnp.asarray(table),
                    lengths=jnp.full((batch,), context, jnp.int32),
                    free_pages=jnp.asarray(np.concatenate([free, perm[:batch * used]])),
                    num_free=jnp.asarray(len(free), jnp.int32))


def time_decode(runner: runner_lib.ModelRunner, kv, batch: int,
                iters: int) -> tuple[float, float, pool_lib.KVPool]:
  """Seconds per decode step (back-to-back steps, one block at the end), the host's
  seconds per call (dispatch), and the pool after the steps.

  Raises if a row went inactive (no page), which would make the step cheaper than it is.
  """
  tokens = jnp.zeros((batch,), jnp.int32)
  ids = jnp.arange(batch, dtype=jnp.int32)
  for _ in range(3):  # compile and warm up
    logits, kv = runner.decode(kv, tokens, ids)
  logits.block_until_ready()
  start = time.perf_counter()
  for _ in range(iters):
    logits, kv = runner.decode(kv, tokens, ids)
  host = (time.perf_counter() - start) / iters
  logits.block_until_ready()
  seconds = (time.perf_counter() - start) / iters
  lengths = np.asarray(kv.lengths)
  if (lengths != lengths[0]).any():
    raise RuntimeError(f"some sequences did not advance: lengths {lengths}")
  return seconds, host, kv


def decode_chunk(loop: Callable, leaves, kv, batch: int, steps: int):
  """One device call of the engine's decode loop: `steps` greedy steps for every row.

  `loop` is the engine's jitted decode loop (`ModelRunner.jitted.decode_loop`), looked up
  once by the caller as `Engine` does: the lookup hashes the graphdef, ~2 ms per call
  during which the GPU would sit idle (30 µs per step at 64 steps per call, measured on an
  H200). It takes the parameters as `jax.tree.leaves(params)` and the per-row arguments
  packed with `num_steps` into one numpy array (`runner.pack_arrays`), as `Engine` passes
  them: the call's one host-to-device copy.
  """
  active, budget = np.ones((batch,), bool), np.full((batch,), 1 << 30, np.int32)
  stop_ids = np.full((batch, 1), -1, np.int32)
  # A different token per row, so rows stay distinct (a mixture of experts then routes
  # them as real traffic would, not all to the same experts).
  packed, layout = runner_lib.pack_arrays(
      num_steps=np.int32(steps), tokens=np.arange(batch, dtype=np.int32), active=active,
      index=np.zeros((batch,), np.int32), budget=budget, stop_ids=stop_ids,
      seeds=np.zeros((batch,), np.uint32), temperature=np.zeros((batch,), np.float32),
      top_k=np.zeros((batch,), np.int32), top_p=np.ones((batch,), np.float32),
      min_p=np.zeros((batch,), np.float32))
  # As `Engine` decides: no row can stop early, so the call runs unchecked.
  checked = runner_lib.needs_checks(steps, steps, active, budget, stop_ids)
  return loop(leaves, kv, packed, layout=layout, max_steps=steps, greedy=True,
              checked=checked, filter_by=None)


def engine_loop(runner: runner_lib.ModelRunner) -> tuple[Callable, list]:
  """The engine's jitted decode loop and the parameters as it takes them (`decode_chunk`'s
  first two arguments)."""
  return runner.jitted.decode_loop, runner.leaves


def check_steps_per_call(parser: argparse.ArgumentParser, flag: str, steps: int) -> None:
  """Exits through `parser` unless `steps` (a device loop call's steps) is positive."""
  if steps < 1:
    parser.error(f"{flag} must be a positive number of steps, got {steps}")


def time_device_loop(runner: runner_lib.ModelRunner,
                     make_pool: Callable[[], pool_lib.KVPool], batch: int, iters: int,
                     calls: int = 7) -> tuple[float, pool_lib.KVPool]:
  """Seconds per decode step inside the engine's device loop (`iters` steps per call):
  the median over `calls` timed calls, each from a fresh pool of `make_pool()` (the same
  contexts every call, so the calls differ only by noise), after one warm-up call; and the
  pool after the last call."""
  loop, leaves = engine_loop(runner)
  out, kv = decode_chunk(loop, leaves, make_pool(), batch, iters)  # compile + warm up
  out.block_until_ready()
  times = []
  for _ in range(calls):
    del kv  # the old pool's memory, before the next is made
    kv = jax.block_until_ready(make_pool())
    start = time.perf_counter()
    out, kv = decode_chunk(loop, leaves, kv, batch, iters)
    out.block_until_ready()
    times.append((time.perf_counter() - start) / iters)
    if (np.asarray(out) < 0).any():
      raise RuntimeError("a row went inactive (no page) in the device loop")
  return float(np.median(times)), kv


def time_attention(kv, num_layers: int, iters: int, num_heads: int | None = None) -> float:
  """Seconds per step spent in decode attention alone: the kernels' GPU time
  (`common.kernel_seconds` over `iters` calls) on layer 0 of the same pool (as the step
  calls it, `num_heads` q heads: default one per kv head), times the number of layers.
  Kernel time, like the ceiling's: a host loop of calls timed their dispatch wherever the
  kernel ran shorter (Falcon-7B's one kv head: 20 µs kernels read as 110 µs)."""
  batch = kv.max_seqs
  num_heads = kv.num_kv_heads if num_heads is None else num_heads
  q = jax.random.normal(jax.random.key(0), (batch, num_heads, kv.head_dim),
                        kv.k_pages.dtype)
  attend = jax.jit(lambda q, kv: paged_attention.paged_decode_attention(
      q, kv.k_pages, kv.v_pages, kv.page_table, kv.lengths, layer=0))
  return common.kernel_seconds(attend, q, kv, calls=iters) * num_layers


def main():
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--batches", type=int, nargs="+", default=[1, 32, 128])
  parser.add_argument("--contexts", type=int, nargs="+", default=[512, 1024])
  parser.add_argument("--iters", type=int, default=64,
                      help="steps per device call")
  parser.add_argument("--double-pool-batch", type=int, default=128,
                      help="batch at which the 2x pool is also timed")
  args = parser.parse_args()
  check_steps_per_call(parser, "--iters", args.iters)

  ceiling = common.read_ceiling_gbs(kernel=True)
  config = gpt2.GPT2Config()
  model = gpt2.GPT2LMHeadModel(config, dtype=jnp.bfloat16, rngs=nnx.Rngs(0))
  runner = runner_lib.ModelRunner(model)
  weight_bytes = sum(x.nbytes for x in runner.leaves)
  # Tokens added to a pool: a device loop call, then the one-call-per-step warm-up and
  # timed steps.
  headroom = 2 * args.iters + 3

  print(f"# GPT-2 124M decode step, bf16, page {PAGE_SIZE}: {common.header()}")
  print(f"read ceiling (jnp.sum over 4 GiB bf16, kernel time): {ceiling:.0f} GB/s; "
        f"weights {weight_bytes / 1e6:.0f} MB")
  print("| batch | context | pool pages | weights + live KV MB | floor us | step us (device "
        "loop) | x floor | new tokens/s | step us (one call per step) | host us/call | "
        "attention us (x layers) |")
  print("|---|---|---|---|---|---|---|---|---|---|---|")
  for context in args.contexts:
    for batch in args.batches:
      # Room for every timed and warm-up step's tokens.
      pages_per_seq = -(-(context + headroom) // PAGE_SIZE)
      pages = batch * pages_per_seq
      # 1x, 2x, 1x, 2x: the repeat shows the run-to-run spread next to any pool effect.
      sizes = [pages, 2 * pages] * 2 if batch == args.double_pool_batch else [pages]
      for num_pages in sizes:
        make_pool = functools.partial(filled_pool, model, batch, context, num_pages,
                                      pages_per_seq, seed=batch + context)
        # Each timed call of the device loop covers tokens context .. context + iters.
        loop_step, kv = time_device_loop(runner, make_pool, batch, args.iters)
        call_step, host, kv = time_decode(runner, kv, batch, args.iters)
        attention = time_attention(kv, config.n_layer, args.iters)
        del kv
        live = context + 0.5 * args.iters
        kv_bytes = (2 * batch * live * config.n_layer * config.n_embd
                    * jnp.dtype(jnp.bfloat16).itemsize)
        floor = (weight_bytes + kv_bytes) / (ceiling * 1e9)
        print(f"| {batch} | {context} | {num_pages} | {(weight_bytes + kv_bytes) / 1e6:.0f} | "
              f"{floor * 1e6:.0f} | {loop_step * 1e6:.0f} | {loop_step / floor:.2f} | "
              f"{batch / loop_step:,.0f} | {call_step * 1e6:.0f} | {host * 1e6:.0f} | "
              f"{attention * 1e6:.0f} |", flush=True)


if __name__ == "__main__":
  main()
