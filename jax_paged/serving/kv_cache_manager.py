"""The host's page accounting of the KV pool (vLLM's KV-cache manager).

The device pool allocates pages inside jitted calls (`pool.reserve`) and frees them in
`pool.release`; a reservation that does not fit fails there silently (an `ok` flag), so
the scheduler must know *before* it dispatches a call that every reservation in it will
succeed. This manager keeps the exact host mirror: the tokens cached per sequence slot,
and so the pages each holds (a sequence of n tokens holds ceil(n / page_size) pages, as
`pool.reserve` allocates them) and the pages free. It answers the scheduler's questions:
how many pages a context needs, how many decode steps fit in what is free.
"""

from __future__ import annotations

import numpy as np


class KVCacheManager:
  """Page accounting for `max_seqs` sequence slots sharing `num_pages` pages."""

  def __init__(self, *, num_pages: int, page_size: int, max_seqs: int):
    self.num_pages = num_pages
    self.page_size = page_size
    self.cached = np.zeros((max_seqs,), np.int64)  # tokens in the pool per slot
    # The most pages ever held at once. Pages only grow within a device call (finished
    # sequences are released at the next), so the high point is right after a call's
    # growth is recorded, before its finished sequences are freed.
    self.peak_used_pages = 0
    self._live_steps = 0   # sum over decode steps of the live tokens
    self._slot_steps = 0   # ... and of the token slots of the pages held

  def pages(self, tokens):
    """Pages that hold `tokens` tokens (an int or an integer array)."""
    return -(-tokens // self.page_size)

  @property
  def num_used_pages(self) -> int:
    return int(self.pages(self.cached).sum())

  @property
  def num_free_pages(self) -> int:
    return self.num_pages - self.num_used_pages

  @property
  def efficiency(self) -> float:
    """Live tokens / token slots of the pages held, summed over every decode step recorded
    by `grow_decode` (1.0 before any): the fraction of reserved KV memory holding data."""
    return self._live_steps / self._slot_steps if self._slot_steps else 1.0

  def grow(self, slots, tokens) -> None:
    """Records `tokens[i]` more tokens cached for `slots[i]` (what one device call
    reserved), in one update."""
    np.add.at(self.cached, np.asarray(slots, np.int64), np.asarray(tokens, np.int64))
    used = self.num_used_pages
    self.peak_used_pages = max(self.peak_used_pages, used)
    if used > self.num_pages:
      raise RuntimeError(f"slots {list(slots)} grew past the pool's {self.num_pages} pages: "
                         "scheduler bug")

  def grow_decode(self, slots, produced) -> None:
    """Records a decode call in which `slots[i]` cached `produced[i]` tokens, one per step,
    and what each of its steps held: every slot of the call keeps its pages until the call
    returns, a finished one too (as the device holds them), so the efficiency and the peak
    do not depend on how many steps a call runs."""
    cached = self.cached[np.asarray(slots, np.int64)]
    produced = np.asarray(produced, np.int64)
    if produced.size:
      held = cached + np.minimum(np.arange(1, produced.max() + 1)[:, None], produced)
      self._live_steps += int(held.sum())
      self._slot_steps += int(self.pages(held).sum()) * self.page_size
    self.grow(slots, produced)

  def free(self, slot: int) -> None:
    """Records that `slot`'s pages go back to the pool."""
    self.cached[slot] = 0

  def steps_that_fit(self, slots: list[int], steps_left: list[int], max_steps: int) -> int:
    """The most decode steps (<= max_steps) for which every new page of these slots fits
    in the free pages; slot i grows one token per step for at most steps_left[i] steps."""
    cached = self.cached[slots]
    steps = np.arange(1, max_steps + 1)[:, None]
    grown = self.pages(cached + np.minimum(steps, steps_left)) - self.pages(cached)
    fits = np.flatnonzero(grown.sum(axis=1) <= self.num_free_pages)
    return int(fits[-1]) + 1 if fits.size else 0

  def projected_pages(self, cached, steps_left, *, horizon: int, linger: int) -> np.ndarray:
    """int64 [horizon]: the pages held t = 0 .. horizon - 1 decode steps from now by
    sequences with `cached` tokens growing one per step for `steps_left` steps, summed.
    Each releases its pages `linger` steps after its last one (a sequence is retired when
    the device call it ends in returns)."""
    t = np.arange(horizon)[None, :]
    cached = np.asarray(cached, np.int64)[:, None]
    left = np.asarray(steps_left, np.int64)[:, None]
    held = self.pages(cached + np.minimum(t, left))
    return np.where(t < left + linger, held, 0).sum(axis=0)
