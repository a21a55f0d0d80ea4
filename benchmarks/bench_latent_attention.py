"""Paged latent (MLA) attention on the GPU: the Triton kernels
(`jax_paged.kernels.paged_latent_attention`) vs XLA's reference, by GPU kernel time.

Decode: bytes read (every latent byte of each head block once, the page table, q) against
the HBM read ceiling. Prefill: TFLOP/s of the absorbed work a causal kernel must do, 2 x H
x (2 D + value_dim) per (query, visible key) pair (576 + 512 wide: 3.4x the flops of
attending with expanded per-head K and V, for no expanded copy). `--model-prefill` times
whole prompts through DeepSeek-V2-Lite's shape (`bench_moe.DEEPSEEK_V2_LITE`, random bf16
weights, `--layers` of its 27) in `ModelRunner.prefill`, the kernels against the model
with `decode_impl="reference"` (XLA's latent attention), same run.

Shapes: DeepSeek-V2-Lite's 16 heads and V2 / V3's 128 over latents of 512 + 64 (the
pool's halves of 288), bf16 q, page size 16, batch x context (decode) or batch x (cached
prefix +) chunk (prefill) as named; pages of each `--cache-dtypes` (bf16, and int8 /
float8_e4m3fn quantized per token as `KVPool` stores them: their bytes count the scales).

    PYTHONPATH=. python benchmarks/bench_latent_attention.py [--shapes NAME ...]
        [--cache-dtypes DTYPE ...] [--configs BLOCK_N/WARPS/STAGES ...]
        [--prefill-shapes NAME ...]
        [--prefill-configs BLOCK_Q/BLOCK_N/WARPS/STAGES ...]
        [--model-prefill BxT ...] [--layers N]

`--configs` / `--prefill-configs` also time the kernels at each setting of their tuning
knobs (a sweep).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import time

import jax
import jax.numpy as jnp
import numpy as np

from flax import nnx

from benchmarks import bench_moe
from benchmarks import common
from jax_paged.kernels import kv_quant, paged_latent_attention, reference
from jax_paged.serving.runner import ModelRunner
from models import deepseek

HEAD_DIM, VALUE_DIM, PAGE = 288, 512, 16
# name -> (heads, batch, context)
SHAPES = {"v2lite-b1-l32k": (16, 1, 32768), "v2lite-b16-l4k": (16, 16, 4096),
          "v2lite-b64-l2k": (16, 64, 2048), "v2lite-b128-l1k": (16, 128, 1024),
          "v3-b16-l4k": (128, 16, 4096), "v3-b64-l2k": (128, 64, 2048)}
# name -> (heads, batch, cached prefix, chunk)
PREFILL_SHAPES = {"v2lite-1x2k": (16, 1, 0, 2048), "v2lite-4x2k": (16, 4, 0, 2048),
                  "v2lite-1x8k": (16, 1, 0, 8192), "v2lite-4x512-after-4k": (16, 4, 4096, 512),
                  "v3-1x4k": (128, 1, 0, 4096)}


def pool(heads: int, batch: int, context: int, cache_dtype, *,
         query_tokens: int | None = None):
  """Random bf16 latents of `batch` sequences of `context` tokens in permuted pages,
  quantized to `cache_dtype` unless bfloat16; q [batch, heads, 2 D] (or [batch,
  query_tokens, heads, 2 D]) and the page table. Returns (q, table, pages: the kernels'
  k_pages, v_pages, k_scales, v_scales as keywords)."""
  pages_per_seq = context // PAGE
  num_pages = batch * pages_per_seq
  rng = np.random.default_rng(0)
  k, v = (jax.random.normal(jax.random.key(i), (1, 1, num_pages, PAGE, HEAD_DIM),
                            jnp.bfloat16) for i in range(2))
  q_shape = (batch, heads) if query_tokens is None else (batch, query_tokens, heads)
  q = jax.random.normal(jax.random.key(2), q_shape + (2 * HEAD_DIM,), jnp.bfloat16)
  table = jnp.asarray(rng.permutation(num_pages).reshape(batch, pages_per_seq), jnp.int32)
  if not kv_quant.is_quantized(cache_dtype):
    return q, table, dict(k_pages=k, v_pages=v, k_scales=None, v_scales=None)
  (k, k_scales), (v, v_scales) = (kv_quant.quantize(x, cache_dtype) for x in (k, v))
  return q, table, dict(k_pages=k, v_pages=kv_quant.transpose_pages(v), k_scales=k_scales,
                        v_scales=v_scales)


def check(name: str, got: jax.Array, want: jax.Array) -> None:
  error = float(jnp.max(jnp.abs(got.astype(jnp.float32) - want.astype(jnp.float32))))
  if not error < 0.05:
    raise RuntimeError(f"{name}: the kernel is {error} from the reference")


def decode_table(emit, names: list[str], cache_dtypes: list[str],
                 configs: list[tuple[int, ...]]) -> None:
  ceiling = common.read_ceiling_gbs(kernel=True)
  emit(f"# paged latent decode attention, {common.header()}, kernel read ceiling "
       f"{ceiling:.0f} GB/s", "",
       "| shape | cache | kernel µs | % of read ceiling | kernel / bf16's | XLA reference µs |"
       " reference / kernel |" + "".join(f" {c[0]}/{c[1]}/{c[2]} µs |" for c in configs),
       "|---|---|---|---|---|---|---|" + "---|" * len(configs))
  for name in names:
    heads, batch, context = SHAPES[name]
    lengths = jnp.full((batch,), context, jnp.int32)
    first = None
    for cache_dtype in cache_dtypes:
      q, table, pages = pool(heads, batch, context, cache_dtype)

      def kernel(q, t, n, pages, c=(None,) * 3):
        return paged_latent_attention.paged_latent_decode_attention(
            q, page_table=t, lengths=n, value_dim=VALUE_DIM, scale=0.1, layer=0,
            block_n=c[0], num_warps=c[1], num_stages=c[2], **pages)

      ref = jax.jit(lambda q, t, n, pages: reference.paged_latent_attention(
          q[:, None], pages["k_pages"], pages["v_pages"], t, jnp.maximum(n - 1, 0)[:, None],
          n, value_dim=VALUE_DIM, scale=0.1, layer=0, k_scales=pages["k_scales"],
          v_scales=pages["v_scales"])[:, 0].astype(q.dtype))
      args = (q, table, lengths, pages)
      check(name, jax.jit(kernel)(*args), ref(*args))
      t_kernel = common.kernel_seconds(jax.jit(kernel), *args)
      t_ref = common.kernel_seconds(ref, *args, calls=5)
      first = first or t_kernel
      token_bytes = 2 * kv_quant.bytes_per_head_token(HEAD_DIM, cache_dtype)
      read = (paged_latent_attention.head_blocks(heads) * batch * context * token_bytes
              + table.nbytes + q.nbytes)
      swept = [common.kernel_seconds(jax.jit(functools.partial(kernel, c=c)), *args)
               for c in configs]
      emit(f"| {name} | {cache_dtype} | {t_kernel * 1e6:.1f} | "
           f"{100 * read / t_kernel / 1e9 / ceiling:.1f} | {t_kernel / first:.3f} | "
           f"{t_ref * 1e6:.1f} | {t_ref / t_kernel:.2f}x |"
           + "".join(f" {t * 1e6:.1f} |" for t in swept))


def prefill_table(emit, names: list[str], cache_dtypes: list[str],
                  configs: list[tuple[int, ...]]) -> None:
  emit("", f"# paged latent prefill attention, {common.header()}", "",
       "| shape | cache | kernel µs | TFLOP/s | XLA reference µs | reference / kernel |"
       + "".join(f" {'/'.join(map(str, c))} µs |" for c in configs),
       "|---|---|---|---|---|---|" + "---|" * len(configs))
  for name in names:
    heads, batch, prefix, chunk = PREFILL_SHAPES[name]
    start = jnp.full((batch,), prefix, jnp.int32)
    q_len = jnp.full((batch,), chunk, jnp.int32)
    for cache_dtype in cache_dtypes:
      q, table, pages = pool(heads, batch, prefix + chunk, cache_dtype, query_tokens=chunk)

      def kernel(q, t, s, n, pages, c=(None,) * 4):
        return paged_latent_attention.paged_latent_prefill_attention(
            q, page_table=t, q_start=s, q_lengths=n, value_dim=VALUE_DIM, scale=0.1,
            layer=0, block_q=c[0], block_n=c[1], num_warps=c[2], num_stages=c[3], **pages)

      ref = jax.jit(lambda q, t, s, n, pages: reference.paged_latent_attention(
          q, pages["k_pages"], pages["v_pages"], t, s[:, None] + jnp.arange(q.shape[1]),
          s + n, value_dim=VALUE_DIM, scale=0.1, layer=0, k_scales=pages["k_scales"],
          v_scales=pages["v_scales"]).astype(q.dtype))
      args = (q, table, start, q_len, pages)
      check(name, jax.jit(kernel)(*args), ref(*args))
      t_kernel = common.kernel_seconds(jax.jit(kernel), *args)
      t_ref = common.kernel_seconds(ref, *args, calls=3)
      pairs = batch * chunk * (prefix + (chunk + 1) / 2)  # (query, visible key) pairs
      flops = pairs * heads * 2 * (2 * HEAD_DIM + VALUE_DIM)
      swept = []
      for c in configs:
        try:
          tuned = jax.jit(functools.partial(kernel, c=c))
          swept.append(f"{common.kernel_seconds(tuned, *args) * 1e6:.1f}")
        except jax.errors.JaxRuntimeError as e:  # a tile past the shared memory
          swept.append(str(e).split(":")[0])
      emit(f"| {name} | {cache_dtype} | {t_kernel * 1e6:.1f} | {flops / t_kernel / 1e12:.0f} "
           f"| {t_ref * 1e6:.1f} | {t_ref / t_kernel:.2f}x |"
           + "".join(f" {t} |" for t in swept))


def model_prefill(emit, prompts: list[str], layers: int) -> None:
  """Whole prompts through DeepSeek-V2-Lite's shape: the latent kernels vs XLA's latent
  attention (median of 3 fresh prefill calls each)."""
  config = dataclasses.replace(bench_moe.DEEPSEEK_V2_LITE, num_hidden_layers=layers)
  emit("", f"# DeepSeek-V2-Lite shape, {layers} layers, bf16: one fresh prefill, "
       f"{common.header()}", "",
       "| prompts | kernels ms | tokens/s | XLA latent attention ms | XLA / kernels |",
       "|---|---|---|---|---|")
  prompts = [tuple(int(x) for x in p.split("x")) for p in prompts]
  seconds = {}
  for impl in ("auto", "reference"):  # one model at a time (15.7B parameters)
    model = deepseek.DeepseekForCausalLM(config, dtype=jnp.bfloat16,
                                         param_dtype=jnp.bfloat16, decode_impl=impl,
                                         rngs=nnx.Rngs(0))
    runner = ModelRunner(model)
    for batch, tokens in prompts:
      ids = np.random.default_rng(0).integers(0, 1000, (batch, tokens)).astype(np.int32)
      times = []
      for _ in range(4):  # the first compiles
        kv = model.spec.create_pool(num_pages=batch * (tokens // PAGE + 1), page_size=PAGE,
                                    max_seqs=batch, max_pages_per_seq=tokens // PAGE + 1)
        begin = time.perf_counter()
        logits, kv = runner.prefill(kv, ids, np.full((batch,), tokens, np.int32),
                                    np.arange(batch, dtype=np.int32))
        logits.block_until_ready()
        times.append(time.perf_counter() - begin)
        del kv
      seconds[impl, batch, tokens] = float(np.median(times[1:]))
    del model, runner
  for batch, tokens in prompts:
    kernels, xla = seconds["auto", batch, tokens], seconds["reference", batch, tokens]
    emit(f"| {batch} x {tokens} | {kernels * 1e3:.1f} | {batch * tokens / kernels:,.0f} | "
         f"{xla * 1e3:.1f} | {xla / kernels:.2f}x |")

def main():
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--shapes", nargs="*", choices=list(SHAPES), default=list(SHAPES))
  parser.add_argument("--configs", nargs="*", default=[],
                      help="block_n/num_warps/num_stages settings to time as well")
  parser.add_argument("--cache-dtypes", nargs="+", default=["bfloat16", "int8"],
                      choices=["bfloat16", "int8", "float8_e4m3fn"],
                      help="page dtypes of the kernel tables (the first is the ratios' base)")
  parser.add_argument("--prefill-shapes", nargs="*", choices=list(PREFILL_SHAPES),
                      default=list(PREFILL_SHAPES))
  parser.add_argument("--prefill-configs", nargs="*", default=[],
                      help="block_q/block_n/num_warps/num_stages settings to time as well")
  parser.add_argument("--model-prefill", nargs="*", default=[],
                      help="BATCHxTOKENS prompts through DeepSeek-V2-Lite's shape")
  parser.add_argument("--layers", type=int, default=27,
                      help="--model-prefill's layers (27: the whole model)")
  args = parser.parse_args()
  parse = lambda configs: [tuple(int(x) for x in c.split("/")) for c in configs]  # noqa: E731
  lines = []
  emit = common.emitter(lines)
  if args.shapes:
    decode_table(emit, args.shapes, args.cache_dtypes, parse(args.configs))
  if args.prefill_shapes:
    prefill_table(emit, args.prefill_shapes, args.cache_dtypes, parse(args.prefill_configs))
  if args.model_prefill:
    model_prefill(emit, args.model_prefill, args.layers)


if __name__ == "__main__":
  main()
