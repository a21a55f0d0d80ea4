"""EXAONE 4.0 in Flax NNX, decoding from a paged KV cache (`jax_paged.KVPool`).

Hugging Face's `Exaone4ForCausalLM` (`model_type` "exaone4": LG AI Research's
EXAONE-4.0-1.2B and -32B) is OLMo 2's blocks (`models.olmo2`: each branch's output
RMS-normalised before its residual add, no input norms) over Llama's attention with:

* q and k RMS-normalised per head before RoPE (Qwen3's), so tensor parallelism splits
  the attention by head as Qwen3's;
* with a sliding_window, local layers (layer_types; HF's default three of every
  sliding_window_pattern) attending within it with RoPE, and global layers attending to
  everything without RoPE (NoPE); without one, every layer global with RoPE;
* no biases; HF's Exaone4Config defaults for the fields a config.json omits.
"""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar

from jax_paged import nn as paged_nn
from models import llama
from models import olmo2

MODEL_TYPES = ("exaone4",)


@dataclasses.dataclass(frozen=True)
class Exaone4Config(llama.LlamaConfig):
  """EXAONE 4.0 hyperparameters under Hugging Face's field names (`llama.LlamaConfig`'s;
  the defaults HF's Exaone4Config's). `layer_types` comes from sliding_window_pattern in
  `from_dict` where a config.json omits it."""

  vocab_size: int = 102400
  hidden_size: int = 4096
  intermediate_size: int = 16384
  num_hidden_layers: int = 32
  num_attention_heads: int = 32
  max_position_embeddings: int = 2048
  rms_norm_eps: float = 1e-5
  sliding_window: int | None = 4096
  bos_token_id: int | None = 0
  eos_token_id: int | tuple[int, ...] | None = 2
  model_type: str = "exaone4"

  model_types: ClassVar[tuple[str, ...]] = MODEL_TYPES

  @property
  def qk_norm(self) -> bool:
    return True

  def layer_rope(self, layer: int) -> paged_nn.RotaryEmbedding | None:
    """Layer `layer`'s rotary embedding: None (NoPE) on a global layer of a model with
    sliding layers, else `rope`."""
    if (self.sliding_window is not None and self.layer_types is not None
        and self.layer_types[layer] != "sliding_attention"):
      return None
    return self.rope

  @classmethod
  def from_dict(cls, config: dict[str, Any]) -> "Exaone4Config":
    """`llama.LlamaConfig.from_dict` with HF's Exaone4Config reading of the windows
    (`hf_layer_types`)."""
    config = dict(config)
    for name in ("attention_bias", "mlp_bias"):  # (HF's EXAONE 4 has no biases)
      config.pop(name, None)
    layer_types = hf_layer_types(config, cls)
    # (past Llama's from_dict, which keeps layer_types for the Qwens and SmolLM3 alone)
    return dataclasses.replace(llama.LlamaConfig.from_dict.__func__(cls, config),
                               layer_types=tuple(layer_types))


def hf_layer_types(config: dict[str, Any], config_class: type) -> list[str]:
  """The layer_types of an HF EXAONE config dict (defaults: `config_class`'s), popped from
  it, with its sliding_window set (HF's default where absent): without layer_types,
  layer i sliding unless (i + 1) % sliding_window_pattern == 0 (an int; every layer
  global without a sliding_window), as HF's Exaone4Config reads it."""
  window = config.setdefault("sliding_window", config_class.sliding_window)
  layers = config.get("num_hidden_layers", config_class.num_hidden_layers)
  layer_types = config.pop("layer_types", None)
  if layer_types is not None:
    return list(layer_types)
  pattern = config.get("sliding_window_pattern", 4)
  if window is None:
    return ["full_attention"] * layers
  if isinstance(pattern, int) and not isinstance(pattern, bool) and pattern > 0:
    return ["full_attention" if (i + 1) % pattern == 0 else "sliding_attention"
            for i in range(layers)]
  raise ValueError(f"sliding_window_pattern must be a positive int when layer_types is "
                   f"not given, got {pattern!r}")


from_pretrained = llama.loader(Exaone4Config, olmo2.Olmo2ForCausalLM)

FAMILY = llama.family("exaone4", MODEL_TYPES, from_pretrained)
