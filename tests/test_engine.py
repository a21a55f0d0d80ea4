"""The serving layer: the continuous-batching engine against static-batch `generate`
under pressure, and its scheduler and runner on their own."""

import collections
import contextlib
import dataclasses
import functools
import gc
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jax_paged import Engine, Guide, KVPool, Request, Vocabulary, generate, pool
from jax_paged.serving import admission
from jax_paged.serving import engine as engine_lib
from jax_paged.serving import runner as runner_lib
from jax_paged.serving.kv_cache_manager import KVCacheManager
from jax_paged.serving.scheduler import Plan, RunningRequest, Scheduler
from models import gpt2

CONFIG = gpt2.GPT2Config(vocab_size=97, n_positions=96, n_embd=32, n_layer=2, n_head=4,
                         bos_token_id=None, eos_token_id=None)


@pytest.fixture(scope="module")
def model():
  return gpt2.GPT2LMHeadModel(CONFIG, rngs=nnx.Rngs(7))


@pytest.fixture(scope="module")
def prompts():
  rng = np.random.default_rng(11)
  return [rng.integers(0, CONFIG.vocab_size, rng.integers(1, 30)).tolist() for _ in range(9)]


@pytest.fixture(scope="module")
def greedy_reference(model, prompts):
  return generate(model, prompts, 14, page_size=8)


def assert_pages_back(eng: Engine) -> None:
  """After a run: no sequence holds a page; the pages still held are the prefix cache's
  (one reference each, its hold); `reset_prefix_cache` frees them, leaving every page free
  and every count zero."""
  refs = np.asarray(eng.kv.refcounts)
  assert not np.asarray(eng.kv.lengths).any()
  assert refs.max(initial=0) <= 1 and int(refs.sum()) == eng.num_cached_pages
  assert int(eng.kv.num_free_pages()) == eng.num_pages - eng.num_cached_pages
  assert eng.reset_prefix_cache() == int(refs.sum()) and eng.num_cached_pages == 0
  assert int(eng.kv.num_free_pages()) == eng.num_pages
  assert not np.asarray(eng.kv.refcounts).any()


# steps_per_call 20: calls rounded down to a group of STEPS_PER_CHECK = 16 checked steps,
# in which every row stops (13 decode steps each) and the rest run idle.
@pytest.mark.parametrize("max_batch,order_seed,steps_per_call",
                         [(1, 0, 5), (3, 1, 5), (16, 2, 5), (3, 3, 20), (40, 4, 5)])
def test_greedy_matches_static_generate_whatever_order_and_capacity(
    model, prompts, greedy_reference, max_batch, order_seed, steps_per_call):
  order = np.random.default_rng(order_seed).permutation(len(prompts))
  eng = Engine(model, max_batch=max_batch, num_pages=64, page_size=8,
               steps_per_call=steps_per_call)
  outputs, report = eng.generate([Request(prompts[i], 14) for i in order])
  assert [outputs[j] for j in np.argsort(order)] == greedy_reference
  assert report.generated_tokens == 14 * len(prompts) and report.preemptions == 0
  assert_pages_back(eng)


def test_decode_calls_run_over_the_occupied_slots(model, prompts, greedy_reference,
                                                  monkeypatch):
  assert runner_lib.decode_width([None] * 40) == 16
  assert runner_lib.decode_width([None] * 16 + [object()] + [None] * 23) == 32
  assert runner_lib.decode_width([None] * 19 + [object()]) == 20  # at most every slot
  widths = []
  decode_loop = runner_lib.ModelRunner.decode_loop

  def spy(self, kv, num_steps, **rows):
    widths.append(len(rows["tokens"]))
    return decode_loop(self, kv, num_steps, **rows)

  monkeypatch.setattr(runner_lib.ModelRunner, "decode_loop", spy)
  eng = Engine(model, max_batch=40, num_pages=256, page_size=8)
  # 27 sequences in slots 0-26: calls over 32 slots of 40, the same tokens.
  outputs, _ = eng.generate([Request(p, 14) for p in prompts * 3])
  assert outputs == greedy_reference * 3
  assert set(widths) == {32}
  assert_pages_back(eng)


def test_packed_host_arrays_round_trip_every_field():
  """A call's host arrays survive the one-array transfer bit for bit: uint32 seeds past
  2**31, float temperatures and top-p, bools, a 2-D array and a scalar."""
  rng = np.random.default_rng(0)
  b, s = 5, 3
  rows = dict(num_steps=np.int32(37), tokens=rng.integers(0, 50257, b, np.int32),
              active=rng.random(b) < 0.5, budget=rng.integers(-3, 1000, b, np.int32),
              stop_ids=rng.integers(-1, 50257, (b, s), np.int32),
              seeds=rng.integers(0, 2**32, b, np.uint32),
              temperature=rng.random(b).astype(np.float32) * 2,
              top_p=rng.random(b).astype(np.float32))
  packed, layout = runner_lib.pack_arrays(**rows)
  assert packed.dtype == np.int32 and packed.shape == (1 + 6 * b + b * s,)
  unpacked = jax.jit(runner_lib.unpack_arrays, static_argnums=1)(packed, layout)
  assert sorted(unpacked) == sorted(rows)
  for name, value in rows.items():
    assert unpacked[name].dtype == value.dtype and unpacked[name].shape == value.shape, name
    np.testing.assert_array_equal(np.asarray(unpacked[name]), value, err_msg=name)
  with pytest.raises(TypeError, match="tokens: pack_arrays takes"):
    runner_lib.pack_arrays(tokens=np.zeros(3, np.int64))


def _prefilled(model, prompts):
  """The model's runner, a pool holding prompts[0] and prompts[1] after prefill, their
  lengths, and the decode rows of both by name (greedy; budget to be filled in by the
  caller)."""
  runner = runner_lib.ModelRunner(model)
  kv = runner.create_pool(num_pages=32, page_size=8, max_seqs=2, max_pages_per_seq=12)
  rows = np.arange(2, dtype=np.int32)
  lengths = np.array([len(prompts[0]), len(prompts[1])], np.int32)
  tokens = np.zeros((2, max(lengths)), np.int32)
  for i in rows:
    tokens[i, :lengths[i]] = prompts[i]
  sampling = dict(seeds=np.zeros(2, np.uint32), temperature=np.zeros(2, np.float32),
                  top_k=np.zeros(2, np.int32), top_p=np.ones(2, np.float32),
                  min_p=np.zeros(2, np.float32))
  logits, kv = runner.prefill(kv, tokens, lengths, rows)
  first = np.argmax(np.asarray(logits), axis=-1)
  pack = lambda budget: dict(
      tokens=np.asarray(first, np.int32), active=np.ones(2, bool), index=np.ones(2, np.int32),
      budget=np.asarray(budget, np.int32), stop_ids=np.full((2, 1), -1, np.int32), **sampling)
  return runner, kv, lengths, pack


def test_decode_loop_runs_exactly_num_steps_in_checked_groups(model, prompts):
  """The device loop checks every 16 steps: 37 steps asked of a 40-step call run as three
  groups whose last steps past 37 stay idle (nothing written, lengths unchanged), and a row
  that stops inside a group (budget 2) stays stopped."""
  assert runner_lib.STEPS_PER_CHECK == 16
  reference = generate(model, prompts[:2], 38, page_size=8)
  runner, kv, lengths, pack = _prefilled(model, prompts)
  (out, _, _), kv = runner.decode_loop(kv, 37, max_steps=40, greedy=True, checked=True,
                                       **pack([40, 2]))
  out = np.asarray(out)
  assert out.shape == (40, 2)  # max_steps rows, though 3 groups of 16 ran
  np.testing.assert_array_equal(out[:37, 0], reference[0][1:38])
  np.testing.assert_array_equal(out[:2, 1], reference[1][1:3])
  assert (out[37:] == -1).all() and (out[2:, 1] == -1).all()
  # Each decode step cached the previous newest token.
  np.testing.assert_array_equal(np.asarray(kv.lengths), lengths + [37, 2])


