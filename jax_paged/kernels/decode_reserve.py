"""`pool.reserve` for a decode step (at most one new token per sequence) as one kernel.

XLA runs `reserve`'s vectorised form as about eight small kernels (the duplicate check, two
prefix sums, the free-stack pops, the page-table and lengths scatters, the slots, the
stack height), each 1-2 µs, on a decode step's critical path; this kernel takes 2.2 µs
(GPT-2 at batch 128 on an H200: 6-9 µs less per step; benchmarks/LOG.md, "K/V write and
reserve"). With at most one new token per sequence and distinct sequence ids in range
(checked when the ids are known when tracing; traced ones that repeat or are out of range
come as max_seqs, which is not served), everything fits one program: a [n] vector per
quantity, the prefix sums as Triton scans, the page pops, and the page-table and lengths
updates as masked gathers and scatters into the pool's arrays, aliased to the outputs (in
place when the pool is donated).

Semantics are exactly `pool.reserve`'s with `max_new_tokens=1`: sequences are served in
order; one fits if its new page (when it needs one) is left on the free stack after the
earlier ones, and its length stays within `max_pages_per_seq` pages; counts outside
{0, 1} are not served. Sequences whose token falls in a shared, partly filled page
(reference count > 1, after `pool.fork`) are served after the others, one at a time, in
order: each but that page's last reference pops a page, copies the shared page's K/V
(and a quantized pool's scales) into it (every layer and kv head) and writes there
(copy-on-write). That walk runs only
when some sequence needs it; otherwise the kernel costs what it did without sharing.
"""

from __future__ import annotations

import functools

import jax
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu
import jax.numpy as jnp

from jax_paged.kernels import triton_backend


_COPY_CHUNK = 1024  # elements of a page's (layer, head) tile copied per iteration


