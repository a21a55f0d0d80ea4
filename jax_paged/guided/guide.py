"""A guide: which tokens may come next so that the generated text matches a pattern.

A `Guide` is a regular expression's byte automaton (`regex_dfa.compile_regex`) lifted to
a vocabulary's tokens: `table[state, token]` is the state after the token's bytes, -1
where they leave every match (outlines' index, built here for all states at once with
numpy). The engine carries one state per guided sequence on the device, masks the
logits to the state's tokens before sampling, and ends the sequence when its text is
complete (`done`); the vocabulary's end-of-sequence tokens are allowed exactly where the
text so far is a whole match.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import json
import os
from typing import Sequence

import numpy as np

from jax_paged.guided import json_schema, regex_dfa

# Threads that lift a guide's states to tokens (`_lift`), at most.
MAX_LIFT_THREADS = 16
# A guide whose token table would exceed this many entries (states x vocabulary) is
# refused: it is held on the device while requests use it (int16, 2 bytes an entry).
MAX_TABLE_ENTRIES = 1 << 27


@dataclasses.dataclass(frozen=True, eq=False)
class Vocabulary:
  """A tokenizer's tokens as the bytes they add to a text.

  Attributes:
    token_bytes: per token id, its bytes, or None for a token that is no text (special
      and control tokens: never allowed by a guide, except the end tokens below).
    eos_token_ids: tokens that end a sequence: allowed where the text is a whole match.
  """

  token_bytes: tuple[bytes | None, ...]
  eos_token_ids: tuple[int, ...] = ()

  def __post_init__(self):
    if not all(t is None or isinstance(t, bytes) for t in self.token_bytes):
      raise TypeError("token_bytes must hold bytes or None per token id")
    bad = [t for t in self.eos_token_ids if not 0 <= t < len(self.token_bytes)]
    if bad:
      raise ValueError(f"eos_token_ids {bad} outside the vocabulary's "
                       f"{len(self.token_bytes)} tokens")

  @property
  def size(self) -> int:
    return len(self.token_bytes)

  @classmethod
  def of_bytes(cls, eos_token_ids: Sequence[int] = ()) -> "Vocabulary":
    """Token i < 256 is the byte i (jax_paged's byte-level test models)."""
    return cls(tuple(bytes([i]) for i in range(256)), tuple(eos_token_ids))

  @classmethod
  def from_tokenizer(cls, tokenizer, eos_token_ids: Sequence[int] = ()) -> "Vocabulary":
    """A Hugging Face tokenizer's tokens (a `tokenizers.Tokenizer`, or a transformers fast
    tokenizer: its `backend_tokenizer`): byte-level BPE tokens (GPT-2, Llama 3, Qwen)
    through GPT-2's byte alphabet; SentencePiece-style tokens (Llama 2, Mistral) with
    "\u2581" as a space and <0xXX> as the byte XX; special added tokens None."""
    tok = getattr(tokenizer, "backend_tokenizer", tokenizer)
    decoder = json.dumps(json.loads(tok.to_str()).get("decoder"))
    byte_level = '"ByteLevel"' in decoder
    alphabet = _byte_level_alphabet()
    added = tok.get_added_tokens_decoder()
    out: list[bytes | None] = []
    for i in range(tok.get_vocab_size()):
      text = tok.id_to_token(i)
      if text is None or (i in added and added[i].special):
        out.append(None)
      elif i in added:
        out.append(text.encode("utf-8"))
      elif byte_level:
        out.append(bytes(alphabet[c] for c in text) if all(c in alphabet for c in text)
                   else None)
      elif len(text) == 6 and text.startswith("<0x") and text.endswith(">"):
        out.append(bytes([int(text[3:5], 16)]))
      else:
        out.append(text.replace("\u2581", " ").encode("utf-8"))
    return cls(tuple(out), tuple(eos_token_ids))


def _byte_level_alphabet() -> dict[str, int]:
  """GPT-2's byte-level BPE alphabet: the printable character standing for each byte."""
  printable = [*range(33, 127), *range(161, 173), *range(174, 256)]
  extra = iter(range(256, 512))
  return {chr(b if b in printable else next(extra)): b for b in range(256)}


@dataclasses.dataclass(frozen=True, eq=False)
class Guide:
  """A pattern over a vocabulary's tokens. State 0 starts.

  Attributes:
    table: int16 [states, vocabulary size]: each state's next state per token, -1 where
      the token is not allowed (an end token in a matching state maps to the state).
    done: bool [states]: the text is a whole match and nothing may follow (the engine
      ends the sequence there with finish_reason 'stop').
    accepting: bool [states]: the text is a whole match.
    description: what it was built from (for messages).
  """

  table: np.ndarray
  done: np.ndarray
  accepting: np.ndarray
  description: str

  @property
  def num_states(self) -> int:
    return len(self.done)

  @property
  def vocab_size(self) -> int:
    return self.table.shape[1]

  def walk(self, state: int, tokens: Sequence[int]) -> int:
    """The state after `tokens` from `state`; -1 once a token is not allowed."""
    for token in tokens:
      if state < 0:
        break
      state = int(self.table[state, token])
    return state

  @classmethod
  def from_regex(cls, pattern: str, vocabulary: Vocabulary) -> "Guide":
    """Texts that wholly match `pattern` (`regex_dfa`'s subset of Python's syntax).

    Raises:
      ValueError (`regex_dfa.RegexError`): the pattern cannot be matched by an automaton,
        or its table would be too large.
    """
    return _lift(regex_dfa.compile_regex(pattern), vocabulary, f"regex {pattern!r:.200}")

  @classmethod
  def from_json_schema(cls, schema, vocabulary: Vocabulary) -> "Guide":
    """JSON texts valid under `schema` (a dict, or its JSON text; `json_schema`'s subset);
    `schema=None`: any JSON object (OpenAI's json_object mode)."""
    return _lift(regex_dfa.compile_regex(json_schema.to_regex(schema)), vocabulary,
                 "JSON object" if schema is None else f"JSON schema {str(schema):.200}")

  @classmethod
  def from_choices(cls, texts: Sequence[str], vocabulary: Vocabulary) -> "Guide":
    """One of `texts` (non-empty strings) exactly."""
    if (isinstance(texts, str) or not texts
        or not all(isinstance(t, str) and t for t in texts)):
      raise ValueError(f"choices must be a non-empty list of non-empty texts, got "
                       f"{texts!r:.200}")
    pattern = "|".join(regex_dfa.regex_escape(t) for t in texts)
    return _lift(regex_dfa.compile_regex(pattern), vocabulary, f"choice of {len(texts)}")


def _lift(dfa: regex_dfa.ByteDFA, vocabulary: Vocabulary, description: str) -> Guide:
  """The token table of a byte DFA: every state's walk over every token's bytes at once,
  tokens sorted by length so that step i walks those longer than i (a prefix)."""
  if not isinstance(vocabulary, Vocabulary):
    raise TypeError(f"vocabulary must be a jax_paged.guided.Vocabulary, got "
                    f"{type(vocabulary).__name__}")
  states, vocab = dfa.num_states, vocabulary.size
  if states * vocab > MAX_TABLE_ENTRIES:
    raise regex_dfa.RegexError(
        f"{description}: its automaton has {states} states, whose table over {vocab} "
        f"tokens would exceed {MAX_TABLE_ENTRIES} entries: simplify it")
  if states >= np.iinfo(np.int16).max:
    raise regex_dfa.RegexError(f"{description}: {states} states exceed the int16 table")
  texts = [(i, t) for i, t in enumerate(vocabulary.token_bytes) if t]
  texts.sort(key=lambda it: -len(it[1]))
  ids = np.asarray([i for i, _ in texts], np.int64)
  lengths = np.asarray([len(t) for _, t in texts], np.int64)
  longest = int(lengths[0]) if len(texts) else 0
  data = np.zeros((longest, len(texts)), np.int32)  # [byte position, token]
  for row, (_, t) in enumerate(texts):
    data[:len(t), row] = np.frombuffer(t, np.uint8)
  # A dead state at index `states` absorbs every byte.
  step = 256 * np.concatenate([np.where(dfa.table >= 0, dfa.table, states),
                               np.full((1, 256), states, np.int32)]).astype(np.int32).ravel()
  walking = np.searchsorted(-lengths, -np.arange(1, longest + 1), side="right")
  # The states split among threads (numpy's `take` releases the interpreter's lock).
  threads = max(1, min(os.cpu_count() or 1, MAX_LIFT_THREADS, states // 32))
  chunks = np.array_split(np.arange(states, dtype=np.int32), threads)
  with concurrent.futures.ThreadPoolExecutor(threads) as pool:
    at = np.concatenate(list(pool.map(lambda c: _walk(step, data, walking, c), chunks)),
                        axis=1)
  table = np.full((states, vocab), -1, np.int16)
  table[:, ids] = np.where(at < states, at, -1).T
  live_bytes = (dfa.table >= 0).any(axis=1)
  for eos in vocabulary.eos_token_ids:
    table[:, eos] = np.where(dfa.accepting, np.arange(states), -1)
  done = dfa.accepting & ~live_bytes
  single = {t[0] for t in vocabulary.token_bytes if t is not None and len(t) == 1}
  if len(single) < 256:  # some byte is no token: a state may have no way on in tokens
    _prune_dead_ends(table, dfa.accepting & (done | bool(vocabulary.eos_token_ids)),
                     description)
  return Guide(table, done, dfa.accepting.copy(), description)


def _walk(step: np.ndarray, data: np.ndarray, walking: np.ndarray, first: np.ndarray
          ) -> np.ndarray:
  """int32 [tokens, len(first)]: each token's state after its bytes from each state of
  `first` (`_lift`'s arrays; the dead state where none).

  The walk holds each token's states times 256 (the flat index of their row of `step`,
  which holds next states times 256) in a row: the tokens longer than i are the first
  rows, a contiguous block, and a step is one flat `take` (~7x faster than a 2-D gather
  over states by rows and tokens strided: 641 states x 50k tokens, dev CPU)."""
  at = np.repeat(first[None, :] * 256, data.shape[1], axis=0)
  for i, n in enumerate(walking):  # tokens longer than i are the first walking[i]
    at[:n] = step.take(at[:n] + data[i, :n, None])
  return at // 256


def _prune_dead_ends(table: np.ndarray, ends: np.ndarray, description: str) -> None:
  """Disallows (in place) the tokens into states from which no tokens reach a state in
  `ends` (bool [states], where a sequence may end)."""
  live = regex_dfa.live_states(table, ends)
  if not live[0]:
    raise regex_dfa.RegexError(f"{description}: the vocabulary's tokens cannot spell any "
                               "match")
  table[(table >= 0) & ~live[np.maximum(table, 0)]] = -1
