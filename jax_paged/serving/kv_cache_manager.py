"""The host's page accounting of the KV pool and its prefix cache (vLLM v1's KV-cache
manager).

The device pool allocates pages inside jitted calls (`pool.reserve`) and frees them in
`pool.release`; a reservation that does not fit fails there silently (an `ok` flag), so
the scheduler must know *before* it dispatches a call that every reservation in it will
succeed. This manager keeps the exact host mirror: the tokens cached per sequence slot,
the pages each slot's page-table row holds (read back after each call: the device picks
them) and every page's reference count (`KVPool.refcounts`), so that it knows the pages
free and how many a plan needs, copies of shared pages included.

The prefix cache (vLLM's automatic prefix caching): a full page is identified by a hash
chain, the hash of (its parent page's hash, its token ids), so equal prompts' first pages
get equal keys. After a prefill, each full page of the context is registered under its key
and held (`pool.retain_pages`); a new request whose context starts with cached pages is
attached to them (`pool.attach`) and prefills only the rest. A cached page that no
sequence uses is evictable, least recently used first, when a plan needs room
(`pool.release_pages`).
"""

from __future__ import annotations

import collections
from collections.abc import Sequence
import functools
import itertools

import numpy as np

from jax_paged.serving.runner import fill_rows


# A 64-bit polynomial hash chain, vectorised: page j's key is K_j = K_{j-1} * B + h_j
# (mod 2**64), h_j a hash of the page's tokens; so K_j = B**j * sum_{i <= j} h_i * B**-i,
# one cumulative sum (B is odd, so invertible mod 2**64). A Python hash per page cost
# ~40 ms of host time for 256 prompts of 52 pages, paid before their first tokens.
_B = np.uint64(0x9E3779B97F4A7C15)
_B_INV = np.uint64(pow(int(_B), -1, 2 ** 64))
_MIX = np.uint64(0xBF58476D1CE4E5B9)


# Tokens hashed per numpy pass of `page_keys`: its temporaries stay under glibc's 128 KiB
# mmap threshold. Larger ones are mapped and unmapped at every call, and touching their
# fresh pages cost a burst of 256 prompts of 832 tokens 0.9-1.2 ms instead of 0.3 ms on
# the dev CPU (~2 ms on the device's host), before its first tokens.
_KEY_GROUP_TOKENS = 24 * 1024


