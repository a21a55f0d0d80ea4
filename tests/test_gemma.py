"""Gemma 3 (text), Gemma 2 and VaultGemma on the paged pool against Hugging Face
transformers' Gemma3ForCausalLM, Gemma2ForCausalLM and VaultGemmaForCausalLM (CPU, f32),
loaded from their `save_pretrained` directories; Gemma 3's image-text checkpoints against
Gemma3ForConditionalGeneration.

The HF models are random, their norms' weights too (HF initialises them to 0, Gemma's
identity, which would hide a norm applied wrongly or not at all); Gemma 2's soft caps are
small enough to change the logits (checked). Tolerance as test_llama's: 1e-4 on the
logits.
"""

import functools
import json

import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers

import jax_paged
from jax_paged import cli
from models import gemma2
from models import gemma3
from tests.test_llama import (PAGE, VOCAB, _hf_generate, _hf_last_logits, _prompts,
                              assert_bf16_tracks_hf,
                              assert_kernels_give_references_and_hfs_tokens,
                              assert_installed_cli_gives_hfs_tokens, assert_logits_track_hf,
                              assert_prefix_cache_and_chunks_give_hfs_tokens)

# Layers 0 and 1 windowed to 5 positions, layer 2 global; GQA 4 q heads over 2 kv heads
# of 32 (128 wide, hidden 48); scores scaled by query_pre_attn_scalar 20, not the head dim.
# Gemma 3: the sliding layers with the local RoPE base, the global one with linear
# scaling. Gemma 2: one RoPE with linear scaling, no q / k norms, logits soft-capped.
CONFIG = dict(vocab_size=VOCAB, hidden_size=48, intermediate_size=80, num_hidden_layers=3,
              num_attention_heads=4, num_key_value_heads=2, head_dim=32,
              max_position_embeddings=64, query_pre_attn_scalar=20, sliding_window=5,
              layer_types=["sliding_attention", "sliding_attention", "full_attention"],
              initializer_range=0.1, bos_token_id=None, eos_token_id=None,
              pad_token_id=None, attn_implementation="eager")
# family -> (HF model class, HF config class, our module, the family's CONFIG fields)
VARIANTS = {
    "gemma3": (transformers.Gemma3ForCausalLM, transformers.Gemma3TextConfig, gemma3, dict(
        rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 100.0},
                         "full_attention": {"rope_type": "linear", "factor": 2.0,
                                            "rope_theta": 1000.0}})),
    "gemma2": (transformers.Gemma2ForCausalLM, transformers.Gemma2Config, gemma2, dict(
        rope_parameters={"rope_type": "linear", "factor": 2.0, "rope_theta": 1000.0},
        attn_logit_softcapping=0.5, final_logit_softcapping=2.0)),
    # VaultGemma: Gemma 2 without the post-norms.
    "vaultgemma": (transformers.VaultGemmaForCausalLM, transformers.VaultGemmaConfig, gemma2,
                   dict(rope_parameters={"rope_type": "default", "rope_theta": 1000.0},
                        attn_logit_softcapping=0.5, final_logit_softcapping=2.0)),
}


def _hf_model(family: str, **overrides):
  model_class, config_class, _, fields = VARIANTS[family]
  torch.manual_seed(0)
  hf = model_class(config_class(**{**CONFIG, **fields, **overrides})).eval()
  with torch.no_grad():
    for name, p in hf.named_parameters():
      if "norm" in name:
        p.normal_(0.0, 0.5)
  return hf


@pytest.fixture(scope="module", params=list(VARIANTS))
def saved(request, tmp_path_factory):
  """(HF model, its save_pretrained directory, our module) of each family."""
  hf = _hf_model(request.param)
  path = tmp_path_factory.mktemp(request.param)
  hf.save_pretrained(path)
  return hf, path, VARIANTS[request.param][2]


def test_gemma2_soft_caps_change_the_logits():
  """The caps of VARIANTS bite: without them HF's logits move by far more than the
  tolerance (so matching HF checks that both are applied)."""
  prompt = _prompts(np.random.default_rng(9), [12])
  capped = _hf_last_logits(_hf_model("gemma2"), prompt)
  for name in ("attn_logit_softcapping", "final_logit_softcapping"):
    uncapped = _hf_last_logits(_hf_model("gemma2", **{name: None}), prompt)
    assert np.abs(capped - uncapped).max() > 1e-2, name


