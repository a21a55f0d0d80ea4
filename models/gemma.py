"""Gemma (the first generation) in Flax NNX, decoding from a paged KV cache
(`jax_paged.KVPool`).

Hugging Face's `GemmaForCausalLM` (`model_type` "gemma": Google's gemma-2b, gemma-7b,
CodeGemma, RecurrentGemma's predecessors' chat tunes) is Llama's model (`models.llama`:
RoPE, GQA / MQA through `nn.PagedAttention`, its loader, engine and adapters) with:

* RMS norms whose weight is an offset from 1 (x * (1 + w), `nn.RMSNorm(unit_offset=True)`:
  Gemma's zero-initialised weights), computed in float32;
* a GeGLU MLP: down(gelu_tanh(gate(x)) * up(x)) (HF reads the released configs' legacy
  hidden_act "gelu" as the tanh approximation, and so does this);
* the token embeddings times sqrt(hidden_size), rounded to the compute dtype as HF rounds
  its normalizer (`llama.LlamaConfig.embedding_multiplier`);
* a head tied to the embeddings, head_dim 256 (HF's GemmaConfig defaults: gemma-7b's
  shape) for the fields a config.json omits.
Gemma 2 and 3 (soft caps, post-norms, sliding layers) are `models.gemma2` / `models.gemma3`.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Callable, ClassVar, Mapping

import jax

from jax_paged import nn as paged_nn
from models import gpt2
from models import llama

MODEL_TYPES = ("gemma",)


@dataclasses.dataclass(frozen=True)
class GemmaConfig(llama.LlamaConfig):
  """Gemma hyperparameters under Hugging Face's field names (`llama.LlamaConfig`'s,
  defaults GemmaConfig's); embedding_multiplier is always sqrt(hidden_size), and
  attention_bias puts biases on q, k, v and o."""

  vocab_size: int = 256000
  hidden_size: int = 3072
  intermediate_size: int = 24576
  num_hidden_layers: int = 28
  num_attention_heads: int = 16
  num_key_value_heads: int | None = 16
  head_dim: int | None = 256
  hidden_act: str = "gelu_pytorch_tanh"
  max_position_embeddings: int = 8192
  tie_word_embeddings: bool = True
  bos_token_id: int | None = 2
  eos_token_id: int | tuple[int, ...] | None = 1
  model_type: str = "gemma"

  model_types: ClassVar[tuple[str, ...]] = MODEL_TYPES
  activations: ClassVar[Mapping[str, Callable[[jax.Array], jax.Array]]] = {
      "gelu_pytorch_tanh": gpt2.ACTIVATIONS["gelu_pytorch_tanh"]}

  def __post_init__(self):
    object.__setattr__(self, "embedding_multiplier", math.sqrt(self.hidden_size))
    super().__post_init__()

  def make_norm(self, param_dtype) -> paged_nn.RMSNorm:
    """Gemma's RMS norm: x * (1 + weight), in float32."""
    return paged_nn.RMSNorm(self.hidden_size, epsilon=self.rms_norm_eps,
                            param_dtype=param_dtype, unit_offset=True)

  @property
  def out_bias(self) -> bool:
    return self.attention_bias

  @classmethod
  def from_dict(cls, config: dict[str, Any]) -> "GemmaConfig":
    """`llama.LlamaConfig.from_dict` (omitted fields: the class's defaults, HF's), the
    legacy hidden_act "gelu" read as HF reads it (the tanh approximation); ValueError for
    bidirectional attention."""
    if config.get("use_bidirectional_attention"):
      raise ValueError("use_bidirectional_attention is not supported (decoding is causal)")
    config = dict(config)
    if config.get("hidden_act", "gelu") == "gelu":
      config["hidden_act"] = "gelu_pytorch_tanh"
    config.pop("sliding_window", None)  # (HF's Gemma has none)
    return llama.LlamaConfig.from_dict.__func__(cls, config)


class GemmaForCausalLM(llama.LlamaForCausalLM):
  """Gemma with its tied LM head, attending through a `KVPool`: `LlamaForCausalLM` of a
  `GemmaConfig` (its Args): Llama's blocks, loader names, LoRA targets and tensor
  parallel splits."""


from_pretrained = llama.loader(GemmaConfig, GemmaForCausalLM)

FAMILY = llama.family("gemma", MODEL_TYPES, from_pretrained)
