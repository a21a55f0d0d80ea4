"""GLM-4 (dense) on the paged pool against Hugging Face transformers' GlmForCausalLM and
Glm4ForCausalLM (CPU, f32), loaded from their `save_pretrained` directories.

The HF models are random, their biases and norms too. "glm" rotates half of each head
(HF's default), "glm4" (its sandwich norms) three quarters, with GQA 8 q heads over 2 kv
heads in both. Tolerance as test_llama's: 1e-4 on the logits.
"""

import jax.numpy as jnp
import pytest
import torch
import transformers

import jax_paged
from models import glm
from tests.test_llama import (VOCAB, assert_bf16_tracks_hf,
                              assert_generate_and_engines_give_hfs_tokens,
                              assert_installed_cli_gives_hfs_tokens,
                              assert_kernels_give_references_and_hfs_tokens,
                              assert_logits_track_hf, assert_lora_adapters_match_peft,
                              randomised)

CONFIG = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
              num_attention_heads=8, num_key_value_heads=2, head_dim=16,
              max_position_embeddings=64, rms_norm_eps=1e-5, initializer_range=0.1,
              pad_token_id=None, bos_token_id=None, eos_token_id=VOCAB - 1,
              attn_implementation="eager")  # (HF's configs replace None by GLM's eos ids)
VARIANTS = {
    "glm": (transformers.GlmForCausalLM, transformers.GlmConfig, {}),
    "glm4": (transformers.Glm4ForCausalLM, transformers.Glm4Config, dict(rope_parameters={
        "rope_type": "default", "rope_theta": 5000.0, "partial_rotary_factor": 0.75})),
}


def _hf_model(model_type: str, **overrides):
  model_class, config_class, fields = VARIANTS[model_type]
  torch.manual_seed(0)
  return randomised(model_class(config_class(**{**CONFIG, **fields, **overrides})))


@pytest.fixture(scope="module", params=list(VARIANTS))
def saved(request, tmp_path_factory):
  """(model type, HF model, its save_pretrained directory)."""
  hf = _hf_model(request.param)
  path = tmp_path_factory.mktemp(request.param)
  hf.save_pretrained(path)
  return request.param, hf, path


def test_prefill_and_decode_logits_match_hf(saved):
  """Logits over a prefill and decode steps: interleaved RoPE on part of each head through
  the reordered q / k rows and biases, the fused gate_up_proj, GLM-4-0414's post norms."""
  model_type, hf, path = saved
  model = glm.from_pretrained(path)
  assert isinstance(model, jax_paged.PagedModel)
  layer = model.layers[0]
  assert layer.self_attn.rope.rotary_dim == (12 if model_type == "glm4" else 8)
  assert layer.self_attn.qkv.bias is not None and layer.self_attn.out.bias is None
  assert (layer.post_mlp_layernorm is not None) == (model_type == "glm4")
  assert_logits_track_hf(hf, model, [3, 8, 13], 7)


def test_generate_and_engine_give_hfs_tokens(saved):
  _, hf, path = saved
  assert_generate_and_engines_give_hfs_tokens(hf, glm.from_pretrained(path))


@pytest.mark.parametrize("model_type", list(VARIANTS))
def test_lora_adapters_match_peft(model_type, tmp_path):
  """PEFT adapters on q / k / v / o_proj, gate_up_proj and down_proj: the served model's
  greedy tokens are those of the adapter merged into HF's weights (q_proj's and k_proj's
  B columns placed where the RoPE reorder put their rows)."""
  assert_lora_adapters_match_peft(
      lambda: _hf_model(model_type), glm.from_pretrained,
      ["q_proj", "k_proj", "v_proj", "o_proj", "gate_up_proj", "down_proj"], tmp_path)


