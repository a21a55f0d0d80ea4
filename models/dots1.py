"""dots.llm1 in Flax NNX, decoding from a paged KV cache (`jax_paged.KVPool`).

Hugging Face's `Dots1ForCausalLM` (`model_type` "dots1": rednote-hilab's dots.llm1.base and
dots.llm1.inst) is Qwen3's attention (each head of q and k RMS-normalised before RoPE,
biases on q, k, v and o with attention_bias, a sliding window on the layers from
max_window_layers on) with GLM-4.5's MLP (`models.glm4_moe`): a dense SwiGLU on the first
first_k_dense_replace layers, then experts routed as DeepSeek-V3's with shared experts.
"""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar

from models import deepseek
from models import glm4_moe
from models import llama

MODEL_TYPES = ("dots1",)
# Fields HF's Dots1Config leaves None, which its model cannot be built without.
_REQUIRED = ("n_routed_experts", "num_experts_per_tok", "n_shared_experts")


@dataclasses.dataclass(frozen=True)
class Dots1Config(glm4_moe.Glm4MoeConfig):
  """dots.llm1 hyperparameters under Hugging Face's field names (`glm4_moe.Glm4MoeConfig`'s;
  the defaults HF's Dots1Config's, which a config.json omitting a field gets there too,
  but for the experts', which HF has none of: dots.llm1's 128, 6 per token, 2 shared).

  Attributes beyond Glm4MoeConfig's:
    max_window_layers: without layer_types, the layers from it on attend within
      sliding_window (HF's), the others to every position.
  """

  vocab_size: int = 152064
  hidden_size: int = 4608
  intermediate_size: int = 10944
  num_hidden_layers: int = 62
  num_attention_heads: int = 32
  num_key_value_heads: int | None = 32
  head_dim: int | None = None  # (hidden_size // num_attention_heads, as HF's)
  max_position_embeddings: int = 2048
  rms_norm_eps: float = 1e-6
  partial_rotary_factor: float = 1.0
  num_experts_per_tok: int = 6
  shared_expert_intermediate_size: int | None = 2 * 1408
  norm_topk_prob: bool = False
  first_k_dense_replace: int = 0
  sliding_window: int | None = 4096
  max_window_layers: int = 62
  model_type: str = "dots1"

  model_types: ClassVar[tuple[str, ...]] = MODEL_TYPES

  def __post_init__(self):
    if self.layer_types is None:  # HF's: windows from max_window_layers on
      windowed = lambda i: self.sliding_window is not None and i >= self.max_window_layers
      object.__setattr__(self, "layer_types", tuple(
          "sliding_attention" if windowed(i) else "full_attention"
          for i in range(self.num_hidden_layers)))
    super().__post_init__()

  @property
  def qk_norm(self) -> bool:
    return True

  @property
  def out_bias(self) -> bool:
    return self.attention_bias

  @classmethod
  def from_dict(cls, config: dict[str, Any]) -> "Dots1Config":
    """`glm4_moe.Glm4MoeConfig.from_dict`, with dots.llm1's layer_types kept (from
    max_window_layers when absent); the experts' counts required, as HF's model needs
    them."""
    config = dict(config)
    missing = [name for name in _REQUIRED if config.get(name) is None]
    if missing:
      raise ValueError(f"a dots1 config needs {', '.join(missing)} (Hugging Face's config "
                       "has no default for them)")
    layer_types = config.pop("layer_types", None)
    parsed = super().from_dict(config)
    if layer_types is None:
      return parsed
    return dataclasses.replace(parsed, layer_types=tuple(layer_types))


# The model is GLM-4.5's over this config, its checkpoints' names DeepSeek's and Llama's.
from_pretrained = llama.loader(Dots1Config, glm4_moe.Glm4MoeForCausalLM,
                               deepseek.experts_sources)

FAMILY = llama.family("dots1", MODEL_TYPES, from_pretrained)
