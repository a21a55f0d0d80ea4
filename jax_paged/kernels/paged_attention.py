"""Paged decode attention: a split-KV (flash-decoding) Pallas-Triton kernel.

One query token per sequence attends to that sequence's K/V, stored in fixed-size pages
of a shared pool (`k_pages`, `v_pages`: [Hkv, num_pages, page_size, D]) and located
through `page_table`. Semantics are exactly `jax_paged.reference.paged_decode_attention`.

Grid (Hkv, num_splits, B) (quantized pages: the sequences longest first). A program owns
one (sequence, kv head) and one contiguous slice of that sequence's tokens; all q heads
sharing the kv head are handled together so each K/V byte is read from HBM once. Each step
it takes `block_n` tokens, looks up every token's page (`page_table[b, t // page_size]`:
the pointers are formed per token, as in vLLM's Triton kernel, so the K/V tile is loaded
directly as a 2-D [block_n, D] gather with 16-byte accesses along D and no reshape), and
updates an f32 online softmax. Only page table entries of tokens below the sequence length
are read or used as indices. With several splits the per-split (o, lse) partials go
through the merge kernel.

A quantized pool (int8 / float8_e4m3fn pages, `kv_quant`) is read narrow, its per-token
f32 scales gathered beside each tile: K's multiply the logits and V's the probabilities,
so dequantization costs no [block_n, D] multiply. Each K/V tile is converted in registers
(exact) to q's dtype, or with a 16-bit q to f16 (float8: one convert per two values; int8:
five instructions per four, `_INT8_TO_F16_PTX`), and the dots run as for float pages. Its
V pages are token-minor ([D, page_size] per page, `kv_quant.v_pages_shape`): a block of
whole pages is read as a [D, block_n] tile with tokens contiguous, so p.v's 1-byte operand
reaches the tensor cores without byte loads from shared memory. The float path is
unchanged (the quantized ones are separate compilations). Measurements beside
`_QUANT_CONFIG` and in benchmarks/LOG.md.

q.k and p.v are tensor-core dots for every group size of float pages, MHA included: the
group of q heads is padded to 16 rows (15 of them masked for MHA). The wasted math is free
in a memory-bound kernel, and only loads feeding a dot get Triton's cp.async software
pipeline: on an H200 the elementwise MHA path it replaced ran at 80-88% of the read
ceiling, this at 87-95%.
"""

from __future__ import annotations

import functools

import jax
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu
import jax.numpy as jnp
import numpy as np

from jax_paged.kernels import kv_quant
from jax_paged.kernels import merge_attention
from jax_paged.kernels import reference
from jax_paged.kernels import triton_backend
from jax_paged.kernels import validation

