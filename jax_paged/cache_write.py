"""Writing new tokens' K/V into the pool's pages: a Pallas-Triton kernel (vLLM's
reshape_and_cache).

XLA writes K and V with one scatter each, and in a decode step each scatter also
re-reduces the split-K partial sums of the qkv projection it reads from: 2 kernels of
~3.7 µs per layer at GPT-2 124M, batch 128, on an H200 (benchmarks/RESULTS.md). This kernel
writes both in one launch, in place: the pool arrays are aliased to its outputs, so a
caller that donates the pool (a jitted decode step) moves only the new tokens' bytes.

Grid (tokens,): program n copies token n's [Hkv, D] K and V rows to flat slot
`slots[n]` of every kv head of `layer`. Negative or out-of-range slots (padding), and
every slot of an out-of-range (traced) layer, write nothing.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from jax_paged import triton_backend


def _write_kernel(layer_ref, slots_ref, k_ref, v_ref, k_in_ref, v_in_ref, k_out_ref,
                  v_out_ref, *, num_layers: int, num_kv_heads: int, head_dim: int,
                  slots_per_head: int, block_h: int, block_d: int):
  """Refs: layer [1], slots [N], k/v [N, Hkv, D]; pools (in and aliased out)
  [L * Hkv * slots_per_head, D]. The `_in` refs are the outputs' buffers: unused."""
  del k_in_ref, v_in_ref
  n = pl.program_id(0)
  slot = slots_ref[n]
  layer = layer_ref[0]
  heads = jnp.arange(block_h)
  cols = jnp.arange(block_d)
  valid = (slot >= 0) & (slot < slots_per_head) & (layer >= 0) & (layer < num_layers)
  mask = (heads[:, None] < num_kv_heads) & (cols[None, :] < head_dim) & valid
  src = (n, heads[:, None], cols[None, :])
  rows = (layer * num_kv_heads + heads) * slots_per_head + jnp.maximum(slot, 0)
  dst = (rows[:, None], cols[None, :])
  plgpu.store(k_out_ref.at[dst], plgpu.load(k_ref.at[src], mask=mask, other=0.0), mask=mask)
  plgpu.store(v_out_ref.at[dst], plgpu.load(v_ref.at[src], mask=mask, other=0.0), mask=mask)


@functools.partial(jax.jit, static_argnames=["interpret"])
def write_kv_pallas(k_pages: jax.Array, v_pages: jax.Array, layer: jax.Array,
                    slots: jax.Array, k: jax.Array, v: jax.Array, *, interpret: bool
                    ) -> tuple[jax.Array, jax.Array]:
  """The kernel behind `jax_paged.pool.write_kv` on a GPU.

  Args:
    k_pages, v_pages: [L, Hkv, P, page_size, D], updated in place when donated.
    layer: int32 scalar.
    slots: int32 [N] flat slots (page * page_size + offset); outside [0, P * page_size)
      = not written.
    k, v: [N, Hkv, D] in the pool's dtype.

  Returns:
    (k_pages, v_pages) with the N tokens written.
  """
  shape = k_pages.shape
  layers, hkv, pages, page_size, d = shape
  slots_per_head = pages * page_size
  flat = (layers * hkv * slots_per_head, d)  # a free bitcast of the pool
  kernel = functools.partial(
      _write_kernel, num_layers=layers, num_kv_heads=hkv, head_dim=d,
      slots_per_head=slots_per_head,
      block_h=pl.next_power_of_2(hkv), block_d=pl.next_power_of_2(d))
  k_out, v_out = pl.pallas_call(
      kernel,
      grid=(slots.shape[0],),
      out_shape=(jax.ShapeDtypeStruct(flat, k_pages.dtype),
                 jax.ShapeDtypeStruct(flat, v_pages.dtype)),
      input_output_aliases={4: 0, 5: 1},
      compiler_params=triton_backend.compiler_params(num_warps=1, num_stages=1),
      interpret=interpret,
      name="write_kv",
  )(jnp.reshape(layer, (1,)).astype(jnp.int32), slots, k, v, k_pages.reshape(flat),
    v_pages.reshape(flat))
  return k_out.reshape(shape), v_out.reshape(shape)
