"""Paged prefill attention kernel vs the plain-jnp reference, decode attention and dense
causal attention.

CPU: the Pallas kernel in interpret mode on small shapes. `-m gpu`: the compiled Triton
kernel. Inputs are fresh random values; page tables are random permutations of the pool
with garbage (negative / out of range) past each row's last page; every K/V element no
live token uses is NaN (pages no row uses, the tail of a partly filled last page) and so
is every padding query: none of it may reach the output.
"""

import functools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_paged
from jax_paged import reference
from jax_paged.kernels import paged_prefill as pp

_TOL = {jnp.float32: dict(atol=2e-5, rtol=1e-5), jnp.bfloat16: dict(atol=2e-2, rtol=2e-2),
        jnp.float16: dict(atol=2e-3, rtol=2e-3)}
_SEED = iter(range(10**6))
# Jitted (compiled once per shape): run eagerly, each of its ops would compile on its own.
_reference = jax.jit(reference.paged_prefill_attention,
                     static_argnames=["scale", "logits_soft_cap", "sliding_window",
                                      "attention_chunk"])
_alibi = lambda num_heads: jnp.asarray(jax_paged.nn.alibi_slopes(num_heads))


def _sinks(num_heads: int) -> jax.Array:
  """Fresh attention sinks (GPT-OSS's learned logits), float32 [num_heads], uniform in
  [-1, 4]."""
  return jnp.asarray(np.random.default_rng(next(_SEED)).uniform(-1, 4, num_heads),
                     jnp.float32)


