"""A regular expression as a deterministic automaton over UTF-8 bytes.

Python's own parser (`re._parser`) reads the pattern; its parse becomes a Thompson NFA
whose edges are sets of bytes (characters by their UTF-8 encodings, character classes by
the byte-range sequences that encode their code point ranges, as Rust's regex-syntax
does), then a DFA by subset construction over the bytes' equivalence classes, pruned of
states that cannot reach a match and minimized (Moore's partition refinement).

The whole text must match (`re.fullmatch`). Supported: literals, `.`, classes (ranges,
negation, `\\d \\w \\s` and their negations, with ASCII meanings as under `re.ASCII`),
groups, alternation, `* + ? {m,n}` (greedy, lazy or possessive: as languages they are
the same), `^` / `$` / `\\A` / `\\Z` at the ends, and the flag `s` (DOTALL). Refused with
a message: backreferences, lookaround, conditionals, word boundaries and ignore-case.
"""

from __future__ import annotations

import dataclasses
import re

import numpy as np

try:  # Python >= 3.11
  import re._constants as C  # noqa: N812 (the parse's opcodes)
  import re._parser as sre_parse
except ImportError:  # 3.10
  import sre_constants as C  # noqa: N812
  import sre_parse

# (3.11's; never in a 3.10 parse)
_ATOMIC_GROUP = getattr(C, "ATOMIC_GROUP", object())
_POSSESSIVE_REPEAT = getattr(C, "POSSESSIVE_REPEAT", object())

MAX_CODE_POINT = 0x10FFFF
# Repetitions are unrolled: a bound past this is refused rather than built.
MAX_REPEAT = 1000
# A pattern whose NFA or DFA grows past these is refused (each DFA state costs the token
# table one row of the vocabulary).
MAX_NFA_STATES = 200_000
MAX_DFA_STATES = 20_000

_ASCII_CATEGORIES = {
    C.CATEGORY_DIGIT: [(0x30, 0x39)],
    C.CATEGORY_WORD: [(0x30, 0x39), (0x41, 0x5A), (0x5F, 0x5F), (0x61, 0x7A)],
    C.CATEGORY_SPACE: [(0x09, 0x0D), (0x20, 0x20)],
}
_NEGATED_CATEGORIES = {C.CATEGORY_NOT_DIGIT: C.CATEGORY_DIGIT,
                       C.CATEGORY_NOT_WORD: C.CATEGORY_WORD,
                       C.CATEGORY_NOT_SPACE: C.CATEGORY_SPACE}


class RegexError(ValueError):
  """A pattern this module cannot turn into an automaton, with the reason."""


@dataclasses.dataclass(frozen=True, eq=False)
class ByteDFA:
  """A DFA over bytes: state 0 starts; `table` int32 [states, 256] is each state's next
  state per byte, -1 where no match can follow; `accepting` bool [states]."""

  table: np.ndarray
  accepting: np.ndarray

  @property
  def num_states(self) -> int:
    return len(self.accepting)

  def matches(self, data: bytes) -> bool:
    """Whether the whole of `data` matches."""
    state = 0
    for byte in data:
      state = self.table[state, byte]
      if state < 0:
        return False
    return bool(self.accepting[state])


def regex_escape(text: str) -> str:
  """`text` as a pattern that matches only itself."""
  return "".join("\\" + c if c in ".^$*+?{}[]\\|()" else c for c in text)


def _normalize(ranges: list[tuple[int, int]]) -> list[tuple[int, int]]:
  """Sorted, merged code point ranges."""
  out: list[tuple[int, int]] = []
  for lo, hi in sorted(ranges):
    if out and lo <= out[-1][1] + 1:
      out[-1] = (out[-1][0], max(out[-1][1], hi))
    else:
      out.append((lo, hi))
  return out


def _complement(ranges: list[tuple[int, int]]) -> list[tuple[int, int]]:
  out, at = [], 0
  for lo, hi in _normalize(ranges):
    if lo > at:
      out.append((at, lo - 1))
    at = hi + 1
  if at <= MAX_CODE_POINT:
    out.append((at, MAX_CODE_POINT))
  return out


