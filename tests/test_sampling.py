"""`jax_paged.sampling`: greedy, temperature, top-k, top-p and min-p, per row."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jax_paged import sampling


def _draws(logits, n, **kwargs) -> np.ndarray:
  """n draws of every row: int [n, B]."""
  keys = jax.random.split(jax.random.key(0), n)
  return np.asarray(jax.jit(jax.vmap(lambda k: sampling.sample(logits, k, **kwargs)))(keys))


def test_greedy_rows_and_top_k_1_are_argmax():
  logits = jax.random.normal(jax.random.key(1), (6, 50))
  argmax = np.asarray(jnp.argmax(logits, -1))
  np.testing.assert_array_equal(sampling.greedy(logits), argmax)
  np.testing.assert_array_equal(sampling.sample(logits, jax.random.key(2)), argmax)
  np.testing.assert_array_equal(
      sampling.sample(logits, jax.random.key(2), temperature=2.0, top_k=1), argmax)
  mixed = sampling.sample(logits, jax.random.key(2), temperature=jnp.array([0.0, 1.0] * 3))
  np.testing.assert_array_equal(np.asarray(mixed)[::2], argmax[::2])


def test_temperature_top_k_top_p_and_min_p_distributions():
  probs = np.array([0.5, 0.25, 0.15, 0.1])
  logits = jnp.log(jnp.asarray(np.tile(probs, (5, 1)), jnp.float32))
  n = 4000
  draws = _draws(logits, n, temperature=1.0, top_k=jnp.array([0, 2, 0, 0, 0]),
                 top_p=jnp.array([1.0, 1.0, 0.7, 1.0, 0.95]),
                 min_p=jnp.array([0.0, 0.0, 0.0, 0.25, 0.25]))
  freq = [np.bincount(draws[:, r], minlength=4) / n for r in range(5)]
  np.testing.assert_allclose(freq[0], probs, atol=0.03)  # 6 sigma at n=4000
  np.testing.assert_allclose(freq[1], [2 / 3, 1 / 3, 0, 0], atol=0.03)
  # top_p 0.7: 0.5 is short of it, 0.5 + 0.25 reaches it; the tail is cut.
  np.testing.assert_allclose(freq[2], [2 / 3, 1 / 3, 0, 0], atol=0.03)
  # min_p 0.25: at least 0.125 (a quarter of 0.5), so the 0.1 is cut.
  np.testing.assert_allclose(freq[3], [0.5 / 0.9, 0.25 / 0.9, 0.15 / 0.9, 0], atol=0.03)
  # top_p 0.95 keeps three (0.9 is short of it), then min_p's cut-off (0.125 of the
  # original; the ratio to the most likely is the same after top-p) keeps them.
  np.testing.assert_allclose(freq[4], [0.5 / 0.9, 0.25 / 0.9, 0.15 / 0.9, 0], atol=0.03)
  # High temperature flattens the distribution.
  hot = np.bincount(_draws(logits[:1], n, temperature=100.0)[:, 0], minlength=4) / n
  np.testing.assert_allclose(hot, 0.25, atol=0.03)


def test_rows_are_independent_of_the_batch():
  logits = jax.random.normal(jax.random.key(3), (4, 100))
  key = jax.random.key(4)
  full = sampling.sample(logits, key, temperature=1.0)
  np.testing.assert_array_equal(sampling.sample(logits[:2], key, temperature=1.0), full[:2])
  assert not np.array_equal(full, sampling.sample(logits, jax.random.key(5), temperature=1.0))


def _hf_kept(logits: np.ndarray, top_k: int, top_p: float, min_p: float) -> np.ndarray:
  """bool [V]: the tokens Hugging Face's warpers keep of one row (top-k, then top-p, then
  min-p)."""
  torch = pytest.importorskip("torch")
  logits_process = pytest.importorskip("transformers.generation.logits_process")
  scores = torch.tensor(logits[None])
  if top_k:
    scores = logits_process.TopKLogitsWarper(top_k)(None, scores)
  if top_p < 1:
    scores = logits_process.TopPLogitsWarper(top_p)(None, scores)
  if min_p:
    scores = logits_process.MinPLogitsWarper(min_p)(None, scores)
  return np.isfinite(scores.numpy()[0])


def test_filters_keep_what_hugging_face_keeps():
  v = 500
  settings = [(k, p, m) for k in (0, 1, 7, 50, v + 3) for p in (1.0, 0.95, 0.6, 0.1, 1e-6)
              for m in (0.0, 0.01, 0.2, 1.0)]
  logits = np.array(jax.random.normal(jax.random.key(6), (len(settings), v)) * 2.5,
                    np.float32)
  logits[::4, :40] = -np.inf  # masked tokens (a padded vocabulary) are never kept
  top_k, top_p, min_p = (jnp.array(x) for x in zip(*settings))
  kept = np.asarray(jax.jit(sampling.filter_mask)(jnp.asarray(logits), top_k, top_p, min_p))
  for row, (k, p, m) in enumerate(settings):
    np.testing.assert_array_equal(kept[row], _hf_kept(logits[row], k, p, m),
                                  err_msg=f"top_k={k} top_p={p} min_p={m}")
  # Top-p weighs what top-k keeps, before min-p: 0.5 + 0.25 reach p = 0.7 of the whole
  # row, where min-p first (vLLM's order) would leave 0.5 + 0.25 of 0.75 and keep one.
  probs = jnp.log(jnp.array([[0.5, 0.25, 0.15, 0.1]]))
  np.testing.assert_array_equal(
      sampling.filter_mask(probs, jnp.array([0]), jnp.array([0.7]), jnp.array([0.3])),
      [[True, True, False, False]])


def test_filters_keep_ties_with_the_last_kept_token():
  logits = jnp.array([[3.0, 2.0, 1.0, 2.0, 0.5]] * 2)
  kept = sampling.filter_mask(logits, jnp.array([2, 0]), jnp.array([1.0, 0.6]))
  # top-k 2: the 3 and both 2s. top-p 0.6: the 3 (0.51 of the mass) is short of it, so a 2
  # is kept (then 0.70 is past it), and its twin with it.
  np.testing.assert_array_equal(kept, [[True, True, False, True, False]] * 2)


def test_rows_draw_alike_with_or_without_the_filters():
  logits = jax.random.normal(jax.random.key(7), (8, 300))
  key = jax.random.key(8)
  plain = sampling.sample(logits, key, temperature=0.7, filter_by=None)
  # Rows that do not filter draw the same tokens in a batch that does, either way.
  for filter_by in ("rejection", "chunked", "sort"):
    filtered = sampling.sample(logits, key, temperature=0.7, top_k=jnp.array([0, 5] * 4),
                               top_p=jnp.array([1.0] * 4 + [0.5] * 4), filter_by=filter_by)
    np.testing.assert_array_equal(np.asarray(filtered)[:4:2], np.asarray(plain)[:4:2])
    np.testing.assert_array_equal(sampling.sample(logits, key, temperature=0.7, top_k=0,
                                                  top_p=1.0, filter_by=filter_by), plain)


def test_the_draw_is_the_argmax_of_the_logits_plus_the_keys_gumbel_noise():
  """What both filter methods rely on: `categorical` draws argmax(logits + gumbel(key))."""
  logits = jax.random.normal(jax.random.key(9), (16, 1000)) * 3
  keys = jax.random.split(jax.random.key(10), 16)
  noise = jax.vmap(lambda k: jax.random.gumbel(k, (1000,), jnp.float32))(keys)
  np.testing.assert_array_equal(jax.vmap(jax.random.categorical)(keys, logits),
                                jnp.argmax(logits + noise, axis=-1))


@pytest.mark.parametrize("scale", [0.5, 3.0, 12.0])
def test_rejection_and_chunked_draw_the_sorts_tokens(scale):
  """Top-p by rejection rounds, and top-k by the chunked cut-off, draw row for row the
  token the sort's mask gives, for rows they decide and rows they leave to the sort (small
  p, top_k above CHUNKED_TOP_K, or any top_k for "rejection"), with ties, masked tokens
  and greedy rows; and under vmap (the cond then runs both branches)."""
  b, v = 96, 2000
  rng = np.random.default_rng(int(scale * 10))
  logits = np.array(rng.standard_normal((b, v)) * scale, np.float32)
  logits[::5, :300] = -np.inf  # a padded vocabulary's tokens
  logits[1::7, :50] = logits[1::7, 50:100]  # ties
  logits = jnp.asarray(logits)
  top_p = jnp.asarray(rng.choice([1.0, 0.99, 0.95, 0.9, 0.5, 0.1, 1e-3], b), jnp.float32)
  top_k = jnp.asarray(np.where(rng.random(b) < 0.5, rng.choice([1, 2, 7, 50, 64, 65, 900], b),
                               0), jnp.int32)
  temperature = jnp.asarray(rng.choice([0.0, 0.7, 1.0, 1.5], b), jnp.float32)
  min_p = jnp.asarray(rng.choice([0.0, 0.0, 0.02, 0.3], b), jnp.float32)
  key = jax.random.key(11)
  # The arrays are arguments, not constants of the programs: XLA would fold the sorts of
  # constants at compile time (seconds each on a CPU).
  args = (logits, temperature, top_k, top_p, min_p)
  draw = lambda filter_by, key, logits, temperature, top_k, top_p, min_p: sampling.sample(
      logits, key, temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p,
      filter_by=filter_by)
  sort = jax.jit(functools.partial(draw, "sort"))
  in_axes = (0,) + (None,) * len(args)
  for method in ("rejection", "chunked"):
    fast = jax.jit(functools.partial(draw, method))
    for i in range(3):
      np.testing.assert_array_equal(fast(jax.random.fold_in(key, i), *args),
                                    sort(jax.random.fold_in(key, i), *args), err_msg=method)
    keys = jax.random.split(key, 4)
    np.testing.assert_array_equal(jax.jit(jax.vmap(fast, in_axes))(keys, *args),
                                  jax.jit(jax.vmap(sort, in_axes))(keys, *args))
  # With nothing left to the sort (p >= 0.9, top_k up to 64) too.
  easy = dict(temperature=1.0, top_p=jnp.maximum(top_p, 0.9),
              top_k=jnp.where(top_k <= 64, top_k, 0), min_p=min_p)
  np.testing.assert_array_equal(sampling.sample(logits, key, filter_by="chunked", **easy),
                                sampling.sample(logits, key, filter_by="sort", **easy))
  # Min-p alone by its one masked argmax.
  alone = dict(temperature=temperature, min_p=min_p)
  np.testing.assert_array_equal(sampling.sample(logits, key, filter_by="min_p", **alone),
                                sampling.sample(logits, key, filter_by="sort", **alone))


@pytest.mark.parametrize("v", [5, 89, 2048, 50257])
def test_top_k_cutoff_is_the_kth_largest(v):
  """The chunked cut-off is the top_k-th largest value for top_k up to CHUNKED_TOP_K (any
  top_k where the vocabulary has no more chunks than that), ties and -inf included."""
  rng = np.random.default_rng(v)
  x = np.array(rng.standard_normal((24, v)), np.float32)
  x[:8] = np.round(x[:8])  # many ties
  x[8:12, : v // 2] = -np.inf
  x[12:16] = np.sort(x[12:16])  # the largest values in the last chunks
  top_k = rng.integers(0, sampling.CHUNKED_TOP_K + 1, 24)
  if v <= 89:
    top_k = rng.integers(0, v + 3, 24)
  cut = np.asarray(sampling.top_k_cutoff(jnp.asarray(x), jnp.asarray(top_k, jnp.int32)))[:, 0]
  ranked = -np.sort(-x, axis=-1)
  want = np.where(top_k > 0, ranked[np.arange(24), np.clip(top_k - 1, 0, v - 1)], -np.inf)
  # Past the vocabulary every value is kept: the cut-off is at most the smallest.
  assert (cut <= want).all()
  np.testing.assert_array_equal(cut[top_k <= v], want[top_k <= v])


@pytest.mark.parametrize("v", [5, 89, 50257])
def test_logprobs_of_the_tokens_and_the_most_likely_are_log_softmax(v):
  """`logprobs`: the tokens' log_softmax, and the n most likely tokens, most likely first,
  and theirs, for n up to min(v, CHUNKED_TOP_K), the largest values anywhere in the row;
  -inf logits (a padded vocabulary) never come before a finite one. Ties (rounded logits) may come in
  either order, so those rows are checked by their values and that each token holds its
  value."""
  rng = np.random.default_rng(v)
  x = np.array(rng.standard_normal((16, v)) * 4, np.float32)
  x[:4] = np.round(x[:4])  # many ties
  x[4:8, v // 2:] = -np.inf
  x[8:12] = np.sort(x[8:12])  # the largest values in the last chunks
  logprobs = np.asarray(jax.nn.log_softmax(jnp.asarray(x), axis=-1))
  tokens = rng.integers(0, v, 16)
  for n in sorted({0, 1, min(v, 20), min(v, sampling.CHUNKED_TOP_K)}):
    own, ids, values = map(np.asarray, sampling.logprobs(jnp.asarray(x), tokens, n))
    np.testing.assert_allclose(own, logprobs[np.arange(16), tokens], atol=1e-5)
    assert ids.shape == values.shape == (16, n) and ids.dtype == np.int32
    want = -np.sort(-logprobs, axis=-1)[:, :n]
    np.testing.assert_allclose(values, want, atol=1e-5)
    np.testing.assert_allclose(np.take_along_axis(logprobs, ids, axis=-1), values, atol=1e-5)
    assert all(len(set(row)) == n for row in ids.tolist())  # distinct tokens
    np.testing.assert_array_equal(ids[4:], np.argsort(-x[4:], axis=-1, kind="stable")[:, :n])
  with pytest.raises(ValueError, match="n must be in"):
    sampling.logprobs(jnp.asarray(x), tokens, min(v, sampling.CHUNKED_TOP_K) + 1)


def test_token_counts_split_prompt_and_generated_tokens():
  """`token_counts`: generated tokens counted, prompt tokens flagged, padding ignored
  (whatever its ids), against numpy's bincount."""
  rng = np.random.default_rng(3)
  v, width = 37, 24
  context = rng.integers(0, v, (6, width)).astype(np.int32)
  context[:, :8] = rng.integers(0, 4, (6, 8))  # repeats
  context_len = np.array([24, 20, 1, 9, 0, 13], np.int32)
  prompt_len = np.array([10, 20, 1, 3, 0, 0], np.int32)
  counts, in_prompt = map(np.asarray, jax.jit(sampling.token_counts, static_argnums=3)(
      context, context_len, prompt_len, v))
  for b in range(6):
    generated = context[b, prompt_len[b]:context_len[b]]
    np.testing.assert_array_equal(counts[b], np.bincount(generated, minlength=v))
    np.testing.assert_array_equal(
        in_prompt[b], np.bincount(context[b, :prompt_len[b]], minlength=v) > 0)


