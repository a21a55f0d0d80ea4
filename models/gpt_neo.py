"""GPT-Neo in Flax NNX, decoding from a paged KV cache (`jax_paged.KVPool`).

Hugging Face's `GPTNeoForCausalLM` (`model_type` "gpt_neo": EleutherAI's GPT-Neo 125M,
1.3B and 2.7B, and the models tuned from them) is GPT-2's model (`models.gpt2`: learned
positions, pre-LayerNorm blocks, a GELU MLP, an LM head tied to wte) with
* unscaled attention logits (q.k, no 1 / sqrt(head_dim));
* "local" layers (attention_types, alternating with "global" ones by default) attending
  within a window of window_size positions (`nn.PagedAttention(sliding_window=)`);
* q_proj / k_proj / v_proj without biases and out_proj with one, torch Linear weights
  (transposed at load), under transformer.h.N.attn.attention.*;
* HF's GPTNeoConfig field names and defaults (hidden_size, num_layers, num_heads,
  max_position_embeddings, intermediate_size; GPT-Neo 1.3B's shape).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import jax
from flax import nnx

from jax_paged import lora
from jax_paged import nn as paged_nn
from jax_paged.kernels import validation
from models import gpt2
from models import llama

MODEL_TYPES = ("gpt_neo",)
_ATTENTION_TYPES = ("global", "local")


@dataclasses.dataclass(frozen=True)
class GPTNeoConfig(gpt2.GPT2Config):
  """GPT-Neo hyperparameters under GPT-2's field names (`from_dict` reads HF's; defaults
  HF's GPTNeoConfig's).

  Attributes beyond `gpt2.GPT2Config`'s:
    attention_layers: "global" or "local" per layer (HF's attention_types expanded).
    window_size: a local layer's window.
  """

  n_positions: int = 2048
  n_embd: int = 2048
  n_layer: int = 24
  n_head: int = 16
  scale_attn_weights: bool = False
  attention_layers: tuple[str, ...] | None = None
  window_size: int = 256

  def __post_init__(self):
    super().__post_init__()
    if self.attention_layers is None:
      object.__setattr__(self, "attention_layers", tuple(
          _ATTENTION_TYPES[i % 2] for i in range(self.n_layer)))
    object.__setattr__(self, "attention_layers", tuple(self.attention_layers))
    if (len(self.attention_layers) != self.n_layer
        or any(t not in _ATTENTION_TYPES for t in self.attention_layers)):
      raise ValueError(f"attention_layers must give one of {_ATTENTION_TYPES} for each of "
                       f"the {self.n_layer} layers, got {self.attention_layers}")
    validation.check_positive_int("window_size", self.window_size)

  def window(self, layer: int) -> int | None:
    """Layer `layer`'s window (None: a global layer)."""
    return self.window_size if self.attention_layers[layer] == "local" else None

  @classmethod
  def from_dict(cls, config: dict[str, Any]) -> "GPTNeoConfig":
    """From a Hugging Face GPTNeoConfig dict: its field names as GPT-2's, attention_types
    ([[types, repeats], ...]) expanded as HF expands them; the logits never scaled."""
    config = dict(config)
    for theirs, ours in (("hidden_size", "n_embd"), ("num_layers", "n_layer"),
                         ("num_heads", "n_head"), ("max_position_embeddings", "n_positions"),
                         ("intermediate_size", "n_inner")):
      if theirs in config:
        config[ours] = config.pop(theirs)
    types = config.pop("attention_types", None)
    if types is not None:
      try:
        config["attention_layers"] = [t for kinds, repeats in types
                                      for _ in range(repeats) for t in kinds]
      except (TypeError, ValueError) as e:
        raise ValueError(f"attention_types must be [[types, repeats], ...], got "
                         f"{types!r}") from e
    config.pop("scale_attn_weights", None)
    return super().from_dict(config)


class Block(gpt2.Block):
  """GPT-2's block with GPT-Neo's attention."""

  def _make_attention(self, config: GPTNeoConfig, layer: int, **kwargs
                      ) -> paged_nn.PagedAttention:
    """q / k / v without biases, out_proj with one, unscaled logits, a local layer's
    window."""
    return paged_nn.PagedAttention(
        config.n_embd, config.n_head, config.head_dim, scale=1.0, qkv_bias=False,
        sliding_window=config.window(layer),
        kernel_init=nnx.initializers.normal(config.initializer_range), **kwargs)


class GPTNeoForCausalLM(gpt2.GPT2LMHeadModel):
  """GPT-Neo with an LM head tied to `wte`: `gpt2.GPT2LMHeadModel` over these blocks (its
  Args)."""

  block = Block

  def lora_targets(self) -> dict[str, lora.Target]:
    """Hugging Face module name -> where its LoRA update lands: q_proj, k_proj and v_proj
    in our fused qkv's columns, out_proj, mlp.c_fc and mlp.c_proj whole."""
    d = self.config.n_embd
    targets = {}
    for i, block in enumerate(self.h):
      prefix = f"transformer.h.{i}."
      for j, name in enumerate(("q_proj", "k_proj", "v_proj")):
        targets[f"{prefix}attn.attention.{name}"] = lora.Target(block.attn.qkv, j * d, d)
      targets[f"{prefix}attn.attention.out_proj"] = lora.Target(block.attn.out)
      targets[f"{prefix}mlp.c_fc"] = lora.Target(block.mlp.c_fc)
      targets[f"{prefix}mlp.c_proj"] = lora.Target(block.mlp.c_proj)
    return targets


def hf_sources(path: tuple[str, ...], config: GPTNeoConfig
               ) -> tuple[list[str], Callable[[list[jax.Array]], jax.Array]]:
  """`llama.load_pretrained`'s `Sources` for GPT-Neo's tensor names: q / k / v_proj's
  weights fused into qkv, torch Linear weights transposed."""
  *module, param = path
  param = "weight" if param in ("scale", "kernel", "embedding") else param
  linear = llama.linear_rows if path[-1] == "kernel" else llama.whole
  if module[0] != "h":  # wte, wpe, ln_f
    return [f"transformer.{'.'.join(module)}.{param}"], llama.whole
  _, layer, *inner = module
  prefix = f"transformer.h.{layer}."
  if inner == ["attn", "qkv"]:
    return [f"{prefix}attn.attention.{p}_proj.{param}" for p in "qkv"], linear
  if inner == ["attn", "out"]:
    return [f"{prefix}attn.attention.out_proj.{param}"], linear
  return [f"{prefix}{'.'.join(inner)}.{param}"], linear


from_pretrained = llama.loader(GPTNeoConfig, GPTNeoForCausalLM, hf_sources, max_model_len=False)

FAMILY = llama.family("gpt_neo", MODEL_TYPES, from_pretrained, max_model_len=False)