def page_keys(contexts: Sequence[np.ndarray], page_size: int) -> list[np.ndarray]:
  """The hash-chain keys (uint64 [full pages]) of each context's (int [tokens]) full
  pages (64-bit: equal keys for different contents are possible, with probability
  ~2**-64 per pair). A few numpy passes for all the contexts (per context, its dozen
  small array operations cost ~40 µs of host time), each over a group of contexts of
  about `_KEY_GROUP_TOKENS` tokens."""
  counts = np.array([len(c) // page_size for c in contexts], np.int64)
  ends = np.cumsum(counts) * page_size  # tokens hashed up to each context's end
  keys, i = [], 0
  while i < len(contexts):
    # At least one context per group: one longer than the limit goes alone.
    j = max(i + 1, int(np.searchsorted(ends, (ends[i - 1] if i else 0) + _KEY_GROUP_TOKENS,
                                       side="right")))
    keys += _group_page_keys(contexts[i:j], counts[i:j], page_size)
    i = j
  return keys


def salted_keys(keys: np.ndarray, salt: int) -> np.ndarray:
  """A context's `page_keys` with its chain started from a key of `salt` (> 0) instead of
  0: K_j + S * B**(j + 1). Contexts computed under different LoRA adapters (the salt:
  the adapter's registration) then never share a key, nor K/V."""
  with np.errstate(over="ignore"):
    return keys + np.uint64(salt) * _MIX * _powers(len(keys) + 1)[1][1:len(keys) + 1]


def _group_page_keys(contexts: Sequence[np.ndarray], counts: np.ndarray, page_size: int
                     ) -> list[np.ndarray]:
  """`page_keys` of these contexts, with `counts` full pages each, in one numpy pass."""
  total = int(counts.sum())
  if not total:
    return [np.zeros(0, np.uint64) for _ in contexts]
  pages = np.concatenate([c[:n * page_size] for c, n in zip(contexts, counts.tolist())]
                         ).reshape(total, page_size)
  starts = np.cumsum(counts) - counts  # each context's first page among all pages
  local = np.arange(total) - np.repeat(starts, counts)  # a page's index in its context
  mix, up, down = _powers(max(page_size + 1, int(counts.max())))
  with np.errstate(over="ignore"):
    # Each page's tokens: a polynomial in _MIX with a final avalanche (cast as einsum
    # multiplies: no uint64 copy of the tokens). Its constant term keeps a page of zeros
    # from hashing to 0, which the chain below would skip: [zeros, X] would key X's page
    # as [X] does, and share the K/V X computed at other positions.
    h = np.einsum("ij,j->i", pages, mix[1:page_size + 1], dtype=np.uint64, casting="unsafe")
    h += mix[0]
    h ^= h >> np.uint64(31)
    h *= _B
    # The cumulative sum runs over all the contexts: less the sum before each one's first
    # page (mod 2**64, like the rest) it is that context's own.
    sums = np.cumsum(h * down[local], dtype=np.uint64)
    before = np.where(starts > 0, sums[starts - 1], np.uint64(0))
    keys = up[local] * (sums - np.repeat(before, counts))
  return [keys[a:a + n] for a, n in zip(starts.tolist(), counts.tolist())]


def _first_occurrences(a: np.ndarray) -> np.ndarray:
  """bool [n]: whether a[i] is the first of its value in the 1-D array a."""
  first = np.zeros(a.shape, bool)
  first[np.unique(a, return_index=True)[1]] = True
  return first


@functools.lru_cache(maxsize=4)
def _powers(n: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
  """_MIX ** i, _B ** i and _B_INV ** i for i < n (rounded up to a power of two)."""
  n = 1 << max(0, n - 1).bit_length()
  out = []
  for base in (_MIX, _B, _B_INV):
    p = np.ones(n, np.uint64)
    with np.errstate(over="ignore"):
      for i in range(1, n):
        p[i] = p[i - 1] * base
    out.append(p)
  return tuple(out)


class KVCacheManager:
  """Page accounting for `max_seqs` sequence slots sharing `num_pages` pages (at most
  `max_pages_per_seq` each: the pool's page-table width), with an optional prefix
  cache."""

  def __init__(self, *, num_pages: int, page_size: int, max_seqs: int,
               max_pages_per_seq: int, prefix_caching: bool = False):
    self.num_pages = num_pages
    self.page_size = page_size
    self.prefix_caching = prefix_caching
    self.cached = np.zeros((max_seqs,), np.int64)  # tokens in the pool per slot
    # The mirror of the pool's page-table rows as of the last `sync` (-1 past each row's
    # `row_pages`): one array, so a call's rows are read, diffed and stored at once.
    self.page_rows = np.full((max_seqs, max_pages_per_seq), -1, np.int64)
    self.row_pages = np.zeros((max_seqs,), np.int64)
    self.refs = np.zeros((num_pages,), np.int64)   # the mirror of KVPool.refcounts
    self._in_use = 0                               # pages with refs > 0
    self._cache: dict[int, int] = {}               # key -> page
    self._page_key: dict[int, int] = {}            # page -> key, for held pages
    self._held = np.zeros((num_pages,), bool)      # pages in _page_key
    # Held pages that only the cache references, least recently used first.
    self._evictable: collections.OrderedDict[int, None] = collections.OrderedDict()
    self._grown: set[int] = set()                  # slots whose rows changed in this call
    self._retain: list[int] = []                   # holds the device has not placed yet
    self.reset_counters()

  def reset_counters(self) -> None:
    """Zeroes what a run reports (the manager, its prefix cache included, outlives a
    run: `Engine` keeps one per pool)."""
    # The most pages held at once by sequences (cached, evictable pages excluded). Pages
    # only grow within a device call (finished sequences are released at the next), so
    # the high point is right after a call's growth is recorded.
    self.peak_used_pages = 0
    self.prompt_tokens = 0          # context tokens admitted (prefix cache lookups)
    self.cached_prompt_tokens = 0   # ... of which served from the prefix cache
    self.pages_saved = 0            # pages attached or forked instead of allocated
    self.evicted_pages = 0          # cached pages dropped to make room
    self._live_steps = 0   # sum over decode steps of the live tokens
    self._slot_steps = 0   # ... and of the token slots of the pages held

  def pages(self, tokens):
    """Pages that hold `tokens` tokens (an int or an integer array)."""
    return -(-tokens // self.page_size)

  @property
  def num_used_pages(self) -> int:
    """Pages sequences hold (shared ones once); evictable cached pages are not counted."""
    return self._in_use - len(self._evictable)

  @property
  def num_free_pages(self) -> int:
    """Pages a plan may take: the free ones and the evictable cached ones."""
    return self.num_pages - self.num_used_pages

  @property
  def num_cached_pages(self) -> int:
    return len(self._cache)

  @property
  def efficiency(self) -> float:
    """Live tokens / token slots of the pages held, summed over every decode step recorded
    by `grow_decode` (1.0 before any): the fraction of reserved KV memory holding data
    (above 1 when sequences share pages)."""
    return self._live_steps / self._slot_steps if self._slot_steps else 1.0

  # Reference counts.

  def _add_refs(self, pages, delta: int) -> None:
    """refs[pages] += delta (pages may repeat), keeping `_in_use` and the evictable set."""
    pages = np.asarray(pages, np.int64).reshape(-1)
    if not pages.size:
      return
    unique, counts = np.unique(pages, return_counts=True)
    before = self.refs[unique]
    after = before + delta * counts
    if (after < 0).any():
      raise RuntimeError(f"pages {unique[after < 0].tolist()} lost more references than "
                         "they had: scheduler bug")
    self.refs[unique] = after
    self._in_use += int(((after > 0) & (before == 0)).sum() - ((after == 0) & (before > 0)).sum())
    # A held page is evictable while the hold is its only reference (count 1).
    changed = self._held[unique] & ((before == 1) != (after == 1))
    if changed.any():
      for page in unique[changed & (before == 1)].tolist():
        del self._evictable[page]
      # Most recently used: at the end.
      self._evictable.update(dict.fromkeys(unique[changed & (after == 1)].tolist()))

  def _record_peak(self) -> None:
    self.peak_used_pages = max(self.peak_used_pages, self.num_used_pages)
    if self.num_used_pages > self.num_pages:
      raise RuntimeError(f"{self.num_used_pages} pages in use in a pool of {self.num_pages}: "
                         "scheduler bug")

  # What the scheduler records as it plans and as calls return.

  def lookup(self, keys: Sequence[np.ndarray], context_lengths: Sequence[int]
             ) -> list[np.ndarray]:
    """The cached pages (int64 arrays) each context starts with, given its full pages'
    keys (`page_keys`) and its length: its longest prefix of full pages in the cache,
    leaving at least its last token to compute (its logits give the next token).

    One pass for all the contexts: requests sharing a system prompt repeat its keys, so
    each distinct key is looked up once (per context, the dictionary lookups cost ~12 µs
    of host time for 52 pages, 3 ms for a batch of 256 prompts).
    """
    if not self.prefix_caching or not self._cache:
      return [np.zeros(0, np.int64) for _ in keys]
    counts = np.array([min(len(k), max(n - 1, 0) // self.page_size)
                       for k, n in zip(keys, context_lengths)], np.int64)
    if not counts.sum():
      return [np.zeros(0, np.int64) for _ in keys]
    flat = np.concatenate([k[:n] for k, n in zip(keys, counts.tolist())])
    unique, inverse = np.unique(flat, return_inverse=True)
    found = np.fromiter(map(self._cache.get, unique.tolist(), itertools.repeat(-1)),
                        np.int64, len(unique))
    pages = found[inverse]
    # Each context's hits: its pages up to its first miss.
    starts = np.cumsum(counts) - counts
    position = np.arange(len(flat)) - np.repeat(starts, counts)
    misses = np.where(pages < 0, position, np.repeat(counts, counts))
    hits = np.zeros_like(counts)
    some = counts > 0  # reduceat over the non-empty segments: an empty one would take one
    hits[some] = np.minimum.reduceat(misses, starts[some])
    return [pages[a:a + h] for a, h in zip(starts.tolist(), hits.tolist())]

  def attach(self, contexts: list[tuple[int, np.ndarray, int]]) -> None:
    """Records admissions: for each (slot, pages, context_length), a
    `context_length`-token context in empty `slot`, which starts on the cached `pages`
    (`pool.attach`). (One call for a device call's admissions, in numpy.)"""
    self.prompt_tokens += sum(n for _, _, n in contexts)
    hits = [(slot, pages) for slot, pages, _ in contexts if len(pages)]
    if not hits:
      return
    slots = np.array([slot for slot, _ in hits], np.int64)
    added = fill_rows(self.page_rows, slots, [pages for _, pages in hits])
    self.row_pages[slots] = [len(pages) for _, pages in hits]
    self.cached[slots] = self.row_pages[slots] * self.page_size
    self.cached_prompt_tokens += len(added) * self.page_size
    self.pages_saved += len(added)
    self._add_refs(added, +1)

  def follow(self, followers: list[tuple[int, int]]) -> None:
    """Records, for each (slot, pages), that the empty `slot` starts on the first `pages`
    full pages of another slot's context as a device call computes them (a second-phase
    chunk, `PrefillChunk.follows`): attached on the device, read back by `sync` (the
    chunk's `grow` marks the slot). (One call for a device call's followers, in numpy.)"""
    if not followers:
      return
    slots, pages = np.array(followers, np.int64).T
    self.cached[slots] = pages * self.page_size
    self.cached_prompt_tokens += int(pages.sum()) * self.page_size
    self.pages_saved += int(pages.sum())

  def fork(self, src: int, dsts) -> None:
    """Records that `dsts` became copies of `src` sharing its pages (`pool.fork`, in the
    call just made: the rows are read back by `sync`)."""
    for d in dsts:
      self.cached[d] = self.cached[src]
      self._grown.add(d)
      self.pages_saved += int(self.pages(self.cached[src]))

  def grow(self, slots, tokens) -> None:
    """Records `tokens[i]` more tokens cached for `slots[i]` (what one device call
    reserved)."""
    np.add.at(self.cached, np.asarray(slots, np.int64), np.asarray(tokens, np.int64))
    self._grown.update(int(s) for s in slots)

  def grow_decode(self, slots, produced) -> None:
    """Records a decode call in which `slots[i]` cached `produced[i]` tokens, one per step,
    and what each of its steps held: every slot of the call keeps its pages until the call
    returns, a finished one too (as the device holds them), so the efficiency and the peak
    do not depend on how many steps a call runs."""
    cached = self.cached[np.asarray(slots, np.int64)]
    produced = np.asarray(produced, np.int64)
    if produced.size:
      held = cached + np.minimum(np.arange(1, produced.max() + 1)[:, None], produced)
      new_pages = (self.pages(held) - self.pages(cached)).sum(axis=1)
      self._live_steps += int(held.sum())
      self._slot_steps += int((self.num_used_pages + new_pages).sum()) * self.page_size
    self.grow(slots, produced)

  def sync(self, page_table: np.ndarray, num_free: int) -> None:
    """Takes the device's page-table rows of the slots that grew in the call just made,
    and checks that the pool's free pages are what the accounting says.

    Raises:
      RuntimeError: they differ (a reservation failed on device: a scheduler bug).
    """
    if self._grown:
      slots = np.fromiter(sorted(self._grown), np.int64, len(self._grown))
      self._grown.clear()
      n_new, n_old = self.pages(self.cached[slots]), self.row_pages[slots]
      width = int(max(n_new.max(), n_old.max()))
      j = np.arange(width)[None, :]
      in_new, in_old = j < n_new[:, None], j < n_old[:, None]
      new = np.where(in_new, np.asarray(page_table)[slots, :width], -1).astype(np.int64)
      old = self.page_rows[slots, :width]
      # Rows grow at their end (and a copy-on-write replaces the last page): only the
      # entries from the first difference on change references.
      differ = new != old
      first = np.where(differ.any(axis=1), differ.argmax(axis=1), width)[:, None]
      self._add_refs(new[in_new & (j >= first)], +1)
      self._add_refs(old[in_old & (j >= first)], -1)
      self.page_rows[slots, :width] = new
      self.row_pages[slots] = n_new
    self._record_peak()
    if self.num_pages - self._in_use != num_free:
      raise RuntimeError(f"the pool has {num_free} free pages, the scheduler expected "
                         f"{self.num_pages - self._in_use}: a reservation found no free "
                         "page (scheduler bug)")

  def register(self, contexts: list[tuple[int, np.ndarray, int, int]]) -> None:
    """For each (slot, keys, start, stop) in order: caches the full pages among tokens
    [start, stop) of `slot`'s context (after `sync`; start on a page boundary: the pages
    before it were attached from the cache or registered after earlier calls), each under
    its hash-chain key (`keys`: `page_keys` of the context), holding them (sent to the
    device by `take_retains`). A key already cached keeps its page, and so does a page
    already cached. (One call for a device call's contexts, in numpy: ~2000 pages per call
    after a batch of prompts.)"""
    if not self.prefix_caching or not contexts:
      return
    ps = self.page_size
    keys = np.concatenate([k[a // ps:b // ps] for _, k, a, b in contexts])
    pages = np.concatenate([self.page_rows[slot, a // ps:b // ps] for slot, _, a, b in contexts])
    key_list = keys.tolist()
    fresh = ~self._held[pages] & ~np.fromiter(map(self._cache.__contains__, key_list), bool,
                                               len(key_list))
    # Within the call the first of equal keys wins, and the first of equal pages: a key
    # holds one page, a page is held under one key.
    fresh &= _first_occurrences(keys) & _first_occurrences(pages)
    new_keys, new = keys[fresh].tolist(), pages[fresh].tolist()
    self._cache.update(zip(new_keys, new))
    self._page_key.update(zip(new, new_keys))
    self._add_refs(new, +1)  # its sequence's reference and the hold: not evictable
    self._held[new] = True
    self._retain += new

  def take_retains(self) -> list[int]:
    """The holds placed since the last take, for a plan (`pool.retain_pages`)."""
    retain, self._retain = self._retain, []
    return retain

  def evict_for(self, pages_needed: int) -> list[int]:
    """Drops least recently used evictable cached pages until `pages_needed` pages are
    free on the device; returns them (`pool.release_pages`)."""
    # Each evictable page has one reference (the hold): dropping it frees the page.
    k = min(pages_needed - (self.num_pages - self._in_use), len(self._evictable))
    if k <= 0:
      return []
    if k == len(self._evictable):  # all of them (`Engine.reset_prefix_cache`)
      evicted = list(self._evictable)
      self._evictable.clear()
    else:
      evicted = list(itertools.islice(self._evictable, k))
      for page in evicted:
        del self._evictable[page]
    for key in map(self._page_key.pop, evicted):
      del self._cache[key]
    self._held[evicted] = False
    self._add_refs(evicted, -1)
    self.evicted_pages += len(evicted)
    return evicted

  def free(self, slots: list[int]) -> None:
    """Records that the references of `slots` go (`pool.release`)."""
    if not slots:
      return
    rows = self.page_rows[slots]
    self._add_refs(rows[rows >= 0], -1)
    self.page_rows[slots] = -1
    self.row_pages[slots] = 0
    self._grown.difference_update(slots)
    self.cached[slots] = 0

  # Questions the scheduler asks.

  def copies_on_write(self, slots: list[int]) -> int:
    """How many of `slots` have their next token in a partly filled page they share (the
    first decode step after a fork then takes a page for a copy)."""
    slots = np.asarray(slots, np.int64)
    last = self.page_rows[slots, np.maximum(self.row_pages[slots] - 1, 0)]
    partial = (self.cached[slots] % self.page_size != 0) & (last >= 0)
    return int((partial & (self.refs[np.maximum(last, 0)] > 1)).sum())

  def decode_growth(self, slots: list[int], steps_left: list[int], max_steps: int
                    ) -> np.ndarray:
    """int64 [max_steps]: entry k - 1 is the pages k decode steps of these slots take;
    slot i grows one token per step for at most steps_left[i] steps, and takes a page for
    a copy at its first (`copies_on_write`)."""
    cached = self.cached[slots]
    steps = np.arange(1, max_steps + 1)[:, None]
    grown = self.pages(cached + np.minimum(steps, steps_left)) - self.pages(cached)
    return grown.sum(axis=1) + self.copies_on_write(slots)

  def steps_that_fit(self, slots: list[int], steps_left: list[int], max_steps: int,
                     reserved: int = 0) -> int:
    """The most decode steps (<= max_steps) whose new pages (`decode_growth`) fit in the
    free pages less `reserved`."""
    fits = np.flatnonzero(self.decode_growth(slots, steps_left, max_steps)
                          <= self.num_free_pages - reserved)
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
