"""Beam search on the paged pool against Hugging Face's `generate(num_beams=...)` (CPU, f32).

The HF model is test_gpt2's random-init GPT-2 (vocabulary 300, pages of 8), loaded through
`models.gpt2.from_pretrained`. Scores are sums of f32 log-probabilities (magnitude ~0.1-10)
that differ from HF's only in summation order: 1e-5 relative.
"""

import jax
import numpy as np
import pytest
import torch

import jax_paged
from jax_paged.serving import beam_search as beam_lib
from models import gpt2

from test_gpt2 import HF_CONFIG, PAGE, _hf_model, _prompts, checkpoint  # noqa: F401

NEW = 14  # every prompt crosses a page boundary while its beams decode


def _hf_beams(hf, prompt: list[int], new: int, beam_width: int, length_penalty=1.0,
              early_stopping=False, num_return_sequences=1, eos_token_id=None,
              min_new_tokens=0):
  """HF's num_return_sequences best hypotheses: (new tokens up to the first stop token
  included, sequences_scores)."""
  with torch.no_grad():
    out = hf.generate(torch.tensor([prompt]), max_new_tokens=new, num_beams=beam_width,
                      do_sample=False, length_penalty=length_penalty,
                      early_stopping=early_stopping,
                      num_return_sequences=num_return_sequences,
                      eos_token_id=eos_token_id, min_new_tokens=min_new_tokens,
                      pad_token_id=0, return_dict_in_generate=True, output_scores=True)
  stops = [] if eos_token_id is None else (
      [eos_token_id] if isinstance(eos_token_id, int) else eos_token_id)
  hyps = []
  for seq, score in zip(out.sequences[:, len(prompt):].tolist(), out.sequences_scores):
    ends = [i + 1 for i, t in enumerate(seq) if t in stops]
    hyps.append((seq[:ends[0]] if ends else seq, float(score)))
  return hyps


SETTINGS = [
    dict(beam_width=4),
    # Stop tokens ending beams early (10% of the vocabulary), two beams.
    dict(beam_width=2, eos_token_id=list(range(1, 300, 10))),
    dict(beam_width=2, early_stopping=True, length_penalty=2.0,
         eos_token_id=list(range(1, 300, 10)), num_return_sequences=2),
    dict(beam_width=2, length_penalty=2.0, early_stopping="never",
         eos_token_id=list(range(1, 300, 10))),
    dict(beam_width=5, length_penalty=-1.0, eos_token_id=[2, 14], num_return_sequences=5),
    # Stop tokens barred for the first 6 new tokens (HF's MinNewTokensLengthLogitsProcessor).
    dict(beam_width=2, eos_token_id=list(range(1, 300, 10)), min_new_tokens=6,
         num_return_sequences=2),
]


@pytest.mark.parametrize("settings", SETTINGS, ids=lambda s: "-".join(
    f"{k}={v if not isinstance(v, list) else len(v)}" for k, v in s.items()))
