"""Arcee (AFM) in Flax NNX, decoding from a paged KV cache (`jax_paged.KVPool`).

Hugging Face's `ArceeForCausalLM` (`model_type` "arcee": Arcee's AFM-4.5B, -Base) is
Llama's model (`models.llama`: RMSNorm pre-norms, GQA with RoPE, YaRN among its scalings,
its loader, engine, adapters and tensor parallel splits) with Nemotron's plain MLP
(`models.nemotron`): down_proj(relu(up_proj(x))^2), no gate; biases on q / k / v / o
with attention_bias, on up / down with mlp_bias; HF's ArceeConfig defaults (AFM-4.5B's
shape) for the fields a config.json omits.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, ClassVar, Mapping

import jax

from models import llama
from models import nemotron

MODEL_TYPES = ("arcee",)


@dataclasses.dataclass(frozen=True)
class ArceeConfig(llama.LlamaConfig):
  """Arcee hyperparameters under Hugging Face's field names (`llama.LlamaConfig`'s;
  defaults HF's ArceeConfig's)."""

  vocab_size: int = 32000
  hidden_size: int = 2560
  intermediate_size: int = 18432
  num_hidden_layers: int = 32
  num_attention_heads: int = 32
  hidden_act: str = "relu2"
  max_position_embeddings: int = 4096
  rms_norm_eps: float = 1e-5
  bos_token_id: int | None = 128000
  eos_token_id: int | tuple[int, ...] | None = 128001
  model_type: str = "arcee"

  model_types: ClassVar[tuple[str, ...]] = MODEL_TYPES
  activations: ClassVar[Mapping[str, Callable[[jax.Array], jax.Array]]] = {
      "relu2": nemotron.relu2}
  plain_mlp: ClassVar[bool] = True

  @property
  def out_bias(self) -> bool:
    return self.attention_bias

  @classmethod
  def from_dict(cls, config: dict[str, Any]) -> "ArceeConfig":
    """`llama.LlamaConfig.from_dict` (omitted fields: the class's defaults, HF's)."""
    config = dict(config)
    config.pop("sliding_window", None)  # (HF's Arcee has none)
    return llama.LlamaConfig.from_dict.__func__(cls, config)


from_pretrained = llama.loader(ArceeConfig, nemotron.NemotronForCausalLM,
                               nemotron.plain_mlp_sources)

FAMILY = llama.family("arcee", MODEL_TYPES, from_pretrained)
