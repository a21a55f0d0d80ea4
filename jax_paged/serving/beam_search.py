"""`jax_paged.beam_search`: beam search over the paged pool (Hugging Face's
`generate(num_beams=k)`, with its scores and stopping rules).

Each prompt keeps `beam_width` (k) running beams, one pool row each. A step extends every
beam's summed log-probability by its next-token log-probabilities and takes the group's
best `keep` = max(2, 1 + stop tokens) x k continuations (each beam's own best `keep`
hold them, `sampling.logprobs`). Those ending in a stop token, or reaching
`max_new_tokens`, among the best k become finished hypotheses scored
sum / generated_length ** length_penalty, of which a group keeps its best k; the best k
others run on. A group stops once its running beams cannot beat its worst finished one
(Hugging Face's heuristic, with `early_stopping` False / True / "never" as theirs).

Paging is what makes the beams cheap: the new beams taking over their group's rows is one
`pool.fork` of those rows onto themselves, so pages of a common prefix (the prompt's, and
whatever two beams share) are referenced, not copied; a partly filled last page is
copied once per extra beam that continues it (`own_last_page`: one vectorised copy
rather than the decode step's copy-on-write walk), and pruned beams' pages go back to
the free stack. Selection, the fork and the model's decode step all run on device,
`steps_per_call` steps per call; the host only reads which groups still run.
"""

from __future__ import annotations

import dataclasses
import math
import os
import time
from typing import NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jax_paged import pool as pool_lib
from jax_paged import sampling
from jax_paged.kernels import kv_quant
from jax_paged.kernels import validation
from jax_paged.kernels.validation import check_positive_int
from jax_paged.lora import LoraAdapter
from jax_paged.paged_model import PagedModel
from jax_paged.serving import runner as runner_lib
from jax_paged.serving.report import Report
from jax_paged.serving.request import Request, is_int, validate_requests

NEG = -1.0e9  # Hugging Face's "very large negative" score: excluded, yet finite
EARLY_STOPPING = (False, True, "never")


class Beam(NamedTuple):
  """A finished hypothesis: its new tokens (the stop token included when one ended it)
  and its score, the sum of their log-probabilities / len(tokens) ** length_penalty
  (Hugging Face's `sequences_scores`)."""
  tokens: list[int]
  score: float


class BeamState(NamedTuple):
  """A wave of G prompts' beam search on device (R = G x k pool rows, M =
  max_new_tokens). Hypotheses are kept best first."""
  logits: jax.Array        # float32 [R, V]: each row's next-token logits
  step: jax.Array          # int32 []: tokens generated so far
  scores: jax.Array        # float32 [G, k]: running beams' summed log-probabilities
  tokens: jax.Array        # int32 [G, k, M]: running beams' tokens
  done_scores: jax.Array   # float32 [G, k]: finished hypotheses' scores (NEG: none)
  done_tokens: jax.Array   # int32 [G, k, M]
  done_lengths: jax.Array  # int32 [G, k]
  is_done: jax.Array       # bool [G, k]: a finished hypothesis in that place
  running: jax.Array       # bool [G]: the group still decodes (Hugging Face's
                           # is_early_stop_heuristic_unsatisfied, and not yet full)
  min_free: jax.Array      # int32 []: the fewest free pages after any step
  decoded: jax.Array       # int32 []: beam tokens decoded (rows run, summed over steps)


@dataclasses.dataclass(frozen=True)
class BeamConfig:
  """The static settings of a beam search (hashable: part of the jitted loop's key)."""
  beam_width: int
  max_new_tokens: int
  length_penalty: float
  early_stopping: bool | str
  stop_ids: tuple[int, ...]
  min_new_tokens: int = 0

  @property
  def keep(self) -> int:
    """Continuations taken per group and step: enough that k run on even if the best
    k x (stop tokens) of them stop."""
    return max(2, 1 + len(self.stop_ids)) * self.beam_width


