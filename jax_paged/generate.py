"""The generation command line: `jax-paged-generate` / `python -m jax_paged.generate`.

Runs the continuous-batching engine over a Hugging Face GPT-2 checkpoint (with its
tokenizer) or over an embedded GPT-2 configuration with random weights, whose text is
encoded as UTF-8 bytes (ids 0-255). Shows a progress bar with live tokens/s on stderr,
prints each completion to stdout and ends with a report whose last line holds tokens/s.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time
from typing import Callable, Sequence

import jax
import jax.numpy as jnp
from flax import nnx

from jax_paged import engine as engine_lib
from models import gpt2

# Embedded configurations for runs without a checkpoint (random weights).
MODELS = {
    "gpt2": gpt2.GPT2Config(),
    "gpt2-medium": gpt2.GPT2Config(n_embd=1024, n_layer=24, n_head=16),
    "tiny": gpt2.GPT2Config(vocab_size=256, n_positions=512, n_embd=64, n_layer=2, n_head=4,
                            bos_token_id=None, eos_token_id=None),
}
DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}


class CLIError(Exception):
  """A user error, printed as one line without a traceback."""


@dataclasses.dataclass
class Codec:
  """Text <-> token ids."""

  encode: Callable[[str], list[int]]
  decode: Callable[[Sequence[int]], str]
  name: str


BYTES = Codec(encode=lambda text: list(text.encode("utf-8")),
              decode=lambda ids: bytes(i for i in ids if 0 <= i < 256).decode("utf-8", "replace"),
              name="UTF-8 bytes (ids 0-255)")


def load_tokenizer(directory: str) -> Codec:
  """The checkpoint's tokenizer (tokenizer.json, or GPT-2's vocab.json + merges.txt)."""
  try:
    import tokenizers
  except ImportError as e:
    raise CLIError("reading a checkpoint's tokenizer needs the `tokenizers` package "
                   "(pip install tokenizers)") from e
  tokenizer_json = os.path.join(directory, "tokenizer.json")
  vocab, merges = (os.path.join(directory, f) for f in ("vocab.json", "merges.txt"))
  if os.path.exists(tokenizer_json):
    tok = tokenizers.Tokenizer.from_file(tokenizer_json)
  elif os.path.exists(vocab) and os.path.exists(merges):
    tok = tokenizers.ByteLevelBPETokenizer(vocab, merges)
  else:
    raise CLIError(f"{directory} has no tokenizer.json nor vocab.json + merges.txt")
  return Codec(encode=lambda text: tok.encode(text).ids,
               decode=lambda ids: tok.decode(list(ids)), name=f"tokenizer of {directory}")


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
  p = argparse.ArgumentParser(
      prog="jax-paged-generate",
      description="Generate text with GPT-2 over a paged KV cache (continuous batching).")
  src = p.add_argument_group("model")
  src.add_argument("--checkpoint", metavar="DIR",
                   help="a Hugging Face GPT-2 directory (config.json + model.safetensors or "
                        "pytorch_model.bin; tokenizer.json or vocab.json + merges.txt)")
  src.add_argument("--model", choices=sorted(MODELS), default="tiny",
                   help="an embedded configuration with RANDOM weights, used when no "
                        "--checkpoint is given; text is encoded as UTF-8 bytes (default: tiny)")
  src.add_argument("--dtype", choices=sorted(DTYPES), default=None,
                   help="compute and KV-cache dtype (default: bfloat16 on GPU, float32 on CPU)")
  prompts = p.add_argument_group("prompts")
  prompts.add_argument("--prompt", action="append", default=[], help="a prompt (repeatable)")
  prompts.add_argument("--prompts-file", metavar="FILE",
                       help="a file with one prompt per line (empty lines are skipped)")
  gen = p.add_argument_group("generation")
  gen.add_argument("--max-new-tokens", type=int, default=64)
  gen.add_argument("--temperature", type=float, default=0.0, help="0 is greedy (default)")
  gen.add_argument("--top-k", type=int, default=None)
  gen.add_argument("--top-p", type=float, default=None)
  gen.add_argument("--seed", type=int, default=0,
                   help="request i samples with seed + i (reproducible)")
  gen.add_argument("--ignore-eos", action="store_true",
                   help="do not stop at the model's eos token")
  eng = p.add_argument_group("engine")
  eng.add_argument("--max-batch", type=int, default=32, help="decode slots (default 32)")
  eng.add_argument("--page-size", type=int, default=16, help="tokens per KV page (default 16)")
  eng.add_argument("--steps-per-call", type=int, default=128,
                   help="the most decode steps per device call (default 128)")
  eng.add_argument("--admission", choices=("optimistic", "peak"), default="optimistic",
                   help="optimistic: admit when the prompt fits, preempt and recompute when "
                        "the pool runs out (vLLM); peak: admit only while the projected "
                        "page use stays within the pool until every request reaches "
                        "max_new_tokens, never preempting (default optimistic)")
  size = eng.add_mutually_exclusive_group()
  size.add_argument("--num-pages", type=int, default=None, help="KV pages in the pool")
  size.add_argument("--memory-fraction", type=float, default=None,
                    help="size the pool from this fraction of the accelerator's free memory "
                         "(default 0.9 on GPU; on CPU the default is enough pages for every "
                         "slot to reach n_positions)")
  eng.add_argument("--no-progress", action="store_true", help="no progress bar")
  return p.parse_args(argv)


def build_model(args: argparse.Namespace, dtype) -> tuple[gpt2.GPT2LMHeadModel, Codec, str]:
  if args.checkpoint:
    if not os.path.isdir(args.checkpoint):
      raise CLIError(f"--checkpoint {args.checkpoint}: not a directory")
    try:
      model = gpt2.from_pretrained(args.checkpoint, dtype=dtype)
    except (FileNotFoundError, ValueError, KeyError, json.JSONDecodeError) as e:
      raise CLIError(f"--checkpoint {args.checkpoint}: {e}") from e
    return model, load_tokenizer(args.checkpoint), f"checkpoint {args.checkpoint}"
  config = MODELS[args.model]
  model = gpt2.GPT2LMHeadModel(config, dtype=dtype, rngs=nnx.Rngs(args.seed))
  return model, BYTES, f"{args.model} with RANDOM weights (no checkpoint)"


def read_prompts(args: argparse.Namespace) -> list[str]:
  prompts = list(args.prompt)
  if args.prompts_file:
    try:
      with open(args.prompts_file, encoding="utf-8") as f:
        prompts += [line.rstrip("\n") for line in f if line.strip()]
    except OSError as e:
      raise CLIError(f"--prompts-file: {e}") from e
  if not prompts:
    raise CLIError("give at least one --prompt or a --prompts-file")
  return prompts


class Progress:
  """A one-line progress bar on stderr, redrawn at most 10 times a second."""

  def __init__(self, total: int, enabled: bool):
    self.total, self.enabled = total, enabled
    self.done = 0
    self.start = self.last = time.perf_counter()

  def update(self, n: int = 1) -> None:
    self.done += n
    now = time.perf_counter()
    if self.enabled and (now - self.last > 0.1 or self.done >= self.total):
      self.last = now
      frac = self.done / max(1, self.total)
      bar = "#" * int(30 * frac)
      rate = self.done / max(now - self.start, 1e-9)
      sys.stderr.write(f"\r[{bar:<30}] {self.done}/{self.total} tokens  {rate:,.1f} tokens/s")
      sys.stderr.flush()

  def close(self) -> None:
    if self.enabled:
      sys.stderr.write("\n")


def run(args: argparse.Namespace) -> int:
  on_gpu = jax.default_backend() == "gpu"
  dtype = DTYPES[args.dtype] if args.dtype else (jnp.bfloat16 if on_gpu else jnp.float32)
  model, codec, label = build_model(args, dtype)
  texts = read_prompts(args)
  prompts = [codec.encode(t) for t in texts]
  config = model.config
  for i, ids in enumerate(prompts):
    if not ids:
      raise CLIError(f"prompt {i} encodes to no tokens")
    if len(ids) >= config.n_positions:
      raise CLIError(f"prompt {i} has {len(ids)} tokens; the model's n_positions is "
                     f"{config.n_positions}")
  num_pages = args.num_pages
  if num_pages is None and (args.memory_fraction is None and not on_gpu):
    num_pages = args.max_batch * -(-config.n_positions // args.page_size)
  eos = None if args.ignore_eos else config.eos_token_id
  try:
    eng = engine_lib.Engine(model, max_batch=args.max_batch, num_pages=num_pages,
                            memory_fraction=args.memory_fraction or 0.9,
                            page_size=args.page_size, steps_per_call=args.steps_per_call,
                            admission=args.admission,
                            eos_token_id=eos)
    requests = [engine_lib.Request(
        ids, min(args.max_new_tokens, config.n_positions - len(ids) + 1),
        temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, seed=args.seed + i)
        for i, ids in enumerate(prompts)]
    print(f"model: {label}; {config.n_layer} layers, {config.n_embd} wide; {jnp.dtype(dtype).name}"
          f" on {jax.devices()[0].platform}; text as {codec.name}", file=sys.stderr)
    print(f"engine: {eng.max_batch} slots, {eng.num_pages} pages of {eng.page_size} tokens",
          file=sys.stderr)
    progress = Progress(sum(r.max_new_tokens for r in requests),
                        enabled=not args.no_progress)
    outputs, report = eng.generate(requests, on_token=lambda event: progress.update())
    progress.close()
  except ValueError as e:
    raise CLIError(str(e)) from e
  for i, (text, out) in enumerate(zip(texts, outputs)):
    print(f"--- [{i}] {text!r} -> {len(out)} tokens")
    print(codec.decode(out))
  print(report)
  return 0


def main(argv: Sequence[str] | None = None) -> int:
  args = parse_args(argv)
  try:
    return run(args)
  except CLIError as e:
    print(f"jax-paged-generate: error: {e}", file=sys.stderr)
    return 2


if __name__ == "__main__":
  sys.exit(main())
