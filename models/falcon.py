"""Falcon in Flax NNX, decoding from a paged KV cache (`jax_paged.KVPool`).

Hugging Face's `FalconForCausalLM` (`model_type` "falcon": TII's Falcon-7B / 40B / 180B,
Falcon2-11B and their instruct tunes) is Llama's model (`models.llama`: RoPE, GQA / MQA
through `nn.PagedAttention`, its loader, engine and adapters) with:

* LayerNorms with biases (layer_norm_epsilon), in one of three blocks: Falcon-7B's one
  norm feeding attention and MLP in parallel (`models.phi`'s block; also
  new_decoder_architecture with num_ln_in_parallel_attn 1: Falcon2-11B), Falcon-40B's
  two (ln_attn for the attention, ln_mlp for the MLP, both from the block's input:
  `models.gpt_neox`'s parallel block), or the sequential pre-norm block (parallel_attn
  false);
* q, k and v in one query_key_value projection laid out per kv group ([q heads of the
  group, k, v]: new_decoder_architecture and multi-query) or per head ([q, k, v] of each:
  multi-head), reordered at load into our q heads, k heads, v heads (and a LoRA
  adapter's columns with them); kv heads num_kv_heads (new_decoder_architecture), one
  (multi_query) or one per head;
* a plain MLP dense_4h_to_h(gelu(dense_h_to_4h(x))) (ffn_hidden_size, exact GELU), biases
  on every projection with bias, a tied head by default;
* ALiBi in place of RoPE with alibi (Falcon-RW 1B / 7B: `nn.alibi_slopes` rounded to
  bfloat16 and divided by sqrt(head_dim), as RW's code adds the biases before the logits'
  scale). Hugging Face's eager attention adds them twice (transformers 5.24: once in its
  mask, once in the scores); its sdpa path, the default, matches RW's original code,
  and this model matches it (tests/test_falcon.py). HF also rounds each bias, slope x
  position, to bfloat16; ours stay float32 (the two agree where HF's is exact: slopes
  that are powers of two, few positions);
* HF's FalconConfig defaults (Falcon-7B's shape) for the fields a config.json omits.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Callable, ClassVar, Mapping

import jax
import jax.numpy as jnp
import numpy as np

from jax_paged import lora
from jax_paged import nn as paged_nn
from jax_paged import pool as pool_lib
from models import gpt2
from models import gpt_neox
from models import llama
from models import phi

MODEL_TYPES = ("falcon",)

# Falcon's config.json names -> HF's Llama names (`FalconConfig.from_dict`).
_HF_NAMES = {"layer_norm_epsilon": "layer_norm_eps", "ffn_hidden_size": "intermediate_size",
             "activation": "hidden_act"}


@dataclasses.dataclass(frozen=True)
class FalconConfig(llama.LlamaConfig):
  """Falcon hyperparameters under Llama's field names (`llama.LlamaConfig`'s; defaults
  FalconConfig's: Falcon-7B's shape; num_key_value_heads resolved from Falcon's
  new_decoder_architecture, multi_query and num_kv_heads).

  Attributes beyond `llama.LlamaConfig`'s:
    layer_norm_eps: the LayerNorms' epsilon.
    new_decoder_architecture: query_key_value laid out per kv group, and the block's
      norms counted by num_ln_in_parallel_attn.
    alibi: ALiBi biases on the attention logits, no RoPE (Falcon-RW).
    num_ln_in_parallel_attn: 1 (one norm for both branches) or 2 (ln_attn and ln_mlp).
    parallel_attn: the parallel block (without new_decoder_architecture).
  attention_bias and mlp_bias are HF's bias.
  """

  vocab_size: int = 65024
  hidden_size: int = 4544
  intermediate_size: int = 18176
  num_hidden_layers: int = 32
  num_attention_heads: int = 71
  num_key_value_heads: int | None = 1
  hidden_act: str = "gelu"
  tie_word_embeddings: bool = True
  layer_norm_eps: float = 1e-5
  new_decoder_architecture: bool = False
  num_ln_in_parallel_attn: int | None = None
  parallel_attn: bool = True
  alibi: bool = False
  bos_token_id: int | None = 11
  eos_token_id: int | tuple[int, ...] | None = 11
  model_type: str = "falcon"

  model_types: ClassVar[tuple[str, ...]] = MODEL_TYPES
  activations: ClassVar[Mapping[str, Callable[[jax.Array], jax.Array]]] = {
      name: gpt2.ACTIVATIONS[name] for name in ("gelu", "gelu_new", "gelu_pytorch_tanh",
                                                 "relu", "silu")}
  plain_mlp: ClassVar[bool] = True

  def __post_init__(self):
    super().__post_init__()
    if self.new_decoder_architecture and self.num_ln_in_parallel_attn is None:
      object.__setattr__(self, "num_ln_in_parallel_attn", 2)  # (HF's default there)
    if self.num_ln_in_parallel_attn not in (None, 1, 2):
      raise ValueError(f"num_ln_in_parallel_attn must be 1 or 2, got "
                       f"{self.num_ln_in_parallel_attn!r}")

  @property
  def block_norms(self) -> int:
    """The block's norms: 1 (both branches from one), 2 (one each, in parallel) or 0
    (the sequential block: input_layernorm, then post_attention_layernorm)."""
    if self.new_decoder_architecture:
      return self.num_ln_in_parallel_attn
    return 1 if self.parallel_attn else 0

  def make_norm(self, param_dtype) -> paged_nn.LayerNorm:
    """A LayerNorm (a weight and a bias) of layer_norm_eps."""
    return paged_nn.LayerNorm(self.hidden_size, epsilon=self.layer_norm_eps,
                              param_dtype=param_dtype)

  @property
  def out_bias(self) -> bool:
    return self.attention_bias

  @property
  def alibi_slopes(self) -> np.ndarray | None:
    """With alibi, RW's slopes (bfloat16, as its code rounds them) over sqrt(head_dim)."""
    if not self.alibi:
      return None
    # (numpy's bfloat16, ml_dtypes': no jax op, so nothing traced under eval_shape)
    slopes = paged_nn.alibi_slopes(self.num_attention_heads).astype(jnp.bfloat16)
    slopes = slopes.astype(np.float32)
    return slopes / math.sqrt(self.head_dim)

  def layer_rope(self, layer: int) -> paged_nn.RotaryEmbedding | None:
    """RoPE, or None with alibi."""
    return None if self.alibi else super().layer_rope(layer)

  @classmethod
  def from_dict(cls, config: dict[str, Any]) -> "FalconConfig":
    """From a Falcon config.json (omitted fields: HF's FalconConfig defaults): its names
    read as Llama's, the kv heads as HF counts them."""
    config = dict(config)
    for theirs, ours in _HF_NAMES.items():
      if theirs in config:
        config[ours] = config.pop(theirs)
    hidden = config.setdefault("hidden_size", cls.hidden_size)
    heads = config.setdefault("num_attention_heads", cls.num_attention_heads)
    if config.get("intermediate_size") is None:
      config["intermediate_size"] = 4 * hidden
    kv_heads = config.pop("num_kv_heads", None)
    if config.get("new_decoder_architecture", False):
      config["num_key_value_heads"] = heads if kv_heads is None else kv_heads
    else:  # (HF ignores num_kv_heads here)
      config["num_key_value_heads"] = 1 if config.get("multi_query", True) else heads
    bias = config.pop("bias", False)
    config.update(attention_bias=bias, mlp_bias=bias)
    config.pop("head_dim", None)  # (hidden / heads, as HF's)
    config.pop("sliding_window", None)
    return llama.LlamaConfig.from_dict.__func__(cls, config)


