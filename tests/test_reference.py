"""The plain-jnp references against straightforward numpy loops on fresh random inputs."""

import chex
import jax.numpy as jnp
import numpy as np
import pytest

from jax_paged import reference


def numpy_paged_decode(q, k_pages, v_pages, page_table, lengths, scale, soft_cap, window,
                       slopes=None, sinks=None):
  """One sequence, one head, one position at a time: the definition, in float64 (ALiBi's
  `slopes` times the keys' absolute positions, as BLOOM adds them: its lse is the
  relative bias's plus slope * (L - 1); `sinks` as GPT-OSS's eager attention counts them:
  a last logit per head, concatenated, whose probability is dropped)."""
  b, h, d = q.shape
  hkv, _, page_size, _ = k_pages.shape
  out = np.zeros((b, h, d))
  lse = np.full((b, h), -np.inf) if sinks is None else np.tile(sinks.astype(np.float64), (b, 1))
  for i in range(b):
    start = 0 if window is None else max(0, lengths[i] - window)
    positions = range(start, lengths[i])
    if not positions:
      continue
    for head in range(h):
      kv = head // (h // hkv)
      ks = np.stack([k_pages[kv, page_table[i, p // page_size], p % page_size] for p in positions])
      vs = np.stack([v_pages[kv, page_table[i, p // page_size], p % page_size] for p in positions])
      logits = scale * ks.astype(np.float64) @ q[i, head].astype(np.float64)
      if soft_cap is not None:
        logits = soft_cap * np.tanh(logits / soft_cap)
      if slopes is not None:
        logits = logits + slopes[head] * np.asarray(positions, np.float64)
      if sinks is not None:
        logits = np.append(logits, sinks[head])
      m = logits.max()
      w = np.exp(logits - m)
      lse[i, head] = m + np.log(w.sum())
      out[i, head] = (w / w.sum())[:len(positions)] @ vs.astype(np.float64)
  return out, lse


def random_paged_inputs(rng, b, h, hkv, d, page_size, max_pages, num_pages, lengths):
  q = rng.standard_normal((b, h, d)).astype(np.float32)
  k_pages = rng.standard_normal((hkv, num_pages, page_size, d)).astype(np.float32)
  v_pages = rng.standard_normal((hkv, num_pages, page_size, d)).astype(np.float32)
  # Each sequence owns distinct pages, randomly permuted; entries past its last page are
  # garbage, including ids that do not exist.
  perm = rng.permutation(num_pages)[:b * max_pages].reshape(b, max_pages)
  garbage = rng.integers(-1000, 1000, size=(b, max_pages))
  used = -(-np.asarray(lengths) // page_size)
  table = np.where(np.arange(max_pages)[None, :] < used[:, None], perm, garbage)
  return q, k_pages, v_pages, table.astype(np.int32), np.asarray(lengths, np.int32)


@pytest.mark.parametrize("h,hkv", [(4, 4), (8, 2), (6, 1)])
@pytest.mark.parametrize("soft_cap,window", [(None, None), (5.0, None), (None, 7), (3.0, 20)])
def test_paged_decode_matches_numpy(h, hkv, soft_cap, window):
  rng = np.random.default_rng([h, hkv, int(soft_cap or 0), window or 0])
  page_size, max_pages = 8, 5
  lengths = [0, 1, 8, 13, 40]  # empty, one token, exact page, ragged, full
  q, k, v, table, lens = random_paged_inputs(rng, len(lengths), h, hkv, 16, page_size,
                                             max_pages, 32, lengths)
  scale = 0.3
  out, lse = reference.paged_decode_attention(
      jnp.asarray(q), jnp.asarray(k), jnp.asarray(v), jnp.asarray(table), jnp.asarray(lens),
      scale=scale, logits_soft_cap=soft_cap, sliding_window=window, return_lse=True)
  want_out, want_lse = numpy_paged_decode(q, k, v, table, lens, scale, soft_cap, window)
  chex.assert_tree_all_finite(out)
  np.testing.assert_allclose(out, want_out, rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(lse, want_lse, rtol=1e-5, atol=1e-5)
  assert np.all(lse[0] == -np.inf) and np.all(np.asarray(out[0]) == 0)


@pytest.mark.parametrize("h,hkv", [(4, 4), (6, 2)])
@pytest.mark.parametrize("soft_cap,window", [(None, None), (3.0, 20)])
def test_paged_decode_alibi_matches_numpy(h, hkv, soft_cap, window):
  rng = np.random.default_rng([h, hkv, 7])
  lengths = [0, 1, 8, 13, 40]
  q, k, v, table, lens = random_paged_inputs(rng, len(lengths), h, hkv, 16, 8, 5, 32,
                                             lengths)
  slopes = rng.uniform(0.01, 1.0, h).astype(np.float32)
  out, lse = reference.paged_decode_attention(
      jnp.asarray(q), jnp.asarray(k), jnp.asarray(v), jnp.asarray(table), jnp.asarray(lens),
      scale=0.3, logits_soft_cap=soft_cap, sliding_window=window,
      alibi_slopes=jnp.asarray(slopes), return_lse=True)
  want_out, want_lse = numpy_paged_decode(q, k, v, table, lens, 0.3, soft_cap, window,
                                          slopes)
  want_lse -= slopes[None, :] * (lens[:, None] - 1)
  plain = numpy_paged_decode(q, k, v, table, lens, 0.3, soft_cap, window)[0]
  assert np.abs(want_out - plain)[2:].max() > 1e-2  # the biases matter here
  chex.assert_tree_all_finite(out)
  np.testing.assert_allclose(out, want_out, rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(lse, want_lse, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("h,hkv", [(4, 4), (6, 2)])
@pytest.mark.parametrize("soft_cap,window", [(None, None), (3.0, 20)])
def test_paged_decode_sinks_match_numpy(h, hkv, soft_cap, window):
  rng = np.random.default_rng([h, hkv, 11])
  lengths = [0, 1, 8, 13, 40]
  q, k, v, table, lens = random_paged_inputs(rng, len(lengths), h, hkv, 16, 8, 5, 32,
                                             lengths)
  sinks = (2 * rng.standard_normal(h)).astype(np.float32)
  out, lse = reference.paged_decode_attention(
      jnp.asarray(q), jnp.asarray(k), jnp.asarray(v), jnp.asarray(table), jnp.asarray(lens),
      scale=0.3, logits_soft_cap=soft_cap, sliding_window=window, sinks=jnp.asarray(sinks),
      return_lse=True)
  want_out, want_lse = numpy_paged_decode(q, k, v, table, lens, 0.3, soft_cap, window,
                                          sinks=sinks)
  plain = numpy_paged_decode(q, k, v, table, lens, 0.3, soft_cap, window)[0]
  assert np.abs(want_out - plain)[1:].max() > 1e-2  # the sinks matter here
  chex.assert_tree_all_finite(out)
  np.testing.assert_allclose(out, want_out, rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(lse, want_lse, rtol=1e-5, atol=1e-5)
  np.testing.assert_array_equal(np.asarray(out[0]), 0.0)  # empty: the sink alone


def test_paged_decode_default_scale_and_dtype():
  rng = np.random.default_rng(1)
  q, k, v, table, lens = random_paged_inputs(rng, 3, 4, 2, 32, 16, 3, 10, [5, 16, 33])
  out = reference.paged_decode_attention(jnp.asarray(q, jnp.bfloat16), jnp.asarray(k, jnp.bfloat16),
                                         jnp.asarray(v, jnp.bfloat16), jnp.asarray(table),
                                         jnp.asarray(lens))
  chex.assert_type(out, jnp.bfloat16)
  q, k, v = (np.asarray(jnp.asarray(x, jnp.bfloat16), np.float32) for x in (q, k, v))
  want, _ = numpy_paged_decode(q, k, v, table, lens, 32 ** -0.5, None, None)
  np.testing.assert_allclose(np.asarray(out, np.float32), want, rtol=1e-2, atol=1e-2)


@pytest.mark.parametrize("bad,match", [
    (dict(q=np.zeros((2, 4), np.float32)), "q must have shape"),
    (dict(q=np.zeros((2, 3, 16), np.float32)), "multiple of k_pages num_kv_heads"),
    (dict(page_table=np.zeros((3, 2), np.int32)), "page_table must have shape"),
    (dict(lengths=np.zeros((2,), np.float32)), "lengths dtype must be int32"),
    (dict(q=np.zeros((2, 4, 16), np.int32)), "q dtype"),
    (dict(sliding_window=0), "sliding_window"),
])
def test_paged_decode_rejects_bad_arguments(bad, match):
  args = dict(q=np.ones((2, 4, 16), np.float32), k_pages=np.ones((2, 4, 8, 16), np.float32),
              v_pages=np.ones((2, 4, 8, 16), np.float32), page_table=np.zeros((2, 2), np.int32),
              lengths=np.ones((2,), np.int32))
  kwargs = {}
  for key, value in bad.items():
    (args if key in args else kwargs)[key] = value
  with pytest.raises(ValueError, match=match):
    reference.paged_decode_attention(*args.values(), **kwargs)


def numpy_merge(o_a, lse_a, o_b, lse_b):
  lse_a = np.where(lse_a == np.inf, -np.inf, lse_a).astype(np.float64)
  lse_b = np.where(lse_b == np.inf, -np.inf, lse_b).astype(np.float64)
  out = np.zeros(o_a.shape)
  lse = np.full(lse_a.shape, -np.inf)
  for idx in np.ndindex(lse_a.shape):
    a, b = lse_a[idx], lse_b[idx]
    if a == -np.inf and b == -np.inf:
      continue
    m = max(a, b)
    wa, wb = np.exp(a - m), np.exp(b - m)
    lse[idx] = m + np.log(wa + wb)
    out[idx] = (o_a[idx] * wa + o_b[idx] * wb) / (wa + wb)
  return out, lse


def test_merge_matches_numpy_with_empty_states():
  rng = np.random.default_rng(2)
  shape = (7, 5)
  o_a = rng.standard_normal(shape + (32,)).astype(np.float32)
  o_b = rng.standard_normal(shape + (32,)).astype(np.float32)
  lse_a = (rng.standard_normal(shape) * 30).astype(np.float32)
  lse_b = (rng.standard_normal(shape) * 30).astype(np.float32)
  lse_a[0, :2] = -np.inf   # a empty
  lse_b[1, :2] = np.inf    # b empty, written as +inf
  lse_a[2, :] = np.inf     # both empty
  lse_b[2, :] = -np.inf
  o_a[2, 0] = np.nan       # an empty state's output must not leak
  out, lse = reference.merge_attention_states(jnp.asarray(o_a), jnp.asarray(lse_a),
                                              jnp.asarray(o_b), jnp.asarray(lse_b))
  want_out, want_lse = numpy_merge(np.nan_to_num(o_a), lse_a, o_b, lse_b)
  chex.assert_tree_all_finite(out)
  np.testing.assert_allclose(out, want_out, rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(lse, want_lse, rtol=1e-6)
  assert np.all(np.asarray(out[2]) == 0) and np.all(np.asarray(lse[2]) == -np.inf)


def test_merge_n_equals_repeated_pairwise_merge():
  rng = np.random.default_rng(3)
  o = jnp.asarray(rng.standard_normal((4, 6, 3, 16)), jnp.float32)
  lse = jnp.asarray(rng.standard_normal((4, 6, 3)) * 5, jnp.float32)
  out, out_lse = reference.merge_attention_states_n(o, lse)
  acc_o, acc_lse = o[0], lse[0]
  for i in range(1, 4):
    acc_o, acc_lse = reference.merge_attention_states(acc_o, acc_lse, o[i], lse[i])
  np.testing.assert_allclose(out, acc_o, rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(out_lse, acc_lse, rtol=1e-5, atol=1e-6)


def test_split_then_merge_equals_whole():
  """Attention over two halves of the keys, merged, equals attention over all keys."""
  rng = np.random.default_rng(4)
  q, k, v, table, lens = random_paged_inputs(rng, 2, 4, 4, 16, 8, 4, 8, [32, 32])
  args = [jnp.asarray(x) for x in (q, k, v)]
  whole, whole_lse = reference.paged_decode_attention(*args, jnp.asarray(table), jnp.asarray(lens),
                                                      return_lse=True)
  first = reference.paged_decode_attention(*args, jnp.asarray(table[:, :2]),
                                           jnp.full((2,), 16, jnp.int32), return_lse=True)
  second = reference.paged_decode_attention(*args, jnp.asarray(table[:, 2:]),
                                            jnp.full((2,), 16, jnp.int32), return_lse=True)
  out, lse = reference.merge_attention_states(*first, *second)
  np.testing.assert_allclose(out, whole, rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(lse, whole_lse, rtol=1e-6)


def test_merge_rejects_bad_arguments():
  o = jnp.ones((3, 8))
  with pytest.raises(ValueError, match="lse_a must have shape"):
    reference.merge_attention_states(o, jnp.ones((4,)), o, jnp.ones((3,)))
  with pytest.raises(ValueError, match="lse_b dtype"):
    reference.merge_attention_states(o, jnp.ones((3,)), o, jnp.ones((3,), jnp.bfloat16))
