"""Paged latent attention (DeepSeek's MLA, up-projections absorbed): Pallas-Triton decode
(split-KV) and prefill kernels.

Every query head of a sequence attends over the same cached latent vector per token
(`reference.paged_latent_attention`, whose semantics this is): the token's latent [c;
k_rope] is stored as the K (first half, width D) and V (second half) of a pool's one kv
head. Scores are q . latent and the output sums c = latent[:value_dim].

Grid (head blocks, num_splits, B). A program owns `block_g` query heads of one sequence
and one contiguous slice of its tokens, so each latent byte is read once per head block
(DeepSeek-V2-Lite's 16 heads: once). Each step takes `block_n` tokens, looks their pages
up per token (as `paged_attention`'s kernel) and loads the K and V halves in column
pieces of power-of-two widths (D = 288, DeepSeek's (512 + 64) / 2, as 256 + 32: Triton
tiles are powers of two, and the pieces need no padded columns), accumulating q . latent
as one tensor-core dot per piece and p . c per piece of c. With several splits the
per-split (o, lse) partials go through the merge kernel.

Prefill (`paged_latent_prefill_attention`: a prompt's chunk, several query tokens per
sequence, causal over its cached prefix and itself) is the same walk with a flash-attention
tile: grid (query blocks, head blocks, B), a program's rows its `block_q` tokens x
`block_h` heads (row = token * block_h + head), so that every latent tile loaded serves
them all, walking the keys up to its last query's position with only the diagonal blocks
masked (as `paged_prefill`'s kernel). XLA's reference materialises [T, H, S] f32 scores
per sequence; this keeps nothing but the tile.

An int8 / float8_e4m3fn pool (`KVPool`'s layout: V token-minor, one f32 scale per token
per half) is read as `paged_attention`'s kernel reads it: tiles converted in registers to
q's dtype (exact), V's as whole pages, each half's scales multiplying its logits and its
probabilities. The conversions cost: half the bytes, but 1.1-1.4x the bf16 kernel's time
at DeepSeek-V2-Lite's 16 heads, 1.8x at 128, prefill 1.6-1.9x (benchmarks/RESULTS.md).
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
from jax_paged.kernels import paged_attention
from jax_paged.kernels import paged_prefill
from jax_paged.kernels import reference
from jax_paged.kernels import triton_backend
from jax_paged.kernels import validation

# Query heads per program: DeepSeek-V2-Lite's 16 in one; V2 / V3's 128 in four blocks of
# 32 (a [32, 544] f32 accumulator per program: 64 heads would spill registers).
_MAX_BLOCK_G = 32
# Tokens per step, warps, pipeline stages: the best of 16-128 tokens, 4 / 8 warps, 2 / 3
# stages on every shape of bench_latent_attention (H200, 2026-11-29: 32/4/2 was 2-22%
# slower, 8 warps 10-60% slower; LOG.md).
_BLOCK_N, _NUM_WARPS, _NUM_STAGES = 64, 4, 2
_PROGRAMS_PER_SM = 2
# Prefill: query rows (tokens x heads) per program and warps. 64 rows / 8 warps against 32
# / 4 (within 5% at 16 heads, 1.6x faster at 128), 64 / 4 (1.5x slower: spills), 128 / 8
# (past the shared memory), 32-token steps (1.3-1.4x slower), 3 stages (7-12% slower);
# H200, bench_latent_attention --prefill-configs, LOG.md.
_PREFILL_ROWS, _PREFILL_WARPS = 64, 8


def pieces(width: int) -> tuple[tuple[int, int], ...]:
  """(offset, width) column pieces of powers of two >= 16 covering `width`, widest first
  (288: (0, 256), (256, 32)); () where `width` is not a multiple of 16."""
  if width % 16:
    return ()
  out, offset = [], 0
  for bit in reversed(range(width.bit_length())):
    if width & (1 << bit):
      out.append((offset, 1 << bit))
      offset += 1 << bit
  return tuple(out)


def head_blocks(num_heads: int) -> int:
  """The grid's head blocks for `num_heads` query heads (each program reads the latents
  once per block)."""
  return -(-num_heads // _MAX_BLOCK_G)


def kernel_supports(head_dim: int, value_dim: int, page_size: int) -> bool:
  """Whether the kernel takes latent halves of width `head_dim`, c of width `value_dim`
  (more than one half, at most both) and this page size."""
  return (bool(pieces(head_dim)) and head_dim < value_dim <= 2 * head_dim
          and validation.kernel_page_size_ok(page_size))


def _parts(head_dim: int) -> list:
  """The latent's column pieces: (ref index 0 = K half / 1 = V half, q's column offset,
  (offset, width) in the half)."""
  return [(0, 0, p) for p in pieces(head_dim)] + [(1, head_dim, p) for p in pieces(head_dim)]


def _summed(parts: list, value_dim: int) -> list[int]:
  """Indices of the pieces holding c's columns (V's pieces past c, the rotated key, take
  part in the scores only)."""
  return [i for i, (_, q_offset, (offset, _)) in enumerate(parts)
          if q_offset + offset < value_dim]


def _load_q(q_ref, index, rows_mask, parts: list) -> list[jax.Array]:
  """q's pieces [M, width] of the rows `index(cols)` addresses (masked rows load 0)."""
  return [plgpu.load(q_ref.at[index(q_offset + offset + jnp.arange(width))],
                     mask=None if rows_mask is None else rows_mask[:, None],
                     other=None if rows_mask is None else 0.0)
          for _, q_offset, (offset, width) in parts]