def test_beams_match_hf(checkpoint, settings):
  """Every hypothesis (tokens and score) of prompts of 1-17 tokens, in waves of two or
  three prompts (max_batch 8 rows): HF's."""
  hf, path = checkpoint
  model = gpt2.from_pretrained(path)
  prompts = _prompts(np.random.default_rng(1), [1, 5, 8, 9, 17])
  beams, report = jax_paged.beam_search(model, prompts, NEW, page_size=PAGE, max_batch=8,
                                        **settings)
  stopped = 0
  for prompt, got in zip(prompts, beams):
    want = _hf_beams(hf, prompt, NEW, **settings)
    assert [b.tokens for b in got] == [w[0] for w in want]
    np.testing.assert_allclose([b.score for b in got], [w[1] for w in want], rtol=1e-5)
    stopped += sum(len(b.tokens) < NEW for b in got)
  if settings in (SETTINGS[1], SETTINGS[-1]):
    assert stopped  # stop tokens did end returned hypotheses
  assert all(len(b.tokens) >= settings.get("min_new_tokens", 1) for got in beams for b in got)
  k = settings["beam_width"]
  assert report.decode_calls >= -(-len(prompts) // (8 // k))
  assert report.generated_tokens == sum(len(b.tokens) for got in beams for b in got)


def test_beams_share_pages(checkpoint):
  """A long prompt's pages are shared by its beams: the peak is well under beam_width
  unshared copies of prompt and new tokens; one prompt per wave gives the same beams."""
  _, path = checkpoint
  model = gpt2.from_pretrained(path)
  prompts = _prompts(np.random.default_rng(2), [40, 33])
  beams, report = jax_paged.beam_search(model, prompts, 8, beam_width=4, page_size=PAGE)
  unshared = sum(4 * -(-(len(p) + 8) // PAGE) for p in prompts)
  assert report.peak_pages_in_use <= sum(len(p) // PAGE + 4 * 2 + 3 for p in prompts)
  assert report.peak_pages_in_use < unshared / 2
  one_wave = jax_paged.beam_search(model, prompts, 8, beam_width=4, page_size=PAGE,
                                   max_batch=4)[0]
  assert [[b.tokens for b in got] for got in one_wave] == [[b.tokens for b in got]
                                                           for got in beams]
  np.testing.assert_allclose([b.score for got in one_wave for b in got],
                             [b.score for got in beams for b in got], rtol=1e-5)


def test_int8_cache_keeps_the_float_caches_beams(checkpoint):
  """An int8 pool (its scales copied with the pages a fork copies): the same best
  hypotheses as the f32 pool's for these prompts, scores within 0.01 (int8 rounding of
  K/V; measured 0.0017-0.0048)."""
  _, path = checkpoint
  model = gpt2.from_pretrained(path)
  prompts = _prompts(np.random.default_rng(1), [1, 5, 8, 9, 17])
  f32, _ = jax_paged.beam_search(model, prompts, NEW, beam_width=4, page_size=PAGE)
  int8, _ = jax_paged.beam_search(model, prompts, NEW, beam_width=4, page_size=PAGE,
                                  cache_dtype="int8")
  assert [b[0].tokens for b in int8] == [b[0].tokens for b in f32]
  np.testing.assert_allclose([b[0].score for b in int8], [b[0].score for b in f32],
                             atol=0.01)


def test_one_beam_is_greedy(checkpoint):
  _, path = checkpoint
  model = gpt2.from_pretrained(path)
  prompts = _prompts(np.random.default_rng(3), [3, 12])
  beams, _ = jax_paged.beam_search(model, prompts, 10, beam_width=1, page_size=PAGE)
  assert [b[0].tokens for b in beams] == jax_paged.generate(model, prompts, 10,
                                                            page_size=PAGE)


@pytest.mark.parametrize("kwargs, match", [
    (dict(beam_width=0), r"beam_width must be an int in \[1, 32\], got 0"),
    (dict(beam_width=2.0), "beam_width must be an int"),
    (dict(beam_width=33), "beam_width must be an int in"),
    (dict(beam_width=32, eos_token_id=[1, 2]), "at most 64, got 96"),
    (dict(num_return_sequences=5), r"num_return_sequences must be an int in \[1, beam_width=4\]"),
    (dict(early_stopping="sometimes"), "early_stopping must be one of"),
    (dict(length_penalty=float("nan")), "length_penalty must be a finite number"),
    (dict(length_penalty=True), "length_penalty must be a finite number"),
    (dict(eos_token_id=300), r"eos_token_id must be None or token ids in \[0, vocab_size=300\)"),
    (dict(eos_token_id=[1, -1]), "eos_token_id must be"),
    (dict(max_batch=3), "max_batch must be >= beam_width = 4"),
    (dict(min_new_tokens=5), r"min_new_tokens must be an int in \[0, max_new_tokens=4\]"),
    (dict(page_size=0), "page_size must be"),
])
def test_bad_settings_are_named(checkpoint, kwargs, match):
  _, path = checkpoint
  model = gpt2.from_pretrained(path)
  with pytest.raises(ValueError, match=match):
    jax_paged.beam_search(model, [[1, 2]], 4, **{"beam_width": 4, **kwargs})


def test_bad_prompts_are_named(checkpoint):
  _, path = checkpoint
  model = gpt2.from_pretrained(path)
  for prompts, match in [([], "non-empty list"), ([[1], []], "request 1: prompt is empty"),
                         ([[1, 300]], r"token ids \[300\] outside \[0, vocab_size=300\)"),
                         ("hello", "non-empty list")]:
    with pytest.raises(ValueError, match=match):
      jax_paged.beam_search(model, prompts, 4)
  with pytest.raises(ValueError, match="n_positions=64"):
    jax_paged.beam_search(model, [[1] * 60], 8)
  with pytest.raises(ValueError, match="max_new_tokens must be an int >= 1, got 0"):
    jax_paged.beam_search(model, [[1]], 0)


def test_keep_covers_stop_tokens():
  assert beam_lib.BeamConfig(4, 8, 1.0, False, ()).keep == 8
  assert beam_lib.BeamConfig(4, 8, 1.0, False, (1, 2)).keep == 12


@pytest.mark.gpu
def test_beams_match_hf_on_gpu(tmp_path):
  """On the GPU's kernels (paged prefill and decode attention, the decode step's reserve)
  with head dim 64 and pages of 16, f32: HF's hypotheses (run on the CPU)."""
  hf = _hf_model(seed=7, n_embd=256, n_head=4, n_layer=3)
  hf.save_pretrained(tmp_path)
  prompts = _prompts(np.random.default_rng(8), [1, 8, 23, 40])
  settings = dict(beam_width=4, eos_token_id=list(range(1, 300, 25)), num_return_sequences=2)
  with jax.default_matmul_precision("highest"):
    beams, report = jax_paged.beam_search(gpt2.from_pretrained(tmp_path), prompts, 24,
                                          page_size=16, **settings)
  for prompt, got in zip(prompts, beams):
    want = _hf_beams(hf, prompt, 24, **settings)
    assert [b.tokens for b in got] == [w[0] for w in want]
    np.testing.assert_allclose([b.score for b in got], [w[1] for w in want], rtol=1e-4)
  assert report.peak_pages_in_use < report.num_pages
