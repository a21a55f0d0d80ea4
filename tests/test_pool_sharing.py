"""Shared pages in the pool: reference counts, fork, attach, holds and copy-on-write,
against a plain-Python model of what each sequence must read."""

import functools

import chex
import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import settings
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from jax_paged import pool as kvpool
from jax_paged.pool import KVPool

LAYERS, HKV, D = 2, 2, 4
NUM_PAGES, PAGE_SIZE, MAX_SEQS, MAX_PAGES_PER_SEQ = 14, 4, 6, 4
BATCH, WIDTH = 3, 5


def make_pool(**overrides) -> KVPool:
  kwargs = dict(num_layers=LAYERS, num_kv_heads=HKV, head_dim=D, num_pages=NUM_PAGES,
                page_size=PAGE_SIZE, max_seqs=MAX_SEQS, max_pages_per_seq=MAX_PAGES_PER_SEQ,
                dtype=jnp.float32)
  kwargs.update(overrides)
  return KVPool.create(**kwargs)


reserve = jax.jit(functools.partial(kvpool.reserve, max_new_tokens=WIDTH), donate_argnums=0)
reserve_one = jax.jit(functools.partial(kvpool.reserve, max_new_tokens=1), donate_argnums=0)
write_kv = jax.jit(kvpool.write_kv, donate_argnums=0)
release = jax.jit(kvpool.release, donate_argnums=0)
fork = jax.jit(kvpool.fork, donate_argnums=0, static_argnames="own_last_page")
attach = jax.jit(kvpool.attach, donate_argnums=0)
retain = jax.jit(kvpool.retain_pages, donate_argnums=0)
unhold = jax.jit(kvpool.release_pages, donate_argnums=0)


def expected_refcounts(p: KVPool, holds: dict[int, int]) -> np.ndarray:
  """Live page-table references per page, plus holds."""
  table, used = np.asarray(p.page_table), np.asarray(p.pages_used())
  counts = np.zeros(p.num_pages, np.int64)
  for s in range(p.max_seqs):
    np.add.at(counts, table[s, :used[s]], 1)
  for page, n in holds.items():
    counts[page] += n
  return counts


def check_accounting(p: KVPool, holds: dict[int, int]) -> None:
  """Counts equal references + holds; the free stack is exactly the unreferenced pages,
  each once: nothing leaks, nothing is both free and referenced."""
  counts = expected_refcounts(p, holds)
  np.testing.assert_array_equal(p.refcounts, counts)
  free = np.asarray(p.free_pages)[:int(p.num_free)]
  assert len(set(free.tolist())) == free.size, free
  assert sorted(free.tolist()) == np.flatnonzero(counts == 0).tolist()


