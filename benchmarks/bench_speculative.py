"""Speculative decoding (prompt lookup, `Engine(speculation=NgramSpeculation(...))`; or a
draft model, `DraftSpeculation`, with `--draft`) against plain decoding, end to end on the
GPU, in the same run.

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

With `--draft`: a Qwen3-8B-shaped target (36 layers, 32 q heads over 8 kv heads of 128,
q / k norms) drafted for by a Qwen3-0.6B-shaped draft (28 layers, hidden 1024, 16 / 8
heads of 128), both random, greedy requests: two random models almost never agree, so
the run measures what a round costs (the draft's `--num-tokens` steps, the verify
forward and the draft's catch-up over the same tokens) against a plain step; what a
round then gains is its acceptance's to say: with a fraction a of drafts kept, a round
takes (1 - a^(k+1)) / (1 - a) tokens (printed for a = 0.6 and 0.8: real pairs' range).

Each figure is the median of three timed runs after an identical untimed one
(`bench_generate.timed`). Printed per row: new tokens/s of both, their ratio, the drafts
kept (of those verified), tokens a sequence took per verify round, and how many requests
gave exactly plain decoding's tokens (bf16: the verify forward rounds differently from a
decode step, so a near tie can flip a token, after which the texts differ).

    PYTHONPATH=. python benchmarks/bench_speculative.py            # on the GPU
    PYTHONPATH=. python benchmarks/bench_speculative.py --draft --batches 1 8 32
    PYTHONPATH=. python benchmarks/bench_speculative.py --tiny [--draft]  # CPU smoke test
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
from jax_paged import DraftSpeculation, Engine, Guide, NgramSpeculation, Request, Vocabulary
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


# --draft: Qwen3-8B's and Qwen3-0.6B's shapes (Hugging Face config.json fields).
_QWEN3 = dict(model_type="qwen3", vocab_size=151936, num_key_value_heads=8, head_dim=128,
              max_position_embeddings=40960, rms_norm_eps=1e-6, rope_theta=1000000.0,
              bos_token_id=151643, eos_token_id=151645)
QWEN3_8B = dict(_QWEN3, hidden_size=4096, intermediate_size=12288, num_hidden_layers=36,
                num_attention_heads=32, tie_word_embeddings=False)
QWEN3_0_6B = dict(_QWEN3, hidden_size=1024, intermediate_size=3072, num_hidden_layers=28,
                  num_attention_heads=16, tie_word_embeddings=True)


def kept_per_round(acceptance: float, k: int) -> float:
  """Tokens a round takes when each draft is kept with probability `acceptance`."""
  return float(sum(acceptance ** i for i in range(k + 1)))


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
  p.add_argument("--draft", action="store_true",
                 help="a draft model's drafts (Qwen3-0.6B's shape for Qwen3-8B's)")
  p.add_argument("--tiny", action="store_true", help="a tiny GPT-2 on CPU, one run")
  args = p.parse_args()
  if args.draft:
    return draft_main(args)
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


def draft_main(args) -> None:
  """--draft: the Qwen3-8B shape with and without its Qwen3-0.6B-shaped draft, greedy."""
  dtype = jnp.bfloat16
  shapes = (QWEN3_8B, QWEN3_0_6B)
  if args.tiny:
    shapes = tuple(dict(c, vocab_size=512, hidden_size=c["hidden_size"] // 16,
                        intermediate_size=64, num_hidden_layers=1, head_dim=16)
                   for c in shapes)
    dtype, args.batches, args.runs, args.prompt, args.new = jnp.float32, [2], 1, 16, 12
  target, draft = (llama.LlamaForCausalLM(llama.LlamaConfig.from_dict(c), dtype=dtype,
                                          rngs=nnx.Rngs(seed))
                   for seed, c in enumerate(shapes))
  k = args.num_tokens
  speculation = DraftSpeculation(draft, num_tokens=k)
  print(f"# bench_speculative --draft: {common.header()}")
  print(f"target {target.spec.num_layers} layers, draft {draft.spec.num_layers} layers "
        f"(random weights); prompt {args.prompt}, {args.new} new tokens, greedy, EOS "
        f"ignored; {k} drafts per round\n")
  print("| batch | plain tok/s | step ms | drafted tok/s | round ms | round / step | drafts "
        f"kept | x plain at a = 0.6 / 0.8 (k = {k}) |")
  print("|---|---|---|---|---|---|---|---|")
  for batch in args.batches:
    requests = requests_of("greedy", target.spec.vocab_size, batch, args.prompt, args.new, 0)
    _, plain_report, plain_s = run(target, requests, None, args.runs)
    _, report, spec_s = run(target, requests, speculation, args.runs)
    tokens = plain_report.generated_tokens
    assert report.generated_tokens == tokens
    step = plain_report.decode_s / plain_report.decode_steps  # (decode calls' time only)
    round_ = report.decode_s / report.decode_steps
    gains = [kept_per_round(a, k) * step / round_ for a in (0.6, 0.8)]
    print(f"| {batch} | {tokens / plain_s:,.0f} | {step * 1e3:.2f} | {tokens / spec_s:,.0f} | "
          f"{round_ * 1e3:.2f} | {round_ / step:.2f} | "
          f"{report.accepted_tokens / max(1, report.draft_tokens):.1%} | "
          f"{gains[0]:.2f} / {gains[1]:.2f} |", flush=True)


if __name__ == "__main__":
  main()
