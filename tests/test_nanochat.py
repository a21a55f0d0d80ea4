"""NanoChat on the paged pool against Hugging Face transformers' NanoChatForCausalLM (CPU,
f32), loaded from its `save_pretrained` directory.

The HF model is random, its biases too (its norms have no weights): GQA 8 q heads over 2
kv heads of 8, RoPE turning each pair by minus its angle, weightless q / k norms after it,
the embeddings normalised, relu^2's fc1 / fc2, biases on q / k / v / o, the logits capped
at 15 (the random logits reach it: the cap changes them). Tolerance as test_llama's: 1e-4
on the logits.
"""

import dataclasses

import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers

import jax_paged
from jax_paged import nn as paged_nn
from models import nanochat
from tests.test_llama import (_COMMON, assert_bf16_tracks_hf,
                              assert_generate_and_engines_give_hfs_tokens,
                              assert_installed_cli_gives_hfs_tokens,
                              assert_kernels_give_references_and_hfs_tokens,
                              assert_logits_track_hf, assert_lora_adapters_match_peft,
                              randomised)

CONFIG = dict(_COMMON, num_attention_heads=8, num_key_value_heads=2, attention_bias=True,
              pad_token_id=None, initializer_range=0.5, final_logit_softcapping=15.0)


def _hf_model(**overrides):
  torch.manual_seed(0)
  return randomised(transformers.NanoChatForCausalLM(
      transformers.NanoChatConfig(**{**CONFIG, **overrides})))


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
  """(HF model, its save_pretrained directory)."""
  hf = _hf_model()
  path = tmp_path_factory.mktemp("nanochat")
  hf.save_pretrained(path)
  return hf, path


def test_prefill_and_decode_logits_match_hf(saved):
  """Logits over a prefill and decode steps: the reversed RoPE, the weightless norms (the
  embeddings' too), relu^2, the cap."""
  hf, path = saved
  model = nanochat.from_pretrained(path)
  assert isinstance(model, jax_paged.PagedModel)
  attn = model.layers[0].self_attn
  assert attn.rope.reverse and attn.qk_norm_after_rope
  np.testing.assert_array_equal(np.asarray(attn.q_norm.weight[...]), 1.0)
  with torch.no_grad():
    assert hf(torch.arange(1, 9)[None]).logits.abs().max() > 7.5  # the cap bends them
  assert_logits_track_hf(hf, model, [3, 8, 13], 7)


def test_reverse_rope_turns_each_pair_back():
  """`RotaryEmbedding(reverse=True)` at p is the plain rotation at -p, and HF's NanoChat
  rotation."""
  from transformers.models.nanochat import modeling_nanochat  # pylint: disable=import-outside-toplevel
  x = np.random.default_rng(0).standard_normal((3, 2, 8)).astype(np.float32)
  pos = np.array([0, 5, 17])
  rope = paged_nn.RotaryEmbedding(8, theta=100.0, reverse=True)
  ours = np.asarray(rope(jnp.asarray(x), jnp.asarray(pos)))
  plain = dataclasses.replace(rope, reverse=False)
  np.testing.assert_allclose(ours, np.asarray(plain(jnp.asarray(x), jnp.asarray(-pos))),
                             rtol=1e-5, atol=1e-6)
  angles = pos[:, None] * rope.inv_freq()[None, :]
  cos = torch.from_numpy(np.concatenate([np.cos(angles)] * 2, -1))
  sin = torch.from_numpy(np.concatenate([np.sin(angles)] * 2, -1))
  t = torch.from_numpy(x)
  want, _ = modeling_nanochat.apply_rotary_pos_emb(t, t, cos, sin, unsqueeze_dim=1)
  np.testing.assert_allclose(ours, want.numpy(), rtol=1e-5, atol=1e-6)


def test_generate_and_engine_give_hfs_tokens(saved):
  hf, path = saved
  assert_generate_and_engines_give_hfs_tokens(hf, nanochat.from_pretrained(path))


def test_lora_adapters_match_peft(tmp_path):
  """PEFT adapters on q / k / v / o_proj, fc1 and fc2 (PEFT's names)."""
  assert_lora_adapters_match_peft(_hf_model, nanochat.from_pretrained,
                                  ["q_proj", "k_proj", "v_proj", "o_proj", "fc1", "fc2"],
                                  tmp_path)


def test_config_reads_hf_and_its_defaults(saved):
  """A saved config, an empty one (HF's defaults), errors."""
  hf, _ = saved
  c = nanochat.NanoChatConfig.from_dict(hf.config.to_dict())
  assert (c.num_key_value_heads, c.head_dim, c.final_logit_softcapping, c.out_bias,
          c.rope.reverse) == (2, 8, 15.0, True, True)
  d = nanochat.NanoChatConfig.from_dict({})
  want = transformers.NanoChatConfig()
  assert d == nanochat.NanoChatConfig.from_dict(want.to_dict())
  assert (d.vocab_size, d.hidden_size, d.intermediate_size, d.num_hidden_layers,
          d.num_attention_heads, d.rope_theta, d.final_logit_softcapping) == (
              want.vocab_size, want.hidden_size, want.intermediate_size,
              want.num_hidden_layers, want.num_attention_heads,
              want.rope_parameters["rope_theta"], want.final_logit_softcapping)
  with pytest.raises(ValueError, match="final_logit_softcapping must be a positive"):
    nanochat.NanoChatConfig.from_dict({"final_logit_softcapping": 0.0})


def test_bf16_tracks_hf(saved):
  hf, path = saved
  assert_bf16_tracks_hf(hf, nanochat.from_pretrained(path, dtype=jnp.bfloat16))


def test_cli_finds_the_model_type(saved, capsys):
  hf, path = saved
  assert_installed_cli_gives_hfs_tokens(hf, path, capsys, seed=15)


@pytest.mark.gpu
def test_triton_kernels_give_the_references_and_hfs_tokens_on_gpu(tmp_path):
  """f32 on a GPU at head dim 64: the kernels give the reference path's and HF's tokens."""
  hf = _hf_model(hidden_size=512)
  hf.save_pretrained(tmp_path)
  assert_kernels_give_references_and_hfs_tokens(
      hf, lambda **kw: nanochat.from_pretrained(tmp_path, **kw))
