"""Generation requests, the events they produce, and their one validation."""

from __future__ import annotations

import array
import dataclasses
import numbers
from typing import Collection, Mapping, NamedTuple, Sequence

import numpy as np

from jax_paged.guided.guide import Guide
from jax_paged.paged_model import ModelSpec
from jax_paged.sampling import MAX_TOP_LOGPROBS


@dataclasses.dataclass(frozen=True)
class Request:
  """One generation request.

  Attributes:
    prompt: token ids (non-empty): a list, or a 1-D integer array (numpy or jax), which
      validation takes whole: ~4x faster than a list's Python ints (a burst of 256
      prompts of 832 tokens: 1.5 vs 5 ms on an H100 host, before its first token).
    max_new_tokens: the most tokens to generate (>= 1).
    temperature: 0 is greedy, otherwise the softmax temperature.
    top_k: keep the k most likely tokens (None = all).
    top_p: nucleus sampling mass in (0, 1] (None = all).
    min_p: keep the tokens at least this many times as likely as the most likely one, in
      [0, 1] (0 = all; applied after top-k and top-p, as Hugging Face's `min_p`).
    seed: this request's sampling seed, in [0, 2**32). Token i is drawn with the key
      `fold_in(key(seed), i)`, so a request's tokens do not depend on what runs beside it.
    stop_token_ids: tokens that end the request (included in its output), in addition to
      the engine's `eos_token_id`.
    stop: texts that end a sample once its generated text contains one (vLLM's stop
      strings; the engine's `detokenize` gives the text): the token completing the first
      is its last, with finish_reason 'stop' and `TokenEvent.stop_text` naming it (the
      text before it is the completion).
    n: samples of the prompt (parallel sampling): its prompt is prefilled once and the
      samples share its pages (`pool.fork`), each drawing with its own seed
      (`sample_seed(seed, j)`: sample 0 draws as a request with n = 1 would).
    arrival_s: the request is not admitted before this many seconds after the run starts
      (`Engine.generate` is called; a workload arriving over time; 0 = at once).
    logprobs: also return each new token's log-probability under the model's next-token
      distribution, log_softmax of its float32 logits, before temperature, top-k and
      top-p (vLLM's default "raw" logprobs; Hugging Face's `output_logits`, normalized):
      `TokenEvent.logprob`. A greedy request that asks runs its batch's calls through
      the logits rather than the fused greedy LM head (`linear.argmax_attend`), so in
      bf16 a near-tie may break differently, as beside a sampled request.
    top_logprobs: with `logprobs`, also this many most likely tokens at each step and
      their log-probabilities, most likely first (`TokenEvent.top_logprobs`; OpenAI's
      top_logprobs), 0 to `sampling.MAX_TOP_LOGPROBS`; with `prompt_logprobs`, at each
      prompt position too.
    prompt_logprobs: also return each prompt token's log-probability given the tokens
      before it (vLLM's prompt_logprobs, OpenAI's echo; raw, as `logprobs`): on the first
      event of each sample (`TokenEvent.prompt_logprobs`, None for the first token). Its
      prompt is computed whole, not read from the prefix cache (vLLM's rule: cached tokens
      have no logits), though its pages are cached for others; each prefill with such a
      request runs the LM head over its every token (its own compilations).
    prompt_logprobs_start: with `prompt_logprobs`, the first prompt position scored (those
      before it None): the full pages before position start - 1 may then come from
      the prefix cache (a request whose pages another admitted with it computes waits a
      call for them to be cached), as when scoring several continuations of one context
      (`guided_choice`); 0 (every position) to len(prompt) - 1.
    repetition_penalty: > 0; a token of the prompt or generated so far has its logit
      divided by it where positive, multiplied where not (Hugging Face's and vLLM's;
      1 = none, > 1 discourages repeating).
    frequency_penalty: in [-2, 2]; subtracted from a token's logit once per time it was
      generated (OpenAI's and vLLM's; 0 = none).
    presence_penalty: in [-2, 2]; subtracted from the logit of every token generated at
      least once (OpenAI's and vLLM's; 0 = none).
    logit_bias: token id -> a number in [-100, 100] added to its logit (OpenAI's
      logit_bias: -100 all but bans a token, 100 all but forces it); None = none.
    min_tokens: the fewest new tokens before a stop token (the eos, stop_token_ids) may
      end the request: until then their logits are -inf (vLLM's min_tokens); 0 to
      max_new_tokens.
      These logits processors apply in vLLM's order, logit_bias and min_tokens, then the
      penalties (`sampling.penalize`), before temperature, top-k and top-p, also for
      greedy requests; log-probabilities stay the model's. A batch with such a request
      runs them all (its own compilations; `Engine.warmup(logits_processors=True)`), and
      each of its calls sends the penalized requests' contexts to the device (shapes
      bucketed by the longest: a few more compilations).
    priority: with `Engine(scheduling_policy="priority")`, arrived requests are admitted
      lower value first (vLLM's convention), and a full pool preempts the lowest
      priority's newest sequence first; an int (0 under the default "fcfs" policy).
    guide: structured output (`jax_paged.guided.Guide`: a regular expression, a JSON
      schema or a choice of texts over the model's vocabulary): each token is drawn from
      those that keep the text a prefix of a match (the logits of the others -inf, after
      the logits processors; log-probabilities stay the model's); the end tokens only
      where the text is a whole match; the sample ends with finish_reason 'stop' once
      nothing may follow. The engine holds each guide's table on the device while a
      request uses it; a batch with a guided request samples through the logits (its own
      compilations).
    lora: the name of a LoRA adapter registered with the engine (`Engine.add_lora`) to
      run the request with, or None for the base model. Requests of different adapters
      (and none) share batches; they share cached prefix pages only with requests of the
      same adapter.
  """

  prompt: Sequence[int]
  max_new_tokens: int
  temperature: float = 0.0
  top_k: int | None = None
  top_p: float | None = None
  min_p: float = 0.0
  seed: int = 0
  stop_token_ids: Sequence[int] = ()
  stop: Sequence[str] = ()
  n: int = 1
  arrival_s: float = 0.0
  logprobs: bool = False
  top_logprobs: int = 0
  prompt_logprobs: bool = False
  prompt_logprobs_start: int = 0
  repetition_penalty: float = 1.0
  frequency_penalty: float = 0.0
  presence_penalty: float = 0.0
  logit_bias: Mapping[int, float] | None = None
  min_tokens: int = 0
  priority: int = 0
  guide: Guide | None = None
  lora: str | None = None

  @property
  def penalized(self) -> bool:
    """Whether any penalty applies."""
    return (self.repetition_penalty != 1.0 or self.frequency_penalty != 0.0
            or self.presence_penalty != 0.0)

  @property
  def processes_logits(self) -> bool:
    """Whether any logits processor applies (penalties, logit_bias, min_tokens)."""
    return self.penalized or bool(self.logit_bias) or self.min_tokens > 0


