"""Arcee (AFM) and Jais 2, Llama's model with Nemotron's relu^2 MLP, on the paged pool
against Hugging Face transformers' ArceeForCausalLM and Jais2ForCausalLM (CPU, f32),
loaded from their `save_pretrained` directories.

The HF models are random, their norms' weights (and Jais 2's LayerNorm biases) and every
bias too. GQA 8 q heads over 2 kv heads of 8, YaRN RoPE (AFM-4.5B's scaling) whose ramp
the positions tested reach (original context 16), relu^2, biases on q / k / v / o and the
MLP. Tolerance as test_llama's: 1e-4 on the logits.
"""

import jax.numpy as jnp
import pytest
import torch
import transformers

import jax_paged
from jax_paged import nn as paged_nn
from models import arcee
from models import jais2
from tests.test_llama import (_COMMON, assert_bf16_tracks_hf,
                              assert_generate_and_engines_give_hfs_tokens,
                              assert_installed_cli_gives_hfs_tokens,
                              assert_kernels_give_references_and_hfs_tokens,
                              assert_logits_track_hf, assert_lora_adapters_match_peft,
                              randomised)

CONFIG = dict(_COMMON, num_attention_heads=8, num_key_value_heads=2, attention_bias=True,
              mlp_bias=True, rope_parameters={
                  "rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                  "original_max_position_embeddings": 16})
# name -> (our module, its config class, HF's model and config classes, the norm's class)
FAMILIES = {
    "arcee": (arcee, arcee.ArceeConfig, transformers.ArceeForCausalLM,
              transformers.ArceeConfig, paged_nn.RMSNorm),
    "jais2": (jais2, jais2.Jais2Config, transformers.Jais2ForCausalLM,
              transformers.Jais2Config, paged_nn.LayerNorm),
}


def _hf_model(name: str, **overrides):
  _, _, model_class, config_class, _ = FAMILIES[name]
  torch.manual_seed(0)
  return randomised(model_class(config_class(**{**CONFIG, **overrides})))


@pytest.fixture(scope="module", params=list(FAMILIES))
def saved(request, tmp_path_factory):
  """(family name, HF model, its save_pretrained directory)."""
  hf = _hf_model(request.param)
  path = tmp_path_factory.mktemp(request.param)
  hf.save_pretrained(path)
  return request.param, hf, path


def test_prefill_and_decode_logits_match_hf(saved):
  """Logits over a prefill and decode steps: RMSNorms (Arcee) or LayerNorms (Jais 2),
  YaRN, relu^2's plain MLP, biases on q / k / v / o and the MLP."""
  name, hf, path = saved
  module, _, _, _, norm_class = FAMILIES[name]
  model = module.from_pretrained(path)
  assert isinstance(model, jax_paged.PagedModel)
  layer = model.layers[0]
  assert isinstance(layer.input_layernorm, norm_class)
  assert layer.self_attn.rope.rope_type == "yarn" and layer.self_attn.out.bias is not None
  assert layer.mlp.c_fc.bias is not None
  assert_logits_track_hf(hf, model, [3, 8, 13], 7)


def test_generate_and_engine_give_hfs_tokens(saved):
  name, hf, path = saved
  assert_generate_and_engines_give_hfs_tokens(hf, FAMILIES[name][0].from_pretrained(path))


@pytest.mark.parametrize("name", list(FAMILIES))
def test_lora_adapters_match_peft(name, tmp_path):
  """PEFT adapters on q / k / v / o_proj, up_proj and down_proj (PEFT's names)."""
  assert_lora_adapters_match_peft(lambda: _hf_model(name), FAMILIES[name][0].from_pretrained,
                                  ["q_proj", "k_proj", "v_proj", "o_proj", "up_proj",
                                   "down_proj"], tmp_path)


def test_config_reads_hf_and_its_defaults(saved):
  """A saved config, a config.json omitting fields (HF's defaults, as HF reads the same
  file), and errors."""
  name, hf, _ = saved
  _, config_class, _, hf_config_class, _ = FAMILIES[name]
  c = config_class.from_dict(hf.config.to_dict())
  assert (c.num_key_value_heads, c.head_dim, c.hidden_act, c.qkv_bias, c.out_bias,
          c.mlp_bias, c.rope.rope_type) == (2, 8, "relu2", True, True, True, "yarn")
  d = config_class.from_dict({"model_type": name})
  hf_default = hf_config_class()
  assert d == config_class.from_dict(hf_default.to_dict())
  assert (d.vocab_size, d.hidden_size, d.intermediate_size, d.num_hidden_layers,
          d.num_key_value_heads, d.head_dim, d.max_position_embeddings, d.bos_token_id,
          d.eos_token_id, d.tie_word_embeddings, d.rope_theta, d.attention_bias,
          d.mlp_bias) == (
              hf_default.vocab_size, hf_default.hidden_size, hf_default.intermediate_size,
              hf_default.num_hidden_layers, hf_default.num_key_value_heads,
              hf_default.hidden_size // hf_default.num_attention_heads,
              hf_default.max_position_embeddings, hf_default.bos_token_id,
              hf_default.eos_token_id, hf_default.tie_word_embeddings,
              hf_default.rope_parameters["rope_theta"], hf_default.attention_bias,
              hf_default.mlp_bias)
  if name == "jais2":
    assert d.layer_norm_eps == hf_default.layer_norm_eps
  for bad, message in (({"hidden_act": "silu"}, "hidden_act 'silu' is not supported"),
                       ({"model_type": "llama"}, "model_type 'llama' is not supported")):
    with pytest.raises(ValueError, match=message):
      config_class.from_dict(bad)


def test_bf16_tracks_hf(saved):
  name, hf, path = saved
  assert_bf16_tracks_hf(hf, FAMILIES[name][0].from_pretrained(path, dtype=jnp.bfloat16))


def test_cli_finds_the_model_type(saved, capsys):
  _, hf, path = saved
  assert_installed_cli_gives_hfs_tokens(hf, path, capsys, seed=8)


@pytest.mark.gpu
@pytest.mark.parametrize("name", list(FAMILIES))
def test_triton_kernels_give_the_references_and_hfs_tokens_on_gpu(name, tmp_path):
  """f32 on a GPU at head dim 64: the decode / prefill kernels, the fused up_proj + relu^2
  GEMM and the norm-fused residual adds give the reference path's and HF's tokens."""
  hf = _hf_model(name, hidden_size=256, num_attention_heads=4)
  hf.save_pretrained(tmp_path)
  assert_kernels_give_references_and_hfs_tokens(
      hf, lambda **kw: FAMILIES[name][0].from_pretrained(tmp_path, **kw))
