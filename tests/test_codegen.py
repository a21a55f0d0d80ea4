"""CodeGen on the paged pool against Hugging Face transformers' CodeGenForCausalLM (CPU,
f32), loaded from its `save_pretrained` directory.

The HF model is random, its LayerNorms' weights and every bias too (the LM head's
included): 8 heads of 8 (two per block of qkv_proj's model-parallel layout), interleaved
RoPE on the first 6 features of each, tanh GELU. Tolerance as test_llama's: 1e-4 on the
logits.
"""

import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers

import jax_paged
from models import codegen
from tests.test_llama import (_COMMON, assert_bf16_tracks_hf,
                              assert_generate_and_engines_give_hfs_tokens,
                              assert_installed_cli_gives_hfs_tokens,
                              assert_kernels_give_references_and_hfs_tokens,
                              assert_logits_track_hf, assert_lora_adapters_match_peft,
                              randomised)

CONFIG = dict(vocab_size=_COMMON["vocab_size"], n_positions=64, n_ctx=64, n_embd=64,
              n_layer=2, n_head=8, rotary_dim=6, n_inner=96, initializer_range=0.1,
              bos_token_id=None, eos_token_id=None, attn_implementation="eager")


def _hf_model(**overrides):
  torch.manual_seed(0)
  return randomised(transformers.CodeGenForCausalLM(transformers.CodeGenConfig(
      **{**CONFIG, **overrides})))


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
  """(HF model, its save_pretrained directory)."""
  hf = _hf_model()
  path = tmp_path_factory.mktemp("codegen")
  hf.save_pretrained(path)
  return hf, path


def test_qkv_rows_pick_each_block():
  """qkv_proj's row order: 4 blocks of [q, v, k] quarters; ours q, k (rotate-half), v."""
  c = codegen.CodeGenConfig.from_dict({**CONFIG, "model_type": "codegen"})
  rows = codegen.qkv_rows(c)
  assert sorted(rows.tolist()) == list(range(3 * 64))
  np.testing.assert_array_equal(rows[128:144], np.arange(16, 32))  # v: block 0's second
  np.testing.assert_array_equal(rows[:8], [0, 2, 4, 1, 3, 5, 6, 7])  # q head 0, 6 rotated


def test_prefill_and_decode_logits_match_hf(saved):
  """Logits over a prefill and decode steps: q / k / v out of qkv_proj's blocks, GPT-J's
  interleaved RoPE and parallel block, the biased head."""
  hf, path = saved
  model = codegen.from_pretrained(path)
  assert isinstance(model, jax_paged.PagedModel)
  assert_logits_track_hf(hf, model, [3, 8, 13], 7)


def test_generate_and_engine_give_hfs_tokens(saved):
  hf, path = saved
  assert_generate_and_engines_give_hfs_tokens(hf, codegen.from_pretrained(path))


def test_lora_adapters_match_peft(tmp_path):
  """PEFT adapters on qkv_proj (its B's columns where the load put its rows), out_proj,
  fc_in and fc_out."""
  assert_lora_adapters_match_peft(_hf_model, codegen.from_pretrained,
                                  ["qkv_proj", "out_proj", "fc_in", "fc_out"], tmp_path)


def test_config_reads_hf_and_its_defaults(saved):
  """A saved config, an empty one (HF's defaults: CodeGen-6B's shape), errors."""
  hf, _ = saved
  c = codegen.CodeGenConfig.from_dict(hf.config.to_dict())
  assert (c.hidden_size, c.num_attention_heads, c.head_dim, c.rotary_dim,
          c.max_position_embeddings) == (64, 8, 8, 6, 64)
  d = codegen.CodeGenConfig.from_dict({"model_type": "codegen"})
  want = transformers.CodeGenConfig()
  assert d == codegen.CodeGenConfig.from_dict(want.to_dict())
  assert (d.vocab_size, d.hidden_size, d.num_hidden_layers, d.rotary_dim,
          d.tie_word_embeddings) == (want.vocab_size, want.n_embd, want.n_layer,
                                     want.rotary_dim, False)
  for bad, message in (({"n_head": 6, "n_embd": 48, "rotary_dim": 8},
                        "must be a multiple of 4"),
                       ({"model_type": "gptj"}, "model_type 'gptj' is not supported")):
    with pytest.raises(ValueError, match=message):
      codegen.CodeGenConfig.from_dict({"model_type": "codegen", **bad})


def test_bf16_tracks_hf(saved):
  hf, path = saved
  assert_bf16_tracks_hf(hf, codegen.from_pretrained(path, dtype=jnp.bfloat16))


def test_cli_finds_the_model_type(saved, capsys):
  hf, path = saved
  assert_installed_cli_gives_hfs_tokens(hf, path, capsys, seed=7)


@pytest.mark.gpu
def test_triton_kernels_give_the_references_and_hfs_tokens_on_gpu(tmp_path):
  """f32 on a GPU at head dim 64 (RoPE on 16 of its features): the kernels give the
  reference path's and HF's tokens."""
  hf = _hf_model(n_embd=256, n_head=4, rotary_dim=16)
  hf.save_pretrained(tmp_path)
  assert_kernels_give_references_and_hfs_tokens(
      hf, lambda **kw: codegen.from_pretrained(tmp_path, **kw))