def test_unchecked_decode_loop_matches_the_checked_one(model, prompts):
  """A call that cannot end early gives the same tokens and pool unchecked (no round trip
  between groups) as checked: 40 of 40 steps, one row stopping on its budget (5) inside
  the first group, the other running past the checked loop's group ends (16, 32)."""
  budget = np.array([1 << 30, 5], np.int32)
  active, stop_ids = np.ones(2, bool), np.full((2, 1), -1, np.int32)
  assert not runner_lib.needs_checks(40, 40, active, budget, stop_ids)
  results = []
  for checked in (True, False):
    runner, kv, lengths, pack = _prefilled(model, prompts)
    (out, _, _), kv = runner.decode_loop(kv, 40, max_steps=40, greedy=True,
                                         checked=checked, **pack(budget))
    results.append((np.asarray(out), kv))
  (out_c, kv_c), (out_u, kv_u) = results
  assert out_u.shape == (40, 2) and (out_u[:, 0] >= 0).all() and (out_u[5:, 1] == -1).all()
  np.testing.assert_array_equal(out_u, out_c)
  np.testing.assert_array_equal(np.asarray(kv_u.lengths), lengths + [40, 5])
  for a, b in zip(jax.tree.leaves(kv_u), jax.tree.leaves(kv_c)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


@pytest.mark.parametrize("num_steps,active,budget,stop_ids,expected", [
    (40, [1, 1], [40, 3], [[-1], [-1]], False),    # row 0 runs all 40 steps
    (40, [1, 0], [50, 0], [[-1], [7]], False),     # a stop token on an inactive row only
    (32, [1, 1], [40, 40], [[-1], [-1]], True),    # fewer steps than the call can run
    (40, [1, 1], [39, 3], [[-1], [-1]], True),     # every row ends before step 40
    (40, [1, 1], [40, 40], [[-1], [7]], True),     # a row may stop on a token
    (40, [0, 0], [40, 40], [[-1], [-1]], True),    # no row at all
])
def test_needs_checks_only_where_a_call_can_end_early(num_steps, active, budget, stop_ids,
                                                       expected):
  assert runner_lib.needs_checks(num_steps, 40, np.array(active, bool), np.array(budget),
                             np.array(stop_ids)) is expected


def test_prefill_calls_group_similar_lengths_within_the_token_budget(model, prompts,
                                                                     greedy_reference):
  lengths = [5, 30, 9, 17, 3, 8, 70]
  cache = KVCacheManager(num_pages=64, page_size=8, max_seqs=16, max_pages_per_seq=16)
  scheduler = Scheduler([Request([1] * n, 4) for n in lengths], max_batch=16, cache=cache,
                        admission=admission.OptimisticAdmission(cache), steps_per_call=8,
                        max_prefill_tokens=64)
  device = FakeDevice(cache)
  calls = []
  for _ in range(4):
    calls.append(scheduler.schedule())
    device.run(scheduler, calls[-1])
  # Longest first; a call holds bucket(rows) x bucket(longest) <= 64 padded tokens, and
  # the 70-token prompt is split into a 64-token chunk and the rest. Slots follow arrival
  # order. Admitted together into an idle engine, they are prefilled whole before they
  # decode (in step).
  assert [[(c.slot, c.start, len(c.tokens)) for c in call.prefill] for call in calls] == [
      [(6, 0, 64)], [(6, 64, 6), (1, 0, 30)], [(3, 0, 17), (2, 0, 9)],
      [(5, 0, 8), (0, 0, 5), (4, 0, 3)]]
  assert [call.decode_steps for call in calls] == [0, 0, 0, 0]
  # Many small calls still give static generate's tokens.
  eng = Engine(model, max_batch=16, num_pages=64, page_size=8, max_prefill_tokens=64)
  outputs, report = eng.generate([Request(p, 14) for p in prompts])
  assert outputs == greedy_reference and report.prefill_calls > 2


def _pad(values, n, fill=-1):
  out = np.full((n,), fill, np.int32)
  out[:len(values)] = values
  return out


class FakeDevice:
  """The runner's pool work for a scheduler's plans, on a pool of 1-wide K/V (no model):
  every sampled or decoded token is `token`; its results go to `scheduler.take_tokens`
  and `.settle`. Each pool function is jitted at one padded shape (eager, a run of
  hundreds of plans would take minutes)."""

  MAX_PAGES = 16

  def __init__(self, cache: KVCacheManager):
    self.max_seqs = len(cache.cached)
    self.width = 128  # tokens a prefill chunk may reserve
    self.kv = KVPool.create(num_layers=1, num_kv_heads=1, head_dim=1,
                            num_pages=cache.num_pages, page_size=cache.page_size,
                            max_seqs=self.max_seqs, max_pages_per_seq=self.MAX_PAGES,
                            dtype=jnp.float32)

  def run(self, scheduler, plan, token=7, num_free=None):
    n = self.max_seqs
    kv = _fake_update_pages(self.kv, np.stack([_pad(plan.retain, 64), _pad(plan.evict, 64)]),
                            _pad(plan.release, n))
    # The prefill call attaches its rows that start on cached pages, before it reserves;
    # then attaches its second phase's rows to the pages the first phase's rows hold.
    attached = [c for c in plan.prefill if c.cached is not None]
    attach_pages = np.full((n, self.MAX_PAGES), -1, np.int32)
    for j, c in enumerate(attached):
      assert c.start == len(c.cached) * scheduler.cache.page_size
      attach_pages[j, :len(c.cached)] = c.cached
    kv = _fake_attach(kv, _pad([c.slot for c in attached], n), attach_pages,
                      _pad([c.start for c in attached], n, 0))
    for phase in (False, True):
      chunks = [c for c in plan.prefill if (c.follows is not None) == phase]
      if phase and chunks:
        assert all(c.cached is None and c.start % scheduler.cache.page_size == 0
                   for c in chunks)
        kv = _fake_attach(kv, _pad([c.slot for c in chunks], n),
                          np.asarray(kv.page_table)[_pad([c.follows for c in chunks], n, 0)],
                          _pad([c.start for c in chunks], n, 0))
      for c in chunks:
        kv, ok = _fake_prefill(kv, np.int32(c.slot), np.int32(len(c.tokens)),
                               _pad(c.forks, n), width=self.width)
        assert bool(ok)
    first = [token] * sum(len(c.samples) for c in plan.prefill)
    decoded = np.full((plan.decode_steps, len(plan.rows)), -1)
    for step in range(plan.decode_steps):
      active = np.array([s is not None and step < s.budget for s in plan.rows])
      kv, ok = _fake_decode(kv, active)
      decoded[step, np.asarray(ok) & active] = token
    self.kv = kv
    free = int(kv.num_free) if num_free is None else num_free
    events = scheduler.take_tokens(plan, np.asarray(first), decoded)
    scheduler.settle(plan, np.asarray(kv.page_table), free)
    return events


_fake_update_pages = jax.jit(runner_lib.update_pages)
_fake_attach = jax.jit(pool.attach)


@functools.partial(jax.jit, static_argnames="width")
def _fake_prefill(kv, slot, length, forks, *, width):
  kv, _, ok = pool.reserve(kv, slot[None], length[None], max_new_tokens=width)
  return pool.fork(kv, jnp.broadcast_to(slot, forks.shape), forks), ok[0]


@jax.jit
def _fake_decode(kv, active):
  kv, _, ok = pool.reserve(kv, jnp.arange(active.shape[0]), active, max_new_tokens=1)
  return kv, ok


def test_scheduler_preempts_the_newest_and_releases_at_the_next_plan():
  """Two requests of up to 3 pages each in a 4-page pool: when not one more decode step
  fits, the newer one is preempted, its slot freed in the next plan's `release`; it comes
  back once the first finishes, recomputed from its prompt and the tokens it had."""
  cache = KVCacheManager(num_pages=4, page_size=4, max_seqs=2, max_pages_per_seq=16)
  scheduler = Scheduler([Request([1, 2, 3], 10), Request([4, 5, 6], 10)], max_batch=2,
                        cache=cache, admission=admission.OptimisticAdmission(cache),
                        steps_per_call=4, max_prefill_tokens=64)
  device = FakeDevice(cache)
  plan = scheduler.schedule()
  assert [c.slot for c in plan.prefill] == [0, 1]
  assert device.run(scheduler, plan) == [(0, 0, [7], None) + (None,) * 4,
                                         (1, 0, [7], None) + (None,) * 4]
  for steps in (4, 1):  # 7 then 8 tokens cached each: the 9th needs a third page each
    plan = scheduler.schedule()
    assert plan.decode_steps == steps and not plan.release
    device.run(scheduler, plan)
  assert cache.num_free_pages == 0
  plan = scheduler.schedule()
  assert plan.release == (1,) and plan.rows[1] is None and plan.decode_steps == 4
  assert scheduler.num_preemptions == 1 and [w[0] for w in scheduler.waiting] == [1]
  assert device.run(scheduler, plan) == [(0, 0, [7] * 4, "length") + (None,) * 4]
  assert cache.peak_used_pages == 4
  plan = scheduler.schedule()
  assert plan.release == (0,) and [c.slot for c in plan.prefill] == [0]
  assert list(plan.prefill[0].tokens) == [4, 5, 6] + [7] * 6  # prompt + the tokens it had
  with pytest.raises(RuntimeError, match="scheduler bug"):
    device.run(scheduler, plan, num_free=3)


def test_priority_scheduling_preempts_the_lowest_priority():
  """The "priority" policy: when the pool runs out, the less urgent request (the larger
  value) is preempted, though it came first (under "fcfs" the newest goes)."""
  for policy, victim in [("fcfs", 1), ("priority", 0)]:
    cache = KVCacheManager(num_pages=4, page_size=4, max_seqs=2, max_pages_per_seq=16)
    urgent = Request([4, 5, 6], 10, arrival_s=1.0, priority=0)
    scheduler = Scheduler([Request([1, 2, 3], 10, priority=1), urgent], max_batch=2,
                          cache=cache, admission=admission.OptimisticAdmission(cache),
                          steps_per_call=4, max_prefill_tokens=64, scheduling_policy=policy)
    device = FakeDevice(cache)
    plan = scheduler.schedule(now=0.0)
    assert [c.slot for c in plan.prefill] == [0]  # (the urgent one has not arrived)
    device.run(scheduler, plan)
    while not scheduler.num_preemptions:
      device.run(scheduler, scheduler.schedule(now=2.0))
    assert [w[0] for w in scheduler.waiting] == [victim], policy
  with pytest.raises(ValueError, match="scheduling_policy must be one of"):
    Scheduler([Request([1], 2)], max_batch=1, cache=cache,
              admission=admission.OptimisticAdmission(cache), steps_per_call=4,
              max_prefill_tokens=64, scheduling_policy="lifo")


def test_priority_scheduling_admits_by_priority_then_arrival(model, prompts,
                                                             greedy_reference):
  """One slot, four requests waiting: they run lower priority first, then in the order
  they came; the tokens are each request's own. Under "fcfs" a priority is refused."""
  eng = Engine(model, max_batch=1, num_pages=40, page_size=8, steps_per_call=5,
               scheduling_policy="priority")
  order = [(2, 0), (2, 1), (0, 2), (1, 3)]  # (priority, prompt)
  ids = {eng.add_request(Request(prompts[i], 14, priority=p)): i for p, i in order}
  started, tokens = [], collections.defaultdict(list)
  while eng.has_unfinished_requests():
    for event in eng.step():
      if not tokens[event.request_id]:
        started.append(ids[event.request_id])
      tokens[event.request_id].append(event.token)
  assert started == [2, 3, 0, 1]
  assert all(tokens[rid] == greedy_reference[i] for rid, i in ids.items())
  fcfs = Engine(model, max_batch=1, num_pages=40, page_size=8)
  with pytest.raises(ValueError, match=r"request 0: priority 1 needs the engine's priority"):
    fcfs.generate([Request(prompts[0], 2, priority=1)])
  with pytest.raises(ValueError, match="request 0: priority must be an int, got 0.5"):
    eng.generate([Request(prompts[0], 2, priority=0.5)])
  with pytest.raises(ValueError, match="scheduling_policy must be one of"):
    Engine(model, max_batch=1, num_pages=40, scheduling_policy="lifo")


# 40 slots: preempted and readmitted sequences move between slots, and the decode calls
# between widths (16 and 32 of 40).
@pytest.mark.parametrize("max_batch,num_pages,copies", [(8, 9, 1), (40, 60, 4)])
def test_preemption_under_a_tiny_pool_gives_the_same_tokens(model, prompts, greedy_reference,
                                                            max_batch, num_pages, copies):
  eng = Engine(model, max_batch=max_batch, num_pages=num_pages, page_size=8, steps_per_call=6)
  outputs, report = eng.generate([Request(p, 14) for p in prompts * copies])
  assert report.preemptions > 0
  assert outputs == greedy_reference * copies
  assert report.peak_pages_in_use <= num_pages
  assert_pages_back(eng)


def test_logits_processors_hold_through_preemption(model, prompts):
  """Requests with logits processors (penalties, logit_bias, min_tokens; greedy and
  sampled, n = 2) under a pool that preempts them give a large pool's tokens: a preempted
  request's new prefill counts its earlier tokens as generated (frequency, presence),
  not as prompt, and its min_tokens from its first token. They change the tokens."""
  settings = [dict(frequency_penalty=1.5), dict(presence_penalty=2.0, repetition_penalty=1.3),
              dict(temperature=0.9, seed=3, frequency_penalty=0.8, presence_penalty=-0.5),
              dict(temperature=1.0, seed=4, top_k=20, repetition_penalty=0.7, n=2),
              dict(logit_bias={5: 3.0, 50: 2.5, 90: -1.0}),
              dict(min_tokens=12, stop_token_ids=[1, 86]), dict()]  # (5: greedy 1, 1, 1, 86)
  requests = [Request(p, 14, **settings[i % len(settings)]) for i, p in enumerate(prompts)]
  run = lambda num_pages: Engine(model, max_batch=8, num_pages=num_pages, page_size=8,
                                 steps_per_call=6).generate(requests)
  expected, _ = run(64)
  outputs, report = run(9)
  assert report.preemptions > 0 and outputs == expected
  plain, _ = Engine(model, max_batch=8, num_pages=64, page_size=8).generate(
      [Request(r.prompt, 14, temperature=r.temperature, seed=r.seed, top_k=r.top_k, n=r.n,
               stop_token_ids=r.stop_token_ids) for r in requests])
  assert sum(a != b for a, b in zip(expected, plain)) >= 6
  assert all(len(o) >= 12 for o, r in zip(expected, requests) if r.min_tokens)


def test_prompt_logprobs_hold_through_chunks_and_preemption(model, prompts):
  """Prompt log-probabilities under a pool that preempts and prefill calls of 8 tokens
  (chunked prompts) equal those of a large pool prefilling each prompt whole, and come
  once per sample (a preempted request's new prefill gives none); the tokens are the
  large pool's, and those of requests that do not ask."""
  requests = [Request(p, 14, prompt_logprobs=i % 3 != 1, top_logprobs=2 * (i % 3 == 2),
                      n=1 + (i == 4), temperature=0.9 * (i == 4), seed=i)
              for i, p in enumerate(prompts)]

  def run(num_pages, max_prefill_tokens):
    eng = Engine(model, max_batch=8, num_pages=num_pages, page_size=8, steps_per_call=6,
                 max_prefill_tokens=max_prefill_tokens)
    events = []
    out, report = eng.generate(requests, on_token=events.append)
    scored = collections.defaultdict(list)
    for e in events:
      if e.prompt_logprobs is not None:
        scored[e.request_id, e.sample].append((e.prompt_logprobs, e.prompt_top_logprobs))
    return out, report, scored

  expected, _, want = run(64, 256)
  outputs, report, got = run(9, 8)
  assert report.preemptions > 0 and outputs == expected
  assert sorted(got) == sorted(want) == sorted(
      (i, j) for i, r in enumerate(requests) for j in range(r.n) if r.prompt_logprobs)
  for key, [(lps, top)] in want.items():
    [(got_lps, got_top)] = got[key]
    assert len(lps) == len(prompts[key[0]]) and lps[0] is got_lps[0] is None
    np.testing.assert_allclose(got_lps[1:], lps[1:], rtol=1e-5, atol=1e-5)
    assert (top is None) == (got_top is None) == (requests[key[0]].top_logprobs == 0)
    if top is not None:
      assert [[t for t, _ in s] for s in got_top[1:]] == [[t for t, _ in s] for s in top[1:]]
  plain, _ = Engine(model, max_batch=8, num_pages=64, page_size=8).generate(
      [dataclasses.replace(r, prompt_logprobs=False, top_logprobs=0) for r in requests])
  assert plain == expected


def test_scoring_continuations_reads_the_context_from_the_prefix_cache(model):
  """Continuations of one context scored from their first token on
  (`prompt_logprobs_start`): the context's pages computed once and read from the cache by
  the others (admitted together: they wait a call for it), the scores at and after the
  start those of scoring each whole, None before it; with top_logprobs too, and under a
  prefill of 16 tokens per call (chunks)."""
  rng = np.random.default_rng(21)
  context = rng.integers(0, CONFIG.vocab_size, 37).tolist()
  endings = [rng.integers(0, CONFIG.vocab_size, k).tolist() for k in (1, 3, 6, 2)]
  whole = [Request(context + e, 1, prompt_logprobs=True, top_logprobs=2 * (i == 1))
           for i, e in enumerate(endings)]
  tail = [dataclasses.replace(r, prompt_logprobs_start=len(context)) for r in whole]

  def run(requests, **kwargs):
    eng = Engine(model, max_batch=8, num_pages=64, page_size=8, **kwargs)
    first = {}
    _, report = eng.generate(requests, on_token=lambda e: first.setdefault(
        e.request_id, (e.prompt_logprobs, e.prompt_top_logprobs)))
    assert_pages_back(eng)
    return [first[i] for i in range(len(requests))], report

  want, plain = run(whole)
  assert plain.cached_prompt_tokens == 0
  for kwargs in ({}, dict(max_prefill_tokens=16)):
    got, report = run(tail, **kwargs)
    # The three after the first read the context's 4 full pages (32 tokens) from the cache.
    assert report.cached_prompt_tokens == 3 * 32
    for (lps, top), (want_lps, want_top), e in zip(got, want, endings):
      n = len(context)
      assert len(lps) == n + len(e) and lps[:n] == (None,) * n
      np.testing.assert_allclose(lps[n:], want_lps[n:], rtol=1e-5, atol=1e-5)
      if want_top is not None:
        assert top[:n] == (None,) * n and [[t for t, _ in s] for s in top[n:]] == [
            [t for t, _ in s] for s in want_top[n:]]
  with pytest.raises(ValueError, match=r"request 0: prompt_logprobs_start must be an int "
                                       r"in \[0, len\(prompt\) - 1 = 37\], got 38"):
    run([Request(context + [1], 1, prompt_logprobs=True, prompt_logprobs_start=38)])
  with pytest.raises(ValueError, match="prompt_logprobs_start=3 needs prompt_logprobs=True"):
    run([Request(context, 1, prompt_logprobs_start=3)])


def test_peak_admission_never_preempts(model, prompts, greedy_reference):
  eng = Engine(model, max_batch=8, num_pages=9, page_size=8, steps_per_call=6,
               admission="peak")
  outputs, report = eng.generate([Request(p, 14) for p in prompts])
  assert report.preemptions == 0 and outputs == greedy_reference
  assert report.peak_pages_in_use <= 9
  assert_pages_back(eng)


def test_peak_admission_overlaps_growth_with_release(model):
  # Peaks of 3 and 5 pages in a 6-page pool: never both at their peak, but the second can
  # start while the first still runs, because the first releases its pages before the
  # second reaches its peak. One after the other would take 16 + 32 decode steps.
  a, b = list(range(1, 9)), list(range(11, 19))
  eng = Engine(model, max_batch=2, num_pages=6, page_size=8, steps_per_call=4,
               admission="peak")
  outputs, report = eng.generate([Request(a, 17), Request(b, 33)])
  assert report.preemptions == 0 and report.peak_pages_in_use <= 6
  assert report.decode_steps < 16 + 32
  assert report.decode_tokens == 17 + 33 - 2  # each request's first token is prefill's
  assert outputs == [generate(model, [a], 17, page_size=8)[0],
                     generate(model, [b], 33, page_size=8)[0]]


def test_no_page_leaks_after_thousands_of_requests(model):
  rng = np.random.default_rng(3)
  requests = [Request(rng.integers(0, CONFIG.vocab_size, rng.integers(1, 12)).tolist(),
                      int(rng.integers(1, 6)), stop_token_ids=(int(rng.integers(0, 97)),))
              for _ in range(2000)]
  eng = Engine(model, max_batch=64, num_pages=40, page_size=4, steps_per_call=4)
  outputs, report = eng.generate(requests)
  assert all(1 <= len(o) <= r.max_new_tokens for o, r in zip(outputs, requests))
  assert report.generated_tokens == sum(map(len, outputs))
  assert_pages_back(eng)
  assert sorted(np.asarray(eng.kv.free_pages).tolist()) == list(range(40))


def test_sampling_is_reproducible_by_seed(model, prompts):
  def run(max_batch, seeds):
    eng = Engine(model, max_batch=max_batch, num_pages=64, page_size=8)
    reqs = [Request(p, 10, temperature=0.9, top_k=40, top_p=0.95, seed=s)
            for p, s in zip(prompts, seeds)]
    return eng.generate(reqs)[0]

  seeds = list(range(100, 100 + len(prompts)))
  first = run(4, seeds)
  assert run(16, seeds) == first  # batching does not change a request's draws
  assert run(4, [s + 1 for s in seeds]) != first


def test_a_request_draws_alike_beside_filtering_requests(model, prompts):
  # A batch with a top-k / top-p row sorts its logits; a batch without skips the sort. A
  # temperature-only request's tokens do not depend on which kind it ran in.
  plain = Request(prompts[0], 10, temperature=0.9, seed=7)
  run = lambda reqs: Engine(model, max_batch=4, num_pages=64, page_size=8).generate(reqs)[0]
  alone = run([plain])[0]
  assert run([plain, Request(prompts[1], 10, temperature=0.9, top_p=0.5, seed=8)])[0] == alone
  assert run([plain, Request(prompts[1], 10, temperature=0.9, top_k=3, seed=8)])[0] == alone
  assert run([plain, Request(prompts[1], 10, temperature=0.9, min_p=0.2, seed=8)])[0] == alone


def test_min_p_one_keeps_only_the_most_likely_token(model, prompts, greedy_reference):
  # min_p = 1 keeps the tokens as likely as the most likely: the greedy tokens, drawn at
  # a temperature that would otherwise wander, in the prefill's draw and the decode loop's.
  eng = Engine(model, max_batch=4, num_pages=64, page_size=8)
  out, _ = eng.generate([Request(p, 10, temperature=5.0, min_p=1.0, seed=i)
                         for i, p in enumerate(prompts[:3])])
  assert out == [greedy_reference[i][:10] for i in range(3)]
  wander, _ = eng.generate([Request(p, 10, temperature=5.0, min_p=0.0, seed=i)
                            for i, p in enumerate(prompts[:3])])
  assert wander != out


def test_stop_tokens_and_eos_end_requests(model, prompts, greedy_reference):
  stop = greedy_reference[0][5]
  cut = greedy_reference[0].index(stop) + 1
  eng = Engine(model, max_batch=4, num_pages=64, page_size=8, eos_token_id=greedy_reference[1][3])
  # Stop ids as a numpy array (any integer sequence), beside the engine's EOS.
  events = list(eng.stream([Request(prompts[0], 14, stop_token_ids=np.array([stop, 96])),
                            Request(prompts[1], 14)]))
  out = {i: [e.token for e in events if e.request_id == i] for i in (0, 1)}
  assert out[0] == greedy_reference[0][:cut]
  assert out[1] == greedy_reference[1][:greedy_reference[1].index(greedy_reference[1][3]) + 1]
  for i in (0, 1):
    reasons = [e.finish_reason for e in events if e.request_id == i]
    assert reasons[-1] == "stop" and set(reasons[:-1]) <= {None}


def test_streaming_reports_every_token_once(model, prompts, greedy_reference):
  eng = Engine(model, max_batch=2, num_pages=64, page_size=8, steps_per_call=3)
  seen = {i: [] for i in range(len(prompts))}
  eng.generate([Request(p, 14) for p in prompts],
               on_token=lambda e: seen[e.request_id].append(e.token))
  assert [seen[i] for i in range(len(prompts))] == greedy_reference
  report = eng.report
  assert report.tokens_per_s > 0 and len(report.ttft_s) == len(prompts)
  assert 0 < report.kv_efficiency <= 1
  assert str(report).splitlines()[-1].endswith("tokens/s")


def test_report_times_count_validation(model, prompts, monkeypatch):
  """Time to first token and elapsed time start when `generate` is called: validating the
  requests (slowed by 0.3 s here, after a run that compiled the steps) counts."""
  eng = Engine(model, max_batch=4, num_pages=64, page_size=8)
  requests = [Request(p, 3) for p in prompts[:3]]
  eng.generate(requests)
  validate = engine_lib.validate_requests

  def slow_validate(*args, **kwargs):
    time.sleep(0.3)
    return validate(*args, **kwargs)

  monkeypatch.setattr(engine_lib, "validate_requests", slow_validate)
  eng.reset_prefix_cache()
  _, report = eng.generate(requests)
  assert min(report.ttft_s) >= 0.3 and report.elapsed_s >= max(report.ttft_s)


def test_a_run_stopped_early_leaves_the_pool_empty(model, prompts, greedy_reference):
  """An abandoned stream, or a callback that raises, ends the run with every page free
  (the prefix cache's, earlier runs' included, are dropped), a second run or a cache reset
  while one is under way is refused, and the next run gives the same tokens."""
  eng = Engine(model, max_batch=2, num_pages=64, page_size=8, steps_per_call=3)
  requests = [Request(p, 14) for p in prompts]
  eng.generate(requests)
  assert eng.num_cached_pages > 0
  for _ in eng.stream(requests):  # the first tokens: pages are held
    assert int(eng.kv.num_free) < 64
    break
  assert int(eng.kv.num_free) == 64 and not np.asarray(eng.kv.refcounts).any()
  assert not np.asarray(eng.kv.lengths).any() and eng.num_cached_pages == 0

  def fail(event):
    raise KeyboardInterrupt

  with pytest.raises(KeyboardInterrupt):
    eng.generate(requests, on_token=fail)
  assert int(eng.kv.num_free) == 64 and not np.asarray(eng.kv.refcounts).any()
  # One run at a time: a second one while a stream is open is refused, pool untouched.
  stream = eng.stream(requests)
  next(stream)
  with pytest.raises(RuntimeError, match="this Engine is already running"):
    eng.generate(requests)
  with pytest.raises(RuntimeError, match="reset_prefix_cache"):
    eng.reset_prefix_cache()
  stream.close()
  assert int(eng.kv.num_free) == 64
  assert eng.generate(requests)[0] == greedy_reference


def test_requests_added_between_steps_get_the_tokens_of_a_generate(model, prompts,
                                                                    greedy_reference):
  """Requests submitted while the engine runs (add_request between steps, as a server
  would) get the tokens a generate gives them: greedy ones static generate's, a sampled
  one those of a generate of it alone; ids count submissions; the run ends with the step
  that finishes the last, its pages back."""
  sampled = Request(prompts[0], 9, temperature=0.9, top_p=0.9, seed=5)
  alone = Engine(model, max_batch=4, num_pages=64, page_size=8).generate([sampled])[0][0]
  eng = Engine(model, max_batch=4, num_pages=64, page_size=8, steps_per_call=5)
  assert not eng.has_unfinished_requests() and eng.step() == []
  queue = [Request(p, 14) for p in prompts] + [sampled]
  rng = np.random.default_rng(3)
  ids, tokens, reasons, runs = [], {}, {}, []
  while queue or eng.has_unfinished_requests():
    for _ in range(min(len(queue), rng.integers(0, 3))):
      if not eng.has_unfinished_requests():  # idle: this request starts a run
        runs.append([])
      ids.append(eng.add_request(queue.pop(0)))
      runs[-1].append(ids[-1])
    for event in eng.step():
      assert reasons.get(event.request_id) is None  # nothing after a finish
      tokens.setdefault(event.request_id, []).append(event.token)
      reasons[event.request_id] = event.finish_reason
  assert ids == list(range(len(prompts) + 1)) and len(runs) > 1  # ids go on across runs
  assert [tokens[i] for i in range(len(prompts))] == greedy_reference
  assert tokens[len(prompts)] == alone
  assert set(reasons.values()) == {"length"}
  report = eng.report  # the last run's
  assert report.num_requests == len(runs[-1]) == len(report.ttft_s)
  assert report.generated_tokens == sum(len(tokens[i]) for i in runs[-1])
  assert_pages_back(eng)


@pytest.mark.gpu
def test_pool_programs_compile_quietly_for_a_pool_of_most_of_the_gpu(capfd):
  """XLA's rematerialization pass counts a donated pool about three times: with a pool of
  over ~1/3 of the GPU (the CLI's default, sized from free memory) each step program
  logged "Can't reduce memory use below ... by rematerialization" until the runner's jits
  got a budget out of reach (`runner._pool_jit`). The decode loop compiled for an abstract
  pool of 90% of the device's memory: nothing is allocated."""
  config = gpt2.GPT2Config(vocab_size=256, n_positions=256, n_embd=128, n_layer=2, n_head=2)
  runner = runner_lib.ModelRunner(gpt2.GPT2LMHeadModel(config, dtype=jnp.bfloat16,
                                                       rngs=nnx.Rngs(0)))
  page, rows = 16, 16
  bytes_per_page = 2 * config.n_layer * config.n_head * page * 64 * 2
  kv = jax.eval_shape(lambda: KVPool.create(
      num_layers=config.n_layer, num_kv_heads=config.n_head, head_dim=64, page_size=page,
      num_pages=int(0.9 * jax.devices()[0].memory_stats()["bytes_limit"]) // bytes_per_page,
      max_seqs=rows, max_pages_per_seq=config.n_positions // page))
  zeros = np.zeros((rows,), np.int32)
  packed, layout = runner_lib.pack_arrays(
      num_steps=np.int32(16), tokens=zeros, active=np.ones((rows,), bool), index=zeros,
      budget=zeros + 16, stop_ids=np.full((rows, runner_lib.MIN_STOP_IDS), -1, np.int32),
      seeds=zeros.astype(np.uint32), temperature=zeros.astype(np.float32), top_k=zeros,
      top_p=np.ones((rows,), np.float32), min_p=zeros.astype(np.float32))
  runner.jitted.decode_loop.lower(runner.leaves, kv, packed, layout=layout, max_steps=16,
                                  greedy=True, checked=False, filter_by=None).compile()
  assert "rematerialization" not in capfd.readouterr().err


@contextlib.contextmanager
def compilations():
  """Yields a list that collects the seconds of each XLA compilation inside the block."""
  compiles = []

  def listen(event, seconds, **_):
    if event == "/jax/core/compile/backend_compile_duration":
      compiles.append(seconds)

  jax.monitoring.register_event_duration_secs_listener(listen)
  try:
    yield compiles
  finally:
    jax.monitoring.unregister_event_duration_listener(listen)


def test_warmup_compiles_every_batch_shape():
  """After warmup() a run of greedy requests, or of greedy and top-p ones (any count up to
  max_batch, prompts up to max_prompt_tokens, fresh or behind a cached page), compiles
  nothing; the pool is left empty. A model of its own: jit caches are shared by models of
  one structure."""
  config = gpt2.GPT2Config(vocab_size=89, n_positions=48, n_embd=16, n_layer=1, n_head=2,
                           bos_token_id=None, eos_token_id=None)
  model = gpt2.GPT2LMHeadModel(config, rngs=nnx.Rngs(2))
  eng = Engine(model, max_batch=12, num_pages=600, page_size=8, steps_per_call=5)
  # Prefill rows 1-16 x widths 8, 16, and 8 behind a cached page (a prompt to cache it,
  # then the rows); decode over 12 slots; greedy and top-p.
  assert eng.warmup(max_prompt_tokens=16, sampling=("greedy", "top_p"),
                    prefix_hits=True) == 2 * (5 * 2 + 1 + 5 * 2)
  assert int(eng.kv.num_free) == 600 and eng.num_cached_pages == 0
  assert eng.report.generated_tokens == 0
  # What it left alive is out of the collector's generations (gc.freeze), the model's
  # objects among it.
  assert gc.get_freeze_count() > 0 and gc.is_tracked(model)
  assert not any(o is model for o in gc.get_objects())
  with compilations() as compiles:
    rng = np.random.default_rng(5)
    for n, top_p in [(1, None), (5, None), (12, None), (7, 0.8), (12, 0.5)]:
      eng.generate([Request(rng.integers(0, 89, rng.integers(1, 17)).tolist(),
                            int(rng.integers(1, 20)),
                            temperature=0.7 if top_p and i % 2 else 0.0,
                            top_p=top_p if i % 2 else None) for i in range(n)])
    system = rng.integers(0, 89, 9).tolist()  # a page cached, then rows behind it
    eng.generate([Request(system, 2)])
    for n in (3, 12):
      eng.generate([Request(system + rng.integers(0, 89, rng.integers(1, 8)).tolist(), 4)
                    for _ in range(n)])
    assert eng.report.cached_prompt_tokens == 12 * 8
    for holds in (1, 300, 600):  # a call holding or dropping up to every page (padding)
      eng.kv = eng.runner.update_pages(eng.kv, retain=[-1] * holds, evict=[-1] * holds)
  assert not compiles
  with pytest.raises(ValueError, match="max_prompt_tokens must be a positive int"):
    eng.warmup(max_prompt_tokens=0)
  with pytest.raises(ValueError, match="sampling must be a non-empty list of"):
    eng.warmup(sampling="greedy")


def test_warmup_covers_long_prompts_stop_tokens_and_samples():
  """After warmup(prefix_hits=True, max_samples=3), requests submitted between steps at
  random compile nothing: prompts longer than max_prefill_tokens (chunked: a chunk after
  the first continues its sequence as a prompt behind a cached page does), up to 7 stop
  tokens of a request's own beside the eos, n = 1-3 samples, greedy and sampled. A model
  of its own structure (jit caches are shared by models of one structure)."""
  config = gpt2.GPT2Config(vocab_size=97, n_positions=48, n_embd=24, n_layer=1, n_head=3,
                           bos_token_id=None, eos_token_id=96)
  model = gpt2.GPT2LMHeadModel(config, rngs=nnx.Rngs(4))
  eng = Engine(model, max_batch=8, num_pages=400, page_size=8, steps_per_call=5,
               max_prefill_tokens=16, eos_token_id=96)
  with pytest.raises(ValueError, match="max_samples=9 exceeds max_batch=8"):
    eng.warmup(max_samples=9)
  eng.warmup(max_prompt_tokens=40, sampling=("greedy", "sampled"), prefix_hits=True,
             max_samples=3)
  assert int(eng.kv.num_free) == 400 and eng.num_cached_pages == 0
  rng = np.random.default_rng(6)
  queue = [Request(rng.integers(0, 96, rng.integers(1, 41)).tolist(),
                   int(rng.integers(1, 8)), temperature=0.8 * (i % 2), seed=i,
                   stop_token_ids=rng.integers(0, 96, rng.integers(0, 8)).tolist(),
                   n=int(rng.integers(1, 4))) for i in range(40)]
  chunked = sum(len(r.prompt) > 16 for r in queue)
  tokens = {}
  with compilations() as compiles:
    while queue or eng.has_unfinished_requests():
      for _ in range(min(len(queue), rng.integers(0, 4))):
        eng.add_request(queue.pop(0))
      for event in eng.step():
        tokens[event.request_id, event.sample] = event.token
  assert chunked >= 10 and len({rid for rid, _ in tokens}) == 40
  assert not compiles
  assert_pages_back(eng)


def test_warmup_covers_logits_processors_and_their_context_widths():
  """After warmup(logits_processors=True), requests with and without penalties,
  logit_bias and min_tokens, greedy and sampled, submitted between steps, compile
  nothing, also where decoding takes their contexts past `runner.MIN_CONTEXT_WIDTH` (a
  wider context array). A model of its own structure."""
  config = gpt2.GPT2Config(vocab_size=89, n_positions=160, n_embd=16, n_layer=1, n_head=2,
                           bos_token_id=None, eos_token_id=None)
  model = gpt2.GPT2LMHeadModel(config, rngs=nnx.Rngs(8))
  eng = Engine(model, max_batch=4, num_pages=200, page_size=8, steps_per_call=8)
  eng.warmup(max_prompt_tokens=16, sampling=("greedy", "sampled"), logits_processors=True)
  rng = np.random.default_rng(9)
  queue = [Request(rng.integers(0, 89, rng.integers(1, 17)).tolist(),
                   int(rng.integers(1, 8)) if i % 3 else 140,
                   temperature=0.8 * (i % 2), seed=i,
                   repetition_penalty=1.2 if i % 4 < 2 else 1.0,
                   frequency_penalty=0.5 * (i % 4 == 1),
                   logit_bias={i: 2.0, 2 * i: -2.0} if i % 4 == 2 else None,
                   min_tokens=1 if i % 4 == 3 else 0, stop_token_ids=[i, i + 1])
           for i in range(12)]
  assert max(len(r.prompt) + r.max_new_tokens for r in queue) > runner_lib.MIN_CONTEXT_WIDTH
  done = set()
  with compilations() as compiles:
    while queue or eng.has_unfinished_requests():
      for _ in range(min(len(queue), rng.integers(0, 3))):
        eng.add_request(queue.pop(0))
      done.update(e.request_id for e in eng.step() if e.finish_reason)
  assert len(done) == 12 and not compiles
  assert_pages_back(eng)


def test_warmup_covers_guided_requests():
  """After warmup(guided=True), guided requests (two guides at once) beside unguided ones,
  greedy and sampled, submitted between steps, compile nothing; each guided answer is a
  prefix of a match, whole where it ended before its budget."""
  config = gpt2.GPT2Config(vocab_size=90, n_positions=96, n_embd=16, n_layer=1, n_head=2,
                           bos_token_id=None, eos_token_id=None)
  model = gpt2.GPT2LMHeadModel(config, rngs=nnx.Rngs(8))
  vocab = Vocabulary(tuple(chr(33 + i).encode() for i in range(89)) + (None,), (89,))
  guides = [Guide.from_regex(r"[a-f]{2,9}=\d{1,3}", vocab),
            Guide.from_json_schema({"enum": ["ab", "cd", [1, 2]]}, vocab)]
  eng = Engine(model, max_batch=4, num_pages=100, page_size=8, steps_per_call=8,
               eos_token_id=89)
  eng.warmup(max_prompt_tokens=16, sampling=("greedy", "sampled"), guided=True)
  rng = np.random.default_rng(9)
  queue = [Request(rng.integers(0, 89, rng.integers(1, 17)).tolist(), 20,
                   temperature=0.8 * (i % 2), seed=i, guide=guides[i % 3] if i % 3 < 2 else None)
           for i in range(12)]
  out = {}
  with compilations() as compiles:
    while queue or eng.has_unfinished_requests():
      for _ in range(min(len(queue), rng.integers(0, 3))):
        eng.add_request(queue.pop(0))
      for e in eng.step():
        out.setdefault(e.request_id, []).append(e)
  assert len(out) == 12 and not compiles
  for rid, events in out.items():
    if rid % 3 < 2:
      guide, tokens = guides[rid % 3], [e.token for e in events]
      state = guide.walk(0, tokens)
      assert state >= 0 and (len(tokens) == 20 or guide.accepting[state])
  assert_pages_back(eng)


def test_warmup_covers_decode_chunks_cut_short_by_a_full_pool():
  """A pool too small for its slots (optimistic admission) cuts decode chunks short and
  preempts: after warmup(prefix_hits=True, short_chunks=True, logprobs=True,
  top_logprobs=True) such a run, some of its requests asking for logprobs and top
  logprobs, compiles nothing and gives the tokens and log-probabilities of a pool that
  never runs short. A model of its own structure."""
  config = gpt2.GPT2Config(vocab_size=83, n_positions=48, n_embd=32, n_layer=1, n_head=4,
                           bos_token_id=None, eos_token_id=None)
  model = gpt2.GPT2LMHeadModel(config, rngs=nnx.Rngs(5))
  rng = np.random.default_rng(7)
  requests = [Request(rng.integers(0, 83, rng.integers(3, 20)).tolist(),
                      int(rng.integers(8, 28)), logprobs=i % 3 > 0,
                      top_logprobs=2 * (i % 3 == 2)) for i in range(12)]

  def run(eng):
    logprobs = [[] for _ in requests]
    tokens, report = eng.generate(requests, on_token=lambda e: logprobs[e.request_id].append(
        (e.logprob,) + sum(e.top_logprobs or (), ())))
    return tokens, report, logprobs

  expected, _, expected_logprobs = run(Engine(model, max_batch=8, num_pages=64, page_size=8))
  # 4 slots (the warm-up's shapes, its time, grow with the slots) over 8 pages: some
  # prefill shapes fit such a pool only with their fewest rows and tokens (a re-prefill
  # of two rows, 17-32 tokens wide, behind a cached page among them).
  eng = Engine(model, max_batch=4, num_pages=8, page_size=8, steps_per_call=5)
  eng.warmup(prefix_hits=True, short_chunks=True, logprobs=True, top_logprobs=True)
  assert int(eng.kv.num_free) == 8 and eng.num_cached_pages == 0
  with compilations() as compiles:
    tokens, report, logprobs = run(eng)
  assert report.preemptions and tokens == expected
  assert not compiles
  for r, got, want in zip(requests, logprobs, expected_logprobs):
    if r.logprobs:  # (a preempted request's next token comes from its new prefill)
      assert np.shape(got) == (len(want), 1 + 2 * r.top_logprobs)
      np.testing.assert_allclose(got, want, atol=1e-5)
    else:
      assert got == [(None,)] * len(want)


def test_add_request_validates_and_abort_frees_the_pool(model, prompts, greedy_reference):
  eng = Engine(model, max_batch=4, num_pages=64, page_size=8, steps_per_call=5)
  with pytest.raises(ValueError, match="request 0: prompt is empty"):
    eng.add_request(Request([], 3))
  assert not eng.has_unfinished_requests()  # nothing submitted, no run
  # add_requests: all or none, the one it cannot serve named by its index.
  other = Engine(model, max_batch=4, num_pages=64, page_size=8, steps_per_call=5)
  with pytest.raises(ValueError, match=r"^requests\[1\]: prompt is empty$"):
    other.add_requests([Request(prompts[1], 3), Request([], 3)])
  with pytest.raises(ValueError, match=r"^prompt is empty$"):
    other.add_requests([Request([], 3)])
  assert not other.has_unfinished_requests()  # (the first was aborted: its run ended)
  assert other.add_requests([Request(prompts[1], 3), Request(prompts[2], 3)]) == [1, 2]
  assert eng.add_request(Request(prompts[1], 14)) == 0
  with pytest.raises(ValueError, match="request 1: max_new_tokens must be an int >= 1"):
    eng.add_request(Request(prompts[2], 0))
  late = time.perf_counter()
  assert eng.add_request(Request(prompts[2], 14, arrival_s=0.2)) == 1
  first = {}
  while eng.has_unfinished_requests():
    for event in eng.step():
      first.setdefault(event.request_id, (event.token, time.perf_counter()))
  assert first[0][0] == greedy_reference[1][0] and first[1][0] == greedy_reference[2][0]
  assert first[1][1] - late >= 0.2 and min(eng.report.ttft_s) >= 0  # from its arrival
  # One run at a time: a run of added requests refuses a generate; a generate's stream
  # refuses add_request and step. abort() ends a run at once, every page back.
  eng.add_request(Request(prompts[3], 14))
  eng.step()
  with pytest.raises(RuntimeError, match="this Engine is already running"):
    eng.generate([Request(prompts[0], 3)])
  eng.abort()
  assert not eng.has_unfinished_requests() and eng.step() == []
  assert int(eng.kv.num_free) == 64 and not np.asarray(eng.kv.refcounts).any()
  stream = eng.stream([Request(prompts[0], 14)])
  next(stream)
  with pytest.raises(RuntimeError, match="add_request\\(\\) during a generate / stream"):
    eng.add_request(Request(prompts[0], 3))
  with pytest.raises(RuntimeError, match="step\\(\\) during a generate / stream"):
    eng.step()
  with pytest.raises(RuntimeError, match="abort\\(\\) during a generate / stream"):
    eng.abort()
  stream.close()
  assert int(eng.kv.num_free) == 64
  assert eng.generate([Request(p, 14) for p in prompts])[0] == greedy_reference


def test_abort_request_between_steps_drops_it_wherever_it_is(model, prompts,
                                                              greedy_reference):
  """`abort_request` between steps: a request in the middle of a chunked prefill, a
  waiting one (no slot yet), one with n = 2 samples decoding (forked) and a greedy one
  after some of its tokens each stop producing tokens; the others get their tokens
  alone; every page comes back; aborting the last requests left ends the run."""
  eng = Engine(model, max_batch=4, num_pages=64, page_size=8, steps_per_call=3,
               max_prefill_tokens=8)
  chunked = eng.add_request(Request(prompts[5] * 2, 14))  # 58 tokens, 8 per call
  forked = eng.add_request(Request(prompts[5], 14, n=2, temperature=1.0))
  ids = [eng.add_request(Request(p, 14)) for p in prompts[:4]]
  waiting = eng.add_request(Request(prompts[6], 14))
  scheduler = eng._run.scheduler  # (to check each request's state when aborted)
  state = lambda rid: [s for s in scheduler.slots if s is not None and s.request_id == rid]
  tokens = collections.defaultdict(list)
  eng.step()
  (s,) = state(chunked)
  assert 0 < s.prefilled < s.prefill_stop and not state(waiting)
  assert eng.abort_request(chunked) and eng.abort_request(waiting)
  aborted = {chunked, waiting}
  while eng.has_unfinished_requests():
    for e in eng.step():
      assert e.request_id not in aborted
      tokens[e.request_id, e.sample].append(e.token)
    if forked not in aborted and tokens[forked, 0] and tokens[forked, 1]:
      assert all(s.decoding for s in state(forked))
      assert eng.abort_request(forked) and not eng.abort_request(forked)
      aborted.add(forked)
    if ids[1] not in aborted and len(tokens[ids[1], 0]) >= 2:
      assert eng.abort_request(ids[1])
      aborted.add(ids[1])
  assert 2 <= len(tokens[ids[1], 0]) < 14 and len(tokens[forked, 0]) < 14
  for i in (0, 2, 3):
    assert tokens[ids[i], 0] == greedy_reference[i]
  assert eng.report.aborted == 4
  assert not eng.abort_request(ids[0])  # finished: no run in progress
  assert_pages_back(eng)
  # Aborting every request left ends the run at once.
  first = eng.add_request(Request(prompts[0], 14))
  second = eng.add_request(Request(prompts[1], 14, arrival_s=30.0))
  eng.step()
  assert eng.abort_request(first) and eng.has_unfinished_requests()
  assert eng.abort_request(second) and not eng.has_unfinished_requests()
  assert eng.step() == [] and "aborted requests: 2" in str(eng.report)
  assert_pages_back(eng)
  assert eng.generate([Request(p, 14) for p in prompts])[0] == greedy_reference


def test_abort_request_from_a_callback_or_a_streams_consumer(model, prompts,
                                                               greedy_reference):
  """An `on_token` callback (and a stream's consumer) that aborts a request after its
  third token: the output holds those three, no later event comes (the rest of the same
  device call's tokens are dropped), the others are unchanged; bad ids are refused."""
  eng = Engine(model, max_batch=4, num_pages=64, page_size=8, steps_per_call=8)
  events = []

  def on_token(e):
    events.append(e)
    if e.request_id == 2 and sum(x.request_id == 2 for x in events) == 3:
      assert eng.abort_request(2)

  out, report = eng.generate([Request(p, 14) for p in prompts], on_token=on_token)
  assert out[2] == greedy_reference[2][:3] == [e.token for e in events if e.request_id == 2]
  assert [o for i, o in enumerate(out) if i != 2] == greedy_reference[:2] + greedy_reference[3:]
  assert report.aborted == 1 and report.generated_tokens == sum(map(len, out))
  assert_pages_back(eng)
  got = collections.defaultdict(list)
  for e in eng.stream([Request(p, 14) for p in prompts]):
    got[e.request_id].append(e.token)
    if e.request_id == 0 and len(got[0]) == 3:
      eng.abort_request(0)
      with pytest.raises(ValueError, match="the run in progress has ids 0 to 8"):
        eng.abort_request(9)
      for bad in (-1, 1.0, True):
        with pytest.raises(ValueError, match="request_id must be"):
          eng.abort_request(bad)
  assert got[0] == greedy_reference[0][:3]
  assert [got[i] for i in range(1, 9)] == greedy_reference[1:]
  assert eng.report.generated_tokens == sum(map(len, got.values()))
  assert_pages_back(eng)


def test_abort_request_of_one_sample_wherever_it_is(model, prompts):
  """`abort_request(id, sample)`: that sample gets no more tokens, whether decoding,
  prefilling the pages its forks will share, or not yet admitted; the request's other
  samples and the other requests get the tokens they get without it; aborting every
  sample one by one counts the request aborted; every page comes back."""
  long_prompt = prompts[5] * 2
  sampled = Request(long_prompt, 14, n=3, temperature=1.0, seed=4)
  ref = Engine(model, max_batch=8, num_pages=64, page_size=8).generate(
      [sampled, Request(prompts[0], 14)])[0]

  def run(eng, abort_at, first=None):
    """Adds (first,) the sampled request, a greedy one; calls abort_at(tokens) -> the
    (request, sample) pairs to abort after each step."""
    ids = ([eng.add_request(first)] if first else []) + [eng.add_request(sampled),
                                                        eng.add_request(Request(prompts[0], 14))]
    tokens = collections.defaultdict(list)
    aborted = set()
    while eng.has_unfinished_requests():
      for e in eng.step():
        assert (e.request_id, e.sample) not in aborted
        tokens[e.request_id, e.sample].append(e.token)
      for pair in abort_at(eng, ids, tokens) - aborted:
        assert eng.abort_request(*pair) and not eng.abort_request(*pair)
        aborted.add(pair)
    assert_pages_back(eng)
    return ids, tokens

  # Decoding: sample 1 after two tokens.
  eng = Engine(model, max_batch=4, num_pages=64, page_size=8, steps_per_call=3)
  (a, b), tokens = run(eng, lambda eng, ids, t: {(ids[0], 1)} if len(t[ids[0], 1]) >= 2
                       else set())
  assert [tokens[a, 0], tokens[a, 2], tokens[b, 0]] == [ref[0][0], ref[0][2], ref[1]]
  assert 2 <= len(tokens[a, 1]) < 14 and tokens[a, 1] == ref[0][1][:len(tokens[a, 1])]
  assert eng.report.aborted == 0

  # Prefilling (chunked, 8 tokens per call) the pages samples 1 and 2 will fork from.
  eng = Engine(model, max_batch=4, num_pages=64, page_size=8, steps_per_call=3,
               max_prefill_tokens=8)

  def while_prefilling(eng, ids, tokens):
    if eng._run is None:  # (the step ended the run)
      return set()
    slots = [s for s in eng._run.scheduler.slots if s is not None and s.request_id == ids[0]]
    if any(s.sample == 0 and 0 < s.prefilled < s.prefill_stop for s in slots):
      return {(ids[0], 0)}
    return set()

  (a, b), tokens = run(eng, while_prefilling)
  assert (a, 0) not in tokens and [tokens[a, 1], tokens[a, 2]] == ref[0][1:]
  assert tokens[b, 0] == ref[1]

  # Not yet admitted (behind a request holding 2 of 3 slots); then every sample, one by
  # one: the request counts as aborted and the run ends with the others.
  eng = Engine(model, max_batch=3, num_pages=64, page_size=8, steps_per_call=3)
  (first, a, b), tokens = run(
      eng, lambda eng, ids, t: {(ids[1], 0)}, Request(prompts[1], 14, n=2))
  assert (a, 0) not in tokens and [tokens[a, 1], tokens[a, 2]] == ref[0][1:]
  assert eng.report.decode_tokens == 13 * 5  # (2 + 2 + 1 sequences: sample 0 never ran)
  eng = Engine(model, max_batch=4, num_pages=64, page_size=8, steps_per_call=3)
  (a, b), tokens = run(eng, lambda eng, ids, t: {(ids[0], j) for j in range(3)
                                                 if len(t[ids[0], j]) >= 1 + 2 * j})
  assert eng.report.aborted == 1 and tokens[b, 0] == ref[1]

  # From a callback, with the sample's tokens in the output up to the abort; bad samples.
  def on_token(e):
    got[e.request_id, e.sample].append(e.token)
    if (e.request_id, e.sample) == (0, 2) and len(got[0, 2]) == 3:
      assert eng.abort_request(0, 2)
      for bad in (3, -1, 1.0, True):
        with pytest.raises(ValueError, match=r"sample must be None \(every sample\) or an "
                                             r"int in \[0, n=3\) for request 0"):
          eng.abort_request(0, bad)

  got = collections.defaultdict(list)
  out, report = eng.generate([sampled, Request(prompts[0], 14)], on_token=on_token)
  assert out == [[ref[0][0], ref[0][1], ref[0][2][:3]], ref[1]]
  assert report.aborted == 0 and report.generated_tokens == 14 * 3 + 3
  assert_pages_back(eng)


def test_stop_texts_end_each_sample_at_its_first(model, prompts, greedy_reference):
  """`Request.stop` with the engine's `detokenize` (a toy: one letter per token): a sample
  ends with the token completing the first stop text in its generated text (one spanning
  two tokens; a sample of n = 2 at its own), finish_reason 'stop' and `stop_text` on its
  last event; its tokens up to there and the other requests' are unchanged; nothing
  counts as aborted; bad stops and a missing detokenize are named."""
  detok = lambda ids: "".join(chr(97 + t % 26) for t in ids)
  eng = Engine(model, max_batch=4, num_pages=64, page_size=8, steps_per_call=5,
               detokenize=detok)
  text = detok(greedy_reference[0])
  stop = text[4:6]
  events = []
  out, report = eng.generate([Request(prompts[0], 14, stop=[stop, "never seen"]),
                              Request(prompts[1], 14)], on_token=events.append)
  assert out == [greedy_reference[0][:text.find(stop) + 2], greedy_reference[1]]
  last = [e for e in events if e.request_id == 0][-1]
  assert (last.finish_reason, last.stop_text) == ("stop", stop)
  assert all(e.stop_text is None for e in events if e is not last)
  assert report.generated_tokens == len(out[0]) + 14 and report.aborted == 0
  assert_pages_back(eng)
  sampled = Request(prompts[2], 14, n=2, temperature=1.0, seed=3)
  (ref,), _ = eng.generate([sampled])
  stop = detok(ref[0])[5]
  (got,), _ = eng.generate([dataclasses.replace(sampled, stop=[stop])])
  for want, tokens in zip(ref, got):
    cut = detok(want).find(stop)
    assert tokens == (want if cut < 0 else want[:cut + 1])
  assert any(len(t) < 14 for t in got)
  assert_pages_back(eng)
  with pytest.raises(ValueError, match="request 0: stop texts need the engine's detokenize"):
    Engine(model, max_batch=4, num_pages=64, page_size=8).generate(
        [Request(prompts[0], 4, stop=["a"])])
  for bad in ("a", [""], [1]):
    with pytest.raises(ValueError, match="request 0: stop must be a list of non-empty texts"):
      eng.generate([Request(prompts[0], 4, stop=bad)])


@pytest.mark.parametrize("request_,match", [
    (Request([], 3), "prompt is empty"),
    (Request([1, 2.5], 3), r"prompt must be a flat list of integer token ids .* shape \(2,\)"),
    (Request([[1, 2]], 3), r"prompt must be a flat list of integer token ids .* \(1, 2\)"),
    (Request(np.array([1.0]), 3), "prompt must be a flat list of integer token ids"),
    (Request(jnp.ones((1, 2), jnp.int32), 3), r"prompt must be a flat list .* \(1, 2\)"),
    (Request([1], 0), "max_new_tokens must be an int >= 1"),
    (Request([1], np.int64(0)), "max_new_tokens must be an int >= 1"),
    (Request([1], True), "max_new_tokens must be an int >= 1"),
    (Request([1], 3, stop_token_ids=[2, 1.5]), "stop_token_ids must be integer"),
    (Request([1], 3, stop_token_ids=[2, 97, -1]), r"stop_token_ids \[97, -1\] outside "
     r"\[0, vocab_size=97\)"),
    (Request([1], 3, temperature=float("inf")), "temperature must be a finite number >= 0"),
    (Request([1], 3, temperature=float("nan")), "temperature must be a finite number >= 0"),
    (Request([1], 3, n=0), "n must be an int"),
    (Request([1] * 90, 10), "exceeds the model's n_positions"),
    (Request([1], 3, top_p=0.0), "top_p"),
    (Request([1], 3, min_p=1.5), r"min_p must be a number in \[0, 1\], got 1.5"),
    (Request([1], 3, min_p=None), r"min_p must be a number in \[0, 1\], got None"),
    (Request([1], 3, seed=-1), "seed must be"),
    (Request([1], 3, logprobs=1), "logprobs must be True or False"),
    (Request([1], 3, logprobs=True, top_logprobs=21),
     r"top_logprobs must be an int in \[0, 20\]"),
    (Request([1], 3, top_logprobs=2), "top_logprobs=2 needs logprobs=True or "
     "prompt_logprobs=True"),
    (Request([1], 3, prompt_logprobs=1), "prompt_logprobs must be True or False, got 1"),
    (Request([1], 3, repetition_penalty=0.0),
     "repetition_penalty must be a finite number > 0"),
    (Request([1], 3, repetition_penalty=float("inf")), "repetition_penalty must be a finite"),
    (Request([1], 3, repetition_penalty="1.2"), "repetition_penalty must be a finite"),
    (Request([1], 3, frequency_penalty=-2.5),
     r"frequency_penalty must be a number in \[-2, 2\]"),
    (Request([1], 3, presence_penalty=float("nan")), "presence_penalty must be a number in"),
    (Request([1], 3, presence_penalty=True), "presence_penalty must be a number in"),
    (Request([1], 3, logit_bias=[(1, 2.0)]), "logit_bias must be a mapping"),
    (Request([1], 3, logit_bias={97: 1.0}), r"logit_bias token 97 is not a token id in "
     r"\[0, vocab_size=97\)"),
    (Request([1], 3, logit_bias={1.0: 1.0}), "logit_bias token 1.0 is not a token id"),
    (Request([1], 3, logit_bias={2: 101.0}), r"logit_bias\[2\] must be a number in "
     r"\[-100, 100\]"),
    (Request([1], 3, logit_bias={2: float("nan")}), r"logit_bias\[2\] must be a number"),
    (Request([1], 3, min_tokens=4), r"min_tokens must be an int in \[0, max_new_tokens=3\]"),
    (Request([1], 3, min_tokens=-1), "min_tokens must be an int"),
    (Request([1000], 3), "outside"),
    (Request([1] * 40, 20), "pool is too small"),
])
def test_bad_requests_raise_clear_errors(model, request_, match):
  eng = Engine(model, max_batch=2, num_pages=6, page_size=8)
  with pytest.raises(ValueError, match=match):
    eng.generate([request_])


def test_a_lone_request_is_named_not_iterated(model):
  eng = Engine(model, max_batch=2, num_pages=6, page_size=8)
  for run in (eng.generate, lambda r: list(eng.stream(r))):
    with pytest.raises(ValueError, match=r"got one Request: pass \[request\]"):
      run(Request([1], 3))


@pytest.mark.gpu
def test_engine_on_gpu_matches_static_generate(prompts):
  """The engine compiled on the GPU (Triton decode and K/V write kernels, the on-device
  decode loop in chunks of 5 steps, the paged prefill kernel over cached and same-call
  shared pages) vs static `generate` with the plain-XLA reference attention."""
  config = gpt2.GPT2Config(vocab_size=97, n_positions=96, n_embd=256, n_layer=2, n_head=4,
                           bos_token_id=None, eos_token_id=None)  # head dim 64: the kernel's
  rng = np.random.default_rng(2)
  system = rng.integers(0, 97, 24).tolist()  # 3 pages, shared by requests admitted together
  shared = [system + rng.integers(0, 97, n).tolist() for n in (1, 5, 9, 13)]
  with jax.default_matmul_precision("highest"):
    kernel = gpt2.GPT2LMHeadModel(config, decode_impl="kernel", rngs=nnx.Rngs(7))
    reference = gpt2.GPT2LMHeadModel(config, decode_impl="reference", rngs=nnx.Rngs(7))
    eng = Engine(kernel, max_batch=4, num_pages=64, page_size=8, steps_per_call=5)
    outputs, _ = eng.generate([Request(p, 14) for p in prompts])
    assert outputs == generate(reference, prompts, 14, page_size=8)
    want = generate(reference, shared, 14, page_size=8)
    for _ in range(2):  # in one call, then on the pages the first run cached
      outputs, report = eng.generate([Request(p, 14) for p in shared])
      assert outputs == want and report.cached_prompt_tokens >= 3 * 24
    # Three greedy samples forked mid-page: the decode reserve kernel's copy-on-write.
    outputs, _ = eng.generate([Request(prompts[0], 14, n=3)])
    assert outputs == [[want_0] * 3 for want_0 in generate(reference, prompts[:1], 14,
                                                            page_size=8)]


@pytest.mark.parametrize("admission_", ["optimistic", "peak"])
def test_report_peak_and_efficiency_are_what_the_device_held(model, admission_):
  """A lone request's peak pages and live / reserved ratio are the same at one step per
  call and at 64 (they were sampled after releases: a run reported a peak of 1 page).
  Beside another, a finished request holds its pages until its call returns: that is
  counted too."""
  def run(requests, steps):
    eng = Engine(model, max_batch=2, num_pages=40, page_size=4, steps_per_call=steps,
                 admission=admission_)
    return eng.generate(requests)[1]

  lone = [Request([3, 1, 4, 1, 5], 60)]  # ends holding 5 + 59 tokens: 16 pages
  one, many = run(lone, 1), run(lone, 64)
  assert one.peak_pages_in_use == many.peak_pages_in_use == 16
  assert one.kv_efficiency == pytest.approx(many.kv_efficiency) and one.kv_efficiency > 0.8
  pair = lone + [Request([9, 2, 6], 30)]  # ends at 3 + 29 tokens (8 pages) after 29 steps
  # One step per call: released at once, beside request 0's 5 + 29 tokens (9 pages). In
  # one 64-step call: held until request 0 ends with its 16.
  assert run(pair, 1).peak_pages_in_use == 8 + 9
  assert run(pair, 64).peak_pages_in_use == 8 + 16


def test_a_short_chunk_runs_a_loop_of_its_own_length(model, prompts):
  """A decode chunk of 3 steps (cut short by the free pages) in a call of up to 16 runs a
  4-step loop (3 rounded up to a power of two), not a whole 16-step checked group, and
  gives static generate's tokens."""
  reference = generate(model, prompts[:2], 5, page_size=8)
  runner, kv, lengths, pack = _prefilled(model, prompts)
  first = [r[0] for r in reference]
  rows = tuple(RunningRequest(i, Request(prompts[i], 40), np.asarray(prompts[i], np.int32),
                             [first[i]], i, ()) for i in (0, 1))
  kv, executed = runner.execute(kv, Plan(rows=rows, decode_steps=3, max_steps=16))
  out = executed.decoded
  assert out.shape == (4, 2)
  np.testing.assert_array_equal(out[:3].T, [r[1:4] for r in reference])
  assert (out[3] == -1).all()
  np.testing.assert_array_equal(np.asarray(kv.lengths), lengths + 3)


def test_stats_count_every_run_and_show_the_load(model, prompts):
  """`Engine.stats()`: the queue and pages while a run goes on; prompt, cached, generated
  tokens and preemptions summed over every run since the engine was built (an aborted
  run's too)."""
  eng = Engine(model, max_batch=8, num_pages=9, page_size=8, steps_per_call=6)
  assert eng.stats() == (0, 0, 0, 0, 9, 0, 0, 0, 0, 0, 0, 0, "", "")  # (no LoRA slots)
  _, first = eng.generate([Request(p, 14) for p in prompts])
  assert first.preemptions > 0
  stats = eng.stats()
  assert stats == (0, 0, 0, eng.num_cached_pages, 9, first.prompt_tokens,
                   first.cached_prompt_tokens, 14 * len(prompts), first.preemptions, 0, 0,
                   0, "", "")
  assert first.prompt_tokens > sum(map(len, prompts))  # (preempted contexts again)
  # Added requests: two admitted, the third's 8 samples waiting for 8 free slots.
  long_prompt = list(range(1, 21))
  for p in (long_prompt, prompts[1]):
    eng.add_request(Request(p, 14))
  eng.add_request(Request(prompts[2], 14, n=8, temperature=1.0))
  assert eng.stats()[:2] == (0, 10)  # (nothing is admitted before a step)
  eng.step()
  running, waiting, in_use, *_ = eng.stats()
  assert (running, waiting) == (2, 8) and in_use > 0
  eng.abort()  # the run ends unfinished
  after = eng.stats()
  assert after[:3] == (0, 0, 0)
  assert after.prompt_tokens == stats.prompt_tokens + len(long_prompt) + len(prompts[1])
  assert stats.generated_tokens < after.generated_tokens <= stats.generated_tokens + 2 * 7
  # A prompt cached by an earlier run: its full pages are hits.
  eng.generate([Request(long_prompt, 2)])
  eng.generate([Request(long_prompt, 2)])
  assert eng.stats().cached_prompt_tokens == after.cached_prompt_tokens + 16
