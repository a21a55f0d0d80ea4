"""The scheduler: plans each device call from the requests and the page accounting (host
only, numpy; vLLM v1's scheduler).

Requests wait in arrival order for one of `max_batch` decode slots (slot i is pool
sequence i). The scheduler alternates two kinds of plan:

1. admission: waiting requests are admitted in arrival order while a slot is free and the
   admission policy (`jax_paged.serving.admission`) lets them, and prefilled in calls of at
   most `max_prefill_tokens` padded tokens, grouped by length;
2. a decode chunk: every running sequence decodes for up to `steps_per_call` steps in one
   device call. The KV-cache manager says how many steps fit in the free pages; when not
   even one does, the most recently admitted request is preempted: its pages are released
   and it goes back to the front of the queue, to be recomputed later from its prompt plus
   the tokens it already produced (vLLM's recompute preemption).

`update` takes what the runner produced, checks that the device pool did exactly what the
host accounting expected, and retires finished requests; their slots' pages are released
at the start of the next plan (`Plan.release`).
"""

from __future__ import annotations

import collections
import dataclasses
from typing import Sequence

import numpy as np

from jax_paged.serving.admission import AdmissionPolicy
from jax_paged.serving.kv_cache_manager import KVCacheManager
from jax_paged.serving.request import Request
from jax_paged.serving.runner import bucket


@dataclasses.dataclass(eq=False)  # compared by identity: slots are scanned for None
class RunningRequest:
  """A request in a slot. The pool caches its context but the newest token, which the
  next decode step feeds in."""

  request_id: int
  request: Request
  tokens: list[int]       # generated so far (all of them, across preemptions)
  admitted_at: int        # admission counter: the newest is preempted first
  stop_token_ids: tuple[int, ...]

  @property
  def context(self) -> list[int]:
    """What a prefill caches: the prompt and every token generated so far."""
    return list(self.request.prompt) + self.tokens

  @property
  def context_length(self) -> int:
    """len(context), without building it."""
    return len(self.request.prompt) + len(self.tokens)

  @property
  def budget(self) -> int:
    """Tokens it may still generate (decode steps it may still run)."""
    return self.request.max_new_tokens - len(self.tokens)


@dataclasses.dataclass(frozen=True)
class Plan:
  """One device call.

  Attributes:
    rows: each slot's request (None = empty), max_batch long.
    release: slots whose pages are freed first (finished or preempted requests).
    prefill: slots to prefill (their `context`); empty for a decode chunk.
    decode_steps: steps the decode chunk may run (every running slot decodes).
    max_steps: the most steps of any decode chunk (`steps_per_call`: the shape of the
      device loop, compiled once).
  """

  rows: tuple[RunningRequest | None, ...]
  release: tuple[int, ...] = ()
  prefill: tuple[int, ...] = ()
  decode_steps: int = 0
  max_steps: int = 1


