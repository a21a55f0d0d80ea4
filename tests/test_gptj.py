"""GPT-J on the paged pool against Hugging Face transformers' GPTJForCausalLM (CPU, f32),
loaded from its `save_pretrained` directory.

The HF model is random, its LayerNorms' weights and every bias too (the LM head's
included). Tolerance as test_llama's: 1e-4 on the logits.
"""

import jax.numpy as jnp
import pytest
import torch
import transformers

import jax_paged
from models import gptj
from tests.test_llama import (_COMMON, assert_bf16_tracks_hf,
                              assert_generate_and_engines_give_hfs_tokens,
                              assert_installed_cli_gives_hfs_tokens,
                              assert_kernels_give_references_and_hfs_tokens,
                              assert_logits_track_hf, assert_lora_adapters_match_peft,
                              randomised)

# 4 heads of 16, interleaved RoPE on the first 6 features of each (GPT-J-6B: 64 of 256),
# tanh GELU, a biased head.
CONFIG = dict(vocab_size=_COMMON["vocab_size"], n_positions=64, n_embd=64, n_layer=2,
              n_head=4, rotary_dim=6, n_inner=96, layer_norm_epsilon=1e-4,
              initializer_range=0.1, bos_token_id=None, eos_token_id=None,
              attn_implementation="eager")


def _hf_model(**overrides):
  torch.manual_seed(0)
  return randomised(transformers.GPTJForCausalLM(transformers.GPTJConfig(
      **{**CONFIG, **overrides})))


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
  """(HF model, its save_pretrained directory)."""
  hf = _hf_model()
  path = tmp_path_factory.mktemp("gptj")
  hf.save_pretrained(path)
  return hf, path


def test_prefill_and_decode_logits_match_hf(saved):
  """Logits over a prefill and decode steps: interleaved RoPE on 6 of 16 features through
  the reordered q / k rows, one LayerNorm for both parallel branches, the biased head."""
  hf, path = saved
  model = gptj.from_pretrained(path)
  assert isinstance(model, jax_paged.PagedModel)
  attention = model.layers[0].self_attn
  assert attention.rope.rotary_dim == 6 and attention.qkv.bias is None
  assert attention.out.bias is None and model.layers[0].mlp.c_fc.bias is not None
  assert_logits_track_hf(hf, model, [3, 8, 13], 7)


def test_generate_and_engine_give_hfs_tokens(saved):
  hf, path = saved
  assert_generate_and_engines_give_hfs_tokens(hf, gptj.from_pretrained(path))


def test_lora_adapters_match_peft(tmp_path):
  """PEFT adapters on q / k / v / out_proj, fc_in and fc_out: the served model's greedy
  tokens are those of the adapter merged into HF's weights (q_proj's and k_proj's B
  columns placed where the RoPE reorder put their rows)."""
  assert_lora_adapters_match_peft(_hf_model, gptj.from_pretrained,
                                  ["q_proj", "k_proj", "v_proj", "out_proj", "fc_in", "fc_out"], tmp_path)


def test_config_reads_hf_and_its_defaults(saved):
  """A saved config, a config.json omitting fields (HF's GPTJConfig defaults, as HF reads
  the same file), rotary_dim None (the whole head), and errors."""
  hf, _ = saved
  c = gptj.GPTJConfig.from_dict(hf.config.to_dict())
  assert (c.hidden_size, c.num_attention_heads, c.head_dim, c.rotary_dim, c.intermediate_size,
          c.layer_norm_eps, c.qkv_bias, c.out_bias, c.mlp_bias) == (
              64, 4, 16, 6, 96, 1e-4, False, False, True)
  d = gptj.GPTJConfig.from_dict({"model_type": "gptj"})
  assert d == gptj.GPTJConfig.from_dict(transformers.GPTJConfig().to_dict())
  assert (d.vocab_size, d.hidden_size, d.intermediate_size, d.num_hidden_layers, d.head_dim,
          d.rotary_dim, d.hidden_act, d.tie_word_embeddings, d.eos_token_id) == (
              50400, 4096, 16384, 28, 256, 64, "gelu_new", False, 50256)
  assert gptj.GPTJConfig.from_dict({"model_type": "gptj", "rotary_dim": None}).rotary_dim == 256
  for bad, message in (({"activation_function": "swish"}, "hidden_act 'swish'"),
                       ({"model_type": "codegen"}, "model_type 'codegen' is not supported")):
    with pytest.raises(ValueError, match=message):
      gptj.GPTJConfig.from_dict(bad)


def test_bf16_tracks_hf(saved):
  hf, path = saved
  assert_bf16_tracks_hf(hf, gptj.from_pretrained(path, dtype=jnp.bfloat16))


def test_cli_finds_the_model_type(saved, capsys):
  hf, path = saved
  assert_installed_cli_gives_hfs_tokens(hf, path, capsys, seed=7)


@pytest.mark.gpu
def test_triton_kernels_give_the_references_and_hfs_tokens_on_gpu(tmp_path):
  """f32 on a GPU at head dim 64 (RoPE on 16 of its features): the decode / prefill
  kernels, the fused fc_in + GELU GEMM and the LayerNorm-fused residual adds give the
  reference path's and HF's tokens."""
  hf = _hf_model(n_embd=256, rotary_dim=16)
  hf.save_pretrained(tmp_path)
  assert_kernels_give_references_and_hfs_tokens(
      hf, lambda **kw: gptj.from_pretrained(tmp_path, **kw))
