"""`jax_paged.sampling`: greedy, temperature, top-k and top-p, per row."""

import jax
import jax.numpy as jnp
import numpy as np

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
