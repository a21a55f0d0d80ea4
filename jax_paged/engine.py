"""A continuous-batching generation engine over the paged KV pool.

The engine keeps a queue of requests and `max_batch` decode slots (slot i is pool sequence
i). Each round it

1. admits waiting requests in arrival order while a slot and pages for their prompt are
   free, and prefills them together (one jitted prefill, padded to bucketed shapes);
2. decodes every running sequence for up to `steps_per_call` steps in ONE jitted device
   loop that samples on device and stops rows on EOS / stop tokens / max_new_tokens, so
   Python dispatch is paid once per chunk, not once per token;
3. streams the new tokens, releases finished sequences' pages at once, and goes back to 1.

Before each chunk the host checks, from its exact mirror of the sequence lengths, that the
chunk cannot run out of pages. When even one step does not fit, the most recently admitted
request is preempted: its pages are released and it goes back to the front of the queue,
to be recomputed later from its prompt plus the tokens it already produced (vLLM's
recompute preemption). Each token is drawn with the key `fold_in(key(seed), index)` where
index counts the request's own tokens, so results do not depend on batching, arrival order
or preemption.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import math
import time
from typing import Callable, Iterator, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jax_paged import pool as pool_lib
from jax_paged import sampling
from models import gpt2


@dataclasses.dataclass(frozen=True)
class Request:
  """One generation request.

  Attributes:
    prompt: token ids (non-empty).
    max_new_tokens: the most tokens to generate (>= 1).
    temperature: 0 is greedy, otherwise the softmax temperature.
    top_k: keep the k most likely tokens (None = all).
    top_p: nucleus sampling mass in (0, 1] (None = all).
    seed: this request's sampling seed.
    stop_token_ids: tokens that end the request (included in its output), in addition to
      the engine's `eos_token_id`.
  """

  prompt: Sequence[int]
  max_new_tokens: int
  temperature: float = 0.0
  top_k: int | None = None
  top_p: float | None = None
  seed: int = 0
  stop_token_ids: Sequence[int] = ()


@dataclasses.dataclass(frozen=True)
class TokenEvent:
  """A token produced for request `request_id` (its index in the submitted list).
  `finish_reason` is None while the request goes on, else 'stop' or 'length'."""

  request_id: int
  token: int
  finish_reason: str | None


@dataclasses.dataclass
class Report:
  """What a run did. `kv_efficiency` is live tokens / reserved token slots (pages in use x
  page_size), averaged over decode chunks: the fraction of reserved KV memory holding data."""

  num_requests: int = 0
  generated_tokens: int = 0
  elapsed_s: float = 0.0
  ttft_s: list[float] = dataclasses.field(default_factory=list)
  peak_pages_in_use: int = 0
  num_pages: int = 0
  kv_efficiency: float = 0.0
  preemptions: int = 0
  decode_calls: int = 0
  prefill_calls: int = 0
  decode_steps: int = 0       # device decode steps run (a step decodes every running row)
  decode_tokens: int = 0      # tokens those steps produced
  decode_s: float = 0.0       # wall time of the decode calls (until their tokens are back)
  prefill_s: float = 0.0      # wall time of the prefill calls

  @property
  def tokens_per_s(self) -> float:
    return self.generated_tokens / self.elapsed_s if self.elapsed_s > 0 else 0.0

  def __str__(self) -> str:
    ttft = np.asarray(self.ttft_s) * 1e3 if self.ttft_s else np.zeros(1)
    return "\n".join([
        f"requests: {self.num_requests}  generated tokens: {self.generated_tokens}  "
        f"time: {self.elapsed_s:.2f} s",
        f"time to first token: mean {ttft.mean():.1f} ms, p50 {np.median(ttft):.1f} ms, "
        f"max {ttft.max():.1f} ms",
        f"KV pages: peak {self.peak_pages_in_use} of {self.num_pages} in use; memory "
        f"efficiency {self.kv_efficiency:.1%} (live tokens / reserved slots)",
        f"preemptions: {self.preemptions}  prefill calls: {self.prefill_calls} "
        f"({self.prefill_s:.2f} s)  decode calls: {self.decode_calls} ({self.decode_s:.2f} s, "
        f"{self.decode_steps} steps, {self.decode_tokens / max(1, self.decode_steps):.1f} "
        f"sequences per step, {1e3 * self.decode_s / max(1, self.decode_steps):.2f} ms per "
        f"step)",
        f"throughput: {self.tokens_per_s:.1f} tokens/s",
    ])


@dataclasses.dataclass
class _Running:
  """Host state of a request in a slot. The pool caches `prompt + tokens` but the newest
  token, which the next decode step feeds in."""

  request_id: int
  request: Request
  tokens: list[int]  # generated so far (all of them, across preemptions)
  cached: int        # tokens in the pool for this sequence
  admitted_at: int   # admission counter: the newest is preempted first


def _bucket(n: int, lo: int) -> int:
  """n rounded up to a power of two times lo, so shapes (and compilations) stay few."""
  return lo * 2 ** max(0, math.ceil(math.log2(max(n, 1) / lo)))


def _row_keys(seeds: jax.Array, index: jax.Array) -> jax.Array:
  return jax.vmap(lambda s, i: jax.random.fold_in(jax.random.key(s), i))(seeds, index)


def _sample_rows(logits, seeds, index, temperature, top_k, top_p, *, greedy: bool):
  """int32 [B]: each row sampled with its own key `fold_in(key(seed), index)`."""
  if greedy:
    return sampling.greedy(logits)
  row = lambda l, k, t, tk, tp: sampling.sample(l[None], k, temperature=t, top_k=tk,
                                                top_p=tp)[0]
  return jax.vmap(row)(logits, _row_keys(seeds, index), temperature, top_k, top_p)


def _prefill_and_sample(graphdef, params, kv, tokens, lengths, seq_ids, seeds, index,
                        temperature, top_k, top_p, *, greedy: bool):
  """Prefills fresh sequences and samples each one's next token."""
  logits, kv = gpt2.prefill(graphdef, params, kv, tokens, lengths, seq_ids)
  return _sample_rows(logits, seeds, index, temperature, top_k, top_p, greedy=greedy), kv


