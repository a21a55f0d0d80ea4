"""Hunyuan MoE on the paged pool against Hugging Face transformers' HunYuanMoEV1ForCausalLM
(CPU, f32), loaded from its `save_pretrained` directory (one tensor per expert and
projection).

The HF model is random, its norms and biases too: Hunyuan's attention (GQA 8 q heads over
2 kv heads of 16, q / k norms after RoPE, an NTK alpha, q / k / v / o biases) and on both
layers 4 experts 32 wide of which 2 run per token, beside a shared MLP. Tolerance as
test_llama's: 1e-4 on the logits.
"""

import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers

import jax_paged
from jax_paged import tensor_parallel
from models import deepseek
from models import hunyuan_moe
from tests.test_hunyuan import ROPE
from tests.test_llama import (_COMMON, assert_bf16_tracks_hf,
                              assert_generate_and_engines_give_hfs_tokens,
                              assert_installed_cli_gives_hfs_tokens,
                              assert_kernels_give_references_and_hfs_tokens,
                              assert_logits_track_hf, randomised)

CONFIG = dict(_COMMON, intermediate_size=32, num_attention_heads=8, num_key_value_heads=2,
              head_dim=16, attention_bias=True, num_experts=4, moe_topk=2,
              pad_token_id=None, rope_parameters=ROPE)


def _hf_model(**overrides):
  torch.manual_seed(0)
  return randomised(transformers.HunYuanMoEV1ForCausalLM(
      transformers.HunYuanMoEV1Config(**{**CONFIG, **overrides})))


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
  """(HF model, its save_pretrained directory)."""
  hf = _hf_model()
  path = tmp_path_factory.mktemp("hunyuan_moe")
  hf.save_pretrained(path)
  return hf, path


def test_prefill_and_decode_logits_match_hf(saved):
  """Logits over a prefill and decode steps: the float32 softmax router's renormalised
  top 2, the shared MLP, Hunyuan's attention."""
  hf, path = saved
  model = hunyuan_moe.from_pretrained(path)
  assert isinstance(model, jax_paged.PagedModel)
  experts = model.layers[0].mlp
  assert isinstance(experts, deepseek.DeepseekMoE) and experts.shared is not None
  assert experts.router[...].dtype == jnp.float32 and experts.correction_bias is None
  np.testing.assert_array_equal(np.asarray(experts.router[...]),
                                hf.model.layers[0].mlp.gate.wg.weight.detach().numpy().T)
  assert model.layers[0].self_attn.qk_norm_after_rope
  assert_logits_track_hf(hf, model, [3, 8, 13], 7)


def test_generate_and_engine_give_hfs_tokens(saved):
  hf, path = saved
  assert_generate_and_engines_give_hfs_tokens(hf, hunyuan_moe.from_pretrained(path))


def test_config_reads_hf_and_its_defaults(saved):
  """A saved config; Hunyuan-A13B-Instruct's config.json fields (per-layer lists, the NTK
  alpha); an empty one (HF's defaults); errors."""
  hf, _ = saved
  c = hunyuan_moe.HunyuanMoeConfig.from_dict(hf.config.to_dict())
  assert (c.num_local_experts, c.num_experts_per_tok, c.expert_width,
          c.shared_expert_intermediate_size, c.qk_norm_after_rope, c.out_bias) == (
              4, 2, 32, 32, True, True)
  a13b = hunyuan_moe.HunyuanMoeConfig.from_dict({
      "architectures": ["HunYuanMoEV1ForCausalLM"], "attention_bias": False,
      "bos_token_id": 1, "eos_token_id": 127960, "head_dim": 128, "hidden_act": "silu",
      "hidden_size": 4096, "intermediate_size": 3072, "max_position_embeddings": 32768,
      "model_type": "hunyuan_v1_moe", "moe_topk": [8] * 32, "num_experts": 64,
      "moe_intermediate_size": [3072] * 32, "num_shared_expert": [1] * 32,
      "num_attention_heads": 32, "num_hidden_layers": 32, "num_key_value_heads": 8,
      "rms_norm_eps": 1e-05, "rope_theta": 10000.0,
      "rope_scaling": {"alpha": 1000.0, "factor": 1.0, "type": "dynamic"},
      "tie_word_embeddings": True, "vocab_size": 128167})
  assert (a13b.num_local_experts, a13b.num_experts_per_tok, a13b.expert_width,
          a13b.rope.rope_type, a13b.rope_theta) == (
              64, 8, 3072, "default", pytest.approx(10000.0 * 1000.0 ** (128 / 126)))
  d = hunyuan_moe.HunyuanMoeConfig.from_dict({})
  hf_default = transformers.HunYuanMoEV1Config()
  assert d == hunyuan_moe.HunyuanMoeConfig.from_dict(hf_default.to_dict())
  assert (d.vocab_size, d.hidden_size, d.num_local_experts, d.num_experts_per_tok,
          d.expert_width, d.eos_token_id) == (
              hf_default.vocab_size, hf_default.hidden_size, hf_default.num_experts,
              hf_default.moe_topk, hf_default.intermediate_size, hf_default.eos_token_id)
  for bad, message in (({"moe_topk": [2, 4]}, "moe_topk must be one value for every layer"),
                       ({"num_experts": 2, "moe_topk": 3}, "num_experts_per_tok \\(3\\)"),
                       ({"model_type": "hunyuan_v1_dense"}, "model_type 'hunyuan_v1_dense'")):
    with pytest.raises(ValueError, match=message):
      hunyuan_moe.HunyuanMoeConfig.from_dict(bad)


def test_bf16_tracks_hf(saved):
  hf, path = saved
  assert_bf16_tracks_hf(hf, hunyuan_moe.from_pretrained(path, dtype=jnp.bfloat16),
                        f32_params=("'router'",))  # (HF's is f32)


def test_tensor_parallel_splits_the_experts(saved):
  _, path = saved
  model = hunyuan_moe.from_pretrained(path)
  experts, width = model.layers[1].mlp, model.config.expert_width
  splits = dict((id(proj), split) for proj, split in model.tensor_parallel_splits())
  assert splits[id(experts.gate_up)] == tensor_parallel.Split("column", (width, width))
  assert splits[id(experts.down)] == tensor_parallel.ROW
  assert splits[id(experts.shared.down)] == tensor_parallel.ROW


def test_cli_finds_the_model_type(saved, capsys):
  hf, path = saved
  assert_installed_cli_gives_hfs_tokens(hf, path, capsys, seed=15)


@pytest.mark.gpu
def test_triton_kernels_give_the_references_and_hfs_tokens_on_gpu(tmp_path):
  """f32 on a GPU at head dim 64: the decode and prefill kernels, the grouped expert
  matmuls and the fused GEMMs give the reference path's and HF's tokens."""
  hf = _hf_model(hidden_size=128, head_dim=64)
  hf.save_pretrained(tmp_path)
  assert_kernels_give_references_and_hfs_tokens(
      hf, lambda **kw: hunyuan_moe.from_pretrained(tmp_path, **kw))