def sample_seed(seed: int, sample: int) -> int:
  """The sampling seed of sample `sample` of a request seeded `seed`: the seed itself for
  sample 0, else a mix of both (a 32-bit multiply-xorshift), so samples draw differently."""
  if sample == 0:
    return seed
  x = (seed ^ (sample * 0x9E3779B9)) & 0xFFFFFFFF
  x = ((x ^ (x >> 16)) * 0x85EBCA6B) & 0xFFFFFFFF
  x = ((x ^ (x >> 13)) * 0xC2B2AE35) & 0xFFFFFFFF
  return x ^ (x >> 16)


class TokenEvent(NamedTuple):
  """A token produced for sample `sample` of request `request_id` (its index in the
  submitted list). `finish_reason` is None while the sample goes on, else 'stop' or
  'length'. `logprob`: the token's log-probability (`Request.logprobs`), else None;
  `top_logprobs`: ((token, log-probability), ...) of the step's most likely tokens, most
  likely first (`Request.top_logprobs`), else None. `stop_text`: on a sample's last event,
  the `Request.stop` text its token completed (finish_reason 'stop'), else None.
  `prompt_logprobs` (on a sample's first event, with `Request.prompt_logprobs`; else
  None): each prompt token's log-probability given those before it, None for the first;
  `prompt_top_logprobs` (with top_logprobs too): each prompt position's most likely
  tokens as `top_logprobs`, None for the first.

  A named tuple: a busy engine makes one per token (4,096 per 16-step call of 256 rows),
  built in ~0.2 µs where a frozen dataclass of these nine fields took ~0.8 (dev CPU), and
  rebuilt from plain tuples on the far side of `EngineProcess`' pipe (benchmarks/LOG.md,
  "twenty-first")."""

  request_id: int
  token: int
  finish_reason: str | None
  sample: int = 0
  logprob: float | None = None
  top_logprobs: tuple[tuple[int, float], ...] | None = None
  prompt_logprobs: tuple[float | None, ...] | None = None
  prompt_top_logprobs: tuple[tuple[tuple[int, float], ...] | None, ...] | None = None
  stop_text: str | None = None


