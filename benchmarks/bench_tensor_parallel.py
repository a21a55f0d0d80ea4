"""Tensor parallel decoding (`Engine(mesh=...)`) at TP 1 and 2 on one host: decode step time
and end-to-end tokens/s, tokens compared across TP sizes.

Model: a Llama-3.1-8B-shaped `models.llama` model (32 layers, hidden 4096, 32 q heads over
8 kv heads of 128, SwiGLU 14336, vocabulary 128256, untied head; ~16 GB of bf16 weights,
random), the largest model shape in the family that fits one H200 beside a pool for batch
256. `--tiny` swaps in a 2-layer toy (GQA 8 / 4 heads, f32) for CPU checks, e.g. with
`XLA_FLAGS=--xla_force_host_platform_device_count=2 JAX_PLATFORMS=cpu`.

For each batch (`--batches`, default 64 and 256) and TP size (`--tp`, default 1 2): an
engine with a pool holding every sequence (no preemption), prompts of `--prompt` random
tokens, `--new` greedy new tokens, EOS ignored. One untimed run compiles; then `--reps`
timed runs, median of each figure:
  step ms   the decode time per step (Report.decode_s / decode_steps: the engine's
            device loop, `--steps-per-call` steps per call),
  tokens/s  batch * new / the run's wall time (prefill included).
and how far the tokens agree with TP 1's: TP changes the order of the sums (each device's
f32 partial products, rounded to bf16 for the all-reduce), so activations round
differently and a near-tie of random weights' logits can flip a greedy token, after which
the sequence diverges (the f32 tests compare tokens exactly: tests/test_tensor_parallel.py).
The target of issue #33: the step at TP 2 >= 1.6x faster than at TP 1, tokens identical.

    PYTHONPATH=. python benchmarks/bench_tensor_parallel.py [--batches 64 256] [--tp 1 2]
        [--prompt 512] [--new 256] [--reps 3] [--tiny (batches 4 8, prompt 32, 16 new)]

Figures: benchmarks/RESULTS.md ("Tensor parallel").
"""

from __future__ import annotations

import argparse
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from benchmarks import common
from jax_paged import Engine, Request, tensor_parallel
from models import llama

LLAMA_3_1_8B = llama.LlamaConfig(
    vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
    num_attention_heads=32, num_key_value_heads=8, head_dim=128,
    max_position_embeddings=131072, rms_norm_eps=1e-5, rope_theta=500000.0,
    tie_word_embeddings=False, bos_token_id=128000, eos_token_id=(128001, 128008, 128009),
    rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                  "high_freq_factor": 4.0, "original_max_position_embeddings": 8192})
TINY = llama.LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=96,
                         num_hidden_layers=2, num_attention_heads=8, num_key_value_heads=4,
                         max_position_embeddings=256, eos_token_id=None)
PAGE_SIZE = 16


def run(model, mesh, batch: int, prompt: int, new: int, steps_per_call: int, reps: int):
  """(tokens of the last run, median step seconds, median tokens/s)."""
  prompts = np.random.default_rng(batch).integers(
      0, model.config.vocab_size, (batch, prompt)).tolist()
  engine = Engine(model, max_batch=batch, num_pages=batch * -(-(prompt + new) // PAGE_SIZE),
                  page_size=PAGE_SIZE, steps_per_call=steps_per_call, mesh=mesh)
  requests = [Request(p, new) for p in prompts]
  engine.generate(requests)  # compiles
  steps, rates = [], []
  for _ in range(reps):
    engine.reset_prefix_cache()  # else the last run's pages serve every prompt
    start = time.perf_counter()
    tokens, report = engine.generate(requests)
    rates.append(batch * new / (time.perf_counter() - start))
    steps.append(report.decode_s / report.decode_steps)
  return tokens, statistics.median(steps), statistics.median(rates)


def agreement(tokens: list[list[int]], ref: list[list[int]]) -> tuple[int, float]:
  """(sequences identical to ref's, mean tokens before a sequence's first difference)."""
  same = sum(t == r for t, r in zip(tokens, ref))
  return same, float(np.mean(common.matched_prefix(tokens, ref)))


def main():
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--batches", type=int, nargs="+", help="default 64 256 (--tiny: 4 8)")
  p.add_argument("--tp", type=int, nargs="+", default=[1, 2])
  p.add_argument("--prompt", type=int, help="prompt tokens, default 512 (--tiny: 32)")
  p.add_argument("--new", type=int, help="new tokens, default 256 (--tiny: 16)")
  p.add_argument("--steps-per-call", type=int, default=128)
  p.add_argument("--reps", type=int, default=3)
  p.add_argument("--tiny", action="store_true", help="a 2-layer toy in f32 (CPU checks)")
  args = p.parse_args()
  # The toy's 256 positions hold neither the full-size prompt nor its new tokens.
  defaults = (dict(batches=[4, 8], prompt=32, new=16) if args.tiny
              else dict(batches=[64, 256], prompt=512, new=256))
  for name, value in defaults.items():
    if getattr(args, name) is None:
      setattr(args, name, value)
  config, dtype = (TINY, jnp.float32) if args.tiny else (LLAMA_3_1_8B, jnp.bfloat16)
  model = llama.LlamaForCausalLM(config, dtype=dtype, rngs=nnx.Rngs(0))
  dev = jax.devices()[0]
  print(f"{dev.device_kind} x {len(jax.devices())}, jax {jax.__version__}; "
        f"{'tiny' if args.tiny else 'Llama-3.1-8B-shaped'} model, "
        f"{jnp.dtype(dtype).name}; prompt {args.prompt}, {args.new} new tokens, greedy\n")
  print("| batch | TP | step ms | step speedup vs TP 1 | tokens/s | sequences = TP 1's | "
        "tokens before the first difference |")
  print("|---|---|---|---|---|---|---|")
  for batch in args.batches:
    ref_tokens = ref_step = None
    for n in args.tp:
      mesh = None if n == 1 else tensor_parallel.make_mesh(n)
      tokens, step, rate = run(model, mesh, batch, args.prompt, args.new,
                               args.steps_per_call, args.reps)
      if ref_tokens is None:
        ref_tokens, ref_step = tokens, step
      same, before = agreement(tokens, ref_tokens)
      print(f"| {batch} | {n} | {step * 1e3:.2f} | **{ref_step / step:.2f}** | {rate:,.0f} | "
            f"{same} / {batch} | {before:.1f} of {args.new} (mean) |", flush=True)


if __name__ == "__main__":
  main()
