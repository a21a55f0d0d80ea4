"""Next-token sampling on device: greedy, temperature, top-k, top-p (nucleus) and min-p;
logits processors before them (`add_bias`, `ban`, the repetition, frequency and presence
penalties of `penalize`); and the drawn tokens' log-probabilities (`logprobs`).

Everything is jittable and per row, so one batch can mix requests with different
settings: temperature 0 is greedy, top_k 0, top_p 1 and min_p 0 switch those filters off.
The order is Hugging Face's: temperature first, then top-k, then top-p on the tempered
distribution, then min-p (a token is kept if at least min_p times as likely as the most
likely one, which every filter keeps: a cut-off at the row's largest tempered logit plus
log(min_p), so it keeps a prefix of the ranking whatever the filters before it).

A token is drawn from the tempered logits in vocabulary order (Gumbel-max, `categorical`:
the argmax of the logits plus the key's Gumbel noise), with the tokens a filter drops
masked out, so a row draws the same token for the same key whether or not the batch
around it filters, and whichever way its filter is computed (`filter_by`):

* "sort": each filter is a cut-off value read from the row sorted (`filter_mask`), which
  on a GPU costs a good part of the model's decode step (H200, GPT-2's vocabulary at
  batch 128: 0.43 ms, the greedy step 0.8).
* "min_p" (min-p alone): the noisy argmax among the tokens at or above the cut-off.
* "rejection" (top-p, min-p): the noisy argmax among the tokens min-p keeps is the token
  drawn if it is in the nucleus, i.e. if the tokens strictly more likely than it hold
  less than p of the mass: one masked sum tells. If not, every token at most as likely is
  out, and the argmax over the tokens more likely is the next candidate (vLLM /
  FlashInfer's sorting-free top-p, on the draw's own noise, so the token is the sort's).
  A candidate is accepted with probability >= p, so `NUCLEUS_ROUNDS` rounds decide nearly
  every row; a batch with a row left undecided (or with top-k) sorts it as above, behind
  one `lax.cond`. 0.16-0.17 ms instead of the sort's 0.43 (H200, batch 128;
  benchmarks/LOG.md, "2026-11-26, seventh").
* "chunked" (top-k up to `CHUNKED_TOP_K`, with or without top-p): the top-k cut-off
  exactly from the row's chunks of `_CHUNK` tokens with the largest maxima
  (`top_k_cutoff`: a sort of ~2k values instead of the vocabulary), then the rounds
  above within it. Rows with a larger top_k go to the sort.
* None: no row filters; the plain draw.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

# Rejection rounds before a batch falls back to the sort. Per draw at batch 128 / 256 on
# an H200 (logits N(0, 1) or N(0, 16), top_p 0.9 / 0.95, temperature 0.8): 1 round 63 /
# 120 µs (the plain draw's 62 / 97), 2 rounds 100 / 187, 3 rounds 123-127 / 228-234 (every
# row decided in 97-100% of draws), 4 rounds 145-147 / 275-285; the `lax.cond` after them
# adds ~35-45 µs (its predicate goes to the host); the sort 432 / 727. A `while_loop` until
# every row is decided: 231-253 / 356-401 (a host round trip per round).
NUCLEUS_ROUNDS = 3

# The largest top_k that "chunked" takes, and its chunks' tokens. H200, the cut-off alone
# at batch 128 / 256 (the sort's filter mask 304-310 / 476 µs): 64 chunks of 32 tokens
# 52 / 92 µs, of 16 60-62 / 105-107, of 50 64 / 114-116; 256 chunks of 16 85-88 / 160-163.
CHUNKED_TOP_K = 64
_CHUNK = 32

FILTER_METHODS = (None, "min_p", "rejection", "chunked", "sort")

# The most alternatives `logprobs` returns per token for the serving layer (OpenAI's
# limit; `Request.top_logprobs`): a batch where a request asks computes this many.
MAX_TOP_LOGPROBS = 20


def greedy(logits: jax.Array) -> jax.Array:
  """int32 [B]: the argmax of float logits [B, V] (for all-greedy batches)."""
  return jnp.argmax(logits, axis=-1).astype(jnp.int32)


def _flip_negatives(bits: jax.Array) -> jax.Array:
  """int32 float bits <-> int32 keys in the floats' order (signed compare): flips the
  magnitude bits of negative floats, whose order runs backwards, and keeps the sign, so
  the map is its own inverse."""
  return bits ^ ((bits >> 31) & 0x7FFFFFFF)


def _descending(x: jax.Array) -> jax.Array:
  """float32 [B, n]: each row of x [B, n] sorted, largest first, as int32 keys in the
  floats' order (`_flip_negatives`), which XLA sorts faster than float32 (H200, 128 x 50257:
  0.42 vs 0.64 ms; 256 rows: 0.61 vs 1.38)."""
  keys = _flip_negatives(jax.lax.bitcast_convert_type(x, jnp.int32))
  return jax.lax.bitcast_convert_type(
      _flip_negatives(jnp.sort(keys, axis=-1)[:, ::-1]), jnp.float32)


def min_p_cutoff(tempered: jax.Array, min_p: jax.Array) -> jax.Array:
  """float32 [B, 1]: the least tempered logit min-p keeps of each row of tempered [B, V]:
  the row's largest plus log(min_p) (-inf where min_p is 0, off). A token's probability is
  at least min_p times the most likely one's exactly when its logit reaches this (Hugging
  Face's `MinPLogitsWarper` compares the probabilities; the two can differ on a token
  within float rounding of the cut-off)."""
  top = jnp.max(tempered, axis=-1, keepdims=True)
  return jnp.where(min_p[:, None] > 0, top + jnp.log(min_p)[:, None], -jnp.inf)


def filter_mask(tempered: jax.Array, top_k: jax.Array, top_p: jax.Array,
                min_p: jax.Array | None = None) -> jax.Array:
  """bool [B, V]: the tokens that top-k, then top-p, then min-p keep of tempered logits
  [B, V] (never a -inf one).

  Args:
    tempered: float32 [B, V], the logits divided by the temperature.
    top_k: int32 [B]: keep the k most likely tokens, and any tied with the k-th (as Hugging
      Face's top-k keeps them); 0 = off.
    top_p: float32 [B]: then keep the most likely tokens while the probability of those
      more likely (of what top-k kept) is short of p, and any tied with the last kept;
      1 = off.
    min_p: float32 [B] in [0, 1] or None: then keep the tokens at least min_p times as
      likely as the most likely (`min_p_cutoff`); 0 or None = off.

  Each filter is a cut-off value: only the values are sorted (`_descending`; not the
  indices, which would double the sort's cost) and a token is kept if it is at or above
  the cut-off.
  """
  v = tempered.shape[-1]
  ranked = _descending(tempered)
  k_cut = jnp.take_along_axis(ranked, jnp.clip(top_k - 1, 0, v - 1)[:, None], axis=-1)
  k_cut = jnp.where(top_k[:, None] > 0, k_cut, -jnp.inf)
  probs = jax.nn.softmax(jnp.where(ranked >= k_cut, ranked, -jnp.inf), axis=-1)
  # The most likely token always stays: nothing is before it.
  kept = jnp.sum(jnp.cumsum(probs, axis=-1) - probs < top_p[:, None], axis=-1)
  p_cut = jnp.take_along_axis(ranked, jnp.maximum(kept - 1, 0)[:, None], axis=-1)
  p_cut = jnp.where(top_p[:, None] < 1.0, p_cut, -jnp.inf)
  cut = jnp.maximum(k_cut, p_cut)
  if min_p is not None:
    cut = jnp.maximum(cut, min_p_cutoff(tempered, min_p))
  # (-inf logits, e.g. a padded vocabulary's, are never kept: they cannot be drawn.)
  return (tempered >= cut) & (tempered > -jnp.inf)


def filter_method(temperature: np.ndarray, top_k: np.ndarray, top_p: np.ndarray,
                  min_p: np.ndarray | float = 0.0) -> str | None:
  """On the host, the `filter_by` of a batch with these settings (numpy [B], as
  `sample_rows` takes them, or scalars for one row): None when no sampling row filters,
  "sort" when one filters by a top-k above `CHUNKED_TOP_K`, "chunked" when one filters by
  top-k, "rejection" when one by top-p, else "min_p" when one by min-p."""
  sampled = np.asarray(temperature) > 0
  top_k = np.asarray(top_k)[sampled]
  if (top_k > CHUNKED_TOP_K).any():
    return "sort"
  if (top_k > 0).any():
    return "chunked"
  if (np.asarray(top_p)[sampled] < 1).any():
    return "rejection"
  return "min_p" if (np.broadcast_to(min_p, sampled.shape)[sampled] > 0).any() else None


def _top_chunks(x: jax.Array, taken: int) -> tuple[jax.Array, jax.Array]:
  """The values of each row of x [B, V] in its `taken` chunks of `_CHUNK` tokens with the
  largest maxima (all its chunks if fewer), and their token ids: float32 / int32 [B,
  taken x _CHUNK] (a padded vocabulary's slots -inf).

  They hold the row's n largest values for any n <= taken: a value above the n-th largest
  outside them would make each of them hold one too, more than n - 1.
  """
  b, v = x.shape
  chunks = -(-v // _CHUNK)
  padded = jnp.pad(x, ((0, 0), (0, chunks * _CHUNK - v)), constant_values=-jnp.inf)
  padded = padded.reshape(b, chunks, _CHUNK)
  maxima = _flip_negatives(jax.lax.bitcast_convert_type(padded.max(axis=-1), jnp.int32))
  # Chunk indices by their maxima, descending (a sort of (key, index) pairs).
  _, order = jax.lax.sort((-maxima, jnp.broadcast_to(jnp.arange(chunks), (b, chunks))),
                          dimension=1, num_keys=1)
  order = order[:, :min(chunks, taken)]
  values = jnp.take_along_axis(padded, order[:, :, None], axis=1).reshape(b, -1)
  ids = (order[:, :, None] * _CHUNK + jnp.arange(_CHUNK)).reshape(b, -1)
  return values, ids.astype(jnp.int32)


def top_k_cutoff(tempered: jax.Array, top_k: jax.Array) -> jax.Array:
  """float32 [B, 1]: each row's top_k-th largest value of tempered [B, V] (-inf where
  top_k is 0), exact for top_k up to `CHUNKED_TOP_K` (or any, for a vocabulary of at most
  that many chunks): the top_k-th largest of the values in its CHUNKED_TOP_K chunks with
  the largest maxima (`_top_chunks`), a sort of CHUNKED_TOP_K x _CHUNK values.
  """
  values, _ = _top_chunks(tempered, CHUNKED_TOP_K)
  ranked = _descending(values)
  cut = jnp.take_along_axis(ranked, jnp.clip(top_k - 1, 0, ranked.shape[-1] - 1)[:, None],
                            axis=-1)
  return jnp.where(top_k[:, None] > 0, cut, -jnp.inf)


def logprobs(logits: jax.Array, tokens: jax.Array, n: int = 0
             ) -> tuple[jax.Array, jax.Array, jax.Array]:
  """Log-probabilities under float logits [B, V] (log softmax: the model's distribution,
  before temperature and filters, vLLM's "raw" logprobs), with one logsumexp per row:
  float32 [B] of each of tokens int [B]; and the n most likely tokens of each row, most
  likely first (ties by either token), and theirs: int32 / float32 [B, n], n (static) <=
  V and at most `CHUNKED_TOP_K` (OpenAI's top_logprobs). The top n come from the row's n
  chunks with the largest maxima (`_top_chunks`): H200, batch 128, n = 20: XLA's `top_k`
  over the vocabulary takes 0.50 ms, more than half a GPT-2 step."""
  if not 0 <= n <= min(CHUNKED_TOP_K, logits.shape[-1]):
    raise ValueError(f"n must be in [0, {min(CHUNKED_TOP_K, logits.shape[-1])}], got {n}")
  logits = logits.astype(jnp.float32)
  lse = jax.nn.logsumexp(logits, axis=-1, keepdims=True)
  picked = jnp.take_along_axis(logits, tokens[:, None].astype(jnp.int32), axis=-1)
  if n == 0:
    b = logits.shape[0]
    return (picked - lse)[:, 0], jnp.zeros((b, 0), jnp.int32), jnp.zeros((b, 0))
  values, ids = _top_chunks(logits, n)
  top, where = jax.lax.top_k(values, n)
  return (picked - lse)[:, 0], jnp.take_along_axis(ids, where, axis=-1), top - lse


def _row_ids(shape: tuple[int, int]) -> jax.Array:
  """int32 [B, K]: each entry's row, to scatter per-row ids [B, K] into [B, V]."""
  return jnp.broadcast_to(jnp.arange(shape[0])[:, None], shape)


def add_bias(logits: jax.Array, tokens: jax.Array, values: jax.Array) -> jax.Array:
  """float32 logits [B, V] with values float32 [B, K] added at tokens int32 [B, K]
  (OpenAI's logit_bias; padding entries add 0 to any token)."""
  return logits.astype(jnp.float32).at[_row_ids(tokens.shape), tokens].add(values)


def ban(logits: jax.Array, tokens: jax.Array, banned: jax.Array) -> jax.Array:
  """float32 logits [B, V] with -inf at each row's tokens int32 [B, S] (-1: padding)
  where banned bool [B] (vLLM's min_tokens: a row's stop tokens before its minimum)."""
  hit = banned[:, None] & (tokens >= 0)
  return logits.astype(jnp.float32).at[_row_ids(tokens.shape), jnp.maximum(tokens, 0)].min(
      jnp.where(hit, -jnp.inf, jnp.inf))


def token_counts(context: jax.Array, context_len: jax.Array, prompt_len: jax.Array,
                 vocab_size: int) -> tuple[jax.Array, jax.Array]:
  """What the penalties of `penalize` count, from each row's context (its prompt, then the
  tokens generated so far; right-padded, the padding ignored).

  Args:
    context: int32 [B, L]; context_len: int32 [B] (<= L); prompt_len: int32 [B] (<=
      context_len), the tokens of each context that are its prompt.
    vocab_size: (static) V.

  Returns:
    (int32 [B, V]: how often each token was generated; bool [B, V]: whether it is in the
    prompt).
  """
  b, width = context.shape
  position = jnp.arange(width)[None]
  generated = (position >= prompt_len[:, None]) & (position < context_len[:, None])
  rows = _row_ids(context.shape)
  # Padding adds 0 (generated) or nothing to the prompt's bits: its token ids do not matter.
  counts = jnp.zeros((b, vocab_size), jnp.int32).at[rows, context].add(
      generated.astype(jnp.int32))
  in_prompt = jnp.zeros((b, vocab_size), jnp.int32).at[rows, context].max(
      (position < prompt_len[:, None]).astype(jnp.int32))
  return counts, in_prompt > 0


def penalize(logits: jax.Array, counts: jax.Array, in_prompt: jax.Array,
             repetition: jax.Array, frequency: jax.Array, presence: jax.Array) -> jax.Array:
  """float32 logits [B, V] with vLLM's (and OpenAI's) penalties applied, before
  temperature and filters: a token in the prompt or generated has its logit divided by
  the row's `repetition` penalty where positive, multiplied where not (Hugging Face's
  `repetition_penalty`, CTRL's); then `frequency` times its count of generations and
  `presence` once if generated at all are subtracted.

  Args:
    logits: float [B, V]; counts: int32 [B, V] and in_prompt: bool [B, V], as
      `token_counts` gives them.
    repetition: float32 [B], > 0 (1: none); frequency, presence: float32 [B] (0: none).
  """
  logits = logits.astype(jnp.float32)
  seen = in_prompt | (counts > 0)
  r = repetition[:, None]
  logits = jnp.where(seen, jnp.where(logits > 0, logits / r, logits * r), logits)
  return (logits - frequency[:, None] * counts.astype(jnp.float32)
          - jnp.where(counts > 0, presence[:, None], 0.0))


def _sorted_draw(tempered: jax.Array, noisy: jax.Array, top_k: jax.Array,
                 top_p: jax.Array, min_p: jax.Array) -> jax.Array:
  """int32 [B]: the argmax of noisy [B, V] over the tokens `filter_mask` keeps."""
  kept = filter_mask(tempered, top_k, top_p, min_p)
  return jnp.argmax(jnp.where(kept, noisy, -jnp.inf), axis=-1).astype(jnp.int32)


def _nucleus_draw(tempered: jax.Array, noisy: jax.Array, top_k: jax.Array,
                  top_p: jax.Array, min_p: jax.Array, decided: jax.Array, chunked: bool
                  ) -> jax.Array:
  """int32 [B]: the argmax of noisy [B, V] (tempered [B, V] + the draw's Gumbel noise)
  over the tokens each row's top-k, then top-p, then min-p keep of tempered; `decided`:
  bool [B], rows whose token does not matter (greedy ones). By rejection rounds within
  the top-k and min-p cut-offs (`top_k_cutoff` when `chunked`; else rows with top_k are
  left to the sort); rows left undecided by `filter_mask`."""
  if chunked:
    in_top_k = tempered >= top_k_cutoff(tempered, top_k)
    valid = (top_k <= CHUNKED_TOP_K) | (-(-tempered.shape[-1] // _CHUNK) <= CHUNKED_TOP_K)
  else:
    in_top_k, valid = tempered > -jnp.inf, top_k <= 0
  # Masses relative to the row's largest term, so no exp overflows; of the top-k kept.
  terms = jnp.where(in_top_k, jnp.exp(tempered - jnp.max(tempered, axis=-1, keepdims=True)),
                    0.0)
  total = jnp.sum(terms, axis=-1)
  # Min-p keeps a prefix of the ranking, as the nucleus is: a candidate is drawn within it,
  # and the nucleus test below still weighs the mass top-k keeps (top-p before min-p).
  in_top_k_min_p = in_top_k & (tempered >= min_p_cutoff(tempered, min_p))
  # Candidates: the tokens both keep more likely than `floor` (at first all they keep).
  floor = jnp.full(top_p.shape + (1,), -jnp.inf, jnp.float32)
  token = jnp.zeros(top_p.shape, jnp.int32)
  undecided = ~decided
  for _ in range(NUCLEUS_ROUNDS):
    candidate = jnp.argmax(jnp.where(in_top_k_min_p & (tempered > floor), noisy, -jnp.inf),
                           axis=-1)
    candidate = candidate.astype(jnp.int32)
    value = jnp.take_along_axis(tempered, candidate[:, None], axis=-1)
    before = jnp.sum(jnp.where(tempered > value, terms, 0.0), axis=-1)
    # In the nucleus: those more likely hold less than p of what top-k keeps (the sort's
    # "mass before the token", ties kept alike); without top-p a row takes its first
    # candidate. A row whose top-k cut-off is not known here is never accepted.
    accepted = ((before < top_p * total) | (top_p >= 1.0)) & valid
    token = jnp.where(undecided, candidate, token)
    undecided &= ~accepted
    floor = jnp.where(undecided[:, None], value, floor)

  def sort(token):
    return jnp.where(undecided, _sorted_draw(tempered, noisy, top_k, top_p, min_p), token)

  return jax.lax.cond(jnp.any(undecided), sort, lambda token: token, token)


def _draw(logits: jax.Array, keys: jax.Array, temperature: jax.Array, top_k: jax.Array,
          top_p: jax.Array, min_p: jax.Array, filter_by: str | None) -> jax.Array:
  """int32 [B]: row b drawn with keys[b] (settings [B] as `sample` takes them)."""
  if filter_by not in FILTER_METHODS:
    raise ValueError(f"filter_by must be one of {FILTER_METHODS}, got {filter_by!r}")
  logits = logits.astype(jnp.float32)
  tempered = logits / jnp.where(temperature > 0, temperature, 1.0)[:, None]
  if filter_by is None:
    sampled = jax.vmap(jax.random.categorical)(keys, tempered).astype(jnp.int32)
  else:
    # `categorical`'s draw is the argmax of the logits plus this noise (checked in tests).
    noisy = tempered + jax.vmap(
        lambda key: jax.random.gumbel(key, tempered.shape[-1:], jnp.float32))(keys)
    if filter_by == "min_p":  # (no row filters by top-k or top-p)
      kept = tempered >= min_p_cutoff(tempered, min_p)
      sampled = jnp.argmax(jnp.where(kept, noisy, -jnp.inf), axis=-1).astype(jnp.int32)
    elif filter_by == "sort":
      sampled = _sorted_draw(tempered, noisy, top_k, top_p, min_p)
    else:
      sampled = _nucleus_draw(tempered, noisy, top_k, top_p, min_p, temperature <= 0,
                              chunked=filter_by == "chunked")
  return jnp.where(temperature > 0, sampled, greedy(logits))


def sample(logits: jax.Array, key: jax.Array, *, temperature=0.0, top_k=0,
           top_p=1.0, min_p=0.0, filter_by: str | None = "chunked") -> jax.Array:
  """Draws one token per row.

  Args:
    logits: float [B, V].
    key: a PRNG key; row i draws with `fold_in(key, i)`, so a row's draw does not depend
      on the batch around it.
    temperature: float scalar or [B]; 0 means greedy (argmax) for that row.
    top_k: int scalar or [B]; keep the k most likely tokens (0 = all), as `filter_mask`.
    top_p: float scalar or [B] in (0, 1]; keep the smallest set of most likely tokens whose
      probability reaches top_p (1 = all), as `filter_mask`.
    min_p: float scalar or [B] in [0, 1]; keep the tokens at least min_p times as likely
      as the most likely one (0 = all), as `filter_mask`.
    filter_by: (static) how the filters are computed (see above), the token being the
      same: None when no row filters (every top_k 0, top_p 1 and min_p 0); "min_p" when
      no row filters by top-k or top-p; "rejection", "chunked" or "sort", each right for
      any settings (a row one cannot decide goes to the sort), and fastest for rows with
      top-p (and min-p), with top-k up to CHUNKED_TOP_K, and with a larger top-k.
      `filter_method` picks on the host.

  Returns:
    int32 [B] token ids.
  """
  b = logits.shape[0]
  setting = lambda x, dtype: jnp.broadcast_to(jnp.asarray(x, dtype), (b,))
  keys = jax.vmap(lambda i: jax.random.fold_in(key, i))(jnp.arange(b))
  return _draw(logits, keys, setting(temperature, jnp.float32), setting(top_k, jnp.int32),
               setting(top_p, jnp.float32), setting(min_p, jnp.float32), filter_by)


def sample_rows(logits: jax.Array, seeds: jax.Array, index: jax.Array, temperature: jax.Array,
                top_k: jax.Array, top_p: jax.Array, min_p: jax.Array, *,
                all_greedy: bool = False, filter_by: str | None = "chunked") -> jax.Array:
  """The serving layer's sampling entry: int32 [B], row b drawn with its own key
  `fold_in(key(seeds[b]), index[b])`, so a request's draws depend only on its seed and
  how many tokens it has generated (not on the batch, its row or preemption).

  Args:
    logits: float [B, V].
    seeds: uint32 [B]; index: int32 [B] (the request's own token count).
    temperature: float32 [B]; top_k: int32 [B]; top_p, min_p: float32 [B]: as `sample`
      takes them.
    all_greedy: (static) every row is greedy: the argmax alone.
    filter_by: (static) as `sample`'s (`filter_method` of the settings).
  """
  if all_greedy:
    return greedy(logits)
  keys = jax.vmap(lambda s, i: jax.random.fold_in(jax.random.key(s), i))(seeds, index)
  return _draw(logits, keys, temperature, top_k, top_p, min_p, filter_by)