def _utf8_sequences(lo: int, hi: int) -> list[list[tuple[int, int]]]:
  """The code points lo..hi (surrogates skipped) as sequences of byte ranges, each
  sequence a product of ranges (Rust regex-syntax's Utf8Sequences)."""
  out = []
  for a, b in ((0, 0xD7FF), (0xE000, MAX_CODE_POINT)):  # no surrogates in UTF-8
    if max(lo, a) <= min(hi, b):
      out += _split_lengths(max(lo, a), min(hi, b))
  return out


def _split_lengths(lo: int, hi: int) -> list[list[tuple[int, int]]]:
  out = []
  for length, top in ((1, 0x7F), (2, 0x7FF), (3, 0xFFFF), (4, MAX_CODE_POINT)):
    if lo <= top:
      out += _split_same_length(lo, min(hi, top), length)
      if hi <= top:
        return out
      lo = top + 1
  return out


def _split_same_length(lo: int, hi: int, length: int) -> list[list[tuple[int, int]]]:
  for i in range(1, length):
    m = (1 << (6 * i)) - 1
    if lo & ~m != hi & ~m:
      if lo & m:
        return (_split_same_length(lo, lo | m, length)
                + _split_same_length((lo | m) + 1, hi, length))
      if hi & m != m:
        return (_split_same_length(lo, (hi & ~m) - 1, length)
                + _split_same_length(hi & ~m, hi, length))
  return [list(zip(chr(lo).encode(), chr(hi).encode()))]


def _byte_set(lo: int, hi: int) -> int:
  """Bytes lo..hi as a 256-bit mask."""
  return ((1 << (hi - lo + 1)) - 1) << lo


class _NFA:
  """Thompson NFA: per state, epsilon edges and (byte mask, target) edges."""

  def __init__(self):
    self.eps: list[list[int]] = []
    self.edges: list[list[tuple[int, int]]] = []

  def state(self) -> int:
    if len(self.eps) >= MAX_NFA_STATES:
      raise RegexError(f"the pattern's automaton grows past {MAX_NFA_STATES} states "
                       "(repetition bounds multiply it): simplify it")
    self.eps.append([])
    self.edges.append([])
    return len(self.eps) - 1

  def chars(self, ranges: list[tuple[int, int]]) -> tuple[int, int]:
    """A fragment (start, end) matching one character of `ranges`."""
    start, end = self.state(), self.state()
    for lo, hi in _normalize(ranges):
      for seq in _utf8_sequences(lo, hi):
        at = start
        for k, (blo, bhi) in enumerate(seq):
          to = end if k == len(seq) - 1 else self.state()
          self.edges[at].append((_byte_set(blo, bhi), to))
          at = to
    return start, end


def _class_ranges(items, pattern: str) -> list[tuple[int, int]]:
  ranges, negate = [], False
  for op, arg in items:
    if op is C.NEGATE:
      negate = True
    elif op is C.LITERAL:
      ranges.append((arg, arg))
    elif op is C.RANGE:
      ranges.append(arg)
    elif op is C.CATEGORY:
      if arg in _ASCII_CATEGORIES:
        ranges += _ASCII_CATEGORIES[arg]
      elif arg in _NEGATED_CATEGORIES:
        ranges += _complement(_ASCII_CATEGORIES[_NEGATED_CATEGORIES[arg]])
      else:
        raise RegexError(f"{pattern!r}: the class category {arg} is not supported")
    else:
      raise RegexError(f"{pattern!r}: {op} inside a character class is not supported")
  return _complement(ranges) if negate else ranges