def _read_block(refs, page_table_ref, b, start, live, end, *, head_page, page_size: int,
                head_dim: int, block_n: int, parts: list, dtype):
  """The latent tiles of sequence b's tokens [start, start + block_n), by piece.

  refs: (k, v) token rows [L * num_pages * page_size, D] of a float pool, or (k, v, k
  scales, v scales) of an int8 / float8 one (v token-minor [L * num_pages * D, page_size],
  scales [L * num_pages * page_size]). live: None (every token is the sequence's) or the
  [N] tokens to read (others load 0); end: None or the first token not read, the bound
  of V's whole pages. Returns (tiles: token-major [N, width], a quantized pool's V
  token-minor [width, N], converted to `dtype`; None or the halves' scales [N], 0 where
  not live)."""
  tok = start + jnp.arange(block_n)
  pages = plgpu.load(page_table_ref.at[b, tok // page_size], mask=live,
                     other=None if live is None else 0)
  rows = (head_page + pages) * page_size + tok % page_size
  quantized = len(refs) == 4
  tiles = []
  for half, _, (offset, width) in parts:
    cols = offset + jnp.arange(width)
    if quantized and half == 1:
      tile = kv_quant.load_v_block(
          refs[1], page_table_ref, b, start // page_size, end, head_page=head_page,
          head_dim=head_dim, page_size=page_size, pages_per_block=block_n // page_size,
          cols=cols, col_mask=None, eviction_policy="evict_first")
    else:
      tile = plgpu.load(refs[half].at[rows[:, None], cols[None, :]],
                        mask=None if live is None else live[:, None],
                        other=None if live is None else 0.0, eviction_policy="evict_first")
    # Narrow values convert exactly; the scales multiply the logits and the weights.
    tiles.append(tile.astype(dtype) if quantized else tile)
  if not quantized:
    return tiles, None
  return tiles, tuple(plgpu.load(ref.at[rows], mask=live, other=None if live is None else 0.0)
                      for ref in refs[2:])


def _logits(qs: list[jax.Array], tiles: list[jax.Array], scales, parts: list) -> jax.Array:
  """f32 q . latent [M, N]: one tensor-core dot per piece, a quantized pool's halves times
  their tokens' scales."""
  halves = [None, None]
  for q, tile, (half, _, _) in zip(qs, tiles, parts):
    token_minor = scales is not None and half == 1  # [width, N]
    dot = lax.dot_general(q, tile, (((1,), (0 if token_minor else 1,)), ((), ())),
                          precision=lax.Precision.HIGHEST, preferred_element_type=jnp.float32)
    halves[half] = dot if halves[half] is None else halves[half] + dot
  if scales is not None:
    halves = [x * scale[None, :] for x, scale in zip(halves, scales)]
  return halves[0] + halves[1]


def _softmax_step(carry, logits: jax.Array, tiles: list[jax.Array], scales, parts: list,
                  summed: list[int], interpret: bool):
  """One block of the online softmax in base 2: logits [M, N] (every row's max finite after
  this block), c's tiles summed into the accumulators (a quantized pool's weighted by
  their tokens' scales: sum_t p_t (s_t x_t) = sum_t (p_t s_t) x_t)."""
  m, l, accs = carry
  m_new = jnp.maximum(m, jnp.max(logits, axis=-1))
  alpha = triton_backend.exp2(m - m_new, interpret)
  p = triton_backend.exp2(logits - m_new[:, None], interpret)
  new_accs = []
  for acc, j in zip(accs, summed):
    half, tile = parts[j][0], tiles[j]
    token_minor = scales is not None and half == 1
    w = p if scales is None else p * scales[half][None, :]
    new_accs.append(acc * alpha[:, None] + lax.dot_general(
        w.astype(tile.dtype), tile, (((1,), (1 if token_minor else 0,)), ((), ())),
        precision=lax.Precision.HIGHEST, preferred_element_type=jnp.float32))
  return m_new, l * alpha + jnp.sum(p, axis=-1), tuple(new_accs)


def _init_carry(rows: int, parts: list, summed: list[int]):
  return (jnp.full((rows,), -jnp.inf, jnp.float32), jnp.zeros((rows,), jnp.float32),
          tuple(jnp.zeros((rows, parts[j][2][1]), jnp.float32) for j in summed))


def _store_c(o_ref, index, accs, inv: jax.Array, rows_mask, parts: list, summed: list[int],
             value_dim: int) -> None:
  """Stores acc * inv per row for c's columns of the rows `index(cols)` addresses."""
  for acc, j in zip(accs, summed):
    _, q_offset, (offset, width) = parts[j]
    cols = q_offset + offset + jnp.arange(width)
    mask = cols[None, :] < value_dim
    if rows_mask is not None:
      mask &= rows_mask[:, None]
    plgpu.store(o_ref.at[index(cols)], (acc * inv[:, None]).astype(o_ref.dtype), mask=mask)


def _latent_decode_kernel(lengths_ref, page_table_ref, layer_ref, q_ref, k_ref, v_ref,
                          *refs, scale: float, num_heads: int, num_pages: int,
                          max_pages: int, page_size: int, head_dim: int, value_dim: int,
                          block_g: int, block_n: int, num_splits: int, interpret: bool):
  """One (head block, split, sequence b) program.

  Refs: lengths [B], page_table [B, max_pages], layer [1], q [B, H, 2 D], k and v [L *
  num_pages * page_size, D] (the pool's one kv head, token rows; quantized: v token-minor
  and the k / v scales, as `_read_block` takes them), o [S, B, H, value_dim], lse [S, B,
  H].
  """
  scale_refs, (o_ref, lse_ref) = refs[:-2], refs[-2:]
  head_block, split, b = pl.program_id(0), pl.program_id(1), pl.program_id(2)
  length = validation.clamp_lengths(lengths_ref[b], max_pages * page_size)
  per_split = pl.cdiv(pl.cdiv(length, num_splits), block_n) * block_n
  lo = split * per_split
  hi = jnp.minimum(lo + per_split, length)
  num_blocks = pl.cdiv(jnp.maximum(hi - lo, 0), block_n)

  heads = head_block * block_g + jnp.arange(block_g)
  head_mask = heads < num_heads if num_heads % block_g else None
  parts = _parts(head_dim)
  summed = _summed(parts, value_dim)
  qs = _load_q(q_ref, lambda cols: (b, heads[:, None], cols[None, :]), head_mask, parts)
  row_scale = scale * triton_backend.LOG2_E  # logits in base 2

  def body(i, carry):
    start = lo + i * block_n
    live = start + jnp.arange(block_n) < hi
    tiles, scales = _read_block(
        (k_ref, v_ref, *scale_refs), page_table_ref, b, start, live, hi,
        head_page=layer_ref[0] * num_pages, page_size=page_size, head_dim=head_dim,
        block_n=block_n, parts=parts, dtype=q_ref.dtype)
    # Every block holds at least one live token, so each row's max is finite.
    logits = jnp.where(live, _logits(qs, tiles, scales, parts) * row_scale, -jnp.inf)
    return _softmax_step(carry, logits, tiles, scales, parts, summed, interpret)

  m, l, accs = lax.fori_loop(0, num_blocks, body, _init_carry(block_g, parts, summed))
  nonempty = l > 0
  _store_c(o_ref, lambda cols: (split, b, heads[:, None], cols[None, :]), accs,
           1.0 / jnp.where(nonempty, l, 1.0), head_mask, parts, summed, value_dim)
  lse = jnp.where(nonempty, (m + jnp.log2(l)) * triton_backend.LN_2, -jnp.inf)
  plgpu.store(lse_ref.at[split, b, heads], lse, mask=head_mask)


def _latent_prefill_kernel(q_start_ref, q_len_ref, page_table_ref, layer_ref, q_ref, k_ref,
                           v_ref, *refs, scale: float, num_tokens: int, num_heads: int,
                           num_pages: int, max_pages: int, page_size: int, head_dim: int,
                           value_dim: int, block_h: int, block_q: int, block_n: int,
                           num_q_blocks: int, interpret: bool):
  """One (query block, head block, sequence b) program.

  Refs: q_start, q_len [B], page_table [B, max_pages], layer [1], q [B, T, H, 2 D], k and
  v (and a quantized pool's scales) as the decode kernel's, o [B, T, H, value_dim].
  """
  scale_refs, o_ref = refs[:-1], refs[-1]
  q_block = num_q_blocks - 1 - pl.program_id(0)  # the longest (last) block first
  head_block, b = pl.program_id(1), pl.program_id(2)
  q_start, q_len = validation.clamp_prefill(q_start_ref[b], q_len_ref[b],
                                            num_tokens=num_tokens,
                                            capacity=max_pages * page_size)

  r = jnp.arange(block_q * block_h)
  tok = q_block * block_q + r // block_h  # the row's query token
  head = head_block * block_h + r % block_h
  real = (tok < q_len) & (head < num_heads)
  pos = q_start + tok
  parts = _parts(head_dim)
  summed = _summed(parts, value_dim)
  # Every row's (token, head) is distinct, padding included (interpret mode stores a masked
  # row by writing back what it read: two rows at one address could undo a real store).
  index = lambda cols: (b, tok[:, None], head[:, None], cols[None, :])  # noqa: E731
  qs = _load_q(q_ref, index, real, parts)  # padding rows 0, whatever the caller left there
  row_scale = scale * triton_backend.LOG2_E

  # The tile's real queries sit at positions [first_pos, last_pos]: blocks [0, full_hi)
  # hold keys every one of them sees, [full_hi, end) keys past some query's position.
  first_pos = q_start + q_block * block_q
  last_pos = q_start + jnp.minimum(q_len, (q_block + 1) * block_q) - 1
  end = jnp.where(last_pos >= first_pos, last_pos // block_n + 1, 0)
  full_hi = jnp.minimum((first_pos + 1) // block_n, end)

  def body(j, carry, *, masked: bool):
    key = j * block_n + jnp.arange(block_n)
    # Unmasked blocks lie inside the sequence.
    live, stop = (key <= last_pos, last_pos + 1) if masked else (None, None)
    tiles, scales = _read_block(
        (k_ref, v_ref, *scale_refs), page_table_ref, b, j * block_n, live, stop,
        head_page=layer_ref[0] * num_pages, page_size=page_size, head_dim=head_dim,
        block_n=block_n, parts=parts, dtype=q_ref.dtype)
    logits = _logits(qs, tiles, scales, parts) * row_scale
    if masked:
      # Blocks run from key 0, which every row sees: each row's max is finite from the
      # first block on, so a row seeing none of a masked block's keys keeps it.
      logits = jnp.where(key[None, :] <= pos[:, None], logits, -jnp.inf)
    return _softmax_step(carry, logits, tiles, scales, parts, summed, interpret)

  carry = lax.fori_loop(0, full_hi, functools.partial(body, masked=False),
                        _init_carry(block_q * block_h, parts, summed))
  _, l, accs = lax.fori_loop(full_hi, end, functools.partial(body, masked=True), carry)
  # Every real query sees at least its own key (l > 0); padding rows store 0.
  inv = jnp.where(real, 1.0 / jnp.where(real, l, 1.0), 0.0)
  _store_c(o_ref, index, accs, inv, (tok < num_tokens) & (head < num_heads), parts, summed,
           value_dim)


def _pool_operands(k_pages, v_pages, k_scales, v_scales) -> list[jax.Array]:
  """A pool [L, 1, num_pages, page_size, D] as the kernels' refs (free reshapes): K and V
  token rows [L * num_pages * page_size, D], a quantized pool's V token-minor rows [L *
  num_pages * D, page_size] and its scales [L * num_pages * page_size]."""
  num_layers, _, num_pages, page_size, head_dim = k_pages.shape
  rows = num_layers * num_pages * page_size
  if k_scales is None:
    return [k_pages.reshape(rows, head_dim), v_pages.reshape(rows, head_dim)]
  return [k_pages.reshape(rows, head_dim), v_pages.reshape(rows // page_size * head_dim,
                                                            page_size),
          k_scales.reshape(rows), v_scales.reshape(rows)]


@functools.partial(jax.jit, static_argnames=[
    "value_dim", "scale", "num_splits", "interpret", "block_n", "num_warps", "num_stages"])
def _latent_decode_pallas(q, k_pages, v_pages, page_table, lengths, layer, k_scales,
                          v_scales, *, value_dim: int, scale: float, num_splits: int,
                          interpret: bool, block_n: int, num_warps: int, num_stages: int):
  """k_pages, v_pages: a pool [L, 1, num_pages, page_size, D] (a quantized pool's v_pages
  token-minor, with its scales; else the scales None); layer: int32 scalar."""
  batch, num_heads, _ = q.shape
  _, _, num_pages, page_size, head_dim = k_pages.shape
  block_g = min(_MAX_BLOCK_G, max(16, pl.next_power_of_2(num_heads)))
  kernel = functools.partial(
      _latent_decode_kernel, scale=scale, num_heads=num_heads, num_pages=num_pages,
      max_pages=page_table.shape[1], page_size=page_size, head_dim=head_dim,
      value_dim=value_dim, block_g=block_g, block_n=block_n, num_splits=num_splits,
      interpret=interpret)
  part_dtype = q.dtype if num_splits == 1 else jnp.float32
  o, lse = pl.pallas_call(
      kernel,
      grid=(pl.cdiv(num_heads, block_g), num_splits, batch),
      out_shape=(jax.ShapeDtypeStruct((num_splits, batch, num_heads, value_dim), part_dtype),
                 jax.ShapeDtypeStruct((num_splits, batch, num_heads), jnp.float32)),
      compiler_params=triton_backend.compiler_params(num_warps=num_warps,
                                                     num_stages=num_stages),
      interpret=interpret,
      name="paged_latent_attention",
  )(lengths, page_table, jnp.reshape(layer, (1,)).astype(jnp.int32), q,
    *_pool_operands(k_pages, v_pages, k_scales, v_scales))
  if num_splits == 1:
    return o[0]
  o, _ = merge_attention.merge_states_pallas(
      [(o.reshape(num_splits, batch * num_heads, value_dim),
        lse.reshape(num_splits, batch * num_heads))], out_dtype=q.dtype, interpret=interpret)
  return o.reshape(batch, num_heads, value_dim)


def _check_rows(name: str, x, batch: int) -> None:
  """Raises ValueError unless x is int32 [batch]."""
  if x.shape != (batch,) or x.dtype != jnp.int32:
    raise ValueError(f"{name} must be int32 [batch={batch}], got {x.dtype} {x.shape}")


def _check_latent_call(q, k_pages, v_pages, page_table, k_scales, v_scales, value_dim: int,
                       q_shape: str, block_n: int | None) -> bool:
  """The checks both wrappers share: a pool of one kv head in q's dtype (or int8 /
  float8_e4m3fn with its scales), widths the kernels take, q [..., 2 D] of rank
  len(q_shape's names), an int32 page table of q's batch, block_n; returns whether the
  kernel can take the call (not a quantized pool under a float16 q: the reference takes
  that)."""
  quantized = kv_quant.is_quantized(k_pages.dtype)
  v_shape = kv_quant.v_pages_shape(k_pages.shape, k_pages.dtype)
  if k_pages.ndim != 5 or k_pages.shape[1] != 1 or v_pages.shape != v_shape:
    raise ValueError("k_pages and v_pages must be pools of one kv head, [num_layers, 1, "
                     "num_pages, page_size, D] (an int8 / float8 pool's v_pages token-minor, "
                     f"[..., D, page_size]), got {k_pages.shape} and {v_pages.shape}")
  validation.check_scales(k_pages, v_pages, k_scales, v_scales)
  head_dim = k_pages.shape[-1]
  if q.ndim != q_shape.count(",") + 1 or q.shape[-1] != 2 * head_dim:
    raise ValueError(f"q must have shape {q_shape} = {2 * head_dim}], got {q.shape}")
  if (page_table.ndim != 2 or page_table.shape[0] != q.shape[0]
      or page_table.dtype != jnp.int32):
    raise ValueError(f"page_table must be int32 [batch={q.shape[0]}, max_pages_per_seq], "
                     f"got {page_table.dtype} {page_table.shape}")
  if q.dtype not in validation.SUPPORTED_DTYPES:
    raise ValueError(f"q dtype must be float32, bfloat16 or float16, got {q.dtype}")
  if not kernel_supports(head_dim, value_dim, k_pages.shape[3]):
    raise ValueError(f"the latent kernel takes D a multiple of 16, value_dim in (D, 2 D] "
                     f"and power-of-two page sizes, got D={head_dim}, value_dim={value_dim},"
                     f" page_size={k_pages.shape[3]}")
  for name, x in (("k_pages", k_pages), ("v_pages", v_pages)):
    if x.dtype != q.dtype and not quantized:
      raise ValueError(f"{name} must have q's dtype {q.dtype} or be int8 / float8_e4m3fn "
                       f"with their scales, got {x.dtype}")
  validation.check_positive_int("block_n", block_n, optional=True, power_of_two=True)
  if block_n is not None and block_n < 16:
    raise ValueError(f"block_n must be >= 16 (a tensor-core dot's K), got {block_n}")
  validation.check_quantized_block_n(block_n, k_pages, k_scales)
  # A float16 q would weight the narrow values by p x scale in float16 (underflowing):
  # the reference's f32 path instead.
  return not (quantized and q.dtype == jnp.float16)


def _default_block_n(k_pages, k_scales) -> int:
  """Tokens per step: a quantized pool's blocks read whole pages of its V."""
  return _BLOCK_N if k_scales is None else max(_BLOCK_N, k_pages.shape[3])


def paged_latent_decode_attention(q: jax.Array, k_pages: jax.Array, v_pages: jax.Array,
                                  page_table: jax.Array, lengths: jax.Array, *,
                                  value_dim: int, scale: float, layer: int | jax.Array,
                                  k_scales: jax.Array | None = None,
                                  v_scales: jax.Array | None = None,
                                  num_splits: int | None = None,
                                  interpret: bool | None = None,
                                  block_n: int | None = None, num_warps: int | None = None,
                                  num_stages: int | None = None) -> jax.Array:
  """One query token per sequence, every head attending over the sequence's latents.

  Args:
    q: [B, H, 2 D] float32 / bfloat16 / float16, the queries in latent space.
    k_pages, v_pages: a pool's [num_layers, 1, num_pages, page_size, D] (the latents'
      halves) in q's dtype, or int8 / float8_e4m3fn with v_pages token-minor [..., D,
      page_size] (`KVPool`'s quantized layout), of which layer `layer` is read in place;
      D a multiple of 16.
    page_table: int32 [B, max_pages_per_seq].
    lengths: int32 [B], tokens in each sequence (0: output 0). Concrete values outside
      [0, max_pages_per_seq * page_size], or page ids outside the pool in the pages used,
      raise ValueError (as `paged_decode_attention`'s); under jit they are clamped alike.
    value_dim: c's width, in (D, 2 D].
    scale: the softmax scale.
    layer: a Python int in [0, num_layers) or a traced int32 scalar (clamped).
    k_scales, v_scales: a quantized pool's float32 scales [num_layers, 1, num_pages,
      page_size] (`KVPool.k_scales` / `v_scales`), dequantized in registers; None for
      float pages. A float16 q over a quantized pool takes the reference.
    num_splits: KV partitions per sequence; None picks from B x head blocks against the
      GPU's SM count.
    interpret: None = the Triton kernel on a GPU, the reference elsewhere; True = Pallas
      interpret mode; False = the kernel.
    block_n, num_warps, num_stages: tuning knobs (None: the defaults; a quantized pool's
      block_n >= page_size).

  Returns:
    [B, H, value_dim] in q's dtype.
  """
  supported = _check_latent_call(q, k_pages, v_pages, page_table, k_scales, v_scales,
                                 value_dim, "[batch, num_heads, 2 * D", block_n)
  _check_rows("lengths", lengths, q.shape[0])
  validation.check_decode_values(page_table, lengths, num_pages=k_pages.shape[2],
                                 page_size=k_pages.shape[3])
  for name, knob in (("num_splits", num_splits), ("num_warps", num_warps),
                     ("num_stages", num_stages)):
    validation.check_positive_int(name, knob, optional=True)
  mode = triton_backend.kernel_mode(interpret, supported=supported and q.size > 0)
  if mode is None:
    positions = jnp.maximum(lengths - 1, 0)[:, None]
    return reference.paged_latent_attention(
        q[:, None], k_pages, v_pages, page_table, positions, lengths, value_dim=value_dim,
        scale=scale, layer=layer, k_scales=k_scales, v_scales=v_scales)[:, 0].astype(q.dtype)
  if not mode:
    kv_quant.check_compiled(k_pages, "k_pages")
  if not isinstance(layer, (int, np.integer)):
    layer = jnp.clip(layer, 0, k_pages.shape[0] - 1)
  page_table = validation.clamp_unchecked_page_ids(page_table, k_pages.shape[2], lengths)
  batch, num_heads = q.shape[:2]
  block_n = block_n or _default_block_n(k_pages, k_scales)
  if num_splits is None:
    # Splits as short as one block (a lone sequence's blocks are dependent gathers of
    # microseconds each: 4-block splits made V2-Lite's batch-1 attention 2x slower), for 2
    # programs per SM (4 ran V2-Lite's batch 64 at 8 splits, 14% slower than 4 with their
    # merge; H200, LOG.md).
    num_splits = paged_attention.auto_num_splits(
        batch, head_blocks(num_heads), page_table.shape[1] * k_pages.shape[3], block_n,
        min_blocks_per_split=1, programs_per_sm=_PROGRAMS_PER_SM)
  return _latent_decode_pallas(
      q, k_pages, v_pages, page_table, lengths, layer, k_scales, v_scales,
      value_dim=value_dim, scale=float(scale), num_splits=num_splits, interpret=mode,
      block_n=block_n, num_warps=num_warps or _NUM_WARPS,
      num_stages=num_stages or _NUM_STAGES)


@functools.partial(jax.jit, static_argnames=[
    "value_dim", "scale", "interpret", "block_q", "block_n", "num_warps", "num_stages"])
def _latent_prefill_pallas(q, k_pages, v_pages, page_table, q_start, q_lengths, layer,
                           k_scales, v_scales, *, value_dim: int, scale: float,
                           interpret: bool, block_q: int, block_n: int, num_warps: int,
                           num_stages: int):
  """As `_latent_decode_pallas`'s operands."""
  batch, num_tokens, num_heads, _ = q.shape
  _, _, num_pages, page_size, head_dim = k_pages.shape
  block_h = min(_MAX_BLOCK_G, pl.next_power_of_2(num_heads))
  num_q_blocks = pl.cdiv(num_tokens, block_q)
  kernel = functools.partial(
      _latent_prefill_kernel, scale=scale, num_tokens=num_tokens, num_heads=num_heads,
      num_pages=num_pages, max_pages=page_table.shape[1], page_size=page_size,
      head_dim=head_dim, value_dim=value_dim, block_h=block_h, block_q=block_q,
      block_n=block_n, num_q_blocks=num_q_blocks, interpret=interpret)
  return pl.pallas_call(
      kernel,
      grid=(num_q_blocks, pl.cdiv(num_heads, block_h), batch),
      out_shape=jax.ShapeDtypeStruct((batch, num_tokens, num_heads, value_dim), q.dtype),
      compiler_params=triton_backend.compiler_params(num_warps=num_warps,
                                                     num_stages=num_stages),
      interpret=interpret,
      name="paged_latent_prefill_attention",
  )(q_start, q_lengths, page_table, jnp.reshape(layer, (1,)).astype(jnp.int32), q,
    *_pool_operands(k_pages, v_pages, k_scales, v_scales))


def paged_latent_prefill_attention(q: jax.Array, k_pages: jax.Array, v_pages: jax.Array,
                                   page_table: jax.Array, q_start: jax.Array,
                                   q_lengths: jax.Array, *, value_dim: int, scale: float,
                                   layer: int | jax.Array,
                                   k_scales: jax.Array | None = None,
                                   v_scales: jax.Array | None = None,
                                   interpret: bool | None = None,
                                   block_q: int | None = None, block_n: int | None = None,
                                   num_warps: int | None = None,
                                   num_stages: int | None = None) -> jax.Array:
  """A chunk of T query tokens per sequence attending causally over its latents: the
  cached prefix and the chunk's own, which the caller wrote first.

  Args:
    q: [B, T, H, 2 D] float32 / bfloat16 / float16, the queries in latent space.
    k_pages, v_pages, k_scales, v_scales: the pool, as `paged_latent_decode_attention`'s.
    page_table: int32 [B, max_pages_per_seq].
    q_start: int32 [B] >= 0, tokens cached before this chunk: query t sits at position
      q_start + t and sees the keys at positions <= its own.
    q_lengths: int32 [B] in [0, T], real query tokens in each row; rows t >= q_lengths[b]
      are padding and give exactly 0. Concrete values out of range raise ValueError (as
      `paged_prefill_attention`'s); under jit they are clamped alike.
    value_dim: c's width, in (D, 2 D].
    scale: the softmax scale.
    layer: a Python int in [0, num_layers) or a traced int32 scalar (clamped).
    interpret: None = the Triton kernel on a GPU, the reference elsewhere; True = Pallas
      interpret mode; False = the kernel.
    block_q, block_n, num_warps, num_stages: tuning knobs (query tokens per program, keys
      per step, both powers of two; None: the defaults).

  Returns:
    [B, T, H, value_dim] in q's dtype.
  """
  supported = _check_latent_call(q, k_pages, v_pages, page_table, k_scales, v_scales,
                                 value_dim, "[batch, num_tokens, num_heads, 2 * D", block_n)
  batch, num_tokens, num_heads, _ = q.shape
  for name, x in (("q_start", q_start), ("q_lengths", q_lengths)):
    _check_rows(name, x, batch)
  validation.check_prefill_values(page_table, q_start, q_lengths, num_tokens=num_tokens,
                                  num_pages=k_pages.shape[2], page_size=k_pages.shape[3])
  validation.check_positive_int("block_q", block_q, optional=True, power_of_two=True)
  for name, knob in (("num_warps", num_warps), ("num_stages", num_stages)):
    validation.check_positive_int(name, knob, optional=True)
  block_h = min(_MAX_BLOCK_G, pl.next_power_of_2(num_heads))
  if block_q is not None and block_q * block_h < 16:
    raise ValueError(f"block_q x the heads per program ({block_h}) must be >= 16 (a "
                     f"tensor-core dot's M), got block_q={block_q}")
  mode = triton_backend.kernel_mode(interpret, supported=supported and q.size > 0)
  if mode is None:
    q_start, q_lengths = validation.clamp_prefill(
        q_start, q_lengths, num_tokens=num_tokens,
        capacity=page_table.shape[1] * k_pages.shape[3])
    t = jnp.arange(num_tokens)
    o = reference.paged_latent_attention(
        q, k_pages, v_pages, page_table, q_start[:, None] + t, q_start + q_lengths,
        value_dim=value_dim, scale=scale, layer=layer, k_scales=k_scales, v_scales=v_scales)
    return jnp.where((t[None, :] < q_lengths[:, None])[..., None, None], o, 0.0
                     ).astype(q.dtype)
  if not mode:
    kv_quant.check_compiled(k_pages, "k_pages")
  if not isinstance(layer, (int, np.integer)):
    layer = jnp.clip(layer, 0, k_pages.shape[0] - 1)
  page_table = validation.clamp_unchecked_page_ids(page_table, k_pages.shape[2], q_start,
                                                   q_lengths)
  if block_q is None:
    block_q = paged_prefill.query_block(_PREFILL_ROWS, block_h, num_tokens)
  return _latent_prefill_pallas(
      q, k_pages, v_pages, page_table, q_start, q_lengths, layer, k_scales, v_scales,
      value_dim=value_dim, scale=float(scale), interpret=mode, block_q=block_q,
      block_n=block_n or _default_block_n(k_pages, k_scales),
      num_warps=num_warps or _PREFILL_WARPS, num_stages=num_stages or _NUM_STAGES)
