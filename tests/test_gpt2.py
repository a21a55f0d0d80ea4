"""GPT-2 on the paged pool against Hugging Face transformers' PyTorch GPT-2 (CPU, f32).

Random-init HF models are saved with `save_pretrained` and loaded back through
`models.gpt2.from_pretrained`, so loading is tested along with the math.

Tolerance: logits are compared at 1e-4 absolute. Both sides compute in f32 and differ only
in summation order (fused qkv, softmax, paged vs contiguous keys); the observed gap is
~1e-6 on logits of magnitude ~1, while a wrong position, mask or page gives errors of
order the logits themselves.
"""

import dataclasses
import functools
import json

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers
from flax import nnx
from safetensors.numpy import load_file, save_file

import jax_paged
from jax_paged.serving.runner import ModelRunner, decode_step
from models import gpt2

PAGE = 8
HF_CONFIG = dict(vocab_size=300, n_positions=64, n_embd=128, n_layer=2, n_head=2,
                 initializer_range=0.1, bos_token_id=0, eos_token_id=0)


def _hf_model(seed: int, **overrides) -> transformers.GPT2LMHeadModel:
  torch.manual_seed(seed)
  config = transformers.GPT2Config(**{**HF_CONFIG, **overrides}, attn_implementation="eager")
  return transformers.GPT2LMHeadModel(config).eval()


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
  """(HF model, its save_pretrained directory)."""
  hf = _hf_model(seed=1234)
  path = tmp_path_factory.mktemp("gpt2")
  hf.save_pretrained(path)
  return hf, path


def _hf_last_logits(hf, tokens: list[int]) -> np.ndarray:
  with torch.no_grad():
    return hf(torch.tensor([tokens])).logits[0, -1].numpy()


def _padded(prompts: list[list[int]]) -> tuple[jax.Array, jax.Array]:
  width = max(map(len, prompts))
  tokens = np.zeros((len(prompts), width), np.int32)
  for i, p in enumerate(prompts):
    tokens[i, :len(p)] = p
  return jnp.asarray(tokens), jnp.asarray([len(p) for p in prompts], jnp.int32)


def _prompts(rng, lengths) -> list[list[int]]:
  return [rng.integers(1, HF_CONFIG["vocab_size"], n).tolist() for n in lengths]


def test_gelu_tanh_is_hf_gelu_new():
  """The sigmoid form equals HF's gelu_new (torch, f64) and jax's tanh GELU on fresh values
  of every magnitude, keeps bf16 inputs bf16, and saturates to x / -0 far out."""
  x = np.random.default_rng(0).standard_normal(4096).astype(np.float32) * np.logspace(
      -3, 3, 4096, dtype=np.float32)
  want = transformers.activations.NewGELUActivation()(torch.from_numpy(x).double()).numpy()
  got = np.asarray(gpt2.gelu_tanh(jnp.asarray(x)), np.float64)
  np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(got, jax.nn.gelu(jnp.asarray(x), approximate=True),
                             rtol=1e-5, atol=1e-6)
  assert gpt2.gelu_tanh(jnp.asarray(x, jnp.bfloat16)).dtype == jnp.bfloat16
  np.testing.assert_array_equal(gpt2.gelu_tanh(jnp.asarray([-1e4, 1e4], jnp.float32)),
                                [0.0, 1e4])


def test_prefill_and_decode_logits_match_hf(checkpoint):
  hf, path = checkpoint
  model = gpt2.from_pretrained(path)
  assert isinstance(model, jax_paged.PagedModel)
  steps = ModelRunner(model)
  rng = np.random.default_rng(0)
  seqs = _prompts(rng, [3, 8, 13])  # ends inside, at and past a page boundary
  kv = model.spec.create_pool(num_pages=16, page_size=PAGE, max_seqs=4, max_pages_per_seq=4)
  seq_ids = jnp.array([2, 0, 3], jnp.int32)
  tokens, lengths = _padded(seqs)
  logits, kv = steps.prefill(kv, tokens, lengths, seq_ids)
  for step in range(12):
    for i, seq in enumerate(seqs):
      np.testing.assert_allclose(logits[i], _hf_last_logits(hf, seq), atol=1e-4,
                                 err_msg=f"step {step} row {i}")
    # Random next tokens, not argmax: every step sees fresh inputs.
    nxt = rng.integers(1, HF_CONFIG["vocab_size"], len(seqs))
    seqs = [s + [int(t)] for s, t in zip(seqs, nxt)]
    logits, kv = steps.decode(kv, jnp.asarray(nxt, jnp.int32), seq_ids)
  np.testing.assert_array_equal(kv.lengths[seq_ids], [len(s) for s in seqs])