def is_int(x) -> bool:
  """A Python or numpy integer, not a bool."""
  # A plain int first: the ABC check costs ~1 µs, three per request.
  return type(x) is int or (isinstance(x, numbers.Integral) and not isinstance(x, bool))


def _is_real(x) -> bool:
  """A Python or numpy real number, not a bool."""
  return isinstance(x, numbers.Real) and not isinstance(x, (bool, np.bool_))


def _token_ids(prompt) -> np.ndarray | None:
  """A prompt as a 1-D integer array, or None if it is not a flat sequence of integers.

  A list goes through `array.array`, which converts Python ints in C and refuses floats
  and other non-integers: half the time of `np.asarray`'s dtype discovery (~25 vs ~50 µs
  for 832 tokens; validation is paid by every `generate` call before the GPU starts).
  An array (numpy, jax) is converted whole: element by element, a jax array would copy
  each token from its device on its own.
  """
  if hasattr(prompt, "__array__"):
    prompt = np.asarray(prompt)
    return prompt if prompt.ndim == 1 and prompt.dtype.kind in "iu" else None
  try:
    return np.frombuffer(array.array("q", prompt), np.int64)
  except (TypeError, OverflowError):
    return None


def validate_requests(requests: Sequence[Request], spec: ModelSpec, *, page_size: int,
                      max_pages: int, max_batch: int, first_id: int = 0,
                      scores_prompts: bool = True, detokenizes: bool = False,
                      prioritizes: bool = False, loras: Collection[str] = ()
                      ) -> list[np.ndarray]:
  """Raises ValueError, naming the request and the field, for anything the engine cannot
  serve as asked; returns the prompts as int32 arrays [prompt tokens].

  Args:
    requests: the requests; messages name them by id, `first_id` for the first.
    spec: the model's (vocabulary and context limit).
    page_size: tokens per page.
    max_pages: the most pages one sequence can hold (the pool's pages, at most its page
      table's width).
    max_batch: the engine's slots (a request's n samples run together).
    scores_prompts: whether the model gives prompt log-probabilities
      (`paged_model.offers_prompt_logprobs`).
    detokenizes: whether the engine turns tokens into text (`Request.stop`).
    prioritizes: whether the engine schedules by `Request.priority` (else it must be 0).
    loras: the LoRA adapters registered with the engine (`Request.lora` names one).
  """
  if isinstance(requests, Request):
    raise ValueError("requests must be a non-empty list of Request, got one Request: pass "
                     "[request]")
  if not isinstance(requests, Sequence) or not requests:
    raise ValueError("requests must be a non-empty list of Request")
  prompts = []
  for i, r in enumerate(requests, first_id):
    if not isinstance(r, Request):
      raise ValueError(f"request {i}: expected a jax_paged.Request, got {type(r).__name__}")
    prompt = _token_ids(r.prompt)
    if prompt is None:
      got = np.asarray(r.prompt, dtype=object)
      raise ValueError(f"request {i}: prompt must be a flat list of integer token ids "
                       f"(int64), got {type(r.prompt).__name__} of shape {got.shape}")
    if prompt.size == 0:
      raise ValueError(f"request {i}: prompt is empty")
    bad = prompt[(prompt < 0) | (prompt >= spec.vocab_size)]
    if bad.size:
      raise ValueError(f"request {i}: token ids {bad[:5].tolist()} outside [0, vocab_size="
                       f"{spec.vocab_size})")
    if not is_int(r.max_new_tokens) or r.max_new_tokens < 1:
      raise ValueError(f"request {i}: max_new_tokens must be an int >= 1, got "
                       f"{r.max_new_tokens!r}")
    # (also NaN; an infinite one would turn a -inf logit, e.g. a padded vocabulary's, NaN)
    if not 0 <= r.temperature < float("inf"):
      raise ValueError(f"request {i}: temperature must be a finite number >= 0, got "
                       f"{r.temperature}")
    if r.top_k is not None and (not is_int(r.top_k) or r.top_k < 1):
      raise ValueError(f"request {i}: top_k must be an int >= 1 or None, got {r.top_k!r}")
    if r.top_p is not None and not 0.0 < r.top_p <= 1.0:
      raise ValueError(f"request {i}: top_p must be in (0, 1], got {r.top_p}")
    if not (_is_real(r.min_p) and 0.0 <= r.min_p <= 1.0):
      raise ValueError(f"request {i}: min_p must be a number in [0, 1], got {r.min_p!r}")
    if not is_int(r.seed) or not 0 <= r.seed < 2 ** 32:
      raise ValueError(f"request {i}: seed must be an int in [0, 2**32), got {r.seed!r}")
    if len(r.stop_token_ids):
      if not all(is_int(t) for t in r.stop_token_ids):
        raise ValueError(f"request {i}: stop_token_ids must be integer token ids, got "
                         f"{list(r.stop_token_ids)!r}")
      bad = [int(t) for t in r.stop_token_ids if not 0 <= t < spec.vocab_size]
      if bad:  # never generated: likely another tokenizer's ids
        raise ValueError(f"request {i}: stop_token_ids {bad[:5]} outside [0, vocab_size="
                         f"{spec.vocab_size})")
    if isinstance(r.stop, str) or not isinstance(r.stop, Sequence) or not all(
        isinstance(t, str) and t for t in r.stop):
      raise ValueError(f"request {i}: stop must be a list of non-empty texts, got "
                       f"{r.stop!r}")
    if len(r.stop) and not detokenizes:
      raise ValueError(f"request {i}: stop texts need the engine's detokenize (token ids "
                       f"-> text): Engine(model, detokenize=tokenizer.decode)")
    if not is_int(r.n) or not 1 <= r.n <= max_batch:
      raise ValueError(f"request {i}: n must be an int in [1, max_batch={max_batch}] (its "
                       f"samples run together), got {r.n!r}")
    if not isinstance(r.logprobs, (bool, np.bool_)):
      raise ValueError(f"request {i}: logprobs must be True or False, got {r.logprobs!r}")
    if not is_int(r.top_logprobs) or not 0 <= r.top_logprobs <= MAX_TOP_LOGPROBS:
      raise ValueError(f"request {i}: top_logprobs must be an int in [0, "
                       f"{MAX_TOP_LOGPROBS}], got {r.top_logprobs!r}")
    if not isinstance(r.prompt_logprobs, (bool, np.bool_)):
      raise ValueError(f"request {i}: prompt_logprobs must be True or False, got "
                       f"{r.prompt_logprobs!r}")
    if not is_int(r.prompt_logprobs_start) or not (
        0 <= r.prompt_logprobs_start < prompt.size):
      raise ValueError(f"request {i}: prompt_logprobs_start must be an int in [0, "
                       f"len(prompt) - 1 = {prompt.size - 1}], got {r.prompt_logprobs_start!r}")
    if r.prompt_logprobs_start and not r.prompt_logprobs:
      raise ValueError(f"request {i}: prompt_logprobs_start={r.prompt_logprobs_start} needs "
                       "prompt_logprobs=True")
    if r.top_logprobs and not (r.logprobs or r.prompt_logprobs):
      raise ValueError(f"request {i}: top_logprobs={r.top_logprobs} needs logprobs=True or "
                       "prompt_logprobs=True")
    if r.prompt_logprobs and not scores_prompts:
      raise ValueError(f"request {i}: prompt_logprobs=True needs a model with "
                       "prefill_hidden and logits (jax_paged.PagedModel's optional methods); "
                       "this engine's model has not both")
    if not (_is_real(r.repetition_penalty)
            and 0.0 < r.repetition_penalty < float("inf")):  # also NaN
      raise ValueError(f"request {i}: repetition_penalty must be a finite number > 0 (1: "
                       f"none), got {r.repetition_penalty!r}")
    for name in ("frequency_penalty", "presence_penalty"):
      value = getattr(r, name)
      if not (_is_real(value) and -2.0 <= value <= 2.0):
        raise ValueError(f"request {i}: {name} must be a number in [-2, 2] (0: none), got "
                         f"{value!r}")
    if r.logit_bias is not None:
      if not isinstance(r.logit_bias, Mapping):
        raise ValueError(f"request {i}: logit_bias must be a mapping of token ids to "
                         f"numbers, got {type(r.logit_bias).__name__}")
      for token, bias in r.logit_bias.items():
        if not (is_int(token) and 0 <= token < spec.vocab_size):
          raise ValueError(f"request {i}: logit_bias token {token!r} is not a token id in "
                           f"[0, vocab_size={spec.vocab_size})")
        if not (_is_real(bias) and -100.0 <= bias <= 100.0):
          raise ValueError(f"request {i}: logit_bias[{token}] must be a number in "
                           f"[-100, 100], got {bias!r}")
    if not is_int(r.min_tokens) or not 0 <= r.min_tokens <= r.max_new_tokens:
      raise ValueError(f"request {i}: min_tokens must be an int in [0, max_new_tokens="
                       f"{r.max_new_tokens}], got {r.min_tokens!r}")
    if not is_int(r.priority):
      raise ValueError(f"request {i}: priority must be an int, got {r.priority!r}")
    if r.priority and not prioritizes:
      raise ValueError(f"request {i}: priority {r.priority} needs the engine's priority "
                       "scheduling: Engine(..., scheduling_policy=\"priority\")")
    if r.guide is not None:
      if not isinstance(r.guide, Guide):
        raise ValueError(f"request {i}: guide must be a jax_paged.guided.Guide or None, got "
                         f"{type(r.guide).__name__}")
      if r.guide.vocab_size > spec.vocab_size:
        raise ValueError(f"request {i}: guide's vocabulary has {r.guide.vocab_size} tokens, "
                         f"more than the model's vocab_size={spec.vocab_size}: it was built "
                         "for another tokenizer")
    if r.lora is not None and (not isinstance(r.lora, str) or r.lora not in loras):
      served = (f"the engine's adapters are {sorted(loras)}" if loras else
                "the engine has none (Engine(max_loras=...), then add_lora)")
      raise ValueError(f"request {i}: lora {r.lora!r} is not a registered LoRA adapter; "
                       f"{served}")
    if not 0.0 <= r.arrival_s < float("inf"):  # also NaN
      raise ValueError(f"request {i}: arrival_s must be a finite number >= 0, got "
                       f"{r.arrival_s!r}")
    # The newest token is never cached: a request holds prompt + max_new_tokens - 1.
    longest = prompt.size + r.max_new_tokens - 1
    if longest > spec.max_positions:
      raise ValueError(f"request {i}: prompt of {prompt.size} tokens + {r.max_new_tokens} "
                       f"new tokens exceeds the model's n_positions={spec.max_positions}")
    pages = -(-longest // page_size)
    if pages > max_pages:
      raise ValueError(f"request {i}: needs {pages} pages of {page_size} tokens but the "
                       f"pool holds {max_pages}: the pool is too small for this request")
    prompts.append(prompt.astype(np.int32))
  return prompts
