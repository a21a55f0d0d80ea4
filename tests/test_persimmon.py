"""Persimmon on the paged pool against Hugging Face transformers' PersimmonForCausalLM
(CPU, f32), loaded from its `save_pretrained` directory.

The HF model is random, its LayerNorms (the q / k ones too) and biases too: 4 heads of 16,
RoPE on half of each head, the sequential block, relu^2, query_key_value head by head.
Tolerance as test_llama's: 1e-4 on the logits.
"""

import jax.numpy as jnp
import pytest
import torch
import transformers

import jax_paged
from jax_paged import nn as paged_nn
from models import persimmon
from tests.test_llama import (_COMMON, assert_bf16_tracks_hf,
                              assert_generate_and_engines_give_hfs_tokens,
                              assert_installed_cli_gives_hfs_tokens,
                              assert_kernels_give_references_and_hfs_tokens,
                              assert_logits_track_hf, assert_lora_adapters_match_peft,
                              randomised)

CONFIG = dict(_COMMON, num_attention_heads=4, pad_token_id=None)


def _hf_model(**overrides):
  torch.manual_seed(0)
  return randomised(transformers.PersimmonForCausalLM(
      transformers.PersimmonConfig(**{**CONFIG, **overrides})), norm="layernorm")


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
  """(HF model, its save_pretrained directory)."""
  hf = _hf_model()
  path = tmp_path_factory.mktemp("persimmon")
  hf.save_pretrained(path)
  return hf, path


def test_prefill_and_decode_logits_match_hf(saved):
  """Logits over a prefill and decode steps: the q / k LayerNorms, half-head RoPE,
  relu^2, the reordered query_key_value."""
  hf, path = saved
  model = persimmon.from_pretrained(path)
  assert isinstance(model, jax_paged.PagedModel)
  attn = model.layers[0].self_attn
  assert isinstance(attn.q_norm, paged_nn.LayerNorm) and attn.rope.rotary_dim == 8
  assert_logits_track_hf(hf, model, [3, 8, 13], 7)


def test_generate_and_engine_give_hfs_tokens(saved):
  hf, path = saved
  assert_generate_and_engines_give_hfs_tokens(hf, persimmon.from_pretrained(path))


def test_lora_adapters_match_peft(tmp_path):
  """PEFT adapters on query_key_value (its B's columns where the load put its rows),
  dense, dense_h_to_4h and dense_4h_to_h."""
  assert_lora_adapters_match_peft(_hf_model, persimmon.from_pretrained,
                                  ["query_key_value", "dense", "dense_h_to_4h",
                                   "dense_4h_to_h"], tmp_path)


def test_config_reads_hf_and_its_defaults(saved):
  """A saved config, an empty one (HF's defaults: Persimmon-8B's shape)."""
  hf, _ = saved
  c = persimmon.PersimmonConfig.from_dict(hf.config.to_dict())
  assert (c.num_attention_heads, c.head_dim, c.rotary_dim, c.qk_norm, c.hidden_act,
          c.use_parallel_residual) == (4, 16, 8, True, "relu2", False)
  d = persimmon.PersimmonConfig.from_dict({})
  want = transformers.PersimmonConfig()
  assert d == persimmon.PersimmonConfig.from_dict(want.to_dict())
  assert (d.vocab_size, d.hidden_size, d.num_hidden_layers, d.num_attention_heads,
          d.max_position_embeddings, d.partial_rotary_factor) == (
              want.vocab_size, want.hidden_size, want.num_hidden_layers,
              want.num_attention_heads, want.max_position_embeddings, 0.5)
  assert not persimmon.PersimmonConfig.from_dict({"qk_layernorm": False}).qk_norm


def test_bf16_tracks_hf(saved):
  hf, path = saved
  assert_bf16_tracks_hf(hf, persimmon.from_pretrained(path, dtype=jnp.bfloat16))


def test_cli_finds_the_model_type(saved, capsys):
  hf, path = saved
  assert_installed_cli_gives_hfs_tokens(hf, path, capsys, seed=15)


@pytest.mark.gpu
def test_triton_kernels_give_the_references_and_hfs_tokens_on_gpu(tmp_path):
  """f32 on a GPU at head dim 64: the kernels give the reference path's and HF's tokens."""
  hf = _hf_model(hidden_size=256)
  hf.save_pretrained(tmp_path)
  assert_kernels_give_references_and_hfs_tokens(
      hf, lambda **kw: persimmon.from_pretrained(tmp_path, **kw))
