"""Writing new tokens' K/V into the pool's pages: a Pallas-Triton kernel (vLLM's
reshape_and_cache).

XLA writes K and V with one scatter each, and in a decode step each scatter also
re-reduces the split-K partial sums of the qkv projection it reads from: 2 kernels of
~3.7 µs per layer at GPT-2 124M, batch 128, on an H200 (benchmarks/LOG.md,
"K/V write and reserve"). This kernel
writes both in one launch, in place: the pool arrays are aliased to its outputs, so a
caller that donates the pool (a jitted decode step) moves only the new tokens' bytes.

Grid (tokens,): program n copies token n's [Hkv, D] K and V rows to flat slot
`slots[n]` of every kv head of `layer`. Negative or out-of-range slots (padding), and
every slot of an out-of-range (traced) layer, write nothing. For a quantized pool (int8 /
float8) a program quantizes its rows (`kv_quant.quantize`: one scale per head) and stores
the scales at the same slots of the scale arrays, and its V token-minor (a token's D
values page_size apart, `kv_quant.v_pages_shape`); the fused projection does the same in
its epilogue when a head is exactly one column block.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from jax_paged.kernels import kv_quant
from jax_paged.kernels import linear
from jax_paged.kernels import triton_backend


def _writable(slot, layer, *, slots_per_head: int, num_layers: int):
  """Inside a kernel: whether a token's slot and the layer address the pool (padding and
  out-of-range slots or layers are not written)."""
  return (slot >= 0) & (slot < slots_per_head) & (layer >= 0) & (layer < num_layers)


def _store_rows(ref, token_rows, cols, x, mask, *, tokens_minor: bool, page_size: int,
                head_dim: int):
  """Inside a kernel: stores x [R, block_d] as the D values of pool token rows
  `token_rows` [R] (row = (layer * Hkv + head) * slots_per_head + slot), in a flat pool
  [rows, D], or with `tokens_minor` [rows / page_size * D, page_size] (a quantized pool's
  V: element d of a token sits in row (row // page_size) * D + d, column row % page_size)."""
  if tokens_minor:
    idx = ((token_rows // page_size * head_dim)[:, None] + cols[None, :],
           jnp.broadcast_to((token_rows % page_size)[:, None], x.shape))
    mask = jnp.broadcast_to(mask, x.shape)
  else:
    idx = (token_rows[:, None], cols[None, :])
  plgpu.store(ref.at[idx], x, mask=mask)


def _write_kernel(layer_ref, slots_ref, k_ref, v_ref, *refs, num_layers: int,
                  num_kv_heads: int, head_dim: int, page_size: int, slots_per_head: int,
                  block_h: int, block_d: int, quantized: bool):
  """Refs: layer [1], slots [N], k/v [N, Hkv, D]; pools (in and aliased out) K [L * Hkv *
  slots_per_head, D], V the same or (quantized) token-minor [L * Hkv * slots_per_head /
  page_size * D, page_size], and for a quantized pool their scales (in and aliased out)
  [L * Hkv * slots_per_head]. The inputs aliased to outputs are unused."""
  outs = refs[len(refs) // 2:]  # k, v pages (and k, v scales)
  n = pl.program_id(0)
  slot = slots_ref[n]
  layer = layer_ref[0]
  heads = jnp.arange(block_h)
  cols = jnp.arange(block_d)
  valid = _writable(slot, layer, slots_per_head=slots_per_head, num_layers=num_layers)
  head_mask = (heads < num_kv_heads) & valid
  mask = head_mask[:, None] & (cols[None, :] < head_dim)
  src = (n, heads[:, None], cols[None, :])
  rows = (layer * num_kv_heads + heads) * slots_per_head + jnp.maximum(slot, 0)
  for i, x_ref in enumerate((k_ref, v_ref)):
    x = plgpu.load(x_ref.at[src], mask=mask, other=0.0)
    if quantized:
      # Masked columns load as 0: they do not change a row's absmax.
      x, scales = kv_quant.quantize(x, outs[i].dtype)
      plgpu.store(outs[2 + i].at[rows], scales, mask=head_mask)
    _store_rows(outs[i], rows, cols, x, mask, tokens_minor=quantized and i == 1,
                page_size=page_size, head_dim=head_dim)


def _flat_pool(k_pages, v_pages, k_scales, v_scales):
  """The pool arrays a kernel writes, as free bitcasts to rows: pages [L * Hkv * P *
  page_size, D] (a quantized pool's token-minor V: [L * Hkv * P * D, page_size]), then
  (quantized) scales [L * Hkv * P * page_size]; and their shapes."""
  arrays = [k_pages, v_pages] + ([] if k_scales is None else [k_scales, v_scales])
  shapes = [x.shape for x in arrays]
  flat = [x.reshape((-1,) + x.shape[4:]) for x in arrays]
  return flat, shapes


@functools.partial(jax.jit, static_argnames=["interpret"])
def write_kv_pallas(k_pages: jax.Array, v_pages: jax.Array, layer: jax.Array,
                    slots: jax.Array, k: jax.Array, v: jax.Array, *, interpret: bool,
                    k_scales: jax.Array | None = None, v_scales: jax.Array | None = None
                    ) -> tuple[jax.Array, ...]:
  """The kernel behind `jax_paged.pool.write_kv` on a GPU.

  Args:
    k_pages, v_pages: [L, Hkv, P, page_size, D] (a quantized pool's v_pages [L, Hkv, P,
      D, page_size]), updated in place when donated.
    layer: int32 scalar.
    slots: int32 [N] flat slots (page * page_size + offset); outside [0, P * page_size)
      = not written.
    k, v: [N, Hkv, D] in the pool's dtype; for a quantized pool any float dtype, quantized
      in the kernel (`kv_quant.quantize`).
    k_scales, v_scales: a quantized pool's float32 scales [L, Hkv, P, page_size] (updated
      in place when donated), else None.

  Returns:
    (k_pages, v_pages), and for a quantized pool (k_pages, v_pages, k_scales, v_scales),
    with the N tokens written.
  """
  layers, hkv, pages, page_size, d = k_pages.shape
  slots_per_head = pages * page_size
  flat, shapes = _flat_pool(k_pages, v_pages, k_scales, v_scales)
  kernel = functools.partial(
      _write_kernel, num_layers=layers, num_kv_heads=hkv, head_dim=d, page_size=page_size,
      slots_per_head=slots_per_head, block_h=pl.next_power_of_2(hkv),
      block_d=pl.next_power_of_2(d), quantized=k_scales is not None)
  outs = pl.pallas_call(
      kernel,
      grid=(slots.shape[0],),
      out_shape=[jax.ShapeDtypeStruct(x.shape, x.dtype) for x in flat],
      input_output_aliases={4 + i: i for i in range(len(flat))},
      compiler_params=triton_backend.compiler_params(num_warps=1, num_stages=1),
      interpret=interpret,
      name="write_kv",
  )(jnp.reshape(layer, (1,)).astype(jnp.int32), slots, k, v, *flat)
  return tuple(x.reshape(shape) for x, shape in zip(outs, shapes))


def _project_write_kernel(layer_ref, slots_ref, x_ref, w_ref, *refs, rows: int, depth: int,
                          q_width: int, kv_width: int, head_dim: int, num_layers: int,
                          num_kv_heads: int, page_size: int, slots_per_head: int,
                          has_bias: bool, has_w_scale: bool, transposed: bool,
                          block_m: int, block_n: int, block_k: int, quantized: bool):
  """Refs: layer [1], slots [rows], x [rows, depth], kernel [depth, q + 2 kv] (`transposed`:
  [q + 2 kv, depth]), (has_bias) bias [q + 2 kv], (has_w_scale) an int8 kernel's f32
  scales [q + 2 kv], pools (in, unused) as `_write_kernel` takes them (K [L * Hkv *
  slots_per_head, D], V the same or token-minor) and (quantized) their scales [L * Hkv *
  slots_per_head] x 2; outputs q [rows, q_width] and the pools (and scales), aliased."""
  if has_bias:
    bias_ref, *refs = refs
  if has_w_scale:
    w_scale_ref, *refs = refs
  # The pool inputs (aliased, unused) come first, then q and the pool outputs.
  q_ref, k_out_ref, v_out_ref, *scale_refs = refs[len(refs) // 2:]
  scale_refs = scale_refs or (None, None)
  n, m = pl.program_id(0), pl.program_id(1)
  cols = q_width + 2 * kv_width
  r, c, _, _ = linear.tile_indices(m, n, rows=rows, cols=cols, block_m=block_m,
                                   block_n=block_n)
  row_mask = r < rows
  # The epilogue's operands are loaded before the K loop, so their memory latency hides
  # under the loop's loads instead of adding to the program's tail.
  bias = plgpu.load(bias_ref.at[c]) if has_bias else None
  w_scale = plgpu.load(w_scale_ref.at[c]) if has_w_scale else None
  layer = layer_ref[0]
  slot = plgpu.load(slots_ref.at[r], mask=row_mask, other=-1)
  acc = linear.matmul_tile(x_ref, w_ref, m=m, n=n, split=0, rows=rows, cols=cols,
                           depth=depth, block_m=block_m, block_n=block_n, block_k=block_k,
                           k_split=pl.cdiv(depth, block_k) * block_k, transposed=transposed)
  if has_w_scale:
    acc *= w_scale[None, :]
  if has_bias:
    acc += bias.astype(jnp.float32)[None, :]

  @pl.when(n * block_n < q_width)
  def _():
    plgpu.store(q_ref.at[r[:, None], c[None, :]], acc.astype(q_ref.dtype),
                mask=row_mask[:, None])

  # K and V columns: head (col // D) is one per program (D is a multiple of block_n); each
  # row goes to its token's slot in that head's pages of `layer`.
  valid = row_mask & _writable(slot, layer, slots_per_head=slots_per_head,
                              num_layers=num_layers)
  for out_ref, scale_ref, start, tokens_minor in (
      (k_out_ref, scale_refs[0], q_width, False),
      (v_out_ref, scale_refs[1], q_width + kv_width, quantized)):
    @pl.when((n * block_n >= start) & (n * block_n < start + kv_width))
    def _(out_ref=out_ref, scale_ref=scale_ref, start=start, tokens_minor=tokens_minor):
      head = (n * block_n - start) // head_dim
      # Rows not written still address something: in interpret mode a masked store writes
      # back what it read, and two rows at one address would race. Send them to another
      # layer's slots (num_layers > 1), which no row of this call writes.
      other = (layer + 1) % num_layers
      dst = jnp.where(valid, (layer * num_kv_heads + head) * slots_per_head + slot,
                      (other * num_kv_heads + head) * slots_per_head + r % slots_per_head)
      if quantized:  # block_n == head_dim: the tile holds whole heads of its rows
        y, scales = kv_quant.quantize(acc, out_ref.dtype)
        plgpu.store(scale_ref.at[dst], scales, mask=valid)
      else:
        y = acc.astype(out_ref.dtype)
      _store_rows(out_ref, dst, (c - start) % head_dim, y, valid[:, None],
                  tokens_minor=tokens_minor, page_size=page_size, head_dim=head_dim)


def can_project_write(rows: int, head_dim: int, num_layers: int, *,
                      quantized: bool = False) -> bool:
  """Whether `project_write_kv_pallas` takes these shapes: decode's few rows, heads made
  of whole column blocks (so each program writes one head), more than one layer; for a
  quantized pool, heads of exactly one column block (a program quantizes whole heads:
  their absmax is a row reduction of its tile)."""
  # Unquantized, the tiles narrow to whole divisors of the head (`whole_k_tiles`'
  # sections); quantized, the column block is the head itself.
  whole = head_dim in (32, 64) if quantized else head_dim % 32 == 0
  return 0 < rows <= linear.MAX_ROWS and whole and num_layers > 1


@functools.partial(jax.jit, static_argnames=["q_width", "interpret", "transposed"])
def project_write_kv_pallas(x: jax.Array, kernel: jax.Array, bias: jax.Array | None,
                            k_pages: jax.Array, v_pages: jax.Array, layer: jax.Array,
                            slots: jax.Array, *, q_width: int, interpret: bool,
                            k_scales: jax.Array | None = None,
                            v_scales: jax.Array | None = None,
                            w_scale: jax.Array | None = None,
                            transposed: bool = False) -> tuple[jax.Array, ...]:
  """A fused q/k/v projection whose K and V go straight into the pool: `linear`'s GEMM
  with this module's write as its epilogue (one kernel where `linear` + `write_kv_pallas`
  were two, and K/V never round-trip through HBM as separate arrays).

  Args:
    x: [N, in] (N <= linear.MAX_ROWS), the pool's dtype.
    kernel: [in, q_width + 2 * Hkv * D], x's dtype or int8 with `w_scale`; q, then k,
      then v columns, head-major.
    bias: [q_width + 2 * Hkv * D] or None.
    k_pages, v_pages: [L, Hkv, P, page_size, D] (a quantized pool's v_pages [L, Hkv, P,
      D, page_size]), updated in place when donated.
    layer: int32 scalar.
    slots: int32 [N] flat slots; outside [0, P * page_size) = not written.
    q_width: q's columns.
    k_scales, v_scales: a quantized pool's float32 scales [L, Hkv, P, page_size] (K/V are
      quantized in the epilogue; `can_project_write(..., quantized=True)` must hold),
      else None.
    w_scale: an int8 kernel's float32 per-column scales [q_width + 2 * Hkv * D]
      (`jax_paged.weight_quant`), or None.
    transposed: the kernel is stored [q_width + 2 * Hkv * D, in].

  Returns:
    (q [N, q_width] in x's dtype, k_pages, v_pages), and for a quantized pool k_scales,
    v_scales after them.
  """
  layers, hkv, pages, page_size, d = k_pages.shape
  rows, depth = x.shape
  cols = linear.columns(kernel, transposed)
  slots_per_head = pages * page_size
  flat, shapes = _flat_pool(k_pages, v_pages, k_scales, v_scales)
  quantized = k_scales is not None
  if quantized and d not in (32, 64):
    raise ValueError(f"a quantized pool's fused write needs head_dim 32 or 64 (one column "
                     f"block per head), got {d}: use linear + write_kv")
  # Quantized, a program's columns are one head: its epilogue quantizes whole heads.
  block_m, block_n, block_k, num_warps = linear.whole_k_tiles(
      rows, depth, cols, x.dtype.itemsize, (q_width, d),
      block_n=d if quantized else None,
      int8_transposed=transposed and kernel.dtype == jnp.int8)
  kernel_fn = functools.partial(
      _project_write_kernel, rows=rows, depth=depth, q_width=q_width, kv_width=hkv * d,
      head_dim=d, num_layers=layers, num_kv_heads=hkv, page_size=page_size,
      slots_per_head=slots_per_head,
      has_bias=bias is not None, has_w_scale=w_scale is not None, transposed=transposed,
      block_m=block_m, block_n=block_n, block_k=block_k, quantized=quantized)
  inputs = [jnp.reshape(layer, (1,)).astype(jnp.int32), slots, x, kernel]
  inputs += [a for a in (bias, w_scale) if a is not None]
  q, *outs = pl.pallas_call(
      kernel_fn,
      grid=(pl.cdiv(cols, block_n), pl.cdiv(rows, block_m)),
      out_shape=[jax.ShapeDtypeStruct((rows, q_width), x.dtype)]
                + [jax.ShapeDtypeStruct(a.shape, a.dtype) for a in flat],
      input_output_aliases={len(inputs) + i: 1 + i for i in range(len(flat))},
      compiler_params=linear.compiler_params(num_warps),
      interpret=interpret,
      name="project_write_kv",
  )(*inputs, *flat)
  return (q,) + tuple(a.reshape(shape) for a, shape in zip(outs, shapes))