class DecoderLayer(llama.DecoderLayer):
  """A Falcon block (`FalconConfig.block_norms`): Phi's (one norm, parallel branches),
  GPT-NeoX's parallel one (a norm per branch) or Llama's sequential one."""

  def __init__(self, config: FalconConfig, layer: int, **kwargs):
    super().__init__(config, layer, **kwargs)
    self.norms = config.block_norms
    self.parallel = True  # (read by the GPT-NeoX block)
    if self.norms == 1:
      del self.post_attention_layernorm

  def __call__(self, x: jax.Array, h: jax.Array, kv: pool_lib.KVPool, layer: int,
               attend: llama.Attend, next_norm: paged_nn.LayerNorm,
               adapters: jax.Array | None = None
               ) -> tuple[jax.Array, jax.Array, pool_lib.KVPool]:
    """As `models.llama.DecoderLayer`'s, by the block's kind."""
    block = {1: phi.DecoderLayer, 2: gpt_neox.DecoderLayer, 0: llama.DecoderLayer}[self.norms]
    return block.__call__(self, x, h, kv, layer, attend, next_norm, adapters)


def qkv_rows(config: FalconConfig) -> np.ndarray:
  """The order of query_key_value's rows putting its q heads, then k heads, then v heads
  (our fused qkv's columns): grouped [q of the group, k, v] per kv head
  (new_decoder_architecture, multi-query), or [q, k, v] per head (multi-head)."""
  h, hkv, d = config.num_attention_heads, config.num_key_value_heads, config.head_dim
  if config.new_decoder_architecture or hkv == 1:
    rows = np.arange(h * d + 2 * hkv * d).reshape(hkv, h // hkv + 2, d)
    return np.concatenate([rows[:, :-2].reshape(-1), rows[:, -2].reshape(-1),
                           rows[:, -1].reshape(-1)])
  rows = np.arange(3 * h * d).reshape(h, 3, d)
  return rows.swapaxes(0, 1).reshape(-1)


class FalconForCausalLM(llama.LlamaForCausalLM):
  """Falcon with an LM head, attending through a `KVPool`: `LlamaForCausalLM`'s forwards,
  pool and tensor parallel splits over Falcon's blocks (its Args)."""

  decoder_layer = DecoderLayer

  def lora_targets(self) -> dict[str, lora.Target]:
    """Hugging Face module name -> where its LoRA update lands (`jax_paged.PagedModel`):
    each block's self_attention.query_key_value (each of its columns where `qkv_rows` put
    its weight's row), self_attention.dense, mlp.dense_h_to_4h and mlp.dense_4h_to_h."""
    columns = tuple(np.argsort(qkv_rows(self.config)).tolist())  # HF's column j -> ours
    targets = {}
    for i, layer in enumerate(self.layers):
      for name, target in (
          ("self_attention.query_key_value", lora.Target(layer.self_attn.qkv, columns=columns)),
          ("self_attention.dense", lora.Target(layer.self_attn.out)),
          ("mlp.dense_h_to_4h", lora.Target(layer.mlp.c_fc)),
          ("mlp.dense_4h_to_h", lora.Target(layer.mlp.c_proj))):
        targets[f"transformer.h.{i}.{name}"] = target
    return targets


# Our modules under HF's Falcon names, by the block's norms (`FalconConfig.block_norms`).
_NAMES = {"self_attn.out": "self_attention.dense", "mlp.c_fc": "mlp.dense_h_to_4h",
          "mlp.c_proj": "mlp.dense_4h_to_h"}
_NORMS = {2: {"input_layernorm": "ln_attn", "post_attention_layernorm": "ln_mlp"}}


def hf_sources(path: tuple[str, ...], config: FalconConfig
               ) -> tuple[list[str], Callable[[list[jax.Array]], jax.Array]]:
  """`llama.load_pretrained`'s `Sources` for Falcon's tensor names, query_key_value's rows
  reordered (`qkv_rows`)."""
  if path == ("embed_tokens", "embedding"):
    return ["transformer.word_embeddings.weight"], llama.whole
  if path == ("lm_head", "embedding"):
    return ["lm_head.weight"], llama.whole
  *module, param = path
  param = "weight" if param in ("scale", "kernel") else param
  if module == ["norm"]:
    return [f"transformer.ln_f.{param}"], llama.whole
  _, layer, *module = module
  module = ".".join(module)
  prefix = f"transformer.h.{layer}."
  if module == "self_attn.qkv":
    rows = qkv_rows(config)
    return ([f"{prefix}self_attention.query_key_value.{param}"],
            lambda parts: (parts[0][rows].T if path[-1] == "kernel" else parts[0][rows]))
  name = _NAMES.get(module) or _NORMS.get(config.block_norms, {}).get(module, module)
  return [f"{prefix}{name}.{param}"], (llama.linear_rows if path[-1] == "kernel"
                                       else llama.whole)


from_pretrained = llama.loader(FalconConfig, FalconForCausalLM, hf_sources)

FAMILY = llama.family("falcon", MODEL_TYPES, from_pretrained)
