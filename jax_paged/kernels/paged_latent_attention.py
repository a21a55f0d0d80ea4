"""Paged latent decode attention (DeepSeek's MLA, up-projections absorbed): a split-KV
Pallas-Triton kernel.

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

Float pages only (an int8 / float8 pool reads through the reference).
"""

from __future__ import annotations

import functools

import jax
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu
import jax.numpy as jnp
import numpy as np

from jax_paged.kernels import merge_attention
from jax_paged.kernels import paged_attention
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


def _latent_decode_kernel(lengths_ref, page_table_ref, layer_ref, q_ref, k_ref, v_ref,
                          o_ref, lse_ref, *, scale: float, num_heads: int, num_pages: int,
                          max_pages: int, page_size: int, head_dim: int, value_dim: int,
                          block_g: int, block_n: int, num_splits: int, interpret: bool):
  """One (head block, split, sequence b) program.

  Refs: lengths [B], page_table [B, max_pages], layer [1], q [B, H, 2 D], k and v [L *
  num_pages * page_size, D] (the pool's one kv head, token rows), o [S, B, H, value_dim],
  lse [S, B, H].
  """
  head_block, split, b = pl.program_id(0), pl.program_id(1), pl.program_id(2)
  length = validation.clamp_lengths(lengths_ref[b], max_pages * page_size)
  base = layer_ref[0] * num_pages * page_size  # the layer's first token row
  per_split = pl.cdiv(pl.cdiv(length, num_splits), block_n) * block_n
  lo = split * per_split
  hi = jnp.minimum(lo + per_split, length)
  num_blocks = pl.cdiv(jnp.maximum(hi - lo, 0), block_n)

  heads = head_block * block_g + jnp.arange(block_g)
  head_mask = heads < num_heads if num_heads % block_g else None
  # The half's pieces: (ref, q's column offset, the piece's (offset, width)); V's pieces
  # past c (the rotated key) take part in the scores only.
  parts = [(k_ref, 0, p) for p in pieces(head_dim)] + [
      (v_ref, head_dim, p) for p in pieces(head_dim)]
  qs = []
  for _, q_offset, (offset, width) in parts:
    cols = q_offset + offset + jnp.arange(width)
    qs.append(plgpu.load(q_ref.at[b, heads[:, None], cols[None, :]],
                         mask=None if head_mask is None else head_mask[:, None],
                         other=None if head_mask is None else 0.0))
  summed = [i for i, (_, q_offset, (offset, _)) in enumerate(parts)
            if q_offset + offset < value_dim]
  row_scale = scale * triton_backend.LOG2_E  # logits in base 2

  def body(i, carry):
    m, l, accs = carry
    tok = lo + i * block_n + jnp.arange(block_n)
    live = tok < hi
    pages = plgpu.load(page_table_ref.at[b, tok // page_size], mask=live, other=0)
    rows = base + pages * page_size + tok % page_size
    tiles, logits = [], None
    for q, (ref, _, (offset, width)) in zip(qs, parts):
      tile = plgpu.load(ref.at[rows[:, None], (offset + jnp.arange(width))[None, :]],
                        mask=live[:, None], other=0.0, eviction_policy="evict_first")
      tiles.append(tile)
      dot = lax.dot_general(q, tile, (((1,), (1,)), ((), ())),
                            precision=lax.Precision.HIGHEST,
                            preferred_element_type=jnp.float32)
      logits = dot if logits is None else logits + dot
    logits = jnp.where(live, logits * row_scale, -jnp.inf)
    # Every block holds at least one live token, so m_new is finite.
    m_new = jnp.maximum(m, jnp.max(logits, axis=-1))
    alpha = triton_backend.exp2(m - m_new, interpret)
    p = triton_backend.exp2(logits - m_new[:, None], interpret)
    accs = tuple(acc * alpha[:, None] + lax.dot_general(
        p.astype(tiles[j].dtype), tiles[j], (((1,), (0,)), ((), ())),
        precision=lax.Precision.HIGHEST, preferred_element_type=jnp.float32)
                 for acc, j in zip(accs, summed))
    return m_new, l * alpha + jnp.sum(p, axis=-1), accs

  init = (jnp.full((block_g,), -jnp.inf, jnp.float32), jnp.zeros((block_g,), jnp.float32),
          tuple(jnp.zeros((block_g, parts[j][2][1]), jnp.float32) for j in summed))
  m, l, accs = lax.fori_loop(0, num_blocks, body, init)

  nonempty = l > 0
  inv = 1.0 / jnp.where(nonempty, l, 1.0)
  for acc, j in zip(accs, summed):
    _, q_offset, (offset, width) = parts[j]
    cols = q_offset + offset + jnp.arange(width)
    mask = cols[None, :] < value_dim
    if head_mask is not None:
      mask &= head_mask[:, None]
    plgpu.store(o_ref.at[split, b, heads[:, None], cols[None, :]],
                (acc * inv[:, None]).astype(o_ref.dtype), mask=mask)
  lse = jnp.where(nonempty, (m + jnp.log2(l)) * triton_backend.LN_2, -jnp.inf)
  plgpu.store(lse_ref.at[split, b, heads], lse, mask=head_mask)


@functools.partial(jax.jit, static_argnames=[
    "value_dim", "scale", "num_splits", "interpret", "block_n", "num_warps", "num_stages"])
def _latent_decode_pallas(q, k_pages, v_pages, page_table, lengths, layer, *, value_dim: int,
                          scale: float, num_splits: int, interpret: bool, block_n: int,
                          num_warps: int, num_stages: int):
  """k_pages, v_pages: a pool [L, 1, num_pages, page_size, D]; layer: int32 scalar."""
  batch, num_heads, _ = q.shape
  num_layers, _, num_pages, page_size, head_dim = k_pages.shape
  block_g = min(_MAX_BLOCK_G, max(16, pl.next_power_of_2(num_heads)))
  rows = num_layers * num_pages * page_size
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
    k_pages.reshape(rows, head_dim), v_pages.reshape(rows, head_dim))
  if num_splits == 1:
    return o[0]
  o, _ = merge_attention.merge_states_pallas(
      [(o.reshape(num_splits, batch * num_heads, value_dim),
        lse.reshape(num_splits, batch * num_heads))], out_dtype=q.dtype, interpret=interpret)
  return o.reshape(batch, num_heads, value_dim)


def paged_latent_decode_attention(q: jax.Array, k_pages: jax.Array, v_pages: jax.Array,
                                  page_table: jax.Array, lengths: jax.Array, *,
                                  value_dim: int, scale: float, layer: int | jax.Array,
                                  num_splits: int | None = None,
                                  interpret: bool | None = None,
                                  block_n: int | None = None, num_warps: int | None = None,
                                  num_stages: int | None = None) -> jax.Array:
  """One query token per sequence, every head attending over the sequence's latents.

  Args:
    q: [B, H, 2 D] float32 / bfloat16 / float16, the queries in latent space.
    k_pages, v_pages: a pool's [num_layers, 1, num_pages, page_size, D] in q's dtype (the
      latents' halves), of which layer `layer` is read in place; D a multiple of 16.
    page_table: int32 [B, max_pages_per_seq].
    lengths: int32 [B], tokens in each sequence (0: output 0). Clamped into range under
      jit, as the reference clamps them.
    value_dim: c's width, in (D, 2 D].
    scale: the softmax scale.
    layer: a Python int in [0, num_layers) or a traced int32 scalar (clamped).
    num_splits: KV partitions per sequence; None picks from B x head blocks against the
      GPU's SM count.
    interpret: None = the Triton kernel on a GPU, the reference elsewhere; True = Pallas
      interpret mode; False = the kernel.
    block_n, num_warps, num_stages: tuning knobs (None: the defaults).

  Returns:
    [B, H, value_dim] in q's dtype.
  """
  if k_pages.ndim != 5 or k_pages.shape[1] != 1 or v_pages.shape != k_pages.shape:
    raise ValueError("k_pages and v_pages must be pools of one kv head, [num_layers, 1, "
                     f"num_pages, page_size, D], got {k_pages.shape} and {v_pages.shape}")
  head_dim = k_pages.shape[-1]
  if q.ndim != 3 or q.shape[-1] != 2 * head_dim:
    raise ValueError(f"q must have shape [batch, num_heads, 2 * D = {2 * head_dim}], got "
                     f"{q.shape}")
  if not kernel_supports(head_dim, value_dim, k_pages.shape[3]):
    raise ValueError(f"the latent kernel takes D a multiple of 16, value_dim in (D, 2 D] "
                     f"and power-of-two page sizes, got D={head_dim}, value_dim={value_dim},"
                     f" page_size={k_pages.shape[3]}")
  for name, x in (("k_pages", k_pages), ("v_pages", v_pages)):
    if x.dtype != q.dtype:
      raise ValueError(f"{name} must have q's dtype {q.dtype} (float pages), got {x.dtype}")
  validation.check_positive_int("block_n", block_n, optional=True, power_of_two=True)
  for name, knob in (("num_splits", num_splits), ("num_warps", num_warps),
                     ("num_stages", num_stages)):
    validation.check_positive_int(name, knob, optional=True)
  mode = triton_backend.kernel_mode(interpret)
  if mode is None or q.size == 0:
    positions = jnp.maximum(lengths - 1, 0)[:, None]
    return reference.paged_latent_attention(
        q[:, None], k_pages, v_pages, page_table, positions, lengths, value_dim=value_dim,
        scale=scale, layer=layer)[:, 0].astype(q.dtype)
  if not isinstance(layer, (int, np.integer)):
    layer = jnp.clip(layer, 0, k_pages.shape[0] - 1)
  page_table = validation.clamp_unchecked_page_ids(page_table, k_pages.shape[2], lengths)
  batch, num_heads = q.shape[:2]
  if num_splits is None:
    # Splits as short as one block (a lone sequence's blocks are dependent gathers of
    # microseconds each: 4-block splits made V2-Lite's batch-1 attention 2x slower), for 2
    # programs per SM (4 ran V2-Lite's batch 64 at 8 splits, 14% slower than 4 with their
    # merge; H200, LOG.md).
    num_splits = paged_attention.auto_num_splits(
        batch, head_blocks(num_heads), page_table.shape[1] * k_pages.shape[3],
        block_n or _BLOCK_N, min_blocks_per_split=1, programs_per_sm=_PROGRAMS_PER_SM)
  return _latent_decode_pallas(
      q, k_pages, v_pages, page_table, lengths, layer, value_dim=value_dim,
      scale=float(scale), num_splits=num_splits, interpret=mode,
      block_n=block_n or _BLOCK_N, num_warps=num_warps or _NUM_WARPS,
      num_stages=num_stages or _NUM_STAGES)
