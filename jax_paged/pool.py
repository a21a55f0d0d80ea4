"""A functional KV page pool: the paged KV cache of every layer as one immutable pytree.

The pool holds the K/V pages of all layers, the page table, the sequence lengths and a
free-page stack. Every operation is a pure, jittable function that returns a new pool; a
jitted caller that donates the pool (`jax.jit(..., donate_argnums=...)`) gets its K/V
buffers updated in place, so nothing is copied per step.

Free pages live in a stack: `free_pages[:num_free]` are the free page ids, and allocation
pops from the top, so a page costs O(1) whatever `num_pages` is.

Pages can be shared (vLLM's prefix caching and parallel sampling). Each page has a
reference count: the page-table rows of live sequences that use it plus the holds placed
on it (`retain_pages`: a prefix cache keeps finished requests' pages that way). `fork`
makes sequences share another's pages, `release` / `release_pages` drop references and
free a page only when its count reaches zero, and `reserve` copies a shared, partly
filled page before a sequence writes into it (copy-on-write), so no sequence ever
overwrites tokens another one reads.

Inside `jax.jit` nothing can raise, so `reserve` reports failures through its `ok` flags
and leaves failed sequences untouched. Outside jit (concrete arguments) the functions also
check `seq_ids` and `slots` up front and raise `ValueError` naming the argument.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from jax_paged.kernels import cache_write
from jax_paged.kernels import decode_reserve
from jax_paged.kernels import kv_quant
from jax_paged.kernels import linear
from jax_paged.kernels import page_copy
from jax_paged.kernels import triton_backend
from jax_paged.kernels import validation


class PoolExhausted(RuntimeError):
  """Raised by `reserve_or_raise` when some sequences could not get their pages."""


@struct.dataclass
class KVPool:
  """The paged KV cache of a whole model.

  Attributes:
    k_pages, v_pages: [num_layers, num_kv_heads, num_pages, page_size, head_dim]. Head-major,
      so one (head, page) tile is contiguous. A quantized pool's v_pages are token-minor,
      [num_layers, num_kv_heads, num_pages, head_dim, page_size] (`kv_quant.v_pages_shape`:
      the decode kernel's p.v contracts over contiguous tokens).
    page_table: int32 [max_seqs, max_pages_per_seq]; entry j of row s is the physical page
      holding tokens [j * page_size, (j + 1) * page_size) of sequence s. Entries past a
      sequence's last used page are garbage.
    lengths: int32 [max_seqs], tokens stored per sequence (0 = empty / inactive).
    free_pages: int32 [num_pages], a stack: `free_pages[:num_free]` are the free pages.
    num_free: int32 [], the stack height.
    refcounts: int32 [num_pages], references to each page: the live sequences whose used
      pages include it (once per row entry) plus its holds (`retain_pages`); 0 exactly for
      the pages on the free stack.
    k_scales, v_scales: for a quantized pool (int8 / float8_e4m3fn pages), float32
      [num_layers, num_kv_heads, num_pages, page_size]: one scale per token per kv head
      (`jax_paged.kernels.kv_quant`), indexed by page ids exactly like the pages, so that
      anything moving a page moves its scales with it (`page_arrays`, `copy_pages`). None
      for float pools.
  """

  k_pages: jax.Array
  v_pages: jax.Array
  page_table: jax.Array
  lengths: jax.Array
  free_pages: jax.Array
  num_free: jax.Array
  refcounts: jax.Array
  k_scales: jax.Array | None = None
  v_scales: jax.Array | None = None

  @classmethod
  def create(cls, *, num_layers: int, num_kv_heads: int, head_dim: int, num_pages: int,
             page_size: int, max_seqs: int, max_pages_per_seq: int,
             dtype=jnp.bfloat16) -> "KVPool":
    """An empty pool: every page free, every sequence of length 0.

    `dtype` is the cache dtype: float32 / bfloat16 / float16 pages, or int8 /
    float8_e4m3fn pages with float32 scales beside them (`k_scales`, `v_scales`; written
    by `write_kv`, read by the kernels, which dequantize in registers).
    """
    for name, value in (("num_layers", num_layers), ("num_kv_heads", num_kv_heads),
                        ("head_dim", head_dim), ("num_pages", num_pages),
                        ("page_size", page_size), ("max_seqs", max_seqs),
                        ("max_pages_per_seq", max_pages_per_seq)):
      validation.check_positive_int(name, value)
    dtype = validation.check_cache_dtype("dtype", dtype)
    if num_pages * page_size >= 2 ** 31:
      raise ValueError(f"num_pages * page_size must fit int32 slots, got {num_pages * page_size}")
    shape = (num_layers, num_kv_heads, num_pages, page_size, head_dim)
    scales = (jnp.zeros(shape[:-1], kv_quant.SCALE_DTYPE) if kv_quant.is_quantized(dtype)
              else None)
    return cls(
        k_pages=jnp.zeros(shape, dtype),
        v_pages=jnp.zeros(kv_quant.v_pages_shape(shape, dtype), dtype),
        **_empty_bookkeeping(num_pages, max_seqs, max_pages_per_seq),
        k_scales=scales,
        v_scales=None if scales is None else jnp.zeros_like(scales),
    )

  @property
  def dtype(self) -> jnp.dtype:
    """The cache dtype (the pages' dtype)."""
    return self.k_pages.dtype

  @property
  def quantized(self) -> bool:
    """Whether pages hold scaled int8 / float8 values (`k_scales`, `v_scales` set)."""
    return kv_quant.is_quantized(self.k_pages.dtype)

  @property
  def num_layers(self) -> int:
    return self.k_pages.shape[0]

  @property
  def num_kv_heads(self) -> int:
    return self.k_pages.shape[1]

  @property
  def num_pages(self) -> int:
    return self.k_pages.shape[2]

  @property
  def page_size(self) -> int:
    return self.k_pages.shape[3]

  @property
  def head_dim(self) -> int:
    return self.k_pages.shape[4]

  @property
  def max_seqs(self) -> int:
    return self.page_table.shape[0]

  @property
  def max_pages_per_seq(self) -> int:
    return self.page_table.shape[1]

  def page_arrays(self) -> dict[str, jax.Array]:
    """The fields indexed by page id (axis 2, [num_layers, num_kv_heads, num_pages, ...]):
    the K/V pages and, for a quantized pool, their scales. Whatever moves or copies a page
    moves all of these."""
    names = ("k_pages", "v_pages") + (("k_scales", "v_scales") if self.quantized else ())
    return {name: getattr(self, name) for name in names}

  def num_free_pages(self) -> jax.Array:
    """int32 scalar: pages not owned by any sequence."""
    return self.num_free

  def pages_used(self, lengths: jax.Array | None = None) -> jax.Array:
    """int32 [max_seqs]: pages owned by each sequence (derived from its length)."""
    lengths = self.lengths if lengths is None else lengths
    return (lengths + self.page_size - 1) // self.page_size


@dataclasses.dataclass(frozen=True)
class PoolSizing:
  """How many pages fit a memory budget (vLLM's way), and why."""

  num_pages: int
  bytes_per_page: int
  budget_bytes: int
  utilization: float

  def __str__(self) -> str:
    gib = 1024 ** 3
    return (f"KV pool: {self.num_pages} pages x {self.bytes_per_page / 1024:.1f} KiB "
            f"(K+V, all layers) = {self.num_pages * self.bytes_per_page / gib:.2f} GiB "
            f"of {self.budget_bytes / gib:.2f} GiB available x {self.utilization:.0%}")


def size_pool(*, num_layers: int, num_kv_heads: int, head_dim: int, page_size: int,
              dtype=jnp.bfloat16, available_bytes: int | None = None,
              utilization: float = 0.9, device: jax.Device | None = None) -> PoolSizing:
  """Sizes `num_pages` from a memory budget: available x utilization / bytes of one page.

  One page holds `page_size` tokens of K and V for every layer and kv head, and for an int8
  / float8_e4m3fn pool their float32 scales (one per token per kv head), so a quantized
  pool holds (2 * D) / (D + 4) times the tokens of a bf16 one in the same budget (1.88x at
  D = 64). An int8 / float8 pool whose K (and V) array would hold 2**31 to 2**32 values
  gets just under 2**31 instead (`kv_quant.kernel_addressable`: jax's Pallas-Triton
  kernels cannot address that window). With `available_bytes=None` the budget is the
  device's free memory (bytes_limit - bytes_in_use from `memory_stats()`), which only
  accelerators report; on CPU pass it explicitly.
  """
  dtype = validation.check_cache_dtype("dtype", dtype)
  if not 0.0 < utilization <= 1.0:
    raise ValueError(f"utilization must be in (0, 1], got {utilization}")
  if available_bytes is None:
    device = device or jax.devices()[0]
    stats = device.memory_stats() if hasattr(device, "memory_stats") else None
    if not stats or "bytes_limit" not in stats:
      raise ValueError(f"device {device} reports no memory stats: pass available_bytes")
    available_bytes = stats["bytes_limit"] - stats.get("bytes_in_use", 0)
  bytes_per_page = (2 * num_layers * num_kv_heads * page_size
                    * kv_quant.bytes_per_head_token(head_dim, dtype))
  num_pages = int(available_bytes * utilization) // bytes_per_page
  # Below the window of page-array sizes that compiled kernels cannot address (1-byte
  # pools of 2-4 GiB per K / V array: `kv_quant.kernel_addressable`).
  num_pages = kv_quant.max_addressable_pages(
      num_layers * num_kv_heads * page_size * head_dim, dtype, num_pages)
  if num_pages < 1:
    raise ValueError(f"available_bytes={available_bytes} x utilization={utilization} holds no "
                     f"page of {bytes_per_page} bytes")
  return PoolSizing(num_pages=num_pages, bytes_per_page=bytes_per_page,
                    budget_bytes=int(available_bytes), utilization=utilization)


def _check_seq_ids(pool: KVPool, seq_ids) -> tuple[jax.Array, np.ndarray | None]:
  """(int32 seq_ids, their values where known when tracing); raises for bad shapes and
  dtypes, and for known ids out of range or repeated."""
  # Before jnp.asarray, which traces even numpy ids under jit.
  ids = validation.concrete(seq_ids)
  seq_ids = jnp.asarray(seq_ids)
  if seq_ids.ndim != 1 or not jnp.issubdtype(seq_ids.dtype, jnp.integer):
    raise ValueError(f"seq_ids must be a 1-D integer array, got shape {seq_ids.shape} "
                     f"dtype {seq_ids.dtype}")
  if ids is not None:
    if ids.size and (ids.min() < 0 or ids.max() >= pool.max_seqs):
      raise ValueError(f"seq_ids must be in [0, max_seqs={pool.max_seqs}), got {ids.tolist()}")
    if len(np.unique(ids)) != ids.size:
      raise ValueError(f"seq_ids must be distinct, got {ids.tolist()}")
  return seq_ids.astype(jnp.int32), ids


def _first_valid_occurrence(pool: KVPool, seq_ids: jax.Array) -> jax.Array:
  """bool [n]: id in range and not repeating an earlier id (the in-jit guard against
  double allocation or double free, where raising is impossible)."""
  n = seq_ids.shape[0]
  earlier = jnp.tril(seq_ids[:, None] == seq_ids[None, :], k=-1).any(axis=1)
  return (seq_ids >= 0) & (seq_ids < pool.max_seqs) & ~earlier if n else jnp.zeros(0, bool)


def reserve(pool: KVPool, seq_ids, num_new_tokens, *, max_new_tokens: int | None = None,
            interpret: bool | None = None, branch_free: bool = False
            ) -> tuple[KVPool, jax.Array, jax.Array]:
  """Makes room for `num_new_tokens` more tokens of each listed sequence.

  Sequences are served in the order given. One that does not fit (not enough free pages,
  more than `max_pages_per_seq` pages, more than `max_new_tokens` tokens, or an invalid or
  repeated id under jit) is left unchanged with `ok[i] = False`; later ones may succeed.

  Args:
    pool: the pool.
    seq_ids: int [n] distinct sequence ids in [0, max_seqs).
    num_new_tokens: a non-negative int, or int [n] per sequence (bool [n]: 0 or 1, e.g. a
      decode step's active rows).
    max_new_tokens: the width of `slots`. Defaults to max(num_new_tokens), which must then
      be known outside of tracing (a Python int or a concrete array).
    interpret: None = on a GPU, one Pallas-Triton kernel where max_new_tokens is 1 (a
      decode step; `jax_paged.decode_reserve`), XLA otherwise and elsewhere; True = that
      kernel in Pallas interpret mode (tests); False = the kernel.
    branch_free: (XLA path) serve without XLA conditionals, each a device-to-host round
      trip (tens of µs inside a device loop): in order by a prefix sum (a sequence that
      does not fit fails with every later one that needs pages), and a sequence whose
      first new token falls in a shared, partly filled page is not served (no
      copy-on-write). For callers whose sequences own their last page and fit (the
      drafts of a speculative round, after its first token's reservation).

  Returns:
    (pool, slots, ok): the new pool with pages allocated and `lengths` advanced; int32
    slots [n, max_new_tokens] where row i holds the flat slots (page * page_size + offset)
    of sequence i's new tokens in order and -1 elsewhere (the whole row when not ok); and
    bool ok [n].
  """
  seq_ids, concrete_ids = _check_seq_ids(pool, seq_ids)
  n = seq_ids.shape[0]
  counts = jnp.asarray(num_new_tokens)
  if counts.shape not in ((), (n,)) or not (jnp.issubdtype(counts.dtype, jnp.integer)
                                           or counts.dtype == jnp.bool_):
    raise ValueError(f"num_new_tokens must be an int or an int (or bool: 0 / 1) array of "
                     f"shape [{n}], got shape {counts.shape} dtype {counts.dtype}")
  concrete_counts = validation.concrete(num_new_tokens)
  counts = jnp.broadcast_to(counts, (n,))
  if concrete_counts is not None:
    concrete_counts = np.broadcast_to(concrete_counts, (n,))
  if concrete_counts is not None and concrete_counts.size and concrete_counts.min() < 0:
    raise ValueError(f"num_new_tokens must be >= 0, got {concrete_counts.tolist()}")
  if max_new_tokens is None:
    if concrete_counts is None:
      raise ValueError("num_new_tokens is traced: pass a static max_new_tokens for the width "
                       "of slots")
    max_new_tokens = int(concrete_counts.max()) if n else 0
  mode = triton_backend.kernel_mode(interpret)
  if mode is None or max_new_tokens != 1 or not n or branch_free:
    return _reserve_xla(pool, seq_ids, counts, max_new_tokens, branch_free)
  # The kernel needs the ids distinct and in range: concrete ones were checked above;
  # traced ones that repeat an earlier id or are out of range become max_seqs (not served,
  # as on the XLA path). Traced ids take the kernel too: the XLA path's copy-on-write
  # branch (`lax.cond`) waits for the device to decide, every call.
  if concrete_ids is None:
    kernel_ids = jnp.where(_first_valid_occurrence(pool, seq_ids), seq_ids, pool.max_seqs)
  else:
    kernel_ids = None if np.array_equal(concrete_ids, np.arange(n)) else seq_ids
  page_arrays = pool.page_arrays()
  page_table, lengths, num_free, refcounts, pages, slots, ok = (
      decode_reserve.reserve_one_pallas(
          pool.page_table, pool.lengths, pool.free_pages, pool.num_free, pool.refcounts,
          tuple(page_arrays.values()), kernel_ids, counts, page_size=pool.page_size,
          interpret=mode))
  return pool.replace(page_table=page_table, lengths=lengths, num_free=num_free,
                      refcounts=refcounts, **dict(zip(page_arrays, pages))), slots, ok


def _reserve_xla(pool: KVPool, seq_ids: jax.Array, counts: jax.Array, max_new_tokens: int,
                 branch_free: bool = False) -> tuple[KVPool, jax.Array, jax.Array]:
  """`reserve` in plain XLA: seq_ids int32 [n], counts int or bool [n], any
  max_new_tokens; `branch_free` as `reserve`'s."""
  ps = pool.page_size
  counts = counts.astype(jnp.int32)

  valid = _first_valid_occurrence(pool, seq_ids)
  safe_ids = jnp.where(valid, seq_ids, 0)
  old_len = jnp.where(valid, pool.lengths[safe_ids], 0)
  new_len = old_len + counts
  have = (old_len + ps - 1) // ps
  need = (new_len + ps - 1) // ps - have
  valid &= (counts >= 0) & (counts <= max_new_tokens)
  valid &= (new_len + ps - 1) // ps <= pool.max_pages_per_seq
  # A first new token inside a partly filled page that other references share: served
  # after the others (copy-on-write, `_serve_shared`).
  current = pool.page_table[safe_ids, jnp.clip(old_len // ps, 0, pool.max_pages_per_seq - 1)]
  shared = valid & (counts > 0) & (old_len % ps != 0) & (
      pool.refcounts[jnp.clip(current, 0, pool.num_pages - 1)] > 1)
  plain = valid & ~shared

  # Greedy in order: sequence i fits if its pages fit in what earlier successes left.
  # Walking that in order is a scan of n tiny steps (~5 us each on a GPU), so it is
  # avoided where a prefix sum gives the same answer: when every need is 0 or 1 (one new
  # token, known statically: no device-to-host branch in a decode step), a request fails
  # exactly when the earlier successes already took every free page; when every valid
  # request fits, all succeed. Only otherwise is the scan walked. The page moves below
  # are vectorised.
  def admit(free, x):
    need_i, valid_i = x
    ok_i = valid_i & (need_i <= free)
    taken = jnp.where(ok_i, need_i, 0)
    return free - taken, (ok_i, free)

  def prefix_sum(need, valid):
    wanted = jnp.where(valid, need, 0)
    ok = valid & ((need == 0) | (jnp.cumsum(wanted) <= pool.num_free))
    taken = jnp.where(ok, need, 0)
    return pool.num_free - jnp.sum(taken), (ok, pool.num_free - jnp.cumsum(taken) + taken)

  def in_order(need, valid):
    return jax.lax.scan(admit, pool.num_free, (need, valid))

  if branch_free:  # (shared sequences are not served: no copies)
    num_free, (ok, free_before) = prefix_sum(need, plain)
    refcounts, copy = pool.refcounts, jnp.zeros_like(ok)
  else:
    if max_new_tokens <= 1:
      num_free, (ok, free_before) = prefix_sum(need, plain)
    else:
      total = jnp.sum(jnp.where(plain, need, 0))
      num_free, (ok, free_before) = jax.lax.cond(total <= pool.num_free, prefix_sum,
                                                 in_order, need, plain)
    # Rare (only forks share a partly filled page): a device-to-host branch only then.
    num_free, refcounts, ok_shared, copy, free_before_shared = jax.lax.cond(
        jnp.any(shared), _serve_shared, _no_shared, num_free, pool.refcounts, shared, need,
        current)
    ok |= ok_shared
    free_before = jnp.where(shared, free_before_shared, free_before)
  # The pages sequence i takes: its copy of the shared page first (replacing it in its
  # row), then its new pages; popped from free_pages[free_before - taken : free_before].
  taken = jnp.where(ok, need + copy, 0)
  first = have - copy

  max_need = -(-max_new_tokens // ps) + 1  # a span of t tokens touches at most this many pages
  j = jnp.arange(max_need)
  take = j[None, :] < taken[:, None]
  popped = pool.free_pages[jnp.clip(free_before[:, None] - 1 - j[None, :], 0, pool.num_pages - 1)]
  rows = jnp.where(take, safe_ids[:, None], pool.max_seqs)  # out of range -> dropped
  page_table = pool.page_table.at[rows, first[:, None] + j[None, :]].set(popped, mode="drop")
  refcounts = refcounts.at[jnp.where(take, popped, pool.num_pages)].set(1, mode="drop")

  lengths = pool.lengths.at[jnp.where(ok, seq_ids, pool.max_seqs)].set(new_len, mode="drop")

  t = jnp.arange(max_new_tokens)
  pos = old_len[:, None] + t[None, :]
  page_idx = jnp.clip(pos // ps, 0, pool.max_pages_per_seq - 1)
  slot = page_table[safe_ids[:, None], page_idx] * ps + pos % ps
  slots = jnp.where(ok[:, None] & (t[None, :] < counts[:, None]), slot, -1).astype(jnp.int32)

  new_pool = pool.replace(page_table=page_table, lengths=lengths, num_free=num_free,
                          refcounts=refcounts)
  if not branch_free:
    new_pool = jax.lax.cond(jnp.any(copy), copy_pages, lambda p, src, dst: p, new_pool,
                            current, jnp.where(copy, popped[:, 0], -1))
  return new_pool, slots, ok


def _serve_shared(num_free, refcounts, shared, need, current):
  """The sequences whose first new token falls in a shared, partly filled page, in order
  after the others: one that is not that page's last reference needs one more page, a
  copy of it to write into, and drops its reference; the last one writes in place.

  Returns (num_free, refcounts, ok [n], copy [n] (bool), free_before [n]).
  """
  def serve(carry, x):
    free, refcounts = carry
    shared_i, need_i, page_i = x
    copy_i = shared_i & (refcounts[page_i] > 1)
    ok_i = shared_i & (need_i + copy_i <= free)
    copy_i &= ok_i
    refcounts = refcounts.at[page_i].add(-copy_i.astype(jnp.int32))
    return (free - jnp.where(ok_i, need_i + copy_i, 0), refcounts), (ok_i, copy_i, free)

  (num_free, refcounts), (ok, copy, free_before) = jax.lax.scan(
      serve, (num_free, refcounts), (shared, need, current))
  return num_free, refcounts, ok, copy, free_before


def _no_shared(num_free, refcounts, shared, need, current):
  del need, current
  no = jnp.zeros_like(shared)
  return num_free, refcounts, no, no, jnp.zeros(shared.shape, jnp.int32)


def copy_pages(pool: KVPool, src, dst, *, interpret: bool | None = None) -> KVPool:
  """Copies the K/V of pages `src[i]` to pages `dst[i]` in every layer and kv head, with a
  quantized pool's scales (`KVPool.page_arrays`).

  Args:
    pool: the pool.
    src, dst: int32 [n] page ids; a negative dst is skipped (no copy). The dst pages are
      distinct and none of them a src (fresh pages).
    interpret: None = on a GPU one Pallas-Triton kernel moving only the copied pages
      (`jax_paged.kernels.page_copy`), XLA's gather and scatter of every listed page
      elsewhere; True = that kernel in interpret mode (tests); False = the kernel.

  Returns:
    The pool with the copies made; nothing else changes (the caller owns the page table
    and the reference counts).
  """
  src, dst = jnp.asarray(src, jnp.int32), jnp.asarray(dst, jnp.int32)
  dst = jnp.where((dst < 0) | (dst >= pool.num_pages), -1, dst)
  src = jnp.clip(src, 0, pool.num_pages - 1)
  mode = triton_backend.kernel_mode(interpret, supported=src.shape[0] > 0)
  if mode is not None:
    arrays = pool.page_arrays()
    copied = page_copy.copy_pages_pallas(tuple(arrays.values()), src, dst, interpret=mode)
    return pool.replace(**dict(zip(arrays, copied)))
  dst = jnp.where(dst < 0, pool.num_pages, dst)  # out of range -> dropped

  return pool.replace(**{name: array.at[:, :, dst].set(array[:, :, src], mode="drop")
                         for name, array in pool.page_arrays().items()})


def _drop_references(pool: KVPool, pages: jax.Array, counted: jax.Array) -> KVPool:
  """Drops one reference per `counted` entry of `pages` (any shape); pages whose count
  reaches zero go back onto the free stack, each once, in the order they first appear.
  A pool left with every page free gets its new pool's stack back, so that the same
  requests on an emptied pool take the same pages (an engine's runs then plan alike)."""
  pages = pages.reshape(-1)
  counted = counted.reshape(-1) & (pages >= 0) & (pages < pool.num_pages)
  target = jnp.where(counted, pages, pool.num_pages)  # out of range -> dropped
  refcounts = pool.refcounts.at[target].add(-1, mode="drop")
  # The first counted occurrence of each page pushes it (a page shared by two released
  # sequences is freed once).
  index = jnp.arange(pages.shape[0], dtype=jnp.int32)
  first_at = jnp.full((pool.num_pages,), pages.shape[0], jnp.int32).at[target].min(
      index, mode="drop")
  safe = jnp.clip(pages, 0, pool.num_pages - 1)
  freed = counted & (first_at[safe] == index) & (refcounts[safe] == 0)
  dest = jnp.where(freed, pool.num_free + jnp.cumsum(freed) - 1, pool.num_pages)
  free_pages = pool.free_pages.at[dest].set(pages, mode="drop")
  num_free = pool.num_free + jnp.sum(freed)
  free_pages = jnp.where(num_free == pool.num_pages, _initial_free_pages(pool.num_pages),
                         free_pages)
  return pool.replace(refcounts=refcounts, free_pages=free_pages, num_free=num_free)


def _initial_free_pages(num_pages: int) -> jax.Array:
  """A new pool's free stack: reversed, so that pops hand out pages 0, 1, 2, ... in
  order."""
  return jnp.arange(num_pages - 1, -1, -1, dtype=jnp.int32)


def _empty_bookkeeping(num_pages: int, max_seqs: int, max_pages_per_seq: int
                       ) -> dict[str, jax.Array]:
  """A new pool's page table, lengths, free stack, free count and reference counts."""
  return dict(page_table=jnp.zeros((max_seqs, max_pages_per_seq), jnp.int32),
              lengths=jnp.zeros((max_seqs,), jnp.int32),
              free_pages=_initial_free_pages(num_pages),
              num_free=jnp.asarray(num_pages, jnp.int32),
              refcounts=jnp.zeros((num_pages,), jnp.int32))


def clear(pool: KVPool) -> KVPool:
  """Every sequence emptied and every page freed, holds included: the pool as `create`
  made it. The K/V pages keep their contents (no page is read before it is written
  again), so no buffer is reallocated."""
  return pool.replace(**_empty_bookkeeping(pool.num_pages, pool.max_seqs,
                                           pool.max_pages_per_seq))


def release(pool: KVPool, seq_ids) -> KVPool:
  """Drops the listed sequences' references to their pages and sets their lengths to 0.

  A page goes back to the free stack when its last reference goes: pages another
  sequence shares, or that a hold keeps (`retain_pages`), stay. Under jit, out-of-range
  or repeated ids are ignored (so a reference is never dropped twice).
  """
  seq_ids, _ = _check_seq_ids(pool, seq_ids)
  return _release(pool, seq_ids, _first_valid_occurrence(pool, seq_ids))


def _release(pool: KVPool, seq_ids: jax.Array, valid: jax.Array) -> KVPool:
  """`release` of the `valid` entries of seq_ids (distinct, in range)."""
  safe_ids = jnp.where(valid, seq_ids, 0)
  count = jnp.where(valid, pool.pages_used()[safe_ids], 0)
  j = jnp.arange(pool.max_pages_per_seq)
  pool = _drop_references(pool, pool.page_table[safe_ids], j[None, :] < count[:, None])
  lengths = pool.lengths.at[jnp.where(valid, seq_ids, pool.max_seqs)].set(0, mode="drop")
  return pool.replace(lengths=lengths)


def _check_num_tokens(num_tokens, n: int) -> tuple[jax.Array, np.ndarray | None]:
  """(int32 num_tokens, their values where known when tracing); raises unless an int
  array of shape [n], one per sequence."""
  known = validation.concrete(num_tokens)
  num_tokens = jnp.asarray(num_tokens)
  if num_tokens.shape != (n,) or not jnp.issubdtype(num_tokens.dtype, jnp.integer):
    raise ValueError(f"num_tokens must be an int array of shape [{n}] (one per sequence), "
                     f"got shape {num_tokens.shape} dtype {num_tokens.dtype}")
  return num_tokens.astype(jnp.int32), known


def truncate(pool: KVPool, seq_ids, num_tokens) -> tuple[KVPool, jax.Array]:
  """Shortens sequences to their first `num_tokens` tokens: speculative decoding's
  rejected drafts, whose K/V a verify step wrote, dropped.

  The references to pages past a sequence's new last page are dropped (a page goes back
  to the free stack at zero, as in `release`); the pages it keeps are not touched (the
  tokens past the new length in its last page are garbage, overwritten by its next
  writes).

  Args:
    pool: the pool.
    seq_ids: int32 [n] distinct ids in [0, max_seqs); under jit, out-of-range (e.g. -1
      padding) or repeated ids are ignored.
    num_tokens: int32 [n], each sequence's new length, at most its length.

  Returns:
    (the pool, bool ok [n]): ok[i] is False for an ignored id and for a num_tokens[i]
    outside [0, length] (that sequence is left as it was).
  """
  seq_ids, _ = _check_seq_ids(pool, seq_ids)
  num_tokens, known = _check_num_tokens(num_tokens, seq_ids.shape[0])
  if known is not None and known.size and known.min() < 0:
    raise ValueError(f"num_tokens must be >= 0, got {known.tolist()}")
  valid = _first_valid_occurrence(pool, seq_ids)
  safe_ids = jnp.where(valid, seq_ids, 0)
  ok = valid & (num_tokens >= 0) & (num_tokens <= pool.lengths[safe_ids])
  keep = pool.pages_used(num_tokens)
  used = pool.pages_used()[safe_ids]
  j = jnp.arange(pool.max_pages_per_seq)
  dropped = ok[:, None] & (j[None, :] >= keep[:, None]) & (j[None, :] < used[:, None])
  pool = _drop_references(pool, pool.page_table[safe_ids], dropped)
  target = jnp.where(ok, seq_ids, pool.max_seqs)  # out of range -> dropped
  return pool.replace(lengths=pool.lengths.at[target].set(num_tokens, mode="drop")), ok


def _check_page_ids(pool: KVPool, page_ids, name: str) -> jax.Array:
  """int32 page ids of any shape; raises for non-integers and, where concrete, for ids
  outside [0, num_pages) (negative = padding where the caller allows it)."""
  known = validation.concrete(page_ids)
  page_ids = jnp.asarray(page_ids)
  if not jnp.issubdtype(page_ids.dtype, jnp.integer):
    raise ValueError(f"{name} must be an integer array, got dtype {page_ids.dtype}")
  if known is not None and known.size and known.max() >= pool.num_pages:
    raise ValueError(f"{name} must be < num_pages = {pool.num_pages} (negative = padding), "
                     f"got {known.max()}")
  return page_ids.astype(jnp.int32)


def retain_pages(pool: KVPool, page_ids) -> KVPool:
  """Places one hold on each listed page (a prefix cache keeping it past its sequences).

  Args:
    pool: the pool.
    page_ids: int32 [n] pages in use (count > 0); negative entries are padding. Under jit,
      ids out of range and free pages are ignored (a free page cannot be held: it may be
      handed out at any time).
  """
  page_ids = _check_page_ids(pool, page_ids, "page_ids")
  known = validation.concrete(page_ids)
  if known is not None:
    counts = np.asarray(pool.refcounts)[known[(known >= 0)]]
    if (counts == 0).any():
      raise ValueError(f"page_ids must be pages in use, got free pages "
                       f"{known[known >= 0][counts == 0].tolist()}")
  safe = jnp.clip(page_ids, 0, pool.num_pages - 1)
  live = (page_ids >= 0) & (page_ids < pool.num_pages) & (pool.refcounts[safe] > 0)
  refcounts = pool.refcounts.at[jnp.where(live, page_ids, pool.num_pages)].add(1, mode="drop")
  return pool.replace(refcounts=refcounts)


def release_pages(pool: KVPool, page_ids) -> KVPool:
  """Drops one hold from each listed page (`retain_pages`' inverse): a page whose count
  reaches zero goes back to the free stack.

  Args:
    pool: the pool.
    page_ids: int32 [n]; negative entries are padding. Under jit, ids out of range and
      pages with no reference are ignored.
  """
  page_ids = _check_page_ids(pool, page_ids, "page_ids")
  safe = jnp.clip(page_ids, 0, pool.num_pages - 1)
  live = (page_ids >= 0) & (page_ids < pool.num_pages) & (pool.refcounts[safe] > 0)
  return _drop_references(pool, page_ids, live)


def fork(pool: KVPool, src_seq, dst_seqs, *, own_last_page: bool = False) -> KVPool:
  """Makes each destination sequence a copy of its source that shares the source's pages.

  No K/V is copied: a destination's page-table row points at its source's pages, whose
  reference counts grow by one per destination, and its length becomes the source's.
  Whoever writes first into a shared, partly filled last page gets a copy of it
  (`reserve`'s copy-on-write), so the sequences diverge without seeing each other's
  tokens. A destination that held tokens drops its own pages (after the new references
  are counted). Sources are read as they were before the call, so a destination may be a
  source too: beams taking over their parents' rows (`jax_paged.serving.beam_search`) are
  one fork of their group's rows onto themselves.

  Args:
    pool: the pool.
    src_seq: int, the source sequence id in [0, max_seqs); or int32 [n], one source per
      destination.
    dst_seqs: int32 [n] distinct ids in [0, max_seqs). Under jit, out-of-range (e.g. -1
      padding) or repeated ids are ignored.
    own_last_page: give each destination whose source's last page is partly filled its
      own copy of that page now, all in one vectorised copy, rather than at its next write
      (`reserve`'s copy-on-write walks shared pages one sequence at a time: a fork of
      many rows then costs a serial copy per row). One sharer per page keeps it: the
      source, or when the source is itself a destination (its own row reassigned), the
      first destination of that source. A destination finding no free page for its copy
      shares the page as without the flag.
  """
  dst_seqs, _ = _check_seq_ids(pool, dst_seqs)
  n = dst_seqs.shape[0]
  known_src = validation.concrete(src_seq)
  src = jnp.asarray(src_seq)
  if src.shape not in ((), (n,)) or not jnp.issubdtype(src.dtype, jnp.integer):
    raise ValueError(f"src_seq must be an int or an int array of shape [{n}] (one per "
                     f"destination), got shape {src.shape} dtype {src.dtype}")
  if known_src is not None and known_src.size and (
      known_src.min() < 0 or known_src.max() >= pool.max_seqs):
    raise ValueError(f"src_seq must be sequence ids in [0, max_seqs={pool.max_seqs}), got "
                     f"{np.ravel(known_src).tolist()}")
  src = jnp.clip(jnp.broadcast_to(src, (n,)).astype(jnp.int32), 0, pool.max_seqs - 1)
  valid = _first_valid_occurrence(pool, dst_seqs)
  safe_dst = jnp.where(valid, dst_seqs, 0)
  rows = pool.page_table[src]  # the destinations' new rows
  lengths = pool.lengths[src]
  used = pool.pages_used(lengths)
  j = jnp.arange(pool.max_pages_per_seq)
  num_free = pool.num_free
  if own_last_page:
    last = jnp.clip(used - 1, 0, pool.max_pages_per_seq - 1)
    same_src = (src[:, None] == src[None, :]) & valid[None, :]
    is_first = ~jnp.tril(same_src, k=-1).any(axis=1)
    reassigned = ((src[:, None] == dst_seqs[None, :]) & valid[None, :]).any(axis=1)
    copy = valid & (lengths % pool.page_size != 0) & ~(reassigned & is_first)
    rank = jnp.cumsum(copy)
    copy &= rank <= num_free
    fresh = pool.free_pages[jnp.clip(num_free - rank, 0, pool.num_pages - 1)]
    pool = copy_pages(pool, rows[jnp.arange(n), last], jnp.where(copy, fresh, -1))
    rows = jnp.where(copy[:, None] & (j[None, :] == last[:, None]), fresh[:, None], rows)
    num_free = num_free - jnp.sum(copy)
  # New references first, then the destinations' old ones dropped: a page a destination
  # keeps (its own, or its source's) never reaches zero in between.
  counted = valid[:, None] & (j[None, :] < used[:, None])
  refcounts = pool.refcounts.at[jnp.where(counted, rows, pool.num_pages)].add(1, mode="drop")
  old_used = jnp.where(valid, pool.pages_used()[safe_dst], 0)
  pool = _drop_references(pool.replace(refcounts=refcounts, num_free=num_free),
                          pool.page_table[safe_dst], j[None, :] < old_used[:, None])
  target = jnp.where(valid, dst_seqs, pool.max_seqs)  # out of range -> dropped
  return pool.replace(page_table=pool.page_table.at[target].set(rows, mode="drop"),
                      lengths=pool.lengths.at[target].set(lengths, mode="drop"))


def attach(pool: KVPool, seq_ids, page_ids, num_tokens) -> KVPool:
  """Starts empty sequences on existing pages: a prefix cache hit.

  Sequence seq_ids[i] gets page_ids[i, :k] as its first k pages (k = ceil(num_tokens[i] /
  page_size)), one more reference on each, and length num_tokens[i]; its next tokens
  go after them (into fresh pages when num_tokens[i] is a whole number of pages, else
  into a copy of the last one: `reserve`'s copy-on-write).

  Args:
    pool: the pool.
    seq_ids: int32 [n] distinct ids in [0, max_seqs) (a sequence holding tokens drops
      them first, as in `fork`). Under jit, out-of-range (e.g. -1 padding) or repeated
      ids are ignored.
    page_ids: int32 [n, m] pages in use (count > 0), m <= max_pages_per_seq.
    num_tokens: int32 [n] in [0, m * page_size].
  """
  seq_ids, _ = _check_seq_ids(pool, seq_ids)
  page_ids = _check_page_ids(pool, page_ids, "page_ids")
  n = seq_ids.shape[0]
  if page_ids.ndim != 2 or page_ids.shape[0] != n or page_ids.shape[1] > pool.max_pages_per_seq:
    raise ValueError(f"page_ids must have shape [{n}, m] with m <= max_pages_per_seq = "
                     f"{pool.max_pages_per_seq}, got {tuple(page_ids.shape)}")
  m = page_ids.shape[1]
  num_tokens, known = _check_num_tokens(num_tokens, n)
  if known is not None and known.size and (known.min() < 0 or known.max() > m * pool.page_size):
    raise ValueError(f"num_tokens must be in [0, {m * pool.page_size}] (the pages given), "
                     f"got {known.tolist()}")
  num_tokens = jnp.clip(num_tokens, 0, m * pool.page_size)
  valid = _first_valid_occurrence(pool, seq_ids)
  pool = _release(pool, seq_ids, valid)
  k = (num_tokens + pool.page_size - 1) // pool.page_size
  use = valid[:, None] & (jnp.arange(m)[None, :] < k[:, None])
  safe = jnp.clip(page_ids, 0, pool.num_pages - 1)
  use &= (page_ids >= 0) & (pool.refcounts[safe] > 0)
  # A row whose pages are not all in use gets nothing (its length stays 0).
  whole = jnp.all(use | (jnp.arange(m)[None, :] >= k[:, None]), axis=1) & valid
  use &= whole[:, None]
  rows = jnp.where(use, seq_ids[:, None], pool.max_seqs)
  page_table = pool.page_table.at[rows, jnp.arange(m)[None, :]].set(page_ids, mode="drop")
  refcounts = pool.refcounts.at[jnp.where(use, page_ids, pool.num_pages)].add(1, mode="drop")
  lengths = pool.lengths.at[jnp.where(whole, seq_ids, pool.max_seqs)].set(num_tokens,
                                                                          mode="drop")
  return pool.replace(page_table=page_table, refcounts=refcounts, lengths=lengths)


def check_write(pool: KVPool, layer, slots: jax.Array) -> None:
  """Raises ValueError for slots that are not integers, and, where they are concrete
  (outside jit), for slots past the pool or a layer outside [0, num_layers): the checks of
  `write_kv`, for a kernel that writes the pool itself (`nn.PagedAttention.decode`)."""
  if not jnp.issubdtype(slots.dtype, jnp.integer):
    raise ValueError(f"slots must be an integer array, got dtype {slots.dtype}")
  total = pool.num_pages * pool.page_size
  concrete_slots = validation.concrete(slots)
  if concrete_slots is not None and concrete_slots.size and concrete_slots.max() >= total:
    raise ValueError(f"slots must be < num_pages * page_size = {total} (negative = padding), "
                     f"got max {concrete_slots.max()}")
  concrete_layer = validation.concrete(layer)
  if concrete_layer is not None and not 0 <= int(concrete_layer) < pool.num_layers:
    raise ValueError(f"layer must be in [0, {pool.num_layers}), got {int(concrete_layer)}")


def write_kv(pool: KVPool, layer, slots, k: jax.Array, v: jax.Array, *,
             interpret: bool | None = None) -> KVPool:
  """Scatters new tokens' K/V into one layer's pages (vLLM's reshape_and_cache).

  On a GPU this is one Pallas-Triton kernel writing K and V in place
  (`jax_paged.cache_write`); elsewhere two XLA scatters.

  A quantized pool (int8 / float8_e4m3fn) stores each token's K and V of each kv head
  quantized with its own scale (`kv_quant.quantize`, in the kernel on a GPU), and the
  scale at the same slot of `k_scales` / `v_scales`: old tokens are never rescaled.

  Args:
    pool: the pool.
    layer: int (or int32 scalar under jit), the layer index.
    slots: int32 [...] flat slots from `reserve`; negative slots are padding, never written
      (neither their values nor their scales).
    k, v: [..., num_kv_heads, head_dim] (= slots.shape + (Hkv, D)) floats, cast to the
      pool's dtype (quantized for int8 / float8 pools).
    interpret: None = the kernel on a GPU, XLA scatters elsewhere; True = the kernel in
      Pallas interpret mode (tests); False = the kernel.

  Returns:
    The pool with the tokens written. Slots outside [0, num_pages * page_size) and a layer
    outside [0, num_layers) are dropped under jit and raise ValueError when concrete.
  """
  slots = jnp.asarray(slots)
  expected = tuple(slots.shape) + (pool.num_kv_heads, pool.head_dim)
  for name, x in (("k", k), ("v", v)):
    if tuple(x.shape) != expected:
      raise ValueError(f"{name} must have shape slots.shape + (num_kv_heads, head_dim) = "
                       f"{expected}, got {tuple(x.shape)}")
  check_write(pool, layer, slots)
  total = pool.num_pages * pool.page_size
  concrete_layer = validation.concrete(layer)
  flat = slots.reshape(-1).astype(jnp.int32)
  # [N, Hkv, D]: in the pool's dtype, or floats that a quantized pool's write quantizes.
  k, v = (x.reshape(-1, pool.num_kv_heads, pool.head_dim) for x in (k, v))
  if not pool.quantized:
    k, v = k.astype(pool.dtype), v.astype(pool.dtype)
  mode = triton_backend.kernel_mode(interpret)
  if mode is not None:
    if flat.size == 0:
      return pool
    if not mode:
      kv_quant.check_compiled(pool.k_pages, "the pool's")
    return _replace_kv(pool, cache_write.write_kv_pallas(
        pool.k_pages, pool.v_pages, jnp.asarray(layer, jnp.int32), flat, k, v, interpret=mode,
        k_scales=pool.k_scales, v_scales=pool.v_scales))
  # Negative indices would wrap: send them (and a traced layer out of range) out of range.
  flat = jnp.where(flat < 0, total, flat)
  if concrete_layer is None:  # traced (a concrete layer was range-checked above)
    layer = jnp.where(layer < 0, pool.num_layers, layer)

  def scatter(array, x):
    # [L, Hkv, P, page_size, ...] -> [L, Hkv, slots, ...]. Integer indices split by a
    # slice put the indexed axis first: updates are [N, Hkv, ...].
    shape = array.shape
    array = array.reshape(shape[:2] + (total,) + shape[4:])
    return array.at[layer, :, flat].set(x, mode="drop").reshape(shape)

  def scatter_tokens_minor(array, x):
    # [L, Hkv, P, D, page_size]: the slot's page and offset split by the D slice, so
    # updates are again [N, Hkv, D]; a dropped slot's page is out of range.
    return array.at[layer, :, flat // pool.page_size, :, flat % pool.page_size].set(
        x, mode="drop")

  if not pool.quantized:
    return pool.replace(k_pages=scatter(pool.k_pages, k), v_pages=scatter(pool.v_pages, v))
  (k, k_scales), (v, v_scales) = (kv_quant.quantize(x, pool.dtype) for x in (k, v))
  return pool.replace(k_pages=scatter(pool.k_pages, k),
                      v_pages=scatter_tokens_minor(pool.v_pages, v),
                      k_scales=scatter(pool.k_scales, k_scales),
                      v_scales=scatter(pool.v_scales, v_scales))


def _replace_kv(pool: KVPool, arrays: tuple[jax.Array, ...]) -> KVPool:
  """The pool with a write kernel's outputs: (k_pages, v_pages[, k_scales, v_scales])."""
  return pool.replace(**dict(zip(("k_pages", "v_pages", "k_scales", "v_scales"), arrays)))


def project_write_kv(pool: KVPool, layer, slots, x: jax.Array, kernel: jax.Array,
                     bias: jax.Array | None, *, q_width: int, interpret: bool | None = None,
                     scale: jax.Array | None = None, transposed: bool = False
                     ) -> tuple[jax.Array, KVPool]:
  """A fused q/k/v projection whose K/V columns go into one layer's pages, returning q.

  y = x @ kernel (* scale) + bias is split into q [N, q_width], then K and V [N, Hkv * D] (each
  head-major), and K/V are written at `slots` as `write_kv` writes them. On a GPU, at
  decode's few rows, one kernel computes the projection and stores K and V straight into
  the pages (`cache_write.project_write_kv_pallas`: they never round-trip through HBM as
  arrays; a quantized pool's K/V are quantized in its epilogue where a head is exactly one
  column block, head_dim 64 or 32); elsewhere `linear.linear` and then `write_kv`.

  Args:
    pool: the pool.
    layer: int (or int32 scalar under jit), the layer index.
    slots: int32 [N] flat slots from `reserve`; negative = padding, never written.
    x: [N, in_features] f32 / bf16 / f16.
    kernel: [in_features, q_width + 2 * Hkv * D] in x's dtype, or int8 with `scale` (its
      f32 per-column scales, `jax_paged.weight_quant`); bias: its [columns] or None.
    q_width: q's columns.
    interpret: None = the kernel on a GPU where it takes the shapes, XLA elsewhere; True =
      the kernel in Pallas interpret mode (tests).
    scale: float32 [columns] for an int8 kernel, else None.
    transposed: the kernel is stored [columns, in_features] (`linear.linear`'s).

  Returns:
    (q [N, q_width] in x's dtype, the pool with the tokens' K/V written).
  """
  slots = jnp.asarray(slots)
  kv_width = pool.num_kv_heads * pool.head_dim
  if x.ndim != 2 or slots.shape != x.shape[:1]:
    raise ValueError(f"x must have shape [N, in_features] with N = len(slots), got x "
                     f"{tuple(x.shape)} and slots {tuple(slots.shape)}")
  if kernel.ndim != 2 or linear.columns(kernel, transposed) != q_width + 2 * kv_width:
    raise ValueError(f"kernel must have q_width + 2 * num_kv_heads * head_dim = "
                     f"{q_width + 2 * kv_width} columns, got shape {tuple(kernel.shape)}")
  check_write(pool, layer, slots)
  fused = linear.takes(x, kernel) and cache_write.can_project_write(
      x.shape[0], pool.head_dim, pool.num_layers, quantized=pool.quantized)
  mode = triton_backend.kernel_mode(interpret, supported=fused)
  if mode is None:
    q, k, v = linear.linear(x, kernel, bias, sections=(q_width, kv_width, kv_width),
                            interpret=interpret, scale=scale, transposed=transposed)
    heads = (x.shape[0], pool.num_kv_heads, pool.head_dim)
    return q, write_kv(pool, layer, slots, k.reshape(heads), v.reshape(heads),
                       interpret=interpret)
  if not mode:
    kv_quant.check_compiled(pool.k_pages, "the pool's")
  q, *arrays = cache_write.project_write_kv_pallas(
      x, kernel, bias, pool.k_pages, pool.v_pages, jnp.asarray(layer, jnp.int32),
      slots.astype(jnp.int32), q_width=q_width, interpret=mode, k_scales=pool.k_scales,
      v_scales=pool.v_scales, w_scale=scale, transposed=transposed)
  return q, _replace_kv(pool, arrays)


def reserve_or_raise(pool: KVPool, seq_ids, num_new_tokens) -> tuple[KVPool, jax.Array]:
  """`reserve` for callers outside jit who prefer an exception to flags.

  Returns (pool, slots); raises `PoolExhausted` naming the sequences that did not fit, in
  which case the input pool is untouched and still valid.
  """
  new_pool, slots, ok = reserve(pool, seq_ids, num_new_tokens)
  ok = np.asarray(ok)
  if not ok.all():
    failed = np.asarray(seq_ids).reshape(-1)[~ok].tolist()
    raise PoolExhausted(
        f"no room for sequences {failed}: {int(pool.num_free)} free pages of "
        f"{pool.page_size} tokens, at most {pool.max_pages_per_seq} pages per sequence")
  return new_pool, slots