def _build(nfa: _NFA, parsed, pattern: str, dotall: bool) -> tuple[int, int]:
  """A fragment (start, end) for a parsed sequence."""
  start = end = nfa.state()
  for i, (op, arg) in enumerate(parsed):
    if op is C.LITERAL:
      frag = nfa.chars([(arg, arg)])
    elif op is C.NOT_LITERAL:
      frag = nfa.chars(_complement([(arg, arg)]))
    elif op is C.ANY:
      frag = nfa.chars([(0, MAX_CODE_POINT)] if dotall else _complement([(10, 10)]))
    elif op is C.IN:
      frag = nfa.chars(_class_ranges(arg, pattern))
    elif op is C.BRANCH:
      frag = nfa.state(), nfa.state()
      for alternative in arg[1]:
        s, e = _build(nfa, alternative, pattern, dotall)
        nfa.eps[frag[0]].append(s)
        nfa.eps[e].append(frag[1])
    elif op is C.SUBPATTERN:
      group, add_flags, del_flags, sub = arg
      if add_flags & ~re.DOTALL & ~re.UNICODE or del_flags & ~re.DOTALL:
        raise RegexError(f"{pattern!r}: inline flags other than (?s) are not supported")
      frag = _build(nfa, sub, pattern,
                    (dotall or bool(add_flags & re.DOTALL)) and not del_flags & re.DOTALL)
    elif op is _ATOMIC_GROUP:
      frag = _build(nfa, arg, pattern, dotall)
    elif op in (C.MAX_REPEAT, C.MIN_REPEAT, _POSSESSIVE_REPEAT):
      frag = _repeat(nfa, arg, pattern, dotall)
    elif op is C.AT:
      at_start = arg in (C.AT_BEGINNING, C.AT_BEGINNING_STRING) and i == 0
      at_end = arg in (C.AT_END, C.AT_END_STRING) and i == len(parsed) - 1
      if not (at_start or at_end):
        raise RegexError(f"{pattern!r}: anchors and word boundaries are supported only as "
                         "^ / \\A at the start and $ / \\Z at the end (the whole text "
                         "matches)")
      continue
    else:
      name = {C.GROUPREF: "backreferences", C.ASSERT: "lookaround",
              C.ASSERT_NOT: "lookaround", C.GROUPREF_EXISTS: "conditionals"}.get(op, op)
      raise RegexError(f"{pattern!r}: {name} cannot be matched by a finite automaton; not "
                       "supported")
    nfa.eps[end].append(frag[0])
    end = frag[1]
  return start, end


def _repeat(nfa: _NFA, arg, pattern: str, dotall: bool) -> tuple[int, int]:
  lo, hi, sub = arg
  unbounded = hi is C.MAXREPEAT
  if lo > MAX_REPEAT or (not unbounded and hi > MAX_REPEAT):
    raise RegexError(f"{pattern!r}: repetition bounds above {MAX_REPEAT} are not supported")
  start = end = nfa.state()
  for _ in range(lo):
    s, e = _build(nfa, sub, pattern, dotall)
    nfa.eps[end].append(s)
    end = e
  if unbounded:
    s, e = _build(nfa, sub, pattern, dotall)
    nfa.eps[end].append(s)
    nfa.eps[e].append(s)
    after = nfa.state()
    nfa.eps[end].append(after)
    nfa.eps[e].append(after)
    return start, after
  after = nfa.state()
  for _ in range(hi - lo):  # each optional copy may skip to the end
    nfa.eps[end].append(after)
    s, e = _build(nfa, sub, pattern, dotall)
    nfa.eps[end].append(s)
    end = e
  nfa.eps[end].append(after)
  return start, after


def _byte_classes(nfa: _NFA) -> np.ndarray:
  """int32 [256]: each byte's class; bytes of a class go along the same edges."""
  masks = sorted({m for edges in nfa.edges for m, _ in edges})
  member = np.stack([np.unpackbits(np.frombuffer(m.to_bytes(32, "little"), np.uint8),
                                   bitorder="little") for m in masks] or [np.zeros(256)])
  return np.unique(member.T, axis=0, return_inverse=True)[1].reshape(-1).astype(np.int32)


def _closure(nfa: _NFA, states) -> frozenset[int]:
  seen, stack = set(states), list(states)
  while stack:
    for t in nfa.eps[stack.pop()]:
      if t not in seen:
        seen.add(t)
        stack.append(t)
  return frozenset(seen)


