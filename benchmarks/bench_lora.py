"""Serving LoRA adapters (`Engine(max_loras=...)`, `Request(lora=...)`): what the adapters
cost end to end on the GPU, against the same engine without LoRA, in the same run.

Models with random weights, bf16: GPT-2 124M and the Llama-3.2-1B shape of
`bench_llama`, every linear adapted (GPT-2: c_attn, attn.c_proj, c_fc, mlp.c_proj;
Llama: q/k/v/o and gate/up/down) by `--adapters` random adapters of rank `--rank`
(`LoraAdapter.random`). Per batch size (`--batches`), `batch` greedy requests of a
`--prompt`-token prompt and `--new` new tokens each, EOS ignored, through an engine of
`batch` slots, three ways:

* base: an engine without LoRA (max_loras=0);
* slots, no adapter: the LoRA engine, every request on the base model (its projections
  still run the adapters' two small GEMMs, masked);
* mixed: the LoRA engine, request i under adapter i % `--adapters`: every batch mixes
  all of them.

Each figure is the median of three timed runs after an identical untimed one
(`bench_generate.timed`). Printed per row: new tokens/s and the ratio to base.

    PYTHONPATH=. python benchmarks/bench_lora.py            # on the GPU
    PYTHONPATH=. python benchmarks/bench_lora.py --tiny     # smoke test on CPU
"""

from __future__ import annotations

import argparse

import jax.numpy as jnp
import numpy as np
from flax import nnx

from benchmarks import bench_generate
from benchmarks import bench_llama
from benchmarks import common
from jax_paged import Engine, Request
from jax_paged.lora import LoraAdapter
from models import gpt2
from models import llama

PAGE_SIZE = 16


def run(model, requests: list[Request], adapters: list[LoraAdapter], rank: int, runs: int):
  """(report, seconds) of the requests through an engine of a slot each, serving
  `adapters` (as "0", "1", ...; none: an engine without LoRA)."""
  batch = len(requests)
  pages = batch * -(-(len(requests[0].prompt) + requests[0].max_new_tokens) // PAGE_SIZE)
  eng = Engine(model, max_batch=batch, page_size=PAGE_SIZE, num_pages=pages + 16,
               steps_per_call=128, prefix_caching=False, max_loras=len(adapters),
               max_lora_rank=rank)
  for i, adapter in enumerate(adapters):
    eng.add_lora(str(i), adapter)
  (_, report), seconds = bench_generate.timed(lambda: eng.generate(requests), runs=runs)
  return report, seconds


def main():
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--models", nargs="+", default=["gpt2", "llama-1b"],
                 choices=["gpt2", "llama-1b"])
  p.add_argument("--batches", type=int, nargs="+", default=[16, 64, 256])
  p.add_argument("--prompt", type=int, default=128)
  p.add_argument("--new", type=int, default=256)
  p.add_argument("--adapters", type=int, default=4)
  p.add_argument("--rank", type=int, default=16)
  p.add_argument("--runs", type=int, default=3, help="timed runs (median)")
  p.add_argument("--tiny", action="store_true", help="a tiny GPT-2 on CPU, one run")
  args = p.parse_args()
  models = {"gpt2": lambda: gpt2.GPT2LMHeadModel(gpt2.GPT2Config(), dtype=jnp.bfloat16,
                                                  rngs=nnx.Rngs(0)),
            "llama-1b": lambda: llama.LlamaForCausalLM(bench_llama.LLAMA_3_2_1B,
                                                       dtype=jnp.bfloat16, rngs=nnx.Rngs(0))}
  if args.tiny:
    models = {"tiny": lambda: gpt2.GPT2LMHeadModel(gpt2.PRESETS["tiny"], rngs=nnx.Rngs(0))}
    args.models, args.batches, args.runs, args.prompt, args.new = ["tiny"], [4], 1, 16, 16
  print(f"# bench_lora: {common.header()}")
  print(f"prompt {args.prompt}, {args.new} new tokens, greedy, EOS ignored; "
        f"{args.adapters} adapters of rank {args.rank} on every linear\n")
  print("| model | batch | base tok/s | slots, no adapter tok/s | x base | mixed tok/s "
        "| x base |")
  print("|---|---|---|---|---|---|---|")
  for name in args.models:
    model = models[name]()
    adapters = [LoraAdapter.random(model.lora_targets(), rank=args.rank, seed=i)
                for i in range(args.adapters)]
    for batch in args.batches:
      rng = np.random.default_rng(batch)
      prompts = [rng.integers(0, model.spec.vocab_size, args.prompt).tolist()
                 for _ in range(batch)]
      plain = [Request(p, args.new) for p in prompts]
      mixed = [Request(p, args.new, lora=str(i % args.adapters))
               for i, p in enumerate(prompts)]
      base_report, base_s = run(model, plain, [], args.rank, args.runs)
      _, idle_s = run(model, plain, adapters, args.rank, args.runs)
      mixed_report, mixed_s = run(model, mixed, adapters, args.rank, args.runs)
      tokens = base_report.generated_tokens
      assert mixed_report.generated_tokens == tokens
      print(f"| {name} | {batch} | {tokens / base_s:,.0f} | {tokens / idle_s:,.0f} | "
            f"{base_s / idle_s:.2f} | {tokens / mixed_s:,.0f} | **{base_s / mixed_s:.2f}** |",
            flush=True)
    del model


if __name__ == "__main__":
  main()
