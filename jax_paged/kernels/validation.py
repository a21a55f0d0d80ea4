"""Argument checks shared by the kernels and their references.

Everything here runs on shapes and dtypes only (static under `jax.jit`), so the checks
happen at the public boundary before anything is traced, and their messages name the
offending argument and say what is allowed.
"""

from __future__ import annotations

import warnings

import jax
import jax.numpy as jnp
import numpy as np

from jax_paged.kernels import kv_quant

# q, outputs and float caches.
SUPPORTED_DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
# What a KV pool may hold: the float dtypes, or narrow values with scales beside them.
CACHE_DTYPES = SUPPORTED_DTYPES + kv_quant.QUANTIZED_DTYPES
SUPPORTED_HEAD_DIMS = (64, 80, 96, 128, 256)
MIN_PAGE_SIZE, MAX_PAGE_SIZE = 8, 128


def _shape(x) -> tuple[int, ...]:
  return tuple(getattr(x, "shape", ()))


def _v_shape(k_pages) -> tuple[int, ...]:
  """The shape v_pages must have beside k_pages: k_pages', or for int8 / float8 pages
  token-minor [..., D, page_size]."""
  return kv_quant.v_pages_shape(_shape(k_pages), getattr(k_pages, "dtype", jnp.float32))


def check_positive_int(name: str, value, *, optional: bool = False,
                       power_of_two: bool = False) -> int | None:
  """value as an int; ValueError naming `name` unless it is a (non-bool) integer >= 1 (a
  power of two where `power_of_two`: a kernel's block size), or None where `optional`."""
  if optional and value is None:
    return None
  if (isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1
      or (power_of_two and value & (value - 1))):
    what = "a power of two" if power_of_two else "a positive int"
    raise ValueError(f"{name} must be {what}{' or None' if optional else ''}, got {value!r}")
  return int(value)


def check_positive_number(name: str, value, *, optional: bool = False) -> float | None:
  """value as a float; ValueError naming `name` unless it is a positive finite (non-bool)
  number, or None where `optional` (a soft cap C, mapping logits to C * tanh(logits / C);
  a model's scale factors)."""
  if optional and value is None:
    return None
  if isinstance(value, bool) or not isinstance(value, (int, float, np.integer, np.floating)) \
      or not value > 0 or not np.isfinite(value):
    raise ValueError(f"{name} must be a positive finite number{' or None' if optional else ''}"
                     f", got {value!r}")
  return float(value)


def check_cache_dtype(name: str, dtype) -> jnp.dtype:
  """dtype as a jnp.dtype; ValueError naming `name` unless it is one of CACHE_DTYPES."""
  try:
    dtype = jnp.dtype(dtype)
  except TypeError:
    dtype = None
  if dtype not in CACHE_DTYPES:
    names = ", ".join(d.name for d in CACHE_DTYPES)
    raise ValueError(f"{name} must be a cache dtype the kernels read ({names}), got "
                     f"{getattr(dtype, 'name', dtype)}")
  return dtype


def check_scales(k_pages, v_pages, k_scales, v_scales) -> None:
  """Validates the scales of quantized pages: float32 of the pages' shape without the head
  dim (one per token per kv head) for int8 / float8 pages, None for float pages."""
  quantized = kv_quant.is_quantized(getattr(k_pages, "dtype", jnp.float32))
  for name, scales in (("k_scales", k_scales), ("v_scales", v_scales)):
    if not quantized:
      if scales is not None:
        raise ValueError(f"{name} is for int8 / float8_e4m3fn pages; k_pages are "
                         f"{k_pages.dtype}: pass None")
      continue
    if scales is None:
      raise ValueError(f"{k_pages.dtype} pages need their scales: pass k_scales and v_scales "
                       f"(float32, shape {_shape(k_pages)[:-1]}; KVPool.k_scales / v_scales)")
    if _shape(scales) != _shape(k_pages)[:-1]:
      raise ValueError(f"{name} must have the pages' shape without head_dim "
                       f"{_shape(k_pages)[:-1]}, got {_shape(scales)}")
    if jnp.dtype(scales.dtype) != kv_quant.SCALE_DTYPE:
      raise ValueError(f"{name} dtype must be float32, got {scales.dtype}")


