"""OLMo (the first) in Flax NNX, decoding from a paged KV cache (`jax_paged.KVPool`).

Hugging Face's `OlmoForCausalLM` (`model_type` "olmo": AI2's OLMo-1B-hf, OLMo-7B-hf,
OLMo-7B-0424-hf / 0724-hf, OLMo-7B-Instruct-hf) is Llama's model (`models.llama`: RoPE,
a SwiGLU MLP, Llama's tensor names, its loader, engine and adapters) with:

* non-parametric LayerNorms (no weight, no bias; epsilon 1e-5): a `nn.LayerNorm` whose
  scale is ones, made at load (the checkpoint holds no norm tensors) and never trained;
* with clip_qkv (OLMo-7B-0424's 8.0), q, k and v clamped to [-clip_qkv, clip_qkv] after
  their projection (`nn.PagedAttention(clip_qkv=...)`);
* HF's OlmoConfig defaults for the fields a config.json omits.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, ClassVar

import jax
import numpy as np

from jax_paged import nn as paged_nn
from models import llama

MODEL_TYPES = ("olmo",)
# HF's OlmoConfig defaults where they differ from `llama.LlamaConfig`'s.
_HF_DEFAULTS = dict(vocab_size=50304, bos_token_id=None, eos_token_id=50279)
_EPSILON = 1e-5  # (HF's OlmoLayerNorm's, fixed)


@dataclasses.dataclass(frozen=True)
class OlmoConfig(llama.LlamaConfig):
  """OLMo hyperparameters under Hugging Face's field names (`llama.LlamaConfig`'s,
  clip_qkv among them; rms_norm_eps unused: the LayerNorms' epsilon is 1e-5)."""

  vocab_size: int = 50304
  bos_token_id: int | None = None
  eos_token_id: int | tuple[int, ...] | None = 50279
  model_type: str = "olmo"

  model_types: ClassVar[tuple[str, ...]] = MODEL_TYPES

  @property
  def out_bias(self) -> bool:
    return self.attention_bias

  def make_norm(self, param_dtype) -> paged_nn.LayerNorm:
    """A LayerNorm without a bias, its scale ones (`hf_sources`): OLMo's have no
    parameters."""
    return paged_nn.LayerNorm(self.hidden_size, epsilon=_EPSILON, param_dtype=param_dtype,
                              use_bias=False)

  @classmethod
  def from_dict(cls, config: dict[str, Any]) -> "OlmoConfig":
    """`llama.LlamaConfig.from_dict`, with HF's OlmoConfig defaults for the fields a
    config.json omits, and its clip_qkv."""
    result = llama.LlamaConfig.from_dict.__func__(cls, {**_HF_DEFAULTS, **config})
    return dataclasses.replace(result, clip_qkv=config.get("clip_qkv"))


class OlmoForCausalLM(llama.LlamaForCausalLM):
  """OLMo with an LM head, attending through a `KVPool`: `LlamaForCausalLM`'s forwards,
  pool, loader names, LoRA targets and tensor parallel splits (its Args)."""


def hf_sources(path: tuple[str, ...], config: OlmoConfig
               ) -> tuple[list[str], Callable[[list[jax.Array]], jax.Array]]:
  """Llama's `Sources`, but for the norms' scales: ones (no tensor)."""
  if path[-1] == "scale":
    return [], lambda _: np.ones(config.hidden_size, np.float32)
  return llama.hf_sources(path, config)


from_pretrained = llama.loader(OlmoConfig, OlmoForCausalLM, hf_sources)

FAMILY = llama.family("olmo", MODEL_TYPES, from_pretrained)
