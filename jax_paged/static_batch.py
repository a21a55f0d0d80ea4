"""Static-batch text generation over the paged KV pool (`jax_paged.generate`).

`generate` runs one static batch: every prompt is prefilled together, then all rows decode
in lock step until `max_new_tokens` (rows that hit `eos_token_id` go inactive and stop
writing to the pool). Nothing is copied to the host until the end, so the device runs the
steps back to back.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jax_paged import sampling
from models import gpt2


@functools.partial(jax.jit, static_argnames="greedy")
def _next_tokens(logits: jax.Array, key: jax.Array, step: jax.Array, temperature: jax.Array,
                 top_k: jax.Array, top_p: jax.Array, *, greedy: bool) -> jax.Array:
  if greedy:
    return sampling.greedy(logits)
  return sampling.sample(logits, jax.random.fold_in(key, step), temperature=temperature,
                         top_k=top_k, top_p=top_p)


def generate(model: gpt2.GPT2LMHeadModel, prompts: list[list[int]], max_new_tokens: int, *,
             temperature: float = 0.0, top_k: int | None = None, top_p: float | None = None,
             seed: int = 0, page_size: int = 16, eos_token_id: int | None = None,
             cache_dtype=None) -> list[list[int]]:
  """Continues each prompt by up to `max_new_tokens` tokens.

  Args:
    model: a `models.gpt2.GPT2LMHeadModel` (any NNX model with its `create_pool`,
      `prefill` and `decode` methods works).
    prompts: token ids, one non-empty list per prompt; lengths may differ.
    max_new_tokens: tokens to generate per prompt (>= 1).
    temperature: 0 is greedy; otherwise the softmax temperature.
    top_k, top_p: optional filters for sampling (see `jax_paged.sampling.sample`).
    seed: the sampling seed; the same seed gives the same tokens.
    page_size: tokens per KV page. The pool is sized to hold exactly these prompts and
      their new tokens.
    eos_token_id: if given, a row stops after generating it (the eos token is included).
    cache_dtype: the pool's dtype (default: the model's compute dtype).

  Returns:
    The new tokens only, one list per prompt.
  """
  if not prompts or any(len(p) == 0 for p in prompts):
    raise ValueError("prompts must be a non-empty list of non-empty token lists")
  if max_new_tokens < 1:
    raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
  if temperature < 0:
    raise ValueError(f"temperature must be >= 0, got {temperature}")
  if top_p is not None and not 0.0 < top_p <= 1.0:
    raise ValueError(f"top_p must be in (0, 1], got {top_p}")
  lengths = np.array([len(p) for p in prompts], np.int32)
  # The last new token is returned, never fed back, so it takes no room in the cache.
  cached = lengths + max_new_tokens - 1
  n_positions = model.config.n_positions
  if cached.max() > n_positions:
    raise ValueError(f"a prompt of {lengths[cached.argmax()]} tokens + {max_new_tokens} new "
                     f"tokens exceeds the model's n_positions={n_positions}")

  b = len(prompts)
  pages = -(-cached // page_size)
  kv = model.create_pool(num_pages=int(pages.sum()), page_size=page_size, max_seqs=b,
                         max_pages_per_seq=int(pages.max()), dtype=cache_dtype)
  # Prompt widths rounded up to a page, so similar batches share one prefill compilation.
  width = page_size * math.ceil(lengths.max() / page_size)
  tokens = np.zeros((b, width), np.int32)
  for i, p in enumerate(prompts):
    tokens[i, :len(p)] = p

  graphdef, params = nnx.split(model)
  steps = gpt2.jit_steps(graphdef)
  seq_ids = jnp.arange(b, dtype=jnp.int32)
  logits, kv = steps.prefill(params, kv, jnp.asarray(tokens), jnp.asarray(lengths), seq_ids)

  pick = functools.partial(_next_tokens, key=jax.random.key(seed),
                           temperature=jnp.float32(temperature), top_k=jnp.int32(top_k or 0),
                           top_p=jnp.float32(1.0 if top_p is None else top_p),
                           greedy=temperature == 0)
  active = jnp.ones((b,), bool)
  new = []
  for step in range(max_new_tokens):
    token = pick(logits, step=jnp.int32(step))
    new.append(token)
    if eos_token_id is not None:
      active &= token != eos_token_id
    if step + 1 < max_new_tokens:
      logits, kv = steps.decode(params, kv, token, seq_ids, active)

  out = np.asarray(jnp.stack(new, axis=1)).tolist()
  if eos_token_id is not None:
    out = [row[:row.index(eos_token_id) + 1] if eos_token_id in row else row for row in out]
  return out