def compile_regex(pattern: str) -> ByteDFA:
  """The minimal DFA over UTF-8 bytes of the texts that wholly match `pattern`.

  Raises:
    RegexError: the pattern is not valid, uses what a finite automaton cannot match (see
      the module's docstring), matches no text at all, or its automaton is too large.
  """
  if not isinstance(pattern, str):
    raise RegexError(f"a pattern must be a str, got {type(pattern).__name__}")
  try:
    parsed = sre_parse.parse(pattern)
  except re.error as e:
    raise RegexError(f"{pattern!r} is not a valid regular expression: {e}") from None
  flags = parsed.state.flags
  if flags & ~(re.DOTALL | re.UNICODE):
    raise RegexError(f"{pattern!r}: flags other than (?s) are not supported")
  nfa = _NFA()
  start, final = _build(nfa, parsed, pattern, bool(flags & re.DOTALL))
  classes = _byte_classes(nfa)
  num_classes = int(classes.max()) + 1
  representative = [int(np.argmax(classes == c)) for c in range(num_classes)]
  # Subset construction over the byte classes.
  first = _closure(nfa, [start])
  ids, order, rows = {first: 0}, [first], []
  while len(rows) < len(order):
    current = order[len(rows)]
    row = []
    for byte in representative:
      targets = {t for s in current for m, t in nfa.edges[s] if (m >> byte) & 1}
      if not targets:
        row.append(-1)
        continue
      nxt = _closure(nfa, targets)
      if nxt not in ids:
        if len(order) >= MAX_DFA_STATES:
          raise RegexError(f"{pattern!r}: its automaton grows past {MAX_DFA_STATES} states")
        ids[nxt] = len(order)
        order.append(nxt)
      row.append(ids[nxt])
    rows.append(row)
  table = np.asarray(rows, np.int32).reshape(len(order), num_classes)
  accepting = np.asarray([final in s for s in order])
  table, accepting = _minimize(*_prune(table, accepting))
  if not len(accepting):
    raise RegexError(f"{pattern!r} matches no text")
  return ByteDFA(np.ascontiguousarray(table[:, classes]), accepting)


def live_states(table: np.ndarray, ends: np.ndarray) -> np.ndarray:
  """bool [states]: the states of a transition table (int [states, symbols], -1: none)
  from which some path reaches a state in `ends` (bool [states])."""
  live = ends.copy()
  while True:
    more = live | ((table >= 0) & live[np.maximum(table, 0)]).any(axis=1)
    if (more == live).all():
      return live
    live = more


def _prune(table: np.ndarray, accepting: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
  """Keeps the states from which a match can be reached (state 0 first); edges to the
  others become -1. Empty arrays if state 0 cannot reach one."""
  live = live_states(table, accepting)
  if not live[0]:
    return table[:0], accepting[:0]
  new_id = np.cumsum(live) - 1
  table = table[live]
  table = np.where((table >= 0) & live[np.maximum(table, 0)], new_id[np.maximum(table, 0)],
                   -1)
  return table.astype(np.int32), accepting[live]


def _minimize(table: np.ndarray, accepting: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
  """The minimal equivalent DFA (Moore): states split by acceptance, then by their
  blocks' next blocks until nothing splits; state 0's block stays state 0."""
  if not len(accepting):
    return table, accepting
  block = accepting.astype(np.int64)
  count = len(np.unique(block))
  while True:
    nxt = np.where(table >= 0, block[np.maximum(table, 0)], -1)
    block = np.unique(np.concatenate([block[:, None], nxt], axis=1), axis=0,
                      return_inverse=True)[1].reshape(-1)
    if block.max() + 1 == count:
      break
    count = block.max() + 1
  # Renumber blocks in order of first appearance, so that state 0's block is 0.
  _, first_at = np.unique(block, return_index=True)
  order = np.argsort(first_at)
  renumber = np.empty_like(order)
  renumber[order] = np.arange(len(order))
  block = renumber[block]
  reps = np.sort(first_at)
  small = np.where(table[reps] >= 0, block[np.maximum(table[reps], 0)], -1)
  return small.astype(np.int32), accepting[reps]