def test_greedy_decode_step_is_the_logits_argmax(checkpoint):
  _, path = checkpoint
  model = gpt2.from_pretrained(path)
  runner = ModelRunner(model)
  rng = np.random.default_rng(5)
  kv = model.spec.create_pool(num_pages=16, page_size=PAGE, max_seqs=4, max_pages_per_seq=4)
  seq_ids = jnp.array([1, 3, 0], jnp.int32)
  tokens, lengths = _padded(_prompts(rng, [4, 9, 16]))
  _, kv = runner.prefill(kv, tokens, lengths, seq_ids)
  nxt = jnp.asarray(rng.integers(1, HF_CONFIG["vocab_size"], 3), jnp.int32)
  # Not donated away: the same pool feeds both steps.
  step = jax.jit(functools.partial(decode_step, model),
                 static_argnames="greedy")
  logits, kv_logits = step(kv, nxt, seq_ids)
  greedy, kv_greedy = step(kv, nxt, seq_ids, greedy=True)
  assert greedy.dtype == jnp.int32
  np.testing.assert_array_equal(greedy, np.argmax(np.asarray(logits), -1))
  chex.assert_trees_all_equal(kv_greedy, kv_logits)


def test_greedy_generate_matches_hf(checkpoint):
  hf, path = checkpoint
  model = gpt2.from_pretrained(path)
  prompts = _prompts(np.random.default_rng(1), [1, 5, 8, 9, 17])
  new = 14  # every prompt crosses at least one page boundary while decoding
  ours = jax_paged.generate(model, prompts, new, page_size=PAGE)
  for prompt, got in zip(prompts, ours):
    with torch.no_grad():
      want = hf.generate(torch.tensor([prompt]), max_new_tokens=new, min_new_tokens=new,
                         do_sample=False, pad_token_id=0)[0, len(prompt):].tolist()
    assert got == want


def _hf_logprobs(hf, prompt: list[int], new: list[int]) -> torch.Tensor:
  """float64 [len(new), vocab]: log softmax of HF's logits for each new token."""
  with torch.no_grad():
    logits = hf(torch.tensor([prompt + new])).logits[0, len(prompt) - 1:-1]
  return torch.log_softmax(logits.double(), dim=-1)


def test_engine_logprobs_are_hf_log_softmax(checkpoint):
  """Request(logprobs=True): each token's log-probability, first token (prefill) and
  decode steps, is log_softmax of HF's logits for it, and its top_logprobs HF's most
  likely tokens and theirs, whether greedy (the logits path, not the fused greedy head)
  or sampled with filters, behind a cached prefix, chunked or as one of n samples; the
  tokens are those drawn without logprobs, and a request that did not ask gets None
  beside one that did."""
  hf, path = checkpoint
  model = gpt2.from_pretrained(path)
  rng = np.random.default_rng(8)
  system = _prompts(rng, [20])[0]
  prompts = [system + p for p in _prompts(rng, [3, 7])] + _prompts(rng, [5, 30, 2])
  # Request 0 asks for none: the first row of a prefill call whose second row asks.
  settings = [dict(logprobs=False), dict(temperature=0.8, top_p=0.9, seed=3, top_logprobs=5),
              dict(), dict(temperature=1.0, top_k=20, seed=4), dict(top_logprobs=20),
              dict(temperature=0.7, n=2, top_logprobs=1)]
  requests = [jax_paged.Request(p, 9, **{"logprobs": True, **kw})
              for p, kw in zip(prompts + [prompts[0]], settings)]

  def run(requests):
    # Prompts over 16 tokens prefill in chunks; the two system-prompt requests share it.
    eng = jax_paged.Engine(model, max_batch=6, num_pages=40, page_size=PAGE,
                           steps_per_call=4, max_prefill_tokens=16)
    events = []
    out, _ = eng.generate(requests, on_token=events.append)
    return out, events

  out, events = run(requests)
  plain, _ = run([dataclasses.replace(r, logprobs=False, top_logprobs=0) for r in requests])
  assert out == plain
  assert {(e.logprob, e.top_logprobs) for e in events if e.request_id == 0} == {(None, None)}
  for i, r in enumerate(requests):
    for j in range(r.n) if r.logprobs else ():
      tokens = out[i] if r.n == 1 else out[i][j]
      mine = [e for e in events if (e.request_id, e.sample) == (i, j)]
      assert [e.token for e in mine] == tokens
      want = _hf_logprobs(hf, r.prompt, tokens)
      np.testing.assert_allclose([e.logprob for e in mine],
                                 want[torch.arange(len(tokens)), tokens], atol=1e-4)
      if not r.top_logprobs:
        assert {e.top_logprobs for e in mine} == {None}
        continue
      values, ids = torch.topk(want, r.top_logprobs, dim=-1)
      assert [[t for t, _ in e.top_logprobs] for e in mine] == ids.tolist()
      np.testing.assert_allclose([[v for _, v in e.top_logprobs] for e in mine], values,
                                 atol=1e-4)


