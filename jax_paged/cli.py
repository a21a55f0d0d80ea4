"""The generation command line: `jax-paged-generate` / `python -m jax_paged.cli`.

Runs the continuous-batching engine over a Hugging Face checkpoint (with its tokenizer) or
over a preset configuration with random weights, whose text is encoded as UTF-8 bytes (ids
0-255). Shows a progress bar with live tokens/s on stderr, prints each completion to stdout
and ends with a report whose last line holds tokens/s. Compiled programs are kept between
runs in jax's persistent compilation cache (`--compilation-cache`).

Models are not imported here: installed packages register model families
(`jax_paged.ModelFamily`) under the entry point group `jax_paged.models`; this project
registers `models.gpt2:FAMILY` and `models.llama:FAMILY`. A checkpoint's `config.json`
`model_type` picks the family.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import dataclasses
import functools
import importlib.metadata
import json
import math
import os
import sys
import time
import warnings
from typing import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jax_paged import tensor_parallel
from jax_paged import weight_quant
from jax_paged.guided import Guide, GuideCache, Vocabulary
from jax_paged.kernels import validation
from jax_paged.paged_model import ModelFamily, PagedModel
from jax_paged.serving.admission import ADMISSION_POLICIES
from jax_paged.serving.beam_search import beam_search
from jax_paged.serving.engine import Engine
from jax_paged.serving.request import MAX_TOP_LOGPROBS, Request, TokenEvent
from jax_paged.serving import speculative
from jax_paged.serving.speculative import DraftSpeculation, NgramSpeculation

ENTRY_POINT_GROUP = "jax_paged.models"
DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}
# --kv-cache-dtype: "auto" is the compute dtype (--dtype).
KV_CACHE_DTYPES = {"auto": None, "int8": jnp.int8, "fp8": jnp.float8_e4m3fn}


class CLIError(Exception):
  """A user error, printed as one line without a traceback."""


@dataclasses.dataclass
class Codec:
  """Text <-> token ids; ids are in [0, vocab_size). `encode(text, add_special_tokens=True)`:
  with the tokenizer's own additions (a BOS), or without (a chat template writes its own);
  `decode(ids, skip_special_tokens=True)`: a completion's text leaves special tokens out,
  a prompt's shown whole keeps them."""

  encode: Callable[..., list[int]]
  decode: Callable[..., str]
  name: str
  vocab_size: int
  # Per token id, the bytes it adds to a text, None for a special token (computed once,
  # when a guide first needs them: `guided.Vocabulary.from_tokenizer`).
  token_bytes: Callable[[], tuple[bytes | None, ...]]


BYTES = Codec(encode=lambda text, add_special_tokens=True: list(text.encode("utf-8")),
              decode=lambda ids, skip_special_tokens=True: bytes(
                  i for i in ids if 0 <= i < 256).decode("utf-8", "replace"),
              name="UTF-8 bytes (ids 0-255)", vocab_size=256,
              token_bytes=lambda: tuple(bytes([i]) for i in range(256)))


# argparse types: a bad value exits with status 2 and "argument --flag: <message>".
def _int_at_least(lo: int, what: str) -> Callable[[str], int]:
  def parse(text: str) -> int:
    try:
      value = int(text)
    except ValueError:
      raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}") from None
    if value < lo:
      raise argparse.ArgumentTypeError(f"must be {what}, got {value}")
    return value
  return parse


_positive_int = _int_at_least(1, "a positive integer")
_non_negative_int = _int_at_least(0, "an integer >= 0")


def _top_logprobs(text: str) -> int:
  value = _positive_int(text)
  if value > MAX_TOP_LOGPROBS:
    raise argparse.ArgumentTypeError(f"must be in [1, {MAX_TOP_LOGPROBS}], got {value}")
  return value


def _logit_bias(text: str) -> dict[int, float]:
  try:
    pairs = [item.split(":") for item in text.split(",") if item.strip()]
    if not pairs:
      raise ValueError(text)
    return {int(token): float(value) for token, value in pairs}
  except ValueError:
    raise argparse.ArgumentTypeError(f"expected comma-separated ID:BIAS pairs, got "
                                     f"{text!r}") from None


def _non_empty(text: str) -> str:
  if not text:
    raise argparse.ArgumentTypeError("expected a non-empty text")
  return text


def _lora_module(text: str) -> tuple[str, str]:
  name, sep, path = text.partition("=")
  if not sep or not name or not path:
    raise argparse.ArgumentTypeError(f"expected NAME=PATH (a PEFT LoRA adapter directory), "
                                     f"got {text!r}")
  return name, path


def _speculative_config(text: str) -> NgramSpeculation | dict:
  """Prompt lookup's settings, validated here; a draft model's config (one naming a
  "model") as its dict, loaded beside the model (`load_model`)."""
  try:
    config = speculative.config_dict(text)
    if speculative.config_method(config) == "draft_model":
      return config
    return speculative.from_config(config)
  except ValueError as e:
    raise argparse.ArgumentTypeError(str(e)) from None


