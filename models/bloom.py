"""BLOOM in Flax NNX, decoding from a paged KV cache (`jax_paged.KVPool`).

Hugging Face's `BloomForCausalLM` (`model_type` "bloom": BigScience's BLOOM 560M-176B,
BLOOMZ, and the models tuned from them) is GPT-2's model (`models.gpt2`: pre-LayerNorm
blocks, a tanh-GELU MLP four times the hidden width, biases on every projection and norm,
an LM head tied to the token embedding) with:

* ALiBi in place of learned positions: head h adds slope_h times the key's distance from
  the query to its logits (`nn.alibi_slopes`, added inside the paged decode and prefill
  kernels, `nn.PagedAttention(alibi_slopes=...)`). The model has no position table, so
  no context limit of its own: `max_model_len` (default 2048, BLOOM's training context)
  sizes the page table;
* a LayerNorm on the token embeddings (word_embeddings_layernorm);
* query_key_value's output laid out head by head ([q, k, v] of each, as GPT-NeoX's),
  reordered at load (and a LoRA adapter's columns with it);
* torch Linear weights ([out, in], transposed at load), loaded by
  `models.llama.load_pretrained` (one file or shards; BLOOM's checkpoints name BloomModel's
  tensors, without the "transformer." prefix);
* HF's BloomConfig defaults for the fields a config.json omits, and its names (hidden_size
  or n_embed, n_layer or num_hidden_layers, n_head or num_attention_heads).

pretraining_tp / slow_but_exact only choose the order of HF's sums (Megatron's TP
slices); apply_residual_connection_post_layernorm (residuals taken after the norms), which
no BLOOM checkpoint sets, is refused.
"""

from __future__ import annotations

import dataclasses
import functools
import os
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jax_paged import lora
from jax_paged import nn as paged_nn
from models import gpt2
from models import gpt_neox
from models import llama

MODEL_TYPES = ("bloom",)

# BloomConfig's names -> GPT2Config's.
_HF_NAMES = {"hidden_size": "n_embd", "n_embed": "n_embd", "num_hidden_layers": "n_layer",
             "num_attention_heads": "n_head"}


@dataclasses.dataclass(frozen=True)
class BloomConfig(gpt2.GPT2Config):
  """BLOOM hyperparameters under `gpt2.GPT2Config`'s field names (defaults HF's
  BloomConfig's); `n_positions` is the longest sequence served (max_model_len), not a
  trained table's size."""

  vocab_size: int = 250880
  n_positions: int = 2048
  n_embd: int = 64
  n_layer: int = 2
  n_head: int = 8
  bos_token_id: int | None = 1
  eos_token_id: int | tuple[int, ...] | None = 2

  @property
  def alibi(self) -> bool:
    return True

  @classmethod
  def from_dict(cls, config: dict[str, Any]) -> "BloomConfig":
    """From a BLOOM config.json (omitted fields: HF's BloomConfig defaults; an eos list, as
    a generation_config.json may give, as a tuple). The MLP is always 4 x n_embd wide
    (BLOOM's n_inner, where present, is unused by HF too)."""
    model_type = config.get("model_type", MODEL_TYPES[0])
    if model_type not in MODEL_TYPES:
      raise ValueError(f"model_type {model_type!r} is not supported by BloomConfig; use one "
                       f"of {list(MODEL_TYPES)}")
    if config.get("apply_residual_connection_post_layernorm"):
      raise ValueError("apply_residual_connection_post_layernorm=True (residuals after the "
                       "norms) is not supported: BLOOM's blocks add to their input")
    names = {f.name for f in dataclasses.fields(cls)}
    ours = {_HF_NAMES.get(k, k): v for k, v in config.items() if k != "n_inner"}
    if isinstance(ours.get("eos_token_id"), list):
      ours["eos_token_id"] = tuple(ours["eos_token_id"])
    if config.get("tie_word_embeddings", True) is False:
      raise ValueError("BloomForCausalLM ties its LM head to the word embeddings: "
                       "tie_word_embeddings=False is not supported")
    return cls(**{k: v for k, v in ours.items() if k in names})


