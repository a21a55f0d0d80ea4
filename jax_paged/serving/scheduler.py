"""The scheduler: plans every device call of a run (vLLM v1's scheduler).

It owns the requests' lifecycle on the host; the runner (`jax_paged.serving.runner`)
executes its plans. Each `schedule()` returns one `Plan`, a device call of:

1. page bookkeeping: holds the prefix cache places on pages it registered, the slots
   whose pages are released (finished or preempted requests), the cached pages it evicts
   (least recently used, only when the call needs room) and the admitted requests that
   start on cached pages (prefix caching: `KVCacheManager.lookup`);
2. a prefill: up to `max_prefill_tokens` padded tokens of the admitted requests' contexts,
   a long one split into chunks over several calls (chunked prefill). A request's last
   chunk samples its first token; with `Request.n > 1` its other samples are forked from
   it there (sharing its pages) and sample theirs. Requests admitted together that share
   a prefix compute it once: the first computes it, the others prefill their own tokens
   on its pages in a second phase of the same call;
3. a decode chunk: every decoding sequence runs up to `steps_per_call` steps in one device
   call (up to `runner.STEPS_PER_CHECK` while prefill work is pending, so that a long
   prompt arriving does not stall everyone's next tokens for long). The KV-cache manager
   says how many steps fit in the free pages (less those promised to pending prefills);
   when not even one does, the most recently admitted sequence is preempted: its pages
   are released and it goes back to the front of the queue, to be recomputed later from
   its prompt plus the tokens it already produced (vLLM's recompute preemption; its
   cached prompt pages make that cheap).

When nothing decodes, prefill calls run back to back. `take_tokens` takes the tokens the
runner produced (the engine streams them at once); `settle` then checks that the device
pool did exactly what the host accounting expected, caches the new full pages and retires
finished sequences, whose slots' pages are released at the start of the next plan.
"""

from __future__ import annotations

import collections
import dataclasses
from typing import Sequence

import numpy as np

from jax_paged.serving.admission import AdmissionPolicy
from jax_paged.serving.adapter_slots import AdapterSlots
from jax_paged.serving.kv_cache_manager import KVCacheManager, page_keys, salted_keys
from jax_paged.serving.request import Request, sample_seed
from jax_paged.serving.runner import STEPS_PER_CHECK, bucket

SCHEDULING_POLICIES = ("fcfs", "priority")


def check_scheduling_policy(name) -> str:
  """`name` if it is one of SCHEDULING_POLICIES; else ValueError."""
  if name not in SCHEDULING_POLICIES:
    raise ValueError(f"scheduling_policy must be one of {SCHEDULING_POLICIES}, got {name!r}")
  return name


def _top_pairs(top_tokens: np.ndarray, top: np.ndarray, k: int) -> list[tuple]:
  """Per step, its k most likely tokens as ((token, log-probability), ...), from
  `runner.Logprobs`' top_tokens / top [steps, n >= k] (numpy)."""
  return [tuple(zip(t, v)) for t, v in zip(top_tokens[:, :k].tolist(), top[:, :k].tolist())]


