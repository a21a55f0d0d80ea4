"""Speculative decoding: by prompt lookup (n-gram drafts; vLLM's `method: "ngram"`), or by
a draft model (vLLM's `method: "draft_model"`).

A decode round guesses each sequence's next tokens. By prompt lookup, from its own
context: where the last n tokens (n from `max_ngram` down to `min_ngram`) occurred
before, the tokens that followed that occurrence are the drafts. By a draft model, a
smaller model of the same vocabulary decodes them greedily, one after another, from its
own K/V of the sequence (`DraftedModel`: its layers after the target's in one pool,
written by every forward the target runs). The model then verifies a row's newest token and
its drafts in one forward over its paged prefix (a prefill with `start`), which gives
the logits at every drafted position at the cost of about one decode step while decoding
is bound by reading the weights and the cache. The token at each position is drawn
exactly as plain decoding draws it (same logits processors, guide state and per-index
key: `runner.speculative_loop`), and the drafts are kept while they equal those draws:
the output is the one plain decoding gives, greedy or sampled, and each round keeps
between 1 and `num_tokens` + 1 tokens.

Prompt lookup pays where text repeats its context: code edits, summaries and extraction
quoting the prompt, structured output, a model that loops. Elsewhere a round costs a bit
more than a step and keeps one token (benchmarks/RESULTS.md, "Speculative decoding"). A
draft model pays where it agrees with the target often and costs it little: a round runs
num_tokens draft steps besides the verifying forward.

This module holds the settings, the drafted model and the device functions of drafting
and acceptance; the runner's loop runs them.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any, Callable

import jax
import jax.numpy as jnp
from flax import nnx

from jax_paged import pool as pool_lib
from jax_paged.kernels.validation import check_positive_int
from jax_paged.paged_model import ModelSpec, PagedModel, offers_prompt_logprobs

# The most drafts a round verifies: its forward runs num_tokens + 1 positions per row
# and samples each of them in turn.
MAX_SPECULATIVE_TOKENS = 15

# The context a proposal looks in by default: the last this many tokens of a sequence
# (its history travels to the device with each decode call).
LOOKUP_WINDOW = 2048


# `NgramSpeculation.from_config`: vLLM's names of the settings.
_CONFIG_NAMES = {"num_tokens": "num_speculative_tokens", "min_ngram": "prompt_lookup_min",
                 "max_ngram": "prompt_lookup_max"}


@dataclasses.dataclass(frozen=True)
class NgramSpeculation:
  """Prompt-lookup speculative decoding's settings (`Engine(speculation=...)`).

  Attributes:
    num_tokens: drafts per round (vLLM's num_speculative_tokens), 1 ..
      MAX_SPECULATIVE_TOKENS.
    min_ngram, max_ngram: the lengths of the context's suffix looked up, longest first
      (vLLM's prompt_lookup_min / _max), 1 <= min_ngram <= max_ngram.
    lookup_window: the last this many tokens of a sequence's context are searched.
  """

  num_tokens: int = 4
  min_ngram: int = 2
  max_ngram: int = 4
  lookup_window: int = LOOKUP_WINDOW

  def __post_init__(self):
    check_num_tokens(self.num_tokens)
    for name in ("min_ngram", "max_ngram", "lookup_window"):
      check_positive_int(name, getattr(self, name))
    if self.min_ngram > self.max_ngram:
      raise ValueError(f"min_ngram ({self.min_ngram}) must be <= max_ngram "
                       f"({self.max_ngram})")
    if self.max_ngram >= self.lookup_window:
      raise ValueError(f"max_ngram ({self.max_ngram}) must be below lookup_window "
                       f"({self.lookup_window})")

  @classmethod
  def from_config(cls, config: str | dict[str, Any]) -> "NgramSpeculation":
    """From vLLM's `speculative_config` (a dict or its JSON): method "ngram",
    num_speculative_tokens (required), prompt_lookup_max (default 4), prompt_lookup_min
    (default 2, or prompt_lookup_max when that is smaller). Raises ValueError naming what
    is wrong."""
    config = config_dict(config)
    known = {"method", "num_speculative_tokens", "prompt_lookup_max", "prompt_lookup_min"}
    if set(config) - known:
      raise ValueError(f"speculative config: unknown keys {sorted(set(config) - known)} "
                       f"(known: {sorted(known)})")
    if config.get("method", "ngram") != "ngram":
      raise ValueError(f"speculative config: method {config['method']!r} is not supported "
                       "(only \"ngram\": prompt lookup)")
    if "num_speculative_tokens" not in config:
      raise ValueError("speculative config needs num_speculative_tokens")
    max_ngram = config.get("prompt_lookup_max", 4)
    min_ngram = config.get("prompt_lookup_min",
                           min(2, max_ngram) if isinstance(max_ngram, int) else 2)
    try:
      return cls(num_tokens=config["num_speculative_tokens"], min_ngram=min_ngram,
                 max_ngram=max_ngram)
    except ValueError as e:  # (named as the config names them)
      message = str(e)
      for ours, theirs in _CONFIG_NAMES.items():
        message = message.replace(ours, theirs)
      raise ValueError(f"speculative config: {message}") from None


def check_num_tokens(num_tokens: Any) -> None:
  """ValueError unless num_tokens (drafts per round) is an int in [1,
  MAX_SPECULATIVE_TOKENS]."""
  check_positive_int("num_tokens", num_tokens)
  if num_tokens > MAX_SPECULATIVE_TOKENS:
    raise ValueError(f"num_tokens must be <= {MAX_SPECULATIVE_TOKENS}, got {num_tokens}")


def config_dict(config: str | dict[str, Any]) -> dict[str, Any]:
  """A speculative config's dict (given as one, or as its JSON); ValueError otherwise."""
  if isinstance(config, str):
    try:
      config = json.loads(config)
    except json.JSONDecodeError as e:
      raise ValueError(f"speculative config is not JSON ({e}): {config!r}") from None
  if not isinstance(config, dict):
    raise ValueError(f"speculative config must be a JSON object, got {config!r}")
  return config


@dataclasses.dataclass(frozen=True)
class DraftSpeculation:
  """Draft-model speculative decoding's settings (`Engine(speculation=...)`).

  Attributes:
    model: the draft, a `PagedModel` with `prefill_hidden`, `logits` and
      `pool_layer_offset` (every family of models/ has them) whose vocabulary and pool
      shape per layer (kv heads, head dim, dtype) are the target's: Qwen3-0.6B for the
      larger Qwen3s, Llama-3.2-3B for Llama-3.1-8B. Its greedy tokens are the drafts.
    num_tokens: drafts per round (vLLM's num_speculative_tokens), 1 ..
      MAX_SPECULATIVE_TOKENS: the draft decodes that many steps per round.
  """

  model: Any = dataclasses.field(compare=False, repr=False)
  num_tokens: int = 4

  def __post_init__(self):
    check_num_tokens(self.num_tokens)
    if not isinstance(self.model, PagedModel) or not offers_prompt_logprobs(self.model):
      raise TypeError(f"a draft model must be a jax_paged.PagedModel with `prefill_hidden` "
                      f"and `logits`, got {type(self.model).__name__}")
    if not isinstance(getattr(self.model, "pool_layer_offset", None), int):
      raise TypeError(f"{type(self.model).__name__} cannot be a draft model: it has no "
                      "`pool_layer_offset` (see jax_paged.PagedModel)")


def config_method(config: dict[str, Any]) -> str:
  """A speculative config's (a dict's) method: its own, else "draft_model" where it
  names a "model", else "ngram"."""
  return config.get("method", "draft_model" if "model" in config else "ngram")


def from_config(config: str | dict[str, Any],
                load_model: Callable[[str], PagedModel] | None = None
                ) -> NgramSpeculation | DraftSpeculation:
  """From vLLM's `speculative_config` (a dict or its JSON): method "ngram"
  (`NgramSpeculation.from_config`), or "draft_model" (the default where the config
  names a "model"): model, a checkpoint directory that `load_model` loads, and
  num_speculative_tokens (required). Raises ValueError naming what is wrong."""
  config = config_dict(config)
  method = config_method(config)
  if method == "ngram":
    return NgramSpeculation.from_config(config)
  if method != "draft_model":
    raise ValueError(f"speculative config: method {method!r} is not supported (\"ngram\": "
                     "prompt lookup, or \"draft_model\" with a \"model\")")
  known = {"method", "model", "num_speculative_tokens"}
  if set(config) - known:
    raise ValueError(f"speculative config: unknown keys {sorted(set(config) - known)} for "
                     f"method \"draft_model\" (known: {sorted(known)})")
  for key in ("model", "num_speculative_tokens"):
    if key not in config:
      raise ValueError(f"speculative config: method \"draft_model\" needs {key}")
  if not isinstance(config["model"], str):
    raise ValueError(f"speculative config: model must be a checkpoint directory, got "
                     f"{config['model']!r}")
  if load_model is None:
    raise ValueError("speculative config: a draft model's checkpoint needs a load_model")
  tokens = config["num_speculative_tokens"]
  try:  # (before loading a checkpoint)
    check_num_tokens(tokens)
  except ValueError as e:
    raise ValueError(f"speculative config: {e}".replace("num_tokens",
                                                        "num_speculative_tokens")) from None
  return DraftSpeculation(load_model(config["model"]), tokens)


class DraftedModel(nnx.Module):
  """A target model and its draft over one pool (`DraftSpeculation`), a `PagedModel`.

  The pool holds the target's layers, then the draft's (the draft's `pool_layer_offset`,
  set on a copy of it sharing its arrays), so every page operation (reservation and its
  copy-on-write, forks, prefix caching, release, preemption) moves both models' K/V; and
  each forward the runner runs (`prefill`, `prefill_hidden`, `decode`) writes the draft's
  K/V of the same tokens after the target's, so the draft's cache always holds what the
  target's does. The outputs are the target's; the draft's own are drawn by
  `draft_tokens`.

  Raises ValueError where the draft's vocabulary, kv heads, head dim or dtype are not the
  target's.
  """

  def __init__(self, target: PagedModel, draft: PagedModel):
    t, d = target.spec, draft.spec
    for name in ("vocab_size", "num_kv_heads", "head_dim"):
      if getattr(t, name) != getattr(d, name):
        raise ValueError(f"the draft model's {name} ({getattr(d, name)}) must be the "
                         f"target's ({getattr(t, name)}): both share one pool of pages")
    if jnp.dtype(t.dtype) != jnp.dtype(d.dtype):
      raise ValueError(f"the draft model's dtype ({jnp.dtype(d.dtype).name}) must be the "
                       f"target's ({jnp.dtype(t.dtype).name}): both share one pool")
    self.target = target
    graphdef, state = nnx.split(draft)  # (a copy with its own Variables: the caller's
    self.draft = nnx.merge(graphdef, jax.tree.map(lambda x: x, state))  # draft unchanged)
    self.draft.pool_layer_offset = t.num_layers

  @property
  def spec(self) -> ModelSpec:
    """The target's, with both models' layers, up to the shorter context."""
    t, d = self.target.spec, self.draft.spec
    return dataclasses.replace(t, num_layers=t.num_layers + d.num_layers,
                               max_positions=min(t.max_positions, d.max_positions))

  def prefill(self, tokens, kv, slots, lengths, *, start=None, page_table=None):
    logits, kv = self.target.prefill(tokens, kv, slots, lengths, start=start,
                                     page_table=page_table)
    return logits, self._draft_writes(tokens, kv, slots, lengths, start, page_table)

  def prefill_hidden(self, tokens, kv, slots, lengths, *, start=None, page_table=None):
    hidden, kv = self.target.prefill_hidden(tokens, kv, slots, lengths, start=start,
                                            page_table=page_table)
    return hidden, self._draft_writes(tokens, kv, slots, lengths, start, page_table)

  def _draft_writes(self, tokens, kv, slots, lengths, start, page_table) -> pool_lib.KVPool:
    # (The draft's hidden states are unused: jit drops the work past its last K/V write.)
    return self.draft.prefill_hidden(tokens, kv, slots, lengths, start=start,
                                     page_table=page_table)[1]

  def decode(self, tokens, positions, kv, slots, page_table, lengths, *, greedy=False):
    out, kv = self.target.decode(tokens, positions, kv, slots, page_table, lengths,
                                 greedy=greedy)
    _, kv = self.draft.decode(tokens, positions, kv, slots, page_table, lengths,
                              greedy=True)
    return out, kv

  def logits(self, h: jax.Array) -> jax.Array:
    return self.target.logits(h)

  def tensor_parallel_splits(self) -> list:
    """Both models' (`jax_paged.tensor_parallel`): each split as it is alone."""
    splits = []
    for model in (self.target, self.draft):
      if not callable(getattr(model, "tensor_parallel_splits", None)):
        raise TypeError(f"{type(model).__name__} cannot run tensor parallel: it lists no "
                        "`tensor_parallel_splits()` (see jax_paged.PagedModel)")
      splits += model.tensor_parallel_splits()
    return splits


def draft_tokens(draft: PagedModel, kv: pool_lib.KVPool, tokens: jax.Array,
                 slots: jax.Array, start: jax.Array, count: jax.Array,
                 page_table: jax.Array) -> tuple[jax.Array, pool_lib.KVPool]:
  """Each row's drafts, the draft model's greedy tokens: it decodes the row's newest token
  (at position start), then each draft in turn, through its own layers of the pool.

  Args:
    draft: `DraftedModel.draft`.
    kv: the pool, the newest token's and the drafts' slots reserved.
    tokens: int32 [B], each row's newest token.
    slots: int32 [B, k + 1], the newest token's slot, then the drafts'.
    start: int32 [B], the tokens each row held before its newest.
    count: int32 [B], the drafts each row takes (0 for an inactive row), <= k.
    page_table: int32 [B, max_pages_per_seq], the rows' pages.

  Returns:
    (int32 [B, k] drafts, meaningful up to count; the pool with the draft's K/V of the
    newest token and the first count - 1 drafts written: the verifying forward writes
    them all again, `DraftedModel.prefill_hidden`).
  """
  k = slots.shape[1] - 1

  def step(i, carry):
    kv, token, drafts = carry
    run = i < count
    token, kv = draft.decode(token, start + i, kv, jnp.where(run, slots[:, i], -1),
                             page_table, jnp.where(run, start + i + 1, 0), greedy=True)
    return kv, token, drafts.at[:, i].set(token)

  drafts = jnp.zeros((tokens.shape[0], k), jnp.int32)
  kv, _, drafts = jax.lax.fori_loop(0, k, step, (kv, tokens, drafts))
  return drafts, kv


def propose(history: jax.Array, length: jax.Array, allowance: jax.Array, *,
            num_tokens: int, min_ngram: int, max_ngram: int
            ) -> tuple[jax.Array, jax.Array]:
  """Each row's drafts: the tokens that followed the latest earlier occurrence of its
  context's last n tokens, for the longest n in [min_ngram, max_ngram] that occurred.

  Args:
    history: int32 [B, W], each row's context (its last tokens, newest last) from column
      0; entries past its length are ignored.
    length: int32 [B], the tokens of each row in `history`.
    allowance: int32 [B], the tokens the row may still take this round: it gets at most
      allowance - 1 drafts (the round keeps one token past its accepted drafts).
    num_tokens, min_ngram, max_ngram: (static) `NgramSpeculation`'s.

  Returns:
    (int32 [B, num_tokens] drafts, meaningful up to the count; int32 [B] count).
  """
  b, w = history.shape
  j = jnp.arange(w)
  rows = jnp.arange(b)
  # Column i of shifted[i] is history[:, j + i]: an occurrence at j of an n-gram compares
  # shifted[0 .. n-1] at j with the suffix.
  shifted = [jnp.pad(history[:, i:], ((0, 0), (0, i)), constant_values=-1)
             for i in range(max_ngram)]
  follows = jnp.full((b,), -1, jnp.int32)  # where the drafts start
  for n in range(min_ngram, max_ngram + 1):  # a longer match overrides a shorter
    match = j[None, :] + n < length[:, None]  # a token follows the occurrence
    for i in range(n):
      match &= shifted[i] == history[rows, jnp.clip(length - n + i, 0, w - 1)][:, None]
    latest = jnp.max(jnp.where(match, j[None, :], -1), axis=1)
    follows = jnp.where((latest >= 0) & (length >= n), latest + n, follows)
  count = jnp.where(follows >= 0, jnp.minimum(num_tokens, length - follows), 0)
  count = jnp.clip(jnp.minimum(count, allowance - 1), 0, num_tokens)
  drafts = history[rows[:, None], jnp.clip(follows[:, None] + jnp.arange(num_tokens),
                                           0, w - 1)]
  return drafts, count.astype(jnp.int32)


def accepted(targets: jax.Array, drafts: jax.Array, count: jax.Array) -> jax.Array:
  """int32 [B]: how many leading drafts (of the first count int32 [B] of drafts int32
  [B, k]) equal the verified tokens at their positions (targets int32 [B, >= k]: the
  token drawn after the newest token, then after each draft)."""
  k = drafts.shape[1]
  match = (targets[:, :k] == drafts) & (jnp.arange(k)[None, :] < count[:, None])
  return jnp.sum(jnp.cumprod(match.astype(jnp.int32), axis=1), axis=1)
