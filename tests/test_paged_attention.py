"""Paged decode attention kernel vs the plain-jnp reference.

CPU: the Pallas kernel in interpret mode on small shapes. `-m gpu`: the compiled Triton
kernel. Inputs are fresh random values, page tables are random permutations of the pool,
and entries past each sequence's last page hold garbage (negative / out of range) that
must never be used as an index.
"""

import functools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_paged
from jax_paged.kernels import paged_attention as pa
from jax_paged import reference

_TOL = {jnp.float32: dict(atol=2e-5, rtol=1e-5), jnp.bfloat16: dict(atol=2e-2, rtol=2e-2),
        jnp.float16: dict(atol=2e-3, rtol=2e-3)}
_SEED = iter(range(10**6))


def make_inputs(batch, num_heads, num_kv_heads, head_dim, page_size, max_pages, dtype,
                lengths, seed=None):
  """Random q/K/V, a permuted page table with garbage past each sequence's last page."""
  key = jax.random.key(next(_SEED) if seed is None else seed)
  kq, kk, kv, kp, kg = jax.random.split(key, 5)
  num_pages = batch * max_pages + 3
  q = jax.random.normal(kq, (batch, num_heads, head_dim), dtype)
  k_pages = jax.random.normal(kk, (num_kv_heads, num_pages, page_size, head_dim), dtype)
  v_pages = jax.random.normal(kv, (num_kv_heads, num_pages, page_size, head_dim), dtype)
  table = jax.random.permutation(kp, num_pages)[:batch * max_pages].reshape(batch, max_pages)
  lengths = jnp.asarray(lengths, jnp.int32)
  used = (lengths + page_size - 1) // page_size
  garbage = jax.random.randint(kg, table.shape, -10**6, 10**6)
  table = jnp.where(jnp.arange(max_pages)[None, :] < used[:, None], table, garbage)
  return q, k_pages, v_pages, table.astype(jnp.int32), lengths


def random_sinks(num_heads: int) -> jax.Array:
  """Fresh attention sinks (GPT-OSS's learned logits), float32 [num_heads], uniform in
  [-1, 4]: beside a few dozen keys' logits of about 1, some weigh much, some little."""
  return jax.random.uniform(jax.random.key(next(_SEED)), (num_heads,), minval=-1.0,
                            maxval=4.0)


def check_against_reference(args, *, interpret, alibi=False, sinks=False, **kwargs):
  """The kernel's (out, lse) vs the reference's; `alibi`: with BLOOM's slopes for q's
  heads; `sinks`: with random attention sinks. Returns the kernel's out."""
  q, *_, lengths = args
  if alibi:
    kwargs["alibi_slopes"] = jnp.asarray(jax_paged.nn.alibi_slopes(q.shape[1]))
  if sinks:
    kwargs["sinks"] = random_sinks(q.shape[1])
  ref_kwargs = {k: kwargs[k] for k in ("scale", "logits_soft_cap", "sliding_window",
                                       "attention_chunk",
                                       "alibi_slopes", "sinks") if k in kwargs}
  out, lse = jax_paged.paged_decode_attention(*args, return_lse=True, interpret=interpret,
                                              **kwargs)
  ref_out, ref_lse = reference.paged_decode_attention(*args, return_lse=True, **ref_kwargs)
  chex.assert_trees_all_equal_shapes_and_dtypes((out, lse), (ref_out, ref_lse))
  assert not np.isnan(np.asarray(out, np.float32)).any()
  assert not np.isnan(np.asarray(lse)).any()
  empty = np.asarray(lengths) == 0
  np.testing.assert_array_equal(np.asarray(out, np.float32)[empty], 0.0)
  empty_lse = -np.inf if not sinks else np.asarray(kwargs["sinks"])  # the sink alone
  np.testing.assert_allclose(np.asarray(lse)[empty], np.broadcast_to(
      empty_lse, lse[empty].shape), rtol=1e-6)
  chex.assert_trees_all_close(out.astype(jnp.float32), ref_out.astype(jnp.float32),
                              **_TOL[q.dtype.type])
  chex.assert_trees_all_close(lse, ref_lse, atol=1e-4, rtol=1e-5)
  return out