@dataclasses.dataclass(eq=False, slots=True)  # by identity: slots are scanned for None
class RunningRequest:
  """One sample of a request in a slot. While decoding, the pool caches its context but
  the newest token, which the next decode step feeds in."""

  request_id: int
  request: Request
  prompt: np.ndarray      # int32 [prompt tokens]: the request's
  tokens: list[int]       # generated so far (all of them, across preemptions)
  admitted_at: int        # admission counter: the newest is preempted first (of the
                          # lowest priority, with the "priority" policy)
  stop_token_ids: tuple[int, ...]
  sample: int = 0         # which of the request's n samples
  prefill_stop: int = 0   # context tokens to prefill (0: forked from `parent`, not prefilled)
  prefilled: int = 0      # ... of which in the pool
  parent: int | None = None  # the slot this sample is forked from after its prefill
  decoding: bool = False
  looked_up: bool = False  # its context was looked up in the prefix cache
  keys: np.ndarray | None = None  # uint64: its context's full pages' `page_keys`
  # While its first prefill runs for a request with `prompt_logprobs`: the prompt's
  # log-probabilities so far (None for its first token), and with `top_logprobs` each
  # position's most likely tokens; None otherwise (and once delivered).
  prompt_logprobs: list | None = None
  prompt_top_logprobs: list | None = None
  # Aborted (`Scheduler.abort` of this sample) while its prefill is still needed by the
  # samples forked from it: it retires after that prefill, its token undelivered.
  aborted: bool = False
  guide_state: int = 0    # with `Request.guide`: its state after the tokens so far
  lora_slot: int = -1     # with `Request.lora`: the device slot of its adapter

  @property
  def seed(self) -> int:
    return sample_seed(self.request.seed, self.sample)

  @property
  def context(self) -> np.ndarray:
    """int32 [context_length]: what a prefill caches, the prompt and every token
    generated so far."""
    if not self.tokens:
      return self.prompt
    return np.concatenate([self.prompt, np.asarray(self.tokens, np.int32)])

  @property
  def context_length(self) -> int:
    """len(context), without building it."""
    return len(self.prompt) + len(self.tokens)

  @property
  def budget(self) -> int:
    """Tokens it may still generate (decode steps it may still run)."""
    return self.request.max_new_tokens - len(self.tokens)


@dataclasses.dataclass(eq=False, slots=True)  # by identity; not frozen: built ~3x faster
class PrefillChunk:
  """context[start:stop] of the sequence in `slot` (`tokens`, int32), prefilled in one
  call.

  Attributes:
    samples: the sequences that sample their first token from this chunk's last logits:
      the slot's own sequence (on its last chunk) and its forks, as (slot, sequence);
      empty for an earlier chunk.
    cached: for a sequence's first chunk after a prefix-cache hit, the cached pages
      (int64) holding context[:start], which the call attaches the slot to before it
      prefills (`pool.attach`); None otherwise.
    follows: for a sequence's first chunk that starts on pages another chunk of the same
      call computes (requests sharing a prefix, admitted together), that chunk's slot:
      the call prefills this chunk in a second phase, after attaching the slot to the
      first start / page_size pages of that slot's row; None otherwise.
    targets: for a chunk of a prompt whose log-probabilities are asked
      (`Request.prompt_logprobs`), int32 context[start + 1:stop + 1] within the prompt:
      the token each of its positions predicts (the prompt's last position none); None
      otherwise. Such a chunk is never cached nor `follows` (its prompt is computed whole).
    top_logprobs: with targets, how many of each position's most likely tokens to give
      (`Request.top_logprobs`).
  """

  slot: int
  start: int
  tokens: np.ndarray
  samples: tuple[tuple[int, RunningRequest], ...] = ()
  cached: np.ndarray | None = None
  follows: int | None = None
  targets: np.ndarray | None = None
  top_logprobs: int = 0

  @property
  def forks(self) -> tuple[int, ...]:
    """Slots that become copies of `slot` after this chunk (`pool.fork`)."""
    if len(self.samples) < 2:  # the common case, asked per chunk of a batch
      return ()
    return tuple(s for s, _ in self.samples if s != self.slot)


@dataclasses.dataclass(frozen=True)
class Plan:
  """One device call, in this order: retain, release, evict, prefill (attaching chunks to
  their cached pages first), decode.

  Attributes:
    rows: each slot's decoding sequence (None = empty, or not decoding in this call),
      max_batch long.
    retain: pages the prefix cache holds from now on (holds placed since the last plan
      that released or evicted: a hold only matters from then).
    release: slots whose pages are released (finished or preempted sequences).
    evict: cached pages whose holds are dropped.
    prefill: the chunks to prefill.
    decode_steps: steps the decode chunk may run (0: no decode).
    max_steps: the most steps of any decode chunk (`steps_per_call`: the shape of the
      device loop, compiled once).
    adapters: with LoRA adapters served, int32 [max_batch]: each slot's adapter's device
      slot (-1: none, or an empty slot); None otherwise.
    lora_loads: (device slot, `LoraAdapter`) to load before the call, in order.
  """

  rows: tuple[RunningRequest | None, ...]
  retain: tuple[int, ...] = ()
  release: tuple[int, ...] = ()
  evict: tuple[int, ...] = ()
  prefill: tuple[PrefillChunk, ...] = ()
  decode_steps: int = 0
  max_steps: int = 1
  adapters: np.ndarray | None = None
  lora_loads: tuple = ()