def test_config_reads_hf_and_its_defaults(saved):
  """A saved config; glm-4-9b-chat-hf's and GLM-4-9B-0414's config.json fields; an empty
  one (HF's defaults); errors."""
  model_type, hf, _ = saved
  c = glm.GlmConfig.from_dict(hf.config.to_dict())
  assert (c.model_type, c.head_dim, c.rotary_dim, c.num_key_value_heads, c.qkv_bias,
          c.out_bias, c.post_norms, c.eos_token_id) == (
              model_type, 16, 12 if model_type == "glm4" else 8, 2, True, False,
              model_type == "glm4", VOCAB - 1)
  nine = glm.GlmConfig.from_dict({
      "architectures": ["Glm4ForCausalLM"], "attention_bias": True, "attention_dropout": 0.0,
      "eos_token_id": [151329, 151336, 151338], "head_dim": 128, "hidden_act": "silu",
      "hidden_size": 4096, "initializer_range": 0.02, "intermediate_size": 13696,
      "max_position_embeddings": 32768, "model_type": "glm4", "num_attention_heads": 32,
      "num_hidden_layers": 40, "num_key_value_heads": 2, "pad_token_id": 151329,
      "partial_rotary_factor": 0.5, "rms_norm_eps": 1e-05, "rope_theta": 10000.0,
      "tie_word_embeddings": False, "torch_dtype": "bfloat16", "vocab_size": 151552})
  assert (nine.rotary_dim, nine.rms_norm_eps, nine.max_position_embeddings, nine.post_norms,
          nine.eos_token_id) == (64, 1e-5, 32768, True, (151329, 151336, 151338))
  for name, config_class in (("glm", transformers.GlmConfig),
                             ("glm4", transformers.Glm4Config)):
    d = glm.GlmConfig.from_dict({"model_type": name})
    hf_default = config_class()
    assert (d.vocab_size, d.hidden_size, d.intermediate_size, d.num_hidden_layers,
            d.num_key_value_heads, d.head_dim, d.rms_norm_eps, d.rotary_dim, d.attention_bias,
            d.eos_token_id) == (
                hf_default.vocab_size, hf_default.hidden_size, hf_default.intermediate_size,
                hf_default.num_hidden_layers, hf_default.num_key_value_heads,
                hf_default.head_dim, hf_default.rms_norm_eps,
                int(hf_default.head_dim * hf_default.rope_parameters["partial_rotary_factor"]),
                hf_default.attention_bias, tuple(hf_default.eos_token_id))
  assert glm.GlmConfig.from_dict({"eos_token_id": None}).eos_token_id == tuple(
      transformers.GlmConfig(eos_token_id=None).eos_token_id)
  for bad, message in (({"hidden_act": "gelu_pytorch_tanh"}, "hidden_act"),
                       ({"partial_rotary_factor": 1.5}, "partial_rotary_factor must be"),
                       ({"model_type": "chatglm"}, "model_type 'chatglm' is not supported")):
    with pytest.raises(ValueError, match=message):
      glm.GlmConfig.from_dict(bad)


def test_bf16_tracks_hf(saved):
  _, hf, path = saved
  assert_bf16_tracks_hf(hf, glm.from_pretrained(path, dtype=jnp.bfloat16))


def test_cli_finds_the_model_type(saved, capsys):
  _, hf, path = saved
  assert_installed_cli_gives_hfs_tokens(hf, path, capsys, seed=7)


@pytest.mark.gpu
def test_triton_kernels_give_the_references_and_hfs_tokens_on_gpu(tmp_path):
  """f32 on a GPU at head dim 64 (RoPE on 32 of its features, interleaved at the source):
  the decode / prefill kernels, the fused GEMMs and the post-norms' fused residual adds
  give the reference path's and HF's tokens."""
  hf = _hf_model("glm4", hidden_size=128, head_dim=64)
  hf.save_pretrained(tmp_path)
  assert_kernels_give_references_and_hfs_tokens(
      hf, lambda **kw: glm.from_pretrained(tmp_path, **kw))
