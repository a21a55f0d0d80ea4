"""Cohere (Command R / R+) and Cohere2 (Command R7B / A) on the paged pool against Hugging
Face transformers' CohereForCausalLM and Cohere2ForCausalLM (CPU, f32), loaded from
their `save_pretrained` directories.

The HF models are random, their LayerNorms' weights (the per-head q / k ones included)
and every bias too (HF's ones and zeros would hide a norm or bias applied wrongly, or a
RoPE reorder missing from one of them). Tolerance as test_llama's: 1e-4 on the logits.
"""

import jax.numpy as jnp
import pytest
import torch
import transformers

import jax_paged
from models import cohere
from tests.test_llama import (_COMMON, assert_bf16_tracks_hf,
                              assert_generate_and_engines_give_hfs_tokens,
                              assert_installed_cli_gives_hfs_tokens,
                              assert_kernels_give_references_and_hfs_tokens,
                              assert_logits_track_hf, assert_lora_adapters_match_peft,
                              randomised)

# Command R+'s block: GQA 4 q heads over 2 kv heads of 16, per-head q / k norms, with
# biases on q / k / v / o (attention_bias) so that the RoPE reorder of q's and k's is
# checked too; a logit scale that is not a power of two.
CONFIG = dict(_COMMON, num_attention_heads=4, num_key_value_heads=2, use_qk_norm=True,
              attention_bias=True, rope_theta=500.0, layer_norm_eps=1e-4, logit_scale=0.3,
              tie_word_embeddings=True)
# Command R7B's: 3 windowed RoPE layers, then a full-attention NoPE one (4 layers, a window
# shorter than the prompts).
COHERE2 = dict(_COMMON, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
               rope_theta=500.0, layer_norm_eps=1e-4, logit_scale=0.3, sliding_window=5)


def _hf_model(**overrides):
  torch.manual_seed(0)
  return randomised(transformers.CohereForCausalLM(transformers.CohereConfig(
      **{**CONFIG, **overrides})))


def _hf_cohere2():
  torch.manual_seed(0)
  return randomised(transformers.Cohere2ForCausalLM(transformers.Cohere2Config(**COHERE2)))


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
  """(HF model, its save_pretrained directory)."""
  hf = _hf_model()
  path = tmp_path_factory.mktemp("cohere")
  hf.save_pretrained(path)
  return hf, path


def test_prefill_and_decode_logits_match_hf(saved):
  """Logits over a prefill and decode steps: the parallel block's one bias-free LayerNorm,
  interleaved RoPE through the reordered q / k rows, per-head q / k norms, the scale."""
  hf, path = saved
  model = cohere.from_pretrained(path)
  assert isinstance(model, jax_paged.PagedModel)
  block = model.layers[0]
  assert block.parallel and block.input_layernorm.bias is None and model.lm_head is None
  assert block.self_attn.k_norm.scale[...].shape == (2, 16)
  assert_logits_track_hf(hf, model, [3, 8, 13], 7)


def test_without_qk_norms_or_biases_tracks_hf(tmp_path):
  """Command R's own block (no q / k norms, no biases), an untied head: HF's logits."""
  hf = _hf_model(use_qk_norm=False, attention_bias=False, tie_word_embeddings=False)
  hf.save_pretrained(tmp_path)
  model = cohere.from_pretrained(tmp_path)
  assert model.layers[0].self_attn.q_norm is None and model.lm_head is not None
  assert_logits_track_hf(hf, model, [3, 8, 13], 7)


def test_cohere2_sliding_rope_and_full_nope_layers_track_hf(tmp_path):
  """Cohere2: windowed RoPE layers and a full-attention layer without positions, HF's
  logits over prompts longer than the window, and its greedy tokens."""
  hf = _hf_cohere2()
  hf.save_pretrained(tmp_path)
  model = cohere.from_pretrained(tmp_path)
  attentions = [layer.self_attn for layer in model.layers]
  assert [a.sliding_window for a in attentions] == [5, 5, 5, None]
  assert [a.rope is None for a in attentions] == [False, False, False, True]
  assert_logits_track_hf(hf, model, [3, 8, 13], 7)
  assert_generate_and_engines_give_hfs_tokens(hf, model)


