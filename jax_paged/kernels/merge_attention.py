"""Merge attention states: a Pallas-Triton kernel (vLLM's merge_attn_states).

Given partial attention outputs over disjoint key sets and their log-sum-exps, returns the
attention over the union:

  lse = log(sum_i exp(lse_i)),   o = sum_i o_i * exp(lse_i - lse)

computed stably (relative to the running max) in f32. An lse of +inf counts as -inf
(empty state); an all-empty row gives o = 0, lse = -inf; an empty state's o is never
used, so NaN in it cannot leak.

The kernel is memory bound (one read of each state, one write): each program merges a
block of rows x head_dim, loaded as 2-D tiles contiguous along head_dim so Triton emits
16-byte vector accesses. The two-way form reads o_a and o_b where they lie (no stacking
copy); the N-way form (split-KV partials) reads one stacked [N, ..., D] array.
"""

from __future__ import annotations

import functools

import jax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu
import jax.numpy as jnp

from jax_paged.kernels import reference
from jax_paged.kernels import triton_backend
from jax_paged.kernels import validation

# Elements (states x rows x head_dim) loaded per program and step: enough bytes in flight
# to hide latency, few enough registers for 4 warps.
_TILE_ELEMS = 8192


def _merge_kernel(*refs, num_rows: int, head_dim: int, block_r: int, block_d: int,
                  chunks: tuple[int, ...]):
  """Merges (o [n, R, D], lse [n, R]) inputs into o_out [R, D], lse_out [R].

  Input j is read `chunks[j]` states at a time as one [chunk, block_r, block_d] tile, so
  all loads of a chunk are in flight together and a many-state merge (split-KV partials
  of a few rows) is a handful of wide loads, not a chain of dependent ones. Chunks are
  combined with a running max.
  """
  num_inputs = len(chunks)
  in_refs, (o_out_ref, lse_out_ref) = refs[:2 * num_inputs], refs[2 * num_inputs:]
  rows = pl.program_id(0) * block_r + jnp.arange(block_r)
  cols = jnp.arange(block_d)
  # Masks only where a tile can overrun the array, so unmasked shapes stay mask-free.
  row_mask = rows < num_rows if num_rows % block_r else None
  col_mask = cols < head_dim if block_d != head_dim else None

  m = jnp.full((block_r,), -jnp.inf, jnp.float32)
  l = jnp.zeros((block_r,), jnp.float32)
  acc = jnp.zeros((block_r, block_d), jnp.float32)
  for o_ref, lse_ref, chunk in zip(in_refs[0::2], in_refs[1::2], chunks):
    n = o_ref.shape[0]
    for first in range(0, n, chunk):
      idx = first + jnp.arange(chunk)
      state_mask = idx < n if n % chunk else None
      lse_mask = triton_backend.and_masks(state_mask, row_mask)
      lse = plgpu.load(lse_ref.at[idx[:, None], rows[None, :]], mask=lse_mask,
                       other=None if lse_mask is None else -jnp.inf)
      lse = jnp.where(lse == jnp.inf, -jnp.inf, lse)  # +inf also marks an empty state
      o_mask = triton_backend.and_masks(lse_mask, col_mask, rank=3)
      o = plgpu.load(o_ref.at[idx[:, None, None], rows[None, :, None], cols[None, None, :]],
                     mask=o_mask, other=None if o_mask is None else 0.0).astype(jnp.float32)
      m_new = jnp.maximum(m, jnp.max(lse, axis=0))
      m_safe = jnp.where(m_new == -jnp.inf, 0.0, m_new)
      alpha = jnp.exp(m - m_safe)  # 0 while nothing was merged yet
      w = jnp.exp(lse - m_safe[None, :])  # 0 for an empty state
      # An empty state's o is meaningless (may be NaN): it contributes exactly 0.
      weighted = jnp.where(w[:, :, None] > 0, o * w[:, :, None], 0.0)
      acc = acc * alpha[:, None] + jnp.sum(weighted, axis=0)
      l = l * alpha + jnp.sum(w, axis=0)
      m = m_new
  nonempty = l > 0
  out = acc / jnp.where(nonempty, l, 1.0)[:, None]
  plgpu.store(o_out_ref.at[rows[:, None], cols[None, :]], out.astype(o_out_ref.dtype),
              mask=triton_backend.and_masks(row_mask, col_mask))
  plgpu.store(lse_out_ref.at[rows], jnp.where(nonempty, m + jnp.log(l), -jnp.inf),
              mask=row_mask)


