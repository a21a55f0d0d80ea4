"""Gemma (the first generation) on the paged pool against Hugging Face transformers'
GemmaForCausalLM (CPU, f32), loaded from its `save_pretrained` directory.

The HF model is random, its norms' weights too (HF initialises them to 0, Gemma's
identity, which would hide a norm applied wrongly or not at all). Tolerance as
test_llama's: 1e-4 on the logits.
"""

import jax.numpy as jnp
import pytest
import torch
import transformers

import jax_paged
from models import gemma
from tests.test_llama import (_COMMON, assert_bf16_tracks_hf,
                              assert_generate_and_engines_give_hfs_tokens,
                              assert_installed_cli_gives_hfs_tokens,
                              assert_kernels_give_references_and_hfs_tokens, assert_logits_track_hf)

# MQA (gemma-2b's: 4 q heads over 1 kv head of 32, wider than hidden / heads), the
# released configs' legacy hidden_act "gelu", biases on q / k / v / o, the tied head.
CONFIG = dict(_COMMON, num_attention_heads=4, num_key_value_heads=1, head_dim=32,
              hidden_act="gelu", attention_bias=True, rope_theta=500.0, pad_token_id=None)


def _hf_model(**overrides):
  torch.manual_seed(0)
  hf = transformers.GemmaForCausalLM(transformers.GemmaConfig(**{**CONFIG, **overrides}))
  with torch.no_grad():
    for name, p in hf.named_parameters():
      if "norm" in name or name.endswith("bias"):
        p.normal_(0.0, 0.5)
  return hf.eval()


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
  """(HF model, its save_pretrained directory)."""
  hf = _hf_model()
  path = tmp_path_factory.mktemp("gemma")
  hf.save_pretrained(path)
  return hf, path


def test_prefill_and_decode_logits_match_hf(saved):
  """Logits over a prefill and decode steps: unit-offset RMS norms, the GeGLU MLP, the
  embeddings scaled by sqrt(hidden), MQA with a head dim wider than hidden / heads."""
  hf, path = saved
  model = gemma.from_pretrained(path)
  assert isinstance(model, jax_paged.PagedModel)
  assert model.config.embedding_multiplier == pytest.approx(8.0)  # sqrt(64)
  assert model.layers[0].input_layernorm.unit_offset and model.lm_head is None
  assert_logits_track_hf(hf, model, [3, 8, 13], 7)


def test_generate_and_engine_give_hfs_tokens(saved):
  """generate; an engine preempting in a tiny pool; one whose prompts share a cached
  prefix and whose long prompt is prefilled in chunks: HF's greedy tokens."""
  hf, path = saved
  assert_generate_and_engines_give_hfs_tokens(hf, gemma.from_pretrained(path))


def test_config_reads_hf_and_its_defaults(saved):
  """A saved config, a config.json omitting fields (Hugging Face's GemmaConfig defaults,
  as HF reads the same file), and what is refused by name."""
  hf, _ = saved
  c = gemma.GemmaConfig.from_dict(hf.config.to_dict())
  assert (c.num_key_value_heads, c.head_dim, c.hidden_act, c.qkv_bias, c.out_bias,
          c.tie_word_embeddings) == (1, 32, "gelu_pytorch_tanh", True, True, True)
  d = gemma.GemmaConfig.from_dict({"model_type": "gemma"})
  assert d == gemma.GemmaConfig.from_dict(transformers.GemmaConfig().to_dict())
  assert (d.vocab_size, d.hidden_size, d.num_key_value_heads, d.head_dim, d.bos_token_id,
          d.eos_token_id, d.out_bias) == (256000, 3072, 16, 256, 2, 1, False)
  for bad, message in (({"hidden_act": "silu"}, "hidden_act 'silu' is not supported"),
                       ({"use_bidirectional_attention": True}, "bidirectional"),
                       ({"model_type": "gemma2"}, "model_type 'gemma2' is not supported")):
    with pytest.raises(ValueError, match=message):
      gemma.GemmaConfig.from_dict(bad)


def test_bf16_tracks_hf(saved):
  hf, path = saved
  assert_bf16_tracks_hf(hf, gemma.from_pretrained(path, dtype=jnp.bfloat16))


def test_cli_finds_the_model_type(saved, capsys):
  hf, path = saved
  assert_installed_cli_gives_hfs_tokens(hf, path, capsys, seed=8)


@pytest.mark.gpu
def test_triton_kernels_give_the_references_and_hfs_tokens_on_gpu(tmp_path):
  """f32 on a GPU at Gemma's head dim 256 (MQA): the decode / prefill kernels and the norm
  kernels give the reference path's and HF's tokens."""
  hf = _hf_model(head_dim=256)
  hf.save_pretrained(tmp_path)
  assert_kernels_give_references_and_hfs_tokens(
      hf, lambda **kw: gemma.from_pretrained(tmp_path, **kw))
