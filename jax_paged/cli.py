"""The generation command line: `jax-paged-generate` / `python -m jax_paged.cli`.

Runs the continuous-batching engine over a Hugging Face checkpoint (with its tokenizer) or
over a preset configuration with random weights, whose text is encoded as UTF-8 bytes (ids
0-255). Shows a progress bar with live tokens/s on stderr, prints each completion to stdout
and ends with a report whose last line holds tokens/s.

Models are not imported here: installed packages register model families
(`jax_paged.ModelFamily`) under the entry point group `jax_paged.models`; this project
registers `models.gpt2:FAMILY`. A checkpoint's `config.json` `model_type` picks the family.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.metadata
import json
import os
import sys
import time
from typing import Callable, Sequence

import jax
import jax.numpy as jnp

from jax_paged.paged_model import ModelFamily, PagedModel
from jax_paged.serving.admission import ADMISSION_POLICIES
from jax_paged.serving.engine import Engine
from jax_paged.serving.request import Request

ENTRY_POINT_GROUP = "jax_paged.models"
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


def model_families() -> list[ModelFamily]:
  """The model families registered under the `jax_paged.models` entry point group."""
  families = []
  for entry in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP):
    family = entry.load()
    if not isinstance(family, ModelFamily):
      raise CLIError(f"entry point {entry.name} = {entry.value} in group {ENTRY_POINT_GROUP} "
                     f"is a {type(family).__name__}, not a jax_paged.ModelFamily")
    families.append(family)
  return families


def presets(families: Sequence[ModelFamily]) -> dict[str, Callable[..., PagedModel]]:
  """Every family's random-weight presets by name."""
  return {name: make for family in families for name, make in family.presets.items()}


def parse_args(argv: Sequence[str] | None, families: Sequence[ModelFamily]
               ) -> argparse.Namespace:
  p = argparse.ArgumentParser(
      prog="jax-paged-generate",
      description="Generate text with a language model over a paged KV cache (continuous "
                  "batching).")
  src = p.add_argument_group("model")
  model_types = sorted(t for f in families for t in f.model_types)
  src.add_argument("--checkpoint", metavar="DIR",
                   help="a Hugging Face checkpoint directory (config.json whose model_type is "
                        f"one of {', '.join(model_types) or 'none installed'}, its weights, and "
                        "tokenizer.json or vocab.json + merges.txt)")
  choices = sorted(presets(families))
  src.add_argument("--model", choices=choices, default="tiny" if "tiny" in choices else None,
                   help="a preset configuration with RANDOM weights, used when no "
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
  eng.add_argument("--admission", choices=ADMISSION_POLICIES, default="optimistic",
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
  args = p.parse_args(argv)
  if not args.checkpoint and args.model is None:
    p.error(f"no model: give --checkpoint or --model (no preset is installed: the "
            f"{ENTRY_POINT_GROUP} entry points come with `pip install -e .`)")
  return args


def read_model_type(directory: str) -> str:
  """The `model_type` of a checkpoint directory's config.json."""
  config_file = os.path.join(directory, "config.json")
  try:
    with open(config_file, encoding="utf-8") as f:
      config = json.load(f)
  except FileNotFoundError as e:
    raise CLIError(f"--checkpoint {directory}: no config.json") from e
  except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
    raise CLIError(f"{config_file}: not a readable JSON file ({e})") from e
  if not isinstance(config, dict) or not isinstance(config.get("model_type"), str):
    raise CLIError(f"{config_file}: has no \"model_type\" string")
  return config["model_type"]


def build_model(args: argparse.Namespace, families: Sequence[ModelFamily], dtype
                ) -> tuple[PagedModel, Codec, str]:
  if args.checkpoint:
    if not os.path.isdir(args.checkpoint):
      raise CLIError(f"--checkpoint {args.checkpoint}: not a directory")
    model_type = read_model_type(args.checkpoint)
    family = next((f for f in families if model_type in f.model_types), None)
    if family is None:
      known = sorted(t for f in families for t in f.model_types)
      raise CLIError(f"--checkpoint {args.checkpoint}: model_type {model_type!r} is not "
                     f"supported (supported: {', '.join(known) or 'none installed'})")
    try:
      model = family.from_pretrained(args.checkpoint, dtype)
    except (FileNotFoundError, ValueError, KeyError, json.JSONDecodeError) as e:
      raise CLIError(f"--checkpoint {args.checkpoint}: {e}") from e
    return model, load_tokenizer(args.checkpoint), f"checkpoint {args.checkpoint}"
  model = presets(families)[args.model](dtype, args.seed)
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


def run(args: argparse.Namespace, families: Sequence[ModelFamily]) -> int:
  on_gpu = jax.default_backend() == "gpu"
  dtype = DTYPES[args.dtype] if args.dtype else (jnp.bfloat16 if on_gpu else jnp.float32)
  model, codec, label = build_model(args, families, dtype)
  spec = model.spec
  texts = read_prompts(args)
  prompts = [codec.encode(t) for t in texts]
  num_pages = args.num_pages
  if num_pages is None and (args.memory_fraction is None and not on_gpu):
    num_pages = args.max_batch * -(-spec.max_positions // args.page_size)
  eos = None if args.ignore_eos else spec.eos_token_id
  try:
    eng = Engine(model, max_batch=args.max_batch, num_pages=num_pages,
                 memory_fraction=args.memory_fraction or 0.9, page_size=args.page_size,
                 steps_per_call=args.steps_per_call, admission=args.admission,
                 eos_token_id=eos)
    # New tokens clamped to what fits the model's context (at least one, so that a prompt
    # too long by itself is reported as such).
    requests = [Request(ids, max(1, min(args.max_new_tokens, spec.max_positions - len(ids) + 1)),
                        temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
                        seed=args.seed + i)
                for i, ids in enumerate(prompts)]
    print(f"model: {label}; {spec.num_layers} layers, {spec.num_kv_heads} kv heads of "
          f"{spec.head_dim}; {jnp.dtype(dtype).name} on {jax.devices()[0].platform}; text as "
          f"{codec.name}", file=sys.stderr)
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
  try:
    families = model_families()
    return run(parse_args(argv, families), families)
  except CLIError as e:
    print(f"jax-paged-generate: error: {e}", file=sys.stderr)
    return 2


if __name__ == "__main__":
  sys.exit(main())