def _float_in(lo: float, hi: float, *, lo_open: bool, what: str) -> Callable[[str], float]:
  def parse(text: str) -> float:
    try:
      value = float(text)
    except ValueError:
      raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}") from None
    if not (math.isfinite(value) and (lo < value if lo_open else lo <= value)
            and value <= hi):
      raise argparse.ArgumentTypeError(f"must be {what}, got {value}")
    return value
  return parse


def _token_ids(text: str) -> list[int]:
  try:
    ids = [int(t) for t in text.split(",") if t.strip()]
  except ValueError:
    raise argparse.ArgumentTypeError(f"expected comma-separated token ids, got {text!r}") from None
  if not ids or min(ids) < 0:
    raise argparse.ArgumentTypeError(f"expected comma-separated token ids >= 0, got {text!r}")
  return ids


def load_tokenizer(directory: str) -> Codec | None:
  """The checkpoint's tokenizer (tokenizer.json, or GPT-2's vocab.json + merges.txt), or
  None if it has none."""
  try:
    import tokenizers
  except ImportError as e:
    raise CLIError("reading a checkpoint's tokenizer needs the `tokenizers` package "
                   "(pip install tokenizers)") from e
  tokenizer_json = os.path.join(directory, "tokenizer.json")
  vocab, merges = (os.path.join(directory, f) for f in ("vocab.json", "merges.txt"))
  try:
    if os.path.exists(tokenizer_json):
      tok = tokenizers.Tokenizer.from_file(tokenizer_json)
    elif os.path.exists(vocab) and os.path.exists(merges):
      tok = tokenizers.ByteLevelBPETokenizer(vocab, merges)
    else:
      return None
  except Exception as e:  # tokenizers raises bare Exceptions for unreadable files
    raise CLIError(f"{directory}: its tokenizer files cannot be read ({e})") from e
  return Codec(encode=lambda text, add_special_tokens=True: tok.encode(
                   text, add_special_tokens=add_special_tokens).ids,
               decode=lambda ids, skip_special_tokens=True: tok.decode(
                   list(ids), skip_special_tokens=skip_special_tokens),
               name=f"tokenizer of {directory}",
               vocab_size=tok.get_vocab_size(),
               token_bytes=functools.cache(lambda: Vocabulary.from_tokenizer(tok).token_bytes))


def model_families() -> list[ModelFamily]:
  """The model families registered under the `jax_paged.models` entry point group, each
  once: two copies of a distribution on the path (a checkout on PYTHONPATH beside its
  installed copy) register the same entry points twice."""
  families = []
  for entry in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP):
    family = entry.load()
    if not isinstance(family, ModelFamily):
      raise CLIError(f"entry point {entry.name} = {entry.value} in group {ENTRY_POINT_GROUP} "
                     f"is a {type(family).__name__}, not a jax_paged.ModelFamily")
    if not any(f is family for f in families):
      families.append(family)
  return families


def presets(families: Sequence[ModelFamily]) -> dict[str, Callable[..., PagedModel]]:
  """Every family's random-weight presets by name."""
  return {name: make for family in families for name, make in family.presets.items()}


def add_model_arguments(p: argparse.ArgumentParser, families: Sequence[ModelFamily]) -> None:
  """The model options (--checkpoint, --model, --dtype, --kv-cache-dtype,
  --quantization, --max-model-len)."""
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
  src.add_argument("--kv-cache-dtype", choices=list(KV_CACHE_DTYPES), default="auto",
                   help="KV cache dtype: auto (the compute dtype), int8 or fp8 (e4m3), "
                        "quantized per token and kv head: ~half the KV bytes, ~1.9x the "
                        "tokens in the same memory (fp8 needs compute capability >= 8.9)")
  src.add_argument("--quantization", choices=["none", "int8"], default="none",
                   help="int8: every linear's weights quantized at load, one scale per output "
                        "column (weight-only; activations, embeddings, the LM head and the "
                        "KV cache keep their dtypes): ~0.55-0.65x the weight memory, "
                        "decoding ~0.9-1.03x as fast (benchmarks/RESULTS.md)")
  src.add_argument("--max-model-len", type=_positive_int, default=None, metavar="N",
                   help="with --checkpoint: the longest sequence served (prompt + new "
                        "tokens), at most the config's max_position_embeddings (default: "
                        "that, or a LongRoPE model's original context: more selects its "
                        "long factors for every sequence)")