def _vllm_penalties(logits, counts, in_prompt, repetition, frequency, presence):
  """vLLM's `apply_penalties` (model_executor/layers/utils.py), in numpy."""
  logits = logits.copy()
  seen = in_prompt | (counts > 0)
  r = np.where(seen, repetition[:, None], 1.0)
  logits = np.where(logits > 0, logits / r, logits * r)
  return logits - frequency[:, None] * counts - presence[:, None] * (counts > 0)


def test_penalties_are_vllms_and_repetition_is_hugging_faces():
  """`penalize` against vLLM's formula (numpy) on random logits of both signs, counts and
  prompt flags, -inf logits staying -inf; the repetition penalty alone against Hugging
  Face's `RepetitionPenaltyLogitsProcessor` over the prompt and generated ids."""
  torch = pytest.importorskip("torch")
  logits_process = pytest.importorskip("transformers.generation.logits_process")
  rng = np.random.default_rng(4)
  b, v = 8, 300
  logits = np.array(rng.standard_normal((b, v)) * 3, np.float32)
  logits[0, :5] = -np.inf
  context = rng.integers(0, v, (b, 40)).astype(np.int32)
  context_len = rng.integers(1, 41, b).astype(np.int32)
  prompt_len = (context_len * rng.uniform(0, 1, b)).astype(np.int32)
  counts, in_prompt = sampling.token_counts(context, context_len, prompt_len, v)
  repetition = np.array([1.0, 1.3, 0.7, 2.0, 1.0, 1.0, 1.1, 1.0], np.float32)
  frequency = np.array([0.0, 0.0, 0.0, 0.5, -0.4, 0.0, 2.0, 1.0], np.float32)
  presence = np.array([0.0, 0.0, 0.0, 0.3, 0.0, -1.5, -2.0, 1.0], np.float32)
  got = np.asarray(jax.jit(sampling.penalize)(logits, counts, in_prompt, repetition,
                                              frequency, presence))
  want = _vllm_penalties(logits, np.asarray(counts), np.asarray(in_prompt), repetition,
                         frequency, presence)
  np.testing.assert_allclose(got, want, rtol=1e-6)
  assert np.isneginf(got[0, :5]).all()
  assert not np.allclose(got[1:4], logits[1:4])  # the penalties changed something
  for row in range(3):  # rows with the repetition penalty alone
    ids = torch.tensor(context[row:row + 1, :context_len[row]], dtype=torch.long)
    hf = logits_process.RepetitionPenaltyLogitsProcessor(float(repetition[row]))(
        ids, torch.tensor(logits[row:row + 1])).numpy()[0]
    np.testing.assert_allclose(got[row], hf, rtol=1e-6)


