"""ERNIE 4.5 (dense) on the paged pool against Hugging Face transformers'
Ernie4_5ForCausalLM (CPU, f32), loaded from its `save_pretrained` directories.

The HF models are random, their biases and norms too: "bias" has use_bias (biases on q,
k, v, o, gate, up and down) and its own lm_head, "plain" none and tied embeddings (the
released checkpoints'), both GQA 8 q heads over 2 kv heads with RoPE over every feature
interleaved. Tolerance as test_llama's: 1e-4 on the logits.
"""

import jax.numpy as jnp
import pytest
import transformers

import jax_paged
from models import ernie4_5
from tests.test_glm import CONFIG
from tests.test_llama import (assert_bf16_tracks_hf,
                              assert_generate_and_engines_give_hfs_tokens,
                              assert_installed_cli_gives_hfs_tokens,
                              assert_kernels_give_references_and_hfs_tokens,
                              assert_logits_track_hf, assert_lora_adapters_match_peft,
                              randomised)

VARIANTS = {"bias": dict(use_bias=True, tie_word_embeddings=False),
            "plain": dict(use_bias=False, tie_word_embeddings=True)}


def _hf_model(variant: str, **overrides):
  import torch  # pylint: disable=import-outside-toplevel
  torch.manual_seed(0)
  # (No eos: HF's generate keeps it from winning under min_new_tokens, ours would not.)
  config = transformers.Ernie4_5Config(**{**CONFIG, "eos_token_id": None, **VARIANTS[variant],
                                          **overrides})
  return randomised(transformers.Ernie4_5ForCausalLM(config))


@pytest.fixture(scope="module", params=list(VARIANTS))
def saved(request, tmp_path_factory):
  """(variant, HF model, its save_pretrained directory)."""
  hf = _hf_model(request.param)
  path = tmp_path_factory.mktemp(request.param)
  hf.save_pretrained(path)
  return request.param, hf, path


def test_prefill_and_decode_logits_match_hf(saved):
  """Logits over a prefill and decode steps: interleaved RoPE over whole heads through the
  reordered q / k rows and biases, use_bias's seven biases, tied or own lm_head."""
  variant, hf, path = saved
  model = ernie4_5.from_pretrained(path)
  assert isinstance(model, jax_paged.PagedModel)
  attention, mlp = model.layers[0].self_attn, model.layers[0].mlp
  assert attention.rope.rotary_dim is None  # (all 16 features)
  biased = variant == "bias"
  assert [m.bias is not None for m in (attention.qkv, attention.out, mlp.gate_up, mlp.down)
          ] == [biased] * 4
  assert model.layers[0].post_mlp_layernorm is None
  assert_logits_track_hf(hf, model, [3, 8, 13], 7)


def test_generate_and_engine_give_hfs_tokens(saved):
  _, hf, path = saved
  assert_generate_and_engines_give_hfs_tokens(hf, ernie4_5.from_pretrained(path))


def test_lora_adapters_match_peft(tmp_path):
  """PEFT adapters on every projection: the served model's greedy tokens are those of the
  adapter merged into HF's weights (q_proj's and k_proj's B columns placed where the RoPE
  reorder put their rows; gate_proj's and up_proj's in the fused gate_up)."""
  assert_lora_adapters_match_peft(
      lambda: _hf_model("bias"), ernie4_5.from_pretrained,
      ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"], tmp_path)


def test_config_reads_hf_and_its_defaults(saved):
  """A saved config; ERNIE-4.5-0.3B-PT's config.json fields; an empty one (HF's
  defaults); errors."""
  variant, hf, _ = saved
  c = ernie4_5.Ernie4_5Config.from_dict(hf.config.to_dict())
  biased = variant == "bias"
  assert (c.head_dim, c.rotary_dim, c.num_key_value_heads, c.qkv_bias, c.out_bias,
          c.mlp_bias, c.tie_word_embeddings, c.post_norms) == (
              16, 16, 2, biased, biased, biased, not biased, False)
  small = ernie4_5.Ernie4_5Config.from_dict({
      "bos_token_id": 1, "eos_token_id": 2, "head_dim": 128, "hidden_act": "silu",
      "hidden_size": 1024, "intermediate_size": 3072, "max_position_embeddings": 131072,
      "model_type": "ernie4_5", "num_attention_heads": 16, "num_key_value_heads": 2,
      "num_hidden_layers": 18, "pad_token_id": 0, "rms_norm_eps": 1e-05,
      "rope_theta": 500000, "tie_word_embeddings": True, "torch_dtype": "bfloat16",
      "use_bias": False, "use_cache": False, "vocab_size": 103424})
  assert (small.rotary_dim, small.rope_theta, small.qkv_bias, small.tie_word_embeddings,
          small.eos_token_id) == (128, 500000, False, True, 2)
  d = ernie4_5.Ernie4_5Config.from_dict({})
  hf_default = transformers.Ernie4_5Config()
  assert (d.model_type, d.vocab_size, d.hidden_size, d.intermediate_size,
          d.num_hidden_layers, d.num_attention_heads, d.num_key_value_heads, d.head_dim,
          d.max_position_embeddings, d.rms_norm_eps, d.rope_theta, d.tie_word_embeddings,
          d.attention_bias, d.bos_token_id, d.eos_token_id) == (
              hf_default.model_type, hf_default.vocab_size, hf_default.hidden_size,
              hf_default.intermediate_size, hf_default.num_hidden_layers,
              hf_default.num_attention_heads, hf_default.num_key_value_heads,
              hf_default.head_dim, hf_default.max_position_embeddings,
              hf_default.rms_norm_eps, hf_default.rope_parameters["rope_theta"],
              hf_default.tie_word_embeddings, hf_default.use_bias, hf_default.bos_token_id,
              hf_default.eos_token_id)
  assert ernie4_5.Ernie4_5Config.from_dict({"eos_token_id": None}).eos_token_id is None
  for bad, message in (({"use_bias": "yes"}, "use_bias must be true or false"),
                       ({"hidden_act": "gelu"}, "hidden_act"),
                       ({"model_type": "ernie4_5_moe"},
                        "model_type 'ernie4_5_moe' is not supported")):
    with pytest.raises(ValueError, match=message):
      ernie4_5.Ernie4_5Config.from_dict(bad)


def test_bf16_tracks_hf(saved):
  _, hf, path = saved
  assert_bf16_tracks_hf(hf, ernie4_5.from_pretrained(path, dtype=jnp.bfloat16))


def test_cli_finds_the_model_type(saved, capsys):
  _, hf, path = saved
  assert_installed_cli_gives_hfs_tokens(hf, path, capsys, seed=11)


@pytest.mark.gpu
def test_triton_kernels_give_the_references_and_hfs_tokens_on_gpu(tmp_path):
  """f32 on a GPU at head dim 64 (RoPE over all of it, interleaved at the source) with
  use_bias: the decode / prefill kernels and the biased fused GEMMs give the reference
  path's and HF's tokens."""
  hf = _hf_model("bias", hidden_size=128, head_dim=64)
  hf.save_pretrained(tmp_path)
  assert_kernels_give_references_and_hfs_tokens(
      hf, lambda **kw: ernie4_5.from_pretrained(tmp_path, **kw))