def add_engine_arguments(p: argparse.ArgumentParser, *, steps_per_call: int) -> None:
  """The engine options (slots, pages, admission, prefix caching, tensor parallel, the
  compilation cache); `steps_per_call` is --steps-per-call's default."""
  eng = p.add_argument_group("engine")
  eng.add_argument("--max-batch", type=_positive_int, default=32,
                   help="decode slots: sequences (samples, beams) decoded together "
                        "(default 32)")
  eng.add_argument("--page-size", type=_positive_int, default=16,
                   help="tokens per KV page (default 16; the GPU kernels take powers of two "
                        "in [8, 128])")
  eng.add_argument("--steps-per-call", type=_positive_int, default=steps_per_call,
                   help=f"the most decode steps per device call (default {steps_per_call})")
  eng.add_argument("--admission", choices=ADMISSION_POLICIES, default="optimistic",
                   help="optimistic: admit when the prompt fits, preempt and recompute when "
                        "the pool runs out (vLLM); peak: admit only while the projected "
                        "page use stays within the pool until every request reaches "
                        "max_new_tokens, never preempting (default optimistic)")
  size = eng.add_mutually_exclusive_group()
  size.add_argument("--num-pages", type=_positive_int, default=None,
                    help="KV pages in the pool")
  size.add_argument("--memory-fraction", default=None,
                    type=_float_in(0.0, 1.0, lo_open=True, what="a fraction in (0, 1]"),
                    help="size the pool from this fraction of the accelerator's free memory "
                         "(default 0.9 on GPU; on CPU the default is enough pages for every "
                         "slot to reach n_positions)")
  eng.add_argument("--no-prefix-caching", action="store_true",
                   help="do not share the pages of prompts that start alike (prefix caching "
                        "is on by default; tokens are the same either way)")
  eng.add_argument("--speculative-config", type=_speculative_config, default=None,
                   metavar="JSON",
                   help="speculative decoding, as vLLM's: {\"method\": \"ngram\", "
                        "\"num_speculative_tokens\": K, \"prompt_lookup_max\": N, "
                        "\"prompt_lookup_min\": M}: each decode step verifies up to K "
                        "tokens drafted from where the context's last N..M tokens occurred "
                        "before (same tokens; faster where text repeats its context); or "
                        "{\"model\": DIR, \"num_speculative_tokens\": K}: K greedy tokens "
                        "of a draft checkpoint of the same vocabulary and kv heads (same "
                        "tokens; faster where the draft agrees)")
  lora = p.add_argument_group("LoRA adapters")
  lora.add_argument("--lora-modules", type=_lora_module, nargs="+", default=[],
                    metavar="NAME=PATH",
                    help="LoRA adapters to serve (PEFT checkpoint directories), each under "
                         "its name; requests of different adapters share batches")
  lora.add_argument("--max-loras", type=_positive_int, default=None, metavar="N",
                    help="adapters on the device at once (default: every --lora-modules "
                         "adapter); requests wait while their adapter has no slot")
  lora.add_argument("--max-lora-rank", type=_positive_int, default=16, metavar="R",
                    help="the largest adapter rank served (default 16)")
  eng.add_argument("--tensor-parallel", type=_positive_int, default=1, metavar="N",
                   help="split the model over the first N devices (Megatron-style: "
                        "attention heads, the KV pool by kv head, the MLP; default 1); "
                        "the checkpoint is loaded on the host, so a model that fits "
                        "only split runs")
  cache = eng.add_mutually_exclusive_group()
  cache.add_argument("--compilation-cache", metavar="DIR", default=None,
                     help="keep compiled programs in DIR, so that a later run of the same "
                          "shapes starts without compiling them (default: "
                          "$JAX_COMPILATION_CACHE_DIR if set, else "
                          "$XDG_CACHE_HOME/jax_paged/xla or ~/.cache/jax_paged/xla)")
  cache.add_argument("--no-compilation-cache", action="store_true",
                     help="compile every program anew, keeping none")


def parse_args(argv: Sequence[str] | None, families: Sequence[ModelFamily]
               ) -> argparse.Namespace:
  return parse_model_args(build_parser(families), argv)