def test_generate_and_engine_give_hfs_tokens(saved):
  """generate; an engine preempting in a tiny pool; one whose prompts share a cached
  prefix and whose long prompt is prefilled in chunks: HF's greedy tokens."""
  hf, path = saved
  assert_generate_and_engines_give_hfs_tokens(hf, cohere.from_pretrained(path))


def test_lora_adapters_match_peft(tmp_path):
  """PEFT adapters on q / k / v / o_proj and the MLP: the served model's greedy tokens are
  those of the adapter merged into HF's weights (q_proj's and k_proj's B columns placed
  where the RoPE reorder put their rows)."""
  assert_lora_adapters_match_peft(_hf_model, cohere.from_pretrained,
                                  ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                                   "down_proj"], tmp_path)


def test_config_reads_hf_and_its_defaults(saved):
  """Saved configs, config.jsons omitting fields (HF's CohereConfig / Cohere2Config
  defaults, as HF reads the same files), and errors."""
  hf, _ = saved
  c = cohere.CohereConfig.from_dict(hf.config.to_dict())
  assert (c.num_key_value_heads, c.head_dim, c.layer_norm_eps, c.logit_scale, c.rope_theta,
          c.qkv_bias, c.out_bias, c.qk_layernorm, c.layer_types) == (
              2, 16, 1e-4, 0.3, 500.0, True, True, True, None)
  for model_type, hf_class in (("cohere", transformers.CohereConfig),
                               ("cohere2", transformers.Cohere2Config)):
    d = cohere.CohereConfig.from_dict({"model_type": model_type})
    assert d == cohere.CohereConfig.from_dict(hf_class().to_dict()), model_type
    assert (d.vocab_size, d.hidden_size, d.num_key_value_heads, d.logit_scale,
            d.bos_token_id, d.eos_token_id, d.tie_word_embeddings) == (
                256000, 8192, 64, 0.0625, 5, 255001, True)
  d2 = cohere.CohereConfig.from_dict({"model_type": "cohere2"})
  assert (d2.rope_theta, d2.sliding_window, d2.layer_types[:4], d2.no_rope_layers[:4]) == (
      10000.0, 4096, ("sliding_attention",) * 3 + ("full_attention",), (1, 1, 1, 0))
  assert cohere.CohereConfig.from_dict({"model_type": "cohere"}).rope_theta == 500000.0
  # Cohere2's head_dim is hidden / heads whatever the file says (as HF's).
  assert cohere.CohereConfig.from_dict({"model_type": "cohere2", "head_dim": 7}).head_dim == 128
  for bad, message in (({"logit_scale": None}, "logit_scale must be a positive number"),
                       ({"logit_scale": -1.0}, "logit_scale"),
                       ({"model_type": "command"}, "model_type 'command' is not supported")):
    with pytest.raises(ValueError, match=message):
      cohere.CohereConfig.from_dict(bad)


def test_bf16_tracks_hf(saved):
  hf, path = saved
  assert_bf16_tracks_hf(hf, cohere.from_pretrained(path, dtype=jnp.bfloat16))


def test_cli_finds_the_model_type(saved, capsys):
  hf, path = saved
  assert_installed_cli_gives_hfs_tokens(hf, path, capsys, seed=7)


@pytest.mark.gpu
def test_triton_kernels_give_the_references_and_hfs_tokens_on_gpu(tmp_path):
  """f32 on a GPU at head dim 64, Command R+'s block: the decode / prefill kernels, the
  LayerNorm-fused residual adds (no bias) and the per-head q / k norms give the reference
  path's and HF's tokens."""
  hf = _hf_model(hidden_size=256)
  hf.save_pretrained(tmp_path)
  assert_kernels_give_references_and_hfs_tokens(
      hf, lambda **kw: cohere.from_pretrained(tmp_path, **kw))