def test_engine_prompt_logprobs_are_hf_log_softmax(checkpoint):
  """Request(prompt_logprobs=True): each prompt token's log-probability given those before
  it is log_softmax of HF's logits, and with top_logprobs HF's most likely tokens there,
  on the first event of each sample only: for prompts prefilled in chunks, behind a
  system prompt cached by an earlier run (computed whole: the cache is not read for them,
  while a request beside them that does not ask reads it), with n = 2, a one-token prompt
  (nothing to score), beside requests that do not ask; the tokens are those generated
  without."""
  hf, path = checkpoint
  model = gpt2.from_pretrained(path)
  eng = jax_paged.Engine(model, max_batch=8, num_pages=60, page_size=PAGE, steps_per_call=4,
                         max_prefill_tokens=16)
  rng = np.random.default_rng(9)
  system = _prompts(rng, [20])[0]
  eng.generate([jax_paged.Request(system + [5], 2)])  # caches the system prompt's 2 pages
  prompts = [system + p for p in _prompts(rng, [3, 7, 30])] + _prompts(rng, [1, 12])
  settings = [dict(), dict(prompt_logprobs=True, top_logprobs=3),
              dict(prompt_logprobs=True, n=2, temperature=0.8, seed=2),
              dict(prompt_logprobs=True, logprobs=True),
              dict(prompt_logprobs=True, top_logprobs=20)]
  requests = [jax_paged.Request(p, 5, **kw) for p, kw in zip(prompts, settings)]
  events = []
  out, report = eng.generate(requests, on_token=events.append)
  assert report.cached_prompt_tokens == 2 * PAGE  # request 0's hit alone
  plain, _ = eng.generate([dataclasses.replace(r, prompt_logprobs=False, top_logprobs=0)
                           for r in requests])
  assert out == plain
  for i, r in enumerate(requests):
    for j in range(r.n):
      mine = [e for e in events if (e.request_id, e.sample) == (i, j)]
      assert all(e.prompt_logprobs is e.prompt_top_logprobs is None for e in mine[1:])
      got, top = mine[0].prompt_logprobs, mine[0].prompt_top_logprobs
      if not r.prompt_logprobs:
        assert got is top is None
        continue
      assert len(got) == len(r.prompt) and got[0] is None
      assert (top is None) == (not r.top_logprobs)
      if len(r.prompt) == 1:
        assert top in (None, (None,))
        continue
      with torch.no_grad():
        want = torch.log_softmax(hf(torch.tensor([r.prompt])).logits[0, :-1].double(), -1)
      np.testing.assert_allclose(got[1:], want[torch.arange(len(r.prompt) - 1),
                                               r.prompt[1:]], atol=1e-4)
      if top is not None:
        assert top[0] is None and all(len(t) == r.top_logprobs for t in top[1:])
        values, ids = torch.topk(want, r.top_logprobs, dim=-1)
        assert [[t for t, _ in step] for step in top[1:]] == ids.tolist()
        np.testing.assert_allclose([[v for _, v in step] for step in top[1:]], values,
                                   atol=1e-4)


def _penalized_greedy(hf, prompt: list[int], new: int, repetition: float,
                      frequency: float, presence: float) -> list[int]:
  """Greedy tokens from HF's logits with vLLM's penalties applied each step (numpy)."""
  out = []
  for _ in range(new):
    logits = _hf_last_logits(hf, prompt + out).astype(np.float64)
    counts = np.bincount(out, minlength=len(logits))
    seen = (counts > 0) | (np.bincount(prompt, minlength=len(logits)) > 0)
    r = np.where(seen, repetition, 1.0)
    logits = np.where(logits > 0, logits / r, logits * r)
    out.append(int(np.argmax(logits - frequency * counts - presence * (counts > 0))))
  return out


