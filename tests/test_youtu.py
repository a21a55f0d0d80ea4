"""Youtu-LLM on the paged pool against Hugging Face transformers' YoutuForCausalLM (CPU,
f32), loaded from its `save_pretrained` directory.

The HF model is random, its norms too: DeepSeek-V3's latent attention (4 heads, a latent
of 56 + 8 rotated features, q through a rank-24 q_a / q_b pair) with its RoPE pairs
interleaved (reordered at load) or not, dense MLPs, a tied head. Tolerance as
test_llama's: 1e-4 on the logits.
"""

import jax.numpy as jnp
import pytest
import torch
import transformers

import jax_paged
from models import youtu
from tests.test_llama import (VOCAB, assert_bf16_tracks_hf,
                              assert_generate_and_engines_give_hfs_tokens,
                              assert_installed_cli_gives_hfs_tokens,
                              assert_kernels_give_references_and_hfs_tokens,
                              assert_logits_track_hf, randomised)

CONFIG = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=56, q_lora_rank=24,
              qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=16, max_position_embeddings=64,
              initializer_range=0.1, bos_token_id=None, eos_token_id=None, pad_token_id=None,
              attn_implementation="eager")


def _hf_model(**overrides):
  torch.manual_seed(0)
  return randomised(transformers.YoutuForCausalLM(
      transformers.YoutuConfig(**{**CONFIG, **overrides})))


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
  """(HF model, its save_pretrained directory)."""
  hf = _hf_model()
  path = tmp_path_factory.mktemp("youtu")
  hf.save_pretrained(path)
  return hf, path


def test_prefill_and_decode_logits_match_hf(saved, tmp_path):
  """Logits over a prefill and decode steps, interleaved RoPE pairs; and without them."""
  hf, path = saved
  model = youtu.from_pretrained(path)
  assert isinstance(model, jax_paged.PagedModel)
  assert model.config.rope_interleave and model.lm_head is None
  assert_logits_track_hf(hf, model, [3, 8, 13], 7)
  plain = _hf_model(rope_interleave=False)
  plain.save_pretrained(tmp_path)
  assert_logits_track_hf(plain, youtu.from_pretrained(tmp_path), [5, 9], 3)


def test_generate_and_engine_give_hfs_tokens(saved):
  hf, path = saved
  assert_generate_and_engines_give_hfs_tokens(hf, youtu.from_pretrained(path))


def test_config_reads_hf_and_its_defaults(saved):
  """A saved config, an empty one (HF's defaults)."""
  hf, _ = saved
  c = youtu.YoutuConfig.from_dict(hf.config.to_dict())
  assert (c.kv_lora_rank, c.q_lora_rank, c.sparse(0), c.tie_word_embeddings) == (
      56, 24, False, True)
  d = youtu.YoutuConfig.from_dict({})
  want = transformers.YoutuConfig()
  assert d == youtu.YoutuConfig.from_dict(want.to_dict())
  assert (d.vocab_size, d.hidden_size, d.intermediate_size, d.num_hidden_layers,
          d.kv_lora_rank, d.q_lora_rank, d.eos_token_id) == (
              want.vocab_size, want.hidden_size, want.intermediate_size,
              want.num_hidden_layers, want.kv_lora_rank, want.q_lora_rank, want.eos_token_id)


def test_bf16_tracks_hf(saved):
  hf, path = saved
  assert_bf16_tracks_hf(hf, youtu.from_pretrained(path, dtype=jnp.bfloat16))


def test_cli_finds_the_model_type(saved, capsys):
  hf, path = saved
  assert_installed_cli_gives_hfs_tokens(hf, path, capsys, seed=15)


@pytest.mark.gpu
def test_triton_kernels_give_the_references_and_hfs_tokens_on_gpu(tmp_path):
  """f32 on a GPU: the latent attention's kernels give the reference path's and HF's
  tokens."""
  hf = _hf_model()
  hf.save_pretrained(tmp_path)
  assert_kernels_give_references_and_hfs_tokens(
      hf, lambda **kw: youtu.from_pretrained(tmp_path, **kw))