def build_parser(families: Sequence[ModelFamily]) -> argparse.ArgumentParser:
  p = argparse.ArgumentParser(
      prog="jax-paged-generate",
      description="Generate text with a language model over a paged KV cache (continuous "
                  "batching).")
  add_model_arguments(p, families)
  prompts = p.add_argument_group("prompts")
  prompts.add_argument("--prompt", action="append", default=[], help="a prompt (repeatable)")
  prompts.add_argument("--prompt-ids", action="append", default=[], type=_token_ids,
                       metavar="IDS", help="a prompt as comma-separated token ids (repeatable; "
                                           "for checkpoints without a tokenizer)")
  prompts.add_argument("--prompts-file", metavar="FILE",
                       help="a file with one prompt per line (empty lines are skipped)")
  gen = p.add_argument_group("generation")
  gen.add_argument("--max-new-tokens", type=_positive_int, default=64,
                   help="lowered, with a notice, where a prompt leaves less room in the "
                        "model's context (default 64)")
  gen.add_argument("--temperature", type=_float_in(0.0, float("inf"), lo_open=False,
                                                   what="a number >= 0"),
                   default=0.0, help="0 is greedy (default)")
  gen.add_argument("--top-k", type=_positive_int, default=None)
  gen.add_argument("--top-p", type=_float_in(0.0, 1.0, lo_open=True, what="in (0, 1]"),
                   default=None)
  gen.add_argument("--min-p", type=_float_in(0.0, 1.0, lo_open=False, what="in [0, 1]"),
                   default=0.0, help="keep the tokens at least this many times as likely as "
                                     "the most likely one (default 0: all)")
  gen.add_argument("--lora", metavar="NAME", default=None,
                   help="generate with this adapter of --lora-modules (default: the base "
                        "model)")
  gen.add_argument("--seed", type=_non_negative_int, default=0,
                   help="request i samples with seed + i (reproducible)")
  gen.add_argument("--ignore-eos", action="store_true",
                   help="do not stop at the model's eos token")
  gen.add_argument("--logit-bias", type=_logit_bias, default=None, metavar="ID:BIAS,...",
                   help="add BIAS (in [-100, 100]) to token ID's logit, e.g. 50256:-100 "
                        "bans GPT-2's end of text")
  gen.add_argument("--min-tokens", type=_non_negative_int, default=0,
                   help="generate at least this many tokens before a stop token may end a "
                        "completion (default 0; with --beam-width, a hypothesis)")
  guided = gen.add_mutually_exclusive_group()
  guided.add_argument("--guided-regex", metavar="PATTERN",
                      help="structured output: each completion is a whole match of the "
                           "regular expression (jax_paged.guided; needs text)")
  guided.add_argument("--guided-json", metavar="SCHEMA",
                      help="structured output: each completion is JSON valid under the "
                           "schema, a JSON text or @FILE ('{\"type\": \"object\"}': any "
                           "object)")
  guided.add_argument("--guided-choice", nargs="+", type=_non_empty, metavar="TEXT",
                      help="structured output: each completion is one of the texts")
  gen.add_argument("--stop", action="append", default=[], type=_non_empty, metavar="TEXT",
                   help="end a completion where its text first contains TEXT (cut before "
                        "it; repeatable; needs text: a tokenizer or the tiny models')")
  gen.add_argument("--logprobs", action="store_true",
                   help="print each new token's log-probability under the model (before "
                        "temperature and filters) and each completion's perplexity")
  gen.add_argument("--top-logprobs", type=_top_logprobs, default=0, metavar="K",
                   help=f"--logprobs, and each step's K most likely tokens (at most "
                        f"{MAX_TOP_LOGPROBS}) with theirs, a line per token (with "
                        "--prompt-logprobs, per prompt token too)")
  gen.add_argument("--prompt-logprobs", action="store_true",
                   help="print each prompt token's log-probability given those before it "
                        "and the prompt's perplexity (scoring a text: --max-new-tokens 1)")
  penalty = _float_in(-2.0, 2.0, lo_open=False, what="a number in [-2, 2]")
  gen.add_argument("--repetition-penalty", default=1.0,
                   type=_float_in(0.0, float("inf"), lo_open=True, what="a number > 0"),
                   help="divide (multiply where negative) the logits of tokens in the "
                        "prompt or generated by this (default 1: none)")
  gen.add_argument("--frequency-penalty", type=penalty, default=0.0,
                   help="subtract this from a token's logit per time it was generated "
                        "(default 0)")
  gen.add_argument("--presence-penalty", type=penalty, default=0.0,
                   help="subtract this from the logit of every token generated (default 0)")
  gen.add_argument("--n", type=_positive_int, default=1,
                   help="samples per prompt, sharing the prompt's pages (default 1; at most "
                        "--max-batch)")
  beam = p.add_argument_group("beam search (instead of sampling)")
  beam.add_argument("--beam-width", type=_positive_int, default=None,
                    metavar="K", help="beam search with K beams per prompt sharing their "
                    "pages (Hugging Face's num_beams); prints each prompt's best "
                    "hypotheses with their scores")
  beam.add_argument("--length-penalty", default=1.0,
                    type=_float_in(-math.inf, math.inf, lo_open=True, what="a finite number"),
                    help="hypotheses score sum of log-probabilities / length ** this "
                         "(default 1.0; > 0 favours longer ones)")
  beam.add_argument("--early-stopping", choices=("false", "true", "never"), default="false",
                    help="false: stop a prompt when its best beam can no longer beat its "
                         "worst finished one at its current length; true: once it has K "
                         "finished; never: as false, at --max-new-tokens' length when the "
                         "length penalty is > 0 (default false; Hugging Face's)")
  beam.add_argument("--num-return-sequences", type=_positive_int, default=1, metavar="N",
                    help="hypotheses printed per prompt, best first (default 1; at most K)")
  add_engine_arguments(p, steps_per_call=128)
  p.add_argument("--no-progress", action="store_true", help="no progress bar")
  return p


def parse_model_args(p: argparse.ArgumentParser, argv: Sequence[str] | None
                     ) -> argparse.Namespace:
  """`p.parse_args(argv)`, exiting with a usage error where no model is given."""
  args = p.parse_args(argv)
  if not args.checkpoint and args.model is None:
    p.error(f"no model: give --checkpoint or --model (no preset is installed: the "
            f"{ENTRY_POINT_GROUP} entry points come with `pip install -e .`)")
  return args


def default_compilation_cache() -> str:
  """Where compiled programs are kept between runs without --compilation-cache: jax's own
  $JAX_COMPILATION_CACHE_DIR if set, else jax_paged/xla under the user's cache directory
  ($XDG_CACHE_HOME, else ~/.cache)."""
  if os.environ.get("JAX_COMPILATION_CACHE_DIR"):
    return os.environ["JAX_COMPILATION_CACHE_DIR"]
  base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
  return os.path.join(base, "jax_paged", "xla")