def initial_state(logits: jax.Array, valid: jax.Array, num_free: jax.Array,
                  config: BeamConfig) -> BeamState:
  """The state after prefill: logits float32 [G, V] of each prompt's last token, valid
  bool [G] (False: a padding group). Only beam 0 scores 0 (Hugging Face's -1e9 for the
  others), so the first step takes k distinct continuations of the prompt."""
  g, k, m = logits.shape[0], config.beam_width, config.max_new_tokens
  scores = jnp.full((g, k), NEG, jnp.float32).at[:, 0].set(0.0)
  return BeamState(
      logits=jnp.repeat(logits.astype(jnp.float32), k, axis=0),
      step=jnp.zeros((), jnp.int32), scores=scores,
      tokens=jnp.zeros((g, k, m), jnp.int32),
      done_scores=jnp.full((g, k), NEG, jnp.float32),
      done_tokens=jnp.zeros((g, k, m), jnp.int32),
      done_lengths=jnp.zeros((g, k), jnp.int32),
      is_done=jnp.zeros((g, k), bool), running=valid, min_free=num_free,
      decoded=jnp.zeros((), jnp.int32))


def select_beams(state: BeamState, config: BeamConfig) -> tuple[BeamState, jax.Array]:
  """One step of Hugging Face's beam search (`GenerationMixin._beam_search`: top-k
  continuations, running beams, finished beams, early-stop heuristic) from
  `state.logits`. Groups not running are left as they were.

  Returns (the new state, with `step` advanced and the running beams' tokens at the old
  step; int32 [G, k] each new beam's parent, an index into its group's old beams)."""
  g, k = state.scores.shape
  keep, t = config.keep, state.step
  logits, shift = state.logits, 0.0
  if config.min_new_tokens and config.stop_ids:
    # Hugging Face's MinNewTokensLengthLogitsProcessor: the stop tokens' log-probabilities
    # -inf until then, after the log-softmax (the others keep theirs: not renormalized).
    rows = logits.shape[0]
    banned = sampling.ban(logits, jnp.broadcast_to(jnp.asarray(config.stop_ids, jnp.int32),
                                                   (rows, len(config.stop_ids))),
                          jnp.broadcast_to(t < config.min_new_tokens, (rows,)))
    shift = (jax.nn.logsumexp(banned, axis=-1, keepdims=True)
             - jax.nn.logsumexp(logits, axis=-1, keepdims=True))
    logits = banned
  _, ids, logprobs = sampling.logprobs(logits, jnp.zeros(g * k, jnp.int32), keep)
  logprobs = logprobs + shift
  summed = (logprobs.reshape(g, k, keep) + state.scores[:, :, None]).reshape(g, k * keep)
  cand_scores, where = jax.lax.top_k(summed, keep)  # best first
  parents = where // keep
  cand_ids = jnp.take_along_axis(ids.reshape(g, k * keep), where, axis=1)
  cand_tokens = jnp.take_along_axis(state.tokens, parents[:, :, None], axis=1)
  cand_tokens = cand_tokens.at[:, :, t].set(cand_ids)
  stops = jnp.isin(cand_ids, jnp.asarray(config.stop_ids, jnp.int32)) if config.stop_ids \
      else jnp.zeros_like(cand_ids, bool)
  hits = stops | (t == config.max_new_tokens - 1)

  # The best k continuations that do not stop run on.
  run_scores, chosen = jax.lax.top_k(cand_scores + NEG * hits, k)
  run_tokens = jnp.take_along_axis(cand_tokens, chosen[:, :, None], axis=1)
  run_parents = jnp.take_along_axis(parents, chosen, axis=1)

  # Those that stop among the best k join the finished ones if among the group's best k.
  # (Hugging Face also bars additions once a group cannot improve or, with early_stopping
  # True, is full; such a group has stopped running here, and its state stays.)
  length = (t + 1).astype(jnp.float32)
  just = hits & (jnp.arange(keep) < k)[None, :]
  finished = cand_scores / length ** config.length_penalty + NEG * ~just
  merged = jnp.concatenate([state.done_scores, finished], axis=1)
  done_scores, best = jax.lax.top_k(merged, k)
  take = lambda old, new: jnp.take_along_axis(jnp.concatenate([old, new], axis=1),
                                              best if old.ndim == 2 else best[:, :, None],
                                              axis=1)
  done_tokens = take(state.done_tokens, cand_tokens)
  done_lengths = take(state.done_lengths, jnp.broadcast_to(t + 1, (g, keep)))
  is_done = take(state.is_done, just)

  # Hugging Face's early-stop heuristic, at the new length.
  if config.early_stopping == "never" and config.length_penalty > 0.0:
    best_length = float(config.max_new_tokens)
  else:
    best_length = length
  best_possible = run_scores[:, :1] / best_length ** config.length_penalty
  worst = jnp.where(is_done, jnp.min(done_scores, axis=1, keepdims=True), NEG)
  improvable = jnp.any(best_possible > worst, axis=1)
  full = jnp.all(is_done, axis=1) & (config.early_stopping is True)
  running = state.running & improvable & ~full & ~jnp.all(hits, axis=1)

  on = state.running
  pick = lambda new, old: jnp.where(on.reshape((g,) + (1,) * (new.ndim - 1)), new, old)
  new = state._replace(
      step=t + 1, scores=pick(run_scores, state.scores), tokens=pick(run_tokens, state.tokens),
      done_scores=pick(done_scores, state.done_scores),
      done_tokens=pick(done_tokens, state.done_tokens),
      done_lengths=pick(done_lengths, state.done_lengths), is_done=pick(is_done, state.is_done),
      running=running)
  return new, run_parents