def merge_states_pallas(states: list[tuple[jax.Array, jax.Array]], *, out_dtype,
                        interpret: bool) -> tuple[jax.Array, jax.Array]:
  """Runs the merge kernel over several inputs of stacked states.

  Args:
    states: pairs (o [n_i, R, D], lse float32 [n_i, R]); o dtypes may differ.
    out_dtype: dtype of the merged o.
    interpret: Pallas interpret mode (CPU tests).

  Returns:
    (o [R, D] out_dtype, lse float32 [R]).
  """
  num_rows, head_dim = states[0][0].shape[1:]
  block_d = pl.next_power_of_2(head_dim)
  # Up to _TILE_ELEMS // block_d states of one input per tile, then as many rows as fit.
  chunks = tuple(min(pl.next_power_of_2(o.shape[0]), max(_TILE_ELEMS // block_d, 1))
                 for o, _ in states)
  block_r = min(max(_TILE_ELEMS // (max(chunks) * block_d), 1), pl.next_power_of_2(num_rows))
  kernel = functools.partial(_merge_kernel, num_rows=num_rows, head_dim=head_dim,
                             block_r=block_r, block_d=block_d, chunks=chunks)
  return pl.pallas_call(
      kernel,
      grid=(pl.cdiv(num_rows, block_r),),
      out_shape=(jax.ShapeDtypeStruct((num_rows, head_dim), out_dtype),
                 jax.ShapeDtypeStruct((num_rows,), jnp.float32)),
      compiler_params=triton_backend.compiler_params(num_warps=4, num_stages=1),
      interpret=interpret,
      name="merge_attention_states",
  )(*[x for pair in states for x in pair])


@functools.partial(jax.jit, static_argnames=["interpret"])
def _merge_n(o: jax.Array, lse: jax.Array, interpret: bool):
  n, *rest, d = o.shape
  out, out_lse = merge_states_pallas([(o.reshape(n, -1, d), lse.reshape(n, -1))],
                                     out_dtype=o.dtype, interpret=interpret)
  return out.reshape(*rest, d), out_lse.reshape(rest)


@functools.partial(jax.jit, static_argnames=["interpret"])
def _merge_2(o_a, lse_a, o_b, lse_b, interpret: bool):
  d = o_a.shape[-1]
  states = [(o.reshape(1, -1, d), lse.reshape(1, -1)) for o, lse in ((o_a, lse_a), (o_b, lse_b))]
  out, out_lse = merge_states_pallas(states, out_dtype=o_a.dtype, interpret=interpret)
  return out.reshape(o_a.shape), out_lse.reshape(lse_a.shape)


def merge_attention_states_n(o: jax.Array, lse: jax.Array, *,
                             interpret: bool | None = None) -> tuple[jax.Array, jax.Array]:
  """Merges N partial attention states along the leading axis.

  Args:
    o: [N, ..., D] float32 / bfloat16 / float16 partial outputs, each normalised over its
      own keys.
    lse: float32 [N, ...] their log-sum-exps; +inf or -inf marks an empty state.
    interpret: None = Triton kernel on GPU, plain XLA elsewhere; True = Pallas interpret
      mode; False = Triton kernel.

  Returns:
    (o [..., D] in o's dtype, lse float32 [...]).
  """
  validation.check_merge_n_args(o, lse)
  mode = triton_backend.kernel_mode(interpret)
  if mode is None or o.size == 0:
    return reference.merge_attention_states_n(o, lse)
  return _merge_n(o, lse, interpret=mode)


def merge_attention_states(o_a: jax.Array, lse_a: jax.Array, o_b: jax.Array, lse_b: jax.Array,
                           *, interpret: bool | None = None) -> tuple[jax.Array, jax.Array]:
  """Merges two partial attention states (vLLM's merge_attn_states).

  Args:
    o_a, o_b: [..., D] float32 / bfloat16 / float16 partial outputs (same dtype).
    lse_a, lse_b: float32 [...] (= o.shape[:-1]) their log-sum-exps.
    interpret: as in `merge_attention_states_n`.

  Returns:
    (o [..., D] in o_a's dtype, lse float32 [...]) with lse = log(exp(lse_a) + exp(lse_b))
    and o = o_a * exp(lse_a - lse) + o_b * exp(lse_b - lse). An lse of +inf counts as
    -inf (empty); two empty states give o = 0, lse = -inf.
  """
  validation.check_merge_args(o_a, lse_a, o_b, lse_b)
  mode = triton_backend.kernel_mode(interpret)
  if mode is None or o_a.size == 0:
    return reference.merge_attention_states(o_a, lse_a, o_b, lse_b)
  return _merge_2(o_a, lse_a, o_b, lse_b, interpret=mode)