class SharingMachine(RuleBasedStateMachine):
  """Random fork / attach / hold / reserve+write / release: every sequence reads exactly
  the tokens it wrote or inherited, and the counts stay exact."""

  def __init__(self):
    super().__init__()
    self.pool = make_pool()
    self.values = [[] for _ in range(MAX_SEQS)]  # per sequence, per token: k [L, HKV, D]
    self.holds: dict[int, int] = {}
    self.rng = np.random.default_rng(0)

  @rule(seq_ids=st.lists(st.integers(0, MAX_SEQS - 1), min_size=BATCH, max_size=BATCH,
                         unique=True),
        counts=st.lists(st.integers(0, WIDTH), min_size=BATCH, max_size=BATCH),
        one=st.booleans())
  def reserve_and_write(self, seq_ids, counts, one):
    if one:  # a decode step: at most one token each
      counts = [min(c, 1) for c in counts]
    p = self.pool
    table = np.asarray(p.page_table)
    refs = expected_refcounts(p, self.holds)
    lengths = [len(v) for v in self.values]
    free = int(p.num_free)
    # The model of reserve: plain sequences in order, then those whose first token falls
    # in a shared, partly filled page, in order (each but the last reference copies it).
    def need(s, n):
      return -(-(lengths[s] + n) // PAGE_SIZE) - -(-lengths[s] // PAGE_SIZE)

    def fits_table(s, n):
      return -(-(lengths[s] + n) // PAGE_SIZE) <= MAX_PAGES_PER_SEQ

    def is_shared(s, n):
      return (n > 0 and lengths[s] % PAGE_SIZE and fits_table(s, n)
              and refs[table[s, lengths[s] // PAGE_SIZE]] > 1)

    shared = {s for s, n in zip(seq_ids, counts) if is_shared(s, n)}
    expected_ok = {}
    for s, n in zip(seq_ids, counts):
      if s not in shared:
        expected_ok[s] = fits_table(s, n) and need(s, n) <= free
        free -= need(s, n) if expected_ok[s] else 0
    for s, n in zip(seq_ids, counts):
      if s in shared:
        page = table[s, lengths[s] // PAGE_SIZE]
        copy = refs[page] > 1
        expected_ok[s] = need(s, n) + copy <= free
        if expected_ok[s]:
          free -= need(s, n) + copy
          refs[page] -= copy
    fn = reserve_one if one else reserve
    self.pool, slots, ok = fn(self.pool, jnp.asarray(seq_ids), jnp.asarray(counts))
    assert np.asarray(ok).tolist() == [expected_ok[s] for s in seq_ids]
    assert int(self.pool.num_free) == free
    slots = np.asarray(slots)
    values = self.rng.standard_normal((BATCH, slots.shape[1], LAYERS, HKV, D)).astype(
        np.float32)
    for i, (s, n) in enumerate(zip(seq_ids, counts)):
      if expected_ok[s]:
        self.values[s].extend(values[i, :n])
      else:
        assert (slots[i] == -1).all()
    for layer in range(LAYERS):
      k = jnp.asarray(values[:, :, layer])
      self.pool = write_kv(self.pool, layer, jnp.asarray(slots), k, -k)

  @rule(dst=st.lists(st.integers(0, MAX_SEQS - 1), min_size=1, max_size=3, unique=True),
        data=st.data(), own_last_page=st.booleans())
  def fork(self, dst, data, own_last_page):
    """Each destination takes its source's tokens as they were before the fork; sources
    may be destinations too (beams reassigned within their group)."""
    src = data.draw(st.lists(st.integers(0, MAX_SEQS - 1), min_size=len(dst),
                             max_size=len(dst)))
    self.pool = fork(self.pool, jnp.asarray(src), jnp.asarray(dst),
                     own_last_page=own_last_page)
    before = [list(v) for v in self.values]
    for s, d in zip(src, dst):
      self.values[d] = list(before[s])

  @rule(seq=st.integers(0, MAX_SEQS - 1), data=st.data())
  def hold_pages(self, seq, data):
    """A prefix cache keeps some of a sequence's pages."""
    used = -(-len(self.values[seq]) // PAGE_SIZE)
    if not used:
      return
    k = data.draw(st.integers(1, used))
    pages = np.asarray(self.pool.page_table)[seq, :k]
    self.pool = retain(self.pool, jnp.asarray(pages))
    for page in pages.tolist():
      self.holds[page] = self.holds.get(page, 0) + 1
    self.held_values = getattr(self, "held_values", {})
    for j, page in enumerate(pages.tolist()):
      self.held_values[page] = self.values[seq][j * PAGE_SIZE:(j + 1) * PAGE_SIZE]

  @rule(data=st.data())
  def drop_holds(self, data):
    if not self.holds:
      return
    pages = data.draw(st.lists(st.sampled_from(sorted(self.holds)), min_size=1, max_size=3,
                               unique=True))
    self.pool = unhold(self.pool, jnp.asarray(pages + [-1]))  # -1: padding
    for page in pages:
      self.holds[page] -= 1
      if not self.holds[page]:
        del self.holds[page]

  @rule(seq=st.integers(0, MAX_SEQS - 1), data=st.data())
  def attach_held(self, seq, data):
    """A prefix-cache hit: an empty sequence starts on held pages whose tokens it reads."""
    full = [page for page in self.holds if len(self.held_values[page]) == PAGE_SIZE]
    if not full or self.values[seq]:
      return
    page = data.draw(st.sampled_from(sorted(full)))
    self.pool = attach(self.pool, jnp.asarray([seq]), jnp.asarray([[page]]),
                       jnp.asarray([PAGE_SIZE]))
    self.values[seq] = list(self.held_values[page])

  @rule(seq_ids=st.lists(st.integers(0, MAX_SEQS - 1), min_size=1, max_size=2, unique=True))
  def release(self, seq_ids):
    self.pool = release(self.pool, jnp.asarray(seq_ids))
    for s in seq_ids:
      self.values[s] = []

  @invariant()
  def consistent(self):
    p = self.pool
    np.testing.assert_array_equal(p.lengths, [len(v) for v in self.values])
    check_accounting(p, self.holds)
    k_pages, v_pages, table = (np.asarray(x) for x in (p.k_pages, p.v_pages, p.page_table))
    for s in range(MAX_SEQS):
      for pos, want in enumerate(self.values[s]):
        page, off = table[s, pos // PAGE_SIZE], pos % PAGE_SIZE
        np.testing.assert_array_equal(k_pages[:, :, page, off], want)
        np.testing.assert_array_equal(v_pages[:, :, page, off], -want)
    for page, want in getattr(self, "held_values", {}).items():
      if page in self.holds:  # a held page is never written over
        for off, value in enumerate(want):
          np.testing.assert_array_equal(k_pages[:, :, page, off], value)


SharingMachine.TestCase.settings = settings(max_examples=40, stateful_step_count=30,
                                            deadline=None)
TestSharingStateful = SharingMachine.TestCase


def test_forks_diverge_without_seeing_each_others_tokens():
  p = make_pool()
  p, slots, _ = kvpool.reserve(p, jnp.array([0]), 6)  # 1.5 pages
  k = jnp.arange(6 * HKV * D, dtype=jnp.float32).reshape(1, 6, HKV, D)
  for layer in range(LAYERS):
    p = kvpool.write_kv(p, layer, slots, k, -k)
  p = kvpool.fork(p, 0, jnp.array([1, 2]))
  assert int(p.refcounts[p.page_table[0, 1]]) == 3
  p, slots, ok = kvpool.reserve(p, jnp.array([0, 1, 2]), 1)
  assert np.asarray(ok).all()
  pages = np.asarray(slots)[:, 0] // PAGE_SIZE
  assert len(set(pages.tolist())) == 3  # two copies, and the last reference in place
  new = jnp.stack([jnp.full((1, HKV, D), 100.0 + i) for i in range(3)])
  for layer in range(LAYERS):
    p = kvpool.write_kv(p, layer, slots, new, -new)
  table = np.asarray(p.page_table)
  for s in range(3):
    page = table[s, 1]
    np.testing.assert_array_equal(p.k_pages[:, :, page, :2], np.broadcast_to(
        np.asarray(k[0, 4:6]).transpose(1, 0, 2), (LAYERS, HKV, 2, D)))
    np.testing.assert_array_equal(p.k_pages[:, :, page, 2], 100.0 + s)
  assert table[0, 0] == table[1, 0] == table[2, 0]  # the full page stays shared
  check_accounting(p, {})
  p = kvpool.release(p, jnp.array([0, 1, 2]))
  assert int(p.num_free) == NUM_PAGES


def test_copy_on_write_refused_cleanly_when_no_page_is_free():
  p = make_pool(num_pages=2)
  p, _, _ = kvpool.reserve(p, jnp.array([0]), 5)
  p = kvpool.fork(p, 0, jnp.array([1]))
  assert int(p.num_free) == 0
  before = p
  p, slots, ok = kvpool.reserve(p, jnp.array([1, 0]), 1)
  # 1 needs a copy and finds no page; 0 is then still not the last reference either.
  np.testing.assert_array_equal(ok, [False, False])
  chex.assert_trees_all_equal(p, before)
  p = kvpool.release(p, jnp.array([1]))
  p, slots, ok = kvpool.reserve(p, jnp.array([0]), 1)  # now the only reference: in place
  assert bool(ok[0]) and int(slots[0, 0]) // PAGE_SIZE == int(before.page_table[0, 1])


def _check_kernel_with_shared_pages(interpret: bool, seed: int) -> None:
  """The one-kernel decode reserve vs the XLA path when forks share partly filled pages."""
  rng = np.random.default_rng(seed)
  p = make_pool(num_pages=20, max_seqs=8, max_pages_per_seq=4)
  p, slots, _ = kvpool.reserve(p, jnp.arange(3), jnp.asarray(rng.integers(1, 12, 3)))
  k = jnp.asarray(rng.standard_normal((3, 12, HKV, D)), jnp.float32)[:, :slots.shape[1]]
  for layer in range(LAYERS):
    p = kvpool.write_kv(p, layer, slots, k + layer, -k)
  p = kvpool.fork(p, 0, jnp.array([3, 4]))
  p = kvpool.fork(p, 1, jnp.array([5]))
  p = p  # sequences 6, 7 stay empty
  free = int(rng.integers(0, int(p.num_free) + 1))
  # A shorter stack: the top `free` pages of it stay (counts are untouched: ids below
  # the top are free pages too, so no used page is handed out).
  p = p.replace(free_pages=jnp.roll(p.free_pages, free - int(p.num_free)),
                num_free=jnp.asarray(free, jnp.int32))
  ids = (np.arange(8) if seed % 2 else rng.permutation(8)).astype(np.int32)
  counts = jnp.asarray(rng.integers(0, 2, 8), jnp.int32).at[:3].set(1)
  xla = jax.jit(lambda p, i, c: kvpool._reserve_xla(p, i, c, 1))  # on any backend
  kernel = jax.jit(lambda p, c: kvpool.reserve(p, ids, c, max_new_tokens=1,
                                               interpret=interpret))
  chex.assert_trees_all_equal(kernel(p, counts), xla(p, jnp.asarray(ids), counts))
  traced = jax.jit(lambda p, i, c: kvpool.reserve(p, i, c, max_new_tokens=1,
                                                  interpret=interpret))
  chex.assert_trees_all_equal(traced(p, jnp.asarray(ids), counts),
                              xla(p, jnp.asarray(ids), counts))


@pytest.mark.parametrize("seed", range(4))
def test_decode_reserve_kernel_copy_on_write_interpret_matches_xla(seed):
  _check_kernel_with_shared_pages(True, seed)


@pytest.mark.gpu
@pytest.mark.parametrize("seed", range(4))
def test_decode_reserve_kernel_copy_on_write_on_gpu_matches_xla(seed):
  _check_kernel_with_shared_pages(False, seed)


def test_fork_with_one_source_per_destination():
  p = make_pool()
  p, _, _ = kvpool.reserve(p, jnp.array([0, 1]), jnp.array([5, 9]))
  p = jax.jit(kvpool.fork)(p, jnp.array([0, 1, 1, 0]), jnp.array([2, 3, 4, 0]))
  np.testing.assert_array_equal(p.lengths, [5, 9, 5, 9, 9, 0])  # 0 takes its own pages
  np.testing.assert_array_equal(p.page_table[3, :3], p.page_table[1, :3])
  check_accounting(p, {})


def test_fork_onto_sources_owning_last_pages():
  """Beams taking over their parents' rows: rows 0-3 become copies of rows 0, 0, 2, 1 as
  they were; with own_last_page the partly filled pages end up unshared (one copy made
  now, for row 1), so the next decode step writes every row in place."""
  p = make_pool()
  p, slots, _ = kvpool.reserve(p, jnp.arange(4), 6)  # a full page and 6 - PAGE_SIZE more
  k = jax.random.normal(jax.random.key(3), (4, 6, HKV, D))
  for layer in range(LAYERS):
    p = kvpool.write_kv(p, layer, slots, k + layer, -k)
  old = np.asarray(p.page_table)
  free = int(p.num_free)
  p = jax.jit(kvpool.fork, static_argnames="own_last_page")(
      p, jnp.array([0, 0, 2, 1]), jnp.arange(4), own_last_page=True)
  table = np.asarray(p.page_table)
  np.testing.assert_array_equal(p.lengths[:4], 6)
  np.testing.assert_array_equal(table[:4, 0], old[[0, 0, 2, 1], 0])  # full pages shared
  np.testing.assert_array_equal(table[[0, 2, 3], 1], old[[0, 2, 1], 1])  # kept, not copied
  assert table[1, 1] not in old[:4, :2]  # the one copy
  assert int(p.num_free) == free + 2 - 1  # row 3's two pages freed, one copy taken
  check_accounting(p, {})
  assert (np.asarray(p.refcounts)[table[:4, 1]] == 1).all()
  for row, src in enumerate([0, 0, 2, 1]):
    for pos in range(6):
      np.testing.assert_array_equal(
          p.k_pages[:, :, table[row, pos // PAGE_SIZE], pos % PAGE_SIZE],
          k[src, pos][None] + jnp.arange(LAYERS)[:, None, None])
  p, slots, ok = kvpool.reserve(p, jnp.arange(4), 1, interpret=True)  # the decode kernel
  assert np.asarray(ok).all()
  np.testing.assert_array_equal(np.asarray(slots)[:, 0] // PAGE_SIZE, table[:4, 1])


def _check_copy_pages(dtype, interpret):
  """The page-copy kernel copies each listed page whole (an int8 pool's scales too), as
  XLA's gather / scatter does, and nothing for a negative destination."""
  p = make_pool(dtype=dtype)
  keys = jax.random.split(jax.random.key(4), 4)
  fill = lambda key, x: (jax.random.normal(key, x.shape) * 50).astype(x.dtype)
  p = p.replace(**{name: fill(key, x) for key, (name, x) in zip(keys, p.page_arrays().items())})
  src, dst = jnp.array([3, 0, 5, 3]), jnp.array([7, -1, 2, 9])
  got = kvpool.copy_pages(p, src, dst, interpret=interpret)
  for x, before in zip(got.page_arrays().values(), p.page_arrays().values()):
    want = np.asarray(before).copy()
    want[:, :, [7, 2, 9]] = want[:, :, [3, 5, 3]]
    np.testing.assert_array_equal(x, want)
  if jax.default_backend() == "cpu":
    chex.assert_trees_all_equal(kvpool.copy_pages(p, src, dst).page_arrays(),  # XLA
                                got.page_arrays())


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16, jnp.int8])
def test_copy_pages_kernel_in_interpret_mode(dtype):
  _check_copy_pages(dtype, True)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.int8])
def test_copy_pages_kernel_on_gpu(dtype):
  _check_copy_pages(dtype, False)


def test_release_frees_a_page_shared_by_two_released_sequences_once():
  p = make_pool()
  p, _, _ = kvpool.reserve(p, jnp.array([0]), 8)
  p = kvpool.fork(p, 0, jnp.array([1, 2]))
  p = kvpool.release(p, jnp.array([0, 1]))
  assert int(p.num_free) == NUM_PAGES - 2
  p = kvpool.release(p, jnp.array([2]))
  assert int(p.num_free) == NUM_PAGES
  check_accounting(p, {})


def test_holds_keep_pages_past_their_sequences():
  p = make_pool()
  p, _, _ = kvpool.reserve(p, jnp.array([0]), 8)
  pages = p.page_table[0, :2]
  p = kvpool.retain_pages(p, pages)
  p = kvpool.release(p, jnp.array([0]))
  assert int(p.num_free) == NUM_PAGES - 2
  p = kvpool.attach(p, jnp.array([3]), pages[None], jnp.array([6]))
  np.testing.assert_array_equal(p.page_table[3, :2], pages)
  assert int(p.lengths[3]) == 6
  check_accounting(p, {int(pages[0]): 1, int(pages[1]): 1})
  p = kvpool.release_pages(p, pages)
  p = kvpool.release(p, jnp.array([3]))
  assert int(p.num_free) == NUM_PAGES


@pytest.mark.parametrize("call,match", [
    (lambda p: kvpool.fork(p, MAX_SEQS, [1]), r"src_seq must be sequence ids in \[0, max_seqs"),
    (lambda p: kvpool.fork(p, [0, 1, 2], [3, 4]), r"src_seq must be an int or an int array of shape \[2\]"),
    (lambda p: kvpool.fork(p, 0, [1, 1]), "distinct"),
    (lambda p: kvpool.retain_pages(p, [NUM_PAGES]), "page_ids must be < num_pages"),
    (lambda p: kvpool.retain_pages(p, [3]), r"page_ids must be pages in use, got free pages \[3\]"),
    (lambda p: kvpool.release_pages(p, [1.5]), "page_ids must be an integer array"),
    (lambda p: kvpool.attach(p, [0], [[0, 1]], [9]), r"num_tokens must be in \[0, 8\]"),
    (lambda p: kvpool.attach(p, [0], [0, 1], [4]), r"page_ids must have shape \[1, m\]"),
])
def test_bad_sharing_arguments_raise_clear_errors(call, match):
  with pytest.raises(ValueError, match=match):
    call(make_pool())
