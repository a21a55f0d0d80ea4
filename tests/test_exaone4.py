"""EXAONE 4.0 on the paged pool against Hugging Face transformers' Exaone4ForCausalLM
(CPU, f32), loaded from its `save_pretrained` directories.

The HF models are random, their norms too; GQA 8 q heads over 2 kv heads of 16. Two
variants: "32b" as EXAONE-4.0-32B (4 layers: 0-2 local, windows of 5 positions, shorter
than the prompts tested, with llama3 RoPE whose scaling the positions reach; layer 3
global without RoPE) and "1.2b" as EXAONE-4.0-1.2B (no window: every layer global with
RoPE; tied embeddings). Tolerance as test_llama's: 1e-4 on the logits.
"""

import jax.numpy as jnp
import pytest
import torch
import transformers

import jax_paged
from models import exaone4
from tests.test_llama import (_COMMON, assert_bf16_tracks_hf,
                              assert_generate_and_engines_give_hfs_tokens,
                              assert_installed_cli_gives_hfs_tokens,
                              assert_kernels_give_references_and_hfs_tokens, assert_logits_track_hf,
                              randomised)

CONFIG = dict(_COMMON, num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=2,
              head_dim=16, pad_token_id=None)
VARIANTS = {
    "32b": dict(sliding_window=5, sliding_window_pattern=4, rope_parameters={
        "rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0,
        "high_freq_factor": 4.0, "original_max_position_embeddings": 16}),
    "1.2b": dict(sliding_window=None, layer_types=["full_attention"] * 4,
                 tie_word_embeddings=True),
}


def _hf_model(variant: str, **overrides):
  torch.manual_seed(0)
  return randomised(transformers.Exaone4ForCausalLM(transformers.Exaone4Config(
      **{**CONFIG, **VARIANTS[variant], **overrides})))


@pytest.fixture(scope="module", params=list(VARIANTS))
def saved(request, tmp_path_factory):
  """(variant, HF model, its save_pretrained directory)."""
  hf = _hf_model(request.param)
  path = tmp_path_factory.mktemp(request.param)
  hf.save_pretrained(path)
  return request.param, hf, path


def test_prefill_and_decode_logits_match_hf(saved):
  """Logits over a prefill and decode steps past the window: local layers' windows and
  RoPE, the global layer's NoPE, per-head q / k norms, OLMo 2's post-norms."""
  variant, hf, path = saved
  model = exaone4.from_pretrained(path)
  assert isinstance(model, jax_paged.PagedModel)
  attention = [layer.self_attn for layer in model.layers]
  local = variant == "32b"
  assert [a.sliding_window for a in attention] == ([5, 5, 5, None] if local else [None] * 4)
  assert [a.rope is None for a in attention] == [False] * 3 + [local]
  assert not attention[0].qk_norm_all_heads and attention[0].q_norm.weight.shape == (16,)
  assert_logits_track_hf(hf, model, [3, 8, 13], 7)


def test_generate_and_engine_give_hfs_tokens(saved):
  _, hf, path = saved
  assert_generate_and_engines_give_hfs_tokens(hf, exaone4.from_pretrained(path))


def test_config_reads_hf_and_its_defaults(saved):
  """A saved config; EXAONE-4.0-32B's config.json fields; an empty one (HF's
  Exaone4Config defaults); errors."""
  variant, hf, _ = saved
  c = exaone4.Exaone4Config.from_dict(hf.config.to_dict())
  assert c.layer_types == tuple(hf.config.layer_types)
  assert (c.sliding_window, c.qk_norm, c.qkv_bias, c.out_bias, c.tie_word_embeddings) == (
      5 if variant == "32b" else None, True, False, False, variant == "1.2b")
  big = exaone4.Exaone4Config.from_dict({
      "architectures": ["Exaone4ForCausalLM"], "bos_token_id": 1, "eos_token_id": 361,
      "head_dim": 128, "hidden_act": "silu", "hidden_size": 5120,
      "intermediate_size": 27392, "max_position_embeddings": 131072,
      "model_type": "exaone4", "num_attention_heads": 40, "num_hidden_layers": 64,
      "num_key_value_heads": 8, "pad_token_id": 0, "rms_norm_eps": 1e-05,
      "rope_scaling": {"factor": 16.0, "high_freq_factor": 4.0, "low_freq_factor": 1.0,
                       "original_max_position_embeddings": 8192, "rope_type": "llama3"},
      "rope_theta": 1000000, "sliding_window": 4096, "sliding_window_pattern": "LLLG",
      "layer_types": ["sliding_attention"] * 3 + ["full_attention"]
      + (["sliding_attention"] * 3 + ["full_attention"]) * 15,
      "tie_word_embeddings": False, "vocab_size": 102400})
  assert (big.window(0), big.window(3), big.layer_rope(0).rope_type, big.layer_rope(3),
          big.eos_token_id) == (4096, None, "llama3", None, 361)
  d = exaone4.Exaone4Config.from_dict({})
  hf_default = transformers.Exaone4Config()
  assert d == exaone4.Exaone4Config.from_dict(hf_default.to_dict())
  assert (d.vocab_size, d.hidden_size, d.intermediate_size, d.num_hidden_layers,
          d.num_key_value_heads, d.sliding_window, d.layer_types, d.rms_norm_eps,
          d.bos_token_id, d.eos_token_id, d.rope_theta) == (
              hf_default.vocab_size, hf_default.hidden_size, hf_default.intermediate_size,
              hf_default.num_hidden_layers, hf_default.num_key_value_heads,
              hf_default.sliding_window, tuple(hf_default.layer_types),
              hf_default.rms_norm_eps, hf_default.bos_token_id, hf_default.eos_token_id,
              hf_default.rope_parameters["rope_theta"])
  assert exaone4.Exaone4Config.from_dict({"sliding_window": None}).layer_types == (
      ("full_attention",) * 32)
  for bad, message in (
      ({"sliding_window_pattern": "LLLG"}, "sliding_window_pattern must be a positive int"),
      ({"sliding_window_pattern": 0}, "sliding_window_pattern must be a positive int"),
      ({"layer_types": ["full_attention"] * 3}, "layer_types"),
      ({"model_type": "exaone"}, "model_type 'exaone' is not supported")):
    with pytest.raises(ValueError, match=message):
      exaone4.Exaone4Config.from_dict(bad)


def test_bf16_tracks_hf(saved):
  _, hf, path = saved
  assert_bf16_tracks_hf(hf, exaone4.from_pretrained(path, dtype=jnp.bfloat16))


def test_cli_finds_the_model_type(saved, capsys):
  _, hf, path = saved
  assert_installed_cli_gives_hfs_tokens(hf, path, capsys, seed=13)


@pytest.mark.gpu
def test_triton_kernels_give_the_references_and_hfs_tokens_on_gpu(tmp_path):
  """f32 on a GPU at head dim 64: the decode / prefill kernels with and without windows
  and RoPE, the per-head norms and the post-norms' fused residual adds give the reference
  path's and HF's tokens."""
  hf = _hf_model("32b", hidden_size=128, head_dim=64)
  hf.save_pretrained(tmp_path)
  assert_kernels_give_references_and_hfs_tokens(
      hf, lambda **kw: exaone4.from_pretrained(tmp_path, **kw))
