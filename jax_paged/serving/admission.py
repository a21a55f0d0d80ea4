"""Admission policies: whether a waiting request may start now.

The scheduler opens a round with the running sequences, then asks `fits` for each waiting
request in arrival order and `add`s those it admits, stopping at the first that does not
fit (a request that does not fit alone in an empty engine is admitted anyway: validation
made sure it fits the pool by itself).
"""

from __future__ import annotations

from typing import Protocol, Sequence

from jax_paged.serving.kv_cache_manager import KVCacheManager


class AdmissionPolicy(Protocol):
  """Decides admissions from the KV-cache manager's page accounting."""

  def open(self, running: Sequence[tuple[int, int]], promised: int = 0) -> None:
    """Starts a round; `running` holds (tokens cached, or to be cached by its queued
    prefill, and decode steps left) per running sequence; `promised` pages are not
    allocated yet but owed to queued prefills."""

  def fits(self, context: int, steps_left: int) -> bool:
    """Whether a request whose prefill caches `context` tokens, then decodes for
    `steps_left` more steps, may start beside those running and admitted so far."""

  def add(self, context: int, steps_left: int) -> None:
    """Counts an admitted request (as `fits` saw it) for the rest of the round."""


class OptimisticAdmission:
  """vLLM's policy: admit while the prompt's pages are free, keeping one page of headroom
  per running sequence so that they can go on; when the pool runs out mid-decode the
  scheduler preempts the newest request (recomputed later)."""

  def __init__(self, cache: KVCacheManager):
    self.cache = cache
    self.budget = 0

  def open(self, running: Sequence[tuple[int, int]], promised: int = 0) -> None:
    self.budget = self.cache.num_free_pages - promised - len(running)

  def _need(self, context: int) -> int:
    return self.cache.pages(context) + 1

  def fits(self, context: int, steps_left: int) -> bool:
    return self._need(context) <= self.budget

  def add(self, context: int, steps_left: int) -> None:
    self.budget -= self._need(context)


class PeakAdmission:
  """Admit only while every running request can still reach its max_new_tokens: the
  pool's projected use, step by step until the last running request ends, counting each
  request's growth and its release when it ends, must stay within the pool. Never
  preempts; best when requests rarely stop early.

  Args:
    cache: the page accounting.
    horizon: steps to project (the longest a request can run, plus `linger` and one).
    linger: steps a finished request's pages stay held (it is retired at the end of its
      device call: up to steps_per_call - 1 steps late).
  """

  def __init__(self, cache: KVCacheManager, *, horizon: int, linger: int):
    self.cache = cache
    self.horizon, self.linger = horizon, linger
    self.projected = None

  def _project(self, cached, steps_left):
    return self.cache.projected_pages(cached, steps_left, horizon=self.horizon,
                                      linger=self.linger)

  def open(self, running: Sequence[tuple[int, int]], promised: int = 0) -> None:
    del promised  # the projection counts the running contexts' pages in full
    self.projected = self._project([c for c, _ in running], [s for _, s in running])

  def fits(self, context: int, steps_left: int) -> bool:
    return (self.projected + self._project([context], [steps_left])).max() <= (
        self.cache.num_pages)

  def add(self, context: int, steps_left: int) -> None:
    self.projected = self.projected + self._project([context], [steps_left])


ADMISSION_POLICIES = ("optimistic", "peak")


def make_policy(name: str, cache: KVCacheManager, *, max_positions: int,
                steps_per_call: int) -> AdmissionPolicy:
  """The policy called `name` (one of ADMISSION_POLICIES) over `cache`."""
  if name == "optimistic":
    return OptimisticAdmission(cache)
  if name == "peak":
    return PeakAdmission(cache, horizon=max_positions + steps_per_call + 1,
                         linger=steps_per_call)
  raise ValueError(f"admission must be one of {ADMISSION_POLICIES}, got {name!r}")
