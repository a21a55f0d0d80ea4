"""Copies of whole KV pages (`pool.copy_pages`) as one Pallas-Triton kernel.

XLA runs `array.at[:, :, dst].set(array[:, :, src])` over the pool's page arrays as a
gather of every listed page, copy or not, and a scatter: for a beam search step's fork of
256 rows of GPT-2 124M (a 590 KB page each, K and V) ~0.49 ms on an H200, whatever few
pages are actually copied. Here program (i, t) copies (layer, kv head) tile t of page
src[i] to page dst[i] in every page array, and returns at once when dst[i] is negative:
only the copies move bytes.
"""

from __future__ import annotations

import functools

import jax
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu
import jax.numpy as jnp

from jax_paged.kernels import triton_backend

_BLOCK = 2048  # elements of a tile moved per iteration


def _kernel(src_ref, dst_ref, *refs, num_pages: int, tile_sizes: tuple[int, ...]):
  """Refs: src, dst int32 [n] (dst < 0: no copy), the page arrays flattened to
  [tiles * num_pages * tile_sizes[j]] (inputs unused: their buffers are the aliased
  outputs), then those outputs."""
  i, tile = pl.program_id(0), pl.program_id(1)
  src, dst = plgpu.load(src_ref.at[i]), plgpu.load(dst_ref.at[i])
  outs = refs[len(tile_sizes):]

  @pl.when(dst >= 0)
  def _copy():
    for pages_ref, tile_size in zip(outs, tile_sizes):
      block = min(_BLOCK, pl.next_power_of_2(tile_size))
      offset = jnp.arange(block)

      def part(p, _, pages_ref=pages_ref, tile_size=tile_size, block=block):
        at = p * block + offset
        inside = at < tile_size
        value = plgpu.load(pages_ref.at[(tile * num_pages + src) * tile_size + at],
                           mask=inside)
        plgpu.store(pages_ref.at[(tile * num_pages + dst) * tile_size + at], value,
                    mask=inside)

      lax.fori_loop(jnp.int32(0), jnp.int32(pl.cdiv(tile_size, block)), part, None)


@functools.partial(jax.jit, static_argnames=["interpret"])
def copy_pages_pallas(pages: tuple[jax.Array, ...], src: jax.Array, dst: jax.Array, *,
                      interpret: bool) -> tuple[jax.Array, ...]:
  """pages[j][:, :, dst[i]] = pages[j][:, :, src[i]] for every i with dst[i] >= 0.

  Args:
    pages: the pool's page arrays (`KVPool.page_arrays`), each [L, Hkv, num_pages, ...]
      (a page is copied whole, whatever its layout); updated in place when donated.
    src: int32 [n] page ids in [0, num_pages).
    dst: int32 [n] page ids in [0, num_pages), distinct and none of them a src; negative
      entries are skipped.

  Returns:
    The page arrays, a tuple like the argument.
  """
  n = src.shape[0]
  num_layers, num_kv_heads, num_pages = pages[0].shape[:3]
  tiles = num_layers * num_kv_heads
  if n == 0:
    return pages
  kernel = functools.partial(_kernel, num_pages=num_pages,
                             tile_sizes=tuple(x.size // (tiles * num_pages) for x in pages))
  flat = [x.reshape(-1) for x in pages]
  outs = pl.pallas_call(
      kernel,
      grid=(n, tiles),
      out_shape=tuple(jax.ShapeDtypeStruct(x.shape, x.dtype) for x in flat),
      input_output_aliases={2 + j: j for j in range(len(flat))},
      compiler_params=triton_backend.compiler_params(num_warps=4, num_stages=1),
      interpret=interpret,
      name="copy_pages",
  )(src.astype(jnp.int32), dst.astype(jnp.int32), *flat)
  return tuple(y.reshape(x.shape) for x, y in zip(pages, outs))