class Scheduler:
  """Plans a run of `requests` (validated) over `max_batch` slots.

  Args:
    requests: the requests, their index being their id.
    max_batch: decode slots.
    cache: the page accounting of the pool (empty).
    admission: the admission policy, over `cache`.
    steps_per_call: the most decode steps per device call.
    max_prefill_tokens: the most padded tokens per prefill call (a lone longer prompt gets
      a call of its own).
    eos_token_id: ends every request when generated (optional).
  """

  def __init__(self, requests: Sequence[Request], *, max_batch: int, cache: KVCacheManager,
               admission: AdmissionPolicy, steps_per_call: int, max_prefill_tokens: int,
               eos_token_id: int | None = None):
    self.requests = requests
    self.cache = cache
    self.admission = admission
    self.steps_per_call = steps_per_call
    self.max_prefill_tokens = max_prefill_tokens
    self.eos_token_id = eos_token_id
    self.slots: list[RunningRequest | None] = [None] * max_batch
    self.waiting = collections.deque(range(len(requests)))
    self.num_preemptions = 0
    self._progress: dict[int, list[int]] = {}  # tokens of preempted requests
    self._admissions = 0
    self._prefills: list[tuple[int, ...]] = []  # admitted, not prefilled yet
    self._admit_next = True
    self._release: list[int] = []

  def schedule(self) -> Plan | None:
    """The next device call, or None when every request has finished."""
    while True:
      if self._prefills:
        return self._plan(prefill=self._prefills.pop(0))
      if self._admit_next:
        # Everything admitted starts now, in as many prefill calls as max_prefill_tokens
        # needs (deferring some to the next round would split the requests into cohorts
        # that peak together).
        self._admit_next = False
        self._prefills = self._prefill_calls(self._admit())
        continue
      self._admit_next = True
      steps = self._fit_decode()
      if steps:
        return self._plan(decode_steps=steps)
      if not self.waiting:
        return None

  def pending_release(self) -> list[int]:
    """Slots retired since the last plan, whose pages the pool still holds (the caller
    frees them after the last plan)."""
    release, self._release = self._release, []
    return release

  def _plan(self, **work) -> Plan:
    return Plan(rows=tuple(self.slots), release=tuple(self.pending_release()),
                max_steps=self.steps_per_call, **work)

  def _admit(self) -> list[int]:
    """Admits waiting requests in arrival order while slots and the policy allow."""
    running = [(int(self.cache.cached[i]), s.budget) for i, s in enumerate(self.slots) if s]
    self.admission.open(running)
    admitted = []
    while self.waiting and None in self.slots:
      rid = self.waiting[0]
      request = self.requests[rid]
      done = self._progress.get(rid, [])
      # Prefill caches the context and samples one token; then decode steps.
      context = len(request.prompt) + len(done)
      steps_left = request.max_new_tokens - len(done) - 1
      if not self.admission.fits(context, steps_left) and (admitted or running):
        break
      self.admission.add(context, steps_left)
      self.waiting.popleft()
      slot = self.slots.index(None)
      stops = (() if self.eos_token_id is None else (self.eos_token_id,)) + tuple(
          int(t) for t in request.stop_token_ids)
      self.slots[slot] = RunningRequest(rid, request, self._progress.pop(rid, []),
                                        self._admissions, stops)
      self._admissions += 1
      admitted.append(slot)
    return admitted

  def _prefill_calls(self, slots: list[int]) -> list[tuple[int, ...]]:
    """Groups the slots to prefill into calls of at most max_prefill_tokens padded tokens.

    Longest first, so each call pads its rows to similar lengths: a call is as wide as
    its longest row (bucketed), and arrival order would put 32-token prompts beside
    512-token ones.
    """
    calls: list[list[int]] = []
    width = 0  # the bucketed length of the current call's first (longest) row
    page_size = self.cache.page_size
    for slot in sorted(slots, key=lambda i: -self.slots[i].context_length):
      if not calls or bucket(len(calls[-1]) + 1, 1) * width > self.max_prefill_tokens:
        calls.append([])
        width = bucket(self.slots[slot].context_length, page_size)
      calls[-1].append(slot)
    return [tuple(c) for c in calls]

  def _fit_decode(self) -> int:
    """Decode steps that fit for every running request (0 if none runs), preempting the
    newest request while not one step fits."""
    while True:
      running = [i for i, s in enumerate(self.slots) if s is not None]
      if not running:
        return 0
      steps = self.cache.steps_that_fit(running, [self.slots[i].budget for i in running],
                                        self.steps_per_call)
      if steps:
        return steps
      victim = max(running, key=lambda i: self.slots[i].admitted_at)
      s = self.slots[victim]
      self._progress[s.request_id] = s.tokens
      self.waiting.appendleft(s.request_id)
      self._retire(victim)
      self.num_preemptions += 1

  def _retire(self, slot: int) -> None:
    self.slots[slot] = None
    self.cache.free(slot)
    self._release.append(slot)

  def _stop_reason(self, s: RunningRequest) -> str | None:
    """Why the request ends after its newest token, or None if it goes on."""
    if s.tokens[-1] in s.stop_token_ids:
      return "stop"
    if not s.budget:
      return "length"
    return None

  def update(self, plan: Plan, tokens: np.ndarray, lengths: np.ndarray
             ) -> list[tuple[int, list[int], str | None]]:
    """Takes a plan's results and retires the requests that finished.

    Args:
      plan: the plan the runner executed.
      tokens: its output (`ModelRunner.execute`).
      lengths: the pool's sequence lengths after the call.

    Returns:
      (request id, new tokens, finish reason or None) per request that produced tokens:
      whole chunks, so the host pays per request, not per token.

    Raises:
      RuntimeError: the pool's lengths differ from the host accounting (a reservation
        failed on device: a scheduler bug).
    """
    if plan.prefill:
      new = {slot: [int(tokens[j])] for j, slot in enumerate(plan.prefill)}
      self.cache.grow(plan.prefill, [self.slots[i].context_length for i in plan.prefill])
    else:
      # A row's tokens are a prefix of its column: the device loop stops a row for good on
      # its first stop token or when its budget runs out, so only the last one can end it.
      produced = (tokens >= 0).sum(axis=0)
      new = {i: tokens[:produced[i], i].tolist() for i, s in enumerate(self.slots)
             if s is not None and produced[i]}
      # Each step cached the previous newest token.
      self.cache.grow_decode(list(new), [len(t) for t in new.values()])
    if not np.array_equal(lengths, self.cache.cached):
      raise RuntimeError(f"the pool holds {np.asarray(lengths).tolist()} tokens per sequence, "
                         f"the scheduler expected {self.cache.cached.tolist()}: a reservation "
                         "found no free page (scheduler bug)")
    events = []
    for slot, t in new.items():
      s = self.slots[slot]
      s.tokens += t
      reason = self._stop_reason(s)
      if reason is not None:
        self._retire(slot)
      events.append((s.request_id, t, reason))
    return events
