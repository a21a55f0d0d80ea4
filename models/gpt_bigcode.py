"""GPT-BigCode in Flax NNX, decoding from a paged KV cache (`jax_paged.KVPool`).

Hugging Face's `GPTBigCodeForCausalLM` (`model_type` "gpt_bigcode": BigCode's StarCoder
and StarCoderBase 1B-15B, SantaCoder, tiny_starcoder, and the models tuned from them:
WizardCoder-15B, OctoCoder, StarChat) is GPT-2's model (`models.gpt2`: learned positions,
pre-LayerNorm blocks, a GELU MLP, an LM head tied to wte) with:

* multi-query attention (multi_query, the default): one K/V head shared by every query
  head, c_attn's output [q of every head, k, v] (`nn.PagedAttention`'s fused layout as it
  is); without multi_query, one K/V head per head and c_attn's output head by head
  ([q, k, v] of each, as GPT-NeoX's), reordered at load (and a LoRA adapter's columns
  with it);
* torch Linear weights ([out, in], transposed at load, where GPT-2's Conv1D are not);
* checkpoints sharded as StarCoder's are (`models.llama.load_pretrained`'s files and
  errors);
* HF's GPTBigCodeConfig defaults for the fields a config.json omits (activation
  gelu_pytorch_tanh). Its attention_softmax_in_fp32 options only choose torch's
  precision: our softmax is float32 always. Cross-attention (add_cross_attention) is
  refused.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable

import jax
import numpy as np

from jax_paged import lora
from models import gpt2
from models import gpt_neox
from models import llama

MODEL_TYPES = ("gpt_bigcode",)


@dataclasses.dataclass(frozen=True)
class GPTBigCodeConfig(gpt2.GPT2Config):
  """GPT-BigCode hyperparameters under Hugging Face's field names (`gpt2.GPT2Config`'s;
  defaults GPTBigCodeConfig's).

  Attributes beyond `gpt2.GPT2Config`'s:
    multi_query: one K/V head for all heads (else one per head).
  """

  activation_function: str = "gelu_pytorch_tanh"
  eos_token_id: int | tuple[int, ...] | None = 50256
  multi_query: bool = True

  @property
  def num_kv_heads(self) -> int:
    return 1 if self.multi_query else self.n_head

  @classmethod
  def from_dict(cls, config: dict[str, Any]) -> "GPTBigCodeConfig":
    """From a GPT-BigCode config.json (omitted fields: HF's GPTBigCodeConfig defaults; an
    eos list, as a generation_config.json may give, as a tuple)."""
    model_type = config.get("model_type", MODEL_TYPES[0])
    if model_type not in MODEL_TYPES:
      raise ValueError(f"model_type {model_type!r} is not supported by GPTBigCodeConfig; "
                       f"use one of {list(MODEL_TYPES)}")
    if config.get("add_cross_attention"):
      raise ValueError("add_cross_attention is not supported: GPTBigCodeForCausalLM here "
                       "is decoder-only")
    if isinstance(config.get("eos_token_id"), list):
      config = {**config, "eos_token_id": tuple(config["eos_token_id"])}
    return super().from_dict(config)


class GPTBigCodeForCausalLM(gpt2.GPT2LMHeadModel):
  """GPT-BigCode with an LM head tied to `wte`, attending through a `KVPool`:
  `gpt2.GPT2LMHeadModel`'s blocks (over `config.num_kv_heads` K/V heads), forwards, pool
  and tensor parallel splits (its Args)."""

  def lora_targets(self) -> dict[str, lora.Target]:
    """Hugging Face module name -> where its LoRA update lands (`jax_paged.PagedModel`):
    GPT-2's (c_attn, attn.c_proj, mlp.c_fc, mlp.c_proj); without multi_query, c_attn's
    columns where the load's reorder put its weight's."""
    targets = super().lora_targets()
    c = self.config
    if c.multi_query:
      return targets
    hf_column = gpt_neox.heads_first(c.n_head, False, [np.arange(3 * c.n_embd)])
    columns = tuple(np.argsort(hf_column).tolist())  # HF's column j -> ours
    for i, block in enumerate(self.h):
      targets[f"transformer.h.{i}.attn.c_attn"] = lora.Target(block.attn.qkv,
                                                              columns=columns)
    return targets


# Our modules under HF's GPT-BigCode names.
_NAMES = {"attn.qkv": "attn.c_attn", "attn.out": "attn.c_proj"}


def hf_sources(path: tuple[str, ...], config: GPTBigCodeConfig
               ) -> tuple[list[str], Callable[[list[jax.Array]], jax.Array]]:
  """`llama.load_pretrained`'s `Sources` for GPT-BigCode's tensor names: Linear weights
  transposed, c_attn's head-by-head rows (multi-head) put q, k, v first."""
  *module, param = path
  param = "weight" if param in ("scale", "kernel", "embedding") else param
  if module[0] == "h":  # ("h", layer, ...): a block's
    _, layer, *inner = module
    inner = ".".join(inner)
    name = f"transformer.h.{layer}.{_NAMES.get(inner, inner)}.{param}"
  else:  # wte, wpe, ln_f
    inner, name = None, f"transformer.{'.'.join(module)}.{param}"
  if inner == "attn.qkv" and not config.multi_query:
    return [name], functools.partial(gpt_neox.heads_first, config.n_head,
                                     path[-1] == "kernel")
  return [name], llama.linear_rows if path[-1] == "kernel" else llama.whole


from_pretrained = llama.loader(GPTBigCodeConfig, GPTBigCodeForCausalLM, hf_sources, max_model_len=False)

FAMILY = llama.family("gpt_bigcode", MODEL_TYPES, from_pretrained, max_model_len=False)