# (heads, kv heads, head dim, page size, dtype): MHA / GQA / MQA, every head dim, page
# sizes 8..128, the three dtypes.
_CPU_GRID = [
    (4, 4, 64, 8, jnp.float32),
    (4, 4, 80, 16, jnp.bfloat16),
    (2, 2, 256, 32, jnp.float16),
    (8, 2, 128, 16, jnp.float32),
    (8, 2, 96, 8, jnp.bfloat16),
    (6, 3, 64, 128, jnp.float32),
    (8, 1, 128, 64, jnp.float16),
    (16, 1, 80, 16, jnp.float32),
    (32, 8, 256, 16, jnp.bfloat16),
]


@pytest.mark.parametrize("num_heads,num_kv_heads,head_dim,page_size,dtype", _CPU_GRID)
@pytest.mark.parametrize("num_splits", [1, 3])
def test_matches_reference_interpret(num_heads, num_kv_heads, head_dim, page_size, dtype,
                                     num_splits):
  # Ragged: empty, one token, an exact page multiple, a partial last page.
  lengths = [0, 1, 2 * page_size, 3 * page_size - 5]
  args = make_inputs(4, num_heads, num_kv_heads, head_dim, page_size, 3, dtype, lengths)
  check_against_reference(args, interpret=True, num_splits=num_splits, block_n=16)


@pytest.mark.parametrize("kwargs", [
    dict(logits_soft_cap=3.0, num_splits=2),
    dict(sliding_window=13, num_splits=2),
    dict(sliding_window=40, logits_soft_cap=7.0, scale=0.3),
    # Chunked attention (Llama 4's): chunks shorter than a block, mid-page, with a window.
    dict(attention_chunk=5, num_splits=1),
    dict(attention_chunk=24, num_splits=2),
    dict(attention_chunk=16, sliding_window=9, num_splits=3),
    dict(num_splits=None),
    dict(num_splits=7),  # more splits than blocks: some splits are empty
])
@pytest.mark.parametrize("num_heads,num_kv_heads", [(4, 4), (8, 2)])
def test_options_interpret(kwargs, num_heads, num_kv_heads):
  args = make_inputs(3, num_heads, num_kv_heads, 64, 8, 6, jnp.float32, [0, 45, 23])
  check_against_reference(args, interpret=True, block_n=16, **kwargs)


@pytest.mark.parametrize("attention_chunk", [1, 5, 16, 24])
def test_chunked_attention_is_a_window_back_to_the_chunks_start(attention_chunk):
  """The reference's chunked attention is, for a sequence of length L, a sliding window
  of (L - 1) % C + 1 tokens: the keys of its last token's chunk."""
  lengths = [0, 45, 23, 16, 17]
  args = make_inputs(5, 8, 2, 64, 8, 6, jnp.float32, lengths)
  out = reference.paged_decode_attention(*args, attention_chunk=attention_chunk)
  for b, length in enumerate(lengths[1:], 1):
    window = reference.paged_decode_attention(
        *args, sliding_window=(length - 1) % attention_chunk + 1)
    np.testing.assert_allclose(out[b], window[b], rtol=1e-6, atol=1e-7)
  if attention_chunk < 45:  # it changes what a long sequence sees
    assert np.abs(out[1] - reference.paged_decode_attention(*args)[1]).max() > 1e-3


@pytest.mark.parametrize("kwargs", [dict(num_splits=1), dict(num_splits=3),
                                    dict(sliding_window=13, logits_soft_cap=5.0, num_splits=2)])
