"""Merge attention states on the GPU: our Pallas-Triton kernel vs the jitted (XLA-fused)
reference, as GB/s against the copy ceiling (bytes read + written by a large negation).

Usage (device machine): PYTHONPATH=. python benchmarks/bench_merge.py
"""

from __future__ import annotations

import json
import os

import jax
import jax.numpy as jnp

from benchmarks import common
import jax_paged
from jax_paged import reference

SHAPES = {"vllm-8192x32x128": (8192, 32, 128), "gpt2-8192x12x64": (8192, 12, 64)}


def copy_ceiling_gbs() -> float:
  x = jax.random.normal(jax.random.key(0), (1 << 30,), jnp.bfloat16)
  t = common.time_fn(jax.jit(jnp.negative), x, calls=5, reps=10)
  return 2 * x.nbytes / t / 1e9


def time_calls(fn, make_args, sets: int = 8) -> float:
  """Seconds per call, issued back to back in one jitted program on `sets` distinct input
  sets (`common.time_in_jit`; distinct so the small cases do not run out of L2)."""
  return common.time_in_jit(fn, [make_args(i) for i in range(sets)])


def main():
  ceiling = copy_ceiling_gbs()
  print(f"# merge: {common.header()}; copy ceiling {ceiling:.0f} GB/s", flush=True)
  rows, log = [], {"header": common.header(), "copy_ceiling_gbs": ceiling}
  for name, shape in SHAPES.items():
    def pair(i, shape=shape):
      ks = jax.random.split(jax.random.key(i), 4)
      o_a, o_b = (jax.random.normal(k, shape, jnp.bfloat16) for k in ks[:2])
      lse_a, lse_b = (jax.random.normal(k, shape[:-1], jnp.float32) for k in ks[2:])
      return o_a, lse_a, o_b, lse_b
    args = pair(0)
    nbytes = 3 * args[0].nbytes + 3 * args[1].nbytes
    ours = jax.jit(jax_paged.merge_attention_states)
    xla = jax.jit(reference.merge_attention_states)
    err = float(jnp.max(jnp.abs(ours(*args)[0].astype(jnp.float32)
                                - xla(*args)[0].astype(jnp.float32))))
    rows.append((f"{name} 2-way", nbytes, time_calls(ours, pair), time_calls(xla, pair), err,
                 common.kernel_seconds(ours, *args), common.kernel_seconds(xla, *args)))
    # N-way: the split-KV path's 16 f32 partials -> bf16.
    n = 16
    def partials(i, shape=shape):
      ks = jax.random.split(jax.random.key(1000 + i))
      o = jax.random.normal(ks[0], (n, shape[0] // n, *shape[1:]), jnp.float32)
      return o, jax.random.normal(ks[1], o.shape[:-1], jnp.float32)
    o, lse = partials(0)
    nbytes_n = o.nbytes + lse.nbytes + o[0].size * 2 + lse[0].nbytes
    ours_n = jax.jit(jax_paged.merge_attention_states_n)
    xla_n = jax.jit(reference.merge_attention_states_n)
    err = float(jnp.max(jnp.abs(ours_n(o, lse)[0] - xla_n(o, lse)[0])))
    rows.append((f"{name} 16-way f32", nbytes_n, time_calls(ours_n, partials),
                 time_calls(xla_n, partials), err, common.kernel_seconds(ours_n, o, lse),
                 common.kernel_seconds(xla_n, o, lse)))
  print(f"\n{common.header()}; copy ceiling {ceiling:.0f} GB/s\n")
  print("Timed in one jitted program (in-jit) and by the GPU kernels' own durations "
        "(kernel).\n")
  print("| case | MB | ours µs (in-jit) | ours % copy | XLA µs (in-jit) | XLA % copy | "
        "ours / XLA kernel µs | max err |")
  print("|---|---|---|---|---|---|---|---|")
  for name, nbytes, t_ours, t_xla, err, k_ours, k_xla in rows:
    g_o, g_x = nbytes / t_ours / 1e9, nbytes / t_xla / 1e9
    print(f"| {name} | {nbytes/1e6:.0f} | {t_ours*1e6:.1f} | {100*g_o/ceiling:.1f}% | "
          f"{t_xla*1e6:.1f} | {100*g_x/ceiling:.1f}% | {k_ours*1e6:.1f} / {k_xla*1e6:.1f} | "
          f"{err:.2g} |")
    log[name] = dict(bytes=nbytes, ours_us=t_ours * 1e6, xla_us=t_xla * 1e6, max_err=err,
                     ours_kernel_us=k_ours * 1e6, xla_kernel_us=k_xla * 1e6)
  with open(os.path.join(common.out_dir(), "merge.json"), "w") as f:
    json.dump(log, f, indent=1)


if __name__ == "__main__":
  main()
