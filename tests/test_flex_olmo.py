"""FlexOlmo on the paged pool against Hugging Face transformers' FlexOlmoForCausalLM (CPU,
f32), loaded from its `save_pretrained` directory.

The HF model is random, its norms too: OLMo 2's post-norm blocks and all-head q / k
norms (GQA 8 q heads over 2 kv heads of 8) over 4 experts 32 wide on both layers, 2 per
token, not renormalised. Tolerance as test_llama's: 1e-4 on the logits.
"""

import jax.numpy as jnp
import pytest
import torch
import transformers

import jax_paged
from models import flex_olmo
from models import moe
from tests.test_llama import (_COMMON, assert_bf16_tracks_hf,
                              assert_generate_and_engines_give_hfs_tokens,
                              assert_installed_cli_gives_hfs_tokens,
                              assert_kernels_give_references_and_hfs_tokens,
                              assert_logits_track_hf, randomised)

CONFIG = dict(_COMMON, intermediate_size=32, num_attention_heads=8, num_key_value_heads=2,
              num_experts=4, num_experts_per_tok=2, pad_token_id=None)


def _hf_model(**overrides):
  torch.manual_seed(0)
  return randomised(transformers.FlexOlmoForCausalLM(
      transformers.FlexOlmoConfig(**{**CONFIG, **overrides})))


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
  """(HF model, its save_pretrained directory)."""
  hf = _hf_model()
  path = tmp_path_factory.mktemp("flex_olmo")
  hf.save_pretrained(path)
  return hf, path


def test_prefill_and_decode_logits_match_hf(saved):
  """Logits over a prefill and decode steps: the experts' output RMS-normalised before
  its residual add, OLMo 2's attention."""
  hf, path = saved
  model = flex_olmo.from_pretrained(path)
  assert isinstance(model, jax_paged.PagedModel)
  assert all(isinstance(layer.mlp, moe.SparseMoE) for layer in model.layers)
  assert model.layers[0].self_attn.qk_norm_all_heads
  assert_logits_track_hf(hf, model, [3, 8, 13], 7)


def test_generate_and_engine_give_hfs_tokens(saved):
  hf, path = saved
  assert_generate_and_engines_give_hfs_tokens(hf, flex_olmo.from_pretrained(path))


def test_config_reads_hf_and_its_defaults(saved):
  """A saved config; an empty one (HF's FlexOlmoConfig defaults); errors."""
  hf, _ = saved
  c = flex_olmo.FlexOlmoConfig.from_dict(hf.config.to_dict())
  assert (c.num_local_experts, c.num_experts_per_tok, c.expert_width, c.norm_topk_prob,
          c.qk_norm_all_heads, c.sparse(0)) == (4, 2, 32, False, True, True)
  d = flex_olmo.FlexOlmoConfig.from_dict({})
  hf_default = transformers.FlexOlmoConfig()
  assert d == flex_olmo.FlexOlmoConfig.from_dict(hf_default.to_dict())
  assert (d.vocab_size, d.hidden_size, d.num_local_experts, d.num_experts_per_tok,
          d.rope_theta, d.rms_norm_eps, d.eos_token_id, d.bos_token_id) == (
              hf_default.vocab_size, hf_default.hidden_size, hf_default.num_experts,
              hf_default.num_experts_per_tok, hf_default.rope_parameters["rope_theta"],
              hf_default.rms_norm_eps, hf_default.eos_token_id, hf_default.bos_token_id)
  for bad, message in (({"num_experts": 2, "num_experts_per_tok": 3}, "must be <="),
                       ({"model_type": "olmoe"}, "model_type 'olmoe' is not supported")):
    with pytest.raises(ValueError, match=message):
      flex_olmo.FlexOlmoConfig.from_dict(bad)


def test_bf16_tracks_hf(saved):
  hf, path = saved
  assert_bf16_tracks_hf(hf, flex_olmo.from_pretrained(path, dtype=jnp.bfloat16))


def test_cli_finds_the_model_type(saved, capsys):
  hf, path = saved
  assert_installed_cli_gives_hfs_tokens(hf, path, capsys, seed=19)


@pytest.mark.gpu
def test_triton_kernels_give_the_references_and_hfs_tokens_on_gpu(tmp_path):
  """f32 on a GPU at head dim 64: the decode and prefill kernels, the grouped expert
  matmuls and the fused post-norm adds give the reference path's and HF's tokens."""
  hf = _hf_model(hidden_size=256, num_attention_heads=4)
  hf.save_pretrained(tmp_path)
  assert_kernels_give_references_and_hfs_tokens(
      hf, lambda **kw: flex_olmo.from_pretrained(tmp_path, **kw))