# Auto split heuristic: aim for this many programs per SM so every SM has work and the
# ragged tail of the last wave is small.
_PROGRAMS_PER_SM = 4
# From this many programs per SM the grid runs unsplit: at 512 programs (Llama-3.2-1B's 8
# kv heads at batch 64, head dim 64, context 2k) one split read at 82.8% of the ceiling, two
# (the rule above) at 66.2%; at 384, two splits still won (80.9 vs 73.7%). H200, 2026-11-25.
_UNSPLIT_PROGRAMS_PER_SM = 3.5
# A split should walk at least this many blocks of tokens, else its fixed costs (q load,
# partial write, merge) dominate.
_MIN_BLOCKS_PER_SPLIT = 4
_MAX_SPLITS = 128
# Default tokens per step, warps and pipeline stages for GQA / MQA: the best or within noise
# of the best on every benchmark shape (H200 sweeps: benchmarks/LOG.md, "Attention kernel").
_BLOCK_N, _NUM_WARPS, _NUM_STAGES = 64, 4, 3
# MHA (a 16 x D tile of which one row is real): 2 warps and 2 stages were the best or within
# a point of it on every MHA shape measured (H200, LOG.md "Attention kernel"); D = 256
# keeps 4 warps (2 would need 255 registers per thread).
_MHA_NUM_WARPS, _MHA_NUM_STAGES = 2, 2
# With at least this many MHA programs per SM, 32-token blocks: far fewer registers than
# 64 tokens' (116 at D = 64), so 12 programs fit on an H200 SM instead of 8 (measured: a
# 13th per SM starts a second wave, LOG.md "Attention kernel") and e.g. GPT-2's 1536 programs
# at batch 128 run as one wave (87 / 92% at context 512 / 1k vs 81 / 85%). Fewer programs
# want 64 tokens' bytes in flight each (86 vs 78% at 768 programs).
_MHA_MANY_PROGRAMS_PER_SM = 8
_MHA_MANY_BLOCK_N = 32
# 1-byte (int8 / float8) pages, head dims <= 128, (block_n, warps, stages). H100, 2026-11-25,
# kernel time / the bf16 kernel's, int8 / fp8: gpt2-b256-l1k 0.586 / 0.584, gqa-b32-l4k
# 0.599 / 0.563, mha-b64-l2k 0.560 / 0.539 (int8 there before its f16 dots), gpt2-b64-l1k
# 0.642 / 0.647 at 64/2/3; in a sweep 128/4/3 gave 0.62-0.72 and 32/2/2 0.68-0.71 on
# these. GQA with head dim 64 (Llama-3.2-1B's 32 / 8 heads at batch 64, context 2k) wants
# more warps: 0.644 / 0.637 at 128/4/3, 0.69 / 0.71 at 64/2/3. Blocks hold whole pages
# (block_n >= page_size).
_QUANT_CONFIG = (64, 2, 3)
_QUANT_GQA_NARROW_CONFIG = (128, 4, 3)
# Head dims above 64 where a split spans at least _QUANT_WIDE_MIN_TOKENS: 128 tokens per
# block. H200, 2026-11-26, kernel µs at 64/2/3 vs 128/2/3 (int8 / fp8): mha-b64-l2k 318.0 /
# 299.3 vs 293.6 / 284.5, gqa-b32-l4k-ragged 74.7 / 70.6 vs 68.0 / 63.1 (gqa-b32-l4k
# in-jit 100.3 / 95.6 vs 94.6 / 91.6), but gqa-b1-l32k (64 splits of 512 tokens) 29.8 /
# 28.2 vs 31.6 / 29.7: a program's fixed costs over half as many blocks. On the H100 they
# were even (gqa-b32-l4k int8 0.608 vs 0.610 the bf16 kernel's time); GPT-2's head dim 64
# gains < 1%.
_QUANT_WIDE_CONFIG = (128, 2, 3)
_QUANT_WIDE_MIN_TOKENS = 1024


# int8 -> f16 for f16 dots, 4 values per instance: each byte, flipped to unsigned (u = x +
# 128), becomes the low mantissa byte of 1024.0 (0x6400 | u = 1024 + u, exact), less 1152.
# Five instructions per 4 values, where Triton's int8 -> bf16 takes about 3 per value.
_INT8_TO_F16_PTX = """{
.reg .b32 u, lo, hi, bias;
xor.b32 u, $2, 0x80808080;
prmt.b32 lo, u, 0x64646464, 0x4140;
prmt.b32 hi, u, 0x64646464, 0x4342;
mov.b32 bias, 0x64806480;
sub.f16x2 $0, lo, bias;
sub.f16x2 $1, hi, bias;
}"""


def _int8_to_f16(x: jax.Array, interpret: bool) -> jax.Array:
  """Inside a kernel: int8 x as float16 (exact); the same values by a convert when
  interpreted (no PTX runs there)."""
  if interpret:
    return x.astype(jnp.float16)
  return plgpu.elementwise_inline_asm(
      _INT8_TO_F16_PTX, args=[x], constraints="=r,=r,r", pack=4,
      result_shape_dtypes=[jax.ShapeDtypeStruct(x.shape, jnp.float16)])[0]


def default_config(num_programs: int, group: int, head_dim: int, *,
                   cache_dtype=None, tokens_per_split: int = 0) -> tuple[int, int, int]:
  """(block_n, num_warps, num_stages) for a grid of `num_programs` (B x Hkv x splits)
  programs with `group` q heads per kv head and head dim `head_dim`; `cache_dtype`: the
  pages' dtype where it is int8 / float8_e4m3fn (None: q's); `tokens_per_split`: the most
  tokens one program may walk (the page table's capacity / splits)."""
  if group > 1:
    config = _BLOCK_N, _NUM_WARPS, _NUM_STAGES
  else:
    many = num_programs >= _MHA_MANY_PROGRAMS_PER_SM * triton_backend.sm_count()
    config = (_MHA_MANY_BLOCK_N if many else _BLOCK_N,
              _MHA_NUM_WARPS if head_dim <= 128 else _NUM_WARPS, _MHA_NUM_STAGES)
  if cache_dtype is None or head_dim > 128:  # head dim 256: the float config (not measured)
    return config
  if head_dim > 64:
    return _QUANT_WIDE_CONFIG if tokens_per_split >= _QUANT_WIDE_MIN_TOKENS else _QUANT_CONFIG
  return _QUANT_GQA_NARROW_CONFIG if group > 1 else _QUANT_CONFIG