def check_quantized_block_n(block_n: int | None, k_pages, k_scales) -> None:
  """Raises ValueError for a kernel's `block_n` knob below the page size of quantized
  pages (with scales): a block reads whole pages of their token-minor V."""
  if block_n is not None and k_scales is not None and block_n < k_pages.shape[-2]:
    raise ValueError(f"block_n must be >= page_size ({k_pages.shape[-2]}) for int8 / float8 "
                     f"pages (a block reads whole pages of V), got {block_n}")


def kernel_page_size_ok(page_size: int) -> bool:
  """Whether the kernels take this page size (a power of two in [8, 128])."""
  return MIN_PAGE_SIZE <= page_size <= MAX_PAGE_SIZE and page_size & (page_size - 1) == 0


def kernel_supports(head_dim: int, page_size: int) -> bool:
  """Whether the Pallas kernels support this head dim and page size."""
  return head_dim in SUPPORTED_HEAD_DIMS and kernel_page_size_ok(page_size)


class ReferencePathWarning(UserWarning):
  """Attention that would run a Triton kernel on a GPU runs on XLA's reference path
  instead, because the kernels do not take its head dim or page size."""


def warn_if_reference_on_gpu(what: str, head_dim: int, page_size: int) -> None:
  """Warns (`ReferencePathWarning`, once per call site under Python's default filter)
  when `what` runs on a GPU with a head dim or page size the kernels do not take: it then
  falls back to XLA's reference (a gather of every page, several times slower), which
  would otherwise go unnoticed."""
  if jax.default_backend() != "gpu" or kernel_supports(head_dim, page_size):
    return
  warnings.warn(
      f"{what}: head dim {head_dim} and page size {page_size} run on XLA's slower "
      f"reference path on this GPU; the Triton kernels take head dims {SUPPORTED_HEAD_DIMS}"
      f" and power-of-two page sizes in [{MIN_PAGE_SIZE}, {MAX_PAGE_SIZE}]",
      ReferencePathWarning, stacklevel=3)


def check_layer(k_pages, v_pages, layer):
  """Validates `paged_decode_attention`'s `layer` against the pools' rank: None for pools of
  one layer [Hkv, num_pages, page_size, D], an int in [0, num_layers) or an integer scalar
  array for whole pools [num_layers, Hkv, num_pages, page_size, D].

  Returns the shape-and-dtype of one layer of k_pages and of v_pages (for
  `check_decode_args`).
  """
  rank = len(_shape(k_pages))
  if layer is None:
    if rank == 5:
      raise ValueError(f"k_pages of shape {_shape(k_pages)} is a whole pool [num_layers, "
                       "num_kv_heads, num_pages, page_size, head_dim]: pass layer=")
    return k_pages, v_pages
  if rank != 5 or _shape(v_pages) != _v_shape(k_pages):
    raise ValueError("with layer, k_pages and v_pages must be pools of shape [num_layers, "
                     f"num_kv_heads, num_pages, page_size, head_dim] (v_pages of int8 / "
                     "float8 pools [..., head_dim, page_size]), got shapes "
                     f"{_shape(k_pages)} and {_shape(v_pages)}")
  if isinstance(layer, (int, np.integer)) and not isinstance(layer, bool):
    if not 0 <= layer < k_pages.shape[0]:
      raise ValueError(f"layer must be in [0, num_layers={k_pages.shape[0]}), got {layer}")
  elif not (_shape(layer) == () and hasattr(layer, "dtype")
            and jnp.issubdtype(layer.dtype, jnp.integer)):
    raise ValueError(f"layer must be an int or an integer scalar array, got {layer!r}")
  one = lambda x: jax.ShapeDtypeStruct(x.shape[1:], x.dtype)
  return one(k_pages), one(v_pages)