# XLA runs a while loop from the host: each iteration copies the predicate to the host,
# which then launches the next body while the GPU waits. So the decode loop checks only
# between groups of this many steps, run as a fixed-trip inner loop that XLA launches
# without a round trip (H200: 465 -> 432 µs per step at batch 1, ~1-2% at batch 128;
# benchmarks/RESULTS.md). The price: when every row stops inside a group, the rest of the
# group runs idle (no row active, nothing written). Each check still idles the GPU (~0.2 ms
# at GPT-2 124M's batch 128 on an H200), so a call that cannot end early runs unchecked
# (`needs_checks`).
STEPS_PER_CHECK = 16


def _steps_per_check(max_steps: int) -> int:
  """Steps between the decode loop's checks for a call of at most `max_steps` steps."""
  return min(STEPS_PER_CHECK, max_steps)


def needs_checks(num_steps: int, max_steps: int, active: np.ndarray, budget: np.ndarray,
                 stop_ids: np.ndarray) -> bool:
  """Whether a decode call of `num_steps` steps (of at most `max_steps`) can end early, and
  so needs the loop that checks between groups of steps.

  It cannot when it runs every step a call can (num_steps == max_steps), no active row has
  a stop token, and some active row's budget lasts all of them: the checked loop would
  then run every group. Arguments as `_decode_loop`'s ([B] rows, stop_ids [B, S]).
  """
  active = np.asarray(active, bool)
  return not (num_steps == max_steps and active.any()
              and (np.asarray(stop_ids)[active] < 0).all()
              and np.asarray(budget)[active].max() >= max_steps)