def test_engine_penalties_match_hf_repetition_penalty_and_vllms_formula(checkpoint):
  """Greedy requests with penalties: with repetition_penalty alone, Hugging Face's
  `generate(repetition_penalty=)`; with frequency and presence penalties, argmax of HF's
  logits penalized as vLLM does; behind a cached system prompt, chunked, as n = 2
  samples, beside a request without (its tokens those of a run without penalties)."""
  hf, path = checkpoint
  model = gpt2.from_pretrained(path)
  rng = np.random.default_rng(9)
  system = _prompts(rng, [20])[0]
  prompts = [system + p for p in _prompts(rng, [3, 6])] + _prompts(rng, [5, 30, 2, 4])
  settings = [dict(repetition_penalty=1.5), dict(repetition_penalty=0.8),
              dict(frequency_penalty=0.7), dict(presence_penalty=1.2, repetition_penalty=1.2),
              dict(frequency_penalty=-0.5, presence_penalty=2.0, n=2), dict()]
  new = 12
  requests = [jax_paged.Request(p, new, **kw) for p, kw in zip(prompts, settings)]
  eng = jax_paged.Engine(model, max_batch=6, num_pages=40, page_size=PAGE,
                         steps_per_call=4, max_prefill_tokens=16)
  out, _ = eng.generate(requests)
  plain, _ = eng.generate([jax_paged.Request(p, new) for p in prompts])
  assert out[-1] == plain[-1]
  changed = 0
  for i, r in enumerate(requests[:-1]):
    want = _penalized_greedy(hf, r.prompt, new, r.repetition_penalty, r.frequency_penalty,
                             r.presence_penalty)
    assert out[i] == (want if r.n == 1 else [want, want]), i
    changed += out[i] != plain[i]
    if r.frequency_penalty == r.presence_penalty == 0:
      with torch.no_grad():
        hf_out = hf.generate(torch.tensor([r.prompt]), max_new_tokens=new,
                             min_new_tokens=new, do_sample=False, pad_token_id=0,
                             repetition_penalty=r.repetition_penalty)
      assert out[i] == hf_out[0, len(r.prompt):].tolist(), i
  assert changed >= 3  # the penalties changed tokens


def test_engine_logit_bias_and_min_tokens_match_hf(checkpoint):
  """Greedy requests with logit_bias, min_tokens (a stop token the model generates early,
  banned until then) and a repetition penalty give Hugging Face's `generate` with
  `sequence_bias`, `min_new_tokens` / `eos_token_id` and `repetition_penalty` (HF applies
  them in the same order: the ban commutes with the penalty); ended by the stop token
  once allowed, which both include."""
  hf, path = checkpoint
  model = gpt2.from_pretrained(path)
  prompts = _prompts(np.random.default_rng(10), [4, 9, 17])
  new = 14
  eng = jax_paged.Engine(model, max_batch=4, num_pages=40, page_size=PAGE,
                         steps_per_call=4, max_prefill_tokens=16)
  plain, _ = eng.generate([jax_paged.Request(p, new) for p in prompts])
  for prompt, out, settings in zip(prompts, plain, [
      dict(logit_bias={7: 4.0, 100: -3.0}), dict(min_tokens=6, repetition_penalty=1.2),
      dict(logit_bias={5: 2.0, 6: 2.0}, min_tokens=5)]):
    stop = out[2]  # generated early: min_tokens bans it until then
    bias = settings.get("logit_bias", {})
    request = jax_paged.Request(prompt, new, stop_token_ids=(stop,), **settings)
    (got,), _ = eng.generate([request])
    with torch.no_grad():
      want = hf.generate(
          torch.tensor([prompt]), max_new_tokens=new, do_sample=False, pad_token_id=stop,
          eos_token_id=stop, min_new_tokens=request.min_tokens,
          repetition_penalty=request.repetition_penalty,
          sequence_bias={(t,): b for t, b in bias.items()} or None)[0, len(prompt):]
    assert got == want.tolist(), settings
    assert stop not in got[:request.min_tokens] and got != out
    if request.min_tokens:
      assert got[-1] == stop or len(got) == new