def use_compilation_cache(directory: str) -> None:
  """Makes jax keep this process's compiled programs in `directory` (created if missing)
  and load them from it. Takes effect only before the process's first compilation."""
  try:
    os.makedirs(directory, exist_ok=True)
  except OSError as e:
    raise CLIError(f"--compilation-cache {directory}: cannot create it ({e})") from e
  if not os.access(directory, os.W_OK | os.X_OK):
    raise CLIError(f"--compilation-cache {directory}: not a writable directory")
  jax.config.update("jax_compilation_cache_dir", directory)
  # Every program, not only those compiling for over jax's default 1 s: a run compiles
  # tens of programs (prefill and decode shapes, page bookkeeping), most of them in under
  # a second each, that together take seconds.
  jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)


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
                ) -> tuple[PagedModel, Codec | None, str]:
  if args.checkpoint:
    if not os.path.isdir(args.checkpoint):
      raise CLIError(f"--checkpoint {args.checkpoint}: not a directory")
    model_type = read_model_type(args.checkpoint)
    family = next((f for f in families if model_type in f.model_types), None)
    if family is None:
      known = sorted(t for f in families for t in f.model_types)
      raise CLIError(f"--checkpoint {args.checkpoint}: model_type {model_type!r} is not "
                     f"supported (supported: {', '.join(known) or 'none installed'})")
    options = {}
    if args.max_model_len is not None:
      if not family.max_model_len:
        raise CLIError(f"--max-model-len: the {family.name} family's models (model_type "
                       f"{model_type!r}) do not take it; serve them without")
      options["max_model_len"] = args.max_model_len
    try:
      model = family.from_pretrained(args.checkpoint, dtype, **options)
    except (FileNotFoundError, ValueError, KeyError) as e:
      raise CLIError(f"--checkpoint {args.checkpoint}: {e}") from e
    codec = load_tokenizer(args.checkpoint)
    if codec is not None and codec.vocab_size > model.spec.vocab_size:
      raise CLIError(f"--checkpoint {args.checkpoint}: its tokenizer has {codec.vocab_size} "
                     f"tokens but the model's vocabulary has {model.spec.vocab_size}")
    return model, codec, f"checkpoint {args.checkpoint}"
  if args.max_model_len is not None:
    raise CLIError("--max-model-len applies to a --checkpoint, not a --model preset")
  model = presets(families)[args.model](dtype, args.seed)
  if model.spec.vocab_size < BYTES.vocab_size:
    raise CLIError(f"--model {args.model}: its vocabulary of {model.spec.vocab_size} tokens "
                   f"cannot hold the UTF-8 byte ids of its text (0-255)")
  return model, BYTES, f"{args.model} with RANDOM weights (no checkpoint)"


def read_prompts(args: argparse.Namespace, codec: Codec | None
                 ) -> list[tuple[str, list[int]]]:
  """(label, token ids) per prompt: --prompt and --prompts-file text, encoded by `codec`,
  then --prompt-ids."""
  texts = list(args.prompt)
  if args.prompts_file:
    try:
      with open(args.prompts_file, encoding="utf-8") as f:
        texts += [line.rstrip("\n") for line in f if line.strip()]
    except UnicodeDecodeError as e:
      raise CLIError(f"--prompts-file {args.prompts_file}: not UTF-8 text (byte "
                     f"{e.start})") from e
    except OSError as e:
      raise CLIError(f"--prompts-file: {e}") from e
  if texts and codec is None:
    raise CLIError("the checkpoint has no tokenizer (tokenizer.json or vocab.json + "
                   "merges.txt): give prompts as --prompt-ids")
  prompts = [(repr(t), codec.encode(t)) for t in texts]
  prompts += [(f"ids {','.join(map(str, ids))}", ids) for ids in args.prompt_ids]
  if not prompts:
    raise CLIError("give at least one --prompt, --prompt-ids or a --prompts-file")
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


def _notice(message: str, prog: str = "jax-paged-generate") -> None:
  print(f"{prog}: note: {message}", file=sys.stderr)


def _host_if(tensor_parallel: bool):
  """Where the model is built or loaded: with tensor parallel on the host's CPU, so that
  no GPU holds the whole model before the engine sends each GPU its blocks (a model that
  fits only split runs); otherwise, and where jax has no CPU backend (JAX_PLATFORMS
  without cpu), on the default device."""
  if tensor_parallel:
    try:
      return jax.default_device(jax.devices("cpu")[0])
    except RuntimeError:
      pass
  return contextlib.nullcontext()


@dataclasses.dataclass
class Loaded:
  """A model built from the model options, with what the engine needs beside it."""

  model: PagedModel
  codec: Codec | None  # None: a checkpoint without a tokenizer
  label: str  # what it is, for messages
  dtype: jnp.dtype
  mesh: object  # a tensor-parallel mesh, or None
  # --speculative-config's settings (a draft model loaded), or None
  speculation: NgramSpeculation | DraftSpeculation | None = None


