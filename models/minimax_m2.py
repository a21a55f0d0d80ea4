"""MiniMax-M2 in Flax NNX, decoding from a paged KV cache (`jax_paged.KVPool`).

Hugging Face's `MiniMaxM2ForCausalLM` (`model_type` "minimax_m2": MiniMax's MiniMax-M2,
M2.1) is Mixtral's decoder (`models.moe`: pre-norm RMSNorm, GQA, routed SwiGLU experts on
every layer, Mixtral's checkpoint names) with:

* q and k RMS-normalised across all heads together before RoPE (OLMoE's and OLMo 2's:
  `nn.PagedAttention(qk_norm_all_heads=True)`; so no tensor parallelism), RoPE on the
  first rotary_dim features of each head (rotate-half);
* DeepSeek-V3's router (`deepseek.DeepseekMoE`, "noaux_tc" with one group: sigmoid scores
  in float32 plus a correction bias that only chooses; the chosen scores renormalised),
  no shared experts;
* HF's MiniMaxM2Config defaults (MiniMax-M2's shape) for the fields a config.json omits.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, ClassVar

import jax

from models import glm4_moe
from models import llama
from models import moe

MODEL_TYPES = ("minimax_m2",)


@dataclasses.dataclass(frozen=True)
class MiniMaxM2Config(glm4_moe.Glm4MoeConfig):
  """MiniMax-M2 hyperparameters (`glm4_moe.Glm4MoeConfig`'s fields, read by `from_dict`
  from HF's: rotary_dim as partial_rotary_factor, each expert intermediate_size wide,
  every layer's MLP the experts). The defaults are HF's MiniMaxM2Config's."""

  vocab_size: int = 200064
  hidden_size: int = 3072
  intermediate_size: int = 1536
  num_hidden_layers: int = 62
  num_attention_heads: int = 48
  num_key_value_heads: int | None = 8
  head_dim: int | None = 128
  max_position_embeddings: int = 196608
  rms_norm_eps: float = 1e-6
  rope_theta: float = 5000000.0
  partial_rotary_factor: float = 1.0
  num_local_experts: int = 256
  num_experts_per_tok: int = 8
  moe_intermediate_size: int | None = None  # (intermediate_size, Mixtral's)
  shared_expert_intermediate_size: int | None = None
  first_k_dense_replace: int = 0
  bos_token_id: int | None = 200034
  eos_token_id: int | tuple[int, ...] | None = 200020
  model_type: str = "minimax_m2"

  model_types: ClassVar[tuple[str, ...]] = MODEL_TYPES

  @property
  def qk_norm(self) -> bool:
    return True

  @property
  def qk_norm_all_heads(self) -> bool:
    return True

  @classmethod
  def from_dict(cls, config: dict[str, Any]) -> "MiniMaxM2Config":
    """From a Hugging Face config dict (`llama.LlamaConfig.from_dict`), fields it omits
    taking HF's defaults; rotary_dim read as the partial_rotary_factor it makes of
    head_dim, num_experts as num_local_experts; the fields HF's model does not read
    (MiniMax's own use_qk_norm, scoring_func, shared_intermediate_size...) ignored."""
    config = dict(config)
    rotary_dim = config.pop("rotary_dim", None)
    if rotary_dim is not None and config.get("partial_rotary_factor") is None:
      config["partial_rotary_factor"] = rotary_dim / config.get("head_dim", cls.head_dim)
    if "num_experts" in config:
      config.setdefault("num_local_experts", config.pop("num_experts"))
    for name in ("moe_intermediate_size", "shared_expert_intermediate_size",
                 "first_k_dense_replace", "n_group", "topk_group", "routed_scaling_factor",
                 "norm_topk_prob", "use_qk_norm"):
      config.pop(name, None)
    # (past Glm4MoeConfig's and MoeConfig's from_dict, which read other names)
    return llama.LlamaConfig.from_dict.__func__(cls, config)


# Mixtral's names: the block, the router, each expert's gate (w1), up (w3) and down (w2).
_EXPERTS = ("block_sparse_moe", "gate", ("w1", "w3", "w2"))


def hf_sources(path: tuple[str, ...], config: MiniMaxM2Config
               ) -> tuple[list[str], Callable[[list[jax.Array]], jax.Array]]:
  """`llama.Sources` of MiniMax-M2's checkpoints: the experts and router under Mixtral's
  names (`moe.hf_sources`), the correction bias the block's e_score_correction_bias."""
  if path[2:4] == ("mlp", "correction_bias"):
    return [f"model.layers.{path[1]}.block_sparse_moe.e_score_correction_bias"], llama.whole
  return moe.hf_sources(path, config, _EXPERTS)


from_pretrained = llama.loader(MiniMaxM2Config, glm4_moe.Glm4MoeForCausalLM, hf_sources)

FAMILY = llama.family("minimax_m2", MODEL_TYPES, from_pretrained)
