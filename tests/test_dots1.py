"""dots.llm1 on the paged pool against Hugging Face transformers' Dots1ForCausalLM (CPU,
f32), loaded from its `save_pretrained` directory.

The HF model is random, its biases, norms and the router's correction bias too: GQA 8 q
heads over 2 kv heads with q / k norms and biases on q, k, v and o; layer 0 dense, layer
1's 8 experts in 4 groups (2 kept), 2 per token, weights renormalised and scaled by 2.5,
two shared experts; layer 1 windowed to 5 positions (max_window_layers 1). Tolerance as
test_llama's: 1e-4 on the logits.
"""

import numpy as np
import pytest
import torch
import transformers

import jax_paged
from models import dots1
from tests.test_glm4_moe import _randomise_correction_bias
from tests.test_llama import (VOCAB, assert_generate_and_engines_give_hfs_tokens,
                              assert_installed_cli_gives_hfs_tokens, assert_logits_track_hf,
                              randomised)

CONFIG = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
              num_hidden_layers=2, num_attention_heads=8, num_key_value_heads=2, head_dim=16,
              n_routed_experts=8, num_experts_per_tok=2, n_shared_experts=2, n_group=4,
              topk_group=2, first_k_dense_replace=1, norm_topk_prob=True,
              routed_scaling_factor=2.5, attention_bias=True, sliding_window=5,
              max_window_layers=1, max_position_embeddings=64, initializer_range=0.1,
              bos_token_id=None, eos_token_id=None, attn_implementation="eager")


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
  """(HF model, its save_pretrained directory)."""
  torch.manual_seed(0)
  hf = _randomise_correction_bias(randomised(transformers.Dots1ForCausalLM(
      transformers.Dots1Config(**CONFIG))))
  path = tmp_path_factory.mktemp("dots1")
  hf.save_pretrained(path)
  return hf, path


def test_prefill_and_decode_logits_match_hf(saved):
  """Logits over a prefill and decode steps: q / k norms, the o bias, the window on layer
  1 only, the grouped sigmoid router, two shared experts."""
  hf, path = saved
  model = dots1.from_pretrained(path)
  assert isinstance(model, jax_paged.PagedModel)
  attn = [layer.self_attn for layer in model.layers]
  assert [a.sliding_window for a in attn] == [None, 5]
  assert attn[0].q_norm is not None and attn[0].out.bias is not None
  np.testing.assert_array_equal(model.layers[1].mlp.correction_bias[...],
                                hf.model.layers[1].mlp.gate.e_score_correction_bias.numpy())
  assert_logits_track_hf(hf, model, [3, 8, 13], 7)


def test_generate_and_engine_give_hfs_tokens(saved):
  hf, path = saved
  assert_generate_and_engines_give_hfs_tokens(hf, dots1.from_pretrained(path))


def test_config_reads_hf_and_its_defaults(saved):
  """A saved config; one giving only the experts' counts (HF's Dots1Config defaults
  otherwise); the counts HF has no default for, required by name."""
  hf, _ = saved
  c = dots1.Dots1Config.from_dict(hf.config.to_dict())
  assert (c.layer_types, c.window(0), c.window(1), c.shared_expert_intermediate_size,
          c.qk_norm, c.out_bias, c.rotary_dim) == (
              ("full_attention", "sliding_attention"), None, 5, 64, True, True, 16)
  counts = dict(n_routed_experts=128, num_experts_per_tok=6, n_shared_experts=2)
  d, hf_default = dots1.Dots1Config.from_dict(counts), transformers.Dots1Config(**counts)
  assert (d.vocab_size, d.hidden_size, d.num_hidden_layers, d.head_dim, d.num_key_value_heads,
          d.max_position_embeddings, d.rms_norm_eps, d.norm_topk_prob, d.first_k_dense_replace,
          d.layer_types, d.sliding_window, d.rotary_dim) == (
              hf_default.vocab_size, hf_default.hidden_size, hf_default.num_hidden_layers,
              hf_default.hidden_size // hf_default.num_attention_heads,
              hf_default.num_key_value_heads, hf_default.max_position_embeddings,
              hf_default.rms_norm_eps, hf_default.norm_topk_prob,
              hf_default.first_k_dense_replace, tuple(hf_default.layer_types),
              hf_default.sliding_window, 144)
  with pytest.raises(ValueError, match="needs num_experts_per_tok, n_shared_experts"):
    dots1.Dots1Config.from_dict({"n_routed_experts": 8})


def test_cli_finds_the_model_type(saved, capsys):
  hf, path = saved
  assert_installed_cli_gives_hfs_tokens(hf, path, capsys, seed=7)
