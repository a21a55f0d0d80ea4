"""MiniCPM3 on the paged pool against Hugging Face transformers' MiniCPM3ForCausalLM (CPU,
f32), loaded from its `save_pretrained` directory.

The HF model is random, its norms too: DeepSeek-V2's latent attention (4 heads, a latent
of 56 + 8 rotated features, q through a rank-24 q_a / q_b pair) with rotate-half RoPE,
dense MLPs, MiniCPM's multipliers (embeddings x 12, branches x 1.4 / sqrt(2), logits / 4).
Tolerance as test_llama's: 1e-4 on the logits.
"""

import math

import jax.numpy as jnp
import pytest
import torch
import transformers

import jax_paged
from models import minicpm3
from tests.test_llama import (VOCAB, assert_bf16_tracks_hf,
                              assert_generate_and_engines_give_hfs_tokens,
                              assert_installed_cli_gives_hfs_tokens,
                              assert_kernels_give_references_and_hfs_tokens,
                              assert_logits_track_hf, randomised)

CONFIG = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=56, q_lora_rank=24,
              qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=16, max_position_embeddings=64,
              initializer_range=0.1, scale_emb=12, scale_depth=1.4, dim_model_base=16,
              bos_token_id=None, eos_token_id=None, pad_token_id=None,
              attn_implementation="eager")


def _hf_model(**overrides):
  torch.manual_seed(0)
  return randomised(transformers.MiniCPM3ForCausalLM(
      transformers.MiniCPM3Config(**{**CONFIG, **overrides})))


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
  """(HF model, its save_pretrained directory)."""
  hf = _hf_model()
  path = tmp_path_factory.mktemp("minicpm3")
  hf.save_pretrained(path)
  return hf, path


def test_prefill_and_decode_logits_match_hf(saved):
  """Logits over a prefill and decode steps: the latent attention's rotate-half RoPE, the
  three multipliers."""
  hf, path = saved
  model = minicpm3.from_pretrained(path)
  assert isinstance(model, jax_paged.PagedModel)
  c = model.config
  assert (c.embedding_multiplier, c.logits_scaling, c.rope_interleave) == (12.0, 4.0, False)
  assert c.residual_multiplier == pytest.approx(1.4 / math.sqrt(2))
  assert_logits_track_hf(hf, model, [3, 8, 13], 7)


def test_generate_and_engine_give_hfs_tokens(saved):
  hf, path = saved
  assert_generate_and_engines_give_hfs_tokens(hf, minicpm3.from_pretrained(path))


def test_config_reads_hf_and_its_defaults(saved):
  """A saved config, an empty one (HF's defaults: MiniCPM3-4B's shape), HF's None
  multipliers."""
  hf, _ = saved
  c = minicpm3.MiniCPM3Config.from_dict(hf.config.to_dict())
  assert (c.kv_lora_rank, c.q_lora_rank, c.qk_nope_head_dim, c.v_head_dim,
          c.sparse(1)) == (56, 24, 16, 16, False)
  d = minicpm3.MiniCPM3Config.from_dict({})
  want = transformers.MiniCPM3Config()
  assert d == minicpm3.MiniCPM3Config.from_dict(want.to_dict())
  assert (d.vocab_size, d.hidden_size, d.num_hidden_layers, d.kv_lora_rank, d.v_head_dim,
          d.tie_word_embeddings, d.logits_scaling) == (
              want.vocab_size, want.hidden_size, want.num_hidden_layers, want.kv_lora_rank,
              want.v_head_dim, True, want.hidden_size / want.dim_model_base)
  n = minicpm3.MiniCPM3Config.from_dict({"scale_depth": None, "dim_model_base": None,
                                         "num_hidden_layers": 4})
  assert (n.residual_multiplier, n.logits_scaling) == (1.0, 1.0)


def test_bf16_tracks_hf(saved):
  hf, path = saved
  assert_bf16_tracks_hf(hf, minicpm3.from_pretrained(path, dtype=jnp.bfloat16))


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
      hf, lambda **kw: minicpm3.from_pretrained(tmp_path, **kw))
