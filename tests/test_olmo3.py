"""OLMo 3 on the paged pool against Hugging Face transformers' Olmo3ForCausalLM (CPU, f32),
loaded from its `save_pretrained` directory.

The HF model is random, its norms too; 4 layers of GQA 8 q heads over 2 kv heads of 8:
layers 0-2 sliding (windows of 5 positions, shorter than the prompts tested), layer 3
full. The full layer's RoPE is YaRN (the long-context models'), whose scaling reaches the
positions tested (original context 16); the sliding layers' the default one of another
base, as transformers 5's per-layer-type rope_parameters allow. Tolerance as
test_llama's: 1e-4 on the logits.
"""

import jax.numpy as jnp
import pytest
import torch
import transformers

import jax_paged
from models import olmo2
from tests.test_llama import (_COMMON, assert_bf16_tracks_hf,
                              assert_generate_and_engines_give_hfs_tokens,
                              assert_installed_cli_gives_hfs_tokens,
                              assert_kernels_give_references_and_hfs_tokens, assert_logits_track_hf,
                              randomised)

CONFIG = dict(_COMMON, num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=2,
              sliding_window=5, pad_token_id=None, rope_parameters={
                  "sliding_attention": {"rope_type": "default", "rope_theta": 20000.0},
                  "full_attention": {"rope_type": "yarn", "rope_theta": 300000.0,
                                     "factor": 4.0, "original_max_position_embeddings": 16}})


def _hf_model(**overrides):
  torch.manual_seed(0)
  return randomised(transformers.Olmo3ForCausalLM(transformers.Olmo3Config(
      **{**CONFIG, **overrides})))


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
  """(HF model, its save_pretrained directory)."""
  hf = _hf_model()
  path = tmp_path_factory.mktemp("olmo3")
  hf.save_pretrained(path)
  return hf, path


def test_prefill_and_decode_logits_match_hf(saved):
  """Logits over a prefill and decode steps past the window: the sliding layers' windows
  and default RoPE, the full layer's YaRN, OLMo 2's post-norms and all-head q / k norms."""
  hf, path = saved
  model = olmo2.from_pretrained(path)
  assert isinstance(model, jax_paged.PagedModel)
  attention = [layer.self_attn for layer in model.layers]
  assert [a.sliding_window for a in attention] == [5, 5, 5, None]
  assert [(a.rope.rope_type, a.rope.theta) for a in attention] == [
      ("default", 20000.0)] * 3 + [("yarn", 300000.0)]
  assert attention[0].qk_norm_all_heads
  assert_logits_track_hf(hf, model, [3, 8, 13], 7)


def test_generate_and_engine_give_hfs_tokens(saved):
  hf, path = saved
  assert_generate_and_engines_give_hfs_tokens(hf, olmo2.from_pretrained(path))


def test_config_reads_hf_and_its_defaults(saved):
  """A saved config; Olmo-3-7B-Instruct's config.json (transformers 4's names); an empty
  one (HF's Olmo3Config defaults); errors."""
  hf, _ = saved
  c = olmo2.Olmo2Config.from_dict(hf.config.to_dict())
  assert (c.layer_types, c.sliding_window, c.sliding_rope_theta, c.rope_theta) == (
      ("sliding_attention",) * 3 + ("full_attention",), 5, 20000.0, 300000.0)
  seven = olmo2.Olmo2Config.from_dict({
      "architectures": ["Olmo3ForCausalLM"], "attention_bias": False, "eos_token_id": 100257,
      "hidden_act": "silu", "hidden_size": 4096, "intermediate_size": 11008,
      "max_position_embeddings": 65536, "model_type": "olmo3", "num_attention_heads": 32,
      "num_hidden_layers": 32, "num_key_value_heads": 32, "pad_token_id": 100277,
      "rms_norm_eps": 1e-06, "rope_scaling": {
          "attention_factor": 1.2079441541679836, "beta_fast": 32, "beta_slow": 1,
          "factor": 8.0, "original_max_position_embeddings": 8192, "rope_type": "yarn"},
      "rope_theta": 500000, "sliding_window": 4096, "tie_word_embeddings": False,
      "vocab_size": 100278, "layer_types": ["sliding_attention"] * 3 + ["full_attention"]
      + ["sliding_attention"] * 28})
  assert (seven.layer_rope(0).rope_type, seven.layer_rope(0).theta, seven.layer_rope(3).rope_type,
          seven.layer_rope(3).factor, seven.window(0), seven.window(3), seven.window(4),
          seven.eos_token_id) == ("default", 500000, "yarn", 8.0, 4096, None, 4096, 100257)
  d = olmo2.Olmo2Config.from_dict({"model_type": "olmo3"})
  hf_default = transformers.Olmo3Config()
  assert d == olmo2.Olmo2Config.from_dict(hf_default.to_dict())
  assert (d.layer_types, d.sliding_window, d.rope_theta, d.vocab_size, d.eos_token_id) == (
      tuple(hf_default.layer_types), hf_default.sliding_window,
      hf_default.rope_parameters["full_attention"]["rope_theta"], hf_default.vocab_size,
      hf_default.eos_token_id)
  for bad, message in (
      ({"rope_parameters": {"rope_type": "default"}}, "must hold a dict for each"),
      ({"rope_parameters": {"sliding_attention": {"rope_type": "linear", "factor": 2.0},
                            "full_attention": {"rope_type": "default"}}},
       "the sliding layers' rope_type 'linear' is not supported"),
      ({"sliding_window": 0}, "sliding_window \\(of sliding layers\\) must be"),
      ({"layer_types": ["full_attention"] * 31}, "layer_types")):
    with pytest.raises(ValueError, match=message):
      olmo2.Olmo2Config.from_dict({"model_type": "olmo3", **bad})
  with pytest.raises(ValueError, match="OLMo 2 has no sliding-window layers"):
    olmo2.Olmo2Config.from_dict({"model_type": "olmo2", "sliding_window": 8})


def test_bf16_tracks_hf(saved):
  hf, path = saved
  assert_bf16_tracks_hf(hf, olmo2.from_pretrained(path, dtype=jnp.bfloat16))


def test_cli_finds_the_model_type(saved, capsys):
  hf, path = saved
  assert_installed_cli_gives_hfs_tokens(hf, path, capsys, seed=9)


@pytest.mark.gpu
def test_triton_kernels_give_the_references_and_hfs_tokens_on_gpu(tmp_path):
  """f32 on a GPU at head dim 64: the decode / prefill kernels with and without windows
  give the reference path's and HF's tokens."""
  hf = _hf_model(hidden_size=256, num_attention_heads=4, num_key_value_heads=2)
  hf.save_pretrained(tmp_path)
  assert_kernels_give_references_and_hfs_tokens(
      hf, lambda **kw: olmo2.from_pretrained(tmp_path, **kw))