def test_prefill_and_decode_logits_match_hf(saved):
  hf, path, module = saved
  model = module.from_pretrained(path)
  assert isinstance(model, jax_paged.PagedModel)
  assert [b.self_attn.sliding_window for b in model.layers] == [5, 5, None]
  vault = model.config.model_type == "vaultgemma"  # (no post-norms)
  assert [m is None for m in (model.layers[0].post_attention_layernorm,
                              model.layers[0].post_feedforward_layernorm)] == [vault] * 2
  assert_logits_track_hf(hf, model, [3, 8, 13], 10)  # across pages, past the window


def test_greedy_tokens_match_hf_with_a_cached_prefix_and_chunks(saved):
  """generate, and an engine whose prompts share a cached prefix and whose long prompt is
  prefilled in chunks: HF's greedy tokens."""
  hf, path, module = saved
  model = module.from_pretrained(path)
  rng = np.random.default_rng(2)
  prompts = _prompts(rng, [1, 5, 9, 17])
  assert jax_paged.generate(model, prompts, 12, page_size=PAGE) == [
      _hf_generate(hf, p, 12) for p in prompts]
  assert assert_prefix_cache_and_chunks_give_hfs_tokens(hf, model, rng, [4, 9]) >= 2 * PAGE


def test_gemma3_config_reads_hf_layouts_and_refuses_what_it_lacks(tmp_path):
  path = tmp_path / "gemma3"
  _hf_model("gemma3").save_pretrained(path)
  config = json.loads((path / "config.json").read_text())
  c = gemma3.Gemma3Config.from_dict(config)
  assert (c.rope_local_base_freq, c.rope_theta) == (100.0, 1000.0)
  assert dict(c.rope_scaling)["factor"] == 2.0
  # transformers 4's layout: flat RoPE fields, layer types from the pattern.
  v4 = {k: v for k, v in config.items() if k not in ("rope_parameters", "layer_types")}
  c = gemma3.Gemma3Config.from_dict({**v4, "rope_theta": 1e6, "rope_local_base_freq": 1e4,
                                     "rope_scaling": {"rope_type": "linear", "factor": 8.0},
                                     "sliding_window_pattern": 2})
  assert c.layer_types == ("sliding_attention", "full_attention", "sliding_attention")
  assert c.rope(0).theta == 1e4 and c.rope(1).theta == 1e6 and c.rope(1).factor == 8.0
  for bad, message in (({"final_logit_softcapping": 30.0}, "soft-capping"),
                       ({"use_bidirectional_attention": True}, "bidirectional"),
                       ({"hidden_activation": "relu"}, "hidden_activation 'relu'"),
                       ({"model_type": "gemma4"}, "model_type 'gemma4' is not supported"),
                       ({"rope_parameters": {**config["rope_parameters"], "full_attention": {
                           "rope_type": "default", "partial_rotary_factor": 0.5}}},
                        "partial_rotary_factor 0.5")):
    with pytest.raises(ValueError, match=message):
      gemma3.Gemma3Config.from_dict({**config, **bad})
  (path.parent / "bad").mkdir(exist_ok=True)
  bad = path.parent / "bad"
  (bad / "config.json").write_text(json.dumps({**config, "attn_logit_softcapping": 50.0}))
  with pytest.raises(ValueError, match=r"config.json: attn_logit_softcapping"):
    gemma3.from_pretrained(bad)


def test_gemma2_config_reads_hf_layouts_and_refuses_what_it_lacks(tmp_path):
  _hf_model("gemma2").save_pretrained(tmp_path)
  config = json.loads((tmp_path / "config.json").read_text())
  c = gemma2.Gemma2Config.from_dict(config)
  assert (c.rope_theta, dict(c.rope_scaling)["factor"]) == (1000.0, 2.0)
  assert (c.attn_logit_softcapping, c.final_logit_softcapping) == (0.5, 2.0)
  assert c.rope(0) == c.rope(2) and not c.qk_norm
  # transformers 4's layout: flat RoPE fields, no layer_types (HF's alternation: layer 0
  # sliding); HF's defaults: Gemma 2 2B's caps.
  v4 = {k: v for k, v in config.items() if k not in ("rope_parameters", "layer_types")}
  c = gemma2.Gemma2Config.from_dict({**v4, "rope_theta": 1e4})
  assert c.layer_types == ("sliding_attention", "full_attention", "sliding_attention")
  assert c.rope(1).theta == 1e4 and c.rope_scaling is None
  assert gemma2.Gemma2Config.from_dict({}) == gemma2.Gemma2Config()
  assert (gemma2.Gemma2Config().attn_logit_softcapping,
          gemma2.Gemma2Config().final_logit_softcapping) == (50.0, 30.0)
  for bad, message in (({"use_bidirectional_attention": True}, "bidirectional"),
                       ({"model_type": "gemma3_text"}, "model_type 'gemma3_text'"),
                       ({"attn_logit_softcapping": -1.0}, "attn_logit_softcapping must be"),
                       ({"rope_parameters": {"rope_type": "dynamic", "factor": 2.0}}, "dynamic"),
                       ({"rope_parameters": [10000.0]}, "rope_parameters must be a dict")):
    with pytest.raises(ValueError, match=message):
      gemma2.Gemma2Config.from_dict({**config, **bad})


