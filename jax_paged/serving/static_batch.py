"""`jax_paged.generate`: one static batch of prompts, start to finish.

Every prompt is prefilled together, then every row decodes in device-side chunks until it
has `max_new_tokens` tokens or generates `eos_token_id`. It is the engine with a pool
sized to hold exactly these prompts and their new tokens, all admitted at once, so it
gives the engine's tokens: prompt i samples as `Request(prompt, ..., seed=seed + i)`.
"""

from __future__ import annotations

from typing import Sequence

from jax_paged.paged_model import PagedModel
from jax_paged.serving.engine import Engine
from jax_paged.serving.request import Request


def generate(model: PagedModel, prompts: Sequence[Sequence[int]], max_new_tokens: int, *,
             temperature: float = 0.0, top_k: int | None = None, top_p: float | None = None,
             min_p: float = 0.0, seed: int = 0, page_size: int = 16,
             eos_token_id: int | None = None,
             cache_dtype=None, mesh=None) -> list[list[int]]:
  """Continues each prompt by up to `max_new_tokens` tokens.

  Args:
    model: any model meeting `jax_paged.PagedModel` (e.g. `models.gpt2.GPT2LMHeadModel`).
    prompts: token ids, one non-empty list per prompt; lengths may differ.
    max_new_tokens: tokens to generate per prompt (>= 1).
    temperature: 0 is greedy; otherwise the softmax temperature.
    top_k, top_p, min_p: optional filters for sampling (see `jax_paged.sampling.sample`).
    seed: prompt i samples with seed + i (reproducible; independent of the batch).
    page_size: tokens per KV page.
    eos_token_id: if given, a row stops after generating it (the eos token is included).
    cache_dtype: the pool's dtype (default: the model's compute dtype).
    mesh: None for one device, or a tensor parallel mesh (see `jax_paged.Engine`).

  Returns:
    The new tokens only, one list per prompt.
  """
  if not isinstance(prompts, Sequence) or not prompts or any(
      not isinstance(p, Sequence) or len(p) == 0 for p in prompts):
    raise ValueError("prompts must be a non-empty list of non-empty token lists")
  requests = [Request(list(p), max_new_tokens, temperature=temperature, top_k=top_k,
                      top_p=top_p, min_p=min_p, seed=seed + i) for i, p in enumerate(prompts)]
  # The last new token is returned, never fed back, so it takes no room in the cache.
  pages = sum(-(-(len(p) + max(max_new_tokens, 1) - 1) // page_size) for p in prompts)
  # "peak" admission admits every request at once: their summed peaks fit the pool.
  engine = Engine(model, max_batch=len(prompts), num_pages=pages, page_size=page_size,
                  admission="peak", eos_token_id=eos_token_id, cache_dtype=cache_dtype,
                  mesh=mesh)
  outputs, _ = engine.generate(requests)
  return outputs
