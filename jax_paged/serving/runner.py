"""The model runner: executes the scheduler's plans on device (vLLM v1's model runner).

It owns the paging policy inside a step and the one jit wrapper of the serving layer:

* `prefill_step` / `decode_step`: the pure step functions over (model, pool, tokens). Each
  reserves its new tokens' slots once for all layers (`pool.reserve`) and runs the
  model's forward over the pool (`PagedModel.prefill` / `.decode`), which writes every
  layer's K/V at those slots. A prefill continues sequences that already hold tokens (a
  cached prefix, earlier chunks) when given their `start`.
* `update_pages`: a plan's page bookkeeping (prefix-cache holds, releases, evictions) as
  one call.
* the decode loop: up to `max_steps` decode steps in one device call, sampling on device
  and stopping rows on stop tokens and budgets, so Python dispatch is paid once per chunk.
* `ModelRunner`: those functions jitted once per model structure (pool donated, so XLA
  updates its buffers in place), the parameters held as a flat list of leaves, and
  `execute(pool, plan)` for a scheduler's `Plan`: bookkeeping, prefill (attaching
  sequences to cached pages first, forking parallel samples after), decode.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any, Callable, NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh

from jax_paged import lora as lora_lib
from jax_paged import pool as pool_lib
from jax_paged import sampling
from jax_paged import tensor_parallel
from jax_paged.serving import speculative
from jax_paged.paged_model import ModelSpec, PagedModel, last_tokens, offers_prompt_logprobs


# jax.jit for the programs that carry the pool (donated). XLA's rematerialization pass
# estimates a program's memory with the donated pool counted about three times (the two
# programs of a GPT-2 CLI run with its default pool, sized from free memory: 282 GiB for a
# 94 GiB pool on an H200, against a budget of 104), so with a pool of over ~1/3 of the GPU
# every such program logged "Can't reduce memory use below ... by rematerialization" and
# found nothing to recompute; the buffers are aliased and the programs run. Nothing in a
# step is worth recomputing to save memory, so the pass gets a budget no GPU reaches
# (100x the default slop factor, 95% of what the inputs and outputs leave).
_pool_jit = functools.partial(
    jax.jit, compiler_options={"xla_gpu_memory_limit_slop_factor": 100 * 95})


def bucket(n: int, lo: int) -> int:
  """n rounded up to a power of two times lo, so shapes (and compilations) stay few."""
  return lo << (max(-(-n // lo), 1) - 1).bit_length()


def fill_rows(out: np.ndarray, rows, values: Sequence[np.ndarray]) -> np.ndarray:
  """out[rows[i], :len(values[i])] = values[i] for every i, as one numpy assignment (a
  Python loop over a batch's 256 rows costs ~0.5 ms of host time); returns the values
  concatenated."""
  # int32 indices: a batch of 256 rows of 64 tokens keeps them under glibc's 128 KiB mmap
  # threshold (a larger temporary is mapped and its fresh pages faulted in every call).
  counts = np.array([len(v) for v in values], np.int32)
  flat = np.concatenate(values) if len(values) else np.zeros(0, out.dtype)
  starts = np.cumsum(counts) - counts
  out[np.repeat(np.asarray(rows, np.int32), counts),
      np.arange(len(flat), dtype=np.int32) - np.repeat(starts, counts)] = flat
  return flat


def prefill_step(model: PagedModel, kv: pool_lib.KVPool, tokens: jax.Array,
                 lengths: jax.Array, seq_ids: jax.Array, start: jax.Array | None = None,
                 *, hidden: bool = False, adapters: jax.Array | None = None
                 ) -> tuple[jax.Array, pool_lib.KVPool]:
  """Reserves and fills the pages of new tokens of several sequences.

  Args:
    model: the model.
    kv: the pool.
    tokens: int32 [B, T], new tokens right-padded to T (the padding value does not matter).
    lengths: int32 [B] in [1, T].
    seq_ids: int32 [B], distinct pool sequence ids; -1 for a padding row (reserves nothing).
    start: None when the sequences are empty; else int32 [B], the tokens each holds (its
      pool length), which the new ones attend to.
    hidden: (static) the model's `prefill_hidden` rather than its `prefill`.
    adapters: None (no LoRA), or int32 [max_seqs]: each pool sequence's LoRA slot (-1:
      none; `jax_paged.lora`), which its rows take.

  Returns:
    (float32 logits [B, vocab] of each row's last new token, or with `hidden` the final
    hidden states [B, T, D] of every new token; the new pool). A sequence that did not fit
    in the pool is left as it was.
  """
  kv, slots, _ = pool_lib.reserve(kv, seq_ids, lengths, max_new_tokens=tokens.shape[1])
  forward = model.prefill_hidden if hidden else model.prefill
  # (Only with adapters: a model without LoRA targets need not take the keyword.)
  lora = {} if adapters is None else dict(adapters=_lora_rows(adapters, seq_ids))
  if start is None:
    return forward(tokens, kv, slots, lengths, **lora)
  page_table = kv.page_table[jnp.clip(seq_ids, 0, kv.max_seqs - 1)]
  return forward(tokens, kv, slots, lengths, start=start, page_table=page_table, **lora)


def _lora_rows(adapters: jax.Array, seq_ids) -> jax.Array:
  """int32 [B]: the LoRA slots of the rows' sequences (-1 for a padding row's -1)."""
  if isinstance(seq_ids, np.ndarray) and np.array_equal(seq_ids, np.arange(len(seq_ids))):
    return _rows(adapters, seq_ids)
  return jnp.where(seq_ids >= 0, adapters[jnp.clip(seq_ids, 0, adapters.shape[0] - 1)], -1)


def update_pages(kv: pool_lib.KVPool, holds: jax.Array, release: jax.Array
                 ) -> pool_lib.KVPool:
  """A plan's page bookkeeping, in its order: holds placed on newly cached pages
  (`pool.retain_pages` of holds[0]), finished or preempted sequences released, and
  evicted cached pages' holds dropped (`pool.release_pages` of holds[1]). Both arguments
  are padded with -1 (ignored): holds int32 [2, n], release int32 [max_seqs]."""
  kv = pool_lib.retain_pages(kv, holds[0])
  kv = pool_lib.release(kv, release)
  return pool_lib.release_pages(kv, holds[1])


def _rows(x: jax.Array, seq_ids) -> jax.Array:
  """x[seq_ids] of a per-sequence pool array; when seq_ids are numpy ids 0 .. n - 1 (the
  decode loop's rows), x's first n rows, a slice: no gather kernel per step."""
  if isinstance(seq_ids, np.ndarray) and np.array_equal(seq_ids, np.arange(len(seq_ids))):
    return x if len(seq_ids) == x.shape[0] else x[:len(seq_ids)]
  return x[seq_ids]


def decode_step(model: PagedModel, kv: pool_lib.KVPool, tokens: jax.Array, seq_ids,
                active: jax.Array | None = None, *, greedy: bool = False,
                adapters: jax.Array | None = None) -> tuple[jax.Array, pool_lib.KVPool]:
  """Appends one token to each active sequence and returns its logits.

  Args:
    model: the model.
    kv: the pool. The token's position is the sequence's current length.
    tokens: int32 [B], the newest token of each sequence.
    seq_ids: int32 [B] distinct pool sequence ids (B is the batch capacity); numpy ids
      0 .. B-1 known when tracing skip gathering the pool's rows (`_rows`).
    active: bool [B], rows to run (default all); inactive rows write nothing and their
      logits are meaningless, so a fixed-capacity batch can carry empty rows.
    greedy: (static) return each row's argmax token instead of the logits (the model may
      compute it without writing them).
    adapters: None, or int32 [max_seqs] each pool sequence's LoRA slot (`prefill_step`).

  Returns:
    (float32 logits [B, vocab], or with `greedy` int32 tokens [B]; the new pool). A row
    that found no free page is treated as inactive and its length does not advance.
  """
  active = jnp.ones(np.shape(seq_ids), bool) if active is None else active
  kv, slots, ok = pool_lib.reserve(kv, seq_ids, active, max_new_tokens=1)
  lengths = _rows(kv.lengths, seq_ids)
  # A row that got its slot is one token longer: the new token sits at the old length.
  # (From the new lengths only, so no reader of the old ones keeps them alive past the
  # in-place reserve kernel.) Other rows' positions are unused.
  positions = jnp.maximum(lengths - 1, 0)
  lora = {} if adapters is None else dict(adapters=_lora_rows(adapters, seq_ids))
  return model.decode(tokens, positions, kv, slots[:, 0], _rows(kv.page_table, seq_ids),
                      jnp.where(active & ok, lengths, 0), greedy=greedy, **lora)


class Logprobs(NamedTuple):
  """Log-probabilities of sampled tokens (`Request.logprobs`), on device or on the host.

  Attributes (for tokens shaped [...]):
    token: float32 [...], each token's (`sampling.logprobs`).
    top_tokens: int32 [..., n], the n most likely tokens at its step, most likely first
      (n: 0, or `sampling.MAX_TOP_LOGPROBS` where a request asks for `top_logprobs`).
    top: float32 [..., n], theirs.
  """

  token: Any
  top_tokens: Any
  top: Any

  @classmethod
  def of(cls, logits: jax.Array, tokens: jax.Array, top_logprobs: int) -> "Logprobs":
    """Of tokens int32 [B] drawn from logits [B, V] (in a jitted step)."""
    return cls(*sampling.logprobs(logits, tokens, top_logprobs))


# Prompt positions one LM head pass of `prompt_logprobs` takes: it holds their float32
# logits at once (GPT-2's vocabulary: 51 MB; Llama 3's: 131 MB), whatever the prompts.
PROMPT_LOGPROBS_BLOCK = 256


def prompt_logprobs(logits: Callable[[jax.Array], jax.Array], hidden: jax.Array,
                    targets: jax.Array, top_logprobs: int) -> Logprobs:
  """`Logprobs` [P, T] of prompt tokens: targets int32 [P, T] (-1 where a position
  predicts no prompt token: its entries are meaningless) under logits(hidden), hidden
  [P, T, D] the final hidden states of the positions before them (`prefill_hidden`),
  `top_logprobs` (static) of the most likely tokens at each. The LM head runs over
  `PROMPT_LOGPROBS_BLOCK` positions at a time (`lax.map`)."""
  p, t, d = hidden.shape
  n = p * t
  block = min(n, PROMPT_LOGPROBS_BLOCK)
  blocks = -(-n // block)
  pad = blocks * block - n
  hidden = jnp.pad(hidden.reshape(n, d), ((0, pad), (0, 0))).reshape(blocks, block, d)
  targets = jnp.pad(jnp.maximum(targets, 0).reshape(n), (0, pad)).reshape(blocks, block)
  out = jax.lax.map(lambda hb: Logprobs.of(logits(hb[0]), hb[1], top_logprobs),
                    (hidden, targets))
  return jax.tree.map(lambda x: x.reshape(blocks * block, *x.shape[2:])[:n].reshape(
      p, t, *x.shape[2:]), out)


# XLA runs a while loop from the host: each iteration copies the predicate to the host,
# which then launches the next body while the GPU waits. So the decode loop checks only
# between groups of this many steps, run as a fixed-trip inner loop that XLA launches
# without a round trip (H200: 465 -> 432 µs per step at batch 1, ~1-2% at batch 128;
# benchmarks/LOG.md, "Engine / decode loop"). The price: when every row stops inside a
# group, the rest of the group runs idle (no row active, nothing written). Each check still
# idles the GPU (~0.2 ms at GPT-2 124M's batch 128 on an H200), so a call that cannot end
# early runs unchecked (`needs_checks`).
STEPS_PER_CHECK = 16


# The fewest slots a decode call runs over (`decode_width`).
MIN_DECODE_WIDTH = 16

# The fewest stop ids a decode call compares each new token with (`_decode_plan`): each
# row's eos ids and stop_token_ids, padded with -1 to this times a power of two, so that
# requests with a few stop tokens of their own (up to 8 with the eos) run in the calls
# warmed and compiled for none instead of compiling new ones per count.
MIN_STOP_IDS = 8

# The fewest page holds a bookkeeping call carries (`ModelRunner.update_pages`): its
# holds are padded to this times a power of two.
MIN_HOLDS = 256


def decode_width(rows: Sequence) -> int:
  """Slots a decode call runs over: the first ones up to the last decoding sequence
  (rows[i] not None), bucketed (powers of two times MIN_DECODE_WIDTH, at most every slot).

  Every step costs each row it runs, occupied or not: the LM head and the sampling over
  the vocabulary above all (H200, GPT-2 124M, 85 sequences: 0.98 ms per step over 256
  slots vs 0.81 over 128; benchmarks/LOG.md). The scheduler fills the lowest free slots
  first, so a batch the pool's pages keep below the engine's capacity runs over a prefix.
  """
  last = max((i for i, s in enumerate(rows) if s is not None), default=0)
  return min(bucket(last + 1, MIN_DECODE_WIDTH), len(rows))


def steps_per_check(max_steps: int) -> int:
  """Steps between the decode loop's checks for a call of at most `max_steps` steps."""
  return min(STEPS_PER_CHECK, max_steps)