def _kernel(*refs, n: int, block: int, max_seqs: int, max_pages: int, num_pages: int,
            page_size: int, tiles: int, tile_sizes: tuple[int, ...], ids_given: bool):
  """Refs: (ids_given) seq_ids [n] (distinct in [0, max_seqs), or max_seqs: not served),
  counts [n], num_free [],
  free_pages [num_pages], then page_table [max_seqs, max_pages], lengths [max_seqs],
  refcounts [num_pages] and the pool's page arrays (K and V pages, and a quantized pool's
  scales) flattened to [tiles * num_pages * tile_sizes[j]] (inputs unused: their buffers
  are the aliased outputs of the same names); outputs page_table, lengths, refcounts, the
  page arrays, num_free [] (num_free's buffer: read before written), slots [n], ok [n]
  (bool)."""
  ids_ref, *refs = refs if ids_given else (None,) + refs
  counts_ref, num_free_ref, free_pages_ref = refs[:3]
  table_ref, lengths_ref, refcounts_ref, *refs = refs[6 + len(tile_sizes):]
  page_refs = refs[:len(tile_sizes)]
  new_free_ref, slots_ref, ok_ref = refs[len(tile_sizes):]
  i = jnp.arange(block)
  lane = i < n  # a lane with an output row
  # Distinct ids: each lane reads and writes only its own sequence's entries, and the
  # lanes past n, or given id max_seqs (not served), address nothing (out of range), so no
  # two lanes store to one address (Pallas interpret mode stores masked lanes too, with
  # the values they read).
  if ids_ref is None:  # sequences 0 .. n - 1
    ids = jnp.where(lane, i, max_seqs)
  else:
    ids = plgpu.load(ids_ref.at[i], mask=lane, other=max_seqs)
  live = lane & (ids < max_seqs)
  counts = plgpu.load(counts_ref.at[i], mask=live, other=0).astype(jnp.int32)
  old_len = plgpu.load(lengths_ref.at[ids], mask=live, other=0)
  new_len = old_len + counts
  have = (old_len + page_size - 1) // page_size
  need = (new_len + page_size - 1) // page_size - have  # 0 or 1
  valid = live & (counts >= 0) & (counts <= 1) & (have + need <= max_pages)
  # A token within the last page goes to that page, unless other references share it.
  appends = valid & (counts > 0) & (need == 0)
  last = plgpu.load(table_ref.at[ids, jnp.clip(old_len // page_size, 0, max_pages - 1)],
                    mask=appends, other=0)
  shared = appends & (plgpu.load(refcounts_ref.at[jnp.clip(last, 0, num_pages - 1)],
                                 mask=appends, other=0) > 1)
  valid &= ~shared
  num_free = num_free_ref[...]
  wanted = jnp.where(valid, need, 0)
  ok = valid & ((need == 0) | (jnp.cumsum(wanted) <= num_free))
  taken = jnp.where(ok, need, 0)
  # Sequence i pops free_pages[free_before - 1], the top of what earlier ones left.
  free_before = num_free - jnp.cumsum(taken) + taken
  pops = taken > 0
  popped = plgpu.load(free_pages_ref.at[jnp.clip(free_before - 1, 0, num_pages - 1)],
                      mask=pops, other=0)
  page = jnp.where(pops, popped, last)
  plgpu.store(table_ref.at[ids, jnp.clip(have, 0, max_pages - 1)], popped, mask=pops)
  # Masked lanes address nothing (out of range): several would name page 0.
  plgpu.store(refcounts_ref.at[jnp.where(pops, popped, num_pages)], jnp.ones_like(popped),
              mask=pops)
  plgpu.store(lengths_ref.at[ids], new_len, mask=ok)
  plgpu.store(slots_ref.at[i], jnp.where(ok & (counts > 0),
                                         page * page_size + old_len % page_size, -1),
              mask=lane & ~shared)
  plgpu.store(ok_ref.at[i], ok, mask=lane & ~shared)
  num_free -= jnp.sum(taken)
  new_free_ref[...] = num_free

  @pl.when(jnp.max(shared.astype(jnp.int32)) > 0)
  def _copy_on_write():
    # One sequence at a time: each reads the count the previous ones left. The addresses
    # touched here (shared pages' counts, the shared rows' entries, pages below the stack
    # top) are not those stored above, so no thread reads another's unflushed store.
    chunk = jnp.arange(_COPY_CHUNK)

    def serve(r, free):
      lane = i == r
      pick = lambda x: jnp.sum(jnp.where(lane, x, 0))
      is_shared = pick(shared.astype(jnp.int32)) > 0
      seq, length, page = pick(ids), pick(old_len), pick(last)
      references = plgpu.load(refcounts_ref.at[page], mask=is_shared, other=0)
      copy = is_shared & (references > 1)
      fits = is_shared & (~copy | (free > 0))
      copy &= fits
      fresh = plgpu.load(free_pages_ref.at[jnp.clip(free - 1, 0, num_pages - 1)], mask=copy,
                         other=0)

      for pages_ref, tile_size in zip(page_refs, tile_sizes):
        # lax ops on int32 operands (jnp's `%` by a constant 1 lowered to an i1 divisor),
        # and typed loop bounds (a where of two Python ints lowered to an i1 bound).
        parts = jnp.int32(pl.cdiv(tile_size, _COPY_CHUNK))

        def copy_tile(t, _, pages_ref=pages_ref, tile_size=tile_size, parts=parts):
          tile, part = lax.div(t, parts), lax.rem(t, parts)
          offset = part * _COPY_CHUNK + chunk
          inside = offset < tile_size
          src = (tile * num_pages + page) * tile_size + offset
          dst = (tile * num_pages + fresh) * tile_size + offset
          plgpu.store(pages_ref.at[dst], plgpu.load(pages_ref.at[src], mask=inside),
                      mask=inside)

        lax.fori_loop(jnp.int32(0), jnp.where(copy, tiles * parts, jnp.int32(0)),
                      copy_tile, None)
      plgpu.store(refcounts_ref.at[page], references - 1, mask=copy)
      plgpu.store(refcounts_ref.at[fresh], jnp.int32(1), mask=copy)
      plgpu.store(table_ref.at[seq, length // page_size], fresh, mask=copy)
      plgpu.store(lengths_ref.at[seq], length + 1, mask=fits)
      target = jnp.where(copy, fresh, page)
      plgpu.store(slots_ref.at[r], jnp.where(fits, target * page_size + length % page_size,
                                             -1), mask=is_shared)
      plgpu.store(ok_ref.at[r], fits, mask=is_shared)
      return free - copy.astype(jnp.int32)

    new_free_ref[...] = lax.fori_loop(0, n, serve, num_free)


@functools.partial(jax.jit, static_argnames=["page_size", "interpret"])
def reserve_one_pallas(page_table: jax.Array, lengths: jax.Array, free_pages: jax.Array,
                       num_free: jax.Array, refcounts: jax.Array,
                       pages: tuple[jax.Array, ...], seq_ids: jax.Array | None,
                       counts: jax.Array, *, page_size: int, interpret: bool):
  """The kernel behind `pool.reserve(..., max_new_tokens=1)` on a GPU.

  Args:
    page_table: int32 [max_seqs, max_pages_per_seq]; lengths: int32 [max_seqs];
      free_pages: int32 [num_pages]; num_free: int32 []; refcounts: int32 [num_pages];
      pages: the pool's page arrays (`KVPool.page_arrays`): k_pages, v_pages [L, Hkv,
      num_pages, page_size, D] (a quantized pool's v_pages [L, Hkv, num_pages, D,
      page_size]: a page is copied whole, whatever its layout), and a quantized pool's
      k_scales, v_scales [L, Hkv, num_pages, page_size] (the pool's fields; all but
      free_pages are updated in place when donated; the page arrays only by copy-on-write).
    seq_ids: int32 [n], distinct ids in [0, max_seqs), or max_seqs for a row not to
      serve (the caller's guard for traced ids that repeat or are out of range); or None
      for sequences 0 .. n - 1 (a decode loop's whole batch: no ids array to materialise
      and load).
    counts: int [n] or bool [n], new tokens per sequence (0 or 1 are served; converted in
      the kernel, where XLA would run the conversion as a kernel of its own).
    page_size: the pool's page size.

  Returns:
    (page_table, lengths, num_free, refcounts, pages (a tuple like the argument), slots
    int32 [n, 1], ok bool [n]).
  """
  n = counts.shape[0]
  m = len(pages)
  max_seqs, max_pages = page_table.shape
  num_layers, num_kv_heads, num_pages = pages[0].shape[:3]
  tiles = num_layers * num_kv_heads
  kernel = functools.partial(
      _kernel, n=n, block=max(16, pl.next_power_of_2(n)), max_seqs=max_seqs,
      max_pages=max_pages, num_pages=num_pages, page_size=page_size, tiles=tiles,
      tile_sizes=tuple(x.size // (tiles * num_pages) for x in pages),
      ids_given=seq_ids is not None)
  ids = () if seq_ids is None else (seq_ids,)
  flat = lambda x: jax.ShapeDtypeStruct((x.size,), x.dtype)
  table, new_lengths, new_refcounts, *outs, new_free, slots, ok = pl.pallas_call(
      kernel,
      out_shape=(jax.ShapeDtypeStruct(page_table.shape, jnp.int32),
                 jax.ShapeDtypeStruct(lengths.shape, jnp.int32),
                 jax.ShapeDtypeStruct(refcounts.shape, jnp.int32),
                 *[flat(x) for x in pages],
                 jax.ShapeDtypeStruct((), jnp.int32),
                 jax.ShapeDtypeStruct((n,), jnp.int32),
                 jax.ShapeDtypeStruct((n,), jnp.bool_)),
      # In place: the page table, the lengths, the counts, the pages, and the stack height
      # too (as its own output XLA would copy it into the pool's buffer: a memcpy and a
      # break in the step's command buffer, ~7 µs of GPU time per step).
      input_output_aliases={len(ids) + 3: 0, len(ids) + 4: 1, len(ids) + 5: 2,
                            **{len(ids) + 6 + j: 3 + j for j in range(m)},
                            len(ids) + 1: 3 + m},
      compiler_params=triton_backend.compiler_params(num_warps=4, num_stages=1),
      interpret=interpret,
      name="decode_reserve",
  )(*ids, counts, num_free, free_pages, page_table, lengths, refcounts,
    *[x.reshape(-1) for x in pages])
  return (table, new_lengths, new_free, new_refcounts,
          tuple(y.reshape(x.shape) for x, y in zip(pages, outs)), slots[:, None], ok)
