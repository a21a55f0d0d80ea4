"""MPT on the paged pool against Hugging Face transformers' MptForCausalLM (CPU, f32),
loaded from its `save_pretrained` directory (4 heads saved in shards; 6 heads, whose
ALiBi slopes are not one geometric sequence, with a softmax_scale and clip_qkv, in one
file).

The HF model is random, its LayerNorms' weights too (MPT has no biases). Tolerance as
test_llama's: 1e-4 on the logits.
"""

import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers

import jax_paged
from jax_paged import nn as paged_nn
from models import mpt
from tests.test_llama import (_COMMON, assert_bf16_tracks_hf,
                              assert_generate_and_engines_give_hfs_tokens,
                              assert_installed_cli_gives_hfs_tokens,
                              assert_kernels_give_references_and_hfs_tokens,
                              assert_logits_track_hf, assert_lora_adapters_match_peft,
                              randomised)

CONFIG = dict(vocab_size=_COMMON["vocab_size"], d_model=64, n_heads=4, n_layers=2,
              max_seq_len=64, layer_norm_epsilon=1e-4, initializer_range=0.1,
              bos_token_id=None, eos_token_id=None, attn_implementation="eager")
VARIANTS = {"four": {}, "six": dict(d_model=96, n_heads=6,
                                    attn_config=dict(softmax_scale=0.2, clip_qkv=0.5))}


def _hf_model(**overrides):
  torch.manual_seed(0)
  return randomised(transformers.MptForCausalLM(transformers.MptConfig(
      **{**CONFIG, **overrides})), norm="norm")


@pytest.fixture(scope="module", params=list(VARIANTS))
def saved(request, tmp_path_factory):
  """(HF model, its save_pretrained directory)."""
  hf = _hf_model(**VARIANTS[request.param])
  path = tmp_path_factory.mktemp(request.param)
  hf.save_pretrained(path, **({"max_shard_size": "40KB"} if request.param == "four" else {}))
  return hf, path


def test_prefill_and_decode_logits_match_hf(saved):
  """Logits over a prefill and decode steps: ALiBi's biases over the prompt and decode
  kernels' offsets, softmax_scale, bias-free LayerNorms, Wqkv as our fused layout."""
  hf, path = saved
  model = mpt.from_pretrained(path)
  assert isinstance(model, jax_paged.PagedModel)
  attn = model.layers[0].self_attn
  assert attn.rope is None and model.layers[0].input_layernorm.bias is None
  c = hf.config
  np.testing.assert_array_equal(attn.alibi_slopes[...], paged_nn.alibi_slopes(c.n_heads))
  assert attn.scale == (c.attn_config.softmax_scale or 16 ** -0.5)
  assert attn.clip_qkv == c.attn_config.clip_qkv
  assert_logits_track_hf(hf, model, [3, 8, 13], 7)


def test_generate_and_engine_give_hfs_tokens(saved):
  hf, path = saved
  assert_generate_and_engines_give_hfs_tokens(hf, mpt.from_pretrained(path))


def test_lora_adapters_match_peft(tmp_path):
  """PEFT adapters on Wqkv, out_proj, up_proj and down_proj."""
  assert_lora_adapters_match_peft(_hf_model, mpt.from_pretrained,
                                  ["Wqkv", "out_proj", "up_proj", "down_proj"], tmp_path)


def test_config_reads_hf_and_its_defaults(saved):
  """A saved config, MPT-7B's config.json fields, an empty one (HF's MptConfig
  defaults), and what HF's MPT does not compute refused by name."""
  hf, _ = saved
  c = mpt.MptConfig.from_dict(hf.config.to_dict())
  assert (c.hidden_size, c.num_attention_heads, c.head_dim, c.intermediate_size,
          c.max_position_embeddings, c.layer_norm_epsilon, c.tie_word_embeddings) == (
              hf.config.d_model, hf.config.n_heads, 16, 4 * hf.config.d_model, 64, 1e-4, True)
  seven = mpt.MptConfig.from_dict({
      "model_type": "mpt", "d_model": 4096, "n_heads": 32, "n_layers": 32,
      "expansion_ratio": 4, "max_seq_len": 2048, "vocab_size": 50432, "no_bias": True,
      "logit_scale": None, "learned_pos_emb": True, "norm_type": "low_precision_layernorm",
      "attn_config": {"alibi": True, "alibi_bias_max": 8, "attn_impl": "torch",
                      "clip_qkv": None, "qk_ln": False, "softmax_scale": None,
                      "prefix_lm": False, "attn_type": "multihead_attention"}})
  assert (seven.head_dim, seven.intermediate_size, seven.max_model_len,
          seven.attention_multiplier) == (128, 16384, 2048, None)
  d = mpt.MptConfig.from_dict({"model_type": "mpt"})
  hf_d = transformers.MptConfig()
  assert (d.vocab_size, d.hidden_size, d.num_attention_heads, d.num_hidden_layers,
          d.max_position_embeddings) == (hf_d.vocab_size, hf_d.d_model, hf_d.n_heads,
                                         hf_d.n_layers, hf_d.max_seq_len)
  assert mpt.MptConfig.from_dict({"attn_config": {"clip_qkv": 8.0}}).clip_qkv == 8.0
  for bad, message in (({"attn_config": {"clip_qkv": -1.0}}, "clip_qkv must be a positive"),
                       ({"attn_config": {"qk_ln": True}}, "qk_ln=True"),
                       ({"attn_config": {"alibi": False}}, "alibi=False"),
                       ({"attn_config": {"alibi_bias_max": 16}}, "alibi_bias_max=16"),
                       ({"attn_config": {"attn_type": "multiquery_attention"}}, "attn_type"),
                       ({"logit_scale": 0.5}, "logit_scale=0.5"),
                       ({"no_bias": False}, "no_bias=False"),
                       ({"norm_type": "rmsnorm"}, "norm_type 'rmsnorm'"),
                       ({"model_type": "gpt2"}, "model_type 'gpt2' is not supported")):
    with pytest.raises(ValueError, match=message):
      mpt.MptConfig.from_dict(bad)


def test_bf16_tracks_hf(saved):
  hf, path = saved
  assert_bf16_tracks_hf(hf, mpt.from_pretrained(path, dtype=jnp.bfloat16),
                        f32_params=("alibi_slopes",))


def test_cli_finds_the_model_type(saved, capsys):
  hf, path = saved
  assert_installed_cli_gives_hfs_tokens(hf, path, capsys, seed=7)


@pytest.mark.gpu
def test_triton_kernels_give_the_references_and_hfs_tokens_on_gpu(tmp_path):
  """f32 on a GPU at head dim 64: the decode and prefill kernels with ALiBi, the fused
  GEMMs and the LayerNorm-fused residual adds give the reference path's and HF's
  tokens."""
  hf = _hf_model(d_model=256)
  hf.save_pretrained(tmp_path)
  assert_kernels_give_references_and_hfs_tokens(
      hf, lambda **kw: mpt.from_pretrained(tmp_path, **kw))
