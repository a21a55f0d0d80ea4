"""Solar Open in Flax NNX, decoding from a paged KV cache (`jax_paged.KVPool`).

Hugging Face's `SolarOpenForCausalLM` (`model_type` "solar_open": Upstage's
Solar-Open-100B) is GLM-4.5's model (`models.glm4_moe`: DeepSeek-V3's sigmoid router with
its correction bias, n_group / topk_group, routed_scaling_factor, and shared experts)
with experts on every layer (no dense ones), RoPE over every feature of each head, no
q / k norms, biases on q, k and v with attention_bias (none on o), and HF's
SolarOpenConfig defaults for the fields a config.json omits.
"""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar

from models import deepseek
from models import glm4_moe
from models import llama

MODEL_TYPES = ("solar_open",)


@dataclasses.dataclass(frozen=True)
class SolarOpenConfig(glm4_moe.Glm4MoeConfig):
  """Solar Open hyperparameters under Hugging Face's field names (`glm4_moe.Glm4MoeConfig`'s
  and its `from_dict`; the defaults HF's SolarOpenConfig's). intermediate_size is unused
  (every layer has experts)."""

  vocab_size: int = 196608
  hidden_size: int = 4096
  num_hidden_layers: int = 48
  num_attention_heads: int = 64
  num_key_value_heads: int | None = 8
  head_dim: int | None = 128
  max_position_embeddings: int = 131072
  rms_norm_eps: float = 1e-5
  rope_theta: float = 1_000_000.0
  partial_rotary_factor: float = 1.0
  num_local_experts: int = 128
  num_experts_per_tok: int = 8
  moe_intermediate_size: int | None = 1280
  shared_expert_intermediate_size: int | None = 1280
  first_k_dense_replace: int = 0
  model_type: str = "solar_open"

  model_types: ClassVar[tuple[str, ...]] = MODEL_TYPES

  @classmethod
  def from_dict(cls, config: dict[str, Any]) -> "SolarOpenConfig":
    """`glm4_moe.Glm4MoeConfig.from_dict` without its dense layers and q / k norms (HF's
    SolarOpenConfig has neither field); an absent head_dim is HF's default 128 (a null
    one hidden_size // num_attention_heads, as HF's attention reads it)."""
    config = dict(config)
    config.setdefault("head_dim", cls.head_dim)
    for name in ("first_k_dense_replace", "use_qk_norm"):
      config.pop(name, None)
    return super().from_dict(config)


from_pretrained = llama.loader(SolarOpenConfig, glm4_moe.Glm4MoeForCausalLM,
                               deepseek.experts_sources)

FAMILY = llama.family("solar_open", MODEL_TYPES, from_pretrained)
