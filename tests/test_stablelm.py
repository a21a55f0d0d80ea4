"""StableLM on the paged pool against Hugging Face transformers' StableLmForCausalLM
(CPU, f32), loaded from its `save_pretrained` directory.

The HF model is random, its LayerNorms' weights (the per-head q / k ones included) and
every bias too (HF's ones and zeros would hide a norm or bias applied wrongly or not at
all). Tolerance as test_llama's: 1e-4 on the logits.
"""

import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers

import jax_paged
from models import stablelm
from tests.test_llama import (_COMMON, assert_bf16_tracks_hf,
                              assert_generate_and_engines_give_hfs_tokens,
                              assert_installed_cli_gives_hfs_tokens,
                              assert_kernels_give_references_and_hfs_tokens,
                              assert_logits_track_hf, assert_lora_adapters_match_peft,
                              randomised)

# StableLM 2 1.6B's block (sequential, q / k / v biases) with GQA 4 q heads over 2 kv
# heads of 16, RoPE on the first 4 features of each (every release's quarter).
CONFIG = dict(_COMMON, num_attention_heads=4, num_key_value_heads=2, use_qkv_bias=True,
              rope_theta=500.0, partial_rotary_factor=0.25, layer_norm_eps=1e-4)
# StableLM 2 12B's: the parallel residual and a LayerNorm per head of q and of k.
TWELVE_B = dict(use_parallel_residual=True, qk_layernorm=True, use_qkv_bias=False)


def _hf_model(**overrides):
  torch.manual_seed(0)
  return randomised(transformers.StableLmForCausalLM(transformers.StableLmConfig(
      **{**CONFIG, **overrides})))


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
  """(HF model, its save_pretrained directory)."""
  hf = _hf_model()
  path = tmp_path_factory.mktemp("stablelm")
  hf.save_pretrained(path)
  return hf, path


def test_prefill_and_decode_logits_match_hf(saved):
  """Logits over a prefill and decode steps: LayerNorms, RoPE on a quarter of each head,
  biases on q / k / v only, GQA."""
  hf, path = saved
  model = stablelm.from_pretrained(path)
  assert isinstance(model, jax_paged.PagedModel)
  attention = model.layers[0].self_attn
  assert (attention.rope.head_dim, attention.rope.rotary_dim) == (16, 4)
  assert attention.qkv.bias is not None and attention.out.bias is None
  assert attention.q_norm is None and not model.layers[0].parallel
  assert_logits_track_hf(hf, model, [3, 8, 13], 7)


def test_parallel_residual_and_per_head_qk_norms_track_hf(tmp_path):
  """StableLM 2 12B's block: one LayerNorm feeding attention and MLP in parallel, each
  head of q and of k LayerNorm-ed with a weight of its own: HF's logits and tokens."""
  hf = _hf_model(**TWELVE_B)
  hf.save_pretrained(tmp_path)
  model = stablelm.from_pretrained(tmp_path)
  block = model.layers[1]
  assert block.parallel and not hasattr(block, "post_attention_layernorm")
  scale = np.asarray(block.self_attn.k_norm.scale[...])
  assert scale.shape == (2, 16)
  np.testing.assert_array_equal(  # head h's own weight, in HF's order
      scale[1], hf.model.layers[1].self_attn.k_layernorm.norms[1].weight.detach().numpy())
  assert_logits_track_hf(hf, model, [3, 8, 13], 7)
  assert_generate_and_engines_give_hfs_tokens(hf, model)


def test_generate_and_engine_give_hfs_tokens(saved):
  """generate; an engine preempting in a tiny pool; one whose prompts share a cached
  prefix and whose long prompt is prefilled in chunks: HF's greedy tokens."""
  hf, path = saved
  assert_generate_and_engines_give_hfs_tokens(hf, stablelm.from_pretrained(path))


def test_lora_adapters_match_peft(tmp_path):
  """PEFT adapters on q / k / v / o_proj and the MLP's three (the 12B block): the served
  model's greedy tokens are those of the adapter merged into HF's weights."""
  assert_lora_adapters_match_peft(lambda: _hf_model(**TWELVE_B), stablelm.from_pretrained,
                                  ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                                   "down_proj"], tmp_path)


def test_config_reads_hf_and_its_defaults(saved):
  """A saved config, transformers 5's rope_parameters, a config.json omitting fields
  (Hugging Face's StableLmConfig defaults, as HF reads the same file), and errors."""
  hf, _ = saved
  c = stablelm.StableLmConfig.from_dict(hf.config.to_dict())
  assert (c.num_key_value_heads, c.head_dim, c.rotary_dim, c.layer_norm_eps, c.rope_theta,
          c.qkv_bias, c.out_bias, c.mlp_bias) == (2, 16, 4, 1e-4, 500.0, True, False, False)
  d = stablelm.StableLmConfig.from_dict({"model_type": "stablelm"})
  hf_default = transformers.StableLmConfig()
  assert d == stablelm.StableLmConfig.from_dict(hf_default.to_dict())
  assert (d.vocab_size, d.hidden_size, d.intermediate_size, d.num_hidden_layers,
          d.num_key_value_heads, d.rotary_dim, d.bos_token_id, d.eos_token_id, d.qkv_bias,
          d.qk_layernorm, d.use_parallel_residual, d.tie_word_embeddings) == (
              hf_default.vocab_size, 2560, 6912, 32, 32, 20, 0, 0, False, False, False, False)
  v5 = stablelm.StableLmConfig.from_dict({"model_type": "stablelm", "rope_parameters": {
      "rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5}})
  assert v5.rotary_dim == 40
  for bad, message in (({"hidden_act": "gelu"}, "hidden_act 'gelu' is not supported"),
                       ({"model_type": "stablelm_epoch"},
                        "model_type 'stablelm_epoch' is not supported"),
                       ({"partial_rotary_factor": 0.01}, "partial_rotary_factor 0.01")):
    with pytest.raises(ValueError, match=message):
      stablelm.StableLmConfig.from_dict(bad)


def test_bf16_tracks_hf(saved):
  hf, path = saved
  assert_bf16_tracks_hf(hf, stablelm.from_pretrained(path, dtype=jnp.bfloat16))


def test_cli_finds_the_model_type(saved, capsys):
  hf, path = saved
  assert_installed_cli_gives_hfs_tokens(hf, path, capsys, seed=7)


@pytest.mark.gpu
def test_triton_kernels_give_the_references_and_hfs_tokens_on_gpu(tmp_path):
  """f32 on a GPU, the 12B block at head dim 64 (RoPE on 16 of its features): the decode /
  prefill kernels, the LayerNorm-fused residual adds and the per-head q / k norms give the
  reference path's and HF's tokens."""
  hf = _hf_model(hidden_size=256, num_attention_heads=4, num_key_value_heads=2, **TWELVE_B)
  hf.save_pretrained(tmp_path)
  assert_kernels_give_references_and_hfs_tokens(
      hf, lambda **kw: stablelm.from_pretrained(tmp_path, **kw))
