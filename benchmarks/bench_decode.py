"""Paged decode attention on the GPU: ours vs XLA gather+einsum vs jax's Pallas op.

Usage (device machine): PYTHONPATH=. python benchmarks/bench_decode.py [--sweep] [--shapes a,b]
    [--cache-dtypes bfloat16,int8,float8_e4m3fn] [--alibi] [--sinks]
Prints a markdown table (% of the HBM read ceiling measured in the same run) and writes
<name>.png / <name>.json to $OUT (or the current directory). With quantized cache dtypes
(int8 / float8_e4m3fn pages with per-token f32 scales, the bf16 K/V quantized), bytes count
the scales, and a second table gives each quantized kernel's time over the bf16 kernel's
on the same shape, same run (peers run on bf16 only). `--alibi` / `--sinks` add a table of
our kernel's time with ALiBi's biases (BLOOM's slopes, `nn.alibi_slopes`) / attention
sinks (GPT-OSS's, random in [0, 3]) over its time without, same shape, same run.

Two timings, each against the ceiling (`jnp.sum` over 4 GiB) timed the same way: "kernel",
the GPU kernels' own durations from a profiler trace (device timestamps; no launch gaps or
host dispatch), and "in-jit", wall time of 16 calls issued back to back by one jitted
program (an upper bound: when a program's GPU time is short its host dispatch shows).
Timing one Python dispatch per call measured the host, not the kernel, below ~100 µs.
"""

from __future__ import annotations

import argparse
import json
import os
import traceback

import jax
from jax.experimental.pallas.ops.gpu import paged_attention as jpa
import jax.numpy as jnp
import numpy as np

from benchmarks import common
import jax_paged
from jax_paged import reference
from jax_paged.kernels import kv_quant

# name: (B, H, Hkv, D, L, page_size, ragged)
SHAPES = {
    "gpt2-b64-l1k": (64, 12, 12, 64, 1024, 16, False),
    "gpt2-b256-l1k": (256, 12, 12, 64, 1024, 16, False),
    "gqa-b32-l4k": (32, 32, 8, 128, 4096, 16, False),
    "gqa-b1-l32k": (1, 32, 8, 128, 32768, 16, False),
    "mha-b64-l2k": (64, 32, 32, 128, 2048, 16, False),
    # StarCoder2-3B's heads: 24 q heads over 2 kv heads (groups of 12).
    "sc2-b64-l2k": (64, 24, 2, 128, 2048, 16, False),
    # Gemma-2B's heads (8 q heads over one kv head of 256) and Gemma-2-2B's (8 over 4).
    "gemma-b64-l2k": (64, 8, 1, 256, 2048, 16, False),
    "gemma-b256-l2k": (256, 8, 1, 256, 2048, 16, False),
    "gemma2-b64-l2k": (64, 8, 4, 256, 2048, 16, False),
    # Falcon-7B's heads: 71 q heads over one kv head of 64 (multi-query).
    "falcon-b64-l2k": (64, 71, 1, 64, 2048, 16, False),
    # BLOOM-560M's heads (16 of 64; ALiBi: `--alibi`).
    "bloom-b64-l2k": (64, 16, 16, 64, 2048, 16, False),
    # gpt-oss-20b's heads (64 q heads over 8 kv heads of 64; sinks: `--sinks`).
    "gptoss-b64-l4k": (64, 64, 8, 64, 4096, 16, False),
    "gpt2-b64-l1k-ragged": (64, 12, 12, 64, 1024, 16, True),
    "gqa-b32-l4k-ragged": (32, 32, 8, 128, 4096, 16, True),
}


def make_inputs(b, h, hkv, d, length, page_size, ragged, seed=0, cache_dtype=jnp.bfloat16):
  """(q, k_pages, v_pages, table, lengths, k_scales, v_scales): bf16 q and K/V, the K/V
  quantized for an int8 / float8 cache (V token-minor; scales None otherwise)."""
  pages_per_seq = length // page_size
  num_pages = b * pages_per_seq
  ks = jax.random.split(jax.random.key(seed), 5)
  q = jax.random.normal(ks[0], (b, h, d), jnp.bfloat16)
  k = jax.random.normal(ks[1], (hkv, num_pages, page_size, d), jnp.bfloat16)
  v = jax.random.normal(ks[2], (hkv, num_pages, page_size, d), jnp.bfloat16)
  k_scales = v_scales = None
  if kv_quant.is_quantized(cache_dtype):
    (k, k_scales), (v, v_scales) = (kv_quant.quantize(x, cache_dtype) for x in (k, v))
    v = kv_quant.transpose_pages(v)  # a quantized pool's V is token-minor
  table = jax.random.permutation(ks[3], num_pages).reshape(b, pages_per_seq).astype(jnp.int32)
  if ragged:
    lengths = jax.random.randint(ks[4], (b,), 1, length + 1).astype(jnp.int32)
  else:
    lengths = jnp.full((b,), length, jnp.int32)
  return q, k, v, table, lengths, k_scales, v_scales


