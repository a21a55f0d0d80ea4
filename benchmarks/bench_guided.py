"""Structured output: the engine's throughput with every request guided (a JSON schema,
any JSON object, a regular expression) against the same requests unguided, and the host
time to build each guide.

GPT-2 124M with random weights, bf16, on a byte-level vocabulary of GPT-2's size (50,257)
made of the 256 bytes, random substrings of Python's own source files (lengths 2-12, as
BPE merges of code and text) and the eos: `--batch` prompts of `--prompt` random tokens,
`--new` new tokens at most, temperature 1 (a random model's draws are near uniform, so
the guide decides much of each answer). Each throughput is the median of three timed
runs after an identical untimed one, in new tokens per second; answers that ended by
their guide are checked (JSON parsed and validated, the regex matched).

    PYTHONPATH=. python benchmarks/bench_guided.py            # on the GPU
    PYTHONPATH=. python benchmarks/bench_guided.py --tiny     # smoke test on CPU
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import random
import re
import sysconfig
import time

import jax.numpy as jnp
import numpy as np
from flax import nnx

from benchmarks import common
from benchmarks.bench_generate import timed
from jax_paged import Engine, Guide, Request, Vocabulary
from models import gpt2

SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 16},
    "age": {"type": "integer", "minimum": 0},
    "email": {"type": "string", "maxLength": 24},
    "roles": {"type": "array", "items": {"enum": ["admin", "dev", "ops"]}, "maxItems": 3},
    "active": {"type": "boolean"}}, "required": ["name", "age", "active"]}
REGEX = r"(\d{3}-){2}\d{4}( [A-Z][a-z]{1,12}){1,3}"


def synthetic_vocabulary(size: int, eos: int, seed: int = 0) -> Vocabulary:
  """The 256 bytes, then distinct random substrings of Python's standard library sources
  (UTF-8, cut anywhere), the eos last."""
  rng = random.Random(seed)
  files = sorted(glob.glob(os.path.join(sysconfig.get_paths()["stdlib"], "*.py")))
  text = b"".join(open(f, "rb").read() for f in files[:200])
  tokens, seen = [bytes([i]) for i in range(256)], set()
  while len(tokens) < size - 1:
    at, n = rng.randrange(len(text) - 16), rng.randint(2, 12)
    piece = text[at:at + n]
    if piece not in seen:
      seen.add(piece)
      tokens.append(piece)
  tokens.insert(eos, None)
  return Vocabulary(tuple(tokens[:size]), (eos,))


def _valid(kind: str, text: str) -> bool:
  if kind == "regex":
    return re.fullmatch(REGEX, text) is not None
  try:
    value = json.loads(text)
  except ValueError:
    return False
  if kind == "object":
    return isinstance(value, dict)
  try:
    import jsonschema
  except ImportError:
    return isinstance(value, dict) and {"name", "age", "active"} <= set(value)
  return jsonschema.Draft202012Validator(SCHEMA).is_valid(value)


def main():
  p = argparse.ArgumentParser()
  p.add_argument("--tiny", action="store_true", help="a tiny model and workload (CPU smoke)")
  p.add_argument("--batch", type=int, default=256)
  p.add_argument("--prompt", type=int, default=64)
  p.add_argument("--new", type=int, default=128)
  p.add_argument("--steps-per-call", type=int, default=32)
  args = p.parse_args()
  if args.tiny:
    config = gpt2.GPT2Config(vocab_size=2000, n_positions=256, n_embd=64, n_layer=2,
                             n_head=4)
    args.batch, args.prompt, args.new, dtype, page_size = 8, 16, 48, jnp.float32, 8
  else:
    config, dtype, page_size = gpt2.GPT2Config(), jnp.bfloat16, 16
  eos = config.vocab_size - 1
  model = gpt2.GPT2LMHeadModel(config, dtype=dtype, rngs=nnx.Rngs(0))
  start = time.perf_counter()
  vocab = synthetic_vocabulary(config.vocab_size, eos)
  vocab_s = time.perf_counter() - start
  guides = {}
  build_s = {}
  for kind, build in (("schema", lambda: Guide.from_json_schema(SCHEMA, vocab)),
                      ("object", lambda: Guide.from_json_schema(None, vocab)),
                      ("regex", lambda: Guide.from_regex(REGEX, vocab))):
    start = time.perf_counter()
    guides[kind] = build()
    build_s[kind] = time.perf_counter() - start
  rng = np.random.default_rng(0)
  prompts = rng.integers(0, eos, (args.batch, args.prompt)).tolist()
  pages = args.batch * -(-(args.prompt + args.new) // page_size)
  engine = Engine(model, max_batch=args.batch, num_pages=pages, page_size=page_size,
                  eos_token_id=eos, steps_per_call=args.steps_per_call, prefix_caching=False)
  lines = [f"# bench_guided: {common.header()}", "",
           f"GPT-2 {config.n_layer}L/{config.n_embd}, {jnp.dtype(dtype).name}, a synthetic "
           f"byte-level vocabulary of {vocab.size} tokens (built in {vocab_s:.1f} s): "
           f"{args.batch} prompts of {args.prompt} random tokens, at most {args.new} new "
           f"tokens, temperature 1, {args.steps_per_call} steps per call; new tokens per "
           "second (median of 3). Each guided run is compared with the same requests "
           "unguided and cut to the guided answers' lengths (the same tokens to generate).",
           "", "| guide | states | built (s) | new tokens | guided (ms) | new tokens/s | "
           "unguided, same lengths (ms) | guided / unguided | answers ended by the guide, "
           "valid |", "|---|---|---|---|---|---|---|---|---|"]
  emit = common.emitter(lines)
  print("\n".join(lines), flush=True)
  for kind, guide in guides.items():
    requests = [Request(prompt, args.new, temperature=1.0, seed=i, guide=guide)
                for i, prompt in enumerate(prompts)]
    outputs, sec = timed(lambda: engine.generate(requests)[0])
    # The same requests unguided, each cut to its guided answer's length (an eos drawn
    # earlier by chance: ~1 in 50k per token).
    plain = [Request(prompt, len(out), temperature=1.0, seed=i)
             for i, (prompt, out) in enumerate(zip(prompts, outputs))]
    _, plain_sec = timed(lambda: engine.generate(plain)[0])
    tokens = sum(map(len, outputs))
    ended = valid = 0
    for out in outputs:
      if len(out) < args.new or guide.done[guide.walk(0, out)]:
        ended += 1
        text = b"".join(vocab.token_bytes[t] or b"" for t in out).decode("utf-8", "replace")
        valid += _valid(kind, text)
    emit(f"| {kind} | {guide.num_states} | {build_s[kind]:.2f} | {tokens:,} | "
         f"{sec * 1e3:.1f} | {tokens / sec:,.0f} | {plain_sec * 1e3:.1f} | "
         f"{plain_sec / sec:.2f}x | {ended} / {valid} |")
  with open(os.path.join(common.out_dir(), "bench_guided.md"), "w") as f:
    f.write("\n".join(lines) + "\n")


if __name__ == "__main__":
  main()
