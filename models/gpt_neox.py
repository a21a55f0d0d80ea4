"""GPT-NeoX in Flax NNX, decoding from a paged KV cache (`jax_paged.KVPool`).

Hugging Face's `GPTNeoXForCausalLM` (`model_type` "gpt_neox": EleutherAI's Pythia 70M -
12B and GPT-NeoX-20B, and models trained on its code: Dolly v2, RedPajama-INCITE) is
Llama's model (`models.llama`: multi-head attention through `nn.PagedAttention`, its
engine, loader and adapters) with:

* RoPE on the first rotary_pct of each head's features only (Pythia's 0.25: the config's
  partial_rotary_factor, `nn.RotaryEmbedding(rotary_dim=)`), the rest passing unrotated;
* a parallel residual (use_parallel_residual, every Pythia): a block adds attention(
  input_layernorm(x)) and mlp(post_attention_layernorm(x)) to x together, both branches
  reading the block's input; the attention's add is one fused projection-add, the MLP's
  fused with the next block's norm (`nn.project_add`, `nn.project_add_norm`). Without it,
  Llama's sequential pre-norm block;
* LayerNorms with biases (layer_norm_eps), a plain MLP dense_4h_to_h(act(dense_h_to_4h(
  x))) (`llama.PlainMLP`; Pythia's exact erf GELU), biases on every projection;
* q, k and v in one query_key_value projection laid out head by head ([q_h; k_h; v_h] for
  each head h), reordered at load into `nn.PagedAttention`'s q heads, k heads, v heads.

LoRA adapters target query_key_value (PEFT's default for GPT-NeoX: its B's columns land
where the load put their weight's, `lora.Target(columns=)`), attention.dense,
mlp.dense_h_to_4h and mlp.dense_4h_to_h.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable, ClassVar, Mapping

import jax
import numpy as np

from jax_paged import lora
from jax_paged import nn as paged_nn
from jax_paged import pool as pool_lib
from models import gpt2
from models import llama

MODEL_TYPES = ("gpt_neox",)


@dataclasses.dataclass(frozen=True)
class GPTNeoXConfig(llama.LlamaConfig):
  """GPT-NeoX hyperparameters under Hugging Face's field names (`llama.LlamaConfig`'s;
  defaults GPTNeoXConfig's; multi-head: num_key_value_heads is num_attention_heads).

  partial_rotary_factor is HF 4's rotary_pct (0.25 by default). Attributes beyond
  `llama.LlamaConfig`'s:
    use_parallel_residual: the parallel block (attention and MLP both from the block's
      input) rather than the sequential one.
    layer_norm_eps: the LayerNorms' epsilon.
  attention_bias puts biases on query_key_value and dense; the MLP always has them.
  """

  vocab_size: int = 50432
  hidden_size: int = 6144
  intermediate_size: int = 24576
  num_hidden_layers: int = 44
  num_attention_heads: int = 64
  hidden_act: str = "gelu"
  attention_bias: bool = True
  mlp_bias: bool = True
  bos_token_id: int | None = 0
  eos_token_id: int | tuple[int, ...] | None = 2
  partial_rotary_factor: float = 0.25
  use_parallel_residual: bool = True
  layer_norm_eps: float = 1e-5
  model_type: str = "gpt_neox"

  model_types: ClassVar[tuple[str, ...]] = MODEL_TYPES
  activations: ClassVar[Mapping[str, Callable[[jax.Array], jax.Array]]] = {
      name: gpt2.ACTIVATIONS[name]
      for name in ("gelu", "gelu_new", "gelu_pytorch_tanh", "relu", "silu")}
  plain_mlp: ClassVar[bool] = True

  def make_norm(self, param_dtype) -> paged_nn.LayerNorm:
    """A LayerNorm (a weight and a bias) of layer_norm_eps."""
    return paged_nn.LayerNorm(self.hidden_size, epsilon=self.layer_norm_eps,
                              param_dtype=param_dtype)

  @property
  def out_bias(self) -> bool:
    return self.attention_bias

  @classmethod
  def from_dict(cls, config: dict[str, Any]) -> "GPTNeoXConfig":
    """`llama.LlamaConfig.from_dict` (omitted fields: the class's defaults, HF's), RoPE
    read as HF reads it: transformers 5's rope_parameters (partial_rotary_factor in it),
    or 4's rotary_pct, rotary_emb_base and rope_scaling."""
    config = dict(config)
    rope = config.pop("rope_parameters", None)
    if rope is None:  # transformers 4's fields
      rope = dict(config.pop("rope_scaling", None) or {})
      rope.setdefault("rope_theta", config.pop("rotary_emb_base",
                                               config.get("rope_theta", 10000.0)))
    if not isinstance(rope, Mapping):
      raise ValueError(f"rope_parameters must be a dict, got {rope!r}")
    rope = dict(rope)
    rope.setdefault("rope_type", rope.pop("type", "default"))
    config["partial_rotary_factor"] = rope.pop(
        "partial_rotary_factor", config.pop("rotary_pct",
                                            config.pop("partial_rotary_factor", 0.25)))
    config.update(rope_parameters=rope, mlp_bias=True)
    config.pop("num_key_value_heads", None)  # (HF's GPT-NeoX has none: multi-head)
    return llama.LlamaConfig.from_dict.__func__(cls, config)