def attention(**kw):
  """Our kernel as fn(q, k, v, table, lengths, k_scales, v_scales), jitted."""
  return jax.jit(lambda q, k, v, table, lengths, k_scales, v_scales: (
      jax_paged.paged_decode_attention(q, k, v, table, lengths, k_scales=k_scales,
                                       v_scales=v_scales, **kw)))


def time_calls(fn, args, sets: int = 16) -> float:
  """Seconds per call of fn(q, k, v, table, lengths, ...), issued back to back inside one
  jitted program (`common.time_in_jit`) on `sets` distinct q's sharing the K/V pool."""
  q = args[0]
  qs = [jax.random.normal(jax.random.key(100 + i), q.shape, q.dtype) for i in range(sets)]
  return common.time_in_jit(fn, [(qi,) for qi in qs], shared=args[1:])


def kv_bytes(k, lengths):
  """Live K/V bytes, scales included."""
  hkv, _, _, d = k.shape
  return 2 * int(np.sum(np.asarray(lengths))) * hkv * kv_quant.bytes_per_head_token(d, k.dtype)


def ours_configs(sweep):
  if not sweep:
    return [dict()]
  grid = [dict(block_n=n, num_warps=w, num_stages=s)
          for n in (32, 64, 128) for w in (4, 8) for s in (2, 3, 4)]
  return [dict()] + grid


