"""Helium on the paged pool against Hugging Face transformers' HeliumForCausalLM (CPU,
f32), loaded from its `save_pretrained` directory.

The HF model is random, its biases and norms too: GQA 8 q heads over 2 kv heads of 8,
RoPE over every feature interleaved, biases on q / k / v (none on o) and the MLP.
Tolerance as test_llama's: 1e-4 on the logits.
"""

import jax.numpy as jnp
import pytest
import torch
import transformers

import jax_paged
from models import helium
from tests.test_glm import CONFIG
from tests.test_llama import (assert_bf16_tracks_hf,
                              assert_generate_and_engines_give_hfs_tokens,
                              assert_installed_cli_gives_hfs_tokens,
                              assert_kernels_give_references_and_hfs_tokens,
                              assert_logits_track_hf, assert_lora_adapters_match_peft,
                              randomised)


def _hf_model(**overrides):
  torch.manual_seed(0)
  # (HF's o_proj is hidden_size square: heads * head_dim must be hidden_size)
  config = transformers.HeliumConfig(**{**CONFIG, "head_dim": 8, "eos_token_id": None,
                                        "attention_bias": True, "mlp_bias": True, **overrides})
  return randomised(transformers.HeliumForCausalLM(config))


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
  """(HF model, its save_pretrained directory)."""
  hf = _hf_model()
  path = tmp_path_factory.mktemp("helium")
  hf.save_pretrained(path)
  return hf, path


def test_prefill_and_decode_logits_match_hf(saved):
  """Logits over a prefill and decode steps: interleaved RoPE over whole heads through the
  reordered q / k rows and biases, no o bias, the MLP's biases."""
  hf, path = saved
  model = helium.from_pretrained(path)
  assert isinstance(model, jax_paged.PagedModel)
  attention, mlp = model.layers[0].self_attn, model.layers[0].mlp
  assert attention.rope.rotary_dim is None  # (all 8 features)
  assert [m.bias is not None for m in (attention.qkv, attention.out, mlp.gate_up, mlp.down)
          ] == [True, False, True, True]
  assert_logits_track_hf(hf, model, [3, 8, 13], 7)


def test_generate_and_engine_give_hfs_tokens(saved):
  hf, path = saved
  assert_generate_and_engines_give_hfs_tokens(hf, helium.from_pretrained(path))


def test_lora_adapters_match_peft(tmp_path):
  """PEFT adapters on every projection: HF's merged model's greedy tokens (q_proj's and
  k_proj's B columns placed where the RoPE reorder put their rows)."""
  assert_lora_adapters_match_peft(
      _hf_model, helium.from_pretrained,
      ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"], tmp_path)


def test_config_reads_hf_and_its_defaults(saved):
  """A saved config; an empty one (HF's HeliumConfig defaults); errors."""
  hf, _ = saved
  c = helium.HeliumConfig.from_dict(hf.config.to_dict())
  assert (c.head_dim, c.rotary_dim, c.qkv_bias, c.out_bias, c.mlp_bias, c.post_norms) == (
      8, 8, True, False, True, False)
  d = helium.HeliumConfig.from_dict({})
  hf_default = transformers.HeliumConfig()
  assert d == helium.HeliumConfig.from_dict(hf_default.to_dict())
  assert (d.vocab_size, d.hidden_size, d.intermediate_size, d.num_hidden_layers,
          d.num_key_value_heads, d.head_dim, d.rms_norm_eps, d.rope_theta, d.bos_token_id,
          d.eos_token_id, d.tie_word_embeddings) == (
              hf_default.vocab_size, hf_default.hidden_size, hf_default.intermediate_size,
              hf_default.num_hidden_layers, hf_default.num_key_value_heads,
              hf_default.head_dim, hf_default.rms_norm_eps,
              hf_default.rope_parameters["rope_theta"], hf_default.bos_token_id,
              hf_default.eos_token_id, hf_default.tie_word_embeddings)
  for bad, message in (({"hidden_act": "gelu"}, "hidden_act"),
                       ({"head_dim": 64},
                        "num_attention_heads \\* head_dim \\(20 \\* 64\\) must be"),
                       ({"model_type": "llama"}, "model_type 'llama' is not supported")):
    with pytest.raises(ValueError, match=message):
      helium.HeliumConfig.from_dict(bad)


def test_bf16_tracks_hf(saved):
  hf, path = saved
  assert_bf16_tracks_hf(hf, helium.from_pretrained(path, dtype=jnp.bfloat16))


def test_cli_finds_the_model_type(saved, capsys):
  hf, path = saved
  assert_installed_cli_gives_hfs_tokens(hf, path, capsys, seed=12)


@pytest.mark.gpu
def test_triton_kernels_give_the_references_and_hfs_tokens_on_gpu(tmp_path):
  """f32 on a GPU at head dim 64 (RoPE over all of it, interleaved at the source): the
  decode / prefill kernels and the biased fused GEMMs give the reference path's and HF's
  tokens."""
  hf = _hf_model(hidden_size=256, num_attention_heads=4, head_dim=64)
  hf.save_pretrained(tmp_path)
  assert_kernels_give_references_and_hfs_tokens(
      hf, lambda **kw: helium.from_pretrained(tmp_path, **kw))
