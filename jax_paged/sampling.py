"""Next-token sampling on device: greedy, temperature, top-k and top-p (nucleus).

Everything is jittable and per row, so one batch can mix requests with different
settings: temperature 0 is greedy, top_k 0 and top_p 1 switch those filters off. The order
is Hugging Face's: temperature first, then top-k, then top-p on the tempered distribution.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def greedy(logits: jax.Array) -> jax.Array:
  """int32 [B]: the argmax of float logits [B, V] (no sort, for all-greedy batches)."""
  return jnp.argmax(logits, axis=-1).astype(jnp.int32)


def sample(logits: jax.Array, key: jax.Array, *, temperature=0.0, top_k=0,
           top_p=1.0) -> jax.Array:
  """Draws one token per row.

  Args:
    logits: float [B, V].
    key: a PRNG key; row i draws from `fold_in(key, i)`, so a row's draw does not depend
      on the batch around it.
    temperature: float scalar or [B]; 0 means greedy (argmax) for that row.
    top_k: int scalar or [B]; keep the k most likely tokens (0 = all).
    top_p: float scalar or [B] in (0, 1]; keep the smallest set of most likely tokens whose
      probability reaches top_p (1 = all).

  Returns:
    int32 [B] token ids.
  """
  b, v = logits.shape
  logits = logits.astype(jnp.float32)
  temperature = jnp.broadcast_to(jnp.asarray(temperature, jnp.float32), (b,))
  top_k = jnp.broadcast_to(jnp.asarray(top_k, jnp.int32), (b,))
  top_p = jnp.broadcast_to(jnp.asarray(top_p, jnp.float32), (b,))

  # Filters work on the sorted row: rank r survives top-k if r < k and top-p if the mass
  # of the ranks before it is still short of p (so the most likely token always stays).
  tempered = logits / jnp.where(temperature > 0, temperature, 1.0)[:, None]
  order = jnp.argsort(-tempered, axis=-1)
  sorted_logits = jnp.take_along_axis(tempered, order, axis=-1)
  rank = jnp.arange(v)[None, :]
  keep = (top_k[:, None] <= 0) | (rank < top_k[:, None])
  sorted_logits = jnp.where(keep, sorted_logits, -jnp.inf)
  probs = jax.nn.softmax(sorted_logits, axis=-1)
  mass_before = jnp.cumsum(probs, axis=-1) - probs
  keep &= mass_before < top_p[:, None]
  sorted_logits = jnp.where(keep, sorted_logits, -jnp.inf)

  keys = jax.vmap(lambda i: jax.random.fold_in(key, i))(jnp.arange(b))
  choice = jax.vmap(jax.random.categorical)(keys, sorted_logits)
  sampled = jnp.take_along_axis(order, choice[:, None], axis=-1)[:, 0].astype(jnp.int32)
  return jnp.where(temperature > 0, sampled, greedy(logits))



def sample_rows(logits: jax.Array, seeds: jax.Array, index: jax.Array, temperature: jax.Array,
                top_k: jax.Array, top_p: jax.Array, *, all_greedy: bool = False) -> jax.Array:
  """The serving layer's sampling entry: int32 [B], row b drawn with its own key
  `fold_in(key(seeds[b]), index[b])`, so a request's draws depend only on its seed and
  how many tokens it has generated (not on the batch, its row or preemption).

  Args:
    logits: float [B, V].
    seeds: uint32 [B]; index: int32 [B] (the request's own token count).
    temperature, top_k, top_p: [B] per-row settings, as `sample` takes them.
    all_greedy: (static) every row is greedy: the argmax, with no sort.
  """
  if all_greedy:
    return greedy(logits)
  keys = jax.vmap(lambda s, i: jax.random.fold_in(jax.random.key(s), i))(seeds, index)
  row = lambda l, k, t, tk, tp: sample(l[None], k, temperature=t, top_k=tk, top_p=tp)[0]
  return jax.vmap(row)(logits, keys, temperature, top_k, top_p)