def split_options(b, hkv, length, sweep):
  if not sweep:
    return [None]
  return [None] + [s for s in (1, 2, 4, 8, 16, 32, 64, 128, 256) if b * hkv * s <= 16384
                   and length // s >= 64]


def bench_jax_pallas(args, length, page_size):
  """Best time of jax.experimental.pallas.ops.gpu.paged_attention over its knobs."""
  q, k, v, table, lengths = args[:5]
  best, errors = None, []
  pages = length // page_size
  for k_splits in (1, 2, 4, 8, 16):
    for ppcb in (4, 8, 16):
      if pages % k_splits or (pages // k_splits) % min(ppcb, pages // k_splits):
        continue
      fn = jax.jit(lambda *a, ks=k_splits, pp=ppcb: jpa.paged_attention(
          *a, k_splits=ks, pages_per_compute_block=pp))
      try:
        t = time_calls(fn, args[:5])
      except Exception as e:  # pylint: disable=broad-except
        errors.append(f"k_splits={k_splits} ppcb={ppcb}: {type(e).__name__}: {str(e)[:200]}")
        continue
      if best is None or t < best[0]:
        best = (t, dict(k_splits=k_splits, pages_per_compute_block=ppcb))
  return best, errors


def bench_shape(name, cache_dtype, opts, log, ceiling):
  """Times one shape with one cache dtype; returns its table row."""
  b, h, hkv, d, length, page_size, ragged = SHAPES[name]
  args = make_inputs(b, h, hkv, d, length, page_size, ragged, cache_dtype=cache_dtype)
  nbytes = kv_bytes(args[1], args[4])
  entry = {"bytes": nbytes, "cache_dtype": cache_dtype.name, "ours": []}
  q, k, v, table, lengths, k_scales, v_scales = args
  expected = reference.paged_decode_attention(
      q, k, v, table, lengths, k_scales=k_scales, v_scales=v_scales).astype(jnp.float32)
  label = f"{name} {cache_dtype.name}"
  for cfg in ours_configs(opts.sweep):
    for splits in split_options(b, hkv, length, opts.sweep and not cfg):
      kw = dict(cfg, num_splits=splits)
      fn = attention(**kw)
      try:
        err = float(jnp.max(jnp.abs(fn(*args).astype(jnp.float32) - expected)))
        t = time_calls(fn, args)
      except Exception as e:  # pylint: disable=broad-except
        print(f"{label} {kw}: {type(e).__name__}: {str(e)[:300]}", flush=True)
        continue
      entry["ours"].append({"cfg": kw, "us": t * 1e6, "gbs": nbytes / t / 1e9, "max_err": err})
      print(f"{label} ours {kw}: {t*1e6:.1f} us {nbytes/t/1e9:.0f} GB/s "
            f"({100*nbytes/t/1e9/ceiling:.1f}%) err {err:.3g}", flush=True)
  default = entry["ours"][0]
  best = max(entry["ours"], key=lambda r: r["gbs"])
  seconds = common.kernel_seconds(attention(**default["cfg"]), *args)
  default.update(kernel_us=seconds * 1e6, kernel_gbs=nbytes / seconds / 1e9)
  for variant in variants(opts):
    extra = VARIANTS[variant][1](h)
    fn = attention(**extra, **default["cfg"])
    want = reference.paged_decode_attention(q, k, v, table, lengths, k_scales=k_scales,
                                            v_scales=v_scales, **extra)
    err = float(jnp.max(jnp.abs(fn(*args).astype(jnp.float32) - want.astype(jnp.float32))))
    variant_seconds = common.kernel_seconds(fn, *args)
    entry[variant] = {"kernel_us": variant_seconds * 1e6, "max_err": err}
    print(f"{label} ours with {VARIANTS[variant][0]}: {variant_seconds * 1e6:.1f} us "
          f"(kernel) vs {seconds * 1e6:.1f} without, err {err:.3g}", flush=True)
  pallas_gbs = xla_kgbs = pallas_kgbs = float("nan")
  if not opts.no_peers and not kv_quant.is_quantized(cache_dtype):
    # Kernel time only: in one program XLA computes the page gather of the shared K/V
    # once for all the calls, so its in-jit time would beat the read ceiling.
    xla = jax.jit(reference.paged_decode_attention)
    xla_kgbs = nbytes / common.kernel_seconds(xla, *args[:5]) / 1e9
    jbest, errors = bench_jax_pallas(args, length, page_size)
    entry["jax_pallas_errors"] = errors
    if errors:
      print(f"{name} jax pallas errors: {errors[:2]}", flush=True)
    if jbest:
      pallas_gbs = nbytes / jbest[0] / 1e9
      jfn = jax.jit(lambda *a: jpa.paged_attention(*a, **jbest[1]))
      pallas_kgbs = nbytes / common.kernel_seconds(jfn, *args[:5]) / 1e9
      entry["jax_pallas"] = {"us": jbest[0] * 1e6, "cfg": jbest[1]}
  entry.update(pallas_gbs=pallas_gbs, xla_kernel_gbs=xla_kgbs, pallas_kernel_gbs=pallas_kgbs)
  log["shapes"][f"{name}/{cache_dtype.name}"] = entry
  return name, cache_dtype, nbytes, default, best, pallas_gbs, xla_kgbs, pallas_kgbs


# --alibi / --sinks: (what, num_heads -> the kernel's extra arguments)
VARIANTS = {
    "alibi": ("ALiBi's biases",
              lambda h: dict(alibi_slopes=jnp.asarray(jax_paged.nn.alibi_slopes(h)))),
    "sinks": ("attention sinks", lambda h: dict(sinks=jax.random.uniform(
        jax.random.key(h), (h,), minval=0.0, maxval=3.0))),
}


def variants(opts) -> list[str]:
  """The variants the flags ask for, in VARIANTS' order."""
  return [name for name in VARIANTS if getattr(opts, name)]


def main():
  parser = argparse.ArgumentParser()
  parser.add_argument("--sweep", action="store_true", help="also sweep our kernel's knobs")
  parser.add_argument("--shapes", default=",".join(SHAPES))
  parser.add_argument("--cache-dtypes", default="bfloat16",
                      help="comma-separated KV cache dtypes, each timed on every shape: "
                           "bfloat16, int8, float8_e4m3fn (default bfloat16)")
  parser.add_argument("--no-peers", action="store_true", help="skip XLA and jax's Pallas op")
  parser.add_argument("--alibi", action="store_true",
                      help="also time our kernel with ALiBi (BLOOM's slopes)")
  parser.add_argument("--sinks", action="store_true",
                      help="also time our kernel with attention sinks (GPT-OSS's)")
  parser.add_argument("--name", default="decode", help="file name stem under $OUT")
  opts = parser.parse_args()
  cache_dtypes = [jnp.dtype(name) for name in opts.cache_dtypes.split(",")]

  ceiling = common.read_ceiling_gbs()
  kceiling = common.read_ceiling_gbs(kernel=True)
  print(f"# decode attention: {common.header()}; read ceiling {ceiling:.0f} GB/s "
        f"(kernel time: {kceiling:.0f} GB/s)", flush=True)
  rows, log = [], {"header": common.header(), "ceiling_gbs": ceiling,
                   "kernel_ceiling_gbs": kceiling, "shapes": {}}
  for name in opts.shapes.split(","):
    for cache_dtype in cache_dtypes:
      rows.append(bench_shape(name, cache_dtype, opts, log, ceiling))

  pct = lambda g: f"{100 * g / ceiling:.1f}%"
  kpct = lambda g: f"{100 * g / kceiling:.1f}%"
  print(f"\n{common.header()}; read ceiling {ceiling:.0f} GB/s, by kernel time "
        f"{kceiling:.0f} GB/s\n")
  print("Timed in one jitted program (in-jit) / by the GPU kernels' own durations (kernel), "
        "each against the ceiling timed the same way. KV bytes include any scales.\n")
  print("| shape | cache | KV MB | ours µs (in-jit) | ours % (in-jit) | ours % (kernel) | "
        "best cfg % in-jit (cfg) | XLA % (kernel) | jax Pallas % (in-jit / kernel) |")
  print("|---|---|---|---|---|---|---|---|---|")
  for name, dtype, nbytes, default, best, pallas_gbs, xla_kgbs, pallas_kgbs in rows:
    print(f"| {name} | {dtype.name} | {nbytes/1e6:.0f} | {default['us']:.1f} | "
          f"{pct(default['gbs'])} | {kpct(default['kernel_gbs'])} | {pct(best['gbs'])} "
          f"({best['cfg']}) | {kpct(xla_kgbs)} | {pct(pallas_gbs)} / {kpct(pallas_kgbs)} |")
  bf16 = {r[0]: r[3] for r in rows if r[1] == jnp.bfloat16}
  quantized = [r for r in rows if kv_quant.is_quantized(r[1]) and r[0] in bf16]
  if quantized:
    print("\nQuantized cache vs bf16, same shape, same run (time ratio < 1 is faster):\n")
    print("| shape | cache | KV MB | bytes / bf16's | kernel µs | bf16 kernel µs | "
          "**time / bf16's** (kernel) | in-jit time / bf16's | % ceiling (kernel) |")
    print("|---|---|---|---|---|---|---|---|---|")
    for name, dtype, nbytes, default, *_ in quantized:
      ref = bf16[name]
      print(f"| {name} | {dtype.name} | {nbytes/1e6:.0f} | "
            f"{nbytes / log['shapes'][name + '/bfloat16']['bytes']:.3f} | "
            f"{default['kernel_us']:.1f} | {ref['kernel_us']:.1f} | "
            f"**{default['kernel_us'] / ref['kernel_us']:.3f}** | "
            f"{default['us'] / ref['us']:.3f} | {kpct(default['kernel_gbs'])} |")
  for variant in variants(opts):
    what = VARIANTS[variant][0]
    print(f"\n{what[0].upper() + what[1:]} vs none, our kernel, same shape, same run "
          "(kernel time):\n")
    print(f"| shape | cache | µs without | µs with {what} | **with / without** | "
          "max abs err |")
    print("|---|---|---|---|---|---|")
    for name, dtype, _, default, *_ in rows:
      timed = log["shapes"][f"{name}/{dtype.name}"][variant]
      print(f"| {name} | {dtype.name} | {default['kernel_us']:.1f} | "
            f"{timed['kernel_us']:.1f} | **{timed['kernel_us'] / default['kernel_us']:.3f}** "
            f"| {timed['max_err']:.3g} |")
  out = common.out_dir()
  with open(os.path.join(out, f"{opts.name}.json"), "w") as f:
    json.dump(log, f, indent=1, default=str)
  try:
    import matplotlib  # pylint: disable=g-import-not-at-top
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top
    x = np.arange(len(rows))
    fig, ax = plt.subplots(figsize=(10, 4.5))
    for i, (label, key) in enumerate((("ours", 3), ("XLA gather+einsum", 6),
                                      ("jax Pallas paged_attention", 7))):
      vals = [100 * (r[key]["kernel_gbs"] if isinstance(r[key], dict) else r[key]) / kceiling
              for r in rows]  # kernel time
      ax.bar(x + (i - 1) * 0.27, vals, 0.27, label=label)
    ax.set_xticks(x, [f"{r[0]} {r[1].name}" for r in rows], rotation=20, fontsize=8)
    ax.set_ylabel("% of HBM read ceiling (GPU kernel time)")
    ax.set_title(f"Paged decode attention ({common.header()})", fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(os.path.join(out, f"{opts.name}.png"), dpi=110)
  except Exception:  # pylint: disable=broad-except
    traceback.print_exc()


if __name__ == "__main__":
  main()
