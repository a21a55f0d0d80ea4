"""Hunyuan (dense) on the paged pool against Hugging Face transformers'
HunYuanDenseV1ForCausalLM (CPU, f32), loaded from its `save_pretrained` directory.

The HF model is random, its norms and biases too: GQA 8 q heads over 2 kv heads of 16,
q / k normalised per head after RoPE, the released models' "dynamic" RoPE with an alpha
(NTK: a larger base), biases on q / k / v / o. Tolerance as test_llama's: 1e-4 on the
logits.
"""

import jax.numpy as jnp
import pytest
import torch
import transformers

import jax_paged
from models import hunyuan
from tests.test_llama import (_COMMON, assert_bf16_tracks_hf,
                              assert_generate_and_engines_give_hfs_tokens,
                              assert_installed_cli_gives_hfs_tokens,
                              assert_kernels_give_references_and_hfs_tokens,
                              assert_logits_track_hf, assert_lora_adapters_match_peft,
                              randomised)

ROPE = {"rope_type": "dynamic", "alpha": 50.0, "factor": 1.0, "rope_theta": 100.0}
CONFIG = dict(_COMMON, num_attention_heads=8, num_key_value_heads=2, head_dim=16,
              attention_bias=True, pad_token_id=None, rope_parameters=ROPE)


def _hf_model(**overrides):
  torch.manual_seed(0)
  return randomised(transformers.HunYuanDenseV1ForCausalLM(
      transformers.HunYuanDenseV1Config(**{**CONFIG, **overrides})))


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
  """(HF model, its save_pretrained directory)."""
  hf = _hf_model()
  path = tmp_path_factory.mktemp("hunyuan")
  hf.save_pretrained(path)
  return hf, path


def test_prefill_and_decode_logits_match_hf(saved):
  """Logits over a prefill and decode steps: the q / k norms after RoPE, the NTK alpha's
  base, the biases."""
  hf, path = saved
  model = hunyuan.from_pretrained(path)
  assert isinstance(model, jax_paged.PagedModel)
  attention = model.layers[0].self_attn
  assert attention.qk_norm_after_rope and attention.q_norm.weight.shape == (16,)
  assert attention.rope.rope_type == "default"
  assert attention.rope.theta == pytest.approx(100.0 * 50.0 ** (16 / 14))
  assert attention.out.bias is not None
  assert_logits_track_hf(hf, model, [3, 8, 13], 7)


def test_generate_and_engine_give_hfs_tokens(saved):
  hf, path = saved
  assert_generate_and_engines_give_hfs_tokens(hf, hunyuan.from_pretrained(path))


def test_lora_adapters_match_peft(tmp_path):
  """PEFT adapters on q / k / v / o_proj and the MLP (PEFT's names)."""
  assert_lora_adapters_match_peft(_hf_model, hunyuan.from_pretrained,
                                  ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj",
                                   "up_proj", "down_proj"], tmp_path)


def test_config_reads_hf_and_its_defaults(saved):
  """A saved config; Hunyuan-7B-Instruct's config.json fields (transformers 4's
  rope_scaling); an empty one (HF's defaults); errors."""
  hf, _ = saved
  c = hunyuan.HunyuanConfig.from_dict(hf.config.to_dict())
  assert (c.qk_norm, c.qk_norm_after_rope, c.qkv_bias, c.out_bias, c.rope_scaling) == (
      True, True, True, True, None)
  seven = hunyuan.HunyuanConfig.from_dict({
      "architectures": ["HunYuanDenseV1ForCausalLM"], "attention_bias": False,
      "bos_token_id": 1, "eos_token_id": 127960, "head_dim": 128, "hidden_act": "silu",
      "hidden_size": 4096, "intermediate_size": 14336, "max_position_embeddings": 32768,
      "model_type": "hunyuan_v1_dense", "num_attention_heads": 32, "num_hidden_layers": 32,
      "num_key_value_heads": 8, "rms_norm_eps": 1e-05, "rope_theta": 10000.0,
      "rope_scaling": {"alpha": 1000.0, "beta_fast": 32, "beta_slow": 1, "factor": 1.0,
                       "mscale": 1.0, "mscale_all_dim": 1.0, "type": "dynamic"},
      "tie_word_embeddings": True, "vocab_size": 128167, "use_qk_norm": True})
  assert seven.rope_theta == pytest.approx(10000.0 * 1000.0 ** (128 / 126))
  assert (seven.rope.rope_type, seven.num_key_value_heads, seven.eos_token_id,
          seven.tie_word_embeddings) == ("default", 8, 127960, True)
  d = hunyuan.HunyuanConfig.from_dict({})
  hf_default = transformers.HunYuanDenseV1Config()
  assert d == hunyuan.HunyuanConfig.from_dict(hf_default.to_dict())
  assert (d.vocab_size, d.hidden_size, d.intermediate_size, d.num_hidden_layers,
          d.num_key_value_heads, d.max_position_embeddings, d.bos_token_id,
          d.eos_token_id, d.rope_theta) == (
              hf_default.vocab_size, hf_default.hidden_size, hf_default.intermediate_size,
              hf_default.num_hidden_layers, hf_default.num_key_value_heads,
              hf_default.max_position_embeddings, hf_default.bos_token_id,
              hf_default.eos_token_id, hf_default.rope_parameters["rope_theta"])
  for bad, message in (
      ({"rope_scaling": {"type": "dynamic", "alpha": -1.0}}, "rope alpha must be"),
      ({"rope_scaling": {"type": "dynamic", "factor": 2.0}}, "dynamic"),
      ({"model_type": "hunyuan_v1_moe"}, "model_type 'hunyuan_v1_moe' is not supported")):
    with pytest.raises(ValueError, match=message):
      hunyuan.HunyuanConfig.from_dict(bad)


def test_bf16_tracks_hf(saved):
  hf, path = saved
  assert_bf16_tracks_hf(hf, hunyuan.from_pretrained(path, dtype=jnp.bfloat16))


def test_cli_finds_the_model_type(saved, capsys):
  hf, path = saved
  assert_installed_cli_gives_hfs_tokens(hf, path, capsys, seed=14)


@pytest.mark.gpu
def test_triton_kernels_give_the_references_and_hfs_tokens_on_gpu(tmp_path):
  """f32 on a GPU at head dim 64: the decode / prefill kernels over K normalised after
  RoPE give the reference path's and HF's tokens."""
  hf = _hf_model(hidden_size=128, head_dim=64)
  hf.save_pretrained(tmp_path)
  assert_kernels_give_references_and_hfs_tokens(
      hf, lambda **kw: hunyuan.from_pretrained(tmp_path, **kw))
