"""Int8 weights (`--quantization int8`, `jax_paged.weight_quant`): decoding speed and
agreement against the same model with bf16 weights, in the same run.

Models with random weights, bf16 compute: GPT-2 124M, the Llama-3.2-1B shape of
`bench_llama` and the Llama-3.1-8B shape of `bench_tensor_parallel` (each built twice
from one seed, the second quantized). Per batch size (`--batches`): `batch` greedy
requests of a `--prompt`-token prompt and `--new` new tokens each, EOS ignored, through
an engine of `batch` slots; median of three timed runs after an identical untimed one
(`bench_generate.timed`). Printed per row: the weights' bytes, new tokens/s and decode
ms per step (the engine's report) of each, and int8 / bf16.

Agreement (the first batch's requests): the mean number of leading generated tokens the
two models share, and the largest |log p(token)| difference over the prompts' tokens
(`prompt_logprobs`). With random weights these say how far rounding moves this model, not
a trained model's quality.

    PYTHONPATH=. python benchmarks/bench_weight_quant.py          # on the GPU
    PYTHONPATH=. python benchmarks/bench_weight_quant.py --tiny   # smoke test on CPU
"""

from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from benchmarks import bench_generate
from benchmarks import bench_llama
from benchmarks import bench_tensor_parallel
from benchmarks import common
from jax_paged import Engine, Request, weight_quant
from models import gpt2
from models import llama

PAGE_SIZE = 16


def run(model, requests: list[Request], runs: int):
  """(outputs, report, seconds) of the requests through an engine of a slot each."""
  batch = len(requests)
  pages = batch * -(-(len(requests[0].prompt) + requests[0].max_new_tokens) // PAGE_SIZE)
  eng = Engine(model, max_batch=batch, page_size=PAGE_SIZE, num_pages=pages + 16,
               steps_per_call=128, prefix_caching=False)
  (outputs, report), seconds = bench_generate.timed(lambda: eng.generate(requests), runs=runs)
  return outputs, report, seconds


def prompt_logprobs(model, prompts: list[list[int]]) -> np.ndarray:
  """float [prompts, len - 1]: each prompt token's log-probability after those before it."""
  eng = Engine(model, max_batch=len(prompts), page_size=PAGE_SIZE,
               num_pages=len(prompts) * -(-(len(prompts[0]) + 1) // PAGE_SIZE) + 16,
               prefix_caching=False)
  events = []
  eng.generate([Request(p, 1, prompt_logprobs=True) for p in prompts], on_token=events.append)
  rows = sorted((e.request_id, e.prompt_logprobs[1:]) for e in events
                if e.prompt_logprobs is not None)
  return np.array([r for _, r in rows], np.float64)


def weight_bytes(model) -> int:
  return sum(x.nbytes for x in jax.tree.leaves(nnx.state(model)))


def main():
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--models", nargs="+", default=["gpt2", "llama-1b", "llama-8b"],
                 choices=["gpt2", "llama-1b", "llama-8b"])
  p.add_argument("--batches", type=int, nargs="+", default=[1, 16, 64])
  p.add_argument("--prompt", type=int, default=128)
  p.add_argument("--new", type=int, default=256)
  p.add_argument("--runs", type=int, default=3, help="timed runs (median)")
  p.add_argument("--tiny", action="store_true", help="a tiny GPT-2 on CPU, one run")
  args = p.parse_args()
  models = {
      "gpt2": lambda: gpt2.GPT2LMHeadModel(gpt2.GPT2Config(), dtype=jnp.bfloat16,
                                           rngs=nnx.Rngs(0)),
      "llama-1b": lambda: llama.LlamaForCausalLM(bench_llama.LLAMA_3_2_1B,
                                                 dtype=jnp.bfloat16, rngs=nnx.Rngs(0)),
      "llama-8b": lambda: llama.LlamaForCausalLM(bench_tensor_parallel.LLAMA_3_1_8B,
                                                 dtype=jnp.bfloat16, rngs=nnx.Rngs(0))}
  if args.tiny:
    models = {"tiny": lambda: gpt2.GPT2LMHeadModel(gpt2.PRESETS["tiny"], rngs=nnx.Rngs(0))}
    args.models, args.batches, args.runs, args.prompt, args.new = ["tiny"], [2, 4], 1, 16, 16
  print(f"# bench_weight_quant: {common.header()}")
  print(f"prompt {args.prompt}, {args.new} new tokens, greedy, EOS ignored; int8 weights "
        "per output column, everything else bf16\n")
  print("| model | batch | weights MB bf16 / int8 | bf16 tok/s | int8 tok/s | **int8 / bf16** "
        "| ms per step bf16 / int8 |")
  print("|---|---|---|---|---|---|---|")
  agreement = []
  for name in args.models:
    base = models[name]()
    int8 = models[name]()
    weight_quant.quantize_weights(int8)
    sizes = f"{weight_bytes(base) / 1e6:,.0f} / {weight_bytes(int8) / 1e6:,.0f}"
    for i, batch in enumerate(args.batches):
      rng = np.random.default_rng(batch)
      prompts = [rng.integers(0, base.spec.vocab_size, args.prompt).tolist()
                 for _ in range(batch)]
      requests = [Request(p, args.new) for p in prompts]
      base_out, base_report, base_s = run(base, requests, args.runs)
      int8_out, int8_report, int8_s = run(int8, requests, args.runs)
      tokens = base_report.generated_tokens
      assert int8_report.generated_tokens == tokens
      steps = [1e3 * r.decode_s / r.decode_steps for r in (base_report, int8_report)]
      print(f"| {name} | {batch} | {sizes} | {tokens / base_s:,.0f} | {tokens / int8_s:,.0f} "
            f"| **{base_s / int8_s:.2f}** | {steps[0]:.2f} / {steps[1]:.2f} |", flush=True)
      if i == 0:
        shared = np.mean(common.matched_prefix(base_out, int8_out))
        scored = prompts[:16]
        delta = np.abs(prompt_logprobs(base, scored) - prompt_logprobs(int8, scored)).max()
        agreement.append(f"| {name} | {batch} | {shared:.1f} of {args.new} | {delta:.3f} |")
    del base, int8
  print("\n| model | requests | leading tokens shared (mean) | max prompt |Δ log p| |")
  print("|---|---|---|---|")
  print("\n".join(agreement))


if __name__ == "__main__":
  main()