def check_decode_args(q, k_pages, v_pages, page_table, lengths, *, scale, logits_soft_cap,
                      sliding_window, strict_kernel_shapes: bool, alibi_slopes=None,
                      sinks=None, attention_chunk=None) -> None:
  """Validates the arguments of `paged_decode_attention` (kernel and reference).

  `strict_kernel_shapes` additionally enforces what the kernels support (head dims
  64/80/96/128/256, power-of-two page sizes 8..128); the reference accepts any.
  """
  if len(_shape(q)) != 3:
    raise ValueError(f"q must have shape [batch, num_heads, head_dim], got shape {_shape(q)}")
  b, h, d = q.shape
  if len(_shape(k_pages)) != 4:
    raise ValueError("k_pages must have shape [num_kv_heads, num_pages, page_size, head_dim], "
                     f"got shape {_shape(k_pages)}")
  if _shape(v_pages) != _v_shape(k_pages):
    minor = (" (int8 / float8 V pages are token-minor, [num_kv_heads, num_pages, head_dim, "
             "page_size]: kv_quant.transpose_pages)"
             if kv_quant.is_quantized(getattr(k_pages, "dtype", jnp.float32)) else "")
    raise ValueError(f"v_pages must have shape {_v_shape(k_pages)} beside k_pages "
                     f"{_shape(k_pages)}{minor}, got {_shape(v_pages)}")
  hkv, _, page_size, dk = k_pages.shape
  if dk != d:
    raise ValueError(f"k_pages head_dim {dk} does not match q head_dim {d}")
  if hkv == 0 or h % hkv:
    raise ValueError(f"q num_heads ({h}) must be a multiple of k_pages num_kv_heads ({hkv})")
  if jnp.dtype(q.dtype) not in SUPPORTED_DTYPES:
    raise ValueError(f"q dtype must be float32, bfloat16 or float16, got {q.dtype}")
  for name, x in (("k_pages", k_pages), ("v_pages", v_pages)):
    if jnp.dtype(x.dtype) not in CACHE_DTYPES:
      raise ValueError(f"{name} dtype must be float32, bfloat16, float16, int8 or "
                       f"float8_e4m3fn, got {x.dtype}")
  if jnp.dtype(k_pages.dtype) != jnp.dtype(v_pages.dtype):
    raise ValueError(f"k_pages and v_pages dtypes differ: {k_pages.dtype} vs {v_pages.dtype}")
  if len(_shape(page_table)) != 2 or page_table.shape[0] != b:
    raise ValueError(f"page_table must have shape [batch={b}, max_pages_per_seq], "
                     f"got shape {_shape(page_table)}")
  if _shape(lengths) != (b,):
    raise ValueError(f"lengths must have shape [batch={b}], got shape {_shape(lengths)}")
  for name, x in (("page_table", page_table), ("lengths", lengths)):
    if jnp.dtype(x.dtype) != jnp.dtype(jnp.int32):
      raise ValueError(f"{name} dtype must be int32, got {x.dtype}")
  if scale is not None and not isinstance(scale, (int, float)):
    raise ValueError(f"scale must be a Python float or None, got {type(scale).__name__}")
  check_positive_number("logits_soft_cap", logits_soft_cap, optional=True)
  check_positive_int("sliding_window", sliding_window, optional=True)
  check_positive_int("attention_chunk", attention_chunk, optional=True)
  for name, x in (("alibi_slopes", alibi_slopes), ("sinks", sinks)):
    check_head_values(name, x, h)
  if strict_kernel_shapes:
    if d not in SUPPORTED_HEAD_DIMS:
      raise ValueError(f"head_dim must be one of {SUPPORTED_HEAD_DIMS}, got {d}")
    if not kernel_page_size_ok(page_size):
      raise ValueError(f"k_pages page_size must be a power of two in "
                       f"[{MIN_PAGE_SIZE}, {MAX_PAGE_SIZE}], got {page_size}")


