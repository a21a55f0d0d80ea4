"""Paged prefill attention: a flash-attention Pallas-Triton kernel over a paged KV cache.

Several query tokens per sequence (a prompt's chunk) attend causally to that sequence's
K/V, all of it stored in the pool's pages (`k_pages`, `v_pages`: [Hkv, num_pages,
page_size, D]) and located through `page_table`: the cached prefix (shared prefix-cache
pages, earlier chunks) and the chunk's own tokens, which the caller wrote first. Semantics
are exactly `jax_paged.reference.paged_prefill_attention`.

Grid (query blocks, Hkv, B), query blocks fastest so that the programs running side by side
read the same sequence's K/V (L2 reuse), the longest (last) block first. A program owns
`block_q` query tokens of one sequence and all `group` q heads of one kv head: the tile's
M = block_q x group rows (row = token * block_g + head, the group padded to a power of two)
feed the tensor-core dots, so each K/V tile loaded serves every q head sharing it. It walks
blocks of `block_n` keys up to its last real query's position, forming every key's address
from the page table (`page_table[b, key // page_size]`, as the decode kernel does) and
keeping an f32 online softmax. Blocks every query of the tile sees whole run unmasked;
only the diagonal blocks (and, with a sliding window, its lower edge) are masked, and the
keys no query of the tile sees are never loaded.

A quantized pool (int8 / float8_e4m3fn pages with per-token scales, V token-minor) is read
as the decode kernel reads it: each tile converted in registers to q's dtype (exact), K's
scales multiplying the logits and V's the probabilities, V read as whole pages. Compute
bound, the conversion costs: 1.1-1.5x the bf16 kernel's time (benchmarks/RESULTS.md).
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
from jax_paged.kernels import paged_attention
from jax_paged.kernels import reference
from jax_paged.kernels import triton_backend
from jax_paged.kernels import validation


def default_config(group: int, head_dim: int, num_tokens: int, itemsize: int, *,
                   min_block_n: int = 1) -> tuple[int, int, int, int]:
  """(block_q, block_n, num_warps, num_stages) for `group` q heads per kv head, head dim
  `head_dim`, `num_tokens` (T) query tokens per row and K/V tiles of `itemsize` bytes (q's
  dtype: quantized tiles are converted to it), with blocks of at least `min_block_n` keys
  (quantized pages: a page, as a block reads whole pages of V)."""
  block_g = pl.next_power_of_2(group)
  # Measured on an H200, bf16, GPU kernel time (benchmarks/bench_prefill.py --sweep):
  # rows (tokens x padded group) per tile: 64 at GPT-2's D = 64 (16 rows x 256 tokens after
  # 0 / 512 cached: 15.2 / 46.1 µs vs 18.1 / 51.9 with 128 rows), 128 at D = 128 (32/8
  # heads, same rows: 149.5 vs 166.7 µs after 512); 64 at D = 256 (not measured: a
  # 128 x 256 f32 accumulator alone would take 128 KB of registers).
  block_m = 128 if 64 < head_dim <= 128 else 64
  block_q = query_block(block_m, block_g, num_tokens)
  # 64 keys per step (32 and 128 were slower or within 1 µs on every shape but GQA's with no
  # prefix: 32 keys x 16 tokens, 53 vs 64 µs), 4 warps (8 were never measurably faster and
  # up to 1.8x slower), 2 stages (3: within 1 µs at D = 64, 7-27% slower at D = 128).
  block_n = 64 if head_dim * itemsize <= 256 else 32
  if min_block_n > block_n:
    # Wider blocks over fewer query rows, so that the tiles keep their size in registers
    # (128-token pages at D = 256, bf16: 300 bytes spilled per thread, none so; SASS for
    # sm_90a on CPU).
    block_q = max(block_q * block_n // min_block_n, 16 // min(block_g, 16))
    block_n = min_block_n
  num_warps = 4 if head_dim <= 128 else 8
  return block_q, block_n, num_warps, 2


def query_block(block_m: int, block_g: int, num_tokens: int) -> int:
  """Query tokens per program for tiles of about `block_m` rows of `block_g` (a power of
  two) heads per token: a short chunk is not padded to a whole tile's tokens, but a dot
  needs 16 rows."""
  block_q = min(max(1, block_m // block_g), pl.next_power_of_2(num_tokens))
  return max(block_q, 16 // min(block_g, 16))


def _prefill_kernel(q_start_ref, q_len_ref, page_table_ref, layer_ref, q_ref, k_ref, v_ref,
                    *refs, scale: float, logits_soft_cap: float | None,
                    sliding_window: int | None, attention_chunk: int | None,
                    num_tokens: int,
                    num_heads: int, num_kv_heads: int, num_pages: int, max_pages: int,
                    page_size: int, head_dim: int, block_d: int, group: int, block_g: int,
                    block_q: int, block_n: int, num_q_blocks: int, quantized: bool,
                    alibi: bool, sinks: bool, interpret: bool):
  """One (query block, kv head, sequence b) program.

  Refs are whole arrays: q_start, q_len [B], page_table [B, max_pages], layer [1],
  q / o [B, T, H, D], k / v [L * Hkv * num_pages * page_size, D] (row ((layer * Hkv +
  kv head) * num_pages + page) * page_size + offset); quantized: v token-minor [L * Hkv *
  num_pages * D, page_size] and k / v scales f32 [L * Hkv * num_pages * page_size] (by
  k's row), then (alibi) slopes f32 [H] and (sinks) sinks f32 [H], before o.
  """
  if quantized:
    ks_ref, vs_ref, *refs = refs
  if alibi:
    slopes_ref, *refs = refs
  if sinks:
    sinks_ref, *refs = refs
  (o_ref,) = refs
  q_block = num_q_blocks - 1 - pl.program_id(0)
  kv_head, b = pl.program_id(1), pl.program_id(2)
  # Clamped as the reference clamps: no key of a traced out-of-range row lies past its page
  # table row.
  q_start, q_len = validation.clamp_prefill(q_start_ref[b], q_len_ref[b],
                                            num_tokens=num_tokens,
                                            capacity=max_pages * page_size)
  head_page = (layer_ref[0] * num_kv_heads + kv_head) * num_pages  # this head's first page
  head_base = head_page * page_size  # its first K row

  block_m = block_q * block_g
  r = jnp.arange(block_m)
  tok = q_block * block_q + r // block_g  # the row's query token
  g = r % block_g
  real = (tok < q_len) & (g < group)  # rows of real queries (q_len <= T)
  pos = q_start + tok  # the row's position in its sequence
  cols = jnp.arange(block_d)
  col_mask = cols < head_dim if block_d != head_dim else None
  # Every row's (token, head) is distinct, padding included (tokens past T, heads past the
  # group are masked): interpret mode stores a masked row by writing back what it read, so
  # two rows at one address could undo a real row's store.
  q_idx = (b, tok[:, None], kv_head * group + g[:, None], cols[None, :])
  # Padding queries load as 0, whatever the caller left there (NaN included).
  q = plgpu.load(q_ref.at[q_idx], mask=triton_backend.and_masks(real, col_mask), other=0.0)

  # The tile's real queries sit at positions [first_pos, last_pos].
  first_pos = q_start + q_block * block_q
  last_pos = q_start + jnp.minimum(q_len, (q_block + 1) * block_q) - 1
  end = jnp.where(last_pos >= first_pos, last_pos // block_n + 1, 0)  # blocks [.., end)
  # Blocks [start, full_lo) hold keys below some query's window (or chunk), [full_lo,
  # full_hi) keys every query sees, [full_hi, end) keys past some query's position: only
  # the first and the last range are masked. (A row's first visible key never decreases
  # with its position: the tile's first and last rows bound them.)
  windowed = sliding_window is not None or attention_chunk is not None
  if not windowed:
    start = full_lo = 0
  else:
    first_key = functools.partial(validation.first_visible_key,
                                  sliding_window=sliding_window,
                                  attention_chunk=attention_chunk)
    start = jnp.minimum(first_key(first_pos) // block_n, end)
    full_lo = jnp.clip(pl.cdiv(first_key(last_pos), block_n), start, end)
  full_hi = jnp.clip((first_pos + 1) // block_n, full_lo, end)

  # exp2 below: the softmax runs in base 2, so the logits are scaled by log2(e) (with a
  # soft cap: after it).
  qk_scale = scale if logits_soft_cap is not None else scale * triton_backend.LOG2_E
  # Quantized pages convert to q's dtype: float8 with a bf16 q does not dot in f16 as in
  # the decode kernel (per-row scales on the logits spilled: 2.1-2.5x the bf16 kernel's
  # time at 32/8 heads of 128, LOG.md).
  pages_per_block = block_n // page_size
  if alibi:  # each row's head's slope, in base 2 (times the key's offset from the query)
    slopes = plgpu.load(slopes_ref.at[kv_head * group + g], mask=g < group,
                        other=0.0) * triton_backend.LOG2_E

  def body(j, carry, *, masked: bool):
    m, l, acc = carry
    key = j * block_n + jnp.arange(block_n)
    # Unmasked blocks lie below the first query's position, so inside the sequence.
    live = key <= last_pos if masked else None
    pages = plgpu.load(page_table_ref.at[b, key // page_size], mask=live,
                       other=None if live is None else 0)
    kv_rows = head_base + pages * page_size + key % page_size
    kv_idx = (kv_rows[:, None], cols[None, :])
    kv_mask = triton_backend.and_masks(live, col_mask)
    other = None if kv_mask is None else 0.0
    k = plgpu.load(k_ref.at[kv_idx], mask=kv_mask, other=other)
    key_scale = qk_scale
    if quantized:
      # Converted in registers (exact: int8 / e4m3 values are f32 / bf16 / f16 values); the
      # keys' scales multiply the logits, the values' the probabilities (below), so
      # dequantizing costs no [block_n, D] multiply.
      k = k.astype(q.dtype)
      scale_mask = live if masked else None
      k_scales = plgpu.load(ks_ref.at[kv_rows], mask=scale_mask,
                            other=None if scale_mask is None else 0.0)
      key_scale = qk_scale * k_scales[None, :]
    s = lax.dot_general(q, k, (((1,), (1,)), ((), ())), precision=lax.Precision.HIGHEST,
                        preferred_element_type=jnp.float32) * key_scale
    if logits_soft_cap is not None:  # capped in natural units, then to base 2
      cap = logits_soft_cap
      s = (cap * triton_backend.LOG2_E) * jnp.tanh(s / cap)
    if alibi:
      s += slopes[:, None] * (key[None, :] - pos[:, None]).astype(jnp.float32)
    if masked:
      visible = key[None, :] <= pos[:, None]
      if windowed:
        visible &= key[None, :] >= first_key(pos)[:, None]
      s = jnp.where(visible, s, -jnp.inf)
    m_new = jnp.maximum(m, jnp.max(s, axis=-1))
    # In a masked block a row may have seen no visible key yet (below its window): its
    # max stays -inf and its weights 0, not exp2(-inf + inf) = NaN. Elsewhere every key
    # is visible, so the max is finite.
    m_safe = jnp.where(m_new == -jnp.inf, 0.0, m_new) if masked else m_new
    alpha = triton_backend.exp2(m - m_safe, interpret)
    p = triton_backend.exp2(s - m_safe[:, None], interpret)
    if quantized:
      # Whole pages, as the decode kernel reads them; slots past last_pos get weight 0.
      v = kv_quant.load_v_block(  # [block_d, block_n]
          v_ref, page_table_ref, b, j * pages_per_block, last_pos + 1 if masked else None,
          head_page=head_page, head_dim=head_dim, page_size=page_size,
          pages_per_block=pages_per_block, cols=cols, col_mask=col_mask).astype(q.dtype)
      # sum_t p_t (s_t v_t) = sum_t (p_t s_t) v_t.
      v_scales = plgpu.load(vs_ref.at[kv_rows], mask=scale_mask,
                            other=None if scale_mask is None else 0.0)
      v_max = None
      if q.dtype == jnp.float16:
        v_scales, v_max = kv_quant.f16_weight_scales(v_scales)
      pv = lax.dot_general((p * v_scales[None, :]).astype(v.dtype), v,
                           (((1,), (1,)), ((), ())), precision=lax.Precision.HIGHEST,
                           preferred_element_type=jnp.float32)
      if v_max is not None:
        pv = pv * v_max
    else:
      v = plgpu.load(v_ref.at[kv_idx], mask=kv_mask, other=other)
      pv = lax.dot_general(p.astype(v.dtype), v, (((1,), (0,)), ((), ())),
                           precision=lax.Precision.HIGHEST, preferred_element_type=jnp.float32)
    return m_new, l * alpha + jnp.sum(p, axis=-1), acc * alpha[:, None] + pv

  carry = (jnp.full((block_m,), -jnp.inf, jnp.float32), jnp.zeros((block_m,), jnp.float32),
           jnp.zeros((block_m, block_d), jnp.float32))
  masked_body = functools.partial(body, masked=True)
  if windowed:
    carry = lax.fori_loop(start, full_lo, masked_body, carry)
  carry = lax.fori_loop(full_lo, full_hi, functools.partial(body, masked=False), carry)
  m, l, acc = lax.fori_loop(full_hi, end, masked_body, carry)
  if sinks:  # each row's head's sink: a logit without a value, in base 2
    sink = plgpu.load(sinks_ref.at[kv_head * group + g], mask=g < group,
                      other=0.0) * triton_backend.LOG2_E
    _, l, acc = paged_attention.count_sink(m, l, acc, sink, interpret)

  # Every real query sees at least its own key, so l > 0 there; padding rows store 0.
  out = jnp.where(real[:, None], acc / jnp.where(real, l, 1.0)[:, None], 0.0)
  store_rows = (tok < num_tokens) & (g < group)
  plgpu.store(o_ref.at[q_idx], out.astype(o_ref.dtype),
              mask=triton_backend.and_masks(store_rows, col_mask))


@functools.partial(jax.jit, static_argnames=[
    "scale", "logits_soft_cap", "sliding_window", "attention_chunk", "interpret",
    "block_q", "block_n", "num_warps", "num_stages"])
def _paged_prefill_pallas(q, k_pages, v_pages, page_table, q_start, q_lengths, layer,
                          k_scales, v_scales, alibi_slopes, sinks, *, scale: float,
                          logits_soft_cap: float | None, sliding_window: int | None,
                          attention_chunk: int | None, interpret: bool, block_q: int,
                          block_n: int, num_warps: int, num_stages: int):
  """k_pages, v_pages: one layer [Hkv, num_pages, page_size, D] (layer 0) or a pool [L, Hkv,
  num_pages, page_size, D], a quantized pool's v_pages token-minor [..., D, page_size];
  layer: int32 scalar; k_scales, v_scales: None, or float32 of k_pages' shape without D for
  int8 / float8 pages; alibi_slopes, sinks: None or float32 [H]."""
  quantized = k_scales is not None
  if k_pages.ndim == 4:  # a pool of one layer (free: a reshape inside jit)
    k_pages, v_pages = k_pages[None], v_pages[None]
  batch, num_tokens, num_heads, head_dim = q.shape
  num_layers, num_kv_heads, num_pages, page_size, _ = k_pages.shape
  group = num_heads // num_kv_heads
  # Token-major views of the pools (free reshapes; token-minor V: row = ((layer * Hkv +
  # head) * pages + page) * D + d); Pallas-Triton forms offsets in 64 bits, so pools past
  # 4 GiB are fine.
  rows = num_layers * num_kv_heads * num_pages * page_size
  v_rows = (v_pages.reshape(rows // page_size * head_dim, page_size) if quantized
            else v_pages.reshape(rows, head_dim))
  scale_refs = [x.reshape(rows) for x in (k_scales, v_scales)] if quantized else []
  head_refs = [x for x in (alibi_slopes, sinks) if x is not None]
  num_q_blocks = pl.cdiv(num_tokens, block_q)
  kernel = functools.partial(
      _prefill_kernel, scale=scale, logits_soft_cap=logits_soft_cap,
      sliding_window=sliding_window, attention_chunk=attention_chunk, num_tokens=num_tokens,
      num_heads=num_heads, num_kv_heads=num_kv_heads, num_pages=num_pages,
      max_pages=page_table.shape[1], page_size=page_size, head_dim=head_dim,
      block_d=pl.next_power_of_2(head_dim), group=group,
      block_g=pl.next_power_of_2(group), block_q=block_q, block_n=block_n,
      num_q_blocks=num_q_blocks, quantized=quantized, alibi=alibi_slopes is not None,
      sinks=sinks is not None, interpret=interpret)
  return pl.pallas_call(
      kernel,
      grid=(num_q_blocks, num_kv_heads, batch),
      out_shape=jax.ShapeDtypeStruct(q.shape, q.dtype),
      compiler_params=triton_backend.compiler_params(num_warps=num_warps,
                                                     num_stages=num_stages),
      interpret=interpret,
      name="paged_prefill_attention",
  )(q_start, q_lengths, page_table, jnp.reshape(layer, (1,)).astype(jnp.int32),
    q, k_pages.reshape(rows, head_dim), v_rows, *scale_refs, *head_refs)


_paged_prefill_reference = jax.jit(reference.paged_prefill_attention,
                                   static_argnames=["scale", "logits_soft_cap",
                                                    "sliding_window", "attention_chunk"])


def paged_prefill_attention(q: jax.Array, k_pages: jax.Array, v_pages: jax.Array,
                            page_table: jax.Array, q_start: jax.Array, q_lengths: jax.Array,
                            *, layer: int | jax.Array | None = None,
                            k_scales: jax.Array | None = None,
                            v_scales: jax.Array | None = None,
                            scale: float | None = None, logits_soft_cap: float | None = None,
                            sliding_window: int | None = None,
                            alibi_slopes: jax.Array | None = None,
                            sinks: jax.Array | None = None,
                            attention_chunk: int | None = None,
                            interpret: bool | None = None, block_q: int | None = None,
                            block_n: int | None = None, num_warps: int | None = None,
                            num_stages: int | None = None) -> jax.Array:
  """A chunk of query tokens per sequence attending causally to its paged K/V cache.

  Row b's query t (t < q_lengths[b]) sits at position p = q_start[b] + t and attends to the
  keys at positions [0, p] (with `sliding_window` W: [p - W + 1, p]), all read from the
  pages: the caller writes this chunk's own K/V into the pages first. q_start[b] = 0 is a
  plain causal prefill; q_start[b] > 0 a chunk after a cached prefix (prefix-cache pages,
  earlier chunks of a long prompt); T = 1 is a decode step.

  Args:
    q: [B, T, H, D] float32 / bfloat16 / float16.
    k_pages, v_pages: [Hkv, num_pages, page_size, D], q's dtype, H % Hkv == 0; or int8 /
      float8_e4m3fn with scales (a quantized pool, read narrow and dequantized in
      registers), whose v_pages are token-minor [Hkv, num_pages, D, page_size], as
      `paged_decode_attention` takes them (and like it, read as whole pages: float8 V must
      hold no NaN in the slots of a row's pages past its last token). With `layer`: a
      whole pool's [num_layers, Hkv, num_pages, page_size, D] (`KVPool.k_pages`,
      `KVPool.v_pages`), of which layer `layer` is read in place (no copy of the layer).
    page_table: int32 [B, max_pages_per_seq], physical page ids in [0, num_pages) for the
      pages a row uses (its first q_start + q_lengths tokens); later entries are never read.
    q_start: int32 [B] >= 0, tokens cached before this chunk.
    q_lengths: int32 [B] in [0, T], real query tokens in each row; rows t >= q_lengths[b]
      are padding and give exactly 0 (a row of length 0 is all padding).
      q_start + q_lengths <= max_pages_per_seq * page_size. Concrete values out of range
      (and used page ids out of range) raise ValueError; under jit the kernel and the
      reference clamp alike (`validation.clamp_prefill`; page ids into [0, num_pages)).
    layer: None, or the layer of 5-D pools to attend to: a Python int in [0, num_layers),
      or a traced int32 scalar (clamped into that range).
    k_scales, v_scales: for int8 / float8_e4m3fn pages, their float32 scales of shape
      k_pages.shape[:-1] (`KVPool.k_scales` / `v_scales`); None for float pages. float8
      kernels need compute capability >= 8.9.
    scale: logits = scale * q.k; defaults to D ** -0.5.
    logits_soft_cap: if set, logits = cap * tanh(logits / cap) before the softmax (Gemma
      2's attention soft-capping).
    sliding_window: W > 0 limits the query at position p to keys [p - W + 1, p] (decode's
      convention: a sequence of length L = p + 1 sees [L - W, L)).
    alibi_slopes: float32 [H] or None: ALiBi (BLOOM's, MPT's positions) adds slope_h *
      (j - p) to head h's logit of the key at position j (after a soft cap).
    sinks: float32 [H] or None: attention sinks (GPT-OSS's), as `paged_decode_attention`
      counts them.
    attention_chunk: C > 0 limits the query at position p to keys [floor(p / C) * C, p]
      (Llama 4's chunked attention).
    interpret: None = Triton kernel on GPU, plain XLA elsewhere; True = Pallas interpret
      mode (tests); False = Triton kernel. Shapes the kernel does not take
      (`validation.kernel_supports`: head dims 64, 80, 96, 128, 256, page sizes 8..128,
      powers of two) and empty q always take the XLA path.
    block_q, block_n, num_warps, num_stages: kernel tuning knobs (query tokens per program,
      keys per step, both powers of two; Triton warps, pipeline stages); None = defaults
      (`default_config`). Quantized pages need block_n >= page_size.

  Returns:
    out [B, T, H, D] in q's dtype.
  """
  k_layer = validation.check_prefill_call(
      q, k_pages, v_pages, page_table, q_start, q_lengths, layer=layer, scale=scale,
      logits_soft_cap=logits_soft_cap, sliding_window=sliding_window,
      strict_kernel_shapes=False, k_scales=k_scales, v_scales=v_scales,
      alibi_slopes=alibi_slopes, sinks=sinks, attention_chunk=attention_chunk)
  for name, knob in (("block_q", block_q), ("block_n", block_n)):
    validation.check_positive_int(name, knob, optional=True, power_of_two=True)
  for name, knob in (("num_warps", num_warps), ("num_stages", num_stages)):
    validation.check_positive_int(name, knob, optional=True)
  if block_n is not None and block_n < 16:
    raise ValueError(f"block_n must be >= 16 (a tensor-core dot's K), got {block_n}")
  validation.check_quantized_block_n(block_n, k_pages, k_scales)
  batch, num_tokens, num_heads, head_dim = q.shape
  num_kv_heads, _, page_size, _ = k_layer.shape
  group = num_heads // num_kv_heads
  if block_q is not None and block_q * pl.next_power_of_2(group) < 16:
    raise ValueError(f"block_q x the q heads per kv head padded to a power of two must be "
                     f">= 16 (a tensor-core dot's M), got block_q={block_q}, group={group}")
  scale = float(head_dim ** -0.5 if scale is None else scale)
  if interpret is None:
    validation.warn_if_reference_on_gpu("paged prefill attention", head_dim, page_size)
  mode = triton_backend.kernel_mode(
      interpret, supported=validation.kernel_supports(head_dim, page_size) and q.size > 0)
  if mode is None:
    return _paged_prefill_reference(q, k_pages, v_pages, page_table, q_start, q_lengths,
                                    layer=layer, k_scales=k_scales, v_scales=v_scales,
                                    scale=scale, logits_soft_cap=logits_soft_cap,
                                    sliding_window=sliding_window,
                                    alibi_slopes=alibi_slopes, sinks=sinks,
                                    attention_chunk=attention_chunk)
  if not mode:
    kv_quant.check_compiled(k_pages, "k_pages")
  if layer is None:
    layer = 0
  elif not isinstance(layer, (int, np.integer)):  # traced: keep the reads inside the pool
    layer = jnp.clip(layer, 0, k_pages.shape[0] - 1)
  page_table = validation.clamp_unchecked_page_ids(page_table, k_layer.shape[1], q_start,
                                                   q_lengths)
  d_q, d_n, d_warps, d_stages = default_config(
      group, head_dim, num_tokens, jnp.dtype(q.dtype).itemsize,
      min_block_n=1 if k_scales is None else page_size)
  return _paged_prefill_pallas(
      q, k_pages, v_pages, page_table, q_start, q_lengths, layer, k_scales, v_scales,
      alibi_slopes, sinks, scale=scale, logits_soft_cap=logits_soft_cap,
      sliding_window=sliding_window, attention_chunk=attention_chunk, interpret=mode,
      block_q=block_q or d_q,
      block_n=block_n or d_n, num_warps=num_warps or d_warps,
      num_stages=num_stages or d_stages)
