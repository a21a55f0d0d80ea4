"""Speculative decoding (prompt lookup, `Engine(speculation=NgramSpeculation(...))`)
against plain decoding, end to end on the GPU, in the same run.

Models with random weights, bf16: GPT-2 124M and the Llama-3.2-1B shape of
`bench_llama`. Per batch size (`--batches`), `batch` requests of a `--prompt`-token
prompt and `--new` new tokens each, EOS ignored, through an engine of `batch` slots with
and without speculation (`--num-tokens` drafts, n-grams `--min-ngram`..`--max-ngram`),
two ways:

* greedy: a random-weight model's greedy text soon repeats itself (a loop of a few
  tokens), the case prompt lookup drafts well (as text quoting its context does);
* sampled at temperature 1: a random model's next token is close to uniform over the
  vocabulary, so drafts are almost never kept: what speculation costs where it fails;
* copy: each answer quotes `--copy` tokens of its prompt (the same span, between random
  tokens, in every prompt), forced by a guide of that text over a synthetic vocabulary
  (token i spelled by three characters of its own): the best case, where a round keeps
  every draft (both engines guided alike).

Each figure is the median of three timed runs after an identical untimed one
(`bench_generate.timed`). Printed per row: new tokens/s of both, their ratio, the drafts
kept (of those verified), tokens a sequence took per verify round, and how many requests
gave exactly plain decoding's tokens (bf16: the verify forward rounds differently from a
decode step, so a near tie can flip a token, after which the texts differ).

    PYTHONPATH=. python benchmarks/bench_speculative.py            # on the GPU
    PYTHONPATH=. python benchmarks/bench_speculative.py --tiny     # smoke test on CPU
"""

from __future__ import annotations

import argparse
import string

import jax.numpy as jnp
import numpy as np
from flax import nnx

from benchmarks import bench_generate
from benchmarks import bench_llama
from benchmarks import common
from jax_paged import Engine, Guide, NgramSpeculation, Request, Vocabulary
from jax_paged.guided.regex_dfa import regex_escape
from models import gpt2
from models import llama

PAGE_SIZE = 16


ALPHABET = string.ascii_letters + string.digits + "+/"


def spelling(vocab_size: int) -> list[str]:
  """Token i's text in the copy workload's vocabulary: three characters of its own."""
  return ["".join(ALPHABET[i // 64 ** j % 64] for j in (2, 1, 0)) for i in range(vocab_size)]


def requests_of(kind: str, vocab_size: int, batch: int, prompt: int, new: int,
                copy: int) -> list[Request]:
  """The workload's requests: greedy / sampled ones of random prompts, or copy ones."""
  rng = np.random.default_rng(batch)
  if kind != "copy":
    return [Request(rng.integers(0, vocab_size, prompt).tolist(), new,
                    temperature=1.0 if kind == "sampled" else 0.0, seed=i)
            for i in range(batch)]
  span = rng.integers(0, vocab_size, copy).tolist()
  words = spelling(vocab_size)
  guide = Guide.from_regex(regex_escape("".join(words[t] for t in span)),
                           Vocabulary(tuple(w.encode() for w in words), ()))
  before = (prompt - copy) // 2
  return [Request(rng.integers(0, vocab_size, before).tolist() + span
                  + rng.integers(0, vocab_size, prompt - copy - before).tolist(), copy,
                  guide=guide) for _ in range(batch)]


def run(model, requests: list[Request], speculation, runs: int):
  """(outputs, report, seconds) of the requests through an engine of a slot each."""
  batch = len(requests)
  prompt = max(len(r.prompt) for r in requests)
  new = max(r.max_new_tokens for r in requests)
  eng = Engine(model, max_batch=batch, page_size=PAGE_SIZE,
               num_pages=batch * -(-(prompt + new) // PAGE_SIZE) + 16,
               steps_per_call=128, prefix_caching=False, speculation=speculation)
  (outputs, report), seconds = bench_generate.timed(lambda: eng.generate(requests),
                                                    runs=runs)
  return outputs, report, seconds


def main():
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--models", nargs="+", default=["gpt2", "llama-1b"],
                 choices=["gpt2", "llama-1b"])
  p.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32, 128])
  p.add_argument("--prompt", type=int, default=256)
  p.add_argument("--new", type=int, default=256)
  p.add_argument("--copy", type=int, default=128, help="the copy workload's quoted tokens")
  p.add_argument("--kinds", nargs="+", default=["greedy", "sampled", "copy"],
                 choices=["greedy", "sampled", "copy"])
  p.add_argument("--num-tokens", type=int, default=4)
  p.add_argument("--min-ngram", type=int, default=2)
  p.add_argument("--max-ngram", type=int, default=4)
  p.add_argument("--runs", type=int, default=3, help="timed runs (median)")
  p.add_argument("--tiny", action="store_true", help="a tiny GPT-2 on CPU, one run")
  args = p.parse_args()
  speculation = NgramSpeculation(num_tokens=args.num_tokens, min_ngram=args.min_ngram,
                                 max_ngram=args.max_ngram)
  models = {"gpt2": lambda: gpt2.GPT2LMHeadModel(gpt2.GPT2Config(), dtype=jnp.bfloat16,
                                                  rngs=nnx.Rngs(0)),
            "llama-1b": lambda: llama.LlamaForCausalLM(bench_llama.LLAMA_3_2_1B,
                                                       dtype=jnp.bfloat16, rngs=nnx.Rngs(0))}
  if args.tiny:
    models = {"tiny": lambda: gpt2.GPT2LMHeadModel(gpt2.PRESETS["tiny"], rngs=nnx.Rngs(0))}
    args.models, args.batches, args.runs = ["tiny"], [1, 4], 1
    args.prompt, args.new, args.copy = 32, 24, 12
  print(f"# bench_speculative: {common.header()}")
  print(f"prompt {args.prompt}, {args.new} new tokens, EOS ignored; {speculation}\n")
  print("| model | batch | decoding | plain tok/s | speculative tok/s | x plain | drafts kept "
        "| tokens per round | same tokens |")
  print("|---|---|---|---|---|---|---|---|---|")
  for name in args.models:
    model = models[name]()
    for batch in args.batches:
      for kind in args.kinds:
        requests = requests_of(kind, model.spec.vocab_size, batch, args.prompt, args.new,
                               args.copy)
        plain, plain_report, plain_s = run(model, requests, None, args.runs)
        spec, report, spec_s = run(model, requests, speculation, args.runs)
        tokens = plain_report.generated_tokens
        assert report.generated_tokens == tokens
        kept = report.accepted_tokens / max(1, report.draft_tokens)
        per_round = report.decode_tokens / max(1, report.decode_tokens - report.accepted_tokens)
        same = sum(a == b for a, b in zip(plain, spec))
        print(f"| {name} | {batch} | {kind} | "
              f"{tokens / plain_s:,.0f} | {tokens / spec_s:,.0f} | "
              f"**{plain_s / spec_s:.2f}** | {kept:.0%} | {per_round:.2f} | "
              f"{same}/{batch} |", flush=True)
    del model


if __name__ == "__main__":
  main()