def beam_loop(model: PagedModel, kv: pool_lib.KVPool, state: BeamState,
              adapters: jax.Array | None = None, *, config: BeamConfig, num_steps: int
              ) -> tuple[BeamState, pool_lib.KVPool]:
  """`num_steps` beam search steps over pool rows 0 .. R-1 (group g's beams in rows
  g x k ..): select, the new beams take over their parents' rows (`pool.fork` onto
  themselves), a finished group's rows are released, and the running rows decode their
  new tokens, which gives the next step's logits. Steps after every group finished
  change nothing. `adapters`: None, or each row's LoRA slot (int32 [R])."""
  g, k = state.scores.shape
  rows = np.arange(g * k, dtype=np.int32)
  first_row = jnp.asarray(rows.reshape(g, k)[:, :1])

  def step(_, carry):
    state, kv = carry
    was_running = state.running
    state, parents = select_beams(state, config)
    on = jnp.repeat(state.running, k)
    kv = pool_lib.fork(kv, (first_row + parents).reshape(-1), jnp.where(on, rows, -1),
                       own_last_page=True)
    ended = jnp.repeat(was_running & ~state.running, k)
    kv = pool_lib.release(kv, jnp.where(ended, rows, -1))
    tokens = state.tokens[:, :, state.step - 1].reshape(-1)
    logits, kv = runner_lib.decode_step(model, kv, tokens, rows, on, adapters=adapters)
    return state._replace(logits=logits, min_free=jnp.minimum(state.min_free, kv.num_free),
                          decoded=state.decoded + jnp.sum(on)), kv

  return jax.lax.fori_loop(0, num_steps, step, (state, kv))


_initial_state = jax.jit(initial_state, static_argnames="config")