@pytest.mark.parametrize("num_heads,num_kv_heads", [(4, 4), (8, 2), (6, 1)])
def test_alibi_interpret(kwargs, num_heads, num_kv_heads):
  """ALiBi's biases (BLOOM's slopes, the largest 2^-1.3..2^-8) in every split: the
  reference's output, which they change."""
  args = make_inputs(3, num_heads, num_kv_heads, 64, 8, 6, jnp.float32, [0, 45, 23])
  out = check_against_reference(args, interpret=True, block_n=16, alibi=True, **kwargs)
  plain = reference.paged_decode_attention(
      *args, **{k: v for k, v in kwargs.items() if k != "num_splits"})
  assert np.abs(np.asarray(out) - np.asarray(plain))[1:].max() > 1e-2


@pytest.mark.parametrize("kwargs", [dict(num_splits=1), dict(num_splits=3),
                                    dict(num_splits=7),  # empty splits: no sink there
                                    dict(sliding_window=13, logits_soft_cap=5.0, num_splits=2),
                                    dict(alibi=True, num_splits=2)])
@pytest.mark.parametrize("num_heads,num_kv_heads", [(4, 4), (8, 2), (6, 1)])
def test_sinks_interpret(kwargs, num_heads, num_kv_heads):
  """Attention sinks (GPT-OSS's), counted once whatever the splits: the reference's
  output, which they change."""
  args = make_inputs(3, num_heads, num_kv_heads, 64, 8, 6, jnp.float32, [0, 45, 23])
  out = check_against_reference(args, interpret=True, block_n=16, sinks=True, **kwargs)
  plain = check_against_reference(args, interpret=True, block_n=16, **kwargs)
  assert np.abs(np.asarray(out) - np.asarray(plain))[1:].max() > 1e-2


@pytest.mark.parametrize("kwargs", [dict(num_splits=1), dict(num_splits=3),
                                    dict(num_splits=1, sliding_window=5)])
def test_pages_of_no_live_token_never_leak_interpret(kwargs):
  """Every page no live token uses holds NaN K and inf V (page 0 aside: the reference
  reads it at dead positions): none of it may reach the output, whatever the kernel
  loads for the masked tokens of a sequence's blocks or its garbage table entries."""
  page_size, max_pages = 8, 4
  q, k_pages, v_pages, table, lengths = make_inputs(4, 4, 4, 64, page_size, max_pages,
                                                    jnp.float32, [0, 1, 9, 30])
  used = (np.asarray(lengths)[:, None] + page_size - 1) // page_size > np.arange(max_pages)
  live_pages = np.zeros(k_pages.shape[1], bool)
  live_pages[np.asarray(table)[used]] = True
  live_pages[0] = True
  dead = jnp.asarray(~live_pages)[None, :, None, None]
  args = (q, jnp.where(dead, jnp.nan, k_pages), jnp.where(dead, jnp.inf, v_pages), table,
          lengths)
  check_against_reference(args, interpret=True, block_n=16, **kwargs)


def test_default_block_size_and_all_empty_interpret():
  args = make_inputs(2, 8, 2, 128, 16, 8, jnp.bfloat16, [0, 0])
  check_against_reference(args, interpret=True)
  args = make_inputs(2, 4, 4, 64, 16, 8, jnp.float32, [128, 77])
  check_against_reference(args, interpret=True)


def test_jit_and_vmap_interpret():
  args = make_inputs(2, 8, 2, 64, 8, 3, jnp.float32, [20, 7])
  fn = functools.partial(jax_paged.paged_decode_attention, interpret=True, num_splits=2,
                         block_n=16)
  expected = reference.paged_decode_attention(*args)
  chex.assert_trees_all_close(jax.jit(fn)(*args), expected, atol=2e-5, rtol=1e-5)
  # vmap over a leading "layer" axis of q and the pools.
  q, k, v, table, lengths = args
  stacked = (jnp.stack([q, -q]), jnp.stack([k, v]), jnp.stack([v, k]))
  out = jax.vmap(fn, in_axes=(0, 0, 0, None, None))(*stacked, table, lengths)
  for layer in range(2):
    expected = reference.paged_decode_attention(stacked[0][layer], stacked[1][layer],
                                                stacked[2][layer], table, lengths)
    chex.assert_trees_all_close(out[layer], expected, atol=2e-5, rtol=1e-5)