def needs_checks(num_steps: int, max_steps: int, active: np.ndarray, budget: np.ndarray,
                 stop_ids: np.ndarray, guided: bool = False) -> bool:
  """Whether a decode call of `num_steps` steps (of at most `max_steps`) can end early, and
  so needs the loop that checks between groups of steps.

  It cannot when it runs every step a call can (num_steps == max_steps), no active row has
  a stop token or a guide (`guided`: some row has), and some active row's budget lasts all
  of them: the checked loop would then run every group. Arguments as `decode_loop`'s ([B]
  rows, stop_ids [B, S]).
  """
  active = np.asarray(active, bool)
  return guided or not (num_steps == max_steps and active.any()
              and (np.asarray(stop_ids)[active] < 0).all()
              and np.asarray(budget)[active].max() >= max_steps)


def decode_loop(model: PagedModel, kv: pool_lib.KVPool, num_steps, tokens, active, index,
                budget, stop_ids, seeds, temperature, top_k, top_p, min_p, *, max_steps: int,
                greedy: bool, checked: bool, filter_by: str | None = "chunked",
                logprobs: bool = False, top_logprobs: int = 0,
                processors: dict[str, jax.Array] | None = None,
                guides: Guides | None = None, guide_offset=None, guide_state=None,
                adapters=None):
  """Up to `num_steps` (<= max_steps) decode steps on device.

  With `checked`, the loop checks every `steps_per_check(max_steps)` steps whether steps
  are left and a row is still active; steps past `num_steps`, and those after every row
  has stopped in a group under way, run with every row inactive: they write nothing.
  Unchecked, it runs all `max_steps` steps with no host round trip (for calls that cannot
  end early, `needs_checks`).

  Args (per slot, [B]): tokens, the newest token (not yet cached); active; index, tokens
  generated so far (the sampling key index); budget, tokens still allowed; stop_ids [B, S]
  (-1 padded); seeds, temperature, top_k, top_p, min_p; greedy (static): every row is
  greedy; filter_by (static): how rows filter (`sampling.sample_rows`);
  logprobs (static): also each new token's log-probability (through the logits, also
  where every row is greedy) and the `top_logprobs` (static) most likely tokens'
  (`Logprobs`); processors: None, or the rows' `processor_arrays` (each step then draws
  from `processed_logits`, counting its new tokens; log-probabilities stay the
  model's); guides: None, or the guided rows' tables (`GuideTables`) with each row's
  guide_offset (-1: unguided) and guide_state (int32 [B]): each step masks the logits
  (`guided_logits`), advances the states and stops a row whose guide is done; adapters:
  None, or each row's LoRA slot (int32 [B], -1: none).

  Returns:
    (int32 [max_steps, B] new tokens, -1 where a row was inactive; the pool), with
    `logprobs` ((tokens, `Logprobs` of [max_steps, B]); the pool).
  """
  b = tokens.shape[0]
  # Known when tracing (not traced): `reserve` then takes its one-kernel decode path.
  seq_ids = np.arange(b, dtype=np.int32)

  def cond(carry):
    step, _, _, active, *_ = carry
    return (step < num_steps) & jnp.any(active)

  def body(_, carry):
    # `active` rows are active at `step`, which is below num_steps for any active row.
    # (out_logprobs, counts: None where not asked for)
    step, kv, tokens, active, index, budget, out, out_logprobs, counts, state = carry
    if greedy and not logprobs and processors is None and guides is None:
      # The argmax without the logits.
      new, kv = decode_step(model, kv, tokens, seq_ids, active, greedy=True,
                            adapters=adapters)
    else:
      logits, kv = decode_step(model, kv, tokens, seq_ids, active, adapters=adapters)
      new = sampling.sample_rows(
          guided_logits(processed_logits(logits, processors, counts, in_prompt, index),
                        guides, guide_offset, state),
          seeds, index, temperature, top_k, top_p, min_p, all_greedy=greedy,
          filter_by=filter_by)
      if processors is not None:
        counts = counts.at[jnp.arange(b), new].add(active.astype(jnp.int32))
    guide_done = False
    if guides is not None:
      moved, guide_done = guided_step(guides, guide_offset, state, new)
      state = jnp.where(active, moved, state)
    # `out` has a row for every step a group can run: no bounds check (an XLA reduction
    # kernel per step for `.at[step].set(..., mode="drop")`).
    out = jax.lax.dynamic_update_slice(out, jnp.where(active, new, -1)[None], (step, 0))
    if logprobs:
      out_logprobs = jax.tree.map(
          lambda all_, x: jax.lax.dynamic_update_slice(all_, x[None], (step,) + (0,) * x.ndim),
          out_logprobs, Logprobs.of(logits, new, top_logprobs))
    index += active
    budget -= active
    stopped = jnp.any(new[:, None] == stop_ids, axis=1) | (budget <= 0) | guide_done
    tokens = jnp.where(active, new, tokens)
    # Masked for the next step here, in this fusion, rather than by a kernel of its own at
    # the start of the next.
    active &= ~stopped & (step + 1 < num_steps)
    return step + 1, kv, tokens, active, index, budget, out, out_logprobs, counts, state

  per_check = steps_per_check(max_steps) if checked else max_steps
  out, out_logprobs = _outputs(-(-max_steps // per_check) * per_check, b, logprobs,
                               top_logprobs)
  counts, in_prompt = processor_counts(processors, model.spec.vocab_size)
  carry = (jnp.int32(0), kv, tokens, active, index, budget, out, out_logprobs, counts,
           guide_state)
  group = lambda carry: jax.lax.fori_loop(0, per_check, body, carry)
  _, kv, *_, out, out_logprobs, _, _ = (jax.lax.while_loop(cond, group, carry) if checked
                                        else group(carry))
  if logprobs:
    return (out[:max_steps], Logprobs(*(x[:max_steps] for x in out_logprobs))), kv
  return out[:max_steps], kv


def _outputs(steps: int, b: int, logprobs: bool, top_logprobs: int
             ) -> tuple[jax.Array, Logprobs | None]:
  """A decode loop's outputs before its first step: int32 [steps, B] tokens, all -1, and
  with `logprobs` their `Logprobs` (zeros: an inactive row's entries are never read)."""
  out = jnp.full((steps, b), -1, jnp.int32)
  if not logprobs:
    return out, None
  return out, Logprobs(jnp.zeros((steps, b)), jnp.zeros((steps, b, top_logprobs), jnp.int32),
                       jnp.zeros((steps, b, top_logprobs)))


def speculative_loop(model: PagedModel, kv: pool_lib.KVPool, num_steps, tokens, active,
                     index, budget, stop_ids, seeds, temperature, top_k, top_p, min_p,
                     history=None, history_len=None, *, max_steps: int,
                     speculation: speculative.NgramSpeculation | speculative.DraftSpeculation,
                     greedy: bool,
                     filter_by: str | None = "chunked", logprobs: bool = False,
                     top_logprobs: int = 0, processors: dict[str, jax.Array] | None = None,
                     guides: Guides | None = None, guide_offset=None, guide_state=None,
                     adapters=None):
  """`decode_loop` by speculative rounds (`jax_paged.serving.speculative`): each row
  takes up to `num_steps` tokens, its output the same tokens plain decoding gives.

  A round drafts each active row's next tokens, at most as many as its budget and
  num_steps leave room for, less one: from its history (`speculative.propose`), or with a
  `DraftSpeculation` (the model a `speculative.DraftedModel`) that many, the draft's
  (`speculative.draft_tokens`, after the slots are reserved); it reserves the newest
  token's and the drafts' slots, runs the model over them at once
  (`prefill_hidden` with `start`, then `logits` at every position), draws the token at
  each position as a decode step would at that index (logits processors counting the
  drafts before it, the guide state after them, the key `fold_in(key(seed), index + i)`),
  keeps the drafts that equal those draws and the draw after them, up to the first stop
  (stop token, budget, guide done), and truncates the pool to what it keeps
  (`pool.truncate`). It checks after every round whether a row is still active.

  Args: as `decode_loop`'s (no `checked`: rounds are always checked), and for prompt
    lookup history int32 [B, W] with history_len int32 [B]: each row's last context
    tokens (the newest included), W at least history_len + num_steps.

  Returns:
    ((int32 [max_steps, B] new tokens, each row's a prefix of its column, -1 after; their
    `Logprobs` with `logprobs`, else None; int32 [3]: the rounds run, the drafts
    verified, the drafts kept); the pool).
  """
  b = tokens.shape[0]
  k = speculation.num_tokens
  drafted = isinstance(speculation, speculative.DraftSpeculation)
  if drafted:  # (no history: carried empty)
    history = history_len = jnp.zeros((b, 0), jnp.int32)
  rows = np.arange(b, dtype=np.int32)  # (numpy: `_rows` slices the pool's first rows)
  at = jnp.arange(k + 1)

  def cond(carry):
    rnd, _, _, active, *_ = carry
    return (rnd < num_steps) & jnp.any(active)

  def body(carry):
    (rnd, kv, tokens, active, index, budget, produced, history, history_len, out,
     out_logprobs, counts, state, stats) = carry
    allowance = jnp.minimum(budget, num_steps - produced)
    if drafted:  # the draft's tokens, drawn once the slots are reserved
      count = jnp.clip(allowance - 1, 0, k)
    else:
      drafts, count = speculative.propose(
          history, history_len, allowance, num_tokens=k, min_ngram=speculation.min_ngram,
          max_ngram=speculation.max_ngram)
    start = _rows(kv.lengths, rows)
    # The newest token's slot as a decode step reserves it (its kernel copies a shared
    # last page), then the drafts' without the XLA path's branches (each a round trip to
    # the host): the scheduler's pages make both succeed.
    kv, newest, ok = pool_lib.reserve(kv, rows, active, max_new_tokens=1)
    active &= ok
    kv, draft_slots, ok = pool_lib.reserve(kv, jnp.where(active, rows, -1), count,
                                           max_new_tokens=k, branch_free=True)
    count = jnp.where(ok, count, 0)
    slots = jnp.concatenate([newest, draft_slots], axis=1)
    page_table = _rows(kv.page_table, rows)
    if drafted:
      drafts, kv = speculative.draft_tokens(model.draft, kv, tokens, slots, start,
                                            jnp.where(active, count, 0), page_table)
    lora = {} if adapters is None else dict(adapters=adapters)
    hidden, kv = model.prefill_hidden(jnp.concatenate([tokens[:, None], drafts], axis=1),
                                      kv, slots, count + 1, start=start,
                                      page_table=page_table, **lora)
    logits = model.logits(hidden)  # [B, k + 1, V]
    # The draw at each position, after the drafts before it.
    states = [state] * (k + 1)
    if processors is None and guides is None:  # every position at once
      positions = lambda x: jnp.repeat(x, k + 1, axis=0)
      draws = sampling.sample_rows(
          logits.reshape(b * (k + 1), -1), positions(seeds),
          (index[:, None] + at[None, :]).reshape(-1), positions(temperature),
          positions(top_k), positions(top_p), positions(min_p), all_greedy=greedy,
          filter_by=filter_by).reshape(b, k + 1)
    else:
      draws, c = [], counts
      for i in range(k + 1):
        draws.append(sampling.sample_rows(
            guided_logits(processed_logits(logits[:, i], processors, c, in_prompt,
                                           index + i), guides, guide_offset, states[i]),
            seeds, index + i, temperature, top_k, top_p, min_p, all_greedy=greedy,
            filter_by=filter_by))
        if i < k and processors is not None:
          c = c.at[jnp.arange(b), drafts[:, i]].add((i < count).astype(jnp.int32))
        if i < k and guides is not None:  # (a draft the guide refuses is never accepted)
          states[i + 1] = guided_step(guides, guide_offset, states[i], drafts[:, i])[0]
      draws = jnp.stack(draws, axis=1)  # [B, k + 1]
    kept = speculative.accepted(draws, drafts, count) + 1  # the draws kept, before stops
    stops = jnp.any(draws[:, :, None] == stop_ids[:, None, :], axis=2)
    stops |= budget[:, None] - 1 - at[None, :] <= 0
    if guides is not None:  # each draw's guide state after it
      after = jax.vmap(lambda st, t: guided_step(guides, guide_offset, st, t),
                       in_axes=1, out_axes=1)(jnp.stack(states, axis=1), draws)
      stops |= after[1]
    stops &= at[None, :] < kept[:, None]
    new = jnp.where(active, jnp.where(jnp.any(stops, axis=1), jnp.argmax(stops, axis=1) + 1,
                                      kept), 0)
    kv, _ = pool_lib.truncate(kv, jnp.where(active, rows, -1), start + new)
    stats += jnp.stack([jnp.sum(jnp.where(active, count, 0)),
                        jnp.sum(jnp.maximum(new - 1, 0))])
    taken = at[None, :] < new[:, None]  # [B, k + 1]
    last = jnp.maximum(new - 1, 0)
    if processors is not None:
      counts = counts.at[rows[:, None], draws].add(taken.astype(jnp.int32))
    if guides is not None:
      state = jnp.where(new > 0, after[0][rows, last], state)
    put = lambda x, where, value: x.at[where].set(value, mode="drop")
    out_row = jnp.where(taken, produced[:, None] + at[None, :], max_steps)
    out = put(out, (out_row, rows[:, None]), draws)
    if logprobs:
      lp = Logprobs.of(logits.reshape(b * (k + 1), -1), draws.reshape(-1), top_logprobs)
      out_logprobs = jax.tree.map(
          lambda all_, x: put(all_, (out_row, rows[:, None]),
                              x.reshape(b, k + 1, *x.shape[1:])), out_logprobs, lp)
    if not drafted:
      history = put(history, (rows[:, None], jnp.where(
          taken, history_len[:, None] + at[None, :], history.shape[1])), draws)
      history_len += new
    tokens = jnp.where(new > 0, draws[rows, last], tokens)
    index += new
    budget -= new
    produced += new
    active &= ~jnp.any(stops, axis=1) & (budget > 0) & (produced < num_steps)
    return (rnd + 1, kv, tokens, active, index, budget, produced, history, history_len, out,
            out_logprobs, counts, state, stats)

  out, out_logprobs = _outputs(max_steps, b, logprobs, top_logprobs)
  counts, in_prompt = processor_counts(processors, model.spec.vocab_size)
  carry = (jnp.int32(0), kv, tokens, active, index, budget, jnp.zeros((b,), jnp.int32),
           history, history_len, out, out_logprobs, counts, guide_state,
           jnp.zeros((2,), jnp.int32))  # (drafts verified, kept)
  rounds, kv, *_, out, out_logprobs, _, _, stats = jax.lax.while_loop(cond, body, carry)
  return (out, out_logprobs, jnp.concatenate([rounds[None], stats])), kv


# The narrowest context a call with penalized rows sends per row (`processor_arrays`): the
# longest row's context rounded up to this times a power of two (a compilation each);
# likewise the fewest `logit_bias` entries per row.
MIN_CONTEXT_WIDTH = 128
MIN_BIAS_TOKENS = 8

_PROCESSOR_ARRAYS = ("context", "context_len", "prompt_len", "repetition", "frequency",
                     "presence", "bias_tokens", "bias_values", "min_tokens", "min_stop_ids")


def processor_arrays(rows: Sequence, context_width: int | None = None
                     ) -> dict[str, np.ndarray]:
  """The logits processors of rows (scheduler `RunningRequest`s, None for an empty row;
  `Request.processes_logits`) as a call's host arrays, {} where no row has any. Each row's
  penalties (float32 [B] repetition, frequency, presence) and, for a penalized row, its
  context (int32 [B, width], its prompt then every token generated so far; empty for
  other rows) with context_len and prompt_len (int32 [B]), from which the call counts
  (`sampling.token_counts`); its logit_bias as bias_tokens / bias_values (int32 / float32
  [B, K], padded with zeros); its min_tokens (int32 [B]) and the stop tokens that are
  banned until then (min_stop_ids, int32 [B, S], -1 padded). A given `context_width`
  makes the arrays, that wide, whatever the rows (`ModelRunner.idle_decode`)."""
  used = [i for i, s in enumerate(rows) if s is not None and s.request.processes_logits]
  if not used and context_width is None:
    return {}
  requests = {i: rows[i].request for i in used}
  b = len(rows)
  penalized = [i for i in used if requests[i].penalized]
  contexts = [rows[i].context for i in penalized]
  if context_width is None:
    context_width = bucket(max(map(len, contexts), default=1), MIN_CONTEXT_WIDTH)
  context = np.zeros((b, context_width), np.int32)
  fill_rows(context, penalized, contexts)
  context_len, prompt_len, min_tokens = np.zeros((3, b), np.int32)
  context_len[penalized] = [len(c) for c in contexts]
  prompt_len[penalized] = [len(rows[i].prompt) for i in penalized]
  biased = [i for i in used if requests[i].logit_bias]
  width = bucket(max((len(requests[i].logit_bias) for i in biased), default=1),
                 MIN_BIAS_TOKENS)
  bias_tokens = np.zeros((b, width), np.int32)
  bias_values = np.zeros((b, width), np.float32)
  fill_rows(bias_tokens, biased, [list(requests[i].logit_bias.keys()) for i in biased])
  fill_rows(bias_values, biased, [list(requests[i].logit_bias.values()) for i in biased])
  waiting = [i for i in used if requests[i].min_tokens]  # (rows whose stops are banned)
  min_tokens[waiting] = [requests[i].min_tokens for i in waiting]
  stops = [rows[i].stop_token_ids for i in waiting]
  min_stop_ids = np.full((b, bucket(max(map(len, stops), default=1), MIN_STOP_IDS)), -1,
                         np.int32)
  fill_rows(min_stop_ids, waiting, stops)
  setting = lambda name, none: np.asarray(
      [none if s is None else getattr(s.request, name) for s in rows], np.float32)
  return dict(context=context, context_len=context_len, prompt_len=prompt_len,
              repetition=setting("repetition_penalty", 1.0),
              frequency=setting("frequency_penalty", 0.0),
              presence=setting("presence_penalty", 0.0), bias_tokens=bias_tokens,
              bias_values=bias_values, min_tokens=min_tokens, min_stop_ids=min_stop_ids)


def take_processors(arrays: dict[str, jax.Array]) -> dict[str, jax.Array] | None:
  """`processor_arrays`' arrays popped from a call's unpacked arrays; None without them."""
  if "context" not in arrays:
    return None
  return {name: arrays.pop(name) for name in _PROCESSOR_ARRAYS}


def processor_counts(processors: dict[str, jax.Array] | None, vocab_size: int
                     ) -> tuple[jax.Array, jax.Array] | tuple[None, None]:
  """On device: (int32 [B, V] generated counts, bool [B, V] in the prompt) of each row
  (`sampling.token_counts` of `processor_arrays`' contexts); (None, None) without."""
  if processors is None:
    return None, None
  return sampling.token_counts(processors["context"], processors["context_len"],
                               processors["prompt_len"], vocab_size)


def processed_logits(logits: jax.Array, processors: dict[str, jax.Array] | None,
                     counts: jax.Array | None, in_prompt: jax.Array | None,
                     index: jax.Array) -> jax.Array:
  """logits [B, V] through the rows' logits processors, in vLLM's order: logit_bias
  (`sampling.add_bias`), the stop tokens banned while index int32 [B] (tokens generated
  so far) is below min_tokens (`sampling.ban`), the penalties (`sampling.penalize`);
  as they are without."""
  if processors is None:
    return logits
  p = processors
  logits = sampling.add_bias(logits, p["bias_tokens"], p["bias_values"])
  logits = sampling.ban(logits, p["min_stop_ids"], index < p["min_tokens"])
  return sampling.penalize(logits, counts, in_prompt, p["repetition"], p["frequency"],
                           p["presence"])


class Guides(NamedTuple):
  """The guides' token tables on the device (`GuideTables`): table int16 [states, V],
  each guide's `Guide.table` from its offset; done bool [states], `Guide.done`."""

  table: jax.Array
  done: jax.Array


def guided_logits(logits: jax.Array, guides: Guides | None, offset: jax.Array,
                  state: jax.Array) -> jax.Array:
  """logits [B, V] with the tokens that each guided row's state does not allow at -inf;
  offset int32 [B]: its guide's first row in `guides` (-1: an unguided row), state int32
  [B]: its state in its guide. As they are without guides."""
  if guides is None:
    return logits
  allowed = guides.table[jnp.maximum(offset + state, 0)] >= 0
  return jnp.where(allowed | (offset < 0)[:, None], logits, -jnp.inf)


def guided_step(guides: Guides, offset: jax.Array, state: jax.Array, tokens: jax.Array
                ) -> tuple[jax.Array, jax.Array]:
  """(int32 [B] each guided row's state after its token tokens [B] (others' as they
  were), bool [B] whether it is done: nothing may follow)."""
  at = jnp.maximum(offset + state, 0)
  new = jnp.where(offset >= 0, guides.table[at, tokens].astype(jnp.int32), state)
  return new, (offset >= 0) & guides.done[jnp.maximum(offset + new, 0)]


class GuideTables:
  """The token tables (`Guide.table`, `Guide.done`) of the guides that requests use, held
  on the device as one array (`Guides`), each guide from an offset.

  `place(guides)` returns each guide's offset, uploading the ones not there: the array is
  then rebuilt from the guides asked for and those it holds still asked for before
  (`place` is given every running sequence's guide), its rows bucketed to a power of two
  times MIN_GUIDE_STATES (one compilation of the calls per size). A guide's table is one
  row of the vocabulary per state (int16): ~33 MB for a JSON object's 329 states with
  GPT-2's vocabulary.
  """

  def __init__(self, vocab_size: int, mesh: Mesh | None = None):
    self.vocab_size, self.mesh = vocab_size, mesh
    self.guides: Guides | None = None
    self.offsets: dict = {}  # guide -> its first row

  def place(self, guides: set) -> dict:
    """{guide: offset} for `guides` (`jax_paged.guided.Guide`s), all on the device."""
    if not guides or guides.issubset(self.offsets):
      return self.offsets
    keep = [g for g in self.offsets if g in guides] + [g for g in guides
                                                      if g not in self.offsets]
    sizes = [g.num_states for g in keep]
    rows = bucket(sum(sizes), MIN_GUIDE_STATES)
    table = np.full((rows, self.vocab_size), -1, np.int16)
    done = np.zeros((rows,), bool)
    self.offsets, at = {}, 0
    for g, n in zip(keep, sizes):
      table[at:at + n, :g.vocab_size] = g.table
      done[at:at + n] = g.done
      self.offsets[g] = at
      at += n
    self.guides = None  # (the old array freed before the new one is uploaded)
    put = (jax.device_put if self.mesh is None else functools.partial(
        jax.device_put, device=jax.sharding.NamedSharding(self.mesh,
                                                          jax.sharding.PartitionSpec())))
    self.guides = Guides(put(table), put(done))
    return self.offsets


# The fewest rows of `GuideTables`' array (a power of two times this): each size is a
# compilation of every guided call's shape, so one size holds most uses (a JSON schema's
# guide has ~100-700 states; 1024 rows of GPT-2's vocabulary take 103 MB).
MIN_GUIDE_STATES = 1024


# A jitted call copies each numpy argument to the device on its own: nine of them cost
# ~215 µs of a decode call's ~840 µs of fixed host time (H200, benchmarks/LOG.md, "Engine /
# decode loop"), while the GPU waited. So each call's host arrays travel as one.
Layout = tuple[tuple[str, str, tuple[int, ...]], ...]


def pack_arrays(**arrays) -> tuple[np.ndarray, Layout]:
  """Host arrays (int32, uint32, float32 or bool, any shapes) as one int32 array of their
  bits, and its layout: (name, dtype, shape) per array, hashable (a static argument of the
  jitted call that `unpack_arrays` them)."""
  layout, parts = [], []
  for name, value in arrays.items():
    value = np.asarray(value)
    if value.dtype == bool:
      bits = value.astype(np.int32)
    elif value.dtype in (np.int32, np.uint32, np.float32):
      bits = np.ascontiguousarray(value).view(np.int32)
    else:
      raise TypeError(f"{name}: pack_arrays takes int32, uint32, float32 or bool arrays, "
                      f"got {value.dtype}")
    layout.append((name, value.dtype.str, value.shape))
    parts.append(bits.reshape(-1))
  return np.concatenate(parts), tuple(layout)


def unpack_arrays(packed: jax.Array, layout: Layout) -> dict[str, jax.Array]:
  """On device: `pack_arrays`' array back to its arrays, by name."""
  arrays, at = {}, 0
  for name, dtype, shape in layout:
    size = math.prod(shape)
    bits = packed[at:at + size].reshape(shape)
    at += size
    dtype = np.dtype(dtype)
    arrays[name] = bits != 0 if dtype == bool else jax.lax.bitcast_convert_type(bits, dtype)
  return arrays


class JittedSteps:
  """The jitted device functions of one model structure, pool donated: `prefill` and
  `decode` (`prefill_step` / `decode_step`), `prefill_sample` (attach rows to cached
  pages, prefill; attach second-phase rows to the pages the first computed, prefill them;
  fork parallel samples, then sample first tokens from the rows' last logits) and
  `decode_loop`; those two take their host arrays packed (`pack_arrays`).

  They take the parameters as the list `jax.tree.leaves(params)` (`treedef` = their
  `jax.tree.structure`): flattening an `nnx.State` of GPT-2 124M's 148 arrays costs
  ~130-190 µs per call, paid on the host while the GPU waits between decode chunks. The
  graphdef is bound rather than static: hashing it per call costs ~1 ms.
  """

  def __init__(self, graphdef: nnx.GraphDef, treedef,
               sharding: tuple[Mesh, tuple] | None = None):
    model = lambda leaves: nnx.merge(graphdef, jax.tree.unflatten(treedef, leaves))

    def prefill(leaves, kv, tokens, lengths, seq_ids, start=None, adapters=None):
      return prefill_step(model(leaves), kv, tokens, lengths, seq_ids, start,
                          adapters=adapters)

    def decode(leaves, kv, tokens, seq_ids, active=None, *, greedy=False):
      return decode_step(model(leaves), kv, tokens, seq_ids, active, greedy=greedy)

    def prefill_sample(leaves, kv, packed, guides=None, *, layout: Layout, greedy: bool,
                       filter_by: str | None, logprobs: bool = False,
                       top_logprobs: int = 0, prompt_top_logprobs: int = 0):
      """Packed: tokens, lengths, seq_ids, start and attach_ids / attach_pages (absent:
      fresh prompts), score_rows and score_targets (first-phase rows whose prompt
      log-probabilities are asked, the tokens their positions predict; absent: none), the
      second phase's follow_tokens, follow_lengths, follow_ids, follow_start and
      follow_src (absent: no second phase), adapters (each pool sequence's LoRA slot;
      absent: no LoRA), fork_src, fork_dst, sample_rows (into both
      phases' rows) and the sample rows' seeds, index, temperature, top_k, top_p, min_p
      and `processor_arrays` (absent: none), and with `guides` (`GuideTables`) the
      sample rows' guide_offset and guide_state (`guided_logits`). Returns ((int32
      [samples] tokens, their `Logprobs` with `logprobs` else None, the scored rows'
      `prompt_logprobs` (with `prompt_top_logprobs` most likely tokens) or None); the
      pool)."""
      a = unpack_arrays(packed, layout)
      m = model(leaves)
      if "start" in a:  # rows attached to cached pages (attach_ids[j] = -1: not row j)
        kv = pool_lib.attach(kv, a["attach_ids"], a["attach_pages"], a["start"])
      scored = None
      adapters = a.get("adapters")  # each pool sequence's LoRA slot, if any
      if "score_rows" in a:
        hidden, kv = prefill_step(m, kv, a["tokens"], a["lengths"], a["seq_ids"],
                                  a.get("start"), hidden=True, adapters=adapters)
        scored = prompt_logprobs(m.logits, hidden[a["score_rows"]], a["score_targets"],
                                 prompt_top_logprobs)
        logits = m.logits(last_tokens(hidden, a["lengths"]))
      else:
        logits, kv = prefill_step(m, kv, a["tokens"], a["lengths"], a["seq_ids"],
                                  a.get("start"), adapters=adapters)
      if "follow_src" in a:  # rows starting on the first pages of rows prefilled above
        src_rows = kv.page_table[jnp.clip(a["follow_src"], 0, kv.max_seqs - 1)]
        kv = pool_lib.attach(kv, a["follow_ids"], src_rows, a["follow_start"])
        more, kv = prefill_step(m, kv, a["follow_tokens"], a["follow_lengths"],
                                a["follow_ids"], a["follow_start"], adapters=adapters)
        logits = jnp.concatenate([logits, more])
      kv = pool_lib.fork(kv, a["fork_src"], a["fork_dst"])
      logits = logits[a["sample_rows"]]
      processors = take_processors(a)
      counts, in_prompt = processor_counts(processors, logits.shape[-1])
      tokens = sampling.sample_rows(guided_logits(
          processed_logits(logits, processors, counts, in_prompt, a["index"]), guides,
          a.get("guide_offset"), a.get("guide_state")),
                                    a["seeds"], a["index"], a["temperature"],
                                    a["top_k"], a["top_p"], a["min_p"], all_greedy=greedy,
                                    filter_by=filter_by)
      lp = Logprobs.of(logits, tokens, top_logprobs) if logprobs else None
      return (tokens, lp, scored), kv

    def loop(leaves, kv, packed, guides=None, *, layout: Layout, max_steps: int,
             greedy: bool, checked: bool, filter_by: str | None, logprobs: bool = False,
             top_logprobs: int = 0):
      """Packed: `decode_loop`'s num_steps and per-row arguments, by name (guide_offset and
      guide_state with `guides`), and the `processor_arrays` if any."""
      a = unpack_arrays(packed, layout)
      processors = take_processors(a)
      return decode_loop(model(leaves), kv, max_steps=max_steps, greedy=greedy,
                         checked=checked, filter_by=filter_by, logprobs=logprobs,
                         top_logprobs=top_logprobs, processors=processors, guides=guides,
                         **a)

    def speculate(leaves, kv, packed, guides=None, *, layout: Layout, max_steps: int,
                  speculation: speculative.NgramSpeculation | speculative.DraftSpeculation,
                  greedy: bool,
                  filter_by: str | None, logprobs: bool = False, top_logprobs: int = 0):
      """Packed: `speculative_loop`'s num_steps and per-row arguments, by name, as
      `loop`'s."""
      a = unpack_arrays(packed, layout)
      processors = take_processors(a)
      return speculative_loop(model(leaves), kv, max_steps=max_steps,
                              speculation=speculation, greedy=greedy, filter_by=filter_by,
                              logprobs=logprobs, top_logprobs=top_logprobs,
                              processors=processors, guides=guides, **a)

    self._model, self._sharding, self._jitted = model, sharding, {}
    if sharding is not None:  # tensor parallel: each step one shard_map over the mesh
      prefill, decode, prefill_sample, loop, speculate = (
          _per_device(fn, *sharding)
          for fn in (prefill, decode, prefill_sample, loop, speculate))
    self.prefill = _pool_jit(prefill, donate_argnums=1)
    self.decode = _pool_jit(decode, donate_argnums=1, static_argnames="greedy")
    self.prefill_sample = _pool_jit(prefill_sample, donate_argnums=1,
                                    static_argnames=("layout", "greedy", "filter_by",
                                                     "logprobs", "top_logprobs",
                                                     "prompt_top_logprobs"))
    self.decode_loop = _pool_jit(loop, donate_argnums=1,
                                 static_argnames=("layout", "max_steps", "greedy",
                                                  "checked", "filter_by", "logprobs",
                                                  "top_logprobs"))
    self.speculative_loop = _pool_jit(
        speculate, donate_argnums=1,
        static_argnames=("layout", "max_steps", "speculation", "greedy", "filter_by",
                         "logprobs", "top_logprobs"))


  def jit(self, fn: Callable, static: tuple) -> Callable:
    """fn(model, kv, *args, **dict(static)) -> (out, kv), a device function of another
    layer (e.g. `beam_search.beam_loop`), as (leaves, kv, *args) -> (out, kv) jitted
    like the steps above: pool donated, one shard_map over a mesh (`out` and `args`
    replicated); once per (fn, static)."""
    if (fn, static) not in self._jitted:
      model, kwargs = self._model, dict(static)
      call = lambda leaves, kv, *args: fn(model(leaves), kv, *args, **kwargs)
      if self._sharding is not None:
        call = _per_device(call, *self._sharding)
      self._jitted[fn, static] = _pool_jit(call, donate_argnums=1)
    return self._jitted[fn, static]


def _per_device(fn, mesh: Mesh, specs: tuple):
  """fn(leaves, kv, *args, **static) as one `shard_map` over a tensor parallel mesh
  (`tensor_parallel.per_device`); static keywords are bound outside it, and None
  arguments (no leaves) pass through."""
  def call(leaves, kv, *args, **static):
    inner = lambda leaves, kv, *args: fn(leaves, kv, *args, **static)
    return tensor_parallel.per_device(inner, mesh, specs, len(args))(leaves, kv, *args)
  return call


@functools.lru_cache(maxsize=8)
def _jitted_steps(graphdef: nnx.GraphDef, treedef, sharding=None) -> JittedSteps:
  return JittedSteps(graphdef, treedef, sharding)


_clear = _pool_jit(pool_lib.clear, donate_argnums=0)


def _lora_targets(model: PagedModel) -> dict:
  if not callable(getattr(model, "lora_targets", None)):
    raise TypeError(f"{type(model).__name__} cannot serve LoRA adapters: it lists no "
                    "`lora_targets()` (see jax_paged.PagedModel)")
  targets = dict(model.lora_targets())
  if not targets:
    raise ValueError(f"{type(model).__name__}.lora_targets() lists no modules")
  return targets


@functools.partial(jax.jit, donate_argnums=0)
def _set_lora_slot(weights: list, blocks: list, slot: jax.Array) -> list:
  """weights (lora_a [K, W], lora_b [W, N] alternately) with slot `slot`'s R columns of
  A and rows of B replaced by blocks ([K, R], [R, N] alternately)."""
  out = []
  for i, (w, block) in enumerate(zip(weights, blocks)):
    r = block.shape[1] if i % 2 == 0 else block.shape[0]
    at = (0, slot * r) if i % 2 == 0 else (slot * r, 0)
    out.append(jax.lax.dynamic_update_slice(w, block.astype(w.dtype), at))
  return out


@jax.jit
def _packed(*arrays: jax.Array) -> jax.Array:
  """int32 and float32 arrays as one flat int32 array (floats by their bits)."""
  return jnp.concatenate([jax.lax.bitcast_convert_type(x, jnp.int32).ravel()
                          for x in arrays])


def _read_back(*results) -> list:
  """int32 / float32 device arrays (pytrees of them; None stays None) on the host, in one
  device-to-host copy: the host waits for each copy in turn, ~0.3 ms apiece on the
  device's host after a prefill call, before its first tokens. Split on the host: a jnp
  slice of a device array dispatches a kernel (~0.5 ms)."""
  leaves, tree = jax.tree.flatten(list(results))
  flat = np.asarray(_packed(*leaves))
  ends = np.cumsum([x.size for x in leaves])
  return jax.tree.unflatten(tree, [part.view(x.dtype).reshape(x.shape)
                                   for part, x in zip(np.split(flat, ends[:-1]), leaves)])


@functools.partial(_pool_jit, donate_argnums=0, static_argnames="layout")
def _update_pages(kv: pool_lib.KVPool, packed: jax.Array, layout: Layout) -> pool_lib.KVPool:
  """`update_pages` with its arrays packed (`pack_arrays`), by its argument names."""
  return update_pages(kv, **unpack_arrays(packed, layout))


@dataclasses.dataclass(frozen=True)
class _Sampling:
  """Per-row sampling settings of a batch (numpy, transferred as the call dispatches)."""

  seeds: np.ndarray
  temperature: np.ndarray
  top_k: np.ndarray
  top_p: np.ndarray
  min_p: np.ndarray
  greedy: bool    # every row is greedy (`sample_rows(all_greedy=True)`)
  filter_by: str | None  # how sampled rows filter (`sampling.filter_method`)
  logprobs: bool  # some row's request asks for its tokens' log-probabilities
  top_logprobs: int  # alternatives computed per token: 0, or MAX_TOP_LOGPROBS if one asks

  @classmethod
  def of(cls, rows: Sequence) -> "_Sampling":
    """From each row's sequence (a scheduler `RunningRequest`: its sample's `seed` and its
    request's settings; None for an empty row: greedy defaults).

    Numpy throughout: the jitted call transfers the arrays as it dispatches, where
    `jnp.asarray` of a list cost ~1 ms each on the device's host.
    """
    requests = [s.request if s is not None else None for s in rows]
    logprobs = any(r is not None and r.logprobs for r in requests)
    top = sampling.MAX_TOP_LOGPROBS * any(r is not None and r.logprobs and r.top_logprobs
                                          for r in requests)
    if all(r is None or r.temperature == 0 for r in requests):
      # Greedy rows take the argmax (`sample_rows(all_greedy=True)`): the settings go
      # unused, so no pass over the rows per setting.
      n = len(rows)
      return cls(seeds=np.zeros(n, np.uint32), temperature=np.zeros(n, np.float32),
                 top_k=np.zeros(n, np.int32), top_p=np.ones(n, np.float32),
                 min_p=np.zeros(n, np.float32), greedy=True,
                 filter_by=None, logprobs=logprobs, top_logprobs=top)
    column = lambda fn, dtype: np.asarray([fn(r) if r is not None else 0 for r in requests],
                                          dtype)
    temperature = column(lambda r: r.temperature, np.float32)
    top_k = column(lambda r: r.top_k or 0, np.int32)
    top_p = np.asarray([1.0 if r is None or r.top_p is None else r.top_p for r in requests],
                       np.float32)
    min_p = column(lambda r: r.min_p, np.float32)
    return cls(seeds=np.asarray([s.seed if s is not None else 0 for s in rows], np.uint32),
               temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p, greedy=False,
               filter_by=sampling.filter_method(temperature, top_k, top_p, min_p),
               logprobs=logprobs, top_logprobs=top)

  def arrays(self) -> dict[str, np.ndarray]:
    return dict(seeds=self.seeds, temperature=self.temperature, top_k=self.top_k,
                top_p=self.top_p, min_p=self.min_p)


def _chunk_rows(chunks, page_size: int):
  """A prefill's rows for these chunks, padded to bucketed shapes: int32 tokens [n,
  width], lengths [n], seq_ids [n] (-1: a padding row, which reserves nothing) and start
  [n]."""
  n = bucket(len(chunks), 1)
  tokens = np.zeros((n, bucket(max(len(c.tokens) for c in chunks), page_size)), np.int32)
  lengths = np.ones((n,), np.int32)
  seq_ids = np.full((n,), -1, np.int32)
  start = np.zeros((n,), np.int32)
  fill_rows(tokens, range(len(chunks)), [c.tokens for c in chunks])
  lengths[:len(chunks)] = [len(c.tokens) for c in chunks]
  seq_ids[:len(chunks)] = [c.slot for c in chunks]
  start[:len(chunks)] = [c.start for c in chunks]
  return tokens, lengths, seq_ids, start


class Executed(NamedTuple):
  """A plan's results, on the host.

  Attributes:
    first: int32 [samples], the first tokens its prefill sampled, in the order of its
      chunks' `samples`.
    decoded: int32 [steps run, max_batch], its decode chunk's tokens, -1 where a row
      produced nothing (at most `plan.max_steps` rows; none without a decode chunk).
    page_table, num_free: the pool's after the call (the scheduler's page accounting
      checks them).
    first_logprobs, decoded_logprobs: their tokens' `Logprobs` (numpy), shaped as `first`
      and `decoded`; None where no row of the call asked (`Request.logprobs`).
    prompt_logprobs: `Logprobs` (numpy) [rows, T] of the prefill's chunks with `targets`
      (`prompt_logprobs`), in their order; None where it has none.
    speculated: int32 [3] of a speculative decode chunk (`speculative_loop`): its rounds,
      the drafts they verified and the drafts kept; None otherwise.
  """

  first: np.ndarray
  decoded: np.ndarray
  page_table: np.ndarray
  num_free: int
  first_logprobs: Logprobs | None = None
  decoded_logprobs: Logprobs | None = None
  prompt_logprobs: Logprobs | None = None
  speculated: np.ndarray | None = None


class ModelRunner:
  """Runs a `PagedModel` over a pool: the step functions jitted once per model structure.

  Every method takes the pool and returns the new one (donated: the old one is consumed).

    prefill(kv, tokens, lengths, seq_ids, start=None, adapters=None) -> (logits, kv)
                                                                  `prefill_step`
    decode(kv, tokens, seq_ids, active=None, greedy=False) -> (logits | tokens, kv)
    decode_loop(kv, num_steps, rows, max_steps=, greedy=, checked=, filter_by=,
                logprobs=, top_logprobs=) -> (tokens | (tokens, Logprobs), kv)
    release(kv, seq_ids) -> kv
    clear(kv) -> kv                                               `pool.clear`
    update_pages(kv, retain=, release=, evict=) -> kv               `update_pages`
    execute(kv, plan) -> (kv, Executed)                           a scheduler's `Plan`
    run(fn, kv, *args, **static) -> (out, kv)          another layer's device function
  """

  def __init__(self, model: PagedModel, mesh: Mesh | None = None,
               speculation: speculative.NgramSpeculation | speculative.DraftSpeculation
               | None = None,
               lora: tuple[int, int] | None = None):
    if not isinstance(model, PagedModel):
      raise TypeError(f"{type(model).__name__} does not meet jax_paged.PagedModel: it needs "
                      "a `spec` and `prefill` / `decode` forwards over the pool")
    if speculation is not None and not isinstance(
        speculation, (speculative.NgramSpeculation, speculative.DraftSpeculation)):
      raise TypeError(f"speculation must be a NgramSpeculation, a DraftSpeculation or "
                      f"None, got {type(speculation).__name__}")
    if speculation is not None and not offers_prompt_logprobs(model):
      raise ValueError(f"speculation needs the model's logits at every new position: "
                       f"{type(model).__name__} lacks PagedModel's optional "
                       "`prefill_hidden` and `logits`")
    if isinstance(speculation, speculative.DraftSpeculation):
      if lora is not None:
        raise ValueError("draft-model speculation does not run with LoRA adapters; use "
                         "prompt lookup (NgramSpeculation) or neither")
      # One pool and one forward for both models (`speculative.DraftedModel`).
      model = speculative.DraftedModel(model, speculation.model)
    self.spec: ModelSpec = model.spec
    # Whether prefills can give prompt log-probabilities (`Request.prompt_logprobs`).
    self.scores_prompts = offers_prompt_logprobs(model)
    # Decode calls run speculative rounds (`speculative_loop`) with it.
    self.speculation = speculation
    self.mesh = mesh
    self.guide_tables = GuideTables(self.spec.vocab_size, mesh)
    # With LoRA (max_loras, max_rank): the slots live among the parameters (`lora`), empty
    # until `load_adapter`; the caller's model is given them only while it is split.
    targets = {} if lora is None else _lora_targets(model)
    self.lora_layout = None if lora is None else lora_lib.SlotLayout.of(targets, lora[1])
    if lora is not None:
      lora_lib.attach(targets, max_loras=lora[0], max_rank=lora[1])
    try:
      if mesh is None:
        graphdef, params = nnx.split(model)
        self.leaves = jax.tree.leaves(params)
        self.jitted = _jitted_steps(graphdef, jax.tree.structure(params))
        key_paths = [kp for kp, _ in jax.tree_util.tree_flatten_with_path(params)[0]]
        orders = {}
      else:
        tensor_parallel.pool_kv_heads(self.spec.num_kv_heads,
                                      tensor_parallel.mesh_size(mesh))
        sharded = tensor_parallel.shard_model(model, mesh)
        self.leaves = sharded.leaves
        self.jitted = _jitted_steps(sharded.graphdef, sharded.treedef,
                                    (mesh, sharded.specs))
        key_paths, orders = sharded.paths, sharded.column_orders
      # Per adapted linear, in `lora_layout`'s order: its (lora_a, lora_b) leaf indices
      # and, tensor parallel, the order of its columns (B's too).
      paths = lora_lib.linear_paths(model, targets)
      self._lora_leaves = lora_lib.slot_leaves(paths, key_paths)
      self._lora_orders = [orders.get(path, slice(None)) for path in paths]
    finally:
      lora_lib.detach(targets)
    if lora is not None:  # (empty slots made empty: compiled here, not at a run's first load)
      dtype = self._lora_dtype  # (as `load_adapter` writes them)
      self._write_slot(0, [(np.zeros((k, w), dtype), np.zeros((w, n), dtype))
                           for modules, (k, n) in self.lora_layout.linears
                           for w in [lora[1] * len(modules)]])

  @property
  def serves_loras(self) -> bool:
    return self.lora_layout is not None

  @property
  def _lora_dtype(self):
    """The slots' dtype (the adapted linears' parameter dtype)."""
    return self.leaves[self._lora_leaves[0][0]].dtype

  def load_adapter(self, slot: int, adapter: lora_lib.LoraAdapter) -> None:
    """Writes `adapter` into LoRA slot `slot` of the parameters (in place: donated)."""
    # (Built here, not kept: a registered adapter holds only its own small factors.)
    self._write_slot(slot, self.lora_layout.blocks(adapter, self._lora_dtype))

  def _write_slot(self, slot: int, blocks: list) -> None:
    """Writes one slot's (A [K, R], B [R, N]) per adapted linear into the parameters."""
    # (Tensor parallel: B's columns in the order the devices' blocks take them.)
    blocks = [(a, b[:, order]) for (a, b), order in zip(blocks, self._lora_orders)]
    flat = [i for pair in self._lora_leaves for i in pair]
    new = _set_lora_slot([self.leaves[i] for i in flat],
                         [x for pair in blocks for x in pair], np.int32(slot))
    for i, x in zip(flat, new):
      self.leaves[i] = x

  def create_pool(self, **kwargs) -> pool_lib.KVPool:
    """An empty pool shaped for the model (`ModelSpec.create_pool`), its K/V split over
    the mesh by kv head when there is one."""
    if self.mesh is None:
      return self.spec.create_pool(**kwargs)
    return tensor_parallel.create_pool(self.spec, self.mesh, **kwargs)

  def prefill(self, kv, tokens, lengths, seq_ids, start=None, adapters=None):
    return self.jitted.prefill(self.leaves, kv, tokens, lengths, seq_ids, start, adapters)

  def decode(self, kv, tokens, seq_ids, active=None, *, greedy: bool = False):
    return self.jitted.decode(self.leaves, kv, tokens, seq_ids, active, greedy=greedy)

  def decode_loop(self, kv, num_steps: int, *, max_steps: int, greedy: bool, checked: bool,
                  filter_by: str | None = "chunked", logprobs: bool = False,
                  top_logprobs: int = 0, guides: Guides | None = None, **rows: np.ndarray):
    """`decode_loop`, or with `speculation` `speculative_loop` (`checked` unused; the rows
    then include history and history_len, `history_arrays`): num_steps and the per-row
    arguments (numpy, by name; and the `processor_arrays` where a row has logits
    processors, guide_offset and guide_state with `guides`) travel as the call's one
    host-to-device copy (`pack_arrays`).

    Returns ((int32 [max_steps, B] tokens, their `Logprobs` with `logprobs` else None,
    with `speculation` int32 [3] rounds run, drafts verified and drafts kept, else None);
    the pool).
    """
    packed, layout = pack_arrays(num_steps=np.int32(num_steps), **rows)
    if self.speculation is not None:
      return self.jitted.speculative_loop(
          self.leaves, kv, packed, guides, layout=layout, max_steps=max_steps,
          speculation=self.speculation, greedy=greedy, filter_by=filter_by,
          logprobs=logprobs, top_logprobs=top_logprobs)
    out, kv = self.jitted.decode_loop(self.leaves, kv, packed, guides, layout=layout,
                                      max_steps=max_steps, greedy=greedy, checked=checked,
                                      filter_by=filter_by, logprobs=logprobs,
                                      top_logprobs=top_logprobs)
    return (*(out if logprobs else (out, None)), None), kv

  def idle_decode(self, kv: pool_lib.KVPool, width: int, max_steps: int, *, greedy: bool,
                  checked: bool, filter_by: str | None, logprobs: bool = False,
                  top_logprobs: int = 0, context_width: int = 0) -> pool_lib.KVPool:
    """A decode call over `width` empty rows in a loop of `max_steps` steps, its tokens
    read back as `execute` reads a call's: compiles the programs such a call runs (for
    `Engine.warmup`; with penalized rows whose contexts take `context_width` > 0) and
    changes nothing (no row is active)."""
    zeros = np.zeros((width,), np.int32)
    decoded, kv = self.decode_loop(
        kv, max_steps, max_steps=max_steps, greedy=greedy, checked=checked,
        filter_by=filter_by, logprobs=logprobs, top_logprobs=top_logprobs, tokens=zeros,
        active=np.zeros((width,), bool), index=zeros, budget=zeros,
        stop_ids=np.full((width, MIN_STOP_IDS), -1, np.int32),
        **_Sampling.of([None] * width).arrays(),
        **processor_arrays([None] * width, context_width or None),
        **self.history_arrays([None] * width, max_steps), **self.lora_arrays(None, width))
    _read_back(*decoded, kv.page_table, kv.num_free)
    return kv

  def lora_arrays(self, adapters: np.ndarray | None, width: int | None = None
                  ) -> dict[str, np.ndarray]:
    """With LoRA: {"adapters": int32 [width]} (default: every slot's), each slot's
    adapter's device slot (a plan's `adapters`; None: -1, none), which every call then
    takes (one program per shape whichever adapters run); {} without."""
    if not self.serves_loras:
      return {}
    if adapters is None:
      return dict(adapters=np.full((width,), -1, np.int32))
    return dict(adapters=adapters[:width])

  def history_arrays(self, rows: Sequence, max_steps: int) -> dict[str, np.ndarray]:
    """With prompt lookup, the drafts' source for a decode call of rows (scheduler
    `RunningRequest`s, None for an empty row): history int32 [B, window + max_steps], each
    row's last `lookup_window` context tokens (at most the model's context) from column
    0, and history_len int32 [B]; {} without."""
    if not isinstance(self.speculation, speculative.NgramSpeculation):
      return {}
    window = min(self.speculation.lookup_window, self.spec.max_positions)
    history = np.zeros((len(rows), window + max_steps), np.int32)
    used = [i for i, s in enumerate(rows) if s is not None]
    contexts = [rows[i].context[-window:] for i in used]
    fill_rows(history, used, contexts)
    history_len = np.zeros((len(rows),), np.int32)
    history_len[used] = [len(c) for c in contexts]
    return dict(history=history, history_len=history_len)

  def run(self, fn: Callable, kv: pool_lib.KVPool, *args, **static):
    """fn(model, kv, *args, **static) -> (out, kv) jitted over this runner's model
    (`JittedSteps.jit`; static keywords hashable): how a layer above runs a device loop
    of its own (`beam_search.beam_loop`). Returns (out, kv)."""
    return self.jitted.jit(fn, tuple(sorted(static.items())))(self.leaves, kv, *args)

  def clear(self, kv: pool_lib.KVPool) -> pool_lib.KVPool:
    """Every page free and every sequence empty (`pool.clear`), in place."""
    return _clear(kv)

  def release(self, kv: pool_lib.KVPool, seq_ids: Sequence[int]) -> pool_lib.KVPool:
    """Frees these sequences' pages (those no other reference holds)."""
    return self.update_pages(kv, release=seq_ids)

  def update_pages(self, kv: pool_lib.KVPool, *, retain: Sequence[int] = (),
                   release: Sequence[int] = (), evict: Sequence[int] = ()
                   ) -> pool_lib.KVPool:
    """`update_pages` in one call (none when there is nothing to do)."""
    if not (len(retain) or len(release) or len(evict)):
      return kv
    release_ids = np.full((kv.max_seqs,), -1, np.int32)  # the pool's max_seqs: one shape
    release_ids[:len(release)] = release
    # Holds placed and dropped share one bucketed length: each new shape compiles the
    # call anew (~0.4 s on an H200 with a large pool, a stall mid-serving), and two
    # lengths bucketed apart made a shape for each of their combinations.
    holds = np.full((2, bucket(max(len(retain), len(evict)), MIN_HOLDS)), -1, np.int32)
    holds[0, :len(retain)] = retain
    holds[1, :len(evict)] = evict
    packed, layout = pack_arrays(holds=holds, release=release_ids)
    return _update_pages(kv, packed, layout)

  def execute(self, kv: pool_lib.KVPool, plan) -> tuple[pool_lib.KVPool, Executed]:
    """Runs a scheduler's `Plan`: its page bookkeeping, then its prefill, then its decode
    chunk, dispatched back to back; the host then reads the results back in one transfer
    (`_read_back`; two with both a prefill and a decode chunk) as `Executed`."""
    kv = self.update_pages(kv, retain=plan.retain, release=plan.release, evict=plan.evict)
    for slot, adapter in plan.lora_loads:
      self.load_adapter(slot, adapter)
    first = decoded = first_lp = decoded_lp = scored = speculated = None
    sequences = [*plan.rows, *(s for c in plan.prefill for _, s in c.samples)]
    offsets = self.guide_tables.place({s.request.guide for s in sequences
                                       if s is not None and s.request.guide is not None})
    if plan.prefill:
      (first, first_lp, scored), kv = self._prefill_plan(kv, plan, offsets)
    if plan.decode_steps:
      decoded, decoded_lp, speculated, kv = self._decode_plan(kv, plan, offsets)
    # A call with both reads its first tokens apart: one `_packed` program per
    # combination of their shapes would compile anew mid-run.
    apart = None
    if decoded is not None and first is not None:
      apart, first, first_lp, scored = (first, first_lp, scored), None, None, None
    decoded, decoded_lp, speculated, page_table, num_free, first, first_lp, scored = (
        _read_back(decoded, decoded_lp, speculated, kv.page_table, kv.num_free, first,
                   first_lp, scored))
    if apart is not None:
      first, first_lp, scored = jax.tree.map(np.asarray, apart)
    samples = sum(len(c.samples) for c in plan.prefill)
    if first is None:
      first = np.zeros((0,), np.int32)
    first, first_lp = jax.tree.map(lambda x: x[:samples], (first, first_lp))
    width = len(plan.rows)
    if decoded is None:
      decoded = np.zeros((0, width), np.int32)
    elif decoded.shape[1] < width:  # the slots past the decode width: no tokens
      pad = lambda x, fill=0: np.pad(x, ((0, 0), (0, width - x.shape[1]))
                                     + ((0, 0),) * (x.ndim - 2), constant_values=fill)
      decoded, decoded_lp = pad(decoded, -1), jax.tree.map(pad, decoded_lp)
    return kv, Executed(first, decoded, page_table, int(num_free), first_lp, decoded_lp,
                        scored, speculated)

  def _guided_rows(self, rows: Sequence, offsets: dict) -> tuple[Guides | None, dict]:
    """(The guides' device tables, each row's guide_offset and guide_state (int32
    [len(rows)]; -1 / 0 for unguided and empty rows)) if a row has a guide, else (None,
    {})."""
    guided = [i for i, s in enumerate(rows) if s is not None and s.request.guide is not None]
    if not guided:
      return None, {}
    offset = np.full((len(rows),), -1, np.int32)
    state = np.zeros((len(rows),), np.int32)
    offset[guided] = [offsets[rows[i].request.guide] for i in guided]
    state[guided] = [rows[i].guide_state for i in guided]
    return self.guide_tables.guides, dict(guide_offset=offset, guide_state=state)

  def _prefill_plan(self, kv, plan, offsets: dict):
    first = [c for c in plan.prefill if c.follows is None]
    second = [c for c in plan.prefill if c.follows is not None]
    tokens, lengths, seq_ids, start = _chunk_rows(first, kv.page_size)
    n = len(seq_ids)
    continued = {}
    if start.any():  # rows continuing a sequence; those starting on cached pages attach
      rows = [j for j, c in enumerate(first) if c.cached is not None]
      attach_ids = np.full((n,), -1, np.int32)
      attach_ids[rows] = seq_ids[rows]
      attach_pages = np.full((n, kv.max_pages_per_seq), -1, np.int32)
      fill_rows(attach_pages, rows, [first[j].cached for j in rows])
      continued = dict(start=start, attach_ids=attach_ids, attach_pages=attach_pages)
    if second:  # the second phase, on the first phase's pages
      f_tokens, f_lengths, f_ids, f_start = _chunk_rows(second, kv.page_size)
      follow_src = np.full_like(f_ids, -1)
      follow_src[:len(second)] = [c.follows for c in second]
      continued.update(follow_tokens=f_tokens, follow_lengths=f_lengths, follow_ids=f_ids,
                       follow_start=f_start, follow_src=follow_src)
    scored = [j for j, c in enumerate(first) if c.targets is not None]
    prompt_top = 0
    if scored:  # rows whose prompt log-probabilities are asked (never second-phase ones)
      score_rows = np.zeros((bucket(len(scored), 1),), np.int32)
      score_rows[:len(scored)] = scored
      score_targets = np.full((len(score_rows), tokens.shape[1]), -1, np.int32)
      fill_rows(score_targets, range(len(scored)), [first[j].targets for j in scored])
      continued.update(score_rows=score_rows, score_targets=score_targets)
      prompt_top = sampling.MAX_TOP_LOGPROBS * any(first[j].top_logprobs for j in scored)
    # Each chunk's row among both phases' logits (chunks hash by identity).
    row = {c: j for j, c in enumerate(first)}
    row.update((c, n + j) for j, c in enumerate(second))
    chunks = plan.prefill
    forks = [(c.slot, f) for c in chunks for f in c.forks]
    samples = [(row[c], s) for c in chunks for _, s in c.samples]
    # Samples (and forks) padded to the call's rows (n + the second phase's, bucketed) times
    # a power of two: a call whose chunks all sample once has one shape whatever number
    # of them sample (a long prompt's earlier chunks do not), and parallel samples (n per
    # prompt) a few more (Engine.warmup compiles both).
    m = bucket(len(samples), bucket(n + (len(f_ids) if second else 0), 1))
    sample_rows = np.zeros((m,), np.int32)
    sample_rows[:len(samples)] = [j for j, _ in samples]
    seqs = [s for _, s in samples] + [None] * (m - len(samples))
    sampling_ = _Sampling.of(seqs)
    guides, guided = self._guided_rows(seqs, offsets)
    fork_src, fork_dst = np.full((2, m), -1, np.int32)
    if forks:
      fork_src[:len(forks)], fork_dst[:len(forks)] = zip(*forks)
    # No start: fresh prompts take the model's attention over the new tokens alone.
    packed, layout = pack_arrays(
        tokens=tokens, lengths=lengths, seq_ids=seq_ids, **continued,
        fork_src=fork_src, fork_dst=fork_dst,
        sample_rows=sample_rows, **self.lora_arrays(plan.adapters),
        index=np.asarray([len(s.tokens) if s else 0 for s in seqs], np.int32),
        **sampling_.arrays(), **processor_arrays(seqs), **guided)
    return self.jitted.prefill_sample(self.leaves, kv, packed, guides, layout=layout,
                                      greedy=sampling_.greedy, filter_by=sampling_.filter_by,
                                      logprobs=sampling_.logprobs,
                                      top_logprobs=sampling_.top_logprobs,
                                      prompt_top_logprobs=prompt_top)

  def _decode_plan(self, kv, plan, offsets: dict):
    """The plan's decode chunk over its first `decode_width(plan.rows)` slots."""
    rows, max_steps = plan.rows[:decode_width(plan.rows)], plan.max_steps
    guides, guided = self._guided_rows(rows, offsets)
    stops = [list(s.stop_token_ids) if s is not None else [] for s in rows]
    stop_ids = np.full((len(rows), bucket(max(map(len, stops)), MIN_STOP_IDS)), -1,
                       np.int32)
    for i, ids in enumerate(stops):
      stop_ids[i, :len(ids)] = ids
    active = np.array([s is not None for s in rows])
    budget = np.array([s.budget if s else 0 for s in rows], np.int32)
    steps = plan.decode_steps
    # (Speculative rounds are each checked and take any number of tokens.)
    checked = self.speculation is None and needs_checks(steps, max_steps, active, budget,
                                                        stop_ids, bool(guided))
    per_check = steps_per_check(max_steps)
    if checked and steps < per_check:
      # A chunk cut short (by the free pages) in a loop of its own length, rounded up to a
      # power of two (a few more compilations): in a whole group the rest would run idle.
      max_steps = bucket(steps, 1)
      checked = needs_checks(steps, max_steps, active, budget, stop_ids, bool(guided))
    elif checked and steps > per_check:
      # Whole groups of checked steps: a partial group would run idle steps to its end.
      steps -= steps % per_check
    sampling_ = _Sampling.of(rows)
    out, kv = self.decode_loop(
        kv, steps, max_steps=max_steps, greedy=sampling_.greedy, checked=checked,
        filter_by=sampling_.filter_by, logprobs=sampling_.logprobs,
        top_logprobs=sampling_.top_logprobs, guides=guides,
        tokens=np.asarray([s.tokens[-1] if s else 0 for s in rows], np.int32),
        active=active, index=np.asarray([len(s.tokens) if s else 0 for s in rows], np.int32),
        budget=budget, stop_ids=stop_ids, **sampling_.arrays(), **processor_arrays(rows),
        **guided, **self.history_arrays(rows, max_steps),
        **self.lora_arrays(plan.adapters, len(rows)))
    return (*out, kv)
