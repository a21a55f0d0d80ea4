"""`jax_paged.sampling`: greedy, temperature, top-k and top-p, per row."""

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


def test_temperature_top_k_and_top_p_distributions():
  probs = np.array([0.5, 0.25, 0.15, 0.1])
  logits = jnp.log(jnp.asarray(np.tile(probs, (3, 1)), jnp.float32))
  n = 4000
  draws = _draws(logits, n, temperature=1.0, top_k=jnp.array([0, 2, 0]),
                 top_p=jnp.array([1.0, 1.0, 0.7]))
  freq = [np.bincount(draws[:, r], minlength=4) / n for r in range(3)]
  np.testing.assert_allclose(freq[0], probs, atol=0.03)  # 6 sigma at n=4000
  np.testing.assert_allclose(freq[1], [2 / 3, 1 / 3, 0, 0], atol=0.03)
  # top_p 0.7: 0.5 is short of it, 0.5 + 0.25 reaches it; the tail is cut.
  np.testing.assert_allclose(freq[2], [2 / 3, 1 / 3, 0, 0], atol=0.03)
  # High temperature flattens the distribution.
  hot = np.bincount(_draws(logits[:1], n, temperature=100.0)[:, 0], minlength=4) / n
  np.testing.assert_allclose(hot, 0.25, atol=0.03)


def test_rows_are_independent_of_the_batch():
  logits = jax.random.normal(jax.random.key(3), (4, 100))
  key = jax.random.key(4)
  full = sampling.sample(logits, key, temperature=1.0)
  np.testing.assert_array_equal(sampling.sample(logits[:2], key, temperature=1.0), full[:2])
  assert not np.array_equal(full, sampling.sample(logits, jax.random.key(5), temperature=1.0))


def _hf_kept(logits: np.ndarray, top_k: int, top_p: float) -> np.ndarray:
  """bool [V]: the tokens Hugging Face's warpers keep of one row (top-k, then top-p)."""
  torch = pytest.importorskip("torch")
  logits_process = pytest.importorskip("transformers.generation.logits_process")
  scores = torch.tensor(logits[None])
  if top_k:
    scores = logits_process.TopKLogitsWarper(top_k)(None, scores)
  if top_p < 1:
    scores = logits_process.TopPLogitsWarper(top_p)(None, scores)
  return np.isfinite(scores.numpy()[0])


def test_filters_keep_what_hugging_face_keeps():
  v = 500
  settings = [(k, p) for k in (0, 1, 7, 50, v + 3) for p in (1.0, 0.95, 0.6, 0.1, 1e-6)]
  logits = np.array(jax.random.normal(jax.random.key(6), (len(settings), v)) * 2.5,
                    np.float32)
  logits[::4, :40] = -np.inf  # masked tokens (a padded vocabulary) are never kept
  top_k = jnp.array([k for k, _ in settings], jnp.int32)
  top_p = jnp.array([p for _, p in settings], jnp.float32)
  kept = np.asarray(jax.jit(sampling.filter_mask)(jnp.asarray(logits), top_k, top_p))
  for row, (k, p) in enumerate(settings):
    np.testing.assert_array_equal(kept[row], _hf_kept(logits[row], k, p),
                                  err_msg=f"top_k={k} top_p={p}")


def test_filters_keep_ties_with_the_last_kept_token():
  logits = jnp.array([[3.0, 2.0, 1.0, 2.0, 0.5]] * 2)
  kept = sampling.filter_mask(logits, jnp.array([2, 0]), jnp.array([1.0, 0.6]))
  # top-k 2: the 3 and both 2s. top-p 0.6: the 3 (0.51 of the mass) is short of it, so a 2
  # is kept (then 0.70 is past it), and its twin with it.
  np.testing.assert_array_equal(kept, [[True, True, False, True, False]] * 2)


def test_rows_draw_alike_with_or_without_the_filters():
  logits = jax.random.normal(jax.random.key(7), (8, 300))
  key = jax.random.key(8)
  plain = sampling.sample(logits, key, temperature=0.7, filtered=False)
  # Rows that do not filter draw the same tokens in a batch that does.
  filtered = sampling.sample(logits, key, temperature=0.7, top_k=jnp.array([0, 5] * 4),
                             top_p=jnp.array([1.0] * 4 + [0.5] * 4))
  np.testing.assert_array_equal(np.asarray(filtered)[:4:2], np.asarray(plain)[:4:2])
  np.testing.assert_array_equal(
      sampling.sample(logits, key, temperature=0.7, top_k=0, top_p=1.0), plain)


def test_sort_keys_order_floats_and_map_back():
  x = jnp.array([-jnp.inf, -3e38, -2.5, -1e-45, -0.0, 0.0, 1e-45, 1.0, 2.5, 3e38, jnp.inf],
                jnp.float32)
  bits = jax.lax.bitcast_convert_type(x, jnp.int32)
  keys = sampling._flip_negatives(bits)
  assert keys.dtype == jnp.int32 and (np.diff(np.asarray(keys)) > 0).all()
  np.testing.assert_array_equal(sampling._flip_negatives(keys), bits)  # bit for bit, -0.0 too
