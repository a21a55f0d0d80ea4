"""Guides built once per pattern: a server sees the same schemas again and again, and
building one over a 50k-token vocabulary takes ~0.1-1 s."""

from __future__ import annotations

import collections
import functools
import json
import threading
from typing import Any, Callable, Sequence

from jax_paged.guided.guide import Guide, Vocabulary

# Guides kept (least recently used dropped first): each holds a table of states x
# vocabulary int16 (~33 MB for a JSON object with GPT-2's vocabulary).
MAX_GUIDES = 32


class GuideCache:
  """Guides over one vocabulary, by what they were built from; safe to share between
  threads (two threads asking for a new guide at once may both build it).

  Args:
    token_bytes: returns each token's bytes (`Vocabulary.token_bytes`); called once, when
      the first guide is built.
    eos_token_ids: the tokens that end a sequence (allowed where the text is a match).
  """

  def __init__(self, token_bytes: Callable[[], Sequence[bytes | None]],
               eos_token_ids: Sequence[int] = ()):
    self._read_token_bytes, self._eos = token_bytes, tuple(eos_token_ids)
    self._vocabularies: dict[bool, Vocabulary] = {}
    self._guides: collections.OrderedDict = collections.OrderedDict()
    self._lock = threading.Lock()

  def vocabulary(self, ends: bool = True) -> Vocabulary:
    """The vocabulary, with the eos tokens (`ends`) or without (a request that ignores
    them: a guide must not let it end, nor write them)."""
    if ends not in self._vocabularies:
      eos = tuple(t for t in self._eos if 0 <= t < len(self._token_bytes)) if ends else ()
      self._vocabularies[ends] = Vocabulary(self._token_bytes, eos)
    return self._vocabularies[ends]

  @functools.cached_property
  def _token_bytes(self) -> tuple[bytes | None, ...]:
    return tuple(self._read_token_bytes())

  def regex(self, pattern: str, *, ends: bool = True) -> Guide:
    """`Guide.from_regex` (raises its ValueError); `ends`: the eos tokens end a match."""
    return self._get(("regex", pattern, ends),
                     lambda: Guide.from_regex(pattern, self.vocabulary(ends)))

  def json_schema(self, schema: Any, *, ends: bool = True) -> Guide:
    """`Guide.from_json_schema` (raises its ValueError); None: any JSON object."""
    key = ("json", json.dumps(schema), ends)  # (not sorted: properties come in their order)
    return self._get(key, lambda: Guide.from_json_schema(schema, self.vocabulary(ends)))

  def choices(self, texts: Sequence[str], *, ends: bool = True) -> Guide:
    """`Guide.from_choices` (raises its ValueError)."""
    return self._get(("choices", tuple(texts), ends),
                     lambda: Guide.from_choices(list(texts), self.vocabulary(ends)))

  def _get(self, key: tuple, build: Callable[[], Guide]) -> Guide:
    with self._lock:
      if key in self._guides:
        self._guides.move_to_end(key)
        return self._guides[key]
    guide = build()
    with self._lock:
      self._guides[key] = guide
      while len(self._guides) > MAX_GUIDES:
        self._guides.popitem(last=False)
    return guide
