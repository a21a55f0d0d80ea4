"""Speculative decoding (prompt lookup): the drafts, the pool's truncation, and the engine
giving plain decoding's tokens with every request setting."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jax_paged import Engine, Guide, KVPool, NgramSpeculation, Request, Vocabulary, pool
from jax_paged.serving import speculative
from models import gpt2
from test_engine import compilations

CONFIG = gpt2.GPT2Config(vocab_size=97, n_positions=128, n_embd=32, n_layer=2, n_head=4,
                         bos_token_id=None, eos_token_id=None)


@pytest.fixture(scope="module")
def model():
  return gpt2.GPT2LMHeadModel(CONFIG, rngs=nnx.Rngs(7))


def reference_propose(history, allowance, k, min_n, max_n):
  """The drafts by plain Python: the tokens after the latest earlier occurrence of the
  longest suffix of length in [min_n, max_n] that occurred."""
  length = len(history)
  for n in range(max_n, min_n - 1, -1):
    for j in range(length - n - 1, -1, -1):
      if n <= length and history[j:j + n] == history[length - n:]:
        count = max(0, min(k, length - j - n, allowance - 1))
        return history[j + n:j + n + count]
  return []


@pytest.mark.parametrize("k,min_n,max_n", [(4, 2, 4), (3, 1, 1), (7, 1, 3)])
def test_propose_matches_a_python_reference(k, min_n, max_n):
  rng = np.random.default_rng(k + 10 * max_n)
  b, w = 64, 40
  # Small alphabets and pasted repeats, so that suffixes recur.
  histories = []
  for i in range(b):
    h = rng.integers(0, 2 + i % 5, rng.integers(0, 30)).tolist()
    if i % 3 == 0 and len(h) > 4:
      h += h[:rng.integers(1, len(h))]
    histories.append(h[:w])
  allowance = rng.integers(0, 9, b).astype(np.int32)
  padded = np.full((b, w), -7, np.int32)  # (garbage past each length)
  for i, h in enumerate(histories):
    padded[i, :len(h)] = h
  drafts, count = jax.jit(speculative.propose, static_argnames=(
      "num_tokens", "min_ngram", "max_ngram"))(
          jnp.asarray(padded), jnp.asarray([len(h) for h in histories], jnp.int32),
          jnp.asarray(allowance), num_tokens=k, min_ngram=min_n, max_ngram=max_n)
  drafts, count = np.asarray(drafts), np.asarray(count)
  assert drafts.shape == (b, k)
  found = 0
  for i, h in enumerate(histories):
    expected = reference_propose(h, int(allowance[i]), k, min_n, max_n)
    assert drafts[i, :count[i]].tolist() == expected, (i, h)
    found += bool(expected)
  assert found > b // 4  # (the test exercises matches)


def test_accepted_counts_leading_matches_within_the_count():
  targets = jnp.asarray([[1, 2, 3, 4], [1, 9, 3, 4], [5, 2, 3, 4], [1, 2, 3, 4]])
  drafts = jnp.asarray([[1, 2, 3], [1, 2, 3], [1, 2, 3], [1, 2, 3]])
  np.testing.assert_array_equal(
      speculative.accepted(targets, drafts, jnp.asarray([3, 3, 3, 2])), [3, 1, 0, 2])


def test_truncate_frees_the_pages_past_the_new_length_and_keeps_shared_ones():
  kv = KVPool.create(num_layers=1, num_kv_heads=1, head_dim=8, num_pages=12, page_size=4,
                     max_seqs=4, max_pages_per_seq=6)
  kv, _, ok = pool.reserve(kv, [0, 1], [10, 7])
  assert ok.all()
  kv = pool.fork(kv, 0, [2])  # sequence 2 shares 0's three pages
  before = np.asarray(kv.page_table).copy()
  kv, ok = pool.truncate(kv, jnp.asarray([0, 1, 3]), jnp.asarray([5, 7, 0]))
  np.testing.assert_array_equal(np.asarray(ok), [True, True, True])
  np.testing.assert_array_equal(np.asarray(kv.lengths), [5, 7, 10, 0])
  refs = np.asarray(kv.refcounts)
  # 0 keeps pages 0-1 (shared with 2: two references), its third page stays with 2 alone.
  assert refs[before[0, :2]].tolist() == [2, 2] and refs[before[0, 2]] == 1
  assert int(kv.num_free) == 12 - 5
  # Truncating 2 to 1 token frees its last two pages' references: page 1 stays (0 uses
  # it), the third page goes back.
  kv, ok = pool.truncate(kv, jnp.asarray([2]), jnp.asarray([1]))
  assert bool(ok[0]) and int(kv.num_free) == 12 - 4
  assert np.asarray(kv.refcounts)[before[0, 2]] == 0
  # Under jit: a length above the sequence's and a padding id are flagged, nothing moves.
  kv2, ok = jax.jit(pool.truncate)(kv, jnp.asarray([1, -1]), jnp.asarray([8, 0]))
  np.testing.assert_array_equal(np.asarray(ok), [False, False])
  for a, b in zip(jax.tree.leaves(kv2), jax.tree.leaves(kv)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_branch_free_reserve_serves_in_order_and_never_writes_a_shared_page():
  kv = KVPool.create(num_layers=1, num_kv_heads=1, head_dim=8, num_pages=5, page_size=4,
                     max_seqs=4, max_pages_per_seq=4)
  kv, _, _ = pool.reserve(kv, [0], [5])  # two pages, the second partly filled
  kv = pool.fork(kv, 0, [1])  # 1 shares it: its next token would need a copy
  reserve = jax.jit(functools.partial(pool.reserve, max_new_tokens=4, branch_free=True))
  kv, slots, ok = reserve(kv, jnp.asarray([2, 1, 3]), jnp.asarray([4, 1, 2]))
  np.testing.assert_array_equal(np.asarray(ok), [True, False, True])
  np.testing.assert_array_equal(np.asarray(kv.lengths), [5, 5, 4, 2])
  assert (np.asarray(slots[1]) == -1).all() and (np.asarray(slots[2, :2]) >= 0).all()
  assert int(kv.num_free) == 1 and np.asarray(kv.refcounts)[np.asarray(kv.page_table)[0, 1]] == 2
  # One page left: 2 gets it, 3 (needing one) fails after it, 0 (needing none) is served.
  kv, _, ok = reserve(kv, jnp.asarray([2, 3, 0]), jnp.asarray([1, 4, 0]))
  np.testing.assert_array_equal(np.asarray(ok), [True, False, True])
  assert int(kv.num_free) == 0


def test_truncate_rejects_bad_arguments():
  kv = KVPool.create(num_layers=1, num_kv_heads=1, head_dim=8, num_pages=4, page_size=4,
                     max_seqs=2, max_pages_per_seq=2)
  with pytest.raises(ValueError, match="num_tokens must be >= 0"):
    pool.truncate(kv, [0], [-1])
  with pytest.raises(ValueError, match=r"num_tokens must be an int array of shape \[1\]"):
    pool.truncate(kv, [0], [1, 2])
  with pytest.raises(ValueError, match="seq_ids must be in"):
    pool.truncate(kv, [5], [0])


def test_settings_are_validated():
  for kwargs, match in [(dict(num_tokens=0), "num_tokens"), (dict(num_tokens=16), "<= 15"),
                        (dict(min_ngram=3, max_ngram=2), "min_ngram"),
                        (dict(max_ngram=8, lookup_window=8), "lookup_window")]:
    with pytest.raises(ValueError, match=match):
      NgramSpeculation(**kwargs)
  assert NgramSpeculation.from_config(
      '{"method": "ngram", "num_speculative_tokens": 5, "prompt_lookup_max": 3}'
  ) == NgramSpeculation(num_tokens=5, min_ngram=2, max_ngram=3)
  assert NgramSpeculation.from_config(
      {"num_speculative_tokens": 2, "prompt_lookup_max": 1}).min_ngram == 1
  for config, match in [("{", "not JSON"), ("[1]", "JSON object"),
                        ({"method": "eagle", "num_speculative_tokens": 2}, "only \"ngram\""),
                        ({"prompt_lookup_max": 2}, "needs num_speculative_tokens"),
                        ({"num_speculative_tokens": 2, "draft_model": "x"}, "unknown keys")]:
    with pytest.raises(ValueError, match=match):
      NgramSpeculation.from_config(config)


def test_engine_refuses_speculation_without_every_position_logits(model):
  class DecodeOnly(nnx.Module):  # a PagedModel without prefill_hidden / logits
    def __init__(self, inner):
      self.inner = inner

    @property
    def spec(self):
      return self.inner.spec

    def prefill(self, *args, **kwargs):
      return self.inner.prefill(*args, **kwargs)

    def decode(self, *args, **kwargs):
      return self.inner.decode(*args, **kwargs)

  with pytest.raises(ValueError, match="prefill_hidden"):
    Engine(DecodeOnly(model), num_pages=8, speculation=NgramSpeculation())
  with pytest.raises(TypeError, match="NgramSpeculation"):
    Engine(model, num_pages=8, speculation={"num_speculative_tokens": 2})


def _events(eng: Engine, requests) -> dict:
  out = {}
  for e in eng.stream(requests):
    out.setdefault((e.request_id, e.sample), []).append(e)
  return out


def test_engine_gives_plain_decodings_tokens_with_every_setting(model):
  """Requests of every kind in one batch (greedy, sampled with top_p and log-probabilities,
  penalties and logit_bias, min_tokens with stop tokens, n = 2, a guide), prompts that
  repeat themselves (drafts found) and random ones, under a pool small enough to preempt:
  speculative decoding gives the tokens, finish reasons and log-probabilities of plain
  decoding, and keeps drafts."""
  rng = np.random.default_rng(3)
  vocab = Vocabulary(tuple(chr(33 + i).encode() for i in range(96)) + (None,), (96,))
  guide = Guide.from_regex(r"(ab|cd)+=[0-9]{1,6}", vocab)
  settings = [dict(), dict(stop_token_ids=[4, 50]),
              dict(temperature=1.0, seed=5, top_p=0.9, logprobs=True, top_logprobs=2),
              dict(temperature=0.7, seed=6, frequency_penalty=0.5, presence_penalty=0.3,
                   logit_bias={7: 2.0, 8: 1.5}),
              dict(min_tokens=10, stop_token_ids=[1, 2, 3]), dict(temperature=0.9, n=2, seed=2),
              dict(repetition_penalty=1.3), dict(guide=guide), dict(temperature=1.0, guide=guide)]
  requests = []
  for i in range(18):
    unit = rng.integers(0, 96, rng.integers(2, 6)).tolist()
    prompt = (unit * 8)[:rng.integers(8, 30)] if i % 2 else rng.integers(
        0, 96, rng.integers(1, 25)).tolist()
    requests.append(Request(prompt, int(rng.integers(10, 40)), **settings[i % len(settings)]))
  runs = []
  for speculation in (None, NgramSpeculation(num_tokens=3, min_ngram=1, max_ngram=3)):
    eng = Engine(model, max_batch=6, num_pages=22, page_size=8, steps_per_call=12,
                 speculation=speculation)
    runs.append((_events(eng, requests), eng.report))
    assert not np.asarray(eng.kv.lengths).any()
  (plain, plain_report), (spec, report) = runs
  assert plain.keys() == spec.keys() and len(plain) == 20
  for key in plain:
    assert [(e.token, e.finish_reason) for e in spec[key]] == [
        (e.token, e.finish_reason) for e in plain[key]], key
    if requests[key[0]].logprobs:
      np.testing.assert_allclose([e.logprob for e in spec[key]],
                                 [e.logprob for e in plain[key]], rtol=1e-4, atol=1e-5)
      assert [[t for t, _ in e.top_logprobs] for e in spec[key]] == [
          [t for t, _ in e.top_logprobs] for e in plain[key]]
  assert report.generated_tokens == plain_report.generated_tokens
  assert report.preemptions > 0
  assert 0 < report.accepted_tokens <= report.draft_tokens
  assert report.decode_steps < plain_report.decode_steps
  assert "speculative decoding:" in str(report)
  stats = eng.stats()
  assert (stats.draft_tokens, stats.accepted_tokens) == (report.draft_tokens,
                                                         report.accepted_tokens)


@pytest.mark.parametrize("drafts", ["ngram", "draft_model"])
def test_warmup_covers_speculative_decode_calls(drafts):
  """After warmup() an engine with speculation serves greedy and sampled batches of any
  size up to its slots without compiling: with prompt lookup its decode calls' history
  arrays have one width (the lookup window, at most the model's context, plus the steps
  per call); with a draft model (here the model itself) they have none."""
  config = gpt2.GPT2Config(vocab_size=89, n_positions=48, n_embd=16, n_layer=1, n_head=2,
                           bos_token_id=None, eos_token_id=None)
  model = gpt2.GPT2LMHeadModel(config, rngs=nnx.Rngs(4))
  speculation = (NgramSpeculation(num_tokens=2, min_ngram=1, max_ngram=2) if drafts == "ngram"
                 else speculative.DraftSpeculation(model, num_tokens=2))
  eng = Engine(model, max_batch=6, num_pages=200, page_size=8, steps_per_call=6,
               speculation=speculation)
  eng.warmup(max_prompt_tokens=16, sampling=("greedy", "sampled"))
  rng = np.random.default_rng(1)
  with compilations() as compiles:
    for n in (1, 4, 6):
      eng.generate([Request((rng.integers(0, 89, 3).tolist() * 5)[:rng.integers(2, 17)],
                            int(rng.integers(3, 20)), temperature=0.8 * (i % 2), seed=i)
                    for i in range(n)])
  assert not compiles and eng.report.accepted_tokens > 0


# ----------------------------------------------------------------- draft-model speculation

def _llama(layers: int, hidden: int, seed: int):
  """A random tiny Llama: GQA 4 q heads over 2 kv heads of 8 whatever its width."""
  from models import llama
  config = llama.LlamaConfig(vocab_size=97, hidden_size=hidden, intermediate_size=48,
                             num_hidden_layers=layers, num_attention_heads=4,
                             num_key_value_heads=2, head_dim=8, max_position_embeddings=128,
                             bos_token_id=None, eos_token_id=None, initializer_range=0.5)
  return llama.LlamaForCausalLM(config, rngs=nnx.Rngs(seed))


def _mixed_requests(rng, n: int) -> list[Request]:
  """Greedy and sampled requests (log-probabilities, penalties, n = 2, stop tokens),
  prompts sharing a cached prefix, one long enough to be prefilled in chunks."""
  shared = rng.integers(0, 97, 19).tolist()
  settings = [dict(), dict(temperature=1.0, seed=5, top_p=0.9, logprobs=True,
                           top_logprobs=2),
              dict(temperature=0.7, seed=6, frequency_penalty=0.5, logit_bias={7: 2.0}),
              dict(stop_token_ids=[4, 50]), dict(temperature=0.9, n=2, seed=2)]
  requests = []
  for i in range(n):
    prompt = (shared + rng.integers(0, 97, rng.integers(1, 9)).tolist() if i % 3 == 0
              else rng.integers(0, 97, 60 if i == 1 else rng.integers(1, 25)).tolist())
    requests.append(Request(prompt, int(rng.integers(10, 30)), **settings[i % len(settings)]))
  return requests


def _plain_and_drafted(target, draft, requests, num_tokens=3, **engine):
  runs = []
  for speculation in (None, speculative.DraftSpeculation(draft, num_tokens=num_tokens)):
    eng = Engine(target, max_batch=4, num_pages=14, page_size=8, steps_per_call=10,
                 max_prefill_tokens=32, speculation=speculation, **engine)
    runs.append((_events(eng, requests), eng))
    assert not np.asarray(eng.kv.lengths).any()
  return runs


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_draft_model_gives_plain_decodings_tokens(model, family):
  """A draft model of the same pool shape but other weights and depth (GPT-2 drafting for
  GPT-2, Llama for Llama): with prefix caching, chunked prefill and preemption in a small
  pool, greedy and sampled requests get plain decoding's tokens, finish reasons and
  log-probabilities; the pool holds both models' layers; the caller's draft is left as it
  was."""
  if family == "gpt2":
    target, draft = model, gpt2.GPT2LMHeadModel(gpt2.GPT2Config(
        vocab_size=97, n_positions=128, n_embd=32, n_layer=1, n_head=4, bos_token_id=None,
        eos_token_id=None), rngs=nnx.Rngs(8))
  else:
    target, draft = _llama(3, 48, 1), _llama(1, 24, 2)
  requests = _mixed_requests(np.random.default_rng(4), 10)
  (plain, _), (drafted, eng) = _plain_and_drafted(target, draft, requests)
  assert eng.kv.k_pages.shape[0] == target.spec.num_layers + draft.spec.num_layers
  assert draft.pool_layer_offset == 0
  assert plain.keys() == drafted.keys()
  for key in plain:
    assert [(e.token, e.finish_reason) for e in drafted[key]] == [
        (e.token, e.finish_reason) for e in plain[key]], key
    if requests[key[0]].logprobs:
      np.testing.assert_allclose([e.logprob for e in drafted[key]],
                                 [e.logprob for e in plain[key]], rtol=1e-4, atol=1e-5)
  report = eng.report
  assert report.preemptions > 0 and report.cached_prompt_tokens > 0
  assert report.draft_tokens > 0 and report.accepted_tokens <= report.draft_tokens


def test_a_draft_that_is_the_target_keeps_its_greedy_drafts():
  """The target as its own draft: its K/V, written by every forward (prompts attached to
  cached pages, chunks, preempted and recomputed sequences, forks), is the target's, so
  greedy rounds keep nearly every draft (f32: only near-ties between the decode and
  prefill paths' rounding could differ) and decode calls run far fewer rounds."""
  target = _llama(2, 32, 3)
  rng = np.random.default_rng(5)
  shared = rng.integers(0, 97, 21).tolist()
  requests = [Request(shared + rng.integers(0, 97, rng.integers(1, 6)).tolist()
                      if i % 2 else rng.integers(0, 97, 40 if i == 2 else 7).tolist(), 24)
              for i in range(8)]
  (plain, plain_eng), (drafted, eng) = _plain_and_drafted(target, target, requests,
                                                          num_tokens=4)
  assert drafted.keys() == plain.keys() and all(
      [e.token for e in drafted[k]] == [e.token for e in plain[k]] for k in plain)
  report = eng.report
  assert report.preemptions > 0 and report.cached_prompt_tokens > 0
  assert report.accepted_tokens >= 0.95 * report.draft_tokens > 0
  assert report.decode_steps < 0.5 * plain_eng.report.decode_steps


def test_draft_speculation_is_validated(model):
  other_heads = gpt2.GPT2LMHeadModel(gpt2.GPT2Config(
      vocab_size=97, n_positions=128, n_embd=32, n_layer=1, n_head=2, bos_token_id=None,
      eos_token_id=None), rngs=nnx.Rngs(1))
  other_vocab = gpt2.GPT2LMHeadModel(gpt2.GPT2Config(
      vocab_size=96, n_positions=128, n_embd=32, n_layer=1, n_head=4, bos_token_id=None,
      eos_token_id=None), rngs=nnx.Rngs(1))
  for draft, match in [(other_heads, r"draft model's num_kv_heads \(2\) must be the "
                                     r"target's \(4\)"),
                       (other_vocab, r"vocab_size \(96\) must be the target's \(97\)")]:
    with pytest.raises(ValueError, match=match):
      Engine(model, num_pages=8, speculation=speculative.DraftSpeculation(draft))
  bf16 = gpt2.GPT2LMHeadModel(CONFIG, dtype=jnp.bfloat16, rngs=nnx.Rngs(1))
  with pytest.raises(ValueError, match="dtype \\(bfloat16\\) must be the target's"):
    Engine(model, num_pages=8, speculation=speculative.DraftSpeculation(bf16))
  with pytest.raises(ValueError, match="does not run with LoRA adapters"):
    Engine(model, num_pages=8, max_loras=1, speculation=speculative.DraftSpeculation(model))
  for kwargs, error, match in [(dict(model=model, num_tokens=0), ValueError, "num_tokens"),
                               (dict(model=model, num_tokens=16), ValueError, "<= 15"),
                               (dict(model="gpt2"), TypeError, "PagedModel")]:
    with pytest.raises(error, match=match):
      speculative.DraftSpeculation(**kwargs)
  loaded = []
  spec = speculative.from_config('{"model": "dir", "num_speculative_tokens": 2}',
                                 lambda path: loaded.append(path) or model)
  assert (spec.num_tokens, spec.model, loaded) == (2, model, ["dir"])
  assert speculative.from_config({"method": "ngram", "num_speculative_tokens": 2}) == (
      NgramSpeculation(num_tokens=2))
  for config, match in [({"method": "draft_model", "num_speculative_tokens": 2}, "needs model"),
                        ({"model": "dir"}, "needs num_speculative_tokens"),
                        ({"model": "dir", "num_speculative_tokens": 2, "x": 1}, "unknown keys"),
                        ({"model": 3, "num_speculative_tokens": 2}, "checkpoint directory"),
                        ({"model": "dir", "num_speculative_tokens": 99},
                         "num_speculative_tokens must be <= 15"),
                        ({"method": "eagle", "num_speculative_tokens": 2}, "'eagle'")]:
    with pytest.raises(ValueError, match=match):
      speculative.from_config(config, lambda path: model)


@pytest.mark.gpu
def test_draft_model_on_gpu_kernels():
  """f32 on a GPU at head dim 64 (the Triton decode / prefill kernels reading the draft's
  layers after the target's), with prefix caching and chunked prefill: a Llama
  draft's rounds (greedy and sampled requests) and the target-as-draft's (greedy) give
  plain decoding's tokens, and the target as its own draft keeps nearly every draft."""
  from models import llama

  def make(layers, hidden, seed):
    return llama.LlamaForCausalLM(llama.LlamaConfig(
        vocab_size=512, hidden_size=hidden, intermediate_size=256, num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=2, head_dim=64, max_position_embeddings=256,
        bos_token_id=None, eos_token_id=None, initializer_range=0.3), rngs=nnx.Rngs(seed))

  target = make(3, 256, 0)
  mixed = _mixed_requests(np.random.default_rng(6), 10)
  greedy = [Request(r.prompt, r.max_new_tokens) for r in mixed]  # (sampled draws reject)
  for draft, requests in ((make(1, 128, 1), mixed), (target, greedy)):
    (plain, _), (drafted, eng) = _plain_and_drafted(target, draft, requests)
    assert all([e.token for e in drafted[k]] == [e.token for e in plain[k]] for k in plain)
    assert eng.report.cached_prompt_tokens > 0
    if draft is target:
      assert eng.report.accepted_tokens >= 0.95 * eng.report.draft_tokens > 0