def beam_search(model: PagedModel, prompts: Sequence[Sequence[int]], max_new_tokens: int,
                *, beam_width: int = 4, length_penalty: float = 1.0,
                early_stopping: bool | str = False, num_return_sequences: int = 1,
                eos_token_id: int | Sequence[int] | None = None, min_new_tokens: int = 0,
                page_size: int = 16,
                max_batch: int = 256, steps_per_call: int = 32, cache_dtype=None,
                mesh=None, lora: LoraAdapter | str | os.PathLike | None = None
                ) -> tuple[list[list[Beam]], Report]:
  """Beam search for each prompt: its `num_return_sequences` best hypotheses.

  The same search as Hugging Face's `generate(num_beams=beam_width, do_sample=False,
  length_penalty=, early_stopping=, num_return_sequences=, eos_token_id=,
  min_new_tokens=)` (no other logits processors), prompt by prompt (no padding), on the
  paged pool.

  Args:
    model: any model meeting `jax_paged.PagedModel`.
    prompts: token ids, one non-empty list per prompt; lengths may differ.
    max_new_tokens: the most new tokens per hypothesis (>= 1).
    beam_width: beams per prompt, in [1, 32] (k; the continuations taken per step,
      max(2, 1 + stop tokens) x k, must be at most 64).
    length_penalty: finished hypotheses score sum of log-probabilities / length **
      length_penalty (> 0 favours longer ones).
    early_stopping: False (stop a prompt when its best running beam, at its current
      length, cannot beat its worst finished one), True (as soon as it has beam_width
      finished hypotheses) or "never" (as False, at max_new_tokens' length when
      length_penalty > 0): Hugging Face's.
    num_return_sequences: hypotheses returned per prompt, in [1, beam_width].
    eos_token_id: None, or a stop token id (or a list of them): a beam generating one is
      finished (the token included).
    min_new_tokens: the stop tokens are barred (log-probability -inf) until a hypothesis
      has this many new tokens, in [0, max_new_tokens].
    page_size: tokens per KV page.
    max_batch: pool rows (beams) decoded together: prompts run in waves of
      max_batch // beam_width.
    steps_per_call: beam steps per device call (the host checks between calls whether
      every prompt of the wave finished).
    cache_dtype: the pool's dtype (default: the model's compute dtype).
    mesh: None for one device, or a tensor parallel mesh (see `jax_paged.Engine`).
    lora: None, or a LoRA adapter (a PEFT checkpoint directory, or a `LoraAdapter`) to
      search with: every beam runs under it (`jax_paged.lora`).

  Returns:
    (beams, report): beams[i] the best num_return_sequences `Beam`s of prompt i, best
    first; the report's peak_pages_in_use is the most pages a wave held, num_pages the
    pool's (sized for a wave whose beams never share a page past the prompt), and
    decode_tokens the beam rows decoded.
  """
  start = time.perf_counter()
  if lora is not None and not isinstance(lora, LoraAdapter):
    lora = LoraAdapter.load(lora)
  runner = runner_lib.ModelRunner(model, mesh, lora=None if lora is None else (1, lora.rank))
  if lora is not None:
    runner.load_adapter(0, lora)
  spec = runner.spec
  config = _check_settings(spec, beam_width, max_new_tokens, length_penalty, early_stopping,
                           num_return_sequences, eos_token_id, min_new_tokens)
  page_size = check_positive_int("page_size", page_size)
  max_batch = check_positive_int("max_batch", max_batch)
  steps_per_call = check_positive_int("steps_per_call", steps_per_call)
  if max_batch < beam_width:
    raise ValueError(f"max_batch must be >= beam_width = {beam_width} (one prompt's beams "
                     f"decode together), got {max_batch}")
  cache_dtype = validation.check_cache_dtype(
      "cache_dtype", spec.dtype if cache_dtype is None else cache_dtype)
  kv_quant.check_fp8_device(cache_dtype, "cache_dtype")
  if isinstance(prompts, Sequence) and not isinstance(prompts, (str, bytes)) and prompts \
      and all(isinstance(p, Sequence) for p in prompts):
    requests = [Request(list(p), max_new_tokens) for p in prompts]
  else:
    raise ValueError("prompts must be a non-empty list of non-empty token lists")
  max_pages_per_seq = -(-spec.max_positions // page_size)
  prompts = validate_requests(requests, spec, page_size=page_size,
                              max_pages=max_pages_per_seq, max_batch=max_batch)

  k = beam_width
  per_wave = max_batch // k
  waves = [list(range(i, min(i + per_wave, len(prompts))))
           for i in range(0, len(prompts), per_wave)]
  # A wave's most pages: each prompt's full pages shared, each beam's tail (the rest of
  # the prompt and max_new_tokens - 1 stored tokens) its own, and k - 1 more in flight (a
  # step's copies of last pages are taken before pruned beams' pages are freed).
  def worst(p: int) -> int:
    shared = p // page_size
    return shared + k * (-(-(p + max_new_tokens - 1) // page_size) - shared) + k - 1

  num_pages = max(sum(worst(len(prompts[i])) for i in wave) for wave in waves)
  kv = runner.create_pool(num_pages=num_pages, page_size=page_size, max_seqs=per_wave * k,
                          max_pages_per_seq=max_pages_per_seq, dtype=cache_dtype)
  report = Report(num_requests=len(prompts), num_pages=num_pages)
  num_steps = min(steps_per_call, max_new_tokens)
  # Every row under the adapter in slot 0, or no LoRA.
  adapters = None if lora is None else np.zeros((per_wave * k,), np.int32)
  beams: list[list[Beam]] = []
  for wave in waves:
    lengths = np.zeros((per_wave,), np.int32)
    lengths[:len(wave)] = [len(prompts[i]) for i in wave]
    tokens = np.zeros((per_wave, runner_lib.bucket(int(lengths.max()), 16)), np.int32)
    runner_lib.fill_rows(tokens, range(len(wave)), [prompts[i] for i in wave])
    seq_ids = np.where(np.arange(per_wave) < len(wave), np.arange(per_wave) * k, -1)
    logits, kv = runner.prefill(kv, tokens, np.maximum(lengths, 1), seq_ids.astype(np.int32),
                                adapters=adapters)
    report.prefill_calls += 1
    report.prompt_tokens += int(lengths.sum())
    state = _initial_state(logits, jnp.asarray(lengths > 0), kv.num_free, config=config)
    running = True
    while running:
      state, kv = runner.run(beam_loop, kv, state, adapters, config=config,
                             num_steps=num_steps)
      report.decode_calls += 1
      report.decode_steps += num_steps
      running = bool(jax.device_get(state.running).any())
    done_tokens, done_lengths, done_scores, min_free, decoded = jax.device_get(
        (state.done_tokens, state.done_lengths, state.done_scores, state.min_free,
         state.decoded))
    report.peak_pages_in_use = max(report.peak_pages_in_use, num_pages - int(min_free))
    report.decode_tokens += int(decoded)
    for g in range(len(wave)):
      beams.append([Beam(done_tokens[g, j, :done_lengths[g, j]].tolist(),
                         float(done_scores[g, j])) for j in range(num_return_sequences)])
    kv = runner.clear(kv)
  report.generated_tokens = sum(len(b.tokens) for hyps in beams for b in hyps)
  report.elapsed_s = time.perf_counter() - start
  return beams, report


def _check_settings(spec, beam_width, max_new_tokens, length_penalty, early_stopping,
                    num_return_sequences, eos_token_id, min_new_tokens) -> BeamConfig:
  """The search's settings checked (ValueError naming the argument) as a `BeamConfig`."""
  if not is_int(beam_width) or not 1 <= beam_width <= 32:
    raise ValueError(f"beam_width must be an int in [1, 32], got {beam_width!r}")
  if not is_int(max_new_tokens) or max_new_tokens < 1:
    raise ValueError(f"max_new_tokens must be an int >= 1, got {max_new_tokens!r}")
  if isinstance(length_penalty, bool) or not isinstance(length_penalty, (int, float)) \
      or not math.isfinite(length_penalty):
    raise ValueError(f"length_penalty must be a finite number, got {length_penalty!r}")
  if not any(early_stopping is v or (isinstance(v, str) and early_stopping == v)
             for v in EARLY_STOPPING):
    raise ValueError(f"early_stopping must be one of {EARLY_STOPPING}, got "
                     f"{early_stopping!r}")
  if not is_int(num_return_sequences) or not 1 <= num_return_sequences <= beam_width:
    raise ValueError(f"num_return_sequences must be an int in [1, beam_width={beam_width}], "
                     f"got {num_return_sequences!r}")
  stop_ids = () if eos_token_id is None else (
      (eos_token_id,) if is_int(eos_token_id) else tuple(eos_token_id)
      if isinstance(eos_token_id, Sequence) else None)
  if stop_ids is None or not all(is_int(s) and 0 <= s < spec.vocab_size for s in stop_ids):
    raise ValueError(f"eos_token_id must be None or token ids in [0, vocab_size="
                     f"{spec.vocab_size}), got {eos_token_id!r}")
  if not is_int(min_new_tokens) or not 0 <= min_new_tokens <= max_new_tokens:
    raise ValueError(f"min_new_tokens must be an int in [0, max_new_tokens="
                     f"{max_new_tokens}], got {min_new_tokens!r}")
  config = BeamConfig(int(beam_width), int(max_new_tokens), float(length_penalty),
                      early_stopping, tuple(sorted({int(s) for s in stop_ids})),
                      int(min_new_tokens))
  if config.keep > min(sampling.CHUNKED_TOP_K, spec.vocab_size):
    raise ValueError(f"beam_width x max(2, 1 + stop tokens) must be at most "
                     f"{min(sampling.CHUNKED_TOP_K, spec.vocab_size)}, got {config.keep} "
                     f"(beam_width {beam_width}, {len(stop_ids)} stop tokens)")
  return config