def test_cpu_default_is_reference_path():
  args = make_inputs(2, 4, 2, 64, 8, 3, jnp.float32, [9, 24])
  chex.assert_trees_all_close(jax_paged.paged_decode_attention(*args),
                              reference.paged_decode_attention(*args), atol=1e-6)


def test_auto_num_splits(monkeypatch):
  monkeypatch.setattr(pa.triton_backend, "sm_count", lambda: 132)
  # Small batch, long context: split to fill the GPU; big batch: no split.
  assert pa.auto_num_splits(1, 8, 32768, 32) > 16
  assert pa.auto_num_splits(256, 12, 1024, 64) == 1
  # 3.5 programs per SM run unsplit (Llama-1B's 8 kv heads at batch 64); fewer split.
  assert pa.auto_num_splits(64, 8, 2048, 64) == 1
  assert pa.auto_num_splits(48, 8, 2048, 64) == 2
  # Head dim 256 counts twice: 256 programs (Gemma-2B's one kv head at batch 256) run
  # unsplit, 64 in 4 splits, where head dim 128 splits them in 2 and 8.
  assert [pa.auto_num_splits(b, 1, 2048, 64, head_dim=256) for b in (256, 64)] == [1, 4]
  assert [pa.auto_num_splits(b, 1, 2048, 64) for b in (256, 64)] == [2, 8]
  # Groups past 32 rows of 128 count their rows: StarCoder's 48 q heads of 128 over one kv
  # head (64 rows: twice) and Falcon-7B's 71 of 64 (128 rows of 64: twice) split half as
  # much; 16 rows of 128 as one.
  assert [pa.auto_num_splits(b, 1, 2048, 64, group=48) for b in (256, 64, 16)] == [1, 4, 8]
  assert pa.auto_num_splits(16, 1, 8192, 64, group=48) == 16
  assert [pa.auto_num_splits(b, 1, 2048, 64, head_dim=64, group=71)
          for b in (256, 64)] == [1, 4]
  assert [pa.auto_num_splits(b, 1, 2048, 64, group=16) for b in (256, 64)] == [2, 8]
  # Short sequences are never split into less than a few blocks each.
  assert pa.auto_num_splits(1, 1, 128, 32) == 1
  # The latent kernel's settings: splits of one block, for 2 programs per SM (DeepSeek's
  # one head block at batch 1 / 16 / 64 over 74 pages of 16).
  latent = dict(min_blocks_per_split=1, programs_per_sm=2)
  assert [pa.auto_num_splits(b, 1, 1184, 64, **latent) for b in (1, 16, 64)] == [16, 16, 4]
  assert pa.auto_num_splits(1, 1, 1184, 64) == 4  # (4 blocks per split)


def test_default_config(monkeypatch):
  monkeypatch.setattr(pa.triton_backend, "sm_count", lambda: 132)
  assert pa.default_config(64, 4, 128) == (64, 4, 3)  # GQA
  assert pa.default_config(5000, 4, 128) == (64, 4, 3)
  assert pa.default_config(768, 1, 64) == (64, 2, 2)  # MHA, fewer than 8 programs per SM
  assert pa.default_config(8 * 132, 1, 64) == (32, 2, 2)  # MHA, one wave of small tiles
  assert pa.default_config(64, 1, 256) == (64, 4, 2)  # D = 256 keeps 4 warps


def _pool_of_layers(num_layers, *args_kwargs):
  """make_inputs for one layer, plus a [num_layers, ...] pool of fresh random layers whose
  layer i is the one-layer k/v of `layers[i]`."""
  layers = [make_inputs(*args_kwargs) for _ in range(num_layers)]
  q, _, _, table, lengths = layers[0]
  k_pool = jnp.stack([l[1] for l in layers])
  v_pool = jnp.stack([l[2] for l in layers])
  return q, k_pool, v_pool, table, lengths, layers