def load_model(args: argparse.Namespace, families: Sequence[ModelFamily],
               prog: str = "jax-paged-generate") -> Loaded:
  """Builds the model of the model and engine options (add_model_arguments,
  add_engine_arguments): the compilation cache first, then on the devices of
  --tensor-parallel. Raises CLIError."""
  if not args.no_compilation_cache:
    use_compilation_cache(args.compilation_cache or default_compilation_cache())
  on_gpu = jax.default_backend() == "gpu"
  dtype = DTYPES[args.dtype] if args.dtype else (jnp.bfloat16 if on_gpu else jnp.float32)
  mesh = None
  if args.tensor_parallel > 1:
    try:  # before loading: a missing device is reported without reading a checkpoint
      mesh = tensor_parallel.make_mesh(args.tensor_parallel)
    except ValueError as e:
      raise CLIError(f"--tensor-parallel {args.tensor_parallel}: {e}") from e
  with _host_if(mesh is not None):
    model, codec, label = build_model(args, families, dtype)
    if args.quantization == "int8":
      if not weight_quant.quantize_weights(model):
        raise CLIError(f"--quantization int8: {label} has no nnx.Linear to quantize")
      label += ", int8 weights"
  speculation = args.speculative_config
  if isinstance(speculation, dict):  # a draft model's: loaded as the model was

    def load_draft(path: str) -> PagedModel:
      try:
        draft, _, _ = build_model(argparse.Namespace(**{**vars(args), "checkpoint": path}),
                                  families, dtype)
      except CLIError as e:  # (named as the option gave it)
        raise CLIError(f"--speculative-config: {e}".replace("--checkpoint", "draft model",
                                                            1)) from e
      if args.quantization == "int8":
        weight_quant.quantize_weights(draft)
      return draft

    try:
      speculation = speculative.from_config(speculation, load_draft)
    except (ValueError, TypeError) as e:
      raise CLIError(f"--speculative-config: {e}") from e
    label += (f", drafts by {args.speculative_config['model']} "
              f"({speculation.model.spec.num_layers} layers)")
  spec = model.spec
  if on_gpu and not validation.kernel_supports(spec.head_dim, args.page_size):
    _notice(f"--page-size {args.page_size} with head dim {spec.head_dim}: the Triton decode "
            f"kernel takes head dims {validation.SUPPORTED_HEAD_DIMS} and power-of-two pages "
            f"in [{validation.MIN_PAGE_SIZE}, {validation.MAX_PAGE_SIZE}]; attention runs "
            "on XLA's slower gather path", prog)
    # Said once here, not again by the layers as they trace.
    warnings.simplefilter("ignore", validation.ReferencePathWarning)
  if args.memory_fraction is not None and not on_gpu:
    raise CLIError("--memory-fraction sizes the pool from an accelerator's free memory; "
                   f"on {jax.default_backend()} give --num-pages")
  return Loaded(model, codec, label, jnp.dtype(dtype), mesh, speculation)


