"""Jais 2 in Flax NNX, decoding from a paged KV cache (`jax_paged.KVPool`).

Hugging Face's `Jais2ForCausalLM` (`model_type` "jais2": Inception's Jais-2 models) is
Llama's model (`models.llama`: GQA with RoPE, its loader, engine, adapters and tensor
parallel splits) with LayerNorms (a weight and a bias, layer_norm_eps) for its norms,
Nemotron's plain MLP (`models.nemotron`: down_proj(relu(up_proj(x))^2)), biases on q / k
/ v / o (attention_bias) and on the MLP (mlp_bias), both on by default, and HF's
Jais2Config defaults for the fields a config.json omits.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, ClassVar, Mapping

import jax

from jax_paged import nn as paged_nn
from models import llama
from models import nemotron

MODEL_TYPES = ("jais2",)


@dataclasses.dataclass(frozen=True)
class Jais2Config(llama.LlamaConfig):
  """Jais 2 hyperparameters under Hugging Face's field names (`llama.LlamaConfig`'s;
  defaults HF's Jais2Config's; rms_norm_eps unused).

  Attributes beyond `llama.LlamaConfig`'s:
    layer_norm_eps: the LayerNorms' epsilon.
  """

  vocab_size: int = 150272
  hidden_size: int = 3328
  intermediate_size: int = 26624
  num_attention_heads: int = 26
  hidden_act: str = "relu2"
  max_position_embeddings: int = 8192
  layer_norm_eps: float = 1e-5
  attention_bias: bool = True
  mlp_bias: bool = True
  bos_token_id: int | None = 0
  eos_token_id: int | tuple[int, ...] | None = 150024
  model_type: str = "jais2"

  model_types: ClassVar[tuple[str, ...]] = MODEL_TYPES
  activations: ClassVar[Mapping[str, Callable[[jax.Array], jax.Array]]] = {
      "relu2": nemotron.relu2}
  plain_mlp: ClassVar[bool] = True

  def make_norm(self, param_dtype) -> paged_nn.LayerNorm:
    """A LayerNorm (a weight and a bias) of layer_norm_eps."""
    return paged_nn.LayerNorm(self.hidden_size, epsilon=self.layer_norm_eps,
                              param_dtype=param_dtype)

  @property
  def out_bias(self) -> bool:
    return self.attention_bias

  @classmethod
  def from_dict(cls, config: dict[str, Any]) -> "Jais2Config":
    """`llama.LlamaConfig.from_dict` (omitted fields: the class's defaults, HF's)."""
    config = dict(config)
    config.pop("sliding_window", None)  # (HF's Jais 2 has none)
    return llama.LlamaConfig.from_dict.__func__(cls, config)


from_pretrained = llama.loader(Jais2Config, nemotron.NemotronForCausalLM,
                               nemotron.plain_mlp_sources)

FAMILY = llama.family("jais2", MODEL_TYPES, from_pretrained)
