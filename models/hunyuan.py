"""Hunyuan (dense) in Flax NNX, decoding from a paged KV cache (`jax_paged.KVPool`).

Hugging Face's `HunYuanDenseV1ForCausalLM` (`model_type` "hunyuan_v1_dense": Tencent's
Hunyuan-0.5B / 1.8B / 4B / 7B, -Pretrain and -Instruct) is Llama's model (`models.llama`:
GQA, pre-norm RMSNorm, SwiGLU, its loader, engine, adapters and tensor parallel splits)
with:

* each head of q and k RMS-normalised after RoPE (query_layernorm, key_layernorm;
  `nn.PagedAttention(qk_norm_after_rope=True)`), so K is cached rotated, then
  normalised;
* RoPE's "dynamic" type with an alpha (the released models' NTK-aware scaling) read as
  HF reads it: the default RoPE of base rope_theta * alpha ** (head_dim / (head_dim - 2)),
  whatever the sequence length;
* biases on q, k, v and o with attention_bias; HF's HunYuanDenseV1Config defaults.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, ClassVar, Mapping

import jax

from jax_paged.kernels import validation
from models import llama

MODEL_TYPES = ("hunyuan_v1_dense",)
# Our per-head q / k norms under HF's Hunyuan names.
_NORMS = {".self_attn.q_norm.": ".self_attn.query_layernorm.",
          ".self_attn.k_norm.": ".self_attn.key_layernorm."}


@dataclasses.dataclass(frozen=True)
class HunyuanConfig(llama.LlamaConfig):
  """Hunyuan hyperparameters under Hugging Face's field names (`llama.LlamaConfig`'s; the
  defaults HF's HunYuanDenseV1Config's, which a config.json omitting a field gets there
  too)."""

  vocab_size: int = 290943
  hidden_size: int = 4096
  intermediate_size: int = 11008
  num_hidden_layers: int = 32
  num_attention_heads: int = 32
  max_position_embeddings: int = 2048
  rms_norm_eps: float = 1e-5
  bos_token_id: int | None = 1
  eos_token_id: int | tuple[int, ...] | None = 2
  model_type: str = "hunyuan_v1_dense"

  model_types: ClassVar[tuple[str, ...]] = MODEL_TYPES

  @property
  def qk_norm(self) -> bool:
    return True

  @property
  def qk_norm_after_rope(self) -> bool:
    return True

  @property
  def out_bias(self) -> bool:
    return self.attention_bias

  @classmethod
  def from_dict(cls, config: dict[str, Any]) -> "HunyuanConfig":
    """`llama.LlamaConfig.from_dict`, a "dynamic" RoPE with an alpha read as HF's
    HunYuanDenseV1RotaryEmbedding reads it (`ntk_alpha_rope`)."""
    return llama.LlamaConfig.from_dict.__func__(cls, ntk_alpha_rope(config, cls))


def ntk_alpha_rope(config: Mapping[str, Any], config_class: type) -> dict[str, Any]:
  """A copy of an HF Hunyuan config dict (defaults: `config_class`'s) without a
  sliding_window (HF's Hunyuan has none) and with a "dynamic" RoPE of NTK alpha a (in
  rope_parameters or rope_scaling) made the default RoPE of base rope_theta * a **
  (head_dim / (head_dim - 2)), as HF's rotary embedding makes it."""
  config = dict(config)
  config.pop("sliding_window", None)
  rope = config.get("rope_parameters") or config.get("rope_scaling")
  if (isinstance(rope, Mapping) and rope.get("rope_type", rope.get("type")) == "dynamic"
      and rope.get("alpha")):
    alpha = validation.check_positive_number("rope alpha", rope["alpha"])
    dim = llama.hf_head_dim(config, config_class)
    theta = rope.get("rope_theta", config.get("rope_theta", 10000.0))
    config.pop("rope_parameters", None)
    config["rope_scaling"] = None
    config["rope_theta"] = theta * alpha ** (dim / (dim - 2))
  return config


def norm_names(sources: llama.Sources) -> llama.Sources:
  """`sources` with the q / k norms under HF's Hunyuan names (query_layernorm,
  key_layernorm)."""

  def renamed(path: tuple[str, ...], config: llama.LlamaConfig
              ) -> tuple[list[str], Callable[[list[jax.Array]], jax.Array]]:
    names, assemble = sources(path, config)
    for ours, theirs in _NORMS.items():
      names = [n.replace(ours, theirs) for n in names]
    return names, assemble

  return renamed


hf_sources = norm_names(llama.hf_sources)


from_pretrained = llama.loader(HunyuanConfig, llama.LlamaForCausalLM, hf_sources)

FAMILY = llama.family("hunyuan_v1_dense", MODEL_TYPES, from_pretrained)
