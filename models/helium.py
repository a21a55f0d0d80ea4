"""Helium in Flax NNX, decoding from a paged KV cache (`jax_paged.KVPool`).

Hugging Face's `HeliumForCausalLM` (`model_type` "helium": Kyutai's Helium-1 2B) is
GLM-4's model (`models.glm`: Llama's decoder with q_proj's and k_proj's rows reordered at
load from interleaved-pair RoPE into rotate-half order) with RoPE over every feature of
each head, biases on q, k and v with attention_bias (none on o), on the MLP with mlp_bias,
gate_proj and up_proj apart in the checkpoint, and HF's HeliumConfig defaults.
"""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar

from models import glm
from models import llama

MODEL_TYPES = ("helium",)


@dataclasses.dataclass(frozen=True)
class HeliumConfig(glm.GlmConfig):
  """Helium hyperparameters under Hugging Face's field names (`llama.LlamaConfig`'s; the
  defaults HF's HeliumConfig's, Helium-1 2B's shape, which a config.json omitting a field
  gets there too)."""

  vocab_size: int = 48000
  hidden_size: int = 2560
  intermediate_size: int = 7040
  num_hidden_layers: int = 24
  num_attention_heads: int = 20
  num_key_value_heads: int | None = 20
  head_dim: int | None = 128
  max_position_embeddings: int = 4096
  rms_norm_eps: float = 1e-8
  rope_theta: float = 100000.0
  partial_rotary_factor: float = 1.0
  attention_bias: bool = False
  bos_token_id: int | None = 1
  eos_token_id: int | tuple[int, ...] | None = 2
  model_type: str = "helium"

  model_types: ClassVar[tuple[str, ...]] = MODEL_TYPES
  fused_gate_up: ClassVar[bool] = False

  def __post_init__(self):
    super().__post_init__()
    if self.num_attention_heads * self.head_dim != self.hidden_size:
      raise ValueError(f"num_attention_heads * head_dim ({self.num_attention_heads} * "
                       f"{self.head_dim}) must be hidden_size ({self.hidden_size}): HF's "
                       "Helium projects the heads back with a hidden_size-square o_proj")

  @classmethod
  def from_dict(cls, config: dict[str, Any]) -> "HeliumConfig":
    """`llama.LlamaConfig.from_dict` (an eos_token_id of null stays none, unlike GLM's)."""
    config = dict(config)
    config.pop("sliding_window", None)  # (HF's Helium has none)
    return llama.LlamaConfig.from_dict.__func__(cls, config)


from_pretrained = llama.loader(HeliumConfig, glm.GlmForCausalLM, glm.hf_sources)

FAMILY = llama.family("helium", MODEL_TYPES, from_pretrained)