def test_bf16_tracks_hf(saved):
  """bf16 weights and compute against HF in f32: within bf16's error."""
  hf, path, module = saved
  assert_bf16_tracks_hf(hf, module.from_pretrained(path, dtype=jnp.bfloat16))


@pytest.mark.gpu
@pytest.mark.parametrize("family", list(VARIANTS))
def test_triton_kernels_match_reference_and_hf_on_gpu(family, tmp_path):
  """f32, Gemma's head dim 256: the decode and prefill attention kernels (windowed and
  not, Gemma 2's soft-capped) and the norm kernels give the reference path's and HF's
  greedy tokens."""
  hf = _hf_model(family, head_dim=256)
  hf.save_pretrained(tmp_path)
  assert_kernels_give_references_and_hfs_tokens(hf, functools.partial(
      VARIANTS[family][2].from_pretrained, tmp_path))


def test_cli_finds_gemma_by_model_type(saved, capsys):
  """jax-paged-generate on the checkpoint, through the installed families (the gemma2 and
  gemma3 entry points): HF's greedy tokens."""
  hf, path, module = saved
  assert set(module.MODEL_TYPES) <= {t for f in cli.model_families() for t in f.model_types}
  assert_installed_cli_gives_hfs_tokens(hf, path, capsys, seed=6)


def test_image_text_checkpoints_language_model_matches_hf(tmp_path, capsys):
  """An image-text Gemma3ForConditionalGeneration checkpoint (model_type gemma3: the
  language model's config in text_config, its tensors under language_model.model.):
  on text, HF's logits and greedy tokens, the CLI finding it by model_type; the top
  level's eos ids win over text_config's."""
  torch.manual_seed(1)
  text = {**{k: v for k, v in CONFIG.items() if k != "attn_implementation"},
          **VARIANTS["gemma3"][3]}
  vision = dict(hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                num_attention_heads=2, image_size=28, patch_size=14)
  hf = transformers.Gemma3ForConditionalGeneration(transformers.Gemma3Config(
      text_config=text, vision_config=vision, mm_tokens_per_image=4,
      image_token_index=VOCAB, boi_token_index=VOCAB + 1, eoi_token_index=VOCAB + 2,
      attn_implementation="eager")).eval()
  with torch.no_grad():
    for name, p in hf.named_parameters():
      if "norm" in name and "language_model" in name:
        p.normal_(0.0, 0.5)
  hf.save_pretrained(tmp_path)
  config = json.loads((tmp_path / "config.json").read_text())
  assert config["model_type"] == "gemma3"
  model = gemma3.from_pretrained(tmp_path)
  assert model.config.model_type == "gemma3"
  assert model.config.query_pre_attn_scalar == 20
  assert_logits_track_hf(hf, model, [3, 11], 3, seed=8)

  assert_installed_cli_gives_hfs_tokens(hf, tmp_path, capsys, seed=8)

  c = gemma3.Gemma3Config.from_dict({**config, "eos_token_id": [1, 106]})
  assert c.eos_token_id == (1, 106) and c.num_hidden_layers == 3
  assert gemma3.Gemma3Config.from_dict({"model_type": "gemma3"}) == gemma3.Gemma3Config(
      model_type="gemma3")  # no text_config: HF's Gemma3TextConfig defaults
  with pytest.raises(ValueError, match="text_config must be a dict"):
    gemma3.Gemma3Config.from_dict({**config, "text_config": [1]})
  with pytest.raises(ValueError, match="use_bidirectional_attention is not supported"):
    gemma3.Gemma3Config.from_dict({**config, "text_config": {
        **config["text_config"], "use_bidirectional_attention": True}})


def test_kernels_in_interpret_mode_match_hf(saved, monkeypatch):
  """Every Pallas kernel in interpret mode (the GPU's path: split-K projections into the
  fused post-norm + add + norm, Gemma's norm kernels, paged attention): HF's logits over
  a prefill and decode steps."""
  from jax_paged.kernels import triton_backend
  original = triton_backend.kernel_mode
  monkeypatch.setattr(triton_backend, "kernel_mode", lambda interpret, *, supported=True:
                      original(True if interpret is None else interpret,
                               supported=supported))
  hf, path, module = saved
  model = module.from_pretrained(path, decode_impl="reference")
  assert_logits_track_hf(hf, model, [4, 9], 2, seed=7)