def _check_pool_consistent(kv: jax_paged.KVPool) -> set[int]:
  """Every page is owned by exactly one sequence or free; returns the owned pages."""
  used = np.asarray(kv.pages_used())
  table = np.asarray(kv.page_table)
  owned = [int(p) for s in range(kv.max_seqs) for p in table[s, :used[s]]]
  free = np.asarray(kv.free_pages)[:int(kv.num_free)].tolist()
  assert len(owned) == len(set(owned)), "a page is owned twice"
  assert sorted(owned + free) == list(range(kv.num_pages)), "pages lost or duplicated"
  return set(owned)


def test_pool_consistent_after_decoding_and_released_pages_reused(checkpoint):
  hf, path = checkpoint
  model = gpt2.from_pretrained(path)
  steps = ModelRunner(model)
  rng = np.random.default_rng(2)
  seqs = _prompts(rng, [6, 11, 2])
  # Exactly enough pages (2 + 2 + 1), so the second round must reuse the released ones.
  kv = model.spec.create_pool(num_pages=5, page_size=PAGE, max_seqs=3, max_pages_per_seq=3)
  ids = jnp.arange(3, dtype=jnp.int32)
  tokens, lengths = _padded(seqs)
  logits, kv = steps.prefill(kv, tokens, lengths, ids)
  for _ in range(5):
    nxt = np.asarray(jnp.argmax(logits, -1))
    seqs = [s + [int(t)] for s, t in zip(seqs, nxt)]
    logits, kv = steps.decode(kv, jnp.asarray(nxt, jnp.int32), ids)
  np.testing.assert_array_equal(kv.lengths, [11, 16, 7])
  before = _check_pool_consistent(kv)
  assert len(before) == 5

  released = set(np.asarray(kv.page_table)[[0, 1], :2].ravel().tolist())
  kv = jax_paged.pool.release(kv, jnp.array([0, 1]))
  _check_pool_consistent(kv)
  fresh = _prompts(rng, [15, 9])
  tokens, lengths = _padded(fresh)
  logits, kv = steps.prefill(kv, tokens, lengths, jnp.array([1, 0], jnp.int32))
  assert released <= _check_pool_consistent(kv)
  # Stale K/V in the reused pages must not leak into the new sequences.
  for i, seq in enumerate(fresh):
    np.testing.assert_allclose(logits[i], _hf_last_logits(hf, seq), atol=1e-4)
  nxt = np.asarray(jnp.argmax(logits, -1))
  logits, kv = steps.decode(kv, jnp.asarray(nxt, jnp.int32),
                            jnp.array([1, 0], jnp.int32))
  for i, seq in enumerate(fresh):
    np.testing.assert_allclose(logits[i], _hf_last_logits(hf, seq + [int(nxt[i])]),
                               atol=1e-4)
  np.testing.assert_array_equal(kv.lengths, [10, 16, 7])
  assert int(kv.num_free) == 0
  _check_pool_consistent(kv)


def test_decode_compiles_once_per_batch_capacity(checkpoint):
  _, path = checkpoint
  # A structure of its own, so that other tests' calls do not touch this jit cache.
  model = gpt2.from_pretrained(path, decode_impl="reference")
  steps = ModelRunner(model)
  jitted = steps.jitted
  kv = model.spec.create_pool(num_pages=32, page_size=PAGE, max_seqs=4, max_pages_per_seq=8)
  ids = jnp.arange(4, dtype=jnp.int32)
  tokens, lengths = _padded(_prompts(np.random.default_rng(3), [4, 9, 1, 16]))
  _, kv = steps.prefill(kv, tokens, lengths, ids)
  rng = np.random.default_rng(4)
  for step in range(20):  # lengths grow across pages; rows drop in and out
    active = jnp.asarray(rng.random(4) < 0.7)
    _, kv = steps.decode(kv, jnp.asarray(rng.integers(1, 300, 4), jnp.int32), ids,
                         active)
    assert jitted.decode._cache_size() == 1, f"recompiled at step {step}"
  assert jitted.prefill._cache_size() == 1