def _decode_loop(graphdef, params, kv, num_steps, tokens, active, index, budget, stop_ids,
                 seeds, temperature, top_k, top_p, *, max_steps: int, greedy: bool,
                 checked: bool):
  """Up to `num_steps` (<= max_steps) decode steps on device.

  With `checked`, the loop checks every `_steps_per_check(max_steps)` steps whether steps
  are left and a row is still active; steps past `num_steps`, and those after every row
  has stopped in a group under way, run with every row inactive: they write nothing.
  Unchecked, it runs all `max_steps` steps with no host round trip (for calls that cannot
  end early, `needs_checks`).

  Args (per slot, [B]): tokens, the newest token (not yet cached); active; index, tokens
  generated so far (the sampling key index); budget, tokens still allowed; stop_ids [B, S]
  (-1 padded); seeds, temperature, top_k, top_p.

  Returns:
    (int32 [max_steps, B] new tokens, -1 where a row was inactive; the pool).
  """
  b = tokens.shape[0]
  # Known when tracing (not traced): `reserve` then takes its one-kernel decode path.
  seq_ids = np.arange(b, dtype=np.int32)

  def cond(carry):
    step, _, _, active, *_ = carry
    return (step < num_steps) & jnp.any(active)

  def body(_, carry):
    # `active` rows are active at `step`, which is below num_steps for any active row.
    step, kv, tokens, active, index, budget, out = carry
    if greedy:  # the argmax without the [B, vocab] logits
      new, kv = gpt2.decode(graphdef, params, kv, tokens, seq_ids, active, greedy=True)
    else:
      logits, kv = gpt2.decode(graphdef, params, kv, tokens, seq_ids, active)
      new = _sample_rows(logits, seeds, index, temperature, top_k, top_p, greedy=False)
    # `out` has a row for every step a group can run: no bounds check (an XLA reduction
    # kernel per step for `.at[step].set(..., mode="drop")`).
    out = jax.lax.dynamic_update_slice(out, jnp.where(active, new, -1)[None], (step, 0))
    index += active
    budget -= active
    stopped = jnp.any(new[:, None] == stop_ids, axis=1) | (budget <= 0)
    tokens = jnp.where(active, new, tokens)
    # Masked for the next step here, in this fusion, rather than by a kernel of its own at
    # the start of the next.
    active &= ~stopped & (step + 1 < num_steps)
    return step + 1, kv, tokens, active, index, budget, out

  per_check = _steps_per_check(max_steps) if checked else max_steps
  out = jnp.full((-(-max_steps // per_check) * per_check, b), -1, jnp.int32)
  carry = (jnp.int32(0), kv, tokens, active, index, budget, out)
  group = lambda carry: jax.lax.fori_loop(0, per_check, body, carry)
  _, kv, *_, out = jax.lax.while_loop(cond, group, carry) if checked else group(carry)
  return out[:max_steps], kv


# The decode loop's per-row arguments travel as one int32 array [8 + S, B]: a call
# with nine numpy arrays spent ~215 µs of its ~840 µs of fixed cost copying them to the
# device one by one (H200, benchmarks/RESULTS.md), while the GPU waited.
_ROW_FIELDS = (("tokens", np.int32), ("active", np.int32), ("index", np.int32),
               ("budget", np.int32), ("seeds", np.uint32), ("top_k", np.int32),
               ("temperature", np.float32), ("top_p", np.float32))


def pack_decode_rows(*, tokens, active, index, budget, stop_ids, seeds, temperature,
                     top_k, top_p) -> np.ndarray:
  """The decode loop's per-row arguments (see `_decode_loop`) as int32 [8 + S, B]: the
  fields of `_ROW_FIELDS` in order (uint32 seeds and float32 temperature / top_p by their
  bits), then stop_ids [B, S] transposed."""
  fields = dict(tokens=tokens, active=active, index=index, budget=budget, seeds=seeds,
                top_k=top_k, temperature=temperature, top_p=top_p)
  rows = [np.asarray(fields[name]).astype(dtype).view(np.int32)
          for name, dtype in _ROW_FIELDS]
  return np.concatenate([np.stack(rows), np.asarray(stop_ids, np.int32).T])


def _unpack_decode_rows(rows: jax.Array) -> dict[str, jax.Array]:
  """On device: `pack_decode_rows`' array back to the keyword arguments of `_decode_loop`."""
  args = {name: jax.lax.bitcast_convert_type(row, dtype)
          for (name, dtype), row in zip(_ROW_FIELDS, rows)}
  args["active"] = args["active"] != 0
  args["stop_ids"] = rows[len(_ROW_FIELDS):].T
  return args


@functools.lru_cache(maxsize=8)
def _jitted(graphdef: nnx.GraphDef, treedef) -> tuple[Callable, Callable]:
  """The engine's device functions for one model structure, pool donated.

  They take the parameters as the list `jax.tree.leaves(params)` (`treedef` = their
  `jax.tree.structure`): flattening an `nnx.State` of GPT-2 124M's 148 arrays costs
  ~130-190 µs per call, paid on the host while the GPU waits between decode chunks. The
  graphdef is bound rather than static, as in `gpt2.jit_steps`: hashing it per call costs
  ~1 ms.

    prefill(leaves, kv, tokens, lengths, seq_ids, seeds, index, temperature, top_k, top_p,
            greedy=...) -> (int32 [B] next tokens, pool)
    decode(leaves, kv, num_steps, pack_decode_rows(...), max_steps=..., greedy=...,
           checked=...) -> (int32 [max_steps, B] new tokens, pool)
  """
  def prefill(leaves, kv, *args, **kwargs):
    return _prefill_and_sample(graphdef, jax.tree.unflatten(treedef, leaves), kv, *args,
                               **kwargs)

  def decode(leaves, kv, num_steps, rows, *, max_steps: int, greedy: bool, checked: bool):
    return _decode_loop(graphdef, jax.tree.unflatten(treedef, leaves), kv, num_steps,
                        max_steps=max_steps, greedy=greedy, checked=checked,
                        **_unpack_decode_rows(rows))

  return (jax.jit(prefill, donate_argnums=1, static_argnames="greedy"),
          jax.jit(decode, donate_argnums=1,
                  static_argnames=("max_steps", "greedy", "checked")))


def _device_functions(graphdef: nnx.GraphDef, params: nnx.State
                      ) -> tuple[Callable, Callable, list[jax.Array]]:
  """`_jitted`'s (prefill, decode) for `nnx.split(model)`, and the parameters as they take
  them (flattened here, once)."""
  return (*_jitted(graphdef, jax.tree.structure(params)), jax.tree.leaves(params))


_release = jax.jit(pool_lib.release, donate_argnums=0)


class Engine:
  """Continuous batching for a `models.gpt2.GPT2LMHeadModel`.

  Args:
    model: the model (its config gives n_positions and the pool's shapes).
    max_batch: decode slots (pool sequences) run together.
    num_pages: pages in the pool; or None to size it from `memory_fraction` of the
      device's free memory (`pool.size_pool`, accelerators only).
    page_size: tokens per page.
    steps_per_call: the most decode steps per device call (one host round trip per
      chunk; streamed tokens arrive per chunk). 128 was the fastest measured (GPT-2 124M
      on an H200: 112k vs 105k tokens/s at 32, benchmarks/RESULTS.md). Above
      `STEPS_PER_CHECK` (16), calls that can end early (`needs_checks`) are rounded down
      to whole groups of it.
    max_prefill_tokens: the most (padded) tokens one prefill call processes (bounding
      prefill memory); more admissions go into further calls before the next chunk,
      grouped by length so that short prompts are not padded to long ones.
    admission: "optimistic" (vLLM's policy: admit when the prompt's pages are free, and
      preempt the newest request when the pool runs out mid-decode) or "peak" (admit only
      when every running request can still reach its max_new_tokens: the pool's projected
      use, step by step until the last running request ends, must stay within the pool
      counting every request's growth and its release when it ends; no preemption; best
      when requests rarely stop early).
    eos_token_id: ends every request when generated (optional).
    cache_dtype: the pool dtype (default: the model's compute dtype).
  """

  def __init__(self, model: gpt2.GPT2LMHeadModel, *, max_batch: int = 32,
               num_pages: int | None = None, memory_fraction: float = 0.9,
               page_size: int = 16, steps_per_call: int = 128,
               max_prefill_tokens: int = 16384, admission: str = "optimistic",
               eos_token_id: int | None = None, cache_dtype=None):
    if max_batch < 1:
      raise ValueError(f"max_batch must be >= 1, got {max_batch}")
    if steps_per_call < 1:
      raise ValueError(f"steps_per_call must be >= 1, got {steps_per_call}")
    c = model.config
    self.config = c
    self.max_batch, self.page_size, self.steps_per_call = max_batch, page_size, steps_per_call
    self.max_prefill_tokens = max_prefill_tokens
    if admission not in ("optimistic", "peak"):
      raise ValueError(f"admission must be 'optimistic' or 'peak', got {admission!r}")
    self.admission = admission
    self.eos_token_id = eos_token_id
    cache_dtype = model.dtype if cache_dtype is None else cache_dtype
    if num_pages is None:
      self.sizing = pool_lib.size_pool(num_layers=c.n_layer, num_kv_heads=c.n_head,
                                       head_dim=c.head_dim, page_size=page_size,
                                       dtype=cache_dtype, utilization=memory_fraction)
      num_pages = self.sizing.num_pages
    else:
      self.sizing = None
    self.max_pages_per_seq = -(-c.n_positions // page_size)
    self.kv = model.create_pool(num_pages=num_pages, page_size=page_size, max_seqs=max_batch,
                                max_pages_per_seq=self.max_pages_per_seq, dtype=cache_dtype)
    self.num_pages = num_pages
    self._prefill_fn, self._decode_fn, self._params = _device_functions(*nnx.split(model))

  def _pages(self, tokens: int) -> int:
    return -(-tokens // self.page_size)

  def _peak_pages(self, r: Request) -> int:
    """Pages a request holds at its longest (the newest token is never cached)."""
    return self._pages(len(r.prompt) + r.max_new_tokens - 1)

  def _projected_pages(self, cached: np.ndarray, left: np.ndarray) -> np.ndarray:
    """int64 [n_positions + steps_per_call + 1]: pages held t decode steps from now by
    requests with `cached` tokens in the pool and `left` decode steps to go, summed.

    A request grows one token per step and releases its pages when it ends; it is
    retired at the end of its device chunk, so its pages count for up to
    steps_per_call - 1 steps longer.
    """
    t = np.arange(self.config.n_positions + self.steps_per_call + 1)[None, :]
    cached, left = np.asarray(cached)[:, None], np.asarray(left)[:, None]
    held = -(-(cached + np.minimum(t, left)) // self.page_size)
    return np.where(t < left + self.steps_per_call, held, 0).sum(axis=0)

  def _check(self, requests: Sequence[Request]) -> None:
    limit = min(self.num_pages, self.max_pages_per_seq)
    for i, r in enumerate(requests):
      if len(r.prompt) == 0:
        raise ValueError(f"request {i}: prompt is empty")
      if r.max_new_tokens < 1:
        raise ValueError(f"request {i}: max_new_tokens must be >= 1, got {r.max_new_tokens}")
      if r.temperature < 0:
        raise ValueError(f"request {i}: temperature must be >= 0, got {r.temperature}")
      if r.top_p is not None and not 0.0 < r.top_p <= 1.0:
        raise ValueError(f"request {i}: top_p must be in (0, 1], got {r.top_p}")
      if not 0 <= r.seed < 2 ** 32:
        raise ValueError(f"request {i}: seed must be in [0, 2**32), got {r.seed}")
      if r.top_k is not None and r.top_k < 1:
        raise ValueError(f"request {i}: top_k must be >= 1, got {r.top_k}")
      bad = [t for t in r.prompt if not 0 <= t < self.config.vocab_size]
      if bad:
        raise ValueError(f"request {i}: token ids {bad[:5]} outside [0, vocab_size="
                         f"{self.config.vocab_size})")
      if len(r.prompt) + r.max_new_tokens - 1 > self.config.n_positions:
        raise ValueError(f"request {i}: prompt of {len(r.prompt)} tokens + {r.max_new_tokens} "
                         f"new tokens exceeds the model's n_positions={self.config.n_positions}")
      if self._peak_pages(r) > limit:
        raise ValueError(f"request {i}: needs {self._peak_pages(r)} pages of {self.page_size} "
                         f"tokens but the pool holds {self.num_pages}: the pool is too small "
                         f"for this request")

  def generate(self, requests: Sequence[Request],
               on_token: Callable[[TokenEvent], None] | None = None
               ) -> tuple[list[list[int]], Report]:
    """Runs every request to completion; returns (new tokens per request, report)."""
    outputs: list[list[int]] = [[] for _ in requests]
    for rid, tokens, reason in self._run(requests):
      outputs[rid] += tokens
      if on_token is not None:
        for j, token in enumerate(tokens):
          on_token(TokenEvent(rid, token, reason if j == len(tokens) - 1 else None))
    return outputs, self.report

  def stream(self, requests: Sequence[Request]) -> Iterator[TokenEvent]:
    """Yields each token as soon as the host has it. `self.report` is complete once the
    iterator is exhausted."""
    for rid, tokens, reason in self._run(requests):
      for j, token in enumerate(tokens):
        yield TokenEvent(rid, token, reason if j == len(tokens) - 1 else None)

  def _run(self, requests: Sequence[Request]) -> Iterator[tuple[int, list[int], str | None]]:
    """The scheduling loop. Yields (request_id, new tokens, finish_reason) per request per
    device call: whole chunks, so the host pays per request, not per token."""
    self._check(requests)
    self.report = report = Report(num_requests=len(requests), num_pages=self.num_pages)
    start = time.perf_counter()
    waiting = collections.deque(range(len(requests)))
    slots: list[_Running | None] = [None] * self.max_batch
    progress: dict[int, list[int]] = {}  # tokens of preempted requests, kept for recompute
    admissions = 0
    efficiency = []

    def free_pages() -> int:
      return self.num_pages - sum(self._pages(s.cached) for s in slots if s is not None)

    def retire(done: list[int]) -> None:
      """Frees these slots and their pages, all in one device call."""
      if done:
        ids = np.full((self.max_batch,), -1, np.int32)  # -1 pads: ignored under jit
        ids[:len(done)] = done
        self.kv = _release(self.kv, ids)
        for slot in done:
          slots[slot] = None

    while waiting or any(slots):
      # 1. Admit in arrival order while slots and pages allow: "optimistic" keeps one
      #    page of headroom per running sequence so they can keep going; "peak" admits
      #    only while the projected use stays within the pool until every running
      #    request (admitted ones included) reaches its max_new_tokens.
      admitted = []
      if self.admission == "peak":
        running = [s for s in slots if s is not None]
        projected = self._projected_pages(
            [s.cached for s in running],
            [s.request.max_new_tokens - len(s.tokens) for s in running])
      else:
        budget = free_pages() - sum(s is not None for s in slots)
      while waiting and None in slots:
        rid = waiting[0]
        done_tokens = len(progress.get(rid, []))
        context = len(requests[rid].prompt) + done_tokens
        if self.admission == "peak":
          # Prefill caches the context and samples one token; then decode steps.
          grown = projected + self._projected_pages(
              [context], [requests[rid].max_new_tokens - done_tokens - 1])
          fits = grown.max() <= self.num_pages
        else:
          fits = self._pages(context) + 1 <= budget
        if not fits and (admitted or any(slots)):
          break
        waiting.popleft()
        slot = slots.index(None)
        slots[slot] = _Running(rid, requests[rid], progress.pop(rid, []), context, admissions)
        admissions += 1
        if self.admission == "peak":
          projected = grown
        else:
          budget -= self._pages(context) + 1
        admitted.append(slot)
      # Everything admitted starts now, in as many prefill calls as max_prefill_tokens
      # needs (deferring some to the next round would split the requests into cohorts
      # that peak together).
      for call in self._prefill_calls([(i, slots[i].cached) for i in admitted]):
        yield from self._prefill(call, slots, report, start, retire)
      report.peak_pages_in_use = max(report.peak_pages_in_use, self.num_pages - free_pages())

      # 2. Fit the chunk in the free pages, preempting the newest request if not one step fits.
      running = [i for i, s in enumerate(slots) if s is not None]
      if not running:
        continue
      steps = self._steps_that_fit(slots, free_pages())
      while steps == 0:
        victim = max((i for i, s in enumerate(slots) if s is not None),
                     key=lambda i: slots[i].admitted_at)
        progress[slots[victim].request_id] = slots[victim].tokens
        waiting.appendleft(slots[victim].request_id)
        retire([victim])
        report.preemptions += 1
        steps = self._steps_that_fit(slots, free_pages())
      if not any(slots):
        continue
      live = sum(s.cached for s in slots if s is not None)
      efficiency.append(live / max(1, (self.num_pages - free_pages()) * self.page_size))

      # 3. Decode the chunk on device, then stream and retire.
      yield from self._decode(steps, slots, report, retire)
      report.peak_pages_in_use = max(report.peak_pages_in_use, self.num_pages - free_pages())
    report.elapsed_s = time.perf_counter() - start
    report.kv_efficiency = float(np.mean(efficiency)) if efficiency else 1.0

  def _steps_that_fit(self, slots: list[_Running | None], free: int) -> int:
    """The most decode steps (<= steps_per_call) whose new pages all fit in `free`."""
    running = [s for s in slots if s is not None]
    cached = np.array([s.cached for s in running])
    left = np.array([s.request.max_new_tokens - len(s.tokens) for s in running])
    steps = np.arange(1, self.steps_per_call + 1)[:, None]
    ps = self.page_size
    grown = -(-(cached + np.minimum(steps, left)) // ps) - -(-cached // ps)  # [steps, running]
    fits = np.flatnonzero(grown.sum(axis=1) <= free)
    return int(fits[-1]) + 1 if fits.size else 0

  def _sampling_arrays(self, running: list[_Running | None]):
    """Per-row sampling settings; rows without a request get greedy defaults.

    Per-call host arrays are numpy throughout: the jitted call transfers them as it
    dispatches, where `jnp.asarray` of a list cost ~1 ms each on the device's host (a
    measured 10 ms per decode call for the ten arrays).
    """
    def column(fn, dtype):
      return np.asarray([fn(s.request) if s is not None else 0 for s in running], dtype)
    return dict(
        seeds=column(lambda r: r.seed, np.uint32),
        temperature=column(lambda r: r.temperature, np.float32),
        top_k=column(lambda r: r.top_k or 0, np.int32),
        top_p=np.asarray([1.0 if s is None or s.request.top_p is None else s.request.top_p
                          for s in running], np.float32),
        greedy=all(s is None or s.request.temperature == 0 for s in running))

  def _stop_reason(self, s: _Running) -> str | None:
    """Why the request ends after its newest token, or None if it goes on."""
    token = s.tokens[-1]
    if token == self.eos_token_id or token in s.request.stop_token_ids:
      return "stop"
    if len(s.tokens) >= s.request.max_new_tokens:
      return "length"
    return None

  def _prefill_calls(self, contexts: list[tuple[int, int]]) -> list[list[int]]:
    """Groups (slot, context length) pairs into prefill calls of at most
    max_prefill_tokens padded tokens (a lone longer prompt gets a call of its own).

    Longest first, so each call pads its rows to similar lengths: a call is as wide as
    its longest row (bucketed), and arrival order would put 32-token prompts beside
    512-token ones.
    """
    calls: list[list[int]] = []
    width = 0  # the bucketed length of the current call's first (longest) row
    for slot, length in sorted(contexts, key=lambda c: -c[1]):
      if not calls or (_bucket(len(calls[-1]) + 1, 1) * width > self.max_prefill_tokens):
        calls.append([])
        width = _bucket(length, self.page_size)
      calls[-1].append(slot)
    return calls

  def _prefill(self, admitted, slots, report, start, retire):
    rows = [slots[i] for i in admitted]
    contexts = [list(s.request.prompt) + s.tokens for s in rows]
    n = _bucket(len(rows), 1)
    width = _bucket(max(map(len, contexts)), self.page_size)
    tokens = np.zeros((n, width), np.int32)
    lengths = np.ones((n,), np.int32)
    seq_ids = np.full((n,), -1, np.int32)  # padding rows: invalid ids reserve nothing
    for j, (slot, ctx) in enumerate(zip(admitted, contexts)):
      tokens[j, :len(ctx)] = ctx
      lengths[j] = len(ctx)
      seq_ids[j] = slot
    rows_padded = rows + [None] * (n - len(rows))
    called = time.perf_counter()
    new, self.kv = self._prefill_fn(
        self._params, self.kv, tokens, lengths, seq_ids,
        index=np.asarray([len(s.tokens) if s else 0 for s in rows_padded], np.int32),
        **self._sampling_arrays(rows_padded))
    new = np.asarray(new)
    report.prefill_s += time.perf_counter() - called
    report.prefill_calls += 1
    cached = np.asarray(self.kv.lengths)[admitted]
    if not np.array_equal(cached, lengths[:len(rows)]):
      raise RuntimeError(f"prefill could not reserve pages (lengths {cached.tolist()}, "
                         f"expected {lengths[:len(rows)].tolist()}): scheduler bug")
    now = time.perf_counter()
    done = []
    for j, (slot, s) in enumerate(zip(admitted, rows)):
      if not s.tokens:
        report.ttft_s.append(now - start)
      s.tokens.append(int(new[j]))
      report.generated_tokens += 1
      reason = self._stop_reason(s)
      if reason is not None:
        done.append(slot)
      yield s.request_id, [int(new[j])], reason
    retire(done)

  def _decode(self, steps, slots, report, retire):
    b = self.max_batch
    stops = [([self.eos_token_id] if self.eos_token_id is not None else [])
             + list(s.request.stop_token_ids) if s is not None else [] for s in slots]
    stop_ids = np.full((b, _bucket(max(map(len, stops)), 1)), -1, np.int32)
    for i, ids in enumerate(stops):
      stop_ids[i, :len(ids)] = ids
    called = time.perf_counter()
    active = np.array([s is not None for s in slots])
    budget = np.array([s.request.max_new_tokens - len(s.tokens) if s else 0 for s in slots],
                      np.int32)
    checked = needs_checks(steps, self.steps_per_call, active, budget, stop_ids)
    # Whole groups of checked steps: a partial group would run idle steps to its end.
    per_check = _steps_per_check(self.steps_per_call)
    if checked and steps > per_check:
      steps -= steps % per_check
    sampling = self._sampling_arrays(slots)
    greedy = sampling.pop("greedy")
    rows = pack_decode_rows(
        tokens=[s.tokens[-1] if s else 0 for s in slots], active=active,
        index=[len(s.tokens) if s else 0 for s in slots], budget=budget, stop_ids=stop_ids,
        **sampling)
    out, self.kv = self._decode_fn(self._params, self.kv, np.int32(steps), rows,
                                   max_steps=self.steps_per_call, greedy=greedy,
                                   checked=checked)
    out = np.asarray(out)
    report.decode_s += time.perf_counter() - called
    report.decode_calls += 1
    # A row's tokens are a prefix of its column: the device loop stops a row for good on
    # its first stop token or when its budget runs out, so only the last one can end it.
    produced = (out >= 0).sum(axis=0)
    report.decode_steps += int(produced.max())
    report.decode_tokens += int(produced.sum())
    done = []
    for i, s in enumerate(slots):
      if s is None or not produced[i]:
        continue
      new = out[:produced[i], i].tolist()
      s.cached += len(new)  # each step cached the previous newest token
      s.tokens += new
      report.generated_tokens += len(new)
      reason = self._stop_reason(s)
      if reason is not None:
        done.append(i)
      yield s.request_id, new, reason
    cached = np.asarray(self.kv.lengths)
    for i, s in enumerate(slots):
      if s is not None and cached[i] != s.cached:
        raise RuntimeError(f"slot {i} holds {cached[i]} cached tokens, expected {s.cached}: "
                           f"a decode step found no free page (scheduler bug)")
    retire(done)
