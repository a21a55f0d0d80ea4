"""Shared pages in the engine: prefix caching, parallel sampling and chunked prefill give
the tokens of unshared runs, and leave no page referenced or leaked."""

import numpy as np
import pytest
from flax import nnx

from jax_paged import Engine, Request, generate
from jax_paged.serving import admission, kv_cache_manager
from jax_paged.serving.kv_cache_manager import KVCacheManager, page_keys
from jax_paged.serving.request import sample_seed
from jax_paged.serving.scheduler import Scheduler
from models import gpt2
from tests.test_engine import FakeDevice, assert_pages_back

CONFIG = gpt2.GPT2Config(vocab_size=97, n_positions=96, n_embd=32, n_layer=2, n_head=4,
                         bos_token_id=None, eos_token_id=None)
PAGE = 8


@pytest.fixture(scope="module")
def model():
  return gpt2.GPT2LMHeadModel(CONFIG, rngs=nnx.Rngs(5))


@pytest.fixture(scope="module")
def shared_prompts():
  """Prompts sharing a 3-page system prompt: plus a suffix (crossing a page, or ending the
  prefix on a page boundary), the prefix alone, the prefix cut mid-page, one identical to
  another, and a cached prefix plus one token."""
  rng = np.random.default_rng(0)
  system = rng.integers(0, CONFIG.vocab_size, 3 * PAGE).tolist()
  first = system + rng.integers(0, CONFIG.vocab_size, 5).tolist()
  return [first, system + rng.integers(0, CONFIG.vocab_size, 11).tolist(), system,
          system[:2 * PAGE + 3], list(first), system[:2 * PAGE] + [4],
          system + system[:PAGE]]


@pytest.fixture(scope="module")
def reference(model, shared_prompts):
  return generate(model, shared_prompts, 10, page_size=PAGE)


@pytest.mark.parametrize("max_batch", [3])
def test_prefix_caching_gives_the_same_greedy_tokens(model, shared_prompts, reference,
                                                     max_batch):
  requests = [Request(p, 10) for p in shared_prompts]
  cached = Engine(model, max_batch=max_batch, num_pages=64, page_size=PAGE)
  outputs, report = cached.generate(requests)
  assert outputs == reference
  assert report.cached_prompt_tokens >= 5 * 2 * PAGE and report.pages_saved >= 10
  off = Engine(model, max_batch=max_batch, num_pages=64, page_size=PAGE,
               prefix_caching=False)
  outputs_off, report_off = off.generate(requests)
  assert outputs_off == reference and report_off.cached_prompt_tokens == 0
  assert report.peak_pages_in_use < report_off.peak_pages_in_use
  assert off.num_cached_pages == 0
  for eng in (cached, off):
    assert_pages_back(eng)


def test_requests_admitted_together_compute_a_shared_prefix_once(model, shared_prompts):
  """Eight requests sharing 3 pages, admitted at once: in one prefill call, the first
  computes them, the rest attach to them and prefill their own tokens after it."""
  system = shared_prompts[2]
  requests = [Request(system + [i, i + 1], 4) for i in range(8)]
  eng = Engine(model, max_batch=8, num_pages=64, page_size=PAGE)
  outputs, report = eng.generate(requests)
  assert report.cached_prompt_tokens == 7 * 3 * PAGE and report.prefill_calls == 1
  assert report.peak_pages_in_use == 3 + 8
  assert outputs == generate(model, [r.prompt for r in requests], 4, page_size=PAGE)


def test_requests_sharing_cached_and_new_pages_prefill_in_one_call(model, shared_prompts):
  """A cached 3-page prefix (an earlier run's), then four requests admitted together that
  share it and 2 more pages: the first attaches to the cached pages and computes the 2,
  the rest start on all 5 of its pages in the same call's second phase."""
  system = shared_prompts[2]
  rng = np.random.default_rng(6)
  shared = system + rng.integers(0, CONFIG.vocab_size, 2 * PAGE).tolist()
  prompts = [shared + rng.integers(0, CONFIG.vocab_size, n).tolist() for n in (3, 9, 1, 12)]
  eng = Engine(model, max_batch=4, num_pages=64, page_size=PAGE)
  eng.generate([Request(system, 2)])
  outputs, report = eng.generate([Request(p, 6) for p in prompts])
  assert outputs == generate(model, prompts, 6, page_size=PAGE)
  assert report.prefill_calls == 1
  assert report.cached_prompt_tokens == (3 + 3 * 5) * PAGE
  assert_pages_back(eng)