def test_bias_adds_and_ban_masks_each_rows_tokens():
  """`add_bias` adds each row's values at its tokens (padding entries: 0 at token 0);
  `ban` sets -inf at each banned row's tokens (-1: padding), other rows untouched."""
  rng = np.random.default_rng(5)
  logits = np.array(rng.standard_normal((3, 11)), np.float32)
  tokens = np.array([[2, 7, 0], [5, 0, 0], [0, 0, 0]], np.int32)
  values = np.array([[1.5, -100.0, 0.0], [3.0, 0.0, 0.0], [0.0, 0.0, 0.0]], np.float32)
  want = logits.copy()
  want[0, 2] += 1.5
  want[0, 7] -= 100.0
  want[1, 5] += 3.0
  np.testing.assert_allclose(jax.jit(sampling.add_bias)(logits, tokens, values), want,
                             rtol=1e-6)
  stops = np.array([[4, 9, -1], [1, -1, -1], [3, 4, -1]], np.int32)
  got = np.asarray(jax.jit(sampling.ban)(logits, stops, np.array([True, False, True])))
  want = logits.copy()
  want[0, [4, 9]] = want[2, [3, 4]] = -np.inf
  np.testing.assert_array_equal(got, want)


def test_filter_method_of_a_batch():
  method = lambda t, k, p, m=(0.0, 0.0): sampling.filter_method(*map(np.array, (t, k, p, m)))
  assert method([0.0, 0.7], [0, 0], [1.0, 1.0]) is None
  assert method([0.0, 0.7], [50, 0], [0.5, 1.0]) is None  # the greedy row's filters: unused
  assert method([0.0, 0.7], [0, 0], [1.0, 0.9]) == "rejection"
  assert method([0.7, 0.7], [0, 0], [1.0, 1.0], [0.0, 0.1]) == "min_p"
  assert method([0.7, 0.7], [0, 0], [0.9, 1.0], [0.0, 0.1]) == "rejection"
  assert method([0.7, 0.7], [5, 0], [1.0, 1.0], [0.0, 0.1]) == "chunked"
  assert method([0.7, 0.0], [0, 0], [1.0, 1.0], [0.0, 0.1]) is None  # a greedy row's
  assert method([0.7, 0.7], [0, 50], [0.9, 1.0]) == "chunked"
  assert method([0.7, 0.7], [0, sampling.CHUNKED_TOP_K + 1], [0.9, 1.0]) == "sort"
  assert method([0.7, 0.0], [0, sampling.CHUNKED_TOP_K + 1], [0.9, 1.0]) == "rejection"
  with pytest.raises(ValueError, match="filter_by must be one of"):
    sampling.sample(jnp.zeros((2, 5)), jax.random.key(0), temperature=1.0, filter_by="sorted")


def test_sort_keys_order_floats_and_map_back():
  x = jnp.array([-jnp.inf, -3e38, -2.5, -1e-45, -0.0, 0.0, 1e-45, 1.0, 2.5, 3e38, jnp.inf],
                jnp.float32)
  bits = jax.lax.bitcast_convert_type(x, jnp.int32)
  keys = sampling._flip_negatives(bits)
  assert keys.dtype == jnp.int32 and (np.diff(np.asarray(keys)) > 0).all()
  np.testing.assert_array_equal(sampling._flip_negatives(keys), bits)  # bit for bit, -0.0 too