def check_head_values(name: str, x, num_heads: int) -> None:
  """Raises ValueError unless x (named `name`) is None or float32 [num_heads], finite
  where concrete: a value per q head (ALiBi's slopes, attention sinks)."""
  if x is None:
    return
  if _shape(x) != (num_heads,) or jnp.dtype(getattr(x, "dtype", None)) != jnp.dtype(
      jnp.float32):
    raise ValueError(f"{name} must be float32 of shape [num_heads={num_heads}] or None, got "
                     f"{getattr(x, 'dtype', type(x).__name__)} of shape {_shape(x)}")
  values = concrete(x)
  if values is not None and not np.isfinite(values).all():
    raise ValueError(f"{name} must be finite, got {values}")


def check_decode_call(q, k_pages, v_pages, page_table, lengths, *, layer, scale,
                      logits_soft_cap, sliding_window, strict_kernel_shapes: bool,
                      k_scales=None, v_scales=None, alibi_slopes=None, sinks=None,
                      attention_chunk=None):
  """All of `paged_decode_attention`'s checks (`check_layer`, `check_decode_args`,
  `check_scales`, `check_decode_values`); returns the shape-and-dtype of one layer of
  k_pages."""
  k_layer, v_layer = check_layer(k_pages, v_pages, layer)
  check_decode_args(q, k_layer, v_layer, page_table, lengths, scale=scale,
                    logits_soft_cap=logits_soft_cap, sliding_window=sliding_window,
                    strict_kernel_shapes=strict_kernel_shapes, alibi_slopes=alibi_slopes,
                    sinks=sinks, attention_chunk=attention_chunk)
  check_scales(k_pages, v_pages, k_scales, v_scales)
  check_decode_values(page_table, lengths, num_pages=k_layer.shape[1],
                      page_size=k_layer.shape[2])
  return k_layer


def concrete(x) -> np.ndarray | None:
  """x as a numpy array if it is known outside of tracing, else None."""
  try:
    return np.asarray(x)
  except (jax.errors.TracerArrayConversionError, jax.errors.ConcretizationTypeError):
    return None