class Scheduler:
  """Plans a run of `requests` (validated) over `max_batch` slots; `add` submits more
  while it runs.

  Args:
    requests: the requests, their index being their id.
    prompts: their prompts as int32 arrays (`validate_requests` returns them), or None
      to convert them here.
    max_batch: decode slots (a request with n samples takes n).
    cache: the page accounting of the pool (empty).
    admission: the admission policy, over `cache`.
    steps_per_call: the most decode steps per device call.
    max_prefill_tokens: the most padded tokens per prefill call; a longer context is
      prefilled in chunks of (about) that many tokens over several calls.
    eos_token_id: ends every request when generated (optional).
    scheduling_policy: "fcfs" admits arrived requests in order and preempts the newest;
      "priority" (vLLM's) admits them by `Request.priority` (lower first), then arrival,
      and preempts the newest of the lowest priority (the largest value).
    adapters: the LoRA adapters' slots (`AdapterSlots`) when the engine serves them: a
      request naming one waits (and those behind it) until its adapter has a slot.
  """

  def __init__(self, requests: Sequence[Request], *, max_batch: int, cache: KVCacheManager,
               admission: AdmissionPolicy, steps_per_call: int, max_prefill_tokens: int,
               eos_token_id: int | None = None,
               prompts: Sequence[np.ndarray] | None = None,
               scheduling_policy: str = "fcfs", adapters: AdapterSlots | None = None):
    self.requests = list(requests)
    # Arrays, so that page keys and prefill rows take whole prompts at numpy speed.
    self.prompts = (list(prompts) if prompts is not None
                    else [np.asarray(r.prompt, np.int32) for r in requests])
    # When each request may be admitted (seconds after the run's start).
    self.arrivals = [r.arrival_s for r in requests]
    self.cache = cache
    self.admission = admission
    self.steps_per_call = steps_per_call
    self.max_prefill_tokens = max_prefill_tokens
    # Chunks end on page boundaries, so a chunk never shares its first page.
    self.max_chunk = max(cache.page_size,
                         max_prefill_tokens // cache.page_size * cache.page_size)
    self.eos_token_id = eos_token_id
    self.by_priority = check_scheduling_policy(scheduling_policy) == "priority"
    self.adapters = adapters
    self.slots: list[RunningRequest | None] = [None] * max_batch
    # (request id, sample, tokens so far): fresh requests take every sample at once.
    self.waiting = collections.deque((rid, None, []) for rid in range(len(requests)))
    self.num_preemptions = 0
    self._admissions = 0
    self._prefill_queue: list[int] = []  # slots with context left to prefill, in order
    # Admitted when nothing was decoding (a static batch, a run's start): the cohort is
    # prefilled whole before it decodes, so that it decodes in step.
    self._cohort_starting = False
    self._release: list[int] = []
    self._finished: list[int] = []  # slots whose sequence ended in the last plan
    # request id -> samples aborted before the request was admitted (`abort`)
    self._aborted_samples: dict[int, set[int]] = {}

  @property
  def finished(self) -> bool:
    return not self.waiting and all(s is None for s in self.slots)

  def add(self, request: Request, prompt: np.ndarray, arrival_s: float) -> int:
    """Queues a request (validated; `prompt` its int32 array) behind the waiting ones, to
    be admitted no earlier than `arrival_s` seconds after the run's start. Returns its
    id."""
    rid = len(self.requests)
    self.requests.append(request)
    self.prompts.append(prompt)
    self.arrivals.append(arrival_s)
    self.waiting.append((rid, None, []))
    return rid

  def unfinished(self, rid: int, sample: int | None = None) -> bool:
    """Whether request `rid` (or its `sample`) has a sample waiting or in a slot."""
    if sample is None:
      return (any(w[0] == rid for w in self.waiting)
              or any(s is not None and s.request_id == rid for s in self.slots))
    return (any(w[0] == rid and (w[1] == sample or w[1] is None
                                 and sample not in self._aborted_samples.get(rid, ()))
                for w in self.waiting)
            or any(s is not None and s.request_id == rid and s.sample == sample
                   and not s.aborted for s in self.slots))

  def abort(self, rid: int, sample: int | None = None) -> None:
    """Drops request `rid`, every sample of it (or only `sample`), waiting, prefilling or
    decoding: its slots are retired (their pages released with the next plan; full pages
    already registered stay cached). A sample whose prefill its forks still need retires
    after it (`RunningRequest.aborted`). Call between a `settle` and the next
    `schedule`."""
    if sample is None:
      self.waiting = collections.deque(w for w in self.waiting if w[0] != rid)
      slots = [i for i, s in enumerate(self.slots) if s is not None and s.request_id == rid]
      self._prefill_queue = [i for i in self._prefill_queue if i not in slots]
      self._retire(slots)
      return
    if any(w[0] == rid and w[1] is None for w in self.waiting):  # not admitted yet
      self._aborted_samples.setdefault(rid, set()).add(sample)
    self.waiting = collections.deque(w for w in self.waiting if w[:2] != (rid, sample))
    for i, s in enumerate(self.slots):
      if s is None or s.request_id != rid or s.sample != sample:
        continue
      if any(f is not None and f.parent == i for f in self.slots):
        s.aborted = True
      else:
        self._prefill_queue = [j for j in self._prefill_queue if j != i]
        self._retire([i])

  def next_arrival(self) -> float:
    """When (seconds after the start) the next waiting request arrives."""
    return min(self.arrivals[rid] for rid, _, _ in self.waiting)

  def schedule(self, now: float = float("inf")) -> Plan | None:
    """The next device call, or None when nothing can run before a request arrives
    (`now`: seconds since the run started) or every request has finished."""
    if not any(s is not None and s.decoding for s in self.slots):
      self._cohort_starting = True
    self._admit(now)
    prefill = self._next_prefill()
    if not self._prefill_queue and not prefill:
      self._cohort_starting = False
    decoding = [i for i, s in enumerate(self.slots) if s is not None and s.decoding]
    steps = 0
    # A prefill that ends the queued work runs alone: its rows join the next decode chunk.
    # While more prefill calls are queued (long prompts, chunked), short decode chunks run
    # beside each, so that running requests keep producing tokens (vLLM's chunked
    # prefill) and the queue advances every STEPS_PER_CHECK steps.
    if decoding and not prefill:
      steps = self._fit_decode(self.steps_per_call, prefill)
    elif decoding and self._prefill_queue and not self._cohort_starting:
      steps = self._fit_decode(min(STEPS_PER_CHECK, self.steps_per_call), prefill)
    decoding = [i for i, s in enumerate(self.slots) if s is not None and s.decoding]
    if not prefill and not steps:
      return None
    need = self._new_pages(prefill)
    if steps:
      need += int(self.cache.decode_growth(
          decoding, [self.slots[i].budget for i in decoding], steps)[-1])
    evict = self.cache.evict_for(need)
    rows = tuple(s if s is not None and s.decoding and steps else None for s in self.slots)
    release, self._release = self._release, []
    # A hold matters on the device only once a cached page's last sequence lets it go, so
    # the holds travel with a release: a plan without one sends none (the bookkeeping call
    # of a static batch's prefills and first decode chunk is then skipped).
    retain = self.cache.take_retains() if release or evict else []
    adapters, loads = None, ()
    if self.adapters is not None:
      adapters = np.array([-1 if s is None else s.lora_slot for s in self.slots], np.int32)
      loads = tuple(self.adapters.take_loads())
    return Plan(rows=rows, retain=tuple(retain), release=tuple(release),
                evict=tuple(evict), prefill=tuple(prefill),
                decode_steps=steps, max_steps=self.steps_per_call, adapters=adapters,
                lora_loads=loads)

  def pending_release(self) -> tuple[list[int], list[int]]:
    """(holds, slots) still to send after the last plan: the prefix cache's holds not
    yet placed on the device and the slots retired since (the caller retains the one and
    frees the other, in that order)."""
    release, self._release = self._release, []
    return self.cache.take_retains(), release

  def _new_pages(self, prefill: list[PrefillChunk]) -> int:
    """Pages these chunks take (in one numpy pass: a batch has hundreds)."""
    start = np.array([c.start for c in prefill], np.int64)
    stop = start + np.array([len(c.tokens) for c in prefill], np.int64)
    return int((self.cache.pages(stop) - self.cache.pages(start)).sum())

  def _promised_pages(self) -> int:
    """Pages the pending prefills will still take (admitted, not yet in the pool)."""
    return sum(int(self.cache.pages(s.prefill_stop) - self.cache.pages(s.prefilled))
               for i in self._prefill_queue if (s := self.slots[i]) is not None)

  def _admit(self, now: float) -> None:
    """Admits arrived waiting requests in order while slots and the policy allow."""
    page_size = self.cache.page_size
    running = []
    for i, s in enumerate(self.slots):
      if s is not None:  # the tokens it holds once prefilled (a fork: its last page's copy)
        held = (int(self.cache.cached[i]) if s.decoding else s.prefill_stop
                or s.context_length % page_size)
        running.append((held, s.budget))
    self.admission.open(running, promised=self._promised_pages())
    if self.by_priority:  # the arrived ones first, by (priority, arrival, submission)
      arrived = [w for w in self.waiting if self.arrivals[w[0]] <= now]
      if arrived:
        arrived.sort(key=lambda w: (self.requests[w[0]].priority, self.arrivals[w[0]], w[0]))
        later = [w for w in self.waiting if self.arrivals[w[0]] > now]
        self.waiting = collections.deque(arrived + later)
    admitted = []
    free = collections.deque(i for i, s in enumerate(self.slots) if s is None)
    eos = () if self.eos_token_id is None else (self.eos_token_id,)
    while self.waiting and self.arrivals[self.waiting[0][0]] <= now:
      rid, sample, done = self.waiting[0]
      request = self.requests[rid]
      if sample is None:  # (less the samples aborted while it waited)
        aborted = self._aborted_samples.get(rid, ())
        samples = [j for j in range(request.n) if j not in aborted]
      else:
        samples = [sample]
      if len(free) < len(samples):
        break
      # Prefill caches the context and samples one token; then decode steps. (Pages a
      # prefix-cache hit will save are not known yet: the lookup is at its first chunk.)
      context_length = len(request.prompt) + len(done)
      steps_left = request.max_new_tokens - len(done) - 1
      if not self.admission.fits(context_length, steps_left) and (admitted or running):
        break
      lora_slot = -1
      if request.lora is not None:  # its adapter in a device slot, one hold per sample
        lora_slot = self.adapters.acquire(request.lora, len(samples))
        if lora_slot is None:
          break
      self.admission.add(context_length, steps_left)
      for _ in samples[1:]:  # forks copy the shared last page, then grow
        self.admission.add(context_length % page_size, steps_left)
      self.waiting.popleft()
      self._aborted_samples.pop(rid, None)
      stops = (eos + tuple(int(t) for t in request.stop_token_ids)
               if len(request.stop_token_ids) else eos)
      first = free[0]
      for j in samples:  # (positional: keywords cost a burst of 256 requests ~40 µs)
        slot = free.popleft()
        self.slots[slot] = RunningRequest(
            rid, request, self.prompts[rid], list(done), self._admissions, stops, j,
            context_length if slot == first else 0, 0, None if slot == first else first)
        self.slots[slot].lora_slot = lora_slot
      if request.guide is not None and done:  # (one preempted sample: its state so far)
        self.slots[first].guide_state = request.guide.walk(0, done)
      if request.prompt_logprobs and not done:  # (a preempted one has delivered them)
        s = self.slots[first]
        s.prompt_logprobs = [None]
        s.prompt_top_logprobs = [None] if request.top_logprobs else None
      self._admissions += 1
      admitted.append(first)
    # Longest first, so each prefill call pads its rows to similar lengths.
    admitted.sort(key=lambda i: -(self.slots[i].prefill_stop - self.slots[i].prefilled))
    self._prefill_queue += admitted

  def _next_prefill(self) -> list[PrefillChunk]:
    """The next prefill call's chunks: queued sequences in order while each of the call's
    two phases' padded tokens (rows x its widest chunk, both bucketed) stay within
    max_prefill_tokens (the phases run one after the other).

    A sequence's first chunk starts after the cached pages its context begins with
    (`KVCacheManager.lookup`: attached in this call). With prefix caching, a sequence
    whose next page to compute is also the next of a sequence before it in this call
    (requests sharing a system prompt, admitted together) starts on that sequence's
    pages instead: its chunk `follows` it, in the call's second phase, so the shared
    prefix is computed once. A sequence whose next page a second-phase chunk computes
    waits for the next call, where that page is cached.
    """
    chunks: list[PrefillChunk] = []
    rows, widths = [0, 0], [0, 0]  # per phase: chunks and the widest (bucketed)
    page_size = self.cache.page_size
    # The key of the first page each chunk computes -> (its slot, the stop of its chunk,
    # whether it is in the second phase).
    computing: dict[int, tuple[int, int, bool]] = {}
    looked_up = []  # (slot, cached pages, context length): `KVCacheManager.attach`
    followers = []  # (slot, shared pages): `KVCacheManager.follow`
    done = set()  # slots whose last chunk is in this call
    forks = collections.defaultdict(list)  # parent slot -> its samples' (slot, sequence)
    for i, f in enumerate(self.slots):
      if f is not None and f.parent is not None:
        forks[f.parent].append((i, f))
    hits = {}  # slot -> the cached pages its context starts with
    if self.cache.prefix_caching:  # the queue's new contexts' keys and lookups, in one pass
      new = [i for i in self._prefill_queue
             if self.slots[i].prefilled == 0 and not self.slots[i].looked_up]
      unkeyed = [self.slots[i] for i in new if self.slots[i].keys is None]
      for s, keys in zip(unkeyed, page_keys([s.context for s in unkeyed], page_size)):
        lora = s.request.lora
        s.keys = keys if lora is None else salted_keys(keys, self.adapters.uids[lora])
      hits = dict(zip(new, self.cache.lookup([self.slots[i].keys for i in new],
                                             [self.slots[i].context_length for i in new])))
    for slot in list(self._prefill_queue):
      s = self.slots[slot]
      context = s.context
      fresh = s.prefilled == 0 and not s.looked_up
      # The full pages a hit or a leader may give it: all but its last token's; a scored
      # one's (first phase only) only those before its first scored position's logits.
      shareable = (len(context) - 1) // page_size
      scored = s.prompt_logprobs is not None
      if scored:
        shareable = min(shareable, max(s.request.prompt_logprobs_start - 1, 0) // page_size)
      hit = hits.get(slot, ())[:shareable] if fresh else ()
      prefilled = len(hit) * page_size or s.prefilled
      follows = None
      if fresh and self.cache.prefix_caching and len(hit) < shareable:
        leader = computing.get(int(s.keys[len(hit)]))
        if leader is not None:
          lead, lead_stop, second = leader
          if second or scored:  # (the runner scores first-phase rows only)
            continue
          # Its full pages up to the first that differs, of those the leader holds after
          # this call, leaving its last token to compute. Equal keys mean equal prefixes,
          # so the pages that match are a prefix of the range: a binary search.
          m = min(len(s.keys), lead_stop // page_size, shareable)
          mine, theirs = s.keys, self.slots[lead].keys
          lo = len(hit) + 1  # page len(hit) matched: it found the leader
          while lo < m:
            mid = (lo + m) // 2
            if mine[mid] == theirs[mid]:
              lo = mid + 1
            else:
              m = mid
          follows, prefilled = lead, m * page_size
      phase = int(follows is not None)
      stop = min(s.prefill_stop, prefilled + self.max_chunk)
      w = max(widths[phase], bucket(stop - prefilled, page_size))
      if chunks and bucket(rows[phase] + 1, 1) * w > self.max_prefill_tokens:
        break
      rows[phase] += 1
      widths[phase] = w
      cached = None
      if fresh:  # attached in this call (before its prefill), so only once it is in it
        s.looked_up = True
        if follows is None:
          looked_up.append((slot, hit, len(context)))
          cached = hit if len(hit) else None
        else:
          looked_up.append((slot, (), len(context)))
          followers.append((slot, prefilled // page_size))
        s.prefilled = prefilled
        if scored and prefilled:  # (positions 1 .. prefilled are read from the cache)
          s.prompt_logprobs += [None] * prefilled
          if s.prompt_top_logprobs is not None:
            s.prompt_top_logprobs += [None] * prefilled
      first_page = s.prefilled // page_size
      if self.cache.prefix_caching and (first_page + 1) * page_size <= stop:
        # keys: set at the sequence's lookup
        computing.setdefault(int(s.keys[first_page]), (slot, stop, bool(phase)))
      samples = ()
      if stop == s.prefill_stop:  # the last chunk: the sequence and its forks sample
        samples = ((slot, s),) + tuple(forks.get(slot, ()))
        done.add(slot)
      chunks.append(PrefillChunk(slot, s.prefilled, context[s.prefilled:stop], samples,
                                 cached, follows,
                                 context[s.prefilled + 1:stop + 1] if scored else None,
                                 s.request.top_logprobs if scored else 0))
      s.prefilled = stop
      if stop != s.prefill_stop:
        break  # a chunked context: its next chunk goes into the next call
    self._prefill_queue = [i for i in self._prefill_queue if i not in done]
    self.cache.attach(looked_up)
    self.cache.follow(followers)
    return chunks

  def _fit_decode(self, max_steps: int, prefill: list[PrefillChunk]) -> int:
    """Decode steps that fit for every decoding sequence (0 if none decodes), preempting
    the newest while not one step fits."""
    reserved = self._promised_pages() + self._new_pages(prefill)
    while True:
      decoding = [i for i, s in enumerate(self.slots) if s is not None and s.decoding]
      if not decoding:
        return 0
      steps = self.cache.steps_that_fit(decoding, [self.slots[i].budget for i in decoding],
                                        max_steps, reserved)
      if steps:
        return steps
      victim = max(decoding, key=lambda i: (
          self.slots[i].request.priority if self.by_priority else 0,
          self.slots[i].admitted_at))
      s = self.slots[victim]
      self.waiting.appendleft((s.request_id, s.sample, s.tokens))
      self._retire([victim])
      self.num_preemptions += 1

  def _retire(self, slots: list[int]) -> None:
    for slot in slots:
      if self.slots[slot].lora_slot >= 0:
        self.adapters.release(self.slots[slot].lora_slot)
      self.slots[slot] = None
    self.cache.free(slots)
    self._release += slots

  def _stop_reason(self, s: RunningRequest) -> str | None:
    """Why the sequence ends after its newest token, or None if it goes on."""
    if s.aborted:
      return "abort"
    if s.tokens[-1] in s.stop_token_ids:
      return "stop"
    if s.request.guide is not None and s.request.guide.done[s.guide_state]:
      return "stop"
    if not s.budget:
      return "length"
    return None

  def take_tokens(self, plan: Plan, prefill_tokens: np.ndarray, decode_tokens: np.ndarray,
                  prefill_logprobs=None, decode_logprobs=None, prompt_logprobs=None
                  ) -> list[tuple]:
    """Takes a plan's new tokens; `settle` takes the rest of its results before the next
    `schedule`. (Two steps, so that the tokens reach the caller before the page
    bookkeeping: ~2 ms of host time after a batch of prefills.)

    Args:
      plan: the plan the runner executed.
      prefill_tokens: int32 [samples], the first tokens its prefill sampled, in the order
        of its chunks' `samples`.
      decode_tokens: int32 [steps, max_batch], its decode chunk's tokens (-1 where a row
        produced nothing).
      prefill_logprobs, decode_logprobs: their `runner.Logprobs` (numpy), shaped alike;
        None where no row of the call asked (`Request.logprobs`).
      prompt_logprobs: `runner.Logprobs` (numpy) [rows, T] of the prefill's chunks with
        `targets`, in their order (None if none): each position's target's.

    Returns:
      (request id, sample, new tokens, finish reason or None, their log-probabilities or
      None, their top log-probabilities ([((token, log-probability), ...) per token]) or
      None, the prompt's log-probabilities and top ones (`TokenEvent`'s) or None) per
      sequence that produced tokens: whole chunks, so the host pays per sequence, not per
      token.
    """
    new: dict[int, list[int]] = {}
    logprobs: dict[int, tuple] = {}  # slot -> (its logprobs, its top logprobs or None)

    def take(slot: int, request: Request, lp, index) -> None:
      """slot's log-probabilities, `index` of `lp`'s arrays (its tokens), if it asks."""
      if lp is None or not request.logprobs:
        return
      top = None
      if request.top_logprobs:
        top = _top_pairs(lp.top_tokens[index], lp.top[index], request.top_logprobs)
      logprobs[slot] = (lp.token[index].tolist(), top)

    if plan.decode_steps:
      # A row's tokens are a prefix of its column: the device loop stops a row for good on
      # its first stop token or when its budget runs out, so only the last one can end it.
      produced = (decode_tokens >= 0).sum(axis=0)
      new = {i: decode_tokens[:produced[i], i].tolist() for i, s in enumerate(plan.rows)
             if s is not None and produced[i]}
      for i in new:
        take(i, plan.rows[i].request, decode_logprobs, (slice(produced[i]), i))
      # Each step cached the previous newest token.
      self.cache.grow_decode(list(new), [len(t) for t in new.values()])
    sampled = iter(np.asarray(prefill_tokens).tolist())
    self.cache.grow([c.slot for c in plan.prefill], [len(c.tokens) for c in plan.prefill])
    j = 0  # the sample's row among the prefill's
    scored = 0  # the chunk's row among `prompt_logprobs`'
    prompts: dict[int, tuple] = {}  # slot -> its prompt's log-probabilities and top ones
    for chunk in plan.prefill:
      self.cache.fork(chunk.slot, chunk.forks)
      if chunk.targets is not None:
        s, n = self.slots[chunk.slot], len(chunk.targets)
        s.prompt_logprobs += prompt_logprobs.token[scored, :n].tolist()
        if chunk.top_logprobs:
          s.prompt_top_logprobs += _top_pairs(prompt_logprobs.top_tokens[scored, :n],
                                              prompt_logprobs.top[scored, :n],
                                              chunk.top_logprobs)
        scored += 1
        if chunk.samples:  # the prompt's last chunk: every sample's first event has them
          start = s.request.prompt_logprobs_start  # (before it: None, computed or not)
          whole = ((None,) * start + tuple(s.prompt_logprobs[start:]),
                   s.prompt_top_logprobs and (None,) * start
                   + tuple(s.prompt_top_logprobs[start:]))
          prompts.update((slot, whole) for slot, _ in chunk.samples)
          s.prompt_logprobs = s.prompt_top_logprobs = None
      for slot, s in chunk.samples:
        new[slot] = [next(sampled)]
        take(slot, s.request, prefill_logprobs, slice(j, j + 1))  # (a [1] slice)
        j += 1
        s.decoding, s.parent = True, None
    events = []
    for slot, t in new.items():
      s = self.slots[slot]
      s.tokens += t
      if s.request.guide is not None:
        s.guide_state = s.request.guide.walk(s.guide_state, t)
        if s.guide_state < 0:  # the device masks such tokens: the two disagree
          raise RuntimeError(f"request {s.request_id}: a token its guide does not allow was "
                             f"generated ({t}): a bug")
      reason = self._stop_reason(s)
      if reason is not None:
        self._finished.append(slot)
      events.append((s.request_id, s.sample, t, reason) + logprobs.get(slot, (None, None))
                    + prompts.get(slot, (None, None)))
    return events

  def settle(self, plan: Plan, page_table: np.ndarray, num_free: int) -> None:
    """Takes the pool's state after a plan (after `take_tokens`): the page-table rows
    that grew, the prefix cache's new pages; and retires the sequences that finished.

    Args:
      plan: the plan the runner executed.
      page_table, num_free: the pool's after the call.

    Raises:
      RuntimeError: the pool differs from the host accounting (a reservation failed on
        device: a scheduler bug).
    """
    self.cache.sync(page_table, num_free)
    self.cache.register([(c.slot, self.slots[c.slot].keys, c.start, c.start + len(c.tokens))
                         for c in plan.prefill])
    finished, self._finished = self._finished, []
    self._retire(finished)
