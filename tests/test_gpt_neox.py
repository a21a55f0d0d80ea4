"""GPT-NeoX (Pythia) on the paged pool against Hugging Face transformers'
GPTNeoXForCausalLM (CPU, f32), loaded from its `save_pretrained` directory.

The HF model is random, its LayerNorms' weights and every bias too (HF's ones and zeros
would hide a norm or bias applied wrongly or not at all). Tolerance as test_llama's: 1e-4
on the logits.
"""

import jax.numpy as jnp
import pytest
import torch
import transformers

import jax_paged
from models import gpt_neox
from tests.test_llama import (_COMMON, assert_bf16_tracks_hf,
                              assert_generate_and_engines_give_hfs_tokens,
                              assert_installed_cli_gives_hfs_tokens,
                              assert_kernels_give_references_and_hfs_tokens, assert_logits_track_hf,
                              randomised)

# 4 heads of 16, RoPE on the first 4 features of each (Pythia's rotary_pct 0.25), the
# parallel residual, exact GELU, untied head (Pythia's).
CONFIG = dict(_COMMON, num_attention_heads=4, rope_parameters={
    "rope_type": "default", "rope_theta": 500.0, "partial_rotary_factor": 0.25},
              layer_norm_eps=1e-4)


def _hf_model(**overrides):
  torch.manual_seed(0)
  return randomised(transformers.GPTNeoXForCausalLM(transformers.GPTNeoXConfig(
      **{**CONFIG, **overrides})))


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
  """(HF model, its save_pretrained directory)."""
  hf = _hf_model()
  path = tmp_path_factory.mktemp("gpt_neox")
  hf.save_pretrained(path)
  return hf, path


def test_prefill_and_decode_logits_match_hf(saved):
  """Logits over a prefill and decode steps: query_key_value's heads reordered, RoPE on a
  quarter of each head, the parallel residual, LayerNorms and biases."""
  hf, path = saved
  model = gpt_neox.from_pretrained(path)
  assert isinstance(model, jax_paged.PagedModel)
  attention = model.layers[0].self_attn
  assert (attention.rope.head_dim, attention.rope.rotary_dim) == (16, 4)
  assert model.layers[0].parallel and model.lm_head is not None
  assert_logits_track_hf(hf, model, [3, 8, 13], 7)


def test_sequential_residual_and_half_rotary_track_hf(tmp_path):
  """use_parallel_residual=False (Llama's sequential block), RoPE on half of each head
  with linear scaling, tanh GELU and a tied head: HF's logits."""
  hf = _hf_model(use_parallel_residual=False, hidden_act="gelu_new", tie_word_embeddings=True,
                 rope_parameters={"rope_type": "linear", "factor": 2.0, "rope_theta": 500.0,
                                  "partial_rotary_factor": 0.5})
  hf.save_pretrained(tmp_path)
  model = gpt_neox.from_pretrained(tmp_path)
  assert not model.layers[0].parallel and model.lm_head is None
  assert model.layers[0].self_attn.rope.rotary_dim == 8
  assert_logits_track_hf(hf, model, [5, 11], 4)


def test_generate_and_engine_give_hfs_tokens(saved):
  """generate; an engine preempting in a tiny pool; one whose prompts share a cached
  prefix and whose long prompt is prefilled in chunks: HF's greedy tokens."""
  hf, path = saved
  model = gpt_neox.from_pretrained(path)
  assert_generate_and_engines_give_hfs_tokens(hf, model)


def test_config_reads_hf_its_defaults_and_transformers_4_names(saved):
  """A saved config; a config.json omitting fields (Hugging Face's GPTNeoXConfig
  defaults, as HF reads the same file); transformers 4's rotary_pct / rotary_emb_base
  (Pythia's config.json) read as 5's rope_parameters; what is refused, by name."""
  hf, _ = saved
  c = gpt_neox.GPTNeoXConfig.from_dict(hf.config.to_dict())
  assert (c.num_key_value_heads, c.head_dim, c.rotary_dim, c.rope_theta,
          c.use_parallel_residual, c.layer_norm_eps) == (4, 16, 4, 500.0, True, 1e-4)
  hf_defaults = transformers.GPTNeoXConfig().to_dict()
  d = gpt_neox.GPTNeoXConfig.from_dict({"model_type": "gpt_neox"})
  assert d == gpt_neox.GPTNeoXConfig.from_dict(hf_defaults)
  assert (d.vocab_size, d.hidden_size, d.num_key_value_heads, d.rotary_dim, d.hidden_act,
          d.eos_token_id, d.qkv_bias, d.out_bias, d.tie_word_embeddings) == (
      50432, 6144, 64, 24, "gelu", 2, True, True, False)
  pythia = {"model_type": "gpt_neox", "hidden_size": 512, "num_attention_heads": 8,
            "rotary_pct": 0.5, "rotary_emb_base": 123.0, "use_parallel_residual": False}
  old = gpt_neox.GPTNeoXConfig.from_dict(pythia)
  assert old == gpt_neox.GPTNeoXConfig.from_dict(
      transformers.GPTNeoXConfig(**pythia).to_dict())
  assert (old.rotary_dim, old.rope_theta, old.use_parallel_residual) == (32, 123.0, False)
  for bad, message in (({"rotary_pct": 0.0}, r"partial_rotary_factor must be in \(0, 1\], "
                                             r"got 0.0"),
                       ({"rotary_pct": 0.02}, "partial_rotary_factor 0.02 of head_dim 96 "
                                              "rotates 1 features; RoPE needs a positive even "
                                              "number"),
                       ({"hidden_act": "swish"}, "hidden_act 'swish' is not supported"),
                       ({"rope_scaling": {"type": "dynamic", "factor": 2.0}},
                        "rope_scaling type 'dynamic' is not supported")):
    with pytest.raises(ValueError, match=message):
      gpt_neox.GPTNeoXConfig.from_dict(bad)


def test_bf16_tracks_hf(saved):
  hf, path = saved
  assert_bf16_tracks_hf(hf, gpt_neox.from_pretrained(path, dtype=jnp.bfloat16))


def test_cli_finds_the_model_type(saved, capsys):
  hf, path = saved
  assert_installed_cli_gives_hfs_tokens(hf, path, capsys, seed=6)


@pytest.mark.gpu
def test_triton_kernels_give_the_references_and_hfs_tokens_on_gpu(tmp_path):
  """f32 on a GPU at head dim 64 (RoPE on 16 features): the decode / prefill kernels, the
  fused projection-adds of the parallel residual and the LayerNorm-fused add give the
  reference path's and HF's tokens."""
  hf = _hf_model(hidden_size=256, num_attention_heads=4)
  hf.save_pretrained(tmp_path)
  assert_kernels_give_references_and_hfs_tokens(
      hf, lambda **kw: gpt_neox.from_pretrained(tmp_path, **kw))
