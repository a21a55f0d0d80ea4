"""The model protocol: what a model gives the serving layer, and how the CLI finds models.

The runner (`jax_paged.serving.runner`) owns paging: it reserves the new tokens' slots in
the pool (`pool.reserve`), calls the model's forward over the pool, samples, and releases
finished sequences. A model owns only the network: it embeds, runs its layers (attending
through `jax_paged.nn.PagedAttention`, which writes K/V at the slots it is given and reads
the pages) and returns logits. Any Flax NNX module meeting `PagedModel` can be served by
`jax_paged.Engine`, `jax_paged.generate` and the CLI; `models/gpt2.py` is one.

A model *family* (`ModelFamily`) is how the CLI builds models it does not import: a
package registers one under the entry point group `jax_paged.models` (this project's
`pyproject.toml` registers `models.gpt2:FAMILY`), naming the `config.json` `model_type`
values it loads and the random-weight presets it offers.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Mapping, Protocol, runtime_checkable

import jax
import jax.numpy as jnp

from jax_paged import pool as pool_lib


@dataclasses.dataclass(frozen=True)
class ModelSpec:
  """The numbers the serving layer needs about a model.

  Attributes:
    num_layers, num_kv_heads, head_dim: the shape of the model's KV pool
      (`KVPool.create(num_layers=..., num_kv_heads=..., head_dim=...)`).
    vocab_size: token ids are in [0, vocab_size).
    max_positions: the longest sequence (prompt + generated tokens) the model can attend
      over (GPT-2's n_positions).
    dtype: the compute dtype, the pool's default dtype.
    eos_token_id: the end-of-sequence token, or several (Llama 3's configs list three),
      if the model has one (the CLI stops on any of them; see `eos_token_ids`).
  """

  num_layers: int
  num_kv_heads: int
  head_dim: int
  vocab_size: int
  max_positions: int
  dtype: Any
  eos_token_id: int | tuple[int, ...] | None = None

  @property
  def eos_token_ids(self) -> tuple[int, ...]:
    """`eos_token_id` as a tuple (empty if None)."""
    if self.eos_token_id is None:
      return ()
    if isinstance(self.eos_token_id, int):
      return (self.eos_token_id,)
    return tuple(self.eos_token_id)

  def create_pool(self, *, num_pages: int, page_size: int, max_seqs: int,
                  max_pages_per_seq: int, dtype=None) -> pool_lib.KVPool:
    """An empty pool shaped for the model (dtype defaults to the compute dtype)."""
    return pool_lib.KVPool.create(
        num_layers=self.num_layers, num_kv_heads=self.num_kv_heads, head_dim=self.head_dim,
        num_pages=num_pages, page_size=page_size, max_seqs=max_seqs,
        max_pages_per_seq=max_pages_per_seq, dtype=self.dtype if dtype is None else dtype)


@runtime_checkable
class PagedModel(Protocol):
  """A Flax NNX causal LM whose KV cache is a `KVPool`.

  Both forwards are traced inside the runner's `jax.jit` (the module split into graph and
  parameters, the pool donated), so they must be pure functions of their arguments and
  the module's parameters. Neither reserves nor releases pages: the slots are given.

  Optional, for tensor parallel serving (`Engine(mesh=...)`, `jax_paged.tensor_parallel`):
  `tensor_parallel_splits() -> [(nnx.Linear, tensor_parallel.Split), ...]`, the model's
  linears outside its `nn.PagedAttention` layers to split over the devices (an MLP's
  first projection column-parallel, its second row-parallel, applied through
  `nn.project_add` / `project_add_norm` / `projection`, which sum a row-parallel
  projection over the devices). The attention layers are split by head without it.

  Optional, for LoRA adapters (`Engine(max_loras=...)`, `jax_paged.lora`):
  `lora_targets() -> {checkpoint module name: lora.Target}`, where each module a PEFT
  adapter may adapt lands (a linear, or columns of a fused one), and an `adapters`
  keyword (int32 [B], each row's slot, -1 for none) on `prefill`, `decode` and
  `prefill_hidden`, passed to the `jax_paged.nn` layers and projections of those linears.
  The engine passes it only when it serves adapters.

  Optional, for prompt log-probabilities (`Request.prompt_logprobs`): `prefill_hidden`,
  `prefill`'s arguments -> (the final hidden state, after the last norm, of every new
  token [B, T, D], the pool), and `logits(h)`, hidden states [..., D] -> float32 logits
  [..., vocab_size] (`prefill` is then `logits(last_tokens(prefill_hidden(...)))`).

  Optional, as a draft model (`speculative.DraftSpeculation`; with `prefill_hidden`): an
  int attribute `pool_layer_offset`, the pool layer its first block reads and writes (0
  alone; a draft's layers sit after its target's in one pool, and the runner sets it on
  a copy of the draft).
  """

  @property
  def spec(self) -> ModelSpec:
    """The pool's shape, the vocabulary and the context limit."""

  def prefill(self, tokens: jax.Array, kv: pool_lib.KVPool, slots: jax.Array,
              lengths: jax.Array, *, start: jax.Array | None = None,
              page_table: jax.Array | None = None) -> tuple[jax.Array, pool_lib.KVPool]:
    """Several new tokens per sequence: a prompt, or the rest of one whose first tokens
    are already in the pool (a cached prefix, or earlier chunks of a long prompt).

    Args:
      tokens: int32 [B, T], right-padded (the padding value does not matter).
      kv: the pool, with the new tokens' slots reserved.
      slots: int32 [B, T] from `pool.reserve`: token t of row b goes to flat slot
        slots[b, t] of every layer; -1 at padding (never written).
      lengths: int32 [B] in [1, T], the new tokens per row.
      start: (static None or not) None when the sequences held no tokens before this
        step (attention over the new tokens alone, `nn.PagedAttention.prefill`'s fast
        path); else int32 [B], the tokens each already holds: new token t sits at
        position start + t and attends to them too, through the pages.
      page_table: int32 [B, max_pages_per_seq], the batch's rows of `kv.page_table`
        (given with `start`).

    Returns:
      (float32 logits [B, vocab_size] of each row's last new token, the pool with every
      layer's K/V of the new tokens written).
    """

  def decode(self, tokens: jax.Array, positions: jax.Array, kv: pool_lib.KVPool,
             slots: jax.Array, page_table: jax.Array, lengths: jax.Array, *,
             greedy: bool = False) -> tuple[jax.Array, pool_lib.KVPool]:
    """One new token per sequence, attending to everything in its pages.

    Args:
      tokens: int32 [B], the newest token of each sequence (not yet cached).
      positions: int32 [B], its position (the sequence's length before this step).
      kv: the pool, with the new tokens' slots reserved.
      slots: int32 [B] from `pool.reserve`; -1 for an inactive row (never written).
      page_table: int32 [B, max_pages_per_seq], the batch's rows of `kv.page_table`.
      lengths: int32 [B], tokens to attend to, the new one included (0 = inactive row,
        whose output is meaningless).
      greedy: (static) return each row's argmax token instead of the logits; the fast
        path of all-greedy batches, which may skip writing the logits.

    Returns:
      (float32 logits [B, vocab_size], or with `greedy` int32 tokens [B]; the pool with
      the new tokens' K/V written).
    """


def last_tokens(h: jax.Array, lengths: jax.Array) -> jax.Array:
  """[B, D]: each row's last new token of per-token values h [B, T, D] (lengths int32 [B]
  in [1, T]; a padding row's 0 takes its first)."""
  return h[jnp.arange(h.shape[0]), jnp.maximum(lengths - 1, 0)]


def offers_prompt_logprobs(model) -> bool:
  """Whether `model` has `PagedModel`'s optional `prefill_hidden` and `logits`."""
  return callable(getattr(model, "prefill_hidden", None)) and callable(
      getattr(model, "logits", None))


@dataclasses.dataclass(frozen=True)
class ModelFamily:
  """How the CLI builds the models of one architecture without importing them.

  Attributes:
    name: the family's name (e.g. "gpt2").
    model_types: the `model_type` values of Hugging Face `config.json` files it loads.
    from_pretrained: (checkpoint directory, dtype, **options) -> a `PagedModel`; raises
      FileNotFoundError / ValueError naming the file for a missing or bad checkpoint.
      The options it takes are those its flags below name.
    presets: name -> (dtype, seed) -> a `PagedModel` with random weights, for runs without
      a checkpoint (their text is encoded as UTF-8 bytes, so their vocabulary should hold
      ids 0-255).
    max_model_len: whether from_pretrained takes `max_model_len=` (the longest sequence
      served, at most the config's context; `models.llama.from_pretrained`'s).
  """

  name: str
  model_types: tuple[str, ...]
  from_pretrained: Callable[..., PagedModel]
  presets: Mapping[str, Callable[[Any, int], PagedModel]]
  max_model_len: bool = False
