"""Speculative decoding by prompt lookup (n-gram drafts; vLLM's `method: "ngram"`).

A decode round guesses each sequence's next tokens from its own context: where the last
n tokens (n from `max_ngram` down to `min_ngram`) occurred before, the tokens that
followed that occurrence are the drafts. The model then verifies a row's newest token and
its drafts in one forward over its paged prefix (a prefill with `start`), which gives
the logits at every drafted position at the cost of about one decode step while decoding
is bound by reading the weights and the cache. The token at each position is drawn
exactly as plain decoding draws it (same logits processors, guide state and per-index
key: `runner.speculative_loop`), and the drafts are kept while they equal those draws:
the output is the one plain decoding gives, greedy or sampled, and each round keeps
between 1 and `num_tokens` + 1 tokens.

It pays where text repeats its context: code edits, summaries and extraction quoting the
prompt, structured output, a model that loops. Elsewhere a round costs a bit more than a
step and keeps one token (benchmarks/RESULTS.md, "Speculative decoding").

This module holds the settings and the device functions of drafting and acceptance; the
runner's loop runs them.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any

import jax
import jax.numpy as jnp

from jax_paged.kernels.validation import check_positive_int

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
    for name in ("num_tokens", "min_ngram", "max_ngram", "lookup_window"):
      check_positive_int(name, getattr(self, name))
    if self.num_tokens > MAX_SPECULATIVE_TOKENS:
      raise ValueError(f"num_tokens must be <= {MAX_SPECULATIVE_TOKENS}, got "
                       f"{self.num_tokens}")
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
    if isinstance(config, str):
      try:
        config = json.loads(config)
      except json.JSONDecodeError as e:
        raise ValueError(f"speculative config is not JSON ({e}): {config!r}") from None
    if not isinstance(config, dict):
      raise ValueError(f"speculative config must be a JSON object, got {config!r}")
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