def make_inputs(num_tokens, num_heads, num_kv_heads, head_dim, page_size, dtype, q_start,
                q_lengths, *, max_pages=None, num_layers=None, seed=None):
  """q [B, T, H, D], poisoned K/V pages (one layer, or a pool of `num_layers`), a permuted
  page table with garbage past each row's last page, q_start, q_lengths."""
  q_start = np.asarray(q_start, np.int32)
  q_lengths = np.asarray(q_lengths, np.int32)
  batch = len(q_start)
  lengths = q_start + q_lengths
  used = -(-lengths // page_size)
  max_pages = max_pages or max(1, int(used.max()))
  rng = np.random.default_rng(next(_SEED) if seed is None else seed)
  num_pages = batch * max_pages + 3
  table = rng.permutation(num_pages)[:batch * max_pages].reshape(batch, max_pages)
  # Token liveness over the pool: page table slot j of row b holds positions
  # [j * page_size, (j + 1) * page_size) of that row.
  live = np.zeros((num_pages, page_size), bool)
  for b in range(batch):
    for pos in range(lengths[b]):
      live[table[b, pos // page_size], pos % page_size] = True
  table = np.where(np.arange(max_pages)[None, :] < used[:, None], table,
                   rng.integers(-10**6, 10**6, table.shape))
  # numpy, not jax.random: eager jax ops would each compile, slower than the kernel's test.
  pool = (num_layers or 1, num_kv_heads, num_pages, page_size, head_dim)
  dead = ~live[None, None, :, :, None]
  k_pages = np.where(dead, np.nan, rng.standard_normal(pool, np.float32))
  v_pages = np.where(dead, np.nan, rng.standard_normal(pool, np.float32))
  if num_layers is None:
    k_pages, v_pages = k_pages[0], v_pages[0]
  q = rng.standard_normal((batch, num_tokens, num_heads, head_dim), np.float32)
  padding = np.arange(num_tokens)[None, :] >= q_lengths[:, None]
  q = np.where(padding[:, :, None, None], np.nan, q)
  return (jnp.asarray(q, dtype), jnp.asarray(k_pages, dtype), jnp.asarray(v_pages, dtype),
          jnp.asarray(table, jnp.int32), jnp.asarray(q_start), jnp.asarray(q_lengths))


def check_output(out, want, q_lengths, dtype):
  """out == want within dtype tolerance, no NaN, padding queries exactly 0."""
  chex.assert_trees_all_equal_shapes_and_dtypes(out, want)
  out32 = np.asarray(out, np.float32)
  assert not np.isnan(out32).any()
  padding = np.arange(out.shape[1])[None, :] >= np.asarray(q_lengths)[:, None]
  np.testing.assert_array_equal(out32[padding], 0.0)
  chex.assert_trees_all_close(out32, np.asarray(want, np.float32), **_TOL[dtype])


def check_against_reference(args, *, interpret=True, alibi=False, sinks=False, **kwargs):
  """The kernel's output vs the reference's (`alibi`: with BLOOM's slopes for q's heads;
  `sinks`: with random attention sinks)."""
  if alibi:
    kwargs["alibi_slopes"] = _alibi(args[0].shape[2])
  if sinks:
    kwargs["sinks"] = _sinks(args[0].shape[2])
  ref_kwargs = {k: kwargs[k] for k in ("scale", "logits_soft_cap", "sliding_window",
                                       "attention_chunk", "layer",
                                       "alibi_slopes", "sinks") if k in kwargs}
  out = jax_paged.paged_prefill_attention(*args, interpret=interpret, **kwargs)
  want = _reference(*args, **ref_kwargs)
  check_output(out, want, args[5], args[0].dtype.type)
  return out


# (heads, kv heads, head dim, page size, dtype, block_q): MHA, GQA (groups 2, 3, 4), MQA,
# head dims 64 / 80 / 128, page sizes 8..32, the three dtypes; block_q so that T = 20 makes
# several query blocks (the last one partial).
_CPU_GRID = [
    (4, 4, 64, 8, jnp.float32, 16),
    (8, 2, 64, 16, jnp.bfloat16, 4),
    (6, 2, 80, 8, jnp.float32, 4),  # group 3, padded to 4 rows per token
    (4, 1, 128, 32, jnp.float16, 4),
    (4, 2, 64, 8, jnp.bfloat16, 8),
]


@pytest.mark.parametrize("num_heads,num_kv_heads,head_dim,page_size,dtype,block_q", _CPU_GRID)
def test_matches_reference_interpret(num_heads, num_kv_heads, head_dim, page_size, dtype,
                                     block_q):
  # A fresh prompt, an empty row, a chunk starting on a page boundary, one crossing pages
  # mid-page, and a short chunk after a long prefix.
  q_start = [0, 5, 2 * page_size, page_size - 3, 3 * page_size + 5]
  q_lengths = [20, 0, 11, 17, 2]
  args = make_inputs(20, num_heads, num_kv_heads, head_dim, page_size, dtype, q_start,
                     q_lengths)
  check_against_reference(args, block_q=block_q, block_n=16)


@pytest.mark.parametrize("sliding_window", [1, 5, 13, 40])
@pytest.mark.parametrize("num_heads,num_kv_heads,block_q", [(4, 4, 16), (8, 2, 4)])
def test_sliding_window_interpret(sliding_window, num_heads, num_kv_heads, block_q):
  # Windows shorter than a query block (no key every query sees), about one key block, and
  # longer than most rows.
  args = make_inputs(20, num_heads, num_kv_heads, 64, 8, jnp.float32, [0, 37, 9],
                     [20, 19, 6])
  check_against_reference(args, block_q=block_q, block_n=16, sliding_window=sliding_window)


@pytest.mark.parametrize("attention_chunk,sliding_window", [(1, None), (5, None), (8, None),
                                                            (13, None), (40, None), (13, 7)])
@pytest.mark.parametrize("num_heads,num_kv_heads,block_q", [(4, 4, 16), (8, 2, 4)])
def test_chunked_attention_interpret(attention_chunk, sliding_window, num_heads, num_kv_heads,
                                     block_q):
  """Llama 4's chunked attention: chunks shorter than a query block, one page, a key
  block, past most rows; with a window inside them."""
  args = make_inputs(20, num_heads, num_kv_heads, 64, 8, jnp.float32, [0, 37, 9],
                     [20, 19, 6])
  check_against_reference(args, block_q=block_q, block_n=16, attention_chunk=attention_chunk,
                          sliding_window=sliding_window)


def test_chunked_reference_is_dense_attention_within_each_chunk():
  """A fresh prompt under chunked attention: every chunk of C tokens attends causally to
  itself alone (numpy's dense attention per chunk)."""
  chunk, t = 6, 20
  q, k_pages, v_pages, table, q_start, q_lengths = make_inputs(
      t, 4, 2, 64, 8, jnp.float32, [0], [t], seed=3)
  out = np.asarray(_reference(q, k_pages, v_pages, table, q_start, q_lengths,
                              attention_chunk=chunk))
  pos = np.arange(t)
  k = np.asarray(k_pages)[:, np.asarray(table)[0, pos // 8], pos % 8]  # [Hkv, T, D]
  v = np.asarray(v_pages)[:, np.asarray(table)[0, pos // 8], pos % 8]
  qh = np.asarray(q)[0].reshape(t, 2, 2, 64)  # [T, Hkv, group, D]
  logits = np.einsum("tkgd,ksd->tkgs", qh, k) / 8.0
  visible = (pos[None, :] <= pos[:, None]) & (pos[None, :] // chunk == pos[:, None] // chunk)
  logits = np.where(visible[:, None, None, :], logits, -np.inf)
  weights = np.exp(logits - logits.max(-1, keepdims=True))
  weights /= weights.sum(-1, keepdims=True)
  want = np.einsum("tkgs,ksd->tkgd", weights, v).reshape(t, 4, 64)
  np.testing.assert_allclose(out[0], want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("kwargs", [dict(logits_soft_cap=1.5),
                                    dict(logits_soft_cap=2.0, sliding_window=9, scale=0.4)])
def test_soft_cap_interpret(kwargs):
  """Logits capped to C * tanh(logits / C) (Gemma 2) in masked and unmasked blocks, with
  and without a window: the reference's output, which the cap changes."""
  args = make_inputs(20, 8, 2, 64, 8, jnp.float32, [0, 37, 9], [20, 19, 6])
  out = check_against_reference(args, block_q=4, block_n=16, **kwargs)
  uncapped = _reference(*args, **{k: v for k, v in kwargs.items() if k != "logits_soft_cap"})
  assert np.abs(np.asarray(out) - np.asarray(uncapped))[:, :6].max() > 1e-2


@pytest.mark.parametrize("kwargs", [dict(), dict(logits_soft_cap=2.0, sliding_window=9)])
@pytest.mark.parametrize("num_heads,num_kv_heads,block_q", [(4, 4, 16), (6, 2, 4)])
def test_alibi_interpret(kwargs, num_heads, num_kv_heads, block_q):
  """ALiBi's biases (BLOOM's slopes) in masked and unmasked blocks, after a prefix and
  not: the reference's output, which they change."""
  args = make_inputs(20, num_heads, num_kv_heads, 64, 8, jnp.float32, [0, 37, 9],
                     [20, 19, 6])
  out = check_against_reference(args, block_q=block_q, block_n=16, alibi=True, **kwargs)
  assert np.abs(np.asarray(out) - np.asarray(_reference(*args, **kwargs))).max() > 1e-2


@pytest.mark.parametrize("kwargs", [dict(), dict(sliding_window=9), dict(alibi=True)])
@pytest.mark.parametrize("num_heads,num_kv_heads,block_q", [(4, 4, 16), (6, 2, 4)])
def test_sinks_interpret(kwargs, num_heads, num_kv_heads, block_q):
  """Attention sinks (GPT-OSS's) on every query row, after a prefix and not: the
  reference's output, which they change."""
  args = make_inputs(20, num_heads, num_kv_heads, 64, 8, jnp.float32, [0, 37, 9],
                     [20, 19, 6])
  out = check_against_reference(args, block_q=block_q, block_n=16, sinks=True, **kwargs)
  plain = check_against_reference(args, block_q=block_q, block_n=16, **kwargs)
  assert np.abs(np.asarray(out) - np.asarray(plain)).max() > 1e-2


@pytest.mark.parametrize("kwargs", [dict(scale=0.3), dict(block_n=32), dict()])
def test_knobs_and_defaults_interpret(kwargs):
  args = make_inputs(12, 8, 2, 64, 16, jnp.float32, [0, 30, 64], [12, 12, 1],
                     max_pages=6)
  check_against_reference(args, **kwargs)


def test_all_rows_empty_and_cpu_default_path():
  args = make_inputs(8, 4, 2, 64, 8, jnp.float32, [0, 9], [0, 0], max_pages=2)
  out = check_against_reference(args)
  np.testing.assert_array_equal(np.asarray(out), 0.0)
  # interpret=None on CPU is the XLA reference path.
  args = make_inputs(8, 4, 2, 64, 8, jnp.float32, [3, 9], [8, 5])
  check_output(jax_paged.paged_prefill_attention(*args),
               _reference(*args), args[5], jnp.float32)


def test_unsupported_head_dim_takes_reference_path():
  args = make_inputs(6, 4, 2, 72, 8, jnp.float32, [3, 0], [6, 4])
  check_against_reference(args)  # interpret=True: still the reference (head dim 72)


def test_layer_of_pool_interpret():
  """Each layer of a 3-layer pool, by int and by traced index, vs the one-layer call."""
  q, k_pool, v_pool, table, q_start, q_lengths = make_inputs(
      10, 8, 2, 64, 8, jnp.float32, [0, 13, 4], [10, 7, 3], num_layers=3)
  traced = jax.jit(functools.partial(jax_paged.paged_prefill_attention, interpret=True,
                                     block_q=4, block_n=16))
  for layer in range(3):
    want = _reference(q, k_pool[layer], v_pool[layer], table, q_start, q_lengths)
    for got in (jax_paged.paged_prefill_attention(q, k_pool, v_pool, table, q_start,
                                                  q_lengths, layer=layer, interpret=True,
                                                  block_q=4, block_n=16),
                traced(q, k_pool, v_pool, table, q_start, q_lengths, layer=jnp.int32(layer)),
                _reference(q, k_pool, v_pool, table, q_start, q_lengths, layer=layer)):
      check_output(got, want, q_lengths, jnp.float32)


@pytest.mark.parametrize("num_heads,num_kv_heads,sliding_window,soft_cap,alibi,sinks,chunk", [
    (4, 4, None, None, False, False, None), (8, 2, None, None, False, False, None),
    (8, 2, 6, None, False, False, None), (8, 2, 6, 1.5, False, False, None),
    (8, 2, None, None, True, False, None), (4, 4, 6, 1.5, True, False, None),
    (8, 2, 6, None, False, True, None), (4, 4, None, None, True, True, None),
    (8, 2, None, None, False, False, 8), (4, 4, None, 1.5, False, True, 12)])
def test_one_token_equals_decode_interpret(num_heads, num_kv_heads, sliding_window, soft_cap,
                                           alibi, sinks, chunk):
  """T = 1 at position q_start is a decode step over lengths = q_start + 1."""
  q, k_pages, v_pages, table, q_start, q_lengths = make_inputs(
      1, num_heads, num_kv_heads, 64, 8, jnp.float32, [0, 7, 8, 30], [1, 1, 1, 1])
  options = dict(sliding_window=sliding_window, attention_chunk=chunk,
                 logits_soft_cap=soft_cap,
                 alibi_slopes=_alibi(num_heads) if alibi else None,
                 sinks=_sinks(num_heads) if sinks else None, interpret=True)
  out = jax_paged.paged_prefill_attention(q, k_pages, v_pages, table, q_start, q_lengths,
                                          **options)
  decode = jax_paged.paged_decode_attention(q[:, 0], k_pages, v_pages, table, q_start + 1,
                                            block_n=16, **options)
  chex.assert_trees_all_close(out[:, 0], decode, **_TOL[jnp.float32])


def _write_pages(x, table, page_size, num_pages):
  """Contiguous x [B, S, Hkv, D] (numpy) -> a pool [Hkv, num_pages, page_size, D] holding
  row b's position s at page table[b, s // page_size], offset s % page_size; NaN elsewhere."""
  b, s, hkv, d = x.shape
  pos = np.arange(s)
  pool = np.full((hkv, num_pages, page_size, d), np.nan, np.float32)
  pool[:, table[:, pos // page_size], pos % page_size] = x.transpose(2, 0, 1, 3)
  return pool


@pytest.mark.parametrize("num_heads,num_kv_heads,dtype", [(4, 4, jnp.float32),
                                                          (8, 2, jnp.bfloat16)])
@pytest.mark.parametrize("alibi", [False, True])
def test_fresh_prompt_equals_dense_causal_attention_interpret(num_heads, num_kv_heads, dtype,
                                                              alibi):
  """q_start = 0: causal self-attention over the chunk, as jax.nn.dot_product_attention
  computes it on contiguous K/V (with ALiBi: its bias slope_h * (j - i), BLOOM's); and the
  same prompt in two chunks (the second attending to the first through the pages) gives
  the same output."""
  batch, seq, page_size, num_pages = 2, 24, 8, 9
  rng = np.random.default_rng(next(_SEED))
  q, k, v = (rng.standard_normal((batch, seq, heads, 64)).astype(np.float32)
             for heads in (num_heads, num_kv_heads, num_kv_heads))
  table = rng.permutation(num_pages)[:6].reshape(batch, 3)
  k_pages, v_pages = (jnp.asarray(_write_pages(x, table, page_size, num_pages), dtype)
                      for x in (k, v))
  q, k, v = (jnp.asarray(x, dtype) for x in (q, k, v))
  slopes, bias = None, None
  if alibi:
    slopes = _alibi(num_heads)
    pos = np.arange(seq)
    bias = jnp.asarray(slopes[:, None, None] * (pos[None, :] - pos[:, None])[None], dtype)
  want = jax.jit(functools.partial(jax.nn.dot_product_attention, is_causal=True))(
      q, k, v, None if bias is None else bias[None])
  fn = functools.partial(jax_paged.paged_prefill_attention, k_pages=k_pages, v_pages=v_pages,
                         page_table=jnp.asarray(table, jnp.int32), interpret=True,
                         block_n=16, alibi_slopes=slopes)
  rows = lambda n: jnp.full((batch,), n, jnp.int32)
  check_output(fn(q, q_start=rows(0), q_lengths=rows(seq)), want, rows(seq), dtype)
  split = 12  # mid-page; both chunks of one shape (one interpret compile)
  first = fn(q[:, :split], q_start=rows(0), q_lengths=rows(split))
  second = fn(q[:, split:], q_start=rows(split), q_lengths=rows(seq - split))
  check_output(jnp.concatenate([first, second], axis=1), want, rows(seq), dtype)


def test_traced_out_of_range_values_are_clamped_alike():
  """Under jit the kernel (interpret mode) and the reference clamp alike: q_lengths into
  [0, T], then q_start so that the row fits its page table, and page ids into the pool."""
  q, k_pages, v_pages, table, _, _ = make_inputs(6, 4, 2, 64, 8, jnp.float32, [18, 18, 18],
                                                 [6, 6, 6])
  # Row 1 (clamped to all 24 tokens) uses ids past either end, which clamp to the last and
  # first page: those hold copies of its live pages (unused pages are NaN).
  last = k_pages.shape[1] - 1
  k_pages, v_pages = (pages.at[:, last].set(pages[:, table[1, 1]])
                      .at[:, 0].set(pages[:, table[1, 0]]) for pages in (k_pages, v_pages))
  table = table.at[1, 1].set(last + 8).at[1, 0].set(-3)
  q_start, q_lengths = jnp.array([-4, 30, 5], jnp.int32), jnp.array([9, 2, -1], jnp.int32)
  kernel = jax.jit(functools.partial(jax_paged.paged_prefill_attention, interpret=True))
  ref = _reference
  got = kernel(q, k_pages, v_pages, table, q_start, q_lengths)
  want = ref(q, k_pages, v_pages, table, q_start, q_lengths)
  assert not jnp.isnan(got).any()
  chex.assert_trees_all_close(got, want, atol=2e-5, rtol=1e-5)
  clamped = ref(q, k_pages, v_pages, table.at[1, 1].set(last).at[1, 0].set(0),
                jnp.array([0, 22, 5]), jnp.array([6, 2, 0]))
  chex.assert_trees_all_close(want, clamped, atol=1e-6, rtol=1e-6)


def _valid_kwargs():
  return dict(q=jnp.zeros((2, 4, 4, 64)), k_pages=jnp.zeros((2, 5, 8, 64)),
              v_pages=jnp.zeros((2, 5, 8, 64)), page_table=jnp.array([[0, 1], [2, 3]],
                                                                     jnp.int32),
              q_start=jnp.array([0, 3], jnp.int32), q_lengths=jnp.array([4, 2], jnp.int32))


@pytest.mark.parametrize("change,match", [
    (dict(q=jnp.zeros((2, 4, 64))), r"q must have shape \[batch, num_tokens"),
    (dict(q_start=jnp.zeros((3,), jnp.int32)), r"q_start must have shape \[batch=2\]"),
    (dict(q_lengths=jnp.zeros((2,), jnp.float32)), "q_lengths dtype must be int32"),
    (dict(k_pages=jnp.zeros((3, 5, 8, 64)), v_pages=jnp.zeros((3, 5, 8, 64))),
     "num_kv_heads"),
    (dict(page_table=jnp.zeros((2, 2), jnp.float32)), "page_table"),
    (dict(q=jnp.zeros((2, 4, 4, 64), jnp.int8)), "q dtype"),
    (dict(q_lengths=jnp.array([5, 2], jnp.int32)),
     r"q_lengths must be in \[0, num_tokens = 4\].*got 5 for sequence 0"),
    (dict(q_start=jnp.array([0, -1], jnp.int32)), "q_start must be >= 0, got -1 for sequence 1"),
    (dict(q_start=jnp.array([0, 15], jnp.int32)),
     r"q_start \+ q_lengths must be <= max_pages_per_seq \* page_size = 16, got 15 \+ 2"),
    (dict(page_table=jnp.array([[0, 1], [5, 3]], jnp.int32)),
     r"page ids in \[0, num_pages=5\).*got 5 at \[1, 0\]"),
    (dict(sliding_window=0), "sliding_window"),
    (dict(attention_chunk=0), "attention_chunk must be a positive int"),
    (dict(logits_soft_cap=-1.0), "logits_soft_cap must be a positive finite number"),
    (dict(alibi_slopes=jnp.ones((3,))), r"alibi_slopes must be float32 of shape \[num_heads=4\]"),
    (dict(sinks=jnp.ones((4, 1))), r"sinks must be float32 of shape \[num_heads=4\]"),
    (dict(sinks=jnp.full((4,), -jnp.inf)), "sinks must be finite"),
    (dict(block_q=24), "block_q must be a power of two"),
    (dict(block_q=4), r"block_q x the q heads .* must be >= 16"),
    (dict(block_n=8), "block_n must be >= 16"),
    (dict(num_warps=0), "num_warps"),
    (dict(layer=0), "pools of shape"),
])
def test_bad_inputs_raise(change, match):
  kwargs = _valid_kwargs()
  kwargs.update(change)
  with pytest.raises(ValueError, match=match):
    jax_paged.paged_prefill_attention(**kwargs)


def test_reference_validates_too_and_skips_garbage_entries():
  kwargs = _valid_kwargs()
  with pytest.raises(ValueError, match="q_lengths must be in"):
    reference.paged_prefill_attention(**dict(kwargs, q_lengths=jnp.array([4, 5], jnp.int32)))
  # A garbage id past a row's used pages (row 0 uses 4 tokens = 1 page) is never read.
  jax_paged.paged_prefill_attention(**dict(kwargs, page_table=jnp.array([[0, 99], [2, 3]],
                                                                        jnp.int32)))


def test_default_config():
  assert pp.default_config(1, 64, 64, 2) == (64, 64, 4, 2)  # GPT-2
  assert pp.default_config(1, 64, 1000, 2) == (64, 64, 4, 2)
  assert pp.default_config(4, 128, 256, 2) == (32, 64, 4, 2)  # GQA: 128 rows
  assert pp.default_config(1, 128, 20, 2) == (32, 64, 4, 2)  # a short chunk: fewer rows
  assert pp.default_config(4, 128, 1, 2)[0] == 4  # a dot needs 16 rows
  assert pp.default_config(1, 256, 512, 4) == (64, 32, 8, 2)
  # Quantized pages: blocks of whole pages, over fewer query rows when a page is wider.
  assert pp.default_config(1, 64, 64, 2, min_block_n=16) == (64, 64, 4, 2)
  assert pp.default_config(1, 256, 512, 2, min_block_n=128) == (16, 128, 8, 2)
  assert pp.default_config(4, 64, 256, 2, min_block_n=128) == (8, 128, 4, 2)


_GPU_GRID = [
    (12, 12, 64, 16, jnp.bfloat16),
    (32, 8, 128, 16, jnp.bfloat16),
    (32, 8, 64, 32, jnp.bfloat16),
    (16, 16, 128, 64, jnp.float16),
    (8, 1, 256, 16, jnp.bfloat16),
    (12, 4, 80, 128, jnp.float32),
    (8, 8, 96, 8, jnp.bfloat16),
]


@pytest.mark.gpu
@pytest.mark.parametrize("num_heads,num_kv_heads,head_dim,page_size,dtype", _GPU_GRID)
@pytest.mark.parametrize("kwargs", [dict(), dict(sliding_window=100),
                                    dict(logits_soft_cap=2.0, sliding_window=100),
                                    dict(alibi=True), dict(alibi=True, sliding_window=100),
                                    dict(sinks=True, sliding_window=128)])
def test_matches_reference_gpu(num_heads, num_kv_heads, head_dim, page_size, dtype, kwargs):
  rng = np.random.default_rng(next(_SEED))
  q_start = rng.integers(0, 700, size=6)
  q_lengths = rng.integers(1, 300, size=6)
  q_start[:3], q_lengths[:3] = [0, 512, 31], [300, 0, 1]
  args = make_inputs(300, num_heads, num_kv_heads, head_dim, page_size, dtype, q_start,
                     q_lengths)
  check_against_reference(args, interpret=False, **kwargs)


@pytest.mark.gpu
def test_layer_of_pool_and_jit_gpu():
  q, k_pool, v_pool, table, q_start, q_lengths = make_inputs(
      64, 32, 8, 128, 16, jnp.bfloat16, [0, 100, 768, 5], [64, 64, 17, 0], num_layers=2)
  fn = jax.jit(jax_paged.paged_prefill_attention)
  for layer in range(2):
    want = _reference(q, k_pool[layer], v_pool[layer], table, q_start, q_lengths)
    check_output(fn(q, k_pool, v_pool, table, q_start, q_lengths, layer=jnp.int32(layer)),
                 want, q_lengths, jnp.bfloat16)
