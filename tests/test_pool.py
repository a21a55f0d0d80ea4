"""The functional KV page pool against a plain-Python model of it."""

import functools

import chex
import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import settings
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from jax_paged.kernels import linear
from jax_paged import pool as kvpool
from jax_paged.pool import KVPool, PoolExhausted

LAYERS, HKV, D = 2, 2, 4
NUM_PAGES, PAGE_SIZE, MAX_SEQS, MAX_PAGES_PER_SEQ = 12, 4, 5, 4
BATCH, WIDTH = 3, 6  # fixed argument shapes, so each jitted op compiles once


def make_pool(**overrides) -> KVPool:
  kwargs = dict(num_layers=LAYERS, num_kv_heads=HKV, head_dim=D, num_pages=NUM_PAGES,
                page_size=PAGE_SIZE, max_seqs=MAX_SEQS, max_pages_per_seq=MAX_PAGES_PER_SEQ,
                dtype=jnp.float32)
  kwargs.update(overrides)
  return KVPool.create(**kwargs)


reserve = jax.jit(functools.partial(kvpool.reserve, max_new_tokens=WIDTH), donate_argnums=0)
write_kv = jax.jit(kvpool.write_kv, donate_argnums=0)
release = jax.jit(kvpool.release, donate_argnums=0)


def owned_pages(p: KVPool) -> dict[int, list[int]]:
  table, used = np.asarray(p.page_table), np.asarray(p.pages_used())
  return {s: table[s, :used[s]].tolist() for s in range(p.max_seqs)}


def check_page_ownership(p: KVPool) -> None:
  """Every page is owned by exactly one sequence or is on the free stack, never both."""
  free = np.asarray(p.free_pages)[:int(p.num_free)].tolist()
  owned = [page for pages in owned_pages(p).values() for page in pages]
  assert sorted(owned + free) == list(range(p.num_pages)), (owned, free)