def test_eviction_under_a_tiny_pool_gives_the_same_tokens(
    model, shared_prompts, reference):
  eng = Engine(model, max_batch=4, num_pages=8, page_size=PAGE, steps_per_call=6)
  outputs, report = eng.generate([Request(p, 10) for p in shared_prompts])
  assert outputs == reference and report.evicted_pages > 0
  assert report.cached_prompt_tokens > 0 and report.peak_pages_in_use <= 8
  assert_pages_back(eng)


def test_parallel_samples_share_the_prompt_and_draw_their_own_streams(model, shared_prompts):
  """Sample j of a request with n samples is what a lone request seeded sample_seed(seed,
  j) draws: forks share the prompt's pages (copy-on-write on the last, partly filled one)
  without seeing each other's tokens."""
  prompt = shared_prompts[1]  # 35 tokens: its last page is shared partly filled
  eng = Engine(model, max_batch=6, num_pages=64, page_size=PAGE, steps_per_call=4)
  outputs, report = eng.generate([Request(prompt, 9, temperature=1.0, seed=3, n=4),
                                  Request(shared_prompts[0], 5, n=2)])
  alone = Engine(model, max_batch=1, num_pages=64, page_size=PAGE)
  for j in range(4):
    lone, _ = alone.generate([Request(prompt, 9, temperature=1.0, seed=sample_seed(3, j))])
    assert outputs[0][j] == lone[0]
  assert len({tuple(o) for o in outputs[0]}) == 4
  greedy = generate(model, [shared_prompts[0]], 5, page_size=PAGE)[0]
  assert outputs[1] == [greedy, greedy]
  assert report.pages_saved >= 3 * (len(prompt) // PAGE + 1)
  assert_pages_back(eng)


def test_long_prompts_prefill_in_chunks_beside_decoding_requests(model, shared_prompts,
                                                                 reference):
  """A 90-token prompt in chunks of 16 arrives while short requests decode: the same tokens,
  and decode chunks run between its chunks."""
  rng = np.random.default_rng(4)
  long_prompt = rng.integers(0, CONFIG.vocab_size, 80).tolist()
  requests = [Request(p, 10) for p in shared_prompts[:3]] + [
      Request(long_prompt, 10, arrival_s=0.5)]
  eng = Engine(model, max_batch=4, num_pages=64, page_size=PAGE, max_prefill_tokens=16,
               steps_per_call=40)
  outputs, report = eng.generate(requests)
  assert outputs[:3] == reference[:3]
  assert outputs[3] == generate(model, [long_prompt], 10, page_size=PAGE)[0]
  assert report.prefill_calls >= 80 // 16


def test_a_request_arriving_later_starts_on_the_cached_prefix(model, shared_prompts,
                                                              reference):
  requests = [Request(shared_prompts[0], 10), Request(shared_prompts[1], 10, arrival_s=0.3)]
  eng = Engine(model, max_batch=2, num_pages=64, page_size=PAGE)
  outputs, report = eng.generate(requests)
  assert outputs == reference[:2] and report.cached_prompt_tokens == 3 * PAGE
  assert report.ttft_s[1] < report.elapsed_s - 0.3 + 1e-6


def test_the_prefix_cache_outlives_a_run(model, shared_prompts, reference):
  """A later run on the same engine starts on the pages earlier runs cached, evicts them
  when it needs room, and gives the same tokens; `reset_prefix_cache` makes it cold."""
  eng = Engine(model, max_batch=2, num_pages=64, page_size=PAGE)
  outputs, report = eng.generate([Request(shared_prompts[0], 10)])
  assert outputs == reference[:1] and report.cached_prompt_tokens == 0
  assert eng.num_cached_pages == 3  # the system prompt's full pages
  outputs, report = eng.generate([Request(shared_prompts[1], 10)])
  assert outputs == reference[1:2] and report.cached_prompt_tokens == 3 * PAGE
  assert eng.reset_prefix_cache() == 4 and eng.num_cached_pages == 0
  outputs, report = eng.generate([Request(shared_prompts[1], 10)])
  assert outputs == reference[1:2] and report.cached_prompt_tokens == 0
  # A pool of 8 pages: each run evicts what earlier runs cached as it needs room.
  tiny = Engine(model, max_batch=4, num_pages=8, page_size=PAGE, steps_per_call=6)
  requests = [Request(p, 10) for p in shared_prompts]
  runs = [tiny.generate(requests) for _ in range(3)]
  assert all(outputs == reference for outputs, _ in runs)
  assert runs[1][1].evicted_pages > 0 and runs[1][1].peak_pages_in_use <= 8
  assert runs[2][1].cached_prompt_tokens > 0
  assert_pages_back(tiny)


@pytest.mark.parametrize("seed", [1, 2])
def test_every_feature_at_once_gives_each_request_its_own_tokens(model, seed):
  """Random requests (prefixes of a few shared prompts plus suffixes, greedy and sampled
  with top-k / top-p, stop tokens, n up to 3) added between steps to a small engine that
  caches prefixes, chunks prompts, evicts and preempts: every sample's tokens are those of
  a run of all of them at once on a pool that holds everything, without prefix caching."""
  rng = np.random.default_rng(seed)
  vocab = CONFIG.vocab_size
  bases = [rng.integers(0, vocab, rng.integers(3, 30)).tolist() for _ in range(3)]
  requests = []
  for _ in range(16):
    base = bases[rng.integers(len(bases))]
    settings = {}
    if rng.random() < 0.4:
      settings.update(temperature=0.8, seed=int(rng.integers(0, 1000)),
                      top_k=[None, 5][rng.integers(2)], top_p=[None, 0.9][rng.integers(2)])
    if rng.random() < 0.3:
      settings.update(stop_token_ids=rng.integers(0, vocab, 2).tolist())
    prompt = (base[:rng.integers(1, len(base) + 1)]
              + rng.integers(0, vocab, rng.integers(0, 6)).tolist())
    requests.append(Request(prompt, int(rng.integers(1, 14)), n=int(rng.choice([1, 1, 2, 3])),
                            **settings))
  big = Engine(model, max_batch=40, num_pages=40 * 13, page_size=PAGE, prefix_caching=False)
  expected, _ = big.generate(requests)
  eng = Engine(model, max_batch=6, num_pages=10, page_size=PAGE, steps_per_call=5,
               max_prefill_tokens=16)
  got, ids, waiting = {}, {}, list(rng.permutation(len(requests)))
  preemptions = evicted = cached = 0
  while waiting or eng.has_unfinished_requests():
    for _ in range(rng.integers(0, 4)):
      if waiting:
        i = waiting.pop(0)
        ids[eng.add_request(requests[i])] = i
    running = eng.has_unfinished_requests()
    for event in eng.step():
      got.setdefault((ids[event.request_id], event.sample), []).append(event.token)
    if running and not eng.has_unfinished_requests():  # this step ended a run: its report
      preemptions += eng.report.preemptions
      evicted += eng.report.evicted_pages
      cached += eng.report.cached_prompt_tokens
  for i, r in enumerate(requests):
    for j in range(r.n):
      assert got[i, j] == (expected[i][j] if r.n > 1 else expected[i]), (i, j, r)
  assert preemptions and evicted and cached
  assert_pages_back(eng)


def test_many_random_requests_with_shared_prefixes_leave_nothing_referenced():
  """Three thousand random requests (shared prefixes, n up to 3, random budgets) through the
  scheduler on a small pool with the device's page work done by the pool functions:
  after every call the host mirror matches the device (`sync` checks the free pages), and
  at the end every page is free and every count zero."""
  rng = np.random.default_rng(1)
  bases = [rng.integers(0, 50, rng.integers(4, 40)).tolist() for _ in range(6)]
  requests = []
  for _ in range(3000):
    base = bases[rng.integers(len(bases))]
    prompt = base[:rng.integers(1, len(base) + 1)] + rng.integers(0, 50, rng.integers(0, 6)).tolist()
    requests.append(Request(prompt, int(rng.integers(1, 12)), n=int(rng.integers(1, 4)),
                            stop_token_ids=[int(rng.integers(0, 50))]))
  cache = KVCacheManager(num_pages=24, page_size=4, max_seqs=8, max_pages_per_seq=16,
                         prefix_caching=True)
  scheduler = Scheduler(requests, max_batch=8, cache=cache,
                        admission=admission.OptimisticAdmission(cache), steps_per_call=5,
                        max_prefill_tokens=32)
  device = FakeDevice(cache)
  finished = 0
  while (plan := scheduler.schedule()) is not None:
    for _, _, _, reason, *_ in device.run(scheduler, plan, token=int(rng.integers(0, 50))):
      finished += reason is not None
  assert finished == sum(r.n for r in requests) and scheduler.finished
  assert cache.cached_prompt_tokens > 0 and scheduler.num_preemptions > 0
  kv = device.kv
  from jax_paged import pool
  retain, release = scheduler.pending_release()
  kv = pool.retain_pages(kv, retain or [-1])
  kv = pool.release(kv, release or [0])
  kv = pool.release_pages(kv, cache.evict_for(cache.num_pages) or [-1])
  assert int(kv.num_free) == 24 and not np.asarray(kv.refcounts).any()


def test_lookup_finds_each_contexts_longest_cached_prefix():
  """The batched lookup against a per-context walk of the cache, on random contexts over
  a few shared bases: empty and one-page contexts, full hits (the last token is left to
  compute), misses at the first page and mid-way."""
  rng = np.random.default_rng(2)
  page = 4
  cache = KVCacheManager(num_pages=64, page_size=page, max_seqs=4, max_pages_per_seq=16,
                         prefix_caching=True)
  bases = [rng.integers(0, 9, 40) for _ in range(3)]
  cached = [bases[0][:28], bases[1][:13]]  # 7 and 3 full pages
  for slot, context in enumerate(cached):
    n = len(context) // page
    cache.page_rows[slot, :n] = rng.permutation(64)[:n] if slot else np.arange(n)
    cache.register([(slot, page_keys([context], page)[0], 0, n * page)])
  contexts = [bases[rng.integers(3)][:rng.integers(0, 41)] for _ in range(200)]
  contexts += [bases[0][:28], bases[0][:29], bases[0][:3]]
  keys = page_keys(contexts, page)
  got = cache.lookup(keys, [len(c) for c in contexts])
  for context, k, pages in zip(contexts, keys, got):
    want = []
    for key in k[:(len(context) - 1) // page].tolist():
      if key not in cache._cache:
        break
      want.append(cache._cache[key])
    np.testing.assert_array_equal(pages, want)
  assert len(got[-3]) == 6 and len(got[-2]) == 7 and len(got[-1]) == 0
  assert sum(map(len, got)) > 100
  off = KVCacheManager(num_pages=64, page_size=page, max_seqs=4, max_pages_per_seq=16)
  assert all(len(p) == 0 for p in off.lookup(keys, [len(c) for c in contexts]))


@pytest.mark.parametrize("group_tokens", [None, 1, 64])
def test_page_keys_chain_each_contexts_pages(group_tokens, monkeypatch):
  """A page's key depends on its tokens and every page before it, not on the other
  contexts of the batch: keys of contexts together equal their keys one by one, equal
  prefixes give equal keys, and one changed token changes its page's key and all later
  ones. Also with the contexts hashed in groups of a few tokens (`group_tokens`: one
  context per group, or groups of one or two)."""
  if group_tokens is not None:
    monkeypatch.setattr(kv_cache_manager, "_KEY_GROUP_TOKENS", group_tokens)
  rng = np.random.default_rng(3)
  page = 4
  base = rng.integers(0, 50257, 40).astype(np.int32)
  changed = base.copy()
  changed[13] += 1  # in page 3
  contexts = [base, base[:22], changed, rng.integers(0, 50257, 3).astype(np.int32),
              rng.integers(0, 50257, 31).astype(np.int32)]
  together = page_keys(contexts, page)
  for context, keys in zip(contexts, together):
    np.testing.assert_array_equal(keys, page_keys([context], page)[0])
    assert keys.dtype == np.uint64 and len(keys) == len(context) // page
  np.testing.assert_array_equal(together[1], together[0][:5])
  np.testing.assert_array_equal(together[2][:3], together[0][:3])
  assert not np.isin(together[2][3:], together[0]).any()
  assert len(np.unique(np.concatenate(together))) == 10 + 7 + 7


def test_a_page_of_zeros_is_part_of_the_chain():
  """Token id 0 (left padding, say) fills whole pages: a context starting with such pages
  keys its later pages apart from a context without them."""
  page = 4
  x = np.array([5, 6, 7, 8, 9, 10, 11, 12], np.int32)
  zeros = np.zeros(page, np.int32)
  plain, one, two = page_keys([x, np.concatenate([zeros, x]),
                               np.concatenate([zeros, zeros, x])], page)
  assert one[0] == two[0]  # the same first page
  assert len(np.unique(np.concatenate([plain, one, two[1:]]))) == 2 + 3 + 3


def test_a_prompt_behind_pages_of_zeros_does_not_reuse_the_cached_prompt(model):
  """With X cached and a page of zeros cached, [zeros, X] shares only the zeros page (X's
  pages hold other positions): its tokens are those of an engine without prefix caching."""
  rng = np.random.default_rng(8)
  x = rng.integers(1, CONFIG.vocab_size, 2 * PAGE + 3).tolist()
  prompts = [x, [0] * PAGE + [7], [0] * PAGE + x]
  eng = Engine(model, max_batch=3, num_pages=64, page_size=PAGE)
  cached = eng.generate([Request(p, 6) for p in prompts[:2]])[0]
  behind, report = eng.generate([Request(prompts[2], 6)])
  off = Engine(model, max_batch=3, num_pages=64, page_size=PAGE, prefix_caching=False)
  assert cached + behind == off.generate([Request(p, 6) for p in prompts])[0]
  assert report.cached_prompt_tokens == PAGE
