"""ERNIE 4.5 (dense) in Flax NNX, decoding from a paged KV cache (`jax_paged.KVPool`).

Hugging Face's `Ernie4_5ForCausalLM` (`model_type` "ernie4_5": Baidu's ERNIE-4.5-0.3B-PT
and -Base-PT) is GLM-4's model (`models.glm`: Llama's decoder with q_proj's and k_proj's
rows reordered at load from interleaved-pair RoPE into rotate-half order) with:

* RoPE over every feature of each head (GLM rotates a part);
* one switch, use_bias, for the biases of q, k, v, o and the MLP's gate, up and down
  (the released checkpoints have none);
* gate_proj and up_proj apart in the checkpoint (fused at load, as Llama's);
* HF's Ernie4_5Config defaults (the 0.3B shape, tied embeddings, RoPE base 500000).
"""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar

from models import glm
from models import llama

MODEL_TYPES = ("ernie4_5",)


@dataclasses.dataclass(frozen=True)
class Ernie4_5Config(glm.GlmConfig):  # pylint: disable=invalid-name (HF's name)
  """ERNIE 4.5 hyperparameters under Hugging Face's field names (`llama.LlamaConfig`'s;
  use_bias read into attention_bias and mlp_bias by `from_dict`). The defaults are HF's
  Ernie4_5Config's, which a config.json omitting a field gets there too."""

  vocab_size: int = 103424
  hidden_size: int = 1024
  intermediate_size: int = 3072
  num_hidden_layers: int = 18
  num_attention_heads: int = 16
  num_key_value_heads: int | None = 2
  head_dim: int | None = 128
  max_position_embeddings: int = 131072
  rms_norm_eps: float = 1e-5
  rope_theta: float = 500000.0
  partial_rotary_factor: float = 1.0
  attention_bias: bool = False
  tie_word_embeddings: bool = True
  bos_token_id: int | None = 1
  eos_token_id: int | tuple[int, ...] | None = 2
  model_type: str = "ernie4_5"

  model_types: ClassVar[tuple[str, ...]] = MODEL_TYPES
  fused_gate_up: ClassVar[bool] = False

  @property
  def out_bias(self) -> bool:
    """o_proj's bias: use_bias, as q / k / v's."""
    return self.attention_bias

  @classmethod
  def from_dict(cls, config: dict[str, Any]) -> "Ernie4_5Config":
    """`llama.LlamaConfig.from_dict` with use_bias (default false) as the attention's and
    the MLP's biases; an eos_token_id of null stays none (as in HF's config, unlike
    GLM's)."""
    config = dict(config)
    use_bias = config.pop("use_bias", None)
    if use_bias is not None and not isinstance(use_bias, bool):
      raise ValueError(f"use_bias must be true or false, got {use_bias!r}")
    config["attention_bias"] = config["mlp_bias"] = bool(use_bias)
    return llama.LlamaConfig.from_dict.__func__(cls, config)


from_pretrained = llama.loader(Ernie4_5Config, glm.GlmForCausalLM, glm.hf_sources)

FAMILY = llama.family("ernie4_5", MODEL_TYPES, from_pretrained)
