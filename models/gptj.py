"""GPT-J in Flax NNX, decoding from a paged KV cache (`jax_paged.KVPool`).

Hugging Face's `GPTJForCausalLM` (`model_type` "gptj": EleutherAI's GPT-J-6B and models
tuned from it: GPT4All-J, Pygmalion-6B, Dolly v1) is Phi's model (`models.phi`: one
LayerNorm per block feeding attention and MLP in parallel, a plain MLP, a biased LM
head; Llama's attention, loader, engine and adapters) with:

* RoPE on the first rotary_dim features of each head (GPT-J-6B's 64 of 256) over
  interleaved pairs (x0, x1), (x2, x3), ...: q_proj's and k_proj's rows (and LoRA
  columns) are reordered per head at load into rotate-half order (`llama.deinterleave`), which
  leaves q . k unchanged;
* no biases on q / k / v or out_proj, biases on fc_in, fc_out and the LM head;
* GPT-J's config names (n_embd, n_layer, n_head, n_inner, rotary_dim, ...) and HF's
  GPTJConfig defaults for the fields a config.json omits.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, ClassVar

import jax
import numpy as np

from jax_paged import lora
from models import llama
from models import phi

MODEL_TYPES = ("gptj",)

# GPT-J's config.json names -> HF's Llama / Phi names (`GPTJConfig.from_dict`).
_HF_NAMES = {"n_embd": "hidden_size", "n_layer": "num_hidden_layers",
             "n_head": "num_attention_heads", "n_inner": "intermediate_size",
             "n_positions": "max_position_embeddings", "activation_function": "hidden_act",
             "layer_norm_epsilon": "layer_norm_eps"}


@dataclasses.dataclass(frozen=True)
class GPTJConfig(phi.PhiConfig):
  """GPT-J hyperparameters under Llama's field names (`phi.PhiConfig`'s; defaults
  GPTJConfig's: GPT-J-6B's shape). partial_rotary_factor is rotary_dim / head_dim; MLP
  biases only (attention_bias False)."""

  vocab_size: int = 50400
  hidden_size: int = 4096
  intermediate_size: int = 16384
  num_hidden_layers: int = 28
  num_attention_heads: int = 16
  max_position_embeddings: int = 2048
  partial_rotary_factor: float = 0.25
  attention_bias: bool = False
  bos_token_id: int | None = 50256
  eos_token_id: int | tuple[int, ...] | None = 50256
  model_type: str = "gptj"

  model_types: ClassVar[tuple[str, ...]] = MODEL_TYPES

  @property
  def out_bias(self) -> bool:
    return False

  @classmethod
  def from_dict(cls, config: dict[str, Any]) -> "GPTJConfig":
    """From a GPT-J config.json (omitted fields: HF's GPTJConfig defaults): its names read
    as Llama's, n_inner None as 4 * n_embd, rotary_dim None as the whole head."""
    config = dict(config)
    for theirs, ours in _HF_NAMES.items():
      if theirs in config:
        config[ours] = config.pop(theirs)
    hidden = config.setdefault("hidden_size", cls.hidden_size)
    heads = config.setdefault("num_attention_heads", cls.num_attention_heads)
    if config.get("intermediate_size") is None:
      config["intermediate_size"] = 4 * hidden
    head_dim = hidden // heads
    rotary_dim = config.pop("rotary_dim", 64)
    config["partial_rotary_factor"] = 1.0 if rotary_dim is None else rotary_dim / head_dim
    config.update(attention_bias=False, mlp_bias=True)
    for name in ("rope_scaling", "rope_parameters", "sliding_window", "num_key_value_heads"):
      config.pop(name, None)  # (HF's GPT-J has none: RoPE base 10000, multi-head)
    return llama.LlamaConfig.from_dict.__func__(cls, config)


class GPTJForCausalLM(phi.PhiForCausalLM):
  """GPT-J with a biased LM head, attending through a `KVPool`: `phi.PhiForCausalLM`'s
  blocks, forwards, pool and tensor parallel splits (its Args)."""

  def lora_targets(self) -> dict[str, lora.Target]:
    """Hugging Face module name -> where its LoRA update lands (`jax_paged.PagedModel`):
    q_proj and k_proj in our fused qkv's columns where the load's RoPE reorder put their
    rows, v_proj there as it is, out_proj, fc_in and fc_out whole."""
    c = self.config
    width = c.num_attention_heads * c.head_dim
    rows = llama.deinterleave(width, c.rotary_dim, c.head_dim, first=True)
    targets = {}
    for i, layer in enumerate(self.layers):
      attn, mlp = layer.self_attn, layer.mlp
      for name, target in (
          ("attn.q_proj", lora.Target(attn.qkv, columns=tuple(np.argsort(rows).tolist()))),
          ("attn.k_proj", lora.Target(attn.qkv, columns=tuple(
              (width + np.argsort(rows)).tolist()))),
          ("attn.v_proj", lora.Target(attn.qkv, 2 * width, width)),
          ("attn.out_proj", lora.Target(attn.out)), ("mlp.fc_in", lora.Target(mlp.c_fc)),
          ("mlp.fc_out", lora.Target(mlp.c_proj))):
        targets[f"transformer.h.{i}.{name}"] = target
    return targets


# Our modules under HF's GPT-J names.
_NAMES = {"input_layernorm": "ln_1", "self_attn.out": "attn.out_proj", "mlp.c_fc": "mlp.fc_in",
          "mlp.c_proj": "mlp.fc_out"}


def hf_sources(path: tuple[str, ...], config: GPTJConfig
               ) -> tuple[list[str], Callable[[list[jax.Array]], jax.Array]]:
  """`llama.load_pretrained`'s `Sources` for GPT-J's tensor names, q_proj's and k_proj's
  rows in rotate-half order."""
  if path == ("embed_tokens", "embedding"):
    return ["transformer.wte.weight"], llama.whole
  if path == ("lm_head", "embedding"):
    return ["lm_head.weight"], llama.whole
  if path == ("lm_head_bias",):
    return ["lm_head.bias"], llama.whole
  *module, param = path
  param = "weight" if param in ("scale", "kernel") else param
  if module == ["norm"]:
    return [f"transformer.ln_f.{param}"], llama.whole
  _, layer, *module = module
  module = ".".join(module)
  prefix = f"transformer.h.{layer}."
  if module == "self_attn.qkv":  # (no bias)
    rows = llama.deinterleave(config.num_attention_heads * config.head_dim,
                              config.rotary_dim, config.head_dim, first=True)
    return ([f"{prefix}attn.{name}.weight" for name in ("q_proj", "k_proj", "v_proj")],
            lambda parts: llama.linear_rows([parts[0][rows], parts[1][rows], parts[2]]))
  name = f"{prefix}{_NAMES[module]}.{param}"
  return [name], llama.linear_rows if path[-1] == "kernel" else llama.whole


from_pretrained = llama.loader(GPTJConfig, GPTJForCausalLM, hf_sources)

FAMILY = llama.family("gptj", MODEL_TYPES, from_pretrained)