class BloomForCausalLM(gpt2.GPT2LMHeadModel):
  """BLOOM with an LM head tied to `wte`, attending through a `KVPool` with ALiBi:
  `gpt2.GPT2LMHeadModel`'s blocks, forwards, pool and tensor parallel splits (its Args),
  and `ln_embed`, the embeddings' LayerNorm."""

  def __init__(self, config: BloomConfig, *, dtype=jnp.float32, param_dtype=None,
               decode_impl: paged_nn.DecodeImpl = "auto", rngs: nnx.Rngs):
    super().__init__(config, dtype=dtype, param_dtype=param_dtype, decode_impl=decode_impl,
                     rngs=rngs)
    self.ln_embed = paged_nn.LayerNorm(config.n_embd, epsilon=config.layer_norm_epsilon,
                                       dtype=dtype,
                                       param_dtype=dtype if param_dtype is None else param_dtype)

  def _embed(self, tokens: jax.Array, positions: jax.Array) -> jax.Array:
    """The normalised token embeddings (positions enter through ALiBi)."""
    return self.ln_embed(self.wte(tokens)).astype(self.dtype)

  def lora_targets(self) -> dict[str, lora.Target]:
    """Hugging Face module name -> where its LoRA update lands (`jax_paged.PagedModel`):
    each block's self_attention.query_key_value (its B columns where the load's reorder
    put its weight's), self_attention.dense, mlp.dense_h_to_4h and mlp.dense_4h_to_h."""
    c = self.config
    hf_column = gpt_neox.heads_first(c.n_head, False, [np.arange(3 * c.n_embd)])
    columns = tuple(np.argsort(hf_column).tolist())  # HF's column j -> ours
    targets = {}
    for i, block in enumerate(self.h):
      prefix = f"transformer.h.{i}."
      targets[prefix + "self_attention.query_key_value"] = lora.Target(block.attn.qkv,
                                                                        columns=columns)
      for name, linear in (("self_attention.dense", block.attn.out),
                           ("mlp.dense_h_to_4h", block.mlp.c_fc),
                           ("mlp.dense_4h_to_h", block.mlp.c_proj)):
        targets[prefix + name] = lora.Target(linear)
    return targets


# Our modules under HF's BLOOM names.
_BLOCK_NAMES = {"ln_1": "input_layernorm", "attn.qkv": "self_attention.query_key_value",
                "attn.out": "self_attention.dense", "ln_2": "post_attention_layernorm",
                "mlp.c_fc": "mlp.dense_h_to_4h", "mlp.c_proj": "mlp.dense_4h_to_h"}
_MODEL_NAMES = {"wte": "word_embeddings", "ln_embed": "word_embeddings_layernorm",
                "ln_f": "ln_f"}


def hf_sources(path: tuple[str, ...], config: BloomConfig
               ) -> tuple[list[str], Callable[[list[jax.Array]], jax.Array]]:
  """`llama.load_pretrained`'s `Sources` for BLOOM's tensor names: Linear weights
  transposed, query_key_value's head-by-head rows put q, k, v first."""
  *module, param = path
  param = "weight" if param in ("scale", "kernel", "embedding") else param
  if module[0] == "h":  # ("h", layer, ...): a block's
    _, layer, *inner = module
    inner = ".".join(inner)
    name = f"transformer.h.{layer}.{_BLOCK_NAMES[inner]}.{param}"
  else:
    inner, name = None, f"transformer.{_MODEL_NAMES[module[0]]}.{param}"
  if inner == "attn.qkv":
    return [name], functools.partial(gpt_neox.heads_first, config.n_head,
                                     path[-1] == "kernel")
  return [name], llama.linear_rows if path[-1] == "kernel" else llama.whole


def from_pretrained(path: str | os.PathLike, *, dtype=jnp.float32, param_dtype=None,
                    decode_impl: paged_nn.DecodeImpl = "auto",
                    max_model_len: int | None = None) -> BloomForCausalLM:
  """Loads a Hugging Face BLOOM checkpoint directory (`models.llama.load_pretrained`: its
  files, shards, errors and generation_config.json's eos ids).

  Args:
    path: a directory with config.json and model.safetensors or its shards.
    dtype, param_dtype, decode_impl: as for `gpt2.GPT2LMHeadModel`.
    max_model_len: the longest sequence (prompt + new tokens) served, > 0; None: 2048
      (BLOOM's training context; ALiBi runs past it, as HF's does, with the quality it
      has there).
  """
  if max_model_len is not None and (not isinstance(max_model_len, int)
                                    or isinstance(max_model_len, bool) or max_model_len < 1):
    raise ValueError(f"max_model_len must be a positive int or None, got {max_model_len!r}")

  def config_of(config: dict[str, Any]) -> BloomConfig:
    c = BloomConfig.from_dict(config)
    return c if max_model_len is None else dataclasses.replace(c, n_positions=max_model_len)

  return llama.load_pretrained(path, config_of, functools.partial(
      BloomForCausalLM, dtype=dtype, param_dtype=param_dtype, decode_impl=decode_impl),
      hf_sources)


FAMILY = llama.family("bloom", MODEL_TYPES, from_pretrained)