def check_layers(interpret, num_heads, num_kv_heads, dtype, **kwargs):
  """Each layer of a 3-layer pool, by int and by traced index, vs the one-layer call."""
  q, k_pool, v_pool, table, lengths, layers = _pool_of_layers(
      3, 4, num_heads, num_kv_heads, 64, 16, 6, dtype, [0, 17, 96, 64])
  traced = jax.jit(functools.partial(jax_paged.paged_decode_attention, interpret=interpret,
                                     **kwargs))
  for layer in range(3):
    want = reference.paged_decode_attention(q, layers[layer][1], layers[layer][2], table,
                                            lengths)
    for got in (jax_paged.paged_decode_attention(q, k_pool, v_pool, table, lengths,
                                                 layer=layer, interpret=interpret, **kwargs),
                traced(q, k_pool, v_pool, table, lengths, layer=jnp.int32(layer)),
                reference.paged_decode_attention(q, k_pool, v_pool, table, lengths,
                                                 layer=layer)):
      chex.assert_trees_all_close(got.astype(jnp.float32), want.astype(jnp.float32),
                                  **_TOL[dtype])


@pytest.mark.parametrize("num_heads,num_kv_heads", [(4, 4), (8, 2)])
def test_layer_of_pool_interpret(num_heads, num_kv_heads):
  check_layers(True, num_heads, num_kv_heads, jnp.float32, num_splits=2)


@pytest.mark.parametrize("pool_shape,layer,match", [
    ((3, 4, 5, 8, 64), None, "pass layer"), ((3, 4, 5, 8, 64), 3, "layer must be in"),
    ((3, 4, 5, 8, 64), -1, "layer must be in"), ((3, 4, 5, 8, 64), 1.0, "layer must be"),
    ((3, 4, 5, 8, 64), jnp.zeros(2, jnp.int32), "layer must be"),
    ((4, 5, 8, 64), 0, "pools of shape")])  # one layer's pages with layer=
def test_bad_layer_raises(pool_shape, layer, match):
  pool = jnp.zeros(pool_shape)
  with pytest.raises(ValueError, match=match):
    jax_paged.paged_decode_attention(jnp.zeros((2, 4, 64)), pool, pool,
                                     jnp.zeros((2, 3), jnp.int32), jnp.zeros(2, jnp.int32),
                                     layer=layer)


@pytest.mark.parametrize("change,name", [
    (dict(q=jnp.zeros((2, 4, 64, 1))), "q"),
    (dict(k_pages=jnp.zeros((3, 5, 8, 64)), v_pages=jnp.zeros((3, 5, 8, 64))), "num_kv_heads"),
    (dict(q=jnp.zeros((2, 4, 72)), k_pages=jnp.zeros((2, 5, 8, 72)),
          v_pages=jnp.zeros((2, 5, 8, 72))), "head_dim"),
    (dict(k_pages=jnp.zeros((4, 5, 12, 64)), v_pages=jnp.zeros((4, 5, 12, 64))), "page_size"),
    (dict(page_table=jnp.zeros((2, 3), jnp.float32)), "page_table"),
    (dict(lengths=jnp.zeros((3,), jnp.int32)), "lengths"),
    (dict(q=jnp.zeros((2, 4, 64), jnp.int8)), "q"),
    (dict(num_splits=0), "num_splits"),
    (dict(block_n=24), "block_n"),
    (dict(attention_chunk=0), "attention_chunk must be a positive int or None, got 0"),
    (dict(attention_chunk=2.5), "attention_chunk must be a positive int"),
    (dict(alibi_slopes=jnp.ones((3,))), "alibi_slopes must be float32 of shape"),
    (dict(alibi_slopes=jnp.ones((4,), jnp.bfloat16)), "alibi_slopes must be float32"),
    (dict(alibi_slopes=jnp.full((4,), jnp.nan)), "alibi_slopes must be finite"),
    (dict(sinks=jnp.ones((8,))), r"sinks must be float32 of shape \[num_heads=4\]"),
    (dict(sinks=jnp.ones((4,), jnp.bfloat16)), "sinks must be float32"),
    (dict(sinks=jnp.array([0.0, 1.0, jnp.inf, 2.0])), "sinks must be finite"),
])
def test_bad_inputs_raise(change, name):
  kwargs = dict(q=jnp.zeros((2, 4, 64)), k_pages=jnp.zeros((4, 5, 8, 64)),
                v_pages=jnp.zeros((4, 5, 8, 64)), page_table=jnp.zeros((2, 3), jnp.int32),
                lengths=jnp.zeros((2,), jnp.int32))
  kwargs.update(change)
  with pytest.raises(ValueError, match=name):
    jax_paged.paged_decode_attention(**kwargs)


