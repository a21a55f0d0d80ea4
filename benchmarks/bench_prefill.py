"""Paged prefill attention on the GPU: ours vs the XLA reference vs cuDNN dense attention.

Usage (device machine): PYTHONPATH=. python benchmarks/bench_prefill.py [--sweep]
    [--shapes a,b] [--sweep-seconds S]
    [--cache-dtypes int8,float8_e4m3fn] [--sweep-dtypes bfloat16,int8] [--alibi]
Prints a markdown table and writes prefill.json to $OUT (or the current directory).
`--alibi` adds our kernel's time with ALiBi's biases (BLOOM's slopes, `nn.alibi_slopes`)
over its time without, same shape, same run.

Each shape is B rows of T new query tokens after `prefix` cached tokens, all K/V in random
permuted pages of 16 tokens (bf16; and the same pages quantized to each of
`--cache-dtypes`, int8 and float8_e4m3fn by default, timed beside them). TFLOP/s count only
the work a causal kernel must do: 4 * H * D per (query, visible key) pair. Times are the
GPU kernels' own durations from a profiler trace (`common.kernel_seconds`), and for ours
also the wall time of calls issued back to back from one jitted program
(`common.time_in_jit`, distinct q's sharing the pool).
`--sweep` times our kernel's knobs by GPU kernel time on every shape (until
`--sweep-seconds` run out); `paged_prefill.default_config` was chosen from it.

cuDNN (`jax.nn.dot_product_attention(implementation="cudnn")`, contiguous K/V of the same
tokens) is a speed baseline. Its causal mask is top-left aligned, so after a prefix it
cannot compute this chunk's causal attention; two forms are timed: the whole prompt's
causal attention (S = prefix + T queries: what a server without a prefix cache computes)
and the chunk's T queries against all S keys unmasked (about our work, no causal skip).
With no prefix the first is exactly our computation.
"""

from __future__ import annotations

import argparse
import functools
import itertools
import json
import os
import time

import jax
import jax.numpy as jnp

from benchmarks import common
import jax_paged
from jax_paged import reference
from jax_paged.kernels import kv_quant
from jax_paged.kernels import paged_prefill

# name: (B, T, prefix, H, Hkv, D, page_size)
SHAPES = {
    "gpt2-b256-t64-p768": (256, 64, 768, 12, 12, 64, 16),
    "gpt2-b16-t256-p0": (16, 256, 0, 12, 12, 64, 16),
    "gpt2-b16-t256-p512": (16, 256, 512, 12, 12, 64, 16),
    "gqa-b16-t256-p0": (16, 256, 0, 32, 8, 128, 16),
    "gqa-b16-t256-p512": (16, 256, 512, 32, 8, 128, 16),
    # BLOOM-560M's heads (16 of 64; ALiBi: `--alibi`), a whole prompt and a chunk.
    "bloom-b4-t2048-p0": (4, 2048, 0, 16, 16, 64, 16),
    "bloom-b4-t512-p1536": (4, 512, 1536, 16, 16, 64, 16),
}


