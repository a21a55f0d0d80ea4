"""Any model meeting `jax_paged.PagedModel` is served: a small GQA model that is not GPT-2,
its decode over the pool against recomputing every prefix from scratch."""

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import jax_paged
from jax_paged import nn
from jax_paged.paged_model import offers_prompt_logprobs
from jax_paged.serving.runner import ModelRunner
from tests.test_engine import assert_pages_back

VOCAB, MAX_POSITIONS, LAYERS, KV_HEADS, HEAD_DIM = 61, 48, 2, 2, 8


class TinyGQA(nnx.Module):
  """Token + position embeddings, attention-only residual blocks with 4 q heads over 2 kv
  heads (`nn.PagedAttention`), an untied LM head."""

  def __init__(self, rngs: nnx.Rngs):
    dim = 32
    self.embed = nnx.Embed(VOCAB, dim, rngs=rngs)
    self.positions = nnx.Embed(MAX_POSITIONS, dim, rngs=rngs)
    self.blocks = nnx.List([nn.PagedAttention(dim, 4, HEAD_DIM, num_kv_heads=KV_HEADS,
                                              rngs=rngs) for _ in range(LAYERS)])
    self.head = nnx.Linear(dim, VOCAB, rngs=rngs)

  @property
  def spec(self) -> jax_paged.ModelSpec:
    return jax_paged.ModelSpec(num_layers=LAYERS, num_kv_heads=KV_HEADS, head_dim=HEAD_DIM,
                               vocab_size=VOCAB, max_positions=MAX_POSITIONS,
                               dtype=jnp.float32)

  def prefill(self, tokens, kv, slots, lengths, *, start=None, page_table=None):
    b, t = tokens.shape
    offset = 0 if start is None else start[:, None]
    x = self.embed(tokens) + self.positions(jnp.arange(t)[None] + offset)
    for layer, block in enumerate(self.blocks):
      y, kv = block.prefill(x, kv, layer, slots, lengths, start=start, page_table=page_table)
      x = x + y
    return self.head(x[jnp.arange(b), lengths - 1]), kv

  def decode(self, tokens, positions, kv, slots, page_table, lengths, *, greedy=False):
    x = self.embed(tokens) + self.positions(positions)
    for layer, block in enumerate(self.blocks):
      y, kv = block.decode(x, kv, layer, slots, page_table, lengths)
      x = x + y
    logits = self.head(x)
    return (jnp.argmax(logits, -1).astype(jnp.int32) if greedy else logits), kv


@pytest.fixture(scope="module")
def model():
  return TinyGQA(nnx.Rngs(3))


def _recomputed_logits(runner: ModelRunner, sequence: list[int]) -> np.ndarray:
  """The last token's logits from a prefill of the whole sequence into a fresh pool."""
  kv = runner.create_pool(num_pages=8, page_size=8, max_seqs=1, max_pages_per_seq=8)
  logits, _ = runner.prefill(kv, jnp.asarray([sequence], jnp.int32),
                             jnp.asarray([len(sequence)], jnp.int32), jnp.array([0]))
  return np.asarray(logits[0])


def test_meets_the_protocol_and_decode_logits_match_recomputation(model):
  assert isinstance(model, jax_paged.PagedModel)
  runner = ModelRunner(model)
  rng = np.random.default_rng(0)
  seqs = [rng.integers(0, VOCAB, n).tolist() for n in (3, 8, 13)]  # page ends 8, 16
  kv = runner.create_pool(num_pages=16, page_size=8, max_seqs=3, max_pages_per_seq=6)
  width = max(map(len, seqs))
  tokens = np.zeros((3, width), np.int32)
  for i, s in enumerate(seqs):
    tokens[i, :len(s)] = s
  ids = jnp.array([2, 0, 1], jnp.int32)
  logits, kv = runner.prefill(kv, tokens, np.array([len(s) for s in seqs], np.int32), ids)
  for step in range(10):
    for i, s in enumerate(seqs):
      np.testing.assert_allclose(logits[i], _recomputed_logits(runner, s), rtol=1e-5,
                                 atol=1e-5, err_msg=f"step {step} row {i}")
    nxt = rng.integers(0, VOCAB, 3)
    seqs = [s + [int(t)] for s, t in zip(seqs, nxt)]
    logits, kv = runner.decode(kv, jnp.asarray(nxt, jnp.int32), ids)


def test_engine_and_generate_serve_it(model):
  """Greedy tokens from static `generate` and from the engine under preemption both equal
  recomputing each prefix from scratch."""
  runner = ModelRunner(model)
  rng = np.random.default_rng(1)
  prompts = [rng.integers(0, VOCAB, n).tolist() for n in (1, 7, 9, 15)]
  want = []
  for p in prompts:
    seq = list(p)
    for _ in range(12):
      seq.append(int(np.argmax(_recomputed_logits(runner, seq))))
    want.append(seq[len(p):])
  assert jax_paged.generate(model, prompts, 12, page_size=8) == want
  eng = jax_paged.Engine(model, max_batch=3, num_pages=7, page_size=8, steps_per_call=4)
  outputs, report = eng.generate([jax_paged.Request(p, 12) for p in prompts])
  assert outputs == want and report.preemptions > 0
  assert_pages_back(eng)


def test_prompt_logprobs_need_the_optional_methods(model):
  """TinyGQA has no `prefill_hidden` / `logits`: a request for prompt log-probabilities
  is refused by name before anything runs; other requests are served."""
  assert not offers_prompt_logprobs(model)
  eng = jax_paged.Engine(model, max_batch=2, num_pages=8, page_size=8)
  with pytest.raises(ValueError, match=r"request 1: prompt_logprobs=True needs a model with "
                                       r"prefill_hidden and logits"):
    eng.generate([jax_paged.Request([1, 2], 2), jax_paged.Request([1, 2], 2,
                                                                  prompt_logprobs=True)])
  assert len(eng.generate([jax_paged.Request([1, 2], 2)])[0][0]) == 2


def test_a_model_that_does_not_meet_the_protocol_is_refused():
  with pytest.raises(TypeError, match="does not meet jax_paged.PagedModel"):
    jax_paged.Engine(nnx.Linear(2, 2, rngs=nnx.Rngs(0)), num_pages=4)
