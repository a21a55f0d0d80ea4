"""Next-token sampling on device: greedy, temperature, top-k and top-p (nucleus).

Everything is jittable and per row, so one batch can mix requests with different
settings: temperature 0 is greedy, top_k 0 and top_p 1 switch those filters off. The order
is Hugging Face's: temperature first, then top-k, then top-p on the tempered distribution.

A token is drawn from the tempered logits in vocabulary order (Gumbel-max, `categorical`),
with the tokens a filter drops masked out, so a row draws the same token for the same key
whether or not the batch around it filters. The filters sort the rows' values, which on a
GPU costs a good part of the model's decode step (H200, GPT-2's vocabulary at batch 128:
0.42 ms for the sort, the step 0.8; benchmarks/LOG.md, "sampling"), so a batch none of
whose rows filters skips them (`filtered=False`, decided on the host).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def greedy(logits: jax.Array) -> jax.Array:
  """int32 [B]: the argmax of float logits [B, V] (for all-greedy batches)."""
  return jnp.argmax(logits, axis=-1).astype(jnp.int32)


def _flip_negatives(bits: jax.Array) -> jax.Array:
  """int32 float bits <-> int32 keys in the floats' order (signed compare): flips the
  magnitude bits of negative floats, whose order runs backwards, and keeps the sign, so
  the map is its own inverse."""
  return bits ^ ((bits >> 31) & 0x7FFFFFFF)


def filter_mask(tempered: jax.Array, top_k: jax.Array, top_p: jax.Array) -> jax.Array:
  """bool [B, V]: the tokens that top-k, then top-p, keep of tempered logits [B, V]
  (never a -inf one).

  Args:
    tempered: float32 [B, V], the logits divided by the temperature.
    top_k: int32 [B]: keep the k most likely tokens, and any tied with the k-th (as Hugging
      Face's top-k keeps them); 0 = off.
    top_p: float32 [B]: then keep the most likely tokens while the probability of those
      more likely (of what top-k kept) is short of p, and any tied with the last kept;
      1 = off.

  Each filter is a cut-off value: only the values are sorted (not the indices, which would
  double the sort's cost) and a token is kept if it is at or above the cut-off. They are
  sorted as int32 keys in the floats' order (`_flip_negatives`), which XLA sorts faster than
  float32 (H200, 128 x 50257: 0.42 vs 0.64 ms; 256 rows: 0.61 vs 1.38).
  """
  v = tempered.shape[-1]
  keys = _flip_negatives(jax.lax.bitcast_convert_type(tempered, jnp.int32))
  ranked = jax.lax.bitcast_convert_type(  # each row descending
      _flip_negatives(jnp.sort(keys, axis=-1)[:, ::-1]), jnp.float32)
  k_cut = jnp.take_along_axis(ranked, jnp.clip(top_k - 1, 0, v - 1)[:, None], axis=-1)
  k_cut = jnp.where(top_k[:, None] > 0, k_cut, -jnp.inf)
  probs = jax.nn.softmax(jnp.where(ranked >= k_cut, ranked, -jnp.inf), axis=-1)
  # The most likely token always stays: nothing is before it.
  kept = jnp.sum(jnp.cumsum(probs, axis=-1) - probs < top_p[:, None], axis=-1)
  p_cut = jnp.take_along_axis(ranked, jnp.maximum(kept - 1, 0)[:, None], axis=-1)
  p_cut = jnp.where(top_p[:, None] < 1.0, p_cut, -jnp.inf)
  # (-inf logits, e.g. a padded vocabulary's, are never kept: they cannot be drawn.)
  return (tempered >= jnp.maximum(k_cut, p_cut)) & (tempered > -jnp.inf)


def _draw(logits: jax.Array, keys: jax.Array, temperature: jax.Array, top_k: jax.Array,
          top_p: jax.Array, filtered: bool) -> jax.Array:
  """int32 [B]: row b drawn with keys[b] (settings [B] as `sample` takes them)."""
  logits = logits.astype(jnp.float32)
  tempered = logits / jnp.where(temperature > 0, temperature, 1.0)[:, None]
  if filtered:
    tempered = jnp.where(filter_mask(tempered, top_k, top_p), tempered, -jnp.inf)
  sampled = jax.vmap(jax.random.categorical)(keys, tempered).astype(jnp.int32)
  return jnp.where(temperature > 0, sampled, greedy(logits))


def sample(logits: jax.Array, key: jax.Array, *, temperature=0.0, top_k=0,
           top_p=1.0, filtered: bool = True) -> jax.Array:
  """Draws one token per row.

  Args:
    logits: float [B, V].
    key: a PRNG key; row i draws with `fold_in(key, i)`, so a row's draw does not depend
      on the batch around it.
    temperature: float scalar or [B]; 0 means greedy (argmax) for that row.
    top_k: int scalar or [B]; keep the k most likely tokens (0 = all), as `filter_mask`.
    top_p: float scalar or [B] in (0, 1]; keep the smallest set of most likely tokens whose
      probability reaches top_p (1 = all), as `filter_mask`.
    filtered: (static) False when no row filters (every top_k 0 and top_p 1): no sort.

  Returns:
    int32 [B] token ids.
  """
  b = logits.shape[0]
  setting = lambda x, dtype: jnp.broadcast_to(jnp.asarray(x, dtype), (b,))
  keys = jax.vmap(lambda i: jax.random.fold_in(key, i))(jnp.arange(b))
  return _draw(logits, keys, setting(temperature, jnp.float32), setting(top_k, jnp.int32),
               setting(top_p, jnp.float32), filtered)


def sample_rows(logits: jax.Array, seeds: jax.Array, index: jax.Array, temperature: jax.Array,
                top_k: jax.Array, top_p: jax.Array, *, all_greedy: bool = False,
                filtered: bool = True) -> jax.Array:
  """The serving layer's sampling entry: int32 [B], row b drawn with its own key
  `fold_in(key(seeds[b]), index[b])`, so a request's draws depend only on its seed and
  how many tokens it has generated (not on the batch, its row or preemption).

  Args:
    logits: float [B, V].
    seeds: uint32 [B]; index: int32 [B] (the request's own token count).
    temperature: float32 [B]; top_k: int32 [B]; top_p: float32 [B]: as `sample` takes them.
    all_greedy: (static) every row is greedy: the argmax alone.
    filtered: (static) some row filters by top-k or top-p (as `sample`'s).
  """
  if all_greedy:
    return greedy(logits)
  keys = jax.vmap(lambda s, i: jax.random.fold_in(jax.random.key(s), i))(seeds, index)
  return _draw(logits, keys, temperature, top_k, top_p, filtered)
