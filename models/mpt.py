"""MPT in Flax NNX, decoding from a paged KV cache (`jax_paged.KVPool`).

Hugging Face's `MptForCausalLM` (`model_type` "mpt": MosaicML's MPT-7B / 30B and their
Instruct, Chat and StoryWriter tunes) is Llama's model (`models.llama`: its sequential
block, loader, engine and adapters) with:

* ALiBi in place of RoPE: head h adds slope_h times the key's distance from the query to
  its logits (`nn.alibi_slopes(n_heads)`: alibi_bias_max 8, inside the paged kernels), up
  to max_seq_len positions (HF's bias table's length);
* LayerNorms with a weight and no bias, no bias on any projection (HF's MPT has none,
  whatever no_bias says), q / k / v in one Wqkv projection laid out [q | k | v] (our
  fused layout as it is), a plain MLP down_proj(gelu(up_proj(x))) of expansion_ratio x
  d_model (exact GELU), an LM head tied to wte;
* softmax_scale (None: head_dim^-0.5) scaling the logits before the biases; clip_qkv
  clamping Wqkv's outputs (`nn.PagedAttention(clip_qkv=)`);
* MPT's config names (d_model, n_heads, n_layers, max_seq_len, attn_config) and HF's
  MptConfig defaults for the fields a config.json omits.

What HF's port silently ignores is refused by name: attn_config's qk_ln, prefix_lm, alibi false (learned positions), alibi_bias_max other than 8 and multi-query
attn_type, a logit_scale, no_bias false, and norm types other than LayerNorm.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, ClassVar, Mapping

import jax
import numpy as np

from jax_paged import lora
from jax_paged import nn as paged_nn
from models import gpt2
from models import llama

MODEL_TYPES = ("mpt",)

# MptConfig's names -> Llama's.
_HF_NAMES = {"d_model": "hidden_size", "n_heads": "num_attention_heads",
             "n_layers": "num_hidden_layers", "max_seq_len": "max_position_embeddings"}
_NORM_TYPES = ("layernorm", "low_precision_layernorm")


@dataclasses.dataclass(frozen=True)
class MptConfig(llama.LlamaConfig):
  """MPT hyperparameters under Llama's field names (`llama.LlamaConfig`'s; defaults HF's
  MptConfig's: MPT-1B's shape; rms_norm_eps and RoPE's fields unused).

  Attributes beyond `llama.LlamaConfig`'s:
    layer_norm_epsilon: the LayerNorms' epsilon.
  intermediate_size is expansion_ratio x hidden_size; attention_multiplier softmax_scale.
  """

  vocab_size: int = 50368
  hidden_size: int = 2048
  intermediate_size: int = 8192
  num_hidden_layers: int = 24
  num_attention_heads: int = 16
  max_position_embeddings: int = 2048
  hidden_act: str = "gelu"
  tie_word_embeddings: bool = True
  layer_norm_epsilon: float = 1e-5
  bos_token_id: int | None = None
  eos_token_id: int | tuple[int, ...] | None = None
  model_type: str = "mpt"

  model_types: ClassVar[tuple[str, ...]] = MODEL_TYPES
  activations: ClassVar[Mapping[str, Callable[[jax.Array], jax.Array]]] = {
      "gelu": gpt2.ACTIVATIONS["gelu"]}
  plain_mlp: ClassVar[bool] = True

  @property
  def alibi_slopes(self) -> np.ndarray:
    return paged_nn.alibi_slopes(self.num_attention_heads)

  def layer_rope(self, layer: int) -> None:
    """None: MPT's positions are ALiBi's."""
    return None

  def make_norm(self, param_dtype) -> paged_nn.LayerNorm:
    """A LayerNorm of layer_norm_epsilon with a weight and no bias."""
    return paged_nn.LayerNorm(self.hidden_size, epsilon=self.layer_norm_epsilon,
                              param_dtype=param_dtype, use_bias=False)

  @classmethod
  def from_dict(cls, config: dict[str, Any]) -> "MptConfig":
    """From an MPT config.json (omitted fields: HF's MptConfig defaults, attn_config's
    MptAttentionConfig's); ValueError for what HF's MPT does not compute (see the module
    docstring)."""
    config = dict(config)
    model_type = config.setdefault("model_type", cls.model_type)
    if model_type not in MODEL_TYPES:
      raise ValueError(f"model_type {model_type!r} is not supported by MptConfig; use one "
                       f"of {list(MODEL_TYPES)}")
    attn = dict(config.pop("attn_config", None) or {})
    for name, allowed in (("qk_ln", False), ("prefix_lm", False),
                          ("alibi", True), ("alibi_bias_max", 8),
                          ("attn_type", "multihead_attention")):
      if attn.get(name, allowed) != allowed:
        raise ValueError(f"attn_config {name}={attn[name]!r} is not supported (HF's MPT "
                         f"computes {name}={allowed!r})")
    for name, allowed in (("logit_scale", None), ("no_bias", True)):
      if config.get(name, allowed) != allowed:
        raise ValueError(f"{name}={config[name]!r} is not supported (HF's MPT computes "
                         f"{name}={allowed!r})")
    if config.get("norm_type", _NORM_TYPES[1]) not in _NORM_TYPES:
      raise ValueError(f"norm_type {config['norm_type']!r} is not supported; use one of "
                       f"{list(_NORM_TYPES)}")
    for theirs, ours in _HF_NAMES.items():
      if theirs in config:
        config[ours] = config.pop(theirs)
    hidden = config.setdefault("hidden_size", cls.hidden_size)
    config["intermediate_size"] = int(config.pop("expansion_ratio", 4)) * hidden
    config.update(attention_bias=False, mlp_bias=False)
    for unused in ("head_dim", "rope_theta", "rope_scaling", "rope_parameters"):
      config.pop(unused, None)
    result = llama.LlamaConfig.from_dict.__func__(cls, config)
    # (Llama's from_dict keeps attention_multiplier for Granite's only, clip_qkv for none.)
    return dataclasses.replace(result, attention_multiplier=attn.get("softmax_scale"),
                               clip_qkv=attn.get("clip_qkv"))


class MptForCausalLM(llama.LlamaForCausalLM):
  """MPT with an LM head tied to wte, attending through a `KVPool` with ALiBi:
  `LlamaForCausalLM`'s forwards, pool and tensor parallel splits (its Args)."""

  def lora_targets(self) -> dict[str, lora.Target]:
    """Hugging Face module name -> where its LoRA update lands (`jax_paged.PagedModel`):
    each block's attn.Wqkv (our qkv as it is), attn.out_proj, ffn.up_proj and
    ffn.down_proj."""
    targets = {}
    for i, layer in enumerate(self.layers):
      for name, linear in (("attn.Wqkv", layer.self_attn.qkv),
                           ("attn.out_proj", layer.self_attn.out),
                           ("ffn.up_proj", layer.mlp.c_fc), ("ffn.down_proj", layer.mlp.c_proj)):
        targets[f"transformer.blocks.{i}.{name}"] = lora.Target(linear)
    return targets


# Our modules under HF's MPT names.
_NAMES = {"input_layernorm": "norm_1", "self_attn.qkv": "attn.Wqkv",
          "self_attn.out": "attn.out_proj", "post_attention_layernorm": "norm_2",
          "mlp.c_fc": "ffn.up_proj", "mlp.c_proj": "ffn.down_proj"}


def hf_sources(path: tuple[str, ...], config: MptConfig
               ) -> tuple[list[str], Callable[[list[jax.Array]], jax.Array]]:
  """`llama.load_pretrained`'s `Sources` for MPT's tensor names (torch Linear weights
  transposed)."""
  if path == ("embed_tokens", "embedding"):
    return ["transformer.wte.weight"], llama.whole
  *module, param = path
  param = "weight" if param in ("scale", "kernel") else param
  if module == ["norm"]:
    return [f"transformer.norm_f.{param}"], llama.whole
  _, layer, *module = module
  name = f"transformer.blocks.{layer}.{_NAMES['.'.join(module)]}.{param}"
  return [name], llama.linear_rows if path[-1] == "kernel" else llama.whole


from_pretrained = llama.loader(MptConfig, MptForCausalLM, hf_sources)

FAMILY = llama.family("mpt", MODEL_TYPES, from_pretrained)