def make_inputs(b, t, prefix, h, hkv, d, page_size, seed=0):
  """(q, k_pages, v_pages, page_table, q_start, q_lengths) and the contiguous k, v
  [B, S, Hkv, D] they page (S = prefix + t)."""
  s = prefix + t
  pages_per_seq = -(-s // page_size)
  num_pages = b * pages_per_seq
  ks = jax.random.split(jax.random.key(seed), 4)
  q = jax.random.normal(ks[0], (b, t, h, d), jnp.bfloat16)
  k = jax.random.normal(ks[1], (b, s, hkv, d), jnp.bfloat16)
  v = jax.random.normal(ks[2], (b, s, hkv, d), jnp.bfloat16)
  table = jax.random.permutation(ks[3], num_pages).reshape(b, pages_per_seq).astype(jnp.int32)
  pos = jnp.arange(s)
  page, offset = table[:, pos // page_size], pos % page_size

  def paged(x):
    pool = jnp.zeros((hkv, num_pages, page_size, d), x.dtype)
    return pool.at[:, page, offset[None, :]].set(x.transpose(2, 0, 1, 3))

  q_start = jnp.full((b,), prefix, jnp.int32)
  q_lengths = jnp.full((b,), t, jnp.int32)
  return (q, paged(k), paged(v), table, q_start, q_lengths), (k, v)


def quantized_inputs(args, cache_dtype):
  """`make_inputs`' args with the pages quantized to `cache_dtype` (V token-minor) and
  their scales as keyword arguments."""
  q, k_pages, v_pages, *rest = args
  (kq, ks), (vq, vs) = (kv_quant.quantize(x, cache_dtype) for x in (k_pages, v_pages))
  return (q, kq, kv_quant.transpose_pages(vq), *rest, dict(k_scales=ks, v_scales=vs))


def causal_flops(b, t, prefix, h, d):
  """4 H D per (query, visible key): query i (0-based) of a row sees prefix + i + 1 keys."""
  return 4 * h * d * b * (t * prefix + t * (t + 1) // 2)


def ours_in_jit(args, kwargs, sets: int = 4) -> float:
  q = args[0]
  qs = [jax.random.normal(jax.random.key(100 + i), q.shape, q.dtype) for i in range(sets)]
  fn = functools.partial(jax_paged.paged_prefill_attention, **kwargs)
  return common.time_in_jit(lambda q, *rest: fn(q, *rest), [(qi,) for qi in qs],
                            shared=args[1:])


def sweep_configs(group: int):
  block_g = 1 << (group - 1).bit_length()
  for block_m, block_n, warps, stages in itertools.chain(
      itertools.product((64, 128), (32, 64, 128), (4,), (2, 3)),
      [(128, 64, 8, 2), (64, 64, 8, 2)]):
    yield dict(block_q=max(1, block_m // block_g), block_n=block_n, num_warps=warps,
               num_stages=stages)


def main():
  parser = argparse.ArgumentParser()
  parser.add_argument("--shapes", default=",".join(SHAPES))
  parser.add_argument("--sweep", action="store_true", help="also sweep our kernel's knobs")
  parser.add_argument("--sweep-seconds", type=float, default=150.0,
                      help="stop the sweep after this long")
  parser.add_argument("--cache-dtypes", default="int8,float8_e4m3fn",
                      help="quantized pages to time beside bf16's ('' for none)")
  parser.add_argument("--sweep-dtypes", default="bfloat16",
                      help="the pages' dtypes the sweep times (bfloat16, int8, float8_e4m3fn)")
  parser.add_argument("--alibi", action="store_true",
                      help="also time our kernel with ALiBi (BLOOM's slopes)")
  opts = parser.parse_args()
  cache_dtypes = [jnp.dtype(x) for x in opts.cache_dtypes.split(",") if x]
  print(f"# paged prefill attention: {common.header()}", flush=True)
  log = {"header": common.header(), "shapes": {}}
  rows = []
  for name in opts.shapes.split(","):
    b, t, prefix, h, hkv, d, page_size = SHAPES[name]
    args, (k, v) = make_inputs(b, t, prefix, h, hkv, d, page_size)
    flops = causal_flops(b, t, prefix, h, d)
    s = prefix + t
    ours = jax.jit(jax_paged.paged_prefill_attention)
    xla = jax.jit(reference.paged_prefill_attention)
    out = ours(*args)
    err = float(jnp.max(jnp.abs(out.astype(jnp.float32) - xla(*args).astype(jnp.float32))))
    entry = dict(flops=flops, max_err_vs_xla=err,
                 config=paged_prefill.default_config(h // hkv, d, t, 2),
                 ours_in_jit_us=ours_in_jit(args, {}) * 1e6,
                 ours_us=common.kernel_seconds(ours, *args) * 1e6,
                 xla_us=common.kernel_seconds(xla, *args) * 1e6)
    q = args[0]
    cudnn = jax.jit(functools.partial(jax.nn.dot_product_attention, implementation="cudnn"),
                    static_argnames=["is_causal"])
    try:
      q_full = jax.random.normal(jax.random.key(7), (b, s, h, d), q.dtype).at[:, prefix:].set(q)
      full = cudnn(q_full, k, v, is_causal=True)
      entry["cudnn_causal_full_us"] = common.kernel_seconds(
          lambda *a: cudnn(*a, is_causal=True), q_full, k, v) * 1e6
      entry["cudnn_causal_full_flops"] = causal_flops(b, s, 0, h, d)
      # Our chunk's output is the last T queries of the whole prompt's causal attention.
      entry["max_err_vs_cudnn"] = float(jnp.max(jnp.abs(
          out.astype(jnp.float32) - full[:, prefix:].astype(jnp.float32))))
      if prefix:
        entry["cudnn_unmasked_us"] = common.kernel_seconds(
            lambda *a: cudnn(*a, is_causal=False), q, k, v) * 1e6
        entry["cudnn_unmasked_flops"] = 4 * h * d * b * t * s
    except Exception as e:  # pylint: disable=broad-except
      entry["cudnn_error"] = f"{type(e).__name__}: {str(e)[:300]}"
    if opts.alibi:
      slopes = jnp.asarray(jax_paged.nn.alibi_slopes(h))
      alibi = jax.jit(functools.partial(jax_paged.paged_prefill_attention,
                                        alibi_slopes=slopes))
      want = reference.paged_prefill_attention(*args, alibi_slopes=slopes)
      entry["alibi"] = dict(
          ours_us=common.kernel_seconds(alibi, *args) * 1e6,
          max_err_vs_xla=float(jnp.max(jnp.abs(alibi(*args).astype(jnp.float32)
                                               - want.astype(jnp.float32)))))
    for cache_dtype in cache_dtypes:
      qargs = quantized_inputs(args, cache_dtype)
      want = xla(*qargs[:6], **qargs[6])
      entry[cache_dtype.name] = dict(
          ours_us=common.kernel_seconds(lambda *a: ours(*a[:6], **a[6]), *qargs) * 1e6,
          xla_us=common.kernel_seconds(lambda *a: xla(*a[:6], **a[6]), *qargs) * 1e6,
          max_err_vs_xla=float(jnp.max(jnp.abs(ours(*qargs[:6], **qargs[6]).astype(
              jnp.float32) - want.astype(jnp.float32)))))
    print(name, json.dumps(entry), flush=True)
    log["shapes"][name] = entry
    rows.append((name, entry))

  tf = lambda flops, us: flops / (us * 1e-6) / 1e12
  cell = lambda e, kind: (f"{e[kind + '_us']:.1f} ({tf(e[kind + '_flops'], e[kind + '_us']):.0f})"
                          if kind + "_us" in e else "-")
  print(f"\n{common.header()}; bf16, random permuted pages; µs = GPU kernel time "
        "(in-jit wall time for ours in brackets); TFLOP/s count causal (unmasked) work "
        "only, each method its own\n")
  print("| shape (B, T, prefix, H/Hkv, D) | ours µs | ours TFLOP/s | XLA ref µs (TFLOP/s) | "
        "cuDNN whole-prompt causal µs (TFLOP/s) | cuDNN chunk unmasked µs (TFLOP/s) | "
        "config (block_q, block_n, warps, stages) | max err vs XLA / cuDNN |")
  print("|---|---|---|---|---|---|---|---|")
  for name, e in rows:
    b, t, prefix, h, hkv, d, _ = SHAPES[name]
    full = cell(e, "cudnn_causal_full") if "cudnn_error" not in e else e["cudnn_error"][:60]
    err_cudnn = e.get("max_err_vs_cudnn", float("nan"))
    print(f"| {name} ({b}, {t}, {prefix}, {h}/{hkv}, {d}) | {e['ours_us']:.1f} "
          f"[{e['ours_in_jit_us']:.1f}] | {tf(e['flops'], e['ours_us']):.0f} | "
          f"{e['xla_us']:.1f} ({tf(e['flops'], e['xla_us']):.1f}) | {full} | "
          f"{cell(e, 'cudnn_unmasked')} | {e['config']} | {e['max_err_vs_xla']:.2g} / "
          f"{err_cudnn:.2g} |", flush=True)
  if cache_dtypes:
    print("\nQuantized pages (per-token scales, V token-minor), the same queries and tokens; "
          "µs = GPU kernel time; the XLA reference dequantizes the pages it gathers\n")
    print("| shape | cache | ours µs | / bf16 ours | TFLOP/s | XLA ref µs | max err vs XLA |")
    print("|---|---|---|---|---|---|---|")
    for name, e in rows:
      for cache_dtype in cache_dtypes:
        c = e[cache_dtype.name]
        print(f"| {name} | {cache_dtype.name} | {c['ours_us']:.1f} | "
              f"{c['ours_us'] / e['ours_us']:.2f} | {tf(e['flops'], c['ours_us']):.0f} | "
              f"{c['xla_us']:.1f} | {c['max_err_vs_xla']:.2g} |", flush=True)

  if opts.alibi:
    print("\nALiBi's biases vs none, our kernel, bf16, same shape, same run (GPU kernel "
          "time)\n")
    print("| shape | µs without | µs with ALiBi | **with / without** | max err vs XLA |")
    print("|---|---|---|---|---|")
    for name, e in rows:
      a = e["alibi"]
      print(f"| {name} | {e['ours_us']:.1f} | {a['ours_us']:.1f} | "
            f"**{a['ours_us'] / e['ours_us']:.3f}** | {a['max_err_vs_xla']:.2g} |", flush=True)

  if opts.sweep:
    deadline = time.monotonic() + opts.sweep_seconds
    log["sweep"] = {}
    print("\n## sweep (µs of GPU kernel time per call)", flush=True)
    for name, dtype in itertools.product(opts.shapes.split(","),
                                         map(jnp.dtype, opts.sweep_dtypes.split(","))):
      b, t, prefix, h, hkv, d, page_size = SHAPES[name]
      args, _ = make_inputs(b, t, prefix, h, hkv, d, page_size)
      scales = {}
      if dtype != jnp.bfloat16:
        *args, scales = quantized_inputs(args, dtype)
      flops = causal_flops(b, t, prefix, h, d)
      results = []
      for cfg in sweep_configs(h // hkv):
        if time.monotonic() > deadline:
          print("sweep: out of time", flush=True)
          break
        fn = jax.jit(functools.partial(jax_paged.paged_prefill_attention, **cfg, **scales))
        try:
          us = common.kernel_seconds(fn, *args, calls=10) * 1e6
        except Exception as e:  # pylint: disable=broad-except
          print(f"{name} {dtype.name} {cfg}: {type(e).__name__}: {str(e)[:200]}", flush=True)
          continue
        results.append((us, cfg))
        print(f"{name} {dtype.name} {cfg}: {us:.1f} us {tf(flops, us):.0f} TFLOP/s", flush=True)
      log["sweep"][f"{name} {dtype.name}"] = [dict(us=us, **cfg) for us, cfg in results]
      if results:
        us, cfg = min(results, key=lambda r: r[0])
        print(f"{name} {dtype.name} best: {cfg} {us:.1f} us {tf(flops, us):.0f} TFLOP/s",
              flush=True)
  with open(os.path.join(common.out_dir(), "prefill.json"), "w") as f:
    json.dump(log, f, indent=1, default=str)


if __name__ == "__main__":
  main()