def make_engine(args: argparse.Namespace, loaded: Loaded, *,
                scheduling_policy: str = "fcfs") -> Engine:
  """The engine of the engine options, over `loaded`'s model (its codec detokenizes stop
  texts); without --num-pages on a CPU, pages for every slot to reach the model's
  context. Prints what it serves to stderr. Raises CLIError."""
  spec = loaded.model.spec
  num_pages = args.num_pages
  if num_pages is None and jax.default_backend() != "gpu":
    num_pages = args.max_batch * -(-spec.max_positions // args.page_size)
  updates = getattr(args, "allow_lora_updates", False)  # (the server's option)
  if args.max_loras is not None and not args.lora_modules and not updates:
    raise CLIError("--max-loras needs --lora-modules")
  names = [name for name, _ in args.lora_modules]
  if len(set(names)) < len(names):
    raise CLIError(f"--lora-modules names an adapter twice: {names}")
  try:
    eng = Engine(loaded.model, max_batch=args.max_batch, num_pages=num_pages,
                 memory_fraction=0.9 if args.memory_fraction is None else args.memory_fraction,
                 page_size=args.page_size, steps_per_call=args.steps_per_call,
                 admission=args.admission, prefix_caching=not args.no_prefix_caching,
                 cache_dtype=KV_CACHE_DTYPES[args.kv_cache_dtype], mesh=loaded.mesh,
                 detokenize=loaded.codec.decode if loaded.codec else None,
                 scheduling_policy=scheduling_policy, speculation=loaded.speculation,
                 max_loras=args.max_loras or len(names) or int(updates),
                 max_lora_rank=args.max_lora_rank)
    for name, path in args.lora_modules:
      eng.add_lora(name, path)
  except (ValueError, TypeError, FileNotFoundError) as e:
    raise CLIError(str(e)) from e
  except jax.errors.JaxRuntimeError as e:
    check_out_of_memory(e, None, args)
    raise
  codec = loaded.codec
  print(f"model: {loaded.label}; {spec.num_layers} layers, {spec.num_kv_heads} kv heads of "
        f"{spec.head_dim}; {loaded.dtype.name} on {args.tensor_parallel} x "
        f"{jax.devices()[0].platform}; text as {codec.name if codec else 'token ids'}",
        file=sys.stderr)
  print(f"engine: {eng.max_batch} slots, {eng.num_pages} pages of {eng.page_size} tokens, "
        f"{eng.cache_dtype.name} KV cache"
        + (f"; LoRA adapters {', '.join(names)}" if names else ""), file=sys.stderr)
  return eng


def check_out_of_memory(e: jax.errors.JaxRuntimeError, eng: Engine | None,
                        args: argparse.Namespace) -> None:
  """Raises a CLIError with advice if `e` is the device running out of memory."""
  if "RESOURCE_EXHAUSTED" not in str(e):
    return
  pool = "" if eng is None else f" with a KV pool of {eng.num_pages} pages"
  # A pool sized from free memory takes what jax reports free, which leaves out other
  # processes on the device (and, jax not preallocating, what it cannot take after all).
  advice = ("give a smaller --num-pages" if args.num_pages is not None else
            "lower --memory-fraction (of the memory jax reports free, which other "
            "processes on the device may hold) or give --num-pages")
  raise CLIError(f"out of device memory{pool}: {advice} ({str(e).splitlines()[0]})") from e


def make_guide(args: argparse.Namespace, codec: Codec | None,
               eos_token_ids: Sequence[int]) -> Guide | None:
  """The guide of --guided-regex / --guided-json / --guided-choice over the codec's
  vocabulary, or None."""
  flag, value = next(((f, v) for f, v in (("--guided-regex", args.guided_regex),
                                           ("--guided-json", args.guided_json),
                                           ("--guided-choice", args.guided_choice))
                      if v is not None), (None, None))
  if flag is None:
    return None
  if codec is None:
    raise CLIError(f"{flag} needs text, and this checkpoint has no tokenizer")
  guides = GuideCache(codec.token_bytes, eos_token_ids)
  try:
    if flag == "--guided-regex":
      return guides.regex(value)
    if flag == "--guided-choice":
      return guides.choices(value)
    if value.startswith("@"):
      try:
        with open(value[1:], encoding="utf-8") as f:
          value = f.read()
      except OSError as e:
        raise CLIError(f"--guided-json {value}: cannot read it ({e.strerror})") from e
    return guides.json_schema(value)
  except ValueError as e:  # (RegexError, SchemaError: what is not supported, and why)
    raise CLIError(f"{flag}: {e}") from e


def run(args: argparse.Namespace, families: Sequence[ModelFamily]) -> int:
  loaded = load_model(args, families)
  model, codec, mesh = loaded.model, loaded.codec, loaded.mesh
  spec = model.spec
  prompts = read_prompts(args, codec)
  # Every eos id stops a request (a config may list several: Llama 3's).
  stops = () if args.ignore_eos else spec.eos_token_ids
  if args.lora is not None and args.lora not in [name for name, _ in args.lora_modules]:
    raise CLIError(f"--lora {args.lora}: not an adapter of --lora-modules "
                   f"({', '.join(name for name, _ in args.lora_modules) or 'none given'})")
  if args.beam_width is not None:
    return run_beam_search(args, model, codec, prompts, loaded.label, stops, mesh)
  show_logprobs = args.logprobs or args.top_logprobs > 0  # (--top-logprobs implies it)
  guide = make_guide(args, codec, stops)
  requests = []
  for i, (_, ids) in enumerate(prompts):
    # New tokens lowered to what fits the model's context (at least one, so that a prompt
    # too long by itself is reported as such).
    new = max(1, min(args.max_new_tokens, spec.max_positions - len(ids) + 1))
    if new < args.max_new_tokens and len(ids) <= spec.max_positions:
      _notice(f"prompt {i}: --max-new-tokens {args.max_new_tokens} lowered to {new}: its "
              f"{len(ids)} tokens leave that much of the model's n_positions="
              f"{spec.max_positions}")
    requests.append(Request(ids, new, temperature=args.temperature, top_k=args.top_k,
                            top_p=args.top_p, min_p=args.min_p, seed=args.seed + i,
                            stop_token_ids=stops, stop=args.stop, n=args.n,
                            logprobs=show_logprobs,
                            top_logprobs=args.top_logprobs,
                            prompt_logprobs=args.prompt_logprobs,
                            repetition_penalty=args.repetition_penalty,
                            frequency_penalty=args.frequency_penalty,
                            presence_penalty=args.presence_penalty,
                            logit_bias=args.logit_bias,
                            min_tokens=min(args.min_tokens, new), guide=guide,
                            lora=args.lora))
  if args.stop and codec is None:
    raise CLIError("--stop needs text, and this checkpoint has no tokenizer (its tokens "
                   "are ids): drop --stop")
  eng = make_engine(args, loaded)
  try:
    progress = Progress(sum(r.max_new_tokens * r.n for r in requests),
                        enabled=not args.no_progress)
    logprobs = collections.defaultdict(list)  # (prompt, sample) -> its tokens' events
    scores = {}  # prompt -> its first event with prompt log-probabilities
    stop_texts = {}  # (prompt, sample) -> the stop text that ended it

    def on_token(event: TokenEvent) -> None:
      progress.update()
      if event.logprob is not None:
        logprobs[event.request_id, event.sample].append(event)
      if event.prompt_logprobs is not None:
        scores.setdefault(event.request_id, event)
      if event.stop_text is not None:
        stop_texts[event.request_id, event.sample] = event.stop_text

    outputs, report = eng.generate(requests, on_token=on_token)
    progress.close()
  except ValueError as e:
    raise CLIError(str(e)) from e
  except jax.errors.JaxRuntimeError as e:
    check_out_of_memory(e, eng, args)
    raise
  text = lambda token: repr(codec.decode([token])) if codec else str(token)

  def print_logprobs(head: str, values: list[float], tokens: list[int], tops) -> None:
    """One line of values, their mean and perplexity; with --top-logprobs a line per
    token with its step's most likely tokens."""
    print(f"{head} (mean {np.mean(values):.4f}, perplexity {np.exp(-np.mean(values)):.3f}): "
          f"{','.join(f'{v:.4f}' for v in values)}")
    for token, value, top in zip(tokens, values, tops) if args.top_logprobs else ():
      print(f"  {text(token)} {value:.4f} | "
            + ", ".join(f"{text(t)} {v:.4f}" for t, v in top))

  for i, ((prompt, ids), out) in enumerate(zip(prompts, outputs)):
    if i in scores:  # (the first token has none: nothing before it)
      e = scores[i]
      if len(ids) > 1:
        print_logprobs(f"--- [{i}] prompt logprobs", e.prompt_logprobs[1:], ids[1:],
                       (e.prompt_top_logprobs or ())[1:])
      else:
        print(f"--- [{i}] prompt logprobs: none (a one-token prompt)")
    for j, sample in enumerate([out] if args.n == 1 else out):
      label = f"[{i}]" if args.n == 1 else f"[{i}.{j}]"
      stop = stop_texts.get((i, j))
      if stop is None:
        print(f"--- {label} {prompt} -> {len(sample)} tokens")
        print(codec.decode(sample) if codec else ",".join(map(str, sample)))
      else:  # (its last token completed the stop text: the completion is the text before)
        text = codec.decode(sample)
        print(f"--- {label} {prompt} -> {len(sample)} tokens, stopped at {stop!r}")
        print(text[:text.find(stop)])
      events = logprobs[i, j][:len(sample)]
      if show_logprobs:
        print_logprobs("logprobs", [e.logprob for e in events], [e.token for e in events],
                       [e.top_logprobs for e in events])
  print(report)
  return 0


# The options beam search takes none of (their defaults are the parser's).
_NOT_FOR_BEAMS = ("temperature", "top_k", "top_p", "min_p", "n", "logit_bias", "stop",
                  "logprobs", "top_logprobs", "prompt_logprobs", "repetition_penalty",
                  "frequency_penalty", "presence_penalty", "seed", "admission",
                  "no_prefix_caching", "num_pages", "memory_fraction", "guided_regex",
                  "guided_json", "guided_choice", "speculative_config")


def run_beam_search(args: argparse.Namespace, model: PagedModel, codec: Codec | None,
                    prompts: list[tuple[str, list[int]]], label: str,
                    stops: Sequence[int], mesh) -> int:
  """--beam-width: `jax_paged.beam_search` over the prompts; prints each prompt's
  --num-return-sequences best hypotheses with their scores, then a summary."""
  defaults = build_parser([])  # (the model families change no default)
  given = [name for name in _NOT_FOR_BEAMS if getattr(args, name) != defaults.get_default(name)]
  if given:
    flags = ", ".join("--" + name.replace("_", "-") for name in given)
    raise CLIError(f"--beam-width searches deterministically over a pool of its own: "
                   f"{flags} do not apply (give them without --beam-width)")
  spec = model.spec
  longest = max(len(ids) for _, ids in prompts)
  new = max(1, min(args.max_new_tokens, spec.max_positions - longest + 1))
  if new < args.max_new_tokens:
    _notice(f"--max-new-tokens {args.max_new_tokens} lowered to {new}: the longest prompt "
            f"leaves that much of the model's n_positions={spec.max_positions}")
  early = {"false": False, "true": True, "never": "never"}[args.early_stopping]
  print(f"model: {label}; beam search, {args.beam_width} beams per prompt", file=sys.stderr)
  try:
    beams, report = beam_search(
        model, [ids for _, ids in prompts], new, beam_width=args.beam_width,
        length_penalty=args.length_penalty, early_stopping=early,
        num_return_sequences=args.num_return_sequences, eos_token_id=list(stops) or None,
        min_new_tokens=min(args.min_tokens, new),
        page_size=args.page_size, max_batch=args.max_batch,
        steps_per_call=args.steps_per_call, cache_dtype=KV_CACHE_DTYPES[args.kv_cache_dtype],
        mesh=mesh, lora=None if args.lora is None else dict(args.lora_modules)[args.lora])
  except (ValueError, FileNotFoundError) as e:
    raise CLIError(str(e)) from e
  for i, ((prompt, _), hyps) in enumerate(zip(prompts, beams)):
    for j, beam in enumerate(hyps):
      tag = f"[{i}]" if len(hyps) == 1 else f"[{i}.{j}]"
      print(f"--- {tag} {prompt} -> {len(beam.tokens)} tokens, score {beam.score:.4f}")
      print(codec.decode(beam.tokens) if codec else ",".join(map(str, beam.tokens)))
  print(f"prompts: {report.num_requests}  beams: {args.beam_width}  returned tokens: "
        f"{report.generated_tokens}  time: {report.elapsed_s:.2f} s")
  print(f"KV pages: peak {report.peak_pages_in_use} of {report.num_pages} (a wave's "
        f"beams if none shared a page past the prompt)  prefill calls: "
        f"{report.prefill_calls}  decode calls: {report.decode_calls} "
        f"({report.decode_steps} steps, {report.decode_tokens} beam tokens)")
  print(f"throughput: {report.decode_tokens / report.elapsed_s:.1f} beam tokens/s")
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