_GPU_GRID = [
    (12, 12, 64, 16, jnp.bfloat16),
    (32, 8, 128, 16, jnp.bfloat16),
    (32, 32, 128, 32, jnp.float16),
    (8, 1, 256, 8, jnp.bfloat16),
    (8, 8, 256, 16, jnp.bfloat16),
    (16, 4, 80, 64, jnp.float32),
    (8, 8, 96, 128, jnp.float32),
    (64, 4, 128, 16, jnp.bfloat16),
    (71, 1, 64, 16, jnp.bfloat16),  # Falcon-7B's: a group of 71 padded to 128 rows
]


@pytest.mark.gpu
@pytest.mark.parametrize("num_heads,num_kv_heads,head_dim,page_size,dtype", _GPU_GRID)
@pytest.mark.parametrize("kwargs", [dict(num_splits=1), dict(num_splits=5), dict(),
                                    dict(sliding_window=300, logits_soft_cap=20.0),
                                    dict(alibi=True), dict(alibi=True, num_splits=3,
                                                           sliding_window=300),
                                    dict(sinks=True), dict(sinks=True, num_splits=4,
                                                           sliding_window=128)])
def test_matches_reference_gpu(num_heads, num_kv_heads, head_dim, page_size, dtype, kwargs):
  rng = np.random.default_rng(next(_SEED))
  max_pages = 1024 // page_size + 1
  lengths = rng.integers(1, max_pages * page_size, size=6)
  lengths[:3] = [0, page_size * 7, 1]
  args = make_inputs(6, num_heads, num_kv_heads, head_dim, page_size, max_pages, dtype,
                     lengths)
  check_against_reference(args, interpret=False, **kwargs)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
def test_mha_many_programs_gpu(dtype):
  # >= 8 MHA programs per SM take the 32-token default block (`default_config`).
  rng = np.random.default_rng(next(_SEED))
  batch = pa.triton_backend.sm_count() + 5  # x 8 kv heads: > 8 programs per SM
  lengths = rng.integers(1, 320, size=batch)
  lengths[:2] = [0, 32]
  args = make_inputs(batch, 8, 8, 64, 16, 20, dtype, lengths)
  assert pa.default_config(batch * 8, 1, 64)[0] == 32
  check_against_reference(args, interpret=False)


@pytest.mark.gpu
@pytest.mark.parametrize("num_heads,num_kv_heads,dtype", [(12, 12, jnp.bfloat16),
                                                          (32, 8, jnp.float16)])
def test_layer_of_pool_gpu(num_heads, num_kv_heads, dtype):
  check_layers(False, num_heads, num_kv_heads, dtype)


