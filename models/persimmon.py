"""Persimmon in Flax NNX, decoding from a paged KV cache (`jax_paged.KVPool`).

Hugging Face's `PersimmonForCausalLM` (`model_type` "persimmon": Adept's Persimmon-8B base
and chat) is GPT-NeoX's model (`models.gpt_neox`: LayerNorms with biases, RoPE on part of
each head, a plain MLP, biases on every projection, q / k / v in one query_key_value laid
out head by head) with the sequential block, relu^2 in the MLP, each head of q and k
LayerNorm-ed (one LayerNorm of head_dim for every q head, one for every k head, with
biases: qk_layernorm) before RoPE, and Persimmon's names (model.*, self_attn.*, lm_head);
HF's PersimmonConfig defaults (Persimmon-8B's shape) for omitted fields.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, ClassVar, Mapping

import jax

from jax_paged import lora
from jax_paged import nn as paged_nn
from models import gpt_neox
from models import llama
from models import nemotron

MODEL_TYPES = ("persimmon",)


@dataclasses.dataclass(frozen=True)
class PersimmonConfig(gpt_neox.GPTNeoXConfig):
  """Persimmon hyperparameters (`gpt_neox.GPTNeoXConfig`'s and qk_layernorm; defaults
  HF's PersimmonConfig's)."""

  vocab_size: int = 262144
  hidden_size: int = 4096
  intermediate_size: int = 16384
  num_hidden_layers: int = 36
  num_attention_heads: int = 64
  hidden_act: str = "relu2"
  max_position_embeddings: int = 16384
  bos_token_id: int | None = 1
  eos_token_id: int | tuple[int, ...] | None = 2
  partial_rotary_factor: float = 0.5
  use_parallel_residual: bool = False
  qk_layernorm: bool = True
  model_type: str = "persimmon"

  model_types: ClassVar[tuple[str, ...]] = MODEL_TYPES
  activations: ClassVar[Mapping[str, Callable[[jax.Array], jax.Array]]] = {
      "relu2": nemotron.relu2}

  @property
  def qk_norm(self) -> bool:
    return self.qk_layernorm

  def make_head_norm(self, width: int, param_dtype) -> paged_nn.LayerNorm:
    """A LayerNorm (weight and bias) of layer_norm_eps over `width` features."""
    return paged_nn.LayerNorm(width, epsilon=self.layer_norm_eps, param_dtype=param_dtype)

  @classmethod
  def from_dict(cls, config: dict[str, Any]) -> "PersimmonConfig":
    """`gpt_neox.GPTNeoXConfig.from_dict` (its RoPE fields, partial_rotary_factor HF's 0.5
    where omitted); the block always sequential."""
    config = dict(config)
    rope = dict(config.get("rope_parameters") or {})
    rope.setdefault("partial_rotary_factor", config.pop("partial_rotary_factor", 0.5))
    config["rope_parameters"] = rope
    config["use_parallel_residual"] = False
    return super().from_dict(config)


class PersimmonForCausalLM(gpt_neox.GPTNeoXForCausalLM):
  """Persimmon with an LM head: GPT-NeoX's model (its Args), LoRA targets under
  Persimmon's names."""

  def lora_targets(self) -> dict[str, lora.Target]:
    """GPT-NeoX's targets under model.layers.N.self_attn.{query_key_value, dense} and
    mlp.*."""
    return {name.replace("gpt_neox.layers.", "model.layers.").replace(
        ".attention.", ".self_attn."): target
            for name, target in super().lora_targets().items()}


# Our head norms under Persimmon's names.
_HEAD_NORMS = {"q_norm": "q_layernorm", "k_norm": "k_layernorm"}


def hf_sources(path: tuple[str, ...], config: PersimmonConfig
               ) -> tuple[list[str], Callable[[list[jax.Array]], jax.Array]]:
  """`gpt_neox.hf_sources` under Persimmon's names (model.embed_tokens, model.layers.N.
  self_attn.*, the q / k LayerNorms, model.final_layernorm, lm_head)."""
  param = "weight" if path[-1] in ("scale", "embedding") else path[-1]
  if path == ("embed_tokens", "embedding"):
    return ["model.embed_tokens.weight"], llama.whole
  if path == ("lm_head", "embedding"):
    return ["lm_head.weight"], llama.whole
  if path[0] == "norm":
    return [f"model.final_layernorm.{param}"], llama.whole
  if path[2:3] == ("self_attn",) and path[3] in _HEAD_NORMS:
    return [f"model.layers.{path[1]}.self_attn.{_HEAD_NORMS[path[3]]}.{param}"], llama.whole
  names, assemble = gpt_neox.hf_sources(path, config)
  return [n.replace("gpt_neox.layers.", "model.layers.").replace(".attention.", ".self_attn.")
          for n in names], assemble


from_pretrained = llama.loader(PersimmonConfig, PersimmonForCausalLM, hf_sources)

FAMILY = llama.family("persimmon", MODEL_TYPES, from_pretrained)
