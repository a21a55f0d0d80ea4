"""OLMo (the first) on the paged pool against Hugging Face transformers' OlmoForCausalLM
(CPU, f32), loaded from its `save_pretrained` directory: q / k / v clamped (clip_qkv, as
OLMo-7B-0424's), LayerNorms without parameters.

The HF model is random (OLMo's norms have no weights to randomise). Tolerance as
test_llama's: 1e-4 on the logits.
"""

import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers

import jax_paged
from models import olmo
from tests.test_llama import (_COMMON, _hf_last_logits, _prompts, assert_bf16_tracks_hf,
                              assert_generate_and_engines_give_hfs_tokens,
                              assert_installed_cli_gives_hfs_tokens,
                              assert_kernels_give_references_and_hfs_tokens,
                              assert_logits_track_hf, assert_lora_adapters_match_peft)

# MHA 4 heads of 16, q / k / v clamped to [-0.5, 0.5] (a third or so of them here).
CONFIG = dict(_COMMON, num_attention_heads=4, clip_qkv=0.5, pad_token_id=None)


def _hf_model(**overrides):
  torch.manual_seed(0)
  return transformers.OlmoForCausalLM(transformers.OlmoConfig(**{**CONFIG, **overrides})).eval()


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
  """(HF model, its save_pretrained directory)."""
  hf = _hf_model()
  path = tmp_path_factory.mktemp("olmo")
  hf.save_pretrained(path)
  return hf, path


def test_prefill_and_decode_logits_match_hf(saved):
  """Logits over a prefill and decode steps, with the clamp (which changes HF's logits
  here) and the parameter-free norms."""
  hf, path = saved
  model = olmo.from_pretrained(path)
  assert isinstance(model, jax_paged.PagedModel)
  assert model.layers[0].self_attn.clip_qkv == 0.5
  np.testing.assert_array_equal(model.layers[1].input_layernorm.scale[...], 1.0)
  assert model.norm.bias is None
  prompt = _prompts(np.random.default_rng(5), [9])
  unclamped = _hf_model(clip_qkv=None)
  assert np.abs(_hf_last_logits(hf, prompt) - _hf_last_logits(unclamped, prompt)).max() > 0.1
  assert_logits_track_hf(hf, model, [3, 8, 13], 7)


def test_generate_and_engine_give_hfs_tokens(saved):
  hf, path = saved
  assert_generate_and_engines_give_hfs_tokens(hf, olmo.from_pretrained(path))


def test_lora_adapters_match_peft(tmp_path):
  assert_lora_adapters_match_peft(_hf_model, olmo.from_pretrained,
                                  ["q_proj", "v_proj", "o_proj", "down_proj"], tmp_path)


def test_config_reads_hf_and_its_defaults(saved):
  """A saved config, an empty config.json (HF's OlmoConfig defaults) and a bad clip."""
  hf, _ = saved
  c = olmo.OlmoConfig.from_dict(hf.config.to_dict())
  assert (c.clip_qkv, c.num_attention_heads, c.head_dim, c.tie_word_embeddings) == (
      0.5, 4, 16, False)
  d = olmo.OlmoConfig.from_dict({"model_type": "olmo"})
  hf_d = transformers.OlmoConfig()
  assert (d.vocab_size, d.hidden_size, d.intermediate_size, d.num_hidden_layers,
          d.max_position_embeddings, d.eos_token_id, d.bos_token_id, d.clip_qkv) == (
              hf_d.vocab_size, hf_d.hidden_size, hf_d.intermediate_size,
              hf_d.num_hidden_layers, hf_d.max_position_embeddings, hf_d.eos_token_id,
              hf_d.bos_token_id, None)
  for bad, message in (({"clip_qkv": 0.0}, "clip_qkv must be a positive finite number"),
                       ({"model_type": "llama"}, "model_type 'llama'")):
    with pytest.raises(ValueError, match=message):
      olmo.OlmoConfig.from_dict(bad)


def test_bf16_tracks_hf(saved):
  hf, path = saved
  assert_bf16_tracks_hf(hf, olmo.from_pretrained(path, dtype=jnp.bfloat16))


def test_cli_finds_the_model_type(saved, capsys):
  hf, path = saved
  assert_installed_cli_gives_hfs_tokens(hf, path, capsys, seed=7)


@pytest.mark.gpu
def test_triton_kernels_give_the_references_and_hfs_tokens_on_gpu(tmp_path):
  """f32 on a GPU at head dim 64: the kernels behind the clamp (q / k / v projected,
  clamped, rotated, then written to the pages) give the reference path's and HF's
  tokens."""
  hf = _hf_model(hidden_size=256)
  hf.save_pretrained(tmp_path)
  assert_kernels_give_references_and_hfs_tokens(
      hf, lambda **kw: olmo.from_pretrained(tmp_path, **kw))