def test_from_pretrained_pytorch_bin_and_bf16(checkpoint, tmp_path):
  hf, _ = checkpoint
  torch.save(hf.state_dict(), tmp_path / "pytorch_model.bin")
  hf.config.to_json_file(tmp_path / "config.json")
  model = gpt2.from_pretrained(tmp_path)
  prompt = _prompts(np.random.default_rng(5), [7])[0]
  tokens, lengths = _padded([prompt])
  kv = model.spec.create_pool(num_pages=2, page_size=PAGE, max_seqs=1, max_pages_per_seq=2)
  logits, _ = ModelRunner(model).prefill(kv, tokens, lengths, jnp.array([0]))
  np.testing.assert_allclose(logits[0], _hf_last_logits(hf, prompt), atol=1e-4)

  half = gpt2.from_pretrained(tmp_path, dtype=jnp.bfloat16)
  assert all(x.dtype == jnp.bfloat16 for x in jax.tree.leaves(nnx.state(half)))
  out = jax_paged.generate(half, [prompt], 4, page_size=PAGE)
  assert len(out[0]) == 4


def test_from_pretrained_errors(checkpoint, tmp_path):
  _, path = checkpoint
  with pytest.raises(FileNotFoundError, match="config.json"):
    gpt2.from_pretrained(tmp_path)
  (tmp_path / "config.json").write_text((path / "config.json").read_text())
  with pytest.raises(FileNotFoundError, match="model.safetensors or pytorch_model.bin"):
    gpt2.from_pretrained(tmp_path)

  tensors = load_file(path / "model.safetensors")
  del tensors["transformer.h.1.mlp.c_fc.weight"]
  save_file(tensors, tmp_path / "model.safetensors")
  with pytest.raises(ValueError, match=r"'h\.1\.mlp\.c_fc\.weight' \(shape \(128, 512\)\) is "
                                       "missing"):
    gpt2.from_pretrained(tmp_path)

  config = json.loads((path / "config.json").read_text())
  config["n_positions"] = 32
  (tmp_path / "config.json").write_text(json.dumps(config))
  save_file(load_file(path / "model.safetensors"), tmp_path / "model.safetensors")
  with pytest.raises(ValueError, match=r"'wpe\.weight' has shape \(64, 128\), expected "
                                       r"\(32, 128\)"):
    gpt2.from_pretrained(tmp_path)


def test_generate_eos_sampling_and_argument_errors(checkpoint):
  _, path = checkpoint
  model = gpt2.from_pretrained(path)
  prompts = _prompts(np.random.default_rng(6), [3, 10])
  greedy = jax_paged.generate(model, prompts, 8, page_size=PAGE)
  eos = greedy[1][2]
  stopped = jax_paged.generate(model, prompts, 8, page_size=PAGE, eos_token_id=eos)
  for full, row in zip(greedy, stopped):
    cut = full.index(eos) + 1 if eos in full else len(full)
    assert row == full[:cut]

  kwargs = dict(page_size=PAGE, temperature=1.5, top_k=50, top_p=0.95)
  a = jax_paged.generate(model, prompts, 8, seed=1, **kwargs)
  assert a == jax_paged.generate(model, prompts, 8, seed=1, **kwargs)
  assert a != jax_paged.generate(model, prompts, 8, seed=2, **kwargs)
  assert all(0 <= t < HF_CONFIG["vocab_size"] for row in a for t in row)

  with pytest.raises(ValueError, match="n_positions=64"):
    jax_paged.generate(model, prompts, 60)
  with pytest.raises(ValueError, match="non-empty"):
    jax_paged.generate(model, [[1], []], 2)


@pytest.mark.gpu
def test_decode_with_triton_kernel_matches_reference_on_gpu(tmp_path):
  # head_dim 64: a shape the Triton kernel supports.
  hf = _hf_model(seed=7, n_embd=256, n_head=4, n_layer=3)
  hf.save_pretrained(tmp_path)
  prompts = _prompts(np.random.default_rng(8), [1, 8, 23, 40])
  with jax.default_matmul_precision("highest"):
    kernel = jax_paged.generate(gpt2.from_pretrained(tmp_path, decode_impl="kernel"), prompts,
                               24, page_size=16)
    ref = jax_paged.generate(gpt2.from_pretrained(tmp_path, decode_impl="reference"),
                             prompts, 24, page_size=16)
  assert kernel == ref
  for prompt, got in zip(prompts, kernel):
    with torch.no_grad():
      want = hf.generate(torch.tensor([prompt]), max_new_tokens=24, min_new_tokens=24,
                         do_sample=False, pad_token_id=0)[0, len(prompt):].tolist()
    assert got == want