def check_decode_values(page_table, lengths, *, num_pages: int, page_size: int) -> None:
  """Where `paged_decode_attention`'s lengths and page table are concrete (outside jit),
  raises ValueError for lengths outside [0, max_pages_per_seq * page_size] and for page
  ids outside [0, num_pages) in any sequence's used pages. Under jit nothing can raise:
  the kernel and the reference both clamp lengths into that range (`clamp_lengths`) and
  page ids into [0, num_pages) (`clamp_page_ids`, `clamp_unchecked_page_ids`)."""
  lens = concrete(lengths)
  if lens is None:
    return
  capacity = page_table.shape[1] * page_size
  bad = np.flatnonzero((lens < 0) | (lens > capacity))
  if bad.size:
    raise ValueError(f"lengths must be in [0, max_pages_per_seq * page_size = {capacity}], "
                     f"got {lens[bad[0]]} for sequence {bad[0]}")
  table = concrete(page_table)
  if table is None:
    return
  used = np.arange(table.shape[1])[None, :] < -(-lens // page_size)[:, None]
  bad = np.argwhere(used & ((table < 0) | (table >= num_pages)))
  if bad.size:
    b, j = bad[0]
    raise ValueError(f"page_table must hold page ids in [0, num_pages={num_pages}) for the "
                     f"pages a sequence uses, got {table[b, j]} at [{b}, {j}] (length "
                     f"{lens[b]})")


# The in-jit forms of `check_decode_values`.
def clamp_page_ids(page_ids, num_pages: int):
  """Page ids into [0, num_pages)."""
  return jnp.clip(page_ids, 0, num_pages - 1)


def clamp_unchecked_page_ids(page_table, num_pages: int, *lengths):
  """page_table with its ids clamped into [0, num_pages) where `check_decode_values` /
  `check_prefill_values` could not check them (the table or the `lengths` that say which
  entries are used are traced); unchanged where they did. The kernels' wrappers call this,
  so that under jit a kernel reads the pages the reference reads and nothing outside the
  pool. (Every layer of a model step clamps the same table: XLA computes it once.)"""
  if any(isinstance(x, jax.core.Tracer) for x in (page_table, *lengths)):
    return clamp_page_ids(page_table, num_pages)
  return page_table


def first_visible_key(pos, sliding_window: int | None, attention_chunk: int | None):
  """The first key position that the query at position `pos` (an int array; -1 for an
  empty sequence's) attends to, never below 0: 0; with a sliding window W, pos - W + 1;
  with chunked attention of C tokens (Llama 4's local layers), the start of pos's chunk,
  floor(pos / C) * C; with both, the later. The kernels and the references mask keys
  below it."""
  first = 0
  if sliding_window is not None:
    first = jnp.maximum(pos - sliding_window + 1, 0)
  if attention_chunk is not None:
    first = jnp.maximum(pos // attention_chunk * attention_chunk, first)
  return first


def clamp_lengths(lengths, capacity: int):
  """Sequence lengths into [0, capacity] (capacity = max_pages_per_seq * page_size)."""
  return jnp.clip(lengths, 0, capacity)


def check_prefill_call(q, k_pages, v_pages, page_table, q_start, q_lengths, *, layer, scale,
                       logits_soft_cap, sliding_window, strict_kernel_shapes: bool,
                       k_scales=None, v_scales=None, alibi_slopes=None, sinks=None,
                       attention_chunk=None):
  """All of `paged_prefill_attention`'s checks; returns the shape-and-dtype of one layer of
  k_pages. q is [B, T, H, D]; the pools, scales, page table, scale, cap and window are checked
  as `paged_decode_attention` checks them (alibi slopes and sinks too; `check_layer`,
  `check_scales`, `check_decode_args` on one token's q), q_start / q_lengths here and, where
  concrete, by `check_prefill_values`."""
  k_layer, v_layer = check_layer(k_pages, v_pages, layer)
  check_scales(k_pages, v_pages, k_scales, v_scales)
  if len(_shape(q)) != 4:
    raise ValueError("q must have shape [batch, num_tokens, num_heads, head_dim], got shape "
                     f"{_shape(q)}")
  b, t, h, d = q.shape
  for name, x in (("q_start", q_start), ("q_lengths", q_lengths)):
    if _shape(x) != (b,):
      raise ValueError(f"{name} must have shape [batch={b}], got shape {_shape(x)}")
    if jnp.dtype(x.dtype) != jnp.dtype(jnp.int32):
      raise ValueError(f"{name} dtype must be int32, got {x.dtype}")
  check_decode_args(jax.ShapeDtypeStruct((b, h, d), q.dtype), k_layer, v_layer, page_table,
                    q_start, scale=scale, logits_soft_cap=logits_soft_cap,
                    sliding_window=sliding_window,
                    strict_kernel_shapes=strict_kernel_shapes, alibi_slopes=alibi_slopes,
                    sinks=sinks, attention_chunk=attention_chunk)
  check_prefill_values(page_table, q_start, q_lengths, num_tokens=t,
                       num_pages=k_layer.shape[1], page_size=k_layer.shape[2])
  return k_layer


def check_prefill_values(page_table, q_start, q_lengths, *, num_tokens: int, num_pages: int,
                         page_size: int) -> None:
  """Where they are concrete (outside jit), raises ValueError for q_start < 0, q_lengths
  outside [0, num_tokens], q_start + q_lengths past max_pages_per_seq * page_size, and page
  ids outside [0, num_pages) in the pages a sequence uses (its first q_start + q_lengths
  tokens). Under jit the kernel and the reference clamp alike (`clamp_prefill`, and page
  ids as `check_decode_values` says)."""
  start, lens = concrete(q_start), concrete(q_lengths)
  if start is not None:
    bad = np.flatnonzero(start < 0)
    if bad.size:
      raise ValueError(f"q_start must be >= 0, got {start[bad[0]]} for sequence {bad[0]}")
  if lens is not None:
    bad = np.flatnonzero((lens < 0) | (lens > num_tokens))
    if bad.size:
      raise ValueError(f"q_lengths must be in [0, num_tokens = {num_tokens}] (q.shape[1]), "
                       f"got {lens[bad[0]]} for sequence {bad[0]}")
  if start is None or lens is None:
    return
  capacity = page_table.shape[1] * page_size
  total = start.astype(np.int64) + lens
  bad = np.flatnonzero(total > capacity)
  if bad.size:
    i = bad[0]
    raise ValueError(f"q_start + q_lengths must be <= max_pages_per_seq * page_size = "
                     f"{capacity}, got {start[i]} + {lens[i]} for sequence {i}")
  check_decode_values(page_table, total.astype(np.int32), num_pages=num_pages,
                      page_size=page_size)


def clamp_prefill(q_start, q_lengths, *, num_tokens: int, capacity: int):
  """The in-jit form of `check_prefill_values`: q_lengths into [0, min(num_tokens,
  capacity)], then q_start into [0, capacity - q_lengths], so a row's tokens never pass its
  page table row. Returns (q_start, q_lengths)."""
  q_lengths = jnp.clip(q_lengths, 0, min(num_tokens, capacity))
  return jnp.clip(q_start, 0, capacity - q_lengths), q_lengths


def check_merge_args(o_a, lse_a, o_b, lse_b) -> None:
  """Validates the arguments of the two-way `merge_attention_states`."""
  if len(_shape(o_a)) < 1:
    raise ValueError(f"o_a must have at least one dimension (head_dim last), got {_shape(o_a)}")
  if _shape(o_b) != _shape(o_a):
    raise ValueError(f"o_b shape {_shape(o_b)} must equal o_a shape {_shape(o_a)}")
  for name, lse in (("lse_a", lse_a), ("lse_b", lse_b)):
    if _shape(lse) != _shape(o_a)[:-1]:
      raise ValueError(f"{name} must have shape o.shape[:-1] = {_shape(o_a)[:-1]}, "
                       f"got {_shape(lse)}")
    if jnp.dtype(lse.dtype) != jnp.dtype(jnp.float32):
      raise ValueError(f"{name} dtype must be float32, got {lse.dtype}")
  for name, o in (("o_a", o_a), ("o_b", o_b)):
    if jnp.dtype(o.dtype) not in SUPPORTED_DTYPES:
      raise ValueError(f"{name} dtype must be float32, bfloat16 or float16, got {o.dtype}")
  if jnp.dtype(o_a.dtype) != jnp.dtype(o_b.dtype):
    raise ValueError(f"o_a and o_b dtypes differ: {o_a.dtype} vs {o_b.dtype}")


def check_merge_n_args(o, lse) -> None:
  """Validates the N-way form: o [N, ..., D], lse [N, ...]."""
  if len(_shape(o)) < 2:
    raise ValueError(f"o must have shape [num_states, ..., head_dim], got {_shape(o)}")
  if _shape(lse) != _shape(o)[:-1]:
    raise ValueError(f"lse must have shape o.shape[:-1] = {_shape(o)[:-1]}, got {_shape(lse)}")
  if jnp.dtype(lse.dtype) != jnp.dtype(jnp.float32):
    raise ValueError(f"lse dtype must be float32, got {lse.dtype}")
  if jnp.dtype(o.dtype) not in SUPPORTED_DTYPES:
    raise ValueError(f"o dtype must be float32, bfloat16 or float16, got {o.dtype}")
