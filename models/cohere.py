"""Cohere's Command models in Flax NNX, decoding from a paged KV cache (`jax_paged.KVPool`).

Hugging Face's `CohereForCausalLM` (`model_type` "cohere": Command R, Command R+, Aya 23,
Aya Expanse) and `Cohere2ForCausalLM` ("cohere2": Command R7B, Command A) are Llama's
model (`models.llama`: GQA through `nn.PagedAttention`, a SwiGLU MLP, its loader, engine
and adapters) with:

* one LayerNorm per block, without a bias, feeding attention and MLP in parallel, both
  added to the block's input (`models.stablelm`'s parallel block, Phi's);
* RoPE over interleaved feature pairs (x0, x1), (x2, x3), ...: q_proj's and k_proj's rows
  (their biases, q / k norms' weights and LoRA columns too) are reordered per head at load
  into rotate-half order (`llama.deinterleave`), which leaves q . k, and so the model,
  unchanged;
* with use_qk_norm (Command R+), each head of q and of k LayerNorm-ed with a weight of its
  own (`nn.HeadLayerNorm`), before RoPE;
* the logits times logit_scale (the greedy argmax needs no product: it is positive);
* Cohere2's layers: each 4th (sliding_window_pattern's, or layer_types') attends to every
  earlier position without RoPE (a NoPE layer), the others through a sliding window with
  RoPE;
* HF's CohereConfig / Cohere2Config defaults for the fields a config.json omits.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, ClassVar

import jax
import jax.numpy as jnp
import numpy as np

from jax_paged import lora
from jax_paged import nn as paged_nn
from jax_paged.kernels import validation
from models import llama
from models import stablelm

MODEL_TYPES = ("cohere", "cohere2")


@dataclasses.dataclass(frozen=True)
class CohereConfig(llama.LlamaConfig):
  """Cohere hyperparameters under Hugging Face's field names (`llama.LlamaConfig`'s,
  defaults CohereConfig's: Command R's shape; rms_norm_eps unused).

  Attributes beyond `llama.LlamaConfig`'s:
    layer_norm_eps: the LayerNorms' epsilon (the q / k ones' too).
    logit_scale: the logits' factor, > 0.
    use_qk_norm: each head of q and of k LayerNorm-ed (its own weight) before RoPE.
  Cohere2's sliding / full layers are `layer_types` and `no_rope_layers` (`from_dict`).
  """

  vocab_size: int = 256000
  hidden_size: int = 8192
  intermediate_size: int = 22528
  num_hidden_layers: int = 40
  num_attention_heads: int = 64
  max_position_embeddings: int = 8192
  rope_theta: float = 500000.0
  tie_word_embeddings: bool = True
  layer_norm_eps: float = 1e-5
  logit_scale: float = 0.0625
  use_qk_norm: bool = False
  bos_token_id: int | None = 5
  eos_token_id: int | tuple[int, ...] | None = 255001
  model_type: str = "cohere"

  model_types: ClassVar[tuple[str, ...]] = MODEL_TYPES
  # `stablelm.DecoderLayer`'s settings: Cohere's block is always the parallel one.
  use_parallel_residual: ClassVar[bool] = True

  def __post_init__(self):
    super().__post_init__()
    validation.check_positive_number("logit_scale", self.logit_scale)

  @property
  def out_bias(self) -> bool:
    return self.attention_bias  # (q, k, v and o_proj's, as HF's)

  @property
  def qk_layernorm(self) -> bool:
    return self.use_qk_norm

  def make_norm(self, param_dtype) -> paged_nn.LayerNorm:
    """A LayerNorm of layer_norm_eps with a weight and no bias."""
    return paged_nn.LayerNorm(self.hidden_size, epsilon=self.layer_norm_eps,
                              param_dtype=param_dtype, use_bias=False)

  @classmethod
  def from_dict(cls, config: dict[str, Any]) -> "CohereConfig":
    """`llama.LlamaConfig.from_dict` (omitted fields: HF's defaults for the model_type);
    Cohere2's layers as HF lays them out: layer_types, else a full-attention NoPE layer
    every sliding_window_pattern (4) layers, windowed RoPE layers between."""
    config = dict(config)
    if config.get("logit_scale", 0.0625) is None:
      raise ValueError("logit_scale must be a positive number, got None")
    cohere2 = config.setdefault("model_type", cls.model_type) == "cohere2"
    if not cohere2:
      config.pop("sliding_window", None)  # (HF's Cohere has no window)
    else:
      # HF's Cohere2Config defaults, and its head_dim (always hidden / heads).
      if "rope_parameters" not in config:
        config.setdefault("rope_theta", 10000.0)
      config.setdefault("sliding_window", 4096)
      config.pop("head_dim", None)
    result = llama.LlamaConfig.from_dict.__func__(cls, config)
    if not cohere2:
      return result
    layer_types = config.get("layer_types")
    if layer_types is None:
      pattern = config.get("sliding_window_pattern", 4)
      layer_types = ["sliding_attention" if (i + 1) % pattern else "full_attention"
                     for i in range(result.num_hidden_layers)]
    return dataclasses.replace(result, layer_types=tuple(layer_types), no_rope_layers=tuple(
        int(t == "sliding_attention") for t in layer_types))


class CohereForCausalLM(llama.LlamaForCausalLM):
  """Command R / R+ / R7B / A with a scaled LM head, attending through a `KVPool`:
  `LlamaForCausalLM`'s forwards, pool and tensor parallel splits over Cohere's blocks
  (`stablelm.DecoderLayer`'s parallel one; its Args)."""

  decoder_layer = stablelm.DecoderLayer

  def logits(self, h: jax.Array) -> jax.Array:
    """float32 logits [..., vocab] of final hidden states h [..., hidden_size], times
    logit_scale."""
    return super().logits(h) * jnp.float32(self.config.logit_scale)

  def lora_targets(self) -> dict[str, lora.Target]:
    """`LlamaForCausalLM.lora_targets` (HF's q / k / v / o_proj and MLP names), with q_proj's
    and k_proj's columns where the load's RoPE reorder put their weight's rows."""
    c = self.config
    q, kv = c.num_attention_heads * c.head_dim, c.num_key_value_heads * c.head_dim
    targets = super().lora_targets()
    for i, layer in enumerate(self.layers):
      for name, offset, width in (("q_proj", 0, q), ("k_proj", q, kv)):
        ours = offset + np.argsort(_rope_rows(width, c.head_dim))  # HF's column j -> ours
        targets[f"model.layers.{i}.self_attn.{name}"] = lora.Target(
            layer.self_attn.qkv, columns=tuple(ours.tolist()))
    return targets


def _rope_rows(rows: int, head_dim: int) -> np.ndarray:
  """The order of q_proj's (or k_proj's) `rows` rows turning each head's interleaved RoPE
  pairs into rotate-half order."""
  return llama.deinterleave(rows, head_dim, head_dim)


def hf_sources(path: tuple[str, ...], config: CohereConfig
               ) -> tuple[list[str], Callable[[list[jax.Array]], jax.Array]]:
  """`llama.load_pretrained`'s `Sources` for Cohere's tensor names: Llama's, with q_proj's
  and k_proj's rows (weights and biases) and the q / k norms' features in rotate-half
  order."""
  d = config.head_dim
  q, kv = config.num_attention_heads * d, config.num_key_value_heads * d
  if path[0] == "layers" and path[-2] in ("q_norm", "k_norm"):
    # [heads, head_dim], each head's features reordered as its q / k rows.
    return ([f"model.layers.{path[1]}.self_attn.{path[-2]}.weight"],
            lambda parts: llama.whole(parts)[:, _rope_rows(d, d)])
  names, assemble = llama.hf_sources(path, config)
  if path[0] == "layers" and path[2:4] == ("self_attn", "qkv"):
    q_rows, k_rows = _rope_rows(q, d), _rope_rows(kv, d)
    return names, lambda parts: assemble([parts[0][q_rows], parts[1][k_rows], parts[2]])
  return names, assemble


from_pretrained = llama.loader(CohereConfig, CohereForCausalLM, hf_sources)

FAMILY = llama.family("cohere", MODEL_TYPES, from_pretrained)