class DecoderLayer(llama.DecoderLayer):
  """A GPT-NeoX block: Llama's (the config's LayerNorms and plain MLP), parallel or
  sequential (Llama's forward)."""

  def __init__(self, config: GPTNeoXConfig, layer: int, **kwargs):
    super().__init__(config, layer, **kwargs)
    self.parallel = config.use_parallel_residual

  def __call__(self, x: jax.Array, h: jax.Array, kv: pool_lib.KVPool, layer: int,
               attend: llama.Attend, next_norm: paged_nn.LayerNorm,
               adapters: jax.Array | None = None
               ) -> tuple[jax.Array, jax.Array, pool_lib.KVPool]:
    """As `models.llama.DecoderLayer`'s: x the residual stream and h = input_layernorm(x)
    -> (the new stream, its `next_norm`, the pool). Parallel: x + dense(attention(h)) +
    dense_4h_to_h(mlp(post_attention_layernorm(x)))."""
    if not self.parallel:
      return super().__call__(x, h, kv, layer, attend, next_norm, adapters)
    m = self.mlp.hidden(self.post_attention_layernorm(x), adapters)
    a, kv = attend(self.self_attn, h, kv, layer)
    x = paged_nn.project_add(self.self_attn.out, a, x, adapters=adapters)
    x, h = paged_nn.project_add_norm(self.mlp.down, m, x, next_norm, adapters=adapters)
    return x, h, kv


class GPTNeoXForCausalLM(llama.LlamaForCausalLM):
  """GPT-NeoX with an LM head, attending through a `KVPool`: `LlamaForCausalLM`'s
  forwards, pool and tensor parallel splits over GPT-NeoX's blocks (its Args)."""

  decoder_layer = DecoderLayer

  def lora_targets(self) -> dict[str, lora.Target]:
    """Hugging Face module name -> where its LoRA update lands (`jax_paged.PagedModel`):
    each block's attention.query_key_value (each of its columns where `heads_first` put
    its weight's), attention.dense, mlp.dense_h_to_4h and mlp.dense_4h_to_h (whole)."""
    c = self.config
    hf_column = heads_first(c.num_attention_heads, False,
                             [np.arange(3 * c.num_attention_heads * c.head_dim)])
    columns = tuple(np.argsort(hf_column).tolist())  # HF's column j -> ours
    targets = {}
    for i, layer in enumerate(self.layers):
      for name, target in (
          ("attention.query_key_value", lora.Target(layer.self_attn.qkv, columns=columns)),
          ("attention.dense", lora.Target(layer.self_attn.out)),
          ("mlp.dense_h_to_4h", lora.Target(layer.mlp.c_fc)),
          ("mlp.dense_4h_to_h", lora.Target(layer.mlp.c_proj))):
        targets[f"gpt_neox.layers.{i}.{name}"] = target
    return targets


# Our modules under HF's GPT-NeoX names (the norms' are the same).
_NAMES = {"self_attn.out": "attention.dense", "mlp.c_fc": "mlp.dense_h_to_4h",
          "mlp.c_proj": "mlp.dense_4h_to_h"}


def heads_first(heads: int, kernel: bool, parts: list) -> jax.Array | np.ndarray:
  """query_key_value's weight [3 H D, hidden] (`kernel`) or bias [3 H D], laid out head by
  head (q, k, v of each), as our fused qkv's kernel [hidden, 3 H D] or bias: q of every
  head, then k, then v."""
  (w,) = parts
  w = w.reshape(heads, 3, -1, *w.shape[1:]).swapaxes(0, 1).reshape(w.shape)
  return w.T if kernel else w


def hf_sources(path: tuple[str, ...], config: GPTNeoXConfig
               ) -> tuple[list[str], Callable[[list[jax.Array]], jax.Array]]:
  """`llama.load_pretrained`'s `Sources` for GPT-NeoX's tensor names."""
  if path == ("embed_tokens", "embedding"):
    return ["gpt_neox.embed_in.weight"], llama.whole
  if path == ("lm_head", "embedding"):
    return ["embed_out.weight"], llama.whole
  *module, param = path
  param = "weight" if param == "scale" else param  # (a LayerNorm's scale is HF's weight)
  if module == ["norm"]:
    return [f"gpt_neox.final_layer_norm.{param}"], llama.whole
  _, layer, *module = module
  module = ".".join(module)
  prefix = f"gpt_neox.layers.{layer}."
  if module == "self_attn.qkv":
    name = f"{prefix}attention.query_key_value.{'weight' if param == 'kernel' else param}"
    return [name], functools.partial(heads_first, config.num_attention_heads,
                                     param == "kernel")
  name = prefix + _NAMES.get(module, module)
  if param == "kernel":
    return [f"{name}.weight"], llama.linear_rows
  return [f"{name}.{param}"], llama.whole


from_pretrained = llama.loader(GPTNeoXConfig, GPTNeoXForCausalLM, hf_sources)

FAMILY = llama.family("gpt_neox", MODEL_TYPES, from_pretrained)
