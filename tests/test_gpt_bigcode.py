"""GPT-BigCode on the paged pool against Hugging Face transformers' GPTBigCodeForCausalLM
(CPU, f32), loaded from its `save_pretrained` directory (multi-query saved in shards, as
StarCoder's are; multi-head in one file).

The HF model is random, its LayerNorms' weights and every bias too. Tolerance as
test_llama's: 1e-4 on the logits.
"""

import jax.numpy as jnp
import pytest
import torch
import transformers

import jax_paged
from models import gpt_bigcode
from tests.test_llama import (_COMMON, assert_bf16_tracks_hf,
                              assert_generate_and_engines_give_hfs_tokens,
                              assert_installed_cli_gives_hfs_tokens,
                              assert_kernels_give_references_and_hfs_tokens,
                              assert_logits_track_hf, assert_lora_adapters_match_peft,
                              randomised)

# 4 heads of 16 over one K/V head (multi_query, HF's default), tanh GELU, MLP 96 wide.
CONFIG = dict(vocab_size=_COMMON["vocab_size"], n_positions=64, n_embd=64, n_layer=2,
              n_head=4, n_inner=96, layer_norm_epsilon=1e-4, initializer_range=0.1,
              bos_token_id=None, eos_token_id=None, attn_implementation="eager")
SHARDS = dict(max_shard_size="40KB")


def _hf_model(**overrides):
  torch.manual_seed(0)
  return randomised(transformers.GPTBigCodeForCausalLM(transformers.GPTBigCodeConfig(
      **{**CONFIG, **overrides})), norm=".ln_")


@pytest.fixture(scope="module", params=["mqa", "mha"])
def saved(request, tmp_path_factory):
  """(HF model, its save_pretrained directory): multi-query in shards, multi-head."""
  mqa = request.param == "mqa"
  hf = _hf_model(multi_query=mqa)
  path = tmp_path_factory.mktemp(request.param)
  hf.save_pretrained(path, **(SHARDS if mqa else {}))
  return hf, path


def test_prefill_and_decode_logits_match_hf(saved):
  """Logits over a prefill and decode steps: one K/V head for four (multi_query) or one
  each through c_attn's reordered rows, learned positions, the tied head."""
  hf, path = saved
  model = gpt_bigcode.from_pretrained(path)
  assert isinstance(model, jax_paged.PagedModel)
  mqa = hf.config.multi_query
  assert mqa == (len(list(path.glob("model-*-of-*.safetensors"))) > 1)
  assert model.spec.num_kv_heads == model.h[0].attn.num_kv_heads == (1 if mqa else 4)
  assert_logits_track_hf(hf, model, [3, 8, 13], 7)


def test_generate_and_engine_give_hfs_tokens(saved):
  hf, path = saved
  assert_generate_and_engines_give_hfs_tokens(hf, gpt_bigcode.from_pretrained(path))


@pytest.mark.parametrize("mqa", [True, False])
def test_lora_adapters_match_peft(tmp_path, mqa):
  """PEFT adapters on c_attn, c_proj and c_fc (attention's and MLP's): the served model's
  greedy tokens are those of the adapter merged into HF's weights (multi-head c_attn's B
  columns placed where the load's reorder put its rows)."""
  assert_lora_adapters_match_peft(lambda: _hf_model(multi_query=mqa),
                                  gpt_bigcode.from_pretrained, ["c_attn", "c_proj", "c_fc"],
                                  tmp_path)


def test_config_reads_hf_and_its_defaults(saved):
  """A saved config, a config.json omitting fields (HF's GPTBigCodeConfig defaults, as HF
  reads the same file), an eos list, and errors."""
  hf, _ = saved
  c = gpt_bigcode.GPTBigCodeConfig.from_dict(hf.config.to_dict())
  assert (c.n_embd, c.n_head, c.head_dim, c.n_inner, c.layer_norm_epsilon, c.multi_query,
          c.num_kv_heads) == (64, 4, 16, 96, 1e-4, hf.config.multi_query,
                              hf.config.num_key_value_heads)
  d = gpt_bigcode.GPTBigCodeConfig.from_dict({"model_type": "gpt_bigcode"})
  assert d == gpt_bigcode.GPTBigCodeConfig.from_dict(transformers.GPTBigCodeConfig().to_dict())
  assert (d.vocab_size, d.n_positions, d.n_embd, d.n_layer, d.n_head, d.activation_function,
          d.multi_query, d.num_kv_heads, d.eos_token_id) == (
              50257, 1024, 768, 12, 12, "gelu_pytorch_tanh", True, 1, 50256)
  assert gpt_bigcode.GPTBigCodeConfig.from_dict({"eos_token_id": [0, 49152]}).eos_token_id == (
      0, 49152)
  for bad, message in (({"activation_function": "swish"}, "activation_function 'swish'"),
                       ({"add_cross_attention": True}, "add_cross_attention"),
                       ({"tie_word_embeddings": False}, "tie_word_embeddings=False"),
                       ({"model_type": "gpt2"}, "model_type 'gpt2' is not supported")):
    with pytest.raises(ValueError, match=message):
      gpt_bigcode.GPTBigCodeConfig.from_dict(bad)


def test_from_pretrained_names_a_missing_or_misshapen_weight(saved, tmp_path):
  """A checkpoint without weights, or with a config that does not fit its tensors: the
  error says which."""
  hf, path = saved
  (tmp_path / "config.json").write_text((path / "config.json").read_text())
  with pytest.raises(FileNotFoundError, match="model.safetensors"):
    gpt_bigcode.from_pretrained(tmp_path)
  hf.save_pretrained(tmp_path / "wide")
  config = (tmp_path / "wide" / "config.json").read_text()
  (tmp_path / "wide" / "config.json").write_text(
      config.replace('"n_inner": 96', '"n_inner": 128'))
  with pytest.raises(ValueError,
                     match=r"weight transformer\.h\.0\.mlp\.c_fc\.\w+ .* expected \(128,?"):
    gpt_bigcode.from_pretrained(tmp_path / "wide")


def test_bf16_tracks_hf(saved):
  hf, path = saved
  assert_bf16_tracks_hf(hf, gpt_bigcode.from_pretrained(path, dtype=jnp.bfloat16))


def test_cli_finds_the_model_type(saved, capsys):
  hf, path = saved
  assert_installed_cli_gives_hfs_tokens(hf, path, capsys, seed=7)


@pytest.mark.gpu
@pytest.mark.parametrize("mqa", [True, False])
def test_triton_kernels_give_the_references_and_hfs_tokens_on_gpu(tmp_path, mqa):
  """f32 on a GPU at head dim 64, 4 q heads over one K/V head or four: the decode / prefill
  kernels, the fused c_fc + GELU GEMM and the LayerNorm-fused residual adds give the
  reference path's and HF's tokens."""
  hf = _hf_model(n_embd=256, multi_query=mqa)
  hf.save_pretrained(tmp_path)
  assert_kernels_give_references_and_hfs_tokens(
      hf, lambda **kw: gpt_bigcode.from_pretrained(tmp_path, **kw))
