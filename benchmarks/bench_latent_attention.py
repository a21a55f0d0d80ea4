"""Paged latent (MLA) decode attention on the GPU: the Triton kernel
(`jax_paged.kernels.paged_latent_attention`) vs XLA's reference, by GPU kernel time, and
its bytes read (every latent byte of each head block once, the page table, q) against the
HBM read ceiling.

Shapes: DeepSeek-V2-Lite's 16 heads and V2 / V3's 128 over latents of 512 + 64 (the
pool's halves of 288), bf16, page size 16, batch x context as named.

    PYTHONPATH=. python benchmarks/bench_latent_attention.py [--shapes NAME ...]
        [--configs BLOCK_N/WARPS/STAGES ...]

`--configs` also times the kernel at each (block_n, num_warps, num_stages), a sweep of
the tuning knobs.
"""

from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks import common
from jax_paged.kernels import paged_latent_attention, reference

HEAD_DIM, VALUE_DIM, PAGE = 288, 512, 16
# name -> (heads, batch, context)
SHAPES = {"v2lite-b1-l32k": (16, 1, 32768), "v2lite-b16-l4k": (16, 16, 4096),
          "v2lite-b64-l2k": (16, 64, 2048), "v2lite-b128-l1k": (16, 128, 1024),
          "v3-b16-l4k": (128, 16, 4096), "v3-b64-l2k": (128, 64, 2048)}


def main():
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--shapes", nargs="+", choices=list(SHAPES), default=list(SHAPES))
  parser.add_argument("--configs", nargs="*", default=[],
                      help="block_n/num_warps/num_stages settings to time as well")
  args = parser.parse_args()
  configs = [tuple(int(x) for x in c.split("/")) for c in args.configs]
  ceiling = common.read_ceiling_gbs(kernel=True)
  lines = []
  emit = common.emitter(lines)
  emit(f"# paged latent decode attention, {common.header()}, kernel read ceiling "
       f"{ceiling:.0f} GB/s", "",
       "| shape | kernel µs | % of read ceiling | XLA reference µs | reference / kernel |"
       + "".join(f" {c[0]}/{c[1]}/{c[2]} µs |" for c in configs),
       "|---|---|---|---|---|" + "---|" * len(configs))
  for name in args.shapes:
    heads, batch, context = SHAPES[name]
    pages_per_seq = context // PAGE
    num_pages = batch * pages_per_seq
    rng = np.random.default_rng(0)
    k, v = (jax.random.normal(jax.random.key(i), (1, 1, num_pages, PAGE, HEAD_DIM),
                              jnp.bfloat16) for i in range(2))
    q = jax.random.normal(jax.random.key(2), (batch, heads, 2 * HEAD_DIM), jnp.bfloat16)
    table = jnp.asarray(rng.permutation(num_pages).reshape(batch, pages_per_seq), jnp.int32)
    lengths = jnp.full((batch,), context, jnp.int32)
    kernel = jax.jit(lambda q, k, v, t, n: paged_latent_attention.paged_latent_decode_attention(
        q, k, v, t, n, value_dim=VALUE_DIM, scale=0.1, layer=0))
    ref = jax.jit(lambda q, k, v, t, n: reference.paged_latent_attention(
        q[:, None], k, v, t, jnp.maximum(n - 1, 0)[:, None], n, value_dim=VALUE_DIM,
        scale=0.1, layer=0)[:, 0].astype(q.dtype))
    got, want = kernel(q, k, v, table, lengths), ref(q, k, v, table, lengths)
    error = float(jnp.max(jnp.abs(got.astype(jnp.float32) - want.astype(jnp.float32))))
    if not error < 0.05:
      raise RuntimeError(f"{name}: the kernel is {error} from the reference")
    t_kernel = common.kernel_seconds(kernel, q, k, v, table, lengths)
    t_ref = common.kernel_seconds(ref, q, k, v, table, lengths, calls=5)
    read = (paged_latent_attention.head_blocks(heads) * batch * context * 2 * HEAD_DIM * 2
            + table.nbytes + q.nbytes)
    swept = []
    for block_n, warps, stages in configs:
      tuned = jax.jit(lambda q, k, v, t, n, c=(block_n, warps, stages):
                      paged_latent_attention.paged_latent_decode_attention(
                          q, k, v, t, n, value_dim=VALUE_DIM, scale=0.1, layer=0,
                          block_n=c[0], num_warps=c[1], num_stages=c[2]))
      swept.append(common.kernel_seconds(tuned, q, k, v, table, lengths))
    emit(f"| {name} | {t_kernel * 1e6:.1f} | {100 * read / t_kernel / 1e9 / ceiling:.1f} | "
         f"{t_ref * 1e6:.1f} | {t_ref / t_kernel:.2f}x |"
         + "".join(f" {t * 1e6:.1f} |" for t in swept))


if __name__ == "__main__":
  main()
