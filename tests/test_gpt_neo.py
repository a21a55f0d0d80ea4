"""GPT-Neo on the paged pool against Hugging Face transformers' GPTNeoForCausalLM (CPU,
f32), loaded from its `save_pretrained` directory.

The HF model is random, its LayerNorms too: 4 heads of 16, layer 0 global, layer 1 local
(a window of 5 positions, shorter than every sequence but the shortest), unscaled logits,
GELU (gelu_new). Tolerance as test_llama's: 1e-4 on the logits.
"""

import jax.numpy as jnp
import pytest
import torch
import transformers

import jax_paged
from models import gpt_neo
from tests.test_llama import (VOCAB, assert_bf16_tracks_hf,
                              assert_generate_and_engines_give_hfs_tokens,
                              assert_installed_cli_gives_hfs_tokens,
                              assert_kernels_give_references_and_hfs_tokens,
                              assert_logits_track_hf, assert_lora_adapters_match_peft,
                              randomised)

CONFIG = dict(vocab_size=VOCAB, hidden_size=64, num_layers=2, num_heads=4,
              attention_types=[[["global", "local"], 1]], window_size=5,
              max_position_embeddings=64, initializer_range=0.1, bos_token_id=None,
              eos_token_id=None, attn_implementation="eager")


def _hf_model(**overrides):
  torch.manual_seed(0)
  return randomised(transformers.GPTNeoForCausalLM(
      transformers.GPTNeoConfig(**{**CONFIG, **overrides})), norm="ln")


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
  """(HF model, its save_pretrained directory)."""
  hf = _hf_model()
  path = tmp_path_factory.mktemp("gpt_neo")
  hf.save_pretrained(path)
  return hf, path


def test_prefill_and_decode_logits_match_hf(saved):
  """Logits over a prefill and decode steps: the global and the local layer, unscaled."""
  hf, path = saved
  model = gpt_neo.from_pretrained(path)
  assert isinstance(model, jax_paged.PagedModel)
  assert [(b.attn.sliding_window, b.attn.scale, b.attn.qkv.bias) for b in model.h] == [
      (None, 1.0, None), (5, 1.0, None)]
  assert_logits_track_hf(hf, model, [3, 8, 13], 7)


def test_generate_and_engine_give_hfs_tokens(saved):
  hf, path = saved
  assert_generate_and_engines_give_hfs_tokens(hf, gpt_neo.from_pretrained(path))


def test_lora_adapters_match_peft(tmp_path):
  """PEFT adapters on q / k / v / out_proj, c_fc and c_proj (PEFT's names)."""
  assert_lora_adapters_match_peft(_hf_model, gpt_neo.from_pretrained,
                                  ["q_proj", "k_proj", "v_proj", "out_proj", "c_fc",
                                   "c_proj"], tmp_path)


def test_config_reads_hf_and_its_defaults(saved):
  """A saved config, an empty one (HF's defaults: GPT-Neo 1.3B), errors."""
  hf, _ = saved
  c = gpt_neo.GPTNeoConfig.from_dict(hf.config.to_dict())
  assert (c.n_embd, c.n_layer, c.n_head, c.n_positions, c.attention_layers,
          [c.window(i) for i in range(2)]) == (64, 2, 4, 64, ("global", "local"), [None, 5])
  d = gpt_neo.GPTNeoConfig.from_dict({})
  want = transformers.GPTNeoConfig()
  assert d == gpt_neo.GPTNeoConfig.from_dict(want.to_dict())
  assert (d.n_embd, d.n_layer, d.n_head, d.n_positions, d.window_size,
          list(d.attention_layers)) == (want.hidden_size, want.num_layers, want.num_heads,
                                        want.max_position_embeddings, want.window_size,
                                        want.attention_layers)
  for bad, message in (({"attention_types": [[["global", "sparse"], 12]]},
                        "attention_layers must give one of"),
                       ({"attention_types": 3}, r"attention_types must be \[\[types"),
                       ({"window_size": 0}, "window_size must be a positive int"),
                       ({"tie_word_embeddings": False}, "tie_word_embeddings=False")):
    with pytest.raises(ValueError, match=message):
      gpt_neo.GPTNeoConfig.from_dict(bad)


def test_bf16_tracks_hf(saved):
  hf, path = saved
  assert_bf16_tracks_hf(hf, gpt_neo.from_pretrained(path, dtype=jnp.bfloat16))


def test_cli_finds_the_model_type(saved, capsys):
  hf, path = saved
  assert_installed_cli_gives_hfs_tokens(hf, path, capsys, seed=15)


@pytest.mark.gpu
def test_triton_kernels_give_the_references_and_hfs_tokens_on_gpu(tmp_path):
  """f32 on a GPU at head dim 64: the kernels give the reference path's and HF's tokens."""
  hf = _hf_model(hidden_size=256)
  hf.save_pretrained(tmp_path)
  assert_kernels_give_references_and_hfs_tokens(
      hf, lambda **kw: gpt_neo.from_pretrained(tmp_path, **kw))