def _decode_kernel(lengths_ref, page_table_ref, layer_ref, q_ref, k_ref, v_ref, *refs,
                   scale: float, logits_soft_cap: float | None,
                   sliding_window: int | None, attention_chunk: int | None,
                   num_kv_heads: int, num_pages: int, max_pages: int,
                   page_size: int, head_dim: int, block_d: int, group: int, block_g: int,
                   block_n: int, num_splits: int, quantized: bool, alibi: bool,
                   sinks: bool, interpret: bool):
  """One (kv head, split, sequence b) program.

  Refs are whole arrays: lengths [B], page_table [B, max_pages], layer [1], q [B, H, D],
  k [L * Hkv * num_pages * page_size, D], v the same or (quantized: token-minor pages)
  [L * Hkv * num_pages * D, page_size], (quantized) order [B] (the sequences, shortest
  first: program (h, s, i) serves sequence order[B - 1 - i]) and k/v scales f32 [L * Hkv
  * num_pages * page_size], (alibi) slopes f32 [H], (sinks) sinks f32 [H], o [S, B, H,
  D], lse [S, B, H].
  """
  kv_head, split, b = pl.program_id(0), pl.program_id(1), pl.program_id(2)
  if quantized:
    order_ref, ks_ref, vs_ref, *refs = refs
    b = order_ref[order_ref.shape[0] - 1 - b]  # the longest first
  if alibi:
    slopes_ref, *refs = refs
  if sinks:
    sinks_ref, *refs = refs
  o_ref, lse_ref = refs
  # Clamped as the reference clamps: a traced length out of range never reads past the
  # sequence's page table row and gives the reference's result. (Traced page ids are
  # clamped by the wrapper, once per table: two integer ops per token here cost 3 points
  # of the read ceiling at GPT-2's batch 256, H100.)
  length = validation.clamp_lengths(lengths_ref[b], max_pages * page_size)
  # The first page of this (layer, kv head): the pool is [L, Hkv, pages, ...].
  head_page = (layer_ref[0] * num_kv_heads + kv_head) * num_pages
  head_base = head_page * page_size  # its first K row
  # The first token the new one (at length - 1) attends to.
  start = validation.first_visible_key(length - 1, sliding_window, attention_chunk)
  windowed = sliding_window is not None or attention_chunk is not None
  # A quantized block reads whole pages of V: blocks start on a page.
  first = start // page_size * page_size if quantized else start
  # Split the live tokens evenly (rounded to whole blocks) over the splits.
  per_split = pl.cdiv(pl.cdiv(length - first, num_splits), block_n) * block_n
  lo = first + split * per_split
  hi = jnp.minimum(lo + per_split, length)
  num_blocks = pl.cdiv(jnp.maximum(hi - lo, 0), block_n)

  cols = jnp.arange(block_d)
  col_mask = cols < head_dim if block_d != head_dim else None
  g = jnp.arange(block_g)
  heads = kv_head * group + g
  head_mask = g < group if block_g != group else None
  q_idx = (b, heads[:, None], cols[None, :])
  q_mask = triton_backend.and_masks(head_mask, col_mask)
  q = plgpu.load(q_ref.at[q_idx], mask=q_mask, other=None if q_mask is None else 0.0)
  # Logits in base 2 (the softmax exponentiates with one ex2 per logit,
  # `triton_backend.exp2`): q.k * row_scale (* the tokens' K scales when quantized), with
  # row_scale = scale * log2(e) (with a soft cap: after it).
  row_scale = scale if logits_soft_cap is not None else scale * triton_backend.LOG2_E
  # Quantized pages with a 16-bit q: the dots run in f16, not q's dtype. e4m3 -> f16 is one
  # convert per two values; to bf16 it goes through f16 and f32 (H200, same run, the bf16
  # kernel's time: 0.84x vs 1.08x at mha-b64-l2k, 0.94x vs 1.10x at gqa-b32-l4k, 1.13x vs
  # 1.15x at gpt2-b256-l1k). int8 -> f16 is `_INT8_TO_F16_PTX`, for head dims above 64:
  # there it beat int8 -> bf16 (H100, same run: gqa-b32-l4k 0.580 vs 0.594x the bf16
  # kernel's time, mha-b64-l2k 0.553 vs 0.565), at 64 it lost (gpt2-b256-l1k 0.593 vs
  # 0.580).
  f16_dots = (quantized and q.dtype != jnp.float32
              and (k_ref.dtype == kv_quant.FP8 or head_dim > 64))

  def to_dot_dtype(x):  # a narrow tile in the dots' dtype (exact)
    if f16_dots and x.dtype == jnp.int8:
      return _int8_to_f16(x, interpret)
    return x.astype(q.dtype)

  if f16_dots:
    q, row_pow2 = kv_quant.f16_rows(q)
    row_scale = (row_scale * row_pow2)[:, None]
  pages_per_block = block_n // page_size
  if alibi:  # each row's slope, in base 2: it multiplies the key's offset from the query
    slopes = plgpu.load(slopes_ref.at[heads], mask=head_mask,
                        other=None if head_mask is None else 0.0) * triton_backend.LOG2_E

  def body(i, carry):
    m, l, acc = carry
    tok = lo + i * block_n + jnp.arange(block_n)
    live = tok < hi
    if quantized and windowed:  # the block may start before the window
      live &= tok >= start
    pages = plgpu.load(page_table_ref.at[b, tok // page_size], mask=live, other=0)
    rows = head_base + pages * page_size + tok % page_size
    kv_idx = (rows[:, None], cols[None, :])
    kv_mask = triton_backend.and_masks(live, col_mask)
    # K/V are read once: evict them first, so they do not push out what the model's other
    # kernels left in L2 (their dirty outputs would be written back to HBM meanwhile, at
    # this kernel's expense: 79 -> 83% of the read ceiling between GPT-2's projections).
    k = plgpu.load(k_ref.at[kv_idx], mask=kv_mask, other=0.0, eviction_policy="evict_first")
    token_scale = row_scale
    if quantized:
      # The per-token scales multiply the logits (block_g x block_n products, not a
      # [block_n, D] dequantization).
      k = to_dot_dtype(k)  # exact: int8 / e4m3 values are f16 / bf16 / f32 values
      k_scales = plgpu.load(ks_ref.at[rows], mask=live, other=0.0,
                            eviction_policy="evict_first")
      token_scale = row_scale * k_scales[None, :]
    logits = lax.dot_general(q, k, (((1,), (1,)), ((), ())),
                             precision=lax.Precision.HIGHEST,
                             preferred_element_type=jnp.float32) * token_scale
    if logits_soft_cap is not None:  # capped in natural units, then to base 2
      cap = logits_soft_cap
      logits = (cap * triton_backend.LOG2_E) * jnp.tanh(logits / cap)
    if alibi:  # the query sits at position length - 1
      logits += slopes[:, None] * (tok - (length - 1)).astype(jnp.float32)[None, :]
    logits = jnp.where(live, logits, -jnp.inf)
    # Every block holds at least one live token, so m_new is finite.
    m_new = jnp.maximum(m, jnp.max(logits, axis=-1))
    alpha = triton_backend.exp2(m - m_new, interpret)
    p = triton_backend.exp2(logits - m_new[:, None], interpret)
    weights, v_max = p, None
    if quantized:
      v = to_dot_dtype(kv_quant.load_v_block(  # [block_d, block_n]
          v_ref, page_table_ref, b, (lo + i * block_n) // page_size, hi, head_page=head_page,
          head_dim=head_dim, page_size=page_size, pages_per_block=pages_per_block,
          cols=cols, col_mask=col_mask, eviction_policy="evict_first"))
      # sum_t p_t (s_t v_t) = sum_t (p_t s_t) v_t: the V scales go into the probabilities.
      v_scales = plgpu.load(vs_ref.at[rows], mask=live, other=0.0,
                            eviction_policy="evict_first")
      if f16_dots:
        v_scales, v_max = kv_quant.f16_weight_scales(v_scales)
      weights = p * v_scales[None, :]
      contract = (((1,), (1,)), ((), ()))
    else:
      v = plgpu.load(v_ref.at[kv_idx], mask=kv_mask, other=0.0, eviction_policy="evict_first")
      contract = (((1,), (0,)), ((), ()))
    pv = lax.dot_general(weights.astype(v.dtype), v, contract,
                         precision=lax.Precision.HIGHEST, preferred_element_type=jnp.float32)
    if v_max is not None:
      pv = pv * v_max
    return m_new, l * alpha + jnp.sum(p, axis=-1), acc * alpha[:, None] + pv

  init = (jnp.full((block_g,), -jnp.inf, jnp.float32), jnp.zeros((block_g,), jnp.float32),
          jnp.zeros((block_g, block_d), jnp.float32))
  m, l, acc = lax.fori_loop(0, num_blocks, body, init)

  if sinks:  # split 0 counts each head's sink (a logit without a value) once, in base 2
    sink = plgpu.load(sinks_ref.at[heads], mask=head_mask,
                      other=None if head_mask is None else 0.0) * triton_backend.LOG2_E
    if num_splits > 1:
      sink = jnp.where(split == 0, sink, -jnp.inf)
    m, l, acc = count_sink(m, l, acc, sink, interpret)
  nonempty = l > 0
  out = acc / jnp.where(nonempty, l, 1.0)[:, None]
  lse = jnp.where(nonempty, (m + jnp.log2(l)) * triton_backend.LN_2, -jnp.inf)
  plgpu.store(o_ref.at[(split,) + q_idx], out.astype(o_ref.dtype), mask=q_mask)
  plgpu.store(lse_ref.at[split, b, heads], lse, mask=head_mask)


def count_sink(m, l, acc, sink, interpret: bool):
  """Inside a kernel: an online softmax's state (m, l, acc: f32 [rows], [rows], [rows, D],
  base 2) with each row's `sink` logit (f32 [rows], base 2; -inf: none) counted in l and
  no value in acc (attention sinks; the prefill kernel's too)."""
  m_new = jnp.maximum(m, sink)
  m_safe = jnp.where(m_new == -jnp.inf, 0.0, m_new)  # a row with neither: l stays 0
  alpha = triton_backend.exp2(m - m_safe, interpret)
  return m_new, l * alpha + triton_backend.exp2(sink - m_safe, interpret), acc * alpha[:, None]


@functools.partial(jax.jit, static_argnames=[
    "scale", "logits_soft_cap", "sliding_window", "attention_chunk", "num_splits",
    "return_lse", "interpret", "block_n", "num_warps", "num_stages"])
def _paged_decode_pallas(q, k_pages, v_pages, page_table, lengths, layer, k_scales, v_scales,
                         alibi_slopes, sinks, *, scale: float,
                         logits_soft_cap: float | None, sliding_window: int | None,
                         attention_chunk: int | None,
                         num_splits: int, return_lse: bool, interpret: bool, block_n: int,
                         num_warps: int, num_stages: int):
  """k_pages, v_pages: one layer [Hkv, num_pages, page_size, D] (layer 0) or a pool [L, Hkv,
  num_pages, page_size, D], a quantized pool's v_pages token-minor [..., D, page_size];
  layer: int32 scalar; k_scales, v_scales: None, or float32 of k_pages' shape without D for
  int8 / float8 pages; alibi_slopes, sinks: None or float32 [H]."""
  quantized = k_scales is not None
  if k_pages.ndim == 4:  # a pool of one layer (free: a reshape inside jit)
    k_pages, v_pages = k_pages[None], v_pages[None]
  batch, num_heads, head_dim = q.shape
  num_layers, num_kv_heads, num_pages, page_size, _ = k_pages.shape
  group = num_heads // num_kv_heads
  # tl.dot needs >= 16 rows: pad the group (one q head for MHA) with masked rows.
  block_g = max(16, pl.next_power_of_2(group))
  # Token-major views of the pools (free reshapes): row = ((layer * Hkv + head) * pages +
  # page) * page_size + offset; token-minor V: row = ((layer * Hkv + head) * pages + page)
  # * D + d. Pallas-Triton forms the offsets into these in 64 bits
  # (`_compute_offsets_from_indices`), so pools past 4 GiB are fine.
  rows = num_layers * num_kv_heads * num_pages * page_size
  k_rows = k_pages.reshape(rows, head_dim)
  v_rows = (v_pages.reshape(rows // page_size * head_dim, page_size) if quantized
            else v_pages.reshape(rows, head_dim))
  kernel = functools.partial(
      _decode_kernel, scale=scale, logits_soft_cap=logits_soft_cap,
      sliding_window=sliding_window, attention_chunk=attention_chunk,
      num_kv_heads=num_kv_heads, num_pages=num_pages,
      max_pages=page_table.shape[1], page_size=page_size, head_dim=head_dim,
      block_d=pl.next_power_of_2(head_dim), group=group, block_g=block_g, block_n=block_n,
      num_splits=num_splits, quantized=quantized, alibi=alibi_slopes is not None,
      sinks=sinks is not None, interpret=interpret)
  quant_refs = []
  if quantized:
    # Programs start in grid order, kv heads fastest: a sequence's programs start together,
    # and quantized pages run longest sequences first, so that a ragged batch does not end
    # on a long program started last (longest-processing-time-first). Kernel time, H100:
    # 128 sequences of 33-768 tokens (GPT-2 heads) 49.7 -> 38.8 µs, 64 of 1-1024 36.3 ->
    # 32.6, equal lengths within 1.5%; the mixed workload's int8 engine +6.5% (H200; LOG.md,
    # "2026-11-25 night, second"). Float pages gain 1-3% on ragged batches, less than the
    # argsort costs a single call (3.7 µs at B = 256, H200; in a jitted step XLA merges the
    # layers' copies of it). Ascending, read from the end: descending adds a negation.
    work = lengths - validation.first_visible_key(lengths - 1, sliding_window,
                                                  attention_chunk)
    quant_refs = [jnp.argsort(work).astype(jnp.int32)]
    quant_refs += [x.reshape(rows) for x in (k_scales, v_scales)]
  head_refs = [x for x in (alibi_slopes, sinks) if x is not None]
  # One split writes the final output directly; partials stay f32 for the merge.
  part_dtype = q.dtype if num_splits == 1 else jnp.float32
  o, lse = pl.pallas_call(
      kernel,
      grid=(num_kv_heads, num_splits, batch),
      out_shape=(jax.ShapeDtypeStruct((num_splits, batch, num_heads, head_dim), part_dtype),
                 jax.ShapeDtypeStruct((num_splits, batch, num_heads), jnp.float32)),
      compiler_params=triton_backend.compiler_params(num_warps=num_warps,
                                                     num_stages=num_stages),
      interpret=interpret,
      name="paged_decode_attention",
  )(lengths, page_table, jnp.reshape(layer, (1,)).astype(jnp.int32), q, k_rows, v_rows,
    *quant_refs, *head_refs)
  if num_splits == 1:
    o, lse = o[0], lse[0]
  else:
    o, lse = merge_attention.merge_states_pallas(
        [(o.reshape(num_splits, batch * num_heads, head_dim),
          lse.reshape(num_splits, batch * num_heads))], out_dtype=q.dtype, interpret=interpret)
    o, lse = o.reshape(q.shape), lse.reshape(q.shape[:-1])
  return (o, lse) if return_lse else o


_paged_decode_reference = jax.jit(
    reference.paged_decode_attention,
    static_argnames=["scale", "logits_soft_cap", "sliding_window", "attention_chunk",
                     "return_lse"])


def auto_num_splits(batch: int, num_kv_heads: int, max_tokens: int, block_n: int, *,
                    min_blocks_per_split: int = _MIN_BLOCKS_PER_SPLIT,
                    programs_per_sm: float = _PROGRAMS_PER_SM, head_dim: int = 128,
                    group: int = 1) -> int:
  """Splits so that batch x kv heads x splits fills the GPU without tiny splits.

  Args:
    batch, num_kv_heads: the grid's other two axes.
    max_tokens: most tokens a sequence can attend to (static bound on the lengths).
    block_n: tokens per kernel step.
    min_blocks_per_split: the fewest blocks a split should walk.
    programs_per_sm: the programs per SM to aim for (and `_UNSPLIT_PROGRAMS_PER_SM`, past
      which none split), counted in programs of head dim <= 128.
    head_dim: the K/V rows' width: a program of head dim 256 reads twice a 128's bytes
      per block and counts as two (H200, 2026-12-01, 8 q heads over 1 or 4 kv heads of
      256, context 2k: 256 programs unsplit 86% of the read ceiling, in 2 splits 73-74%;
      64 programs best in 4 splits, 58% vs 51% in 8).
    group: q heads per kv head. A program computes its padded group's rows (`block_g`)
      against each token: past 32 rows of 128 features (block_g x head_dim > 4096) it
      counts as block_g x head_dim / 4096 programs, and a split's float32 partials grow
      with it. H200, 2026-12-02, kernel µs by splits, batch 64 / 256, one kv head, context
      2k: 48 q heads of 128 (StarCoder's) best in 4 / 1 splits (29.5 / 76.8 vs 35.6 / 87.8
      in 8 / 2), 71 of 64 (Falcon-7B's; context 1k at 256) in 4 / 1 (22.2 / 38.7 vs 28.2 /
      46.8); 16 of 128 equal in 4 or 8 (25.5 / 25.8).
  """
  block_g = max(16, pl.next_power_of_2(group))
  weight = max(1.0, head_dim / 128, block_g * head_dim / 4096)
  programs = batch * num_kv_heads
  if programs * weight >= _UNSPLIT_PROGRAMS_PER_SM * triton_backend.sm_count():
    return 1
  wanted = pl.cdiv(int(programs_per_sm * triton_backend.sm_count() / weight), programs)
  most = max(1, max_tokens // (min_blocks_per_split * block_n))
  splits = max(1, min(wanted, most, _MAX_SPLITS))
  # Round down to a power of two: measured on an H200, 3 splits at B*Hkv=256 ran at 71%
  # of the read ceiling where 2 ran at 84%, and 64 beat 66 at B*Hkv=8.
  return 1 << (splits.bit_length() - 1)


def paged_decode_attention(q: jax.Array, k_pages: jax.Array, v_pages: jax.Array,
                           page_table: jax.Array, lengths: jax.Array, *,
                           layer: int | jax.Array | None = None,
                           k_scales: jax.Array | None = None,
                           v_scales: jax.Array | None = None,
                           scale: float | None = None, logits_soft_cap: float | None = None,
                           sliding_window: int | None = None,
                           alibi_slopes: jax.Array | None = None,
                           sinks: jax.Array | None = None,
                           attention_chunk: int | None = None,
                           num_splits: int | None = None,
                           return_lse: bool = False, interpret: bool | None = None,
                           block_n: int | None = None, num_warps: int | None = None,
                           num_stages: int | None = None):
  """One query token per sequence attending to its paged K/V cache.

  Args:
    q: [B, H, D] float32 / bfloat16 / float16; D in (64, 80, 96, 128, 256).
    k_pages, v_pages: [Hkv, num_pages, page_size, D], q's dtype, or int8 / float8_e4m3fn
      with scales (a quantized pool: read narrow, dequantized in registers), whose v_pages
      are token-minor, [Hkv, num_pages, D, page_size] (`kv_quant.v_pages_shape`,
      `kv_quant.transpose_pages`); H % Hkv == 0; page_size a power of two in [8, 128].
      A quantized block reads whole pages of V, so the slots of a sequence's pages that it
      does not attend to (the tail of its last page; with a window, those before it) are
      read with zero weight: float8 V must hold no NaN there (int8 has none). Pools from
      `KVPool.create` and `write_kv` never hold NaN bytes (`kv_quant.quantize`); zeroing
      them here cost 1-38% of float8's kernel time (H100, LOG.md).
      With `layer`: a whole pool's [num_layers, Hkv, num_pages, page_size, D]
      (`KVPool.k_pages`; `KVPool.v_pages`), of which layer `layer` is read in place
      (slicing `k_pages[layer]` would hand the kernel a copy of that layer every call).
    page_table: int32 [B, max_pages_per_seq], physical page ids in [0, num_pages); entries
      past a sequence's last page are never read.
    lengths: int32 [B] in [0, max_pages_per_seq * page_size], tokens in each sequence's
      cache (0 = empty). Concrete lengths or used page ids out of range raise ValueError.
      Under jit, lengths are clamped into range and page ids into [0, num_pages) exactly
      as `reference.paged_decode_attention` clamps them: the two agree, no page table entry
      past a row is read, and no read leaves the pool.
    layer: None, or the layer of 5-D pools to attend to: a Python int in [0, num_layers),
      or a traced int32 scalar (clamped into that range).
    k_scales, v_scales: for int8 / float8_e4m3fn pages, their float32 scales of shape
      k_pages.shape[:-1] (`KVPool.k_scales` / `v_scales`: K = k_pages * k_scales per token
      and kv head); None for float pages. float8 kernels need compute capability >= 8.9.
    scale: logits = scale * q.k; defaults to D ** -0.5.
    logits_soft_cap: c > 0 gives logits = c * tanh(logits / c).
    sliding_window: W > 0 limits a sequence of length L to positions [L - W, L).
    alibi_slopes: float32 [H] or None: ALiBi (BLOOM's, MPT's positions) adds slope_h *
      (j - (L - 1)) to head h's logit of the key at position j (after a soft cap).
    sinks: float32 [H] or None: attention sinks (GPT-OSS's): head h's softmax also counts
      a logit sinks[h] (natural units, not scaled or capped) that has no value, so its
      weights sum to less than 1 (`reference.paged_decode_attention`).
    attention_chunk: C > 0 limits a sequence of length L to the positions of its last
      token's chunk of C, [floor((L - 1) / C) * C, L) (Llama 4's chunked attention).
    num_splits: KV partitions per sequence (flash-decoding); None picks from B x Hkv
      against the GPU's SM count and max_pages_per_seq.
    return_lse: also return the log-sum-exp of the final logits (the sinks' included).
    interpret: None = Triton kernel on GPU, plain XLA elsewhere; True = Pallas interpret
      mode (tests); False = Triton kernel.
    block_n, num_warps, num_stages: kernel tuning knobs (tokens per step, Triton warps,
      pipeline stages); None = measured defaults. Quantized pages need block_n >=
      page_size.

  Returns:
    out [B, H, D] in q's dtype, and if `return_lse`, lse float32 [B, H] (natural log).
    A sequence of length 0 gives out 0 and lse -inf (with sinks: the sink's logit).
  """
  validation.check_decode_call(
      q, k_pages, v_pages, page_table, lengths, layer=layer, scale=scale,
      logits_soft_cap=logits_soft_cap, sliding_window=sliding_window,
      strict_kernel_shapes=True, k_scales=k_scales, v_scales=v_scales,
      alibi_slopes=alibi_slopes, sinks=sinks, attention_chunk=attention_chunk)
  validation.check_positive_int("block_n", block_n, optional=True, power_of_two=True)
  for name, knob in (("num_splits", num_splits), ("num_warps", num_warps),
                     ("num_stages", num_stages)):
    validation.check_positive_int(name, knob, optional=True)
  validation.check_quantized_block_n(block_n, k_pages, k_scales)
  scale = float(q.shape[-1] ** -0.5 if scale is None else scale)
  logits_soft_cap = None if logits_soft_cap is None else float(logits_soft_cap)
  mode = triton_backend.kernel_mode(interpret)
  if mode is None or q.size == 0:
    return _paged_decode_reference(q, k_pages, v_pages, page_table, lengths, layer=layer,
                                   k_scales=k_scales, v_scales=v_scales,
                                   scale=scale, logits_soft_cap=logits_soft_cap,
                                   sliding_window=sliding_window,
                                   alibi_slopes=alibi_slopes, sinks=sinks,
                                   return_lse=return_lse, attention_chunk=attention_chunk)
  if not mode:
    kv_quant.check_compiled(k_pages, "k_pages")
  if layer is None:
    layer = 0
  elif not isinstance(layer, (int, np.integer)):  # traced: keep the reads inside the pool
    layer = jnp.clip(layer, 0, k_pages.shape[0] - 1)
  page_table = validation.clamp_unchecked_page_ids(page_table, k_pages.shape[-3], lengths)
  batch, num_heads, head_dim = q.shape
  num_kv_heads, _, page_size, _ = k_pages.shape[-4:]
  max_tokens = page_table.shape[1] * page_size
  for width in (sliding_window, attention_chunk):  # the most a sequence attends to
    if width is not None:
      max_tokens = min(max_tokens, width + page_size)
  if num_splits is None:
    num_splits = auto_num_splits(batch, num_kv_heads, max_tokens, block_n or _BLOCK_N,
                                 head_dim=head_dim, group=num_heads // num_kv_heads)
  quantized = k_scales is not None
  default_n, default_warps, default_stages = default_config(
      batch * num_kv_heads * num_splits, num_heads // num_kv_heads, head_dim,
      cache_dtype=k_pages.dtype if quantized else None,
      tokens_per_split=max_tokens // num_splits)
  if quantized:  # its blocks are whole pages of V
    default_n = max(default_n, page_size)
  return _paged_decode_pallas(
      q, k_pages, v_pages, page_table, lengths, layer, k_scales, v_scales, alibi_slopes,
      sinks, scale=scale, logits_soft_cap=logits_soft_cap,
      sliding_window=sliding_window, attention_chunk=attention_chunk,
      num_splits=num_splits, return_lse=return_lse,
      interpret=mode, block_n=block_n or default_n, num_warps=num_warps or default_warps,
      num_stages=num_stages or default_stages)