class PoolMachine(RuleBasedStateMachine):
  """Random reserve / write / release against a model: lengths and token values per sequence."""

  def __init__(self):
    super().__init__()
    self.pool = make_pool()
    self.lengths = [0] * MAX_SEQS
    self.values = [[] for _ in range(MAX_SEQS)]  # per sequence, per token: k [L, HKV, D]
    self.rng = np.random.default_rng(0)

  def _token_values(self, n):
    return self.rng.standard_normal((n, LAYERS, HKV, D)).astype(np.float32)

  def _write(self, slots, values, layer):
    """Writes values [BATCH, WIDTH, L, HKV, D] at slots into one layer: k = v, v = -k."""
    k = jnp.asarray(values[:, :, layer])
    self.pool = write_kv(self.pool, layer, slots, k, -k)

  @rule(seq_ids=st.lists(st.integers(0, MAX_SEQS - 1), min_size=BATCH, max_size=BATCH,
                         unique=True),
        counts=st.lists(st.integers(0, WIDTH), min_size=BATCH, max_size=BATCH))
  def reserve_and_write(self, seq_ids, counts):
    free = NUM_PAGES - sum(-(-n // PAGE_SIZE) for n in self.lengths)
    expected_ok = []
    for s, n in zip(seq_ids, counts):
      need = -(-(self.lengths[s] + n) // PAGE_SIZE) - -(-self.lengths[s] // PAGE_SIZE)
      fits = need <= free and -(-(self.lengths[s] + n) // PAGE_SIZE) <= MAX_PAGES_PER_SEQ
      expected_ok.append(fits)
      free -= need if fits else 0
    old_lengths = list(self.lengths)
    self.pool, slots, ok = reserve(self.pool, jnp.asarray(seq_ids), jnp.asarray(counts))
    assert np.asarray(ok).tolist() == expected_ok
    slots = np.asarray(slots)
    values = self._token_values(BATCH * WIDTH).reshape(BATCH, WIDTH, LAYERS, HKV, D)
    for i, (s, n) in enumerate(zip(seq_ids, counts)):
      if expected_ok[i]:
        assert (slots[i, :n] >= 0).all() and (slots[i, n:] == -1).all()
        self.lengths[s] += n
        self.values[s].extend(values[i, :n])
      else:
        assert (slots[i] == -1).all()
        assert int(self.pool.lengths[s]) == old_lengths[s]
    for layer in range(LAYERS):
      self._write(jnp.asarray(slots), values, layer)

  @rule(seq_ids=st.lists(st.integers(0, MAX_SEQS - 1), min_size=2, max_size=2, unique=True))
  def release(self, seq_ids):
    self.pool = release(self.pool, jnp.asarray(seq_ids))
    for s in seq_ids:
      self.lengths[s] = 0
      self.values[s] = []

  @rule(data=st.data())
  def overwrite_existing(self, data):
    """Rewrites random cached positions through slots computed from the page table; the
    rest of the slot matrix is negative padding that must not touch live data."""
    live = [s for s in range(MAX_SEQS) if self.lengths[s]]
    if not live:
      return
    slots = np.full((BATCH, WIDTH), -1, np.int32)
    values = self._token_values(BATCH * WIDTH).reshape(BATCH, WIDTH, LAYERS, HKV, D)
    table = np.asarray(self.pool.page_table)
    s = data.draw(st.sampled_from(live))
    positions = data.draw(st.lists(st.integers(0, self.lengths[s] - 1), min_size=1,
                                   max_size=WIDTH, unique=True))
    for j, p in enumerate(positions):
      slots[0, j] = table[s, p // PAGE_SIZE] * PAGE_SIZE + p % PAGE_SIZE
      self.values[s][p] = values[0, j]
    slots[1:] = data.draw(st.sampled_from([-1, -7, -(2 ** 30)]))
    for layer in range(LAYERS):
      self._write(jnp.asarray(slots), values, layer)

  @invariant()
  def consistent(self):
    p = self.pool
    np.testing.assert_array_equal(p.lengths, self.lengths)
    check_page_ownership(p)
    assert int(p.num_free_pages()) == NUM_PAGES - sum(-(-n // PAGE_SIZE) for n in self.lengths)
    k_pages, v_pages, table = (np.asarray(x) for x in (p.k_pages, p.v_pages, p.page_table))
    for s in range(MAX_SEQS):
      for pos, want in enumerate(self.values[s]):
        page, off = table[s, pos // PAGE_SIZE], pos % PAGE_SIZE
        np.testing.assert_array_equal(k_pages[:, :, page, off], want)
        np.testing.assert_array_equal(v_pages[:, :, page, off], -want)


PoolMachine.TestCase.settings = settings(max_examples=40, stateful_step_count=30, deadline=None)
TestPoolStateful = PoolMachine.TestCase


def test_soak_leaks_no_page():
  """Thousands of random reserve / release steps, all in one jitted loop."""
  p = make_pool(num_pages=64, max_seqs=16, max_pages_per_seq=8)

  def step(carry, key):
    p, ok_count = carry
    k1, k2, k3 = jax.random.split(key, 3)
    ids = jax.random.permutation(k1, p.max_seqs)[:4]
    counts = jax.random.randint(k2, (4,), 0, 12)
    p, _, ok = kvpool.reserve(p, ids, counts, max_new_tokens=12)
    p = kvpool.release(p, jax.random.permutation(k3, p.max_seqs)[:3])
    return (p, ok_count + jnp.sum(ok)), p.num_free + jnp.sum(p.pages_used())

  steps = 3000
  (p, ok_count), totals = jax.jit(lambda p, keys: jax.lax.scan(step, (p, 0), keys))(
      p, jax.random.split(jax.random.key(0), steps))
  np.testing.assert_array_equal(totals, np.full(steps, 64))
  assert 0 < int(ok_count) < 4 * steps  # both successes and refusals were exercised
  check_page_ownership(p)
  p = kvpool.release(p, jnp.arange(p.max_seqs))
  assert int(p.num_free_pages()) == 64
  check_page_ownership(p)


def test_reserve_serves_in_order_and_later_ones_may_fit():
  p = make_pool(num_pages=3)
  p, slots, ok = kvpool.reserve(p, jnp.array([0, 1, 2]), jnp.array([8, 5, 4]))
  # 0 takes 2 pages; 1 needs 2 but only 1 is left; 2 needs 1 and fits.
  np.testing.assert_array_equal(ok, [True, False, True])
  np.testing.assert_array_equal(slots[1], [-1] * 8)
  np.testing.assert_array_equal(p.lengths[:3], [8, 0, 4])
  assert int(p.num_free_pages()) == 0
  check_page_ownership(p)


@pytest.mark.parametrize("seed", range(5))
def test_one_token_reserve_is_greedy_in_order_when_pages_run_short(seed):
  """A decode step's reserve (max_new_tokens=1, a prefix sum) equals in-order greedy."""
  rng = np.random.default_rng(seed)
  p = make_pool(num_pages=10, max_seqs=8, max_pages_per_seq=4)
  # Every sequence holds one page, half of them full: 2 free pages for ~4 that need one.
  p, _, _ = kvpool.reserve(p, jnp.arange(8), jnp.asarray(rng.choice([2, 4], 8)))
  ids = rng.permutation(8)
  counts = rng.integers(0, 2, 8)
  counts[:2] = 1
  lengths, free = np.asarray(p.lengths), int(p.num_free_pages())
  expected = []
  for s, n in zip(ids, counts):
    need = int(n > 0 and lengths[s] % PAGE_SIZE == 0)
    expected.append(need <= free)
    free -= need if need <= free else 0
  new, slots, ok = jax.jit(functools.partial(kvpool.reserve, max_new_tokens=1))(
      p, jnp.asarray(ids), jnp.asarray(counts))
  np.testing.assert_array_equal(ok, expected)
  assert int(new.num_free_pages()) == free
  assert ((np.asarray(slots)[:, 0] >= 0) == (np.asarray(expected) & (counts > 0))).all()
  check_page_ownership(new)


# `reserve`'s plain-XLA path, whatever the backend: the kernels' reference.
reserve_xla = jax.jit(lambda p, ids, counts: kvpool._reserve_xla(p, ids, counts, 1))


def _check_decode_reserve_kernel(interpret: bool, seed: int) -> None:
  """`reserve`'s one-kernel decode path (max_new_tokens=1) vs its XLA path: random
  lengths, a short free stack, counts in -1..2 (traced; the invalid ones refused) and
  bool; concrete counts in {0, 1} outside jit; and traced ids, among them repeated and
  out-of-range ones (not served)."""
  rng = np.random.default_rng(seed)
  p = make_pool(num_pages=24, max_seqs=8, max_pages_per_seq=3)
  p, _, _ = kvpool.reserve(p, jnp.arange(8), jnp.asarray(rng.integers(0, 13, 8)))
  p = p.replace(num_free=jnp.asarray(rng.integers(0, int(p.num_free) + 1), jnp.int32))
  # Some seeds take every sequence in order (the kernel then makes the ids itself).
  ids = (np.arange(8) if seed % 3 == 0 else rng.permutation(8)[:rng.integers(1, 9)]
         ).astype(np.int32)
  kernel = jax.jit(lambda p, c: kvpool.reserve(p, ids, c, max_new_tokens=1,
                                               interpret=interpret))
  counts = jnp.asarray(rng.integers(-1, 3, ids.size), jnp.int32)
  chex.assert_trees_all_equal(kernel(p, counts), reserve_xla(p, jnp.asarray(ids), counts))
  active = jnp.asarray(rng.integers(0, 2, ids.size), bool)  # bool counts: a decode step's
  chex.assert_trees_all_equal(kernel(p, active), reserve_xla(p, jnp.asarray(ids), active))
  counts = rng.integers(0, 2, ids.size)
  counts[0] = 1  # max_new_tokens defaults to max(counts): 1
  chex.assert_trees_all_equal(kvpool.reserve(p, ids, counts, interpret=interpret),
                              reserve_xla(p, jnp.asarray(ids), jnp.asarray(counts)))
  traced = jax.jit(lambda p, i, c: kvpool.reserve(p, i, c, max_new_tokens=1,
                                                  interpret=interpret))
  bad = np.concatenate([ids, rng.choice(ids, 2), [-1, 8, 11]]).astype(np.int32)
  for seq_ids in (ids, rng.permutation(bad)):
    counts = jnp.asarray(rng.integers(-1, 3, seq_ids.size), jnp.int32)
    chex.assert_trees_all_equal(traced(p, jnp.asarray(seq_ids), counts),
                                reserve_xla(p, jnp.asarray(seq_ids), counts))


@pytest.mark.parametrize("seed", range(6))
def test_decode_reserve_kernel_interpret_matches_xla(seed):
  _check_decode_reserve_kernel(True, seed)


@pytest.mark.gpu
@pytest.mark.parametrize("seed", range(3))
def test_decode_reserve_kernel_on_gpu_matches_xla(seed):
  _check_decode_reserve_kernel(False, seed)


def test_numpy_ids_are_checked_under_jit():
  with pytest.raises(ValueError, match="distinct"):
    jax.jit(lambda p: kvpool.reserve(p, np.array([1, 1]), 1))(make_pool())


def test_reserve_past_max_pages_per_seq_fails_cleanly():
  p = make_pool()
  limit = MAX_PAGES_PER_SEQ * PAGE_SIZE
  p, _, ok = kvpool.reserve(p, jnp.array([0, 1]), jnp.array([limit, limit + 1]))
  np.testing.assert_array_equal(ok, [True, False])
  p, _, ok = kvpool.reserve(p, jnp.array([0]), 1)
  assert not bool(ok[0]) and int(p.lengths[0]) == limit


def test_reserve_slots_continue_a_partly_filled_page():
  p = make_pool()
  p, first, _ = kvpool.reserve(p, jnp.array([2]), 3)
  p, second, _ = kvpool.reserve(p, jnp.array([2]), 3)
  page0 = int(p.page_table[2, 0])
  page1 = int(p.page_table[2, 1])
  np.testing.assert_array_equal(first[0], [page0 * 4, page0 * 4 + 1, page0 * 4 + 2])
  np.testing.assert_array_equal(second[0], [page0 * 4 + 3, page1 * 4, page1 * 4 + 1])


def test_released_pages_are_reused():
  p = make_pool(num_pages=2)
  p, _, _ = kvpool.reserve(p, jnp.array([0]), 8)
  pages = set(owned_pages(p)[0])
  p = kvpool.release(p, jnp.array([0]))
  p, _, ok = kvpool.reserve(p, jnp.array([3]), 8)
  assert bool(ok[0]) and set(owned_pages(p)[3]) == pages


def test_an_emptied_pool_hands_out_pages_as_a_new_one():
  """Pages released out of order scramble the free stack; once every page is free again
  it is the new pool's, so the same requests take the same pages (and while pages are
  still held, the stack keeps the order they were freed in)."""
  fresh = make_pool()
  p, _, _ = kvpool.reserve(fresh, jnp.array([0, 1, 2]), jnp.array([9, 3, 13]),
                           max_new_tokens=WIDTH * PAGE_SIZE)
  first = owned_pages(p)
  p = kvpool.release(p, jnp.array([1, 0]))
  assert not np.array_equal(np.asarray(p.free_pages), np.asarray(fresh.free_pages))
  p = kvpool.release(p, jnp.array([2]))
  np.testing.assert_array_equal(np.asarray(p.free_pages), np.asarray(fresh.free_pages))
  assert int(p.num_free) == NUM_PAGES and not np.asarray(p.refcounts).any()
  p, _, _ = kvpool.reserve(p, jnp.array([0, 1, 2]), jnp.array([9, 3, 13]),
                           max_new_tokens=WIDTH * PAGE_SIZE)
  assert owned_pages(p) == first


def test_clear_frees_every_page_and_empties_every_sequence():
  """After reserves, a fork and holds, `clear` gives a new pool's bookkeeping (the same
  pages handed out next) and keeps the K/V buffers."""
  fresh = make_pool()
  p, _, _ = kvpool.reserve(fresh, jnp.array([0, 1]), jnp.array([9, 13]),
                           max_new_tokens=WIDTH * PAGE_SIZE)
  first = owned_pages(p)
  p = kvpool.fork(p, 0, jnp.array([2]))
  p = kvpool.retain_pages(p, jnp.array(first[1][:1]))
  p = kvpool.write_kv(p, 0, jnp.arange(4), *[jnp.ones((4, HKV, D))] * 2)
  k = np.asarray(p.k_pages)
  p = jax.jit(kvpool.clear)(p)
  for name in ("page_table", "lengths", "free_pages", "num_free", "refcounts"):
    np.testing.assert_array_equal(np.asarray(getattr(p, name)), np.asarray(getattr(fresh, name)))
  np.testing.assert_array_equal(np.asarray(p.k_pages), k)
  p, _, _ = kvpool.reserve(p, jnp.array([0, 1]), jnp.array([9, 13]),
                           max_new_tokens=WIDTH * PAGE_SIZE)
  assert owned_pages(p) == first


def test_invalid_ids_under_jit_are_flagged_not_applied():
  p = make_pool()
  p, slots, ok = jax.jit(lambda p, ids: kvpool.reserve(p, ids, 2))(p, jnp.array([1, 1, 9, -1]))
  np.testing.assert_array_equal(ok, [True, False, False, False])
  assert (np.asarray(slots[1:]) == -1).all()
  p = jax.jit(kvpool.release)(p, jnp.array([1, 1, 7]))  # the repeat must not free twice
  assert int(p.num_free_pages()) == NUM_PAGES
  check_page_ownership(p)


def test_traced_counts_need_static_width():
  p = make_pool()
  with pytest.raises(ValueError, match="max_new_tokens"):
    jax.jit(lambda p, n: kvpool.reserve(p, jnp.array([0]), n))(p, jnp.array([2]))
  _, _, ok = jax.jit(lambda p, n: kvpool.reserve(p, jnp.array([0]), n, max_new_tokens=2))(
      p, jnp.array([3]))
  assert not bool(ok[0])  # more tokens than the slot width: refused, not truncated


@pytest.mark.parametrize("call,match", [
    (lambda p: kvpool.reserve(p, [0, 0], 1), "distinct"),
    (lambda p: kvpool.reserve(p, [MAX_SEQS], 1), r"seq_ids must be in \[0, max_seqs"),
    (lambda p: kvpool.reserve(p, [0], -1), "num_new_tokens must be >= 0"),
    (lambda p: kvpool.reserve(p, [0, 1], jnp.array([1, 2, 3])), "num_new_tokens must be"),
    (lambda p: kvpool.release(p, [[0]]), "seq_ids must be a 1-D"),
    (lambda p: kvpool.write_kv(p, 0, jnp.array([0]), jnp.ones((1, HKV, D + 1)),
                               jnp.ones((1, HKV, D + 1))), "k must have shape"),
    (lambda p: kvpool.write_kv(p, 0, jnp.array([NUM_PAGES * PAGE_SIZE]), jnp.ones((1, HKV, D)),
                               jnp.ones((1, HKV, D))), "slots must be <"),
    (lambda p: kvpool.write_kv(p, LAYERS, jnp.array([0]), jnp.ones((1, HKV, D)),
                               jnp.ones((1, HKV, D))), "layer must be in"),
    (lambda p: make_pool(num_pages=0), "num_pages must be a positive int"),
])
def test_bad_arguments_raise_clear_errors(call, match):
  with pytest.raises(ValueError, match=match):
    call(make_pool())


def test_reserve_or_raise():
  p = make_pool(num_pages=1)
  p, slots = kvpool.reserve_or_raise(p, jnp.array([0]), 4)
  assert slots.shape == (1, 4)
  with pytest.raises(PoolExhausted, match=r"no room for sequences \[1\]"):
    kvpool.reserve_or_raise(p, jnp.array([1]), 1)
  assert int(p.num_free_pages()) == 0 and int(p.lengths[1]) == 0


def test_size_pool():
  sizing = kvpool.size_pool(num_layers=12, num_kv_heads=12, head_dim=64, page_size=16,
                            dtype=jnp.bfloat16, available_bytes=10 * 2 ** 30, utilization=0.9)
  per_page = 2 * 12 * 12 * 16 * 64 * 2
  assert sizing.bytes_per_page == per_page
  assert sizing.num_pages == int(10 * 2 ** 30 * 0.9) // per_page
  assert "pages" in str(sizing) and "GiB" in str(sizing)
  with pytest.raises(ValueError, match="utilization"):
    kvpool.size_pool(num_layers=1, num_kv_heads=1, head_dim=64, page_size=16,
                     available_bytes=2 ** 30, utilization=1.5)


def test_pool_is_a_pytree():
  p = make_pool()
  leaves = jax.tree_util.tree_leaves(p)
  assert len(leaves) == 7
  chex.assert_trees_all_equal_shapes(p, jax.tree_util.tree_map(jnp.zeros_like, p))


@pytest.mark.parametrize("interpret", [None, True])
def test_donated_reserve_and_write_update_buffers_in_place(interpret):
  """A jitted reserve+write with the pool donated reuses the K/V buffers: no pool copy
  (XLA's scatters on CPU, and the aliased write kernel)."""
  p = make_pool(num_pages=64, max_seqs=8, max_pages_per_seq=8)

  @functools.partial(jax.jit, donate_argnums=0)
  def step(p, k):
    p, slots, _ = kvpool.reserve(p, jnp.arange(4), 2)
    return kvpool.write_kv(p, 1, slots, k, -k, interpret=interpret)

  k = jnp.asarray(np.random.default_rng(5).standard_normal((4, 2, HKV, D)), jnp.float32)
  pointers = (p.k_pages.unsafe_buffer_pointer(), p.v_pages.unsafe_buffer_pointer())
  for _ in range(3):
    old = p
    p = step(p, k)
    assert old.k_pages.is_deleted() and old.v_pages.is_deleted()
    assert (p.k_pages.unsafe_buffer_pointer(), p.v_pages.unsafe_buffer_pointer()) == pointers
  assert int(p.lengths[0]) == 6


def _random_pool(seed: int, **overrides) -> KVPool:
  """A pool whose pages hold random values (so unwritten elements are recognisable)."""
  p = make_pool(**overrides)
  ks = jax.random.split(jax.random.key(seed))
  return p.replace(k_pages=jax.random.normal(ks[0], p.k_pages.shape, p.k_pages.dtype),
                   v_pages=jax.random.normal(ks[1], p.v_pages.shape, p.v_pages.dtype))


def _check_kernel_write_matches_scatter(interpret: bool, dtype, hkv: int, d: int):
  """The write kernel vs XLA's scatter: tokens at random distinct slots of a random layer
  (traced), padding (-1) and an out-of-range slot dropped, every other element untouched."""
  rng = np.random.default_rng(hkv * 100 + d)
  p = _random_pool(d, num_kv_heads=hkv, head_dim=d, num_layers=3, dtype=dtype)
  total = NUM_PAGES * PAGE_SIZE
  slots = rng.permutation(total)[:2 * 5].reshape(2, 5).astype(np.int32)
  slots[0, 3] = slots[1, 4] = -1
  slots[1, 0] = total + 7  # out of range under jit: dropped
  k = jnp.asarray(rng.standard_normal(slots.shape + (hkv, d)), dtype)
  v = jnp.asarray(rng.standard_normal(slots.shape + (hkv, d)), dtype)
  write = jax.jit(kvpool.write_kv, static_argnames=["interpret"])
  got = write(p, jnp.int32(2), jnp.asarray(slots), k, v, interpret=interpret)
  want = write(p, jnp.int32(2), jnp.asarray(slots), k, v, interpret=None)
  chex.assert_trees_all_equal(got.k_pages, want.k_pages)
  chex.assert_trees_all_equal(got.v_pages, want.v_pages)
  written = np.asarray(got.k_pages[2]).reshape(hkv, total, d)
  np.testing.assert_array_equal(written[:, slots[0, 0]], np.asarray(k[0, 0]))
  for layer in (0, 1):
    np.testing.assert_array_equal(np.asarray(got.v_pages[layer]), np.asarray(p.v_pages[layer]))
  # A traced layer out of range writes nothing (nothing past the pool either).
  for layer in (-1, 3):
    for mode in (interpret, None):
      same = write(p, jnp.int32(layer), jnp.asarray(slots), k, v, interpret=mode)
      chex.assert_trees_all_equal(same.k_pages, p.k_pages)
      chex.assert_trees_all_equal(same.v_pages, p.v_pages)


@pytest.mark.parametrize("dtype,hkv,d", [(jnp.float32, 2, 4), (jnp.bfloat16, 3, 80)])
def test_write_kernel_interpret_matches_scatter(dtype, hkv, d):
  if jax.default_backend() == "gpu":
    pytest.skip("the interpret=None reference is the kernel itself on a GPU")
  _check_kernel_write_matches_scatter(True, dtype, hkv, d)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype,hkv,d", [(jnp.bfloat16, 12, 64), (jnp.float16, 3, 80)])
def test_write_kernel_on_gpu_matches_scatter(dtype, hkv, d):
  """The compiled kernel vs a numpy write; padding (-1) not written."""
  rng = np.random.default_rng(d)
  p = _random_pool(d, num_kv_heads=hkv, head_dim=d, dtype=dtype)
  total = NUM_PAGES * PAGE_SIZE
  slots = jnp.asarray(np.append(rng.permutation(total)[:6], -1).astype(np.int32))
  k, v = (jnp.asarray(rng.standard_normal((7, hkv, d)), dtype) for _ in range(2))
  got = jax.jit(kvpool.write_kv)(p, 1, slots, k, v)
  want_k, want_v = np.array(p.k_pages), np.array(p.v_pages)
  for i, slot in enumerate(np.asarray(slots)):
    if slot >= 0:
      want_k[1, :, slot // PAGE_SIZE, slot % PAGE_SIZE] = np.asarray(k[i])
      want_v[1, :, slot // PAGE_SIZE, slot % PAGE_SIZE] = np.asarray(v[i])
  np.testing.assert_array_equal(np.asarray(got.k_pages), want_k)
  np.testing.assert_array_equal(np.asarray(got.v_pages), want_v)


def _check_project_write_matches_unfused(interpret, dtype, heads: int, hkv: int, d: int):
  """`pool.project_write_kv` (one kernel, `cache_write.project_write_kv_pallas`) vs
  `linear.linear` + `write_kv`: the same q and pool, padding (-1) and out-of-range slots
  dropped, every other element untouched."""
  rng = np.random.default_rng(heads * 10 + d)
  p = _random_pool(d, num_kv_heads=hkv, head_dim=d, num_layers=3, dtype=dtype)
  total = NUM_PAGES * PAGE_SIZE
  slots = rng.permutation(total)[:9].astype(np.int32)
  slots[3] = -1
  slots[5] = total + 2
  width = (heads + 2 * hkv) * d
  x = jnp.asarray(rng.standard_normal((9, 48)), dtype)
  w = jnp.asarray(rng.standard_normal((48, width)) / 7, dtype)
  b = jnp.asarray(rng.standard_normal(width), dtype)
  q, fused = jax.jit(functools.partial(kvpool.project_write_kv, q_width=heads * d,
                                       interpret=interpret))(p, jnp.int32(2), slots, x, w, b)
  k_pages, v_pages = fused.k_pages, fused.v_pages
  # The same GEMM as `linear` (bitwise equal on the same backend).
  want_q, k, v = linear.linear(x, w, b, sections=(heads * d, hkv * d, hkv * d),
                               interpret=interpret)
  want = jax.jit(kvpool.write_kv)(p, jnp.int32(2), jnp.asarray(slots),
                                  k.reshape(9, hkv, d), v.reshape(9, hkv, d))
  tol = dict(rtol=1e-5, atol=1e-5) if dtype == jnp.float32 else dict(rtol=0, atol=0)
  chex.assert_trees_all_close((q, k_pages, v_pages), (want_q, want.k_pages, want.v_pages),
                              **tol)
  for layer in (0, 1):
    np.testing.assert_array_equal(np.asarray(k_pages[layer]), np.asarray(p.k_pages[layer]))


@pytest.mark.parametrize("dtype,heads,hkv,d", [(jnp.float32, 4, 2, 32),
                                               (jnp.bfloat16, 3, 3, 64)])
def test_project_write_kernel_interpret(dtype, heads, hkv, d):
  _check_project_write_matches_unfused(True, dtype, heads, hkv, d)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype,heads,hkv,d", [(jnp.bfloat16, 12, 12, 64),
                                               (jnp.float16, 32, 8, 128)])
def test_project_write_kernel_on_gpu(dtype, heads, hkv, d):
  _check_project_write_matches_unfused(False, dtype, heads, hkv, d)


def test_project_write_kv_on_cpu_is_linear_then_write_and_checks_shapes():
  """Without a GPU (or interpret), `project_write_kv` is `linear` + `write_kv`; bad shapes
  and concrete out-of-range slots raise, naming the argument."""
  rng = np.random.default_rng(3)
  p = _random_pool(4, num_kv_heads=2, head_dim=16, num_layers=2, dtype=jnp.float32)
  slots = jnp.asarray(rng.permutation(NUM_PAGES * PAGE_SIZE)[:5], jnp.int32)
  x = jnp.asarray(rng.standard_normal((5, 24)), jnp.float32)
  w = jnp.asarray(rng.standard_normal((24, 3 * 32)), jnp.float32)
  q, got = kvpool.project_write_kv(p, 1, slots, x, w, None, q_width=32)
  want_q, k, v = linear.linear(x, w, sections=(32, 32, 32))
  want = kvpool.write_kv(p, 1, slots, k.reshape(5, 2, 16), v.reshape(5, 2, 16))
  chex.assert_trees_all_equal((q, got), (want_q, want))
  with pytest.raises(ValueError, match="kernel must have q_width"):
    kvpool.project_write_kv(p, 1, slots, x, w, None, q_width=16)
  with pytest.raises(ValueError, match="x must have shape"):
    kvpool.project_write_kv(p, 1, slots[:4], x, w, None, q_width=32)
  with pytest.raises(ValueError, match="slots must be <"):
    kvpool.project_write_kv(p, 1, slots.at[0].set(NUM_PAGES * PAGE_SIZE), x, w, None,
                            q_width=32)


@pytest.mark.parametrize("dtype", [jnp.int32, jnp.float64, jnp.uint8, jnp.float8_e5m2])
def test_create_accepts_only_the_cache_dtypes_the_kernels_read(dtype):
  with pytest.raises(ValueError, match="dtype must be a cache dtype the kernels read"):
    make_pool(dtype=dtype)