@pytest.mark.gpu
def test_jit_vmap_gpu():
  args = make_inputs(4, 32, 8, 128, 16, 20, jnp.bfloat16, [0, 300, 17, 320])
  out = jax.jit(jax_paged.paged_decode_attention)(*args)
  chex.assert_trees_all_close(out.astype(jnp.float32),
                              reference.paged_decode_attention(*args).astype(jnp.float32),
                              atol=2e-2, rtol=2e-2)
  q, k, v, table, lengths = args
  out = jax.vmap(jax_paged.paged_decode_attention, in_axes=(0, 0, 0, None, None))(
      jnp.stack([q, q]), jnp.stack([k, v]), jnp.stack([v, k]), table, lengths)
  chex.assert_trees_all_close(out[1].astype(jnp.float32),
                              reference.paged_decode_attention(q, v, k, table, lengths)
                              .astype(jnp.float32), atol=2e-2, rtol=2e-2)


def _bad_value_inputs():
  """q, pools of 6 pages of 8 tokens, a page table [2, 3] and lengths [2] of fresh random
  values (capacity 24 tokens per sequence)."""
  ks = jax.random.split(jax.random.key(21), 3)
  q = jax.random.normal(ks[0], (2, 4, 64), jnp.float32)
  k_pages = jax.random.normal(ks[1], (2, 6, 8, 64), jnp.float32)
  v_pages = jax.random.normal(ks[2], (2, 6, 8, 64), jnp.float32)
  table = jnp.array([[3, 1, 5], [0, 2, 4]], jnp.int32)
  return q, k_pages, v_pages, table


@pytest.mark.parametrize("lengths,table_fix,match", [
    ([25, 3], None, r"lengths must be in \[0, max_pages_per_seq \* page_size = 24\], got 25"),
    ([-1, 3], None, "got -1 for sequence 0"),
    ([9, 3], ((0, 1), 6), r"page ids in \[0, num_pages=6\).*got 6 at \[0, 1\]"),
    ([9, 3], ((1, 0), -2), r"got -2 at \[1, 0\]"),
])
@pytest.mark.parametrize("fn", [jax_paged.paged_decode_attention,
                                reference.paged_decode_attention])
def test_concrete_out_of_range_values_raise(fn, lengths, table_fix, match):
  q, k_pages, v_pages, table = _bad_value_inputs()
  bad = table if table_fix is None else table.at[table_fix[0]].set(table_fix[1])
  with pytest.raises(ValueError, match=match):
    fn(q, k_pages, v_pages, bad, jnp.asarray(lengths, jnp.int32))
  # An out-of-range id past a sequence's used pages is garbage, never read: no error.
  fn(q, k_pages, v_pages, table.at[1, 2].set(99), jnp.array([16, 3], jnp.int32))


def test_traced_out_of_range_values_are_clamped_alike():
  """Under jit the kernel (interpret mode) and the reference agree on lengths past the
  capacity, negative lengths and page ids outside the pool: both clamp."""
  q, k_pages, v_pages, table = _bad_value_inputs()
  lengths = jnp.array([40, -3], jnp.int32)
  kernel = jax.jit(lambda *a: jax_paged.paged_decode_attention(*a, interpret=True,
                                                               return_lse=True))
  ref = jax.jit(lambda *a: reference.paged_decode_attention(*a, return_lse=True))
  got, want = kernel(q, k_pages, v_pages, table, lengths), ref(q, k_pages, v_pages, table,
                                                                 lengths)
  chex.assert_trees_all_close(got, want, rtol=1e-5, atol=1e-5)
  chex.assert_trees_all_close(want, ref(q, k_pages, v_pages, table, jnp.array([24, 0])),
                              rtol=1e-6, atol=1e-6)
  wild = jnp.array([[3, 9, 5], [-4, 2, 4]], jnp.int32)  # 9 -> 5, -4 -> 0
  want = ref(q, k_pages, v_pages, wild, lengths)
  chex.assert_trees_all_close(want, ref(q, k_pages, v_pages,
                                        jnp.array([[3, 5, 5], [0, 2, 4]]), lengths),
                              rtol=1e-6, atol=1e-6)
  chex.assert_trees_all_close(kernel(q, k_pages, v_pages, wild, lengths), want, rtol=1e-5,
                              atol=1e-5)
