"""Nemotron on the paged pool against Hugging Face transformers' NemotronForCausalLM (CPU,
f32), loaded from its `save_pretrained` directory.

The HF model is random, its LayerNorms' weights and every bias too (HF's zeros, read as
weight + 1, would hide the one left out or added twice). Tolerance as test_llama's: 1e-4
on the logits.
"""

import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers

import jax_paged
from models import nemotron
from tests.test_llama import (_COMMON, assert_bf16_tracks_hf,
                              assert_generate_and_engines_give_hfs_tokens,
                              assert_installed_cli_gives_hfs_tokens,
                              assert_kernels_give_references_and_hfs_tokens,
                              assert_logits_track_hf, assert_lora_adapters_match_peft,
                              randomised)

# GQA 4 q heads over 2 kv heads of 16, RoPE on half of each, relu^2, biases everywhere.
CONFIG = dict(_COMMON, num_attention_heads=4, num_key_value_heads=2, rope_theta=500.0,
              partial_rotary_factor=0.5, norm_eps=1e-4, attention_bias=True, mlp_bias=True)


def _hf_model(**overrides):
  torch.manual_seed(0)
  hf = randomised(transformers.NemotronForCausalLM(transformers.NemotronConfig(
      **{**CONFIG, **overrides})))
  with torch.no_grad():  # (1P norms: weights near zero, as trained ones are)
    for name, p in hf.named_parameters():
      if "norm" in name and name.endswith("weight"):
        p.uniform_(-0.5, 0.5)
  return hf


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
  """(HF model, its save_pretrained directory)."""
  hf = _hf_model()
  path = tmp_path_factory.mktemp("nemotron")
  hf.save_pretrained(path)
  return hf, path


def test_prefill_and_decode_logits_match_hf(saved):
  """Logits over a prefill and decode steps: 1P LayerNorms (weight + 1), relu^2, RoPE on
  half of each head, biases on q / k / v / o and the MLP."""
  hf, path = saved
  model = nemotron.from_pretrained(path)
  assert isinstance(model, jax_paged.PagedModel)
  hf_weight = hf.model.layers[0].input_layernorm.weight.detach().numpy()
  np.testing.assert_allclose(np.asarray(model.layers[0].input_layernorm.scale[...]),
                             hf_weight + 1, rtol=1e-6)
  attention = model.layers[0].self_attn
  assert attention.rope.rotary_dim == 8 and attention.out.bias is not None
  assert_logits_track_hf(hf, model, [3, 8, 13], 7)


def test_generate_and_engine_give_hfs_tokens(saved):
  hf, path = saved
  assert_generate_and_engines_give_hfs_tokens(hf, nemotron.from_pretrained(path))


def test_lora_adapters_match_peft(tmp_path):
  """PEFT adapters on q / k / v / o_proj, up_proj and down_proj (PEFT's names)."""
  assert_lora_adapters_match_peft(_hf_model, nemotron.from_pretrained,
                                  ["q_proj", "k_proj", "v_proj", "o_proj", "up_proj",
                                   "down_proj"], tmp_path)


def test_config_reads_hf_and_its_defaults(saved):
  """A saved config, a config.json omitting fields (HF's NemotronConfig defaults, as HF
  reads the same file), and errors."""
  hf, _ = saved
  c = nemotron.NemotronConfig.from_dict(hf.config.to_dict())
  assert (c.num_key_value_heads, c.head_dim, c.rotary_dim, c.norm_eps, c.hidden_act,
          c.qkv_bias, c.out_bias, c.mlp_bias) == (2, 16, 8, 1e-4, "relu2", True, True, True)
  d = nemotron.NemotronConfig.from_dict({"model_type": "nemotron"})
  assert d == nemotron.NemotronConfig.from_dict(transformers.NemotronConfig().to_dict())
  assert (d.vocab_size, d.hidden_size, d.num_key_value_heads, d.head_dim, d.rotary_dim,
          d.bos_token_id, d.eos_token_id, d.tie_word_embeddings) == (
              256000, 6144, 48, 128, 64, 2, 3, False)
  for bad, message in (({"hidden_act": "silu"}, "hidden_act 'silu' is not supported"),
                       ({"model_type": "nemotron_h"}, "model_type 'nemotron_h'")):
    with pytest.raises(ValueError, match=message):
      nemotron.NemotronConfig.from_dict(bad)


def test_bf16_tracks_hf(saved):
  hf, path = saved
  assert_bf16_tracks_hf(hf, nemotron.from_pretrained(path, dtype=jnp.bfloat16))


def test_cli_finds_the_model_type(saved, capsys):
  hf, path = saved
  assert_installed_cli_gives_hfs_tokens(hf, path, capsys, seed=7)


@pytest.mark.gpu
def test_triton_kernels_give_the_references_and_hfs_tokens_on_gpu(tmp_path):
  """f32 on a GPU at head dim 64 (RoPE on 32 of its features): the decode / prefill
  kernels, the fused up_proj + relu^2 GEMM and the LayerNorm-fused residual adds give the
  reference path's and HF's tokens."""
  hf = _hf_model(hidden_size=256)
  hf.save_pretrained(tmp_path)
  assert_kernels_give_references_and_hfs_tokens(
      hf, lambda **kw: nemotron.from_pretrained(tmp_path, **kw))
