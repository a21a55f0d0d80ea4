"""Nemotron in Flax NNX, decoding from a paged KV cache (`jax_paged.KVPool`).

Hugging Face's `NemotronForCausalLM` (`model_type` "nemotron": NVIDIA's Nemotron-4
Minitron 4B / 8B, Nemotron-Mini-4B, Nemotron-4 15B / 340B) is Llama's model
(`models.llama`: GQA through `nn.PagedAttention`, its loader, engine and adapters) with:

* "1P" LayerNorms (a bias, and a weight stored minus one: HF scales by weight + 1), the
  one added at load into `nn.LayerNorm`'s scale, in f32 before the parameter dtype (as
  HF's sum rounds once);
* a plain MLP down_proj(relu(up_proj(x))^2) (hidden_act "relu2"), no gate;
* RoPE on the first partial_rotary_factor of each head's features (0.5 in every release);
* biases on q / k / v / o with attention_bias, on up / down with mlp_bias;
* HF's NemotronConfig defaults (Nemotron-4 15B's shape) for the fields a config.json
  omits.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, ClassVar, Mapping

import jax
import jax.numpy as jnp

from jax_paged import lora
from jax_paged import nn as paged_nn
from models import llama

MODEL_TYPES = ("nemotron",)


def relu2(x: jax.Array) -> jax.Array:
  """relu(x)^2 (HF's ReLUSquaredActivation)."""
  return jnp.square(jax.nn.relu(x))


@dataclasses.dataclass(frozen=True)
class NemotronConfig(llama.LlamaConfig):
  """Nemotron hyperparameters under Hugging Face's field names (`llama.LlamaConfig`'s,
  defaults NemotronConfig's; rms_norm_eps unused).

  Attributes beyond `llama.LlamaConfig`'s:
    norm_eps: the LayerNorms' epsilon.
  attention_bias puts biases on q, k, v and o; mlp_bias on up_proj and down_proj.
  """

  vocab_size: int = 256000
  hidden_size: int = 6144
  intermediate_size: int = 24576
  num_hidden_layers: int = 32
  num_attention_heads: int = 48
  hidden_act: str = "relu2"
  max_position_embeddings: int = 4096
  initializer_range: float = 0.0134
  partial_rotary_factor: float = 0.5
  norm_eps: float = 1e-5
  bos_token_id: int | None = 2
  eos_token_id: int | tuple[int, ...] | None = 3
  model_type: str = "nemotron"

  model_types: ClassVar[tuple[str, ...]] = MODEL_TYPES
  activations: ClassVar[Mapping[str, Callable[[jax.Array], jax.Array]]] = {"relu2": relu2}
  plain_mlp: ClassVar[bool] = True

  def make_norm(self, param_dtype) -> paged_nn.LayerNorm:
    """A LayerNorm (a weight, its one added at load, and a bias) of norm_eps."""
    return paged_nn.LayerNorm(self.hidden_size, epsilon=self.norm_eps,
                              param_dtype=param_dtype)

  @property
  def out_bias(self) -> bool:
    return self.attention_bias

  @classmethod
  def from_dict(cls, config: dict[str, Any]) -> "NemotronConfig":
    """`llama.LlamaConfig.from_dict` (omitted fields: the class's defaults, HF's)."""
    config = dict(config)
    config.pop("sliding_window", None)  # (HF's Nemotron has none)
    return llama.LlamaConfig.from_dict.__func__(cls, config)


class NemotronForCausalLM(llama.LlamaForCausalLM):
  """Nemotron with an LM head, attending through a `KVPool`: `LlamaForCausalLM` over a
  `NemotronConfig` (its LayerNorms and relu^2 MLP; its Args). (Arcee's model too:
  `models.arcee`.)"""

  # Our plain MLP's linears under HF's names (a subclass's own: `models.nanochat`'s).
  mlp_names: ClassVar[Mapping[str, str]] = {"c_fc": "up_proj", "c_proj": "down_proj"}

  def lora_targets(self) -> dict[str, lora.Target]:
    """`LlamaForCausalLM.lora_targets` under HF's names: q / k / v / o_proj and the plain
    MLP's `mlp_names` (Nemotron's and Arcee's up_proj and down_proj)."""
    targets = {}
    for name, target in super().lora_targets().items():
      for ours, theirs in self.mlp_names.items():
        name = name.replace(f".mlp.{ours}", f".mlp.{theirs}")
      targets[name] = target
    return targets


def _plus_one(parts: list[jax.Array]) -> jax.Array:
  """A 1P LayerNorm's stored weight as the scale it multiplies by: weight + 1, in f32."""
  return llama.whole(parts).astype(jnp.float32) + 1.0


def plain_mlp_sources(path: tuple[str, ...], config: llama.LlamaConfig,
                      names: Mapping[str, str] = NemotronForCausalLM.mlp_names
                      ) -> tuple[list[str], Callable[[list[jax.Array]], jax.Array]]:
  """`llama.hf_sources` with the plain MLP's linears under HF's `names` (Nemotron's and
  Arcee's up_proj / down_proj: `models.arcee`)."""
  if path[0] == "layers" and path[2] == "mlp":
    name = f"model.layers.{path[1]}.mlp.{names[path[3]]}"
    if path[-1] == "kernel":
      return [f"{name}.weight"], llama.linear_rows
    return [f"{name}.{path[-1]}"], llama.whole
  return llama.hf_sources(path, config)


def hf_sources(path: tuple[str, ...], config: NemotronConfig
               ) -> tuple[list[str], Callable[[list[jax.Array]], jax.Array]]:
  """`llama.load_pretrained`'s `Sources` for Nemotron's tensor names: `plain_mlp_sources`,
  each LayerNorm's weight plus one."""
  names, assemble = plain_mlp_sources(path, config)
  return names, _plus_one if path[-1] == "scale" else assemble


from_pretrained = llama.loader(NemotronConfig, NemotronForCausalLM, hf_sources)

FAMILY = llama.family("nemotron", MODEL_TYPES, from_pretrained)
