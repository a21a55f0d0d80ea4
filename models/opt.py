"""OPT in Flax NNX, decoding from a paged KV cache (`jax_paged.KVPool`).

Hugging Face's `OPTForCausalLM` (`model_type` "opt": Meta's OPT 125M, 1.3B, 2.7B, 6.7B,
13B, 30B, 66B, and the models tuned from them) is GPT-2's model (`models.gpt2`: learned
positions, pre-LayerNorm blocks with biases on every projection, an LM head tied to the
token embeddings) with a ReLU MLP (fc1, fc2), learned positions offset by two rows (OPT's
table starts at row 2), q / k / v / out_proj apart in the checkpoint (torch Linear weights,
transposed at load) under model.decoder.*, and HF's OPTConfig names and defaults (OPT
125M's shape). OPT-350M's layout (post-LayerNorm blocks, embeddings projected from
word_embed_proj_dim) is refused by name, as are enable_bias=False and LayerNorms without
affine parameters (no released checkpoint has them).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable

import jax
import jax.numpy as jnp

from jax_paged import lora
from models import gpt2
from models import llama

MODEL_TYPES = ("opt",)


@dataclasses.dataclass(frozen=True)
class OPTConfig(gpt2.GPT2Config):
  """OPT hyperparameters under GPT-2's field names (`from_dict` reads HF's; defaults HF's
  OPTConfig's)."""

  vocab_size: int = 50272
  n_positions: int = 2048
  n_inner: int | None = 3072
  activation_function: str = "relu"
  bos_token_id: int | None = 2
  eos_token_id: int | None = 2

  @classmethod
  def from_dict(cls, config: dict[str, Any]) -> "OPTConfig":
    """From a Hugging Face OPTConfig dict: its field names as GPT-2's; the layouts no
    checkpoint of this model's has refused (the module docstring)."""
    config = dict(config)
    hidden = config.get("hidden_size", 768)
    for name, allowed, why in (
        ("do_layer_norm_before", True, "OPT-350M's post-LayerNorm blocks"),
        ("_remove_final_layer_norm", False, "a model without its final LayerNorm"),
        ("word_embed_proj_dim", hidden, "OPT-350M's projected embeddings"),
        ("enable_bias", True, "projections without biases"),
        ("layer_norm_elementwise_affine", True, "LayerNorms without parameters")):
      if config.get(name, allowed) != allowed:
        raise ValueError(f"{name}={config[name]!r} ({why}) is not supported; only "
                         f"{allowed!r}")
    for theirs, ours in (("hidden_size", "n_embd"), ("num_hidden_layers", "n_layer"),
                         ("num_attention_heads", "n_head"), ("ffn_dim", "n_inner"),
                         ("max_position_embeddings", "n_positions"),
                         ("init_std", "initializer_range")):
      if theirs in config:
        config[ours] = config.pop(theirs)
    return super().from_dict(config)


class OPTForCausalLM(gpt2.GPT2LMHeadModel):
  """OPT with an LM head tied to the token embeddings: `gpt2.GPT2LMHeadModel` (its Args)
  with the positions' table offset by two rows."""

  position_offset = 2

  def lora_targets(self) -> dict[str, lora.Target]:
    """Hugging Face module name -> where its LoRA update lands: q_proj, k_proj and v_proj
    in our fused qkv's columns, out_proj, fc1 and fc2 whole."""
    d = self.config.n_embd
    targets = {}
    for i, block in enumerate(self.h):
      prefix = f"model.decoder.layers.{i}."
      for j, name in enumerate(("q_proj", "k_proj", "v_proj")):
        targets[f"{prefix}self_attn.{name}"] = lora.Target(block.attn.qkv, j * d, d)
      targets[f"{prefix}self_attn.out_proj"] = lora.Target(block.attn.out)
      targets[f"{prefix}fc1"] = lora.Target(block.mlp.c_fc)
      targets[f"{prefix}fc2"] = lora.Target(block.mlp.c_proj)
    return targets


# Our modules under HF's OPT names.
_NAMES = {"wte": "embed_tokens", "wpe": "embed_positions", "ln_f": "final_layer_norm",
          "ln_1": "self_attn_layer_norm", "ln_2": "final_layer_norm",
          "attn.out": "self_attn.out_proj", "mlp.c_fc": "fc1", "mlp.c_proj": "fc2"}


def hf_sources(path: tuple[str, ...], config: OPTConfig
               ) -> tuple[list[str], Callable[[list[jax.Array]], jax.Array]]:
  """`llama.load_pretrained`'s `Sources` for OPT's tensor names: q / k / v_proj fused into
  qkv (weights and biases), torch Linear weights transposed."""
  *module, param = path
  param = "weight" if param in ("scale", "kernel", "embedding") else param
  if module[0] != "h":  # wte, wpe, ln_f
    return [f"model.decoder.{_NAMES[module[0]]}.{param}"], llama.whole
  _, layer, *inner = module
  prefix = f"model.decoder.layers.{layer}."
  inner = ".".join(inner)
  if inner == "attn.qkv":
    return ([f"{prefix}self_attn.{p}_proj.{param}" for p in "qkv"],
            llama.linear_rows if path[-1] == "kernel"
            else functools.partial(jnp.concatenate, axis=0))
  return ([f"{prefix}{_NAMES[inner]}.{param}"],
          llama.linear_rows if path[-1] == "kernel" else llama.whole)


from_pretrained = llama.loader(OPTConfig, OPTForCausalLM, hf_sources, max_model_len=False)

FAMILY = llama.family("opt", MODEL_TYPES, from_pretrained, max_model_len=False)
