"""StableLM in Flax NNX, decoding from a paged KV cache (`jax_paged.KVPool`).

Hugging Face's `StableLmForCausalLM` (`model_type` "stablelm": Stability AI's StableLM-3B-
4E1T, StableLM Zephyr 3B, StableLM 2 1.6B and 12B and their chat tunes) is Llama's model
(`models.llama`: RoPE, GQA through `nn.PagedAttention`, a SwiGLU MLP, its loader, engine
and adapters) with:

* LayerNorms (a weight and a bias, layer_norm_eps) where Llama has RMS norms, the final
  one too; each residual add is fused with the next LayerNorm after the projection;
* RoPE on the first partial_rotary_factor of each head's features (0.25 in every release);
* biases on q, k and v with use_qkv_bias (StableLM 2), none on o_proj or the MLP;
* StableLM 2 12B's settings: the parallel residual (use_parallel_residual: one LayerNorm
  per block feeding attention and MLP, both added to its input, as Phi's) and a LayerNorm
  of its own for each head of q and of k (qk_layernorm: `nn.HeadLayerNorm`, split by head
  under tensor parallelism);
* HF's StableLmConfig defaults (StableLM-3B-4E1T's shape) for the fields a config.json
  omits.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable, ClassVar

import jax
import jax.numpy as jnp
from flax import nnx

from jax_paged import nn as paged_nn
from jax_paged import pool as pool_lib
from models import llama
from models import phi

MODEL_TYPES = ("stablelm",)


@dataclasses.dataclass(frozen=True)
class StableLmConfig(llama.LlamaConfig):
  """StableLM hyperparameters under Hugging Face's field names (`llama.LlamaConfig`'s,
  defaults StableLmConfig's: StableLM-3B-4E1T's shape; rms_norm_eps unused).

  Attributes beyond `llama.LlamaConfig`'s:
    layer_norm_eps: the LayerNorms' epsilon (the q / k ones' too).
    qk_layernorm: each head of q and of k LayerNorm-ed (its own weight, no bias) before
      RoPE.
    use_parallel_residual: the parallel block (attention and MLP from one LayerNorm of
      the block's input) rather than the sequential one.
  HF's use_qkv_bias sets attention_bias, which here puts biases on q, k and v only.
  """

  vocab_size: int = 50304
  hidden_size: int = 2560
  intermediate_size: int = 6912
  num_hidden_layers: int = 32
  num_attention_heads: int = 32
  max_position_embeddings: int = 4096
  partial_rotary_factor: float = 0.25
  layer_norm_eps: float = 1e-5
  qk_layernorm: bool = False
  use_parallel_residual: bool = False
  bos_token_id: int | None = 0
  eos_token_id: int | tuple[int, ...] | None = 0
  model_type: str = "stablelm"

  model_types: ClassVar[tuple[str, ...]] = MODEL_TYPES

  def make_norm(self, param_dtype) -> paged_nn.LayerNorm:
    """A LayerNorm (a weight and a bias) of layer_norm_eps."""
    return paged_nn.LayerNorm(self.hidden_size, epsilon=self.layer_norm_eps,
                              param_dtype=param_dtype)

  @property
  def qkv_bias(self) -> bool:
    return self.attention_bias

  @property
  def out_bias(self) -> bool:
    return False

  @classmethod
  def from_dict(cls, config: dict[str, Any]) -> "StableLmConfig":
    """`llama.LlamaConfig.from_dict` (omitted fields: the class's defaults, HF's);
    use_qkv_bias read as attention_bias."""
    config = dict(config)
    config["attention_bias"] = bool(config.pop("use_qkv_bias", False))
    config.pop("mlp_bias", None)  # (HF's StableLM MLP has none)
    config.pop("sliding_window", None)  # (nor a window)
    return llama.LlamaConfig.from_dict.__func__(cls, config)


class DecoderLayer(llama.DecoderLayer):
  """A StableLM block: Llama's sequential one (its config's LayerNorms), or with
  use_parallel_residual Phi's (one LayerNorm, attention and MLP in parallel from it);
  per-head q / k LayerNorms with qk_layernorm."""

  def __init__(self, config: StableLmConfig, layer: int, *, dtype, param_dtype,
               decode_impl: paged_nn.DecodeImpl, rngs: nnx.Rngs):
    super().__init__(config, layer, dtype=dtype, param_dtype=param_dtype,
                     decode_impl=decode_impl, rngs=rngs)
    self.parallel = config.use_parallel_residual
    if self.parallel:  # (HF's parallel block has no second norm)
      del self.post_attention_layernorm

  def _make_attention(self, config: StableLmConfig, layer: int, *, decode_impl, param_dtype,
                      **kwargs) -> paged_nn.PagedAttention:
    attention = super()._make_attention(config, layer, decode_impl=decode_impl,
                                        param_dtype=param_dtype, **kwargs)
    if config.qk_layernorm:
      # One weight per head (HF's StableLmLayerNormPerHead), where `head_norm` would make
      # one norm shared by every head (Qwen3's).
      norm = functools.partial(paged_nn.HeadLayerNorm, head_dim=config.head_dim,
                               epsilon=config.layer_norm_eps, param_dtype=param_dtype)
      # (nnx.data: the attention's None norms were static attributes.)
      attention.q_norm = nnx.data(norm(config.num_attention_heads))
      attention.k_norm = nnx.data(norm(config.num_key_value_heads))
    return attention

  def __call__(self, x: jax.Array, h: jax.Array, kv: pool_lib.KVPool, layer: int,
               attend: llama.Attend, next_norm: paged_nn.LayerNorm,
               adapters: jax.Array | None = None
               ) -> tuple[jax.Array, jax.Array, pool_lib.KVPool]:
    """As `models.llama.DecoderLayer`'s; parallel: as `models.phi.DecoderLayer`'s."""
    block = phi.DecoderLayer if self.parallel else llama.DecoderLayer
    return block.__call__(self, x, h, kv, layer, attend, next_norm, adapters)


class StableLmForCausalLM(llama.LlamaForCausalLM):
  """StableLM with an LM head, attending through a `KVPool`: `LlamaForCausalLM`'s
  forwards, pool, adapters (HF's q / k / v / o_proj and MLP names) and tensor parallel
  splits over StableLM's blocks (its Args)."""

  decoder_layer = DecoderLayer


def hf_sources(path: tuple[str, ...], config: StableLmConfig
               ) -> tuple[list[str], Callable[[list[jax.Array]], jax.Array]]:
  """`llama.load_pretrained`'s `Sources` for StableLM's tensor names: Llama's, and each
  head's q / k LayerNorm weight stacked into `nn.HeadLayerNorm`'s [heads, head_dim]."""
  if path[0] == "layers" and path[-2] in ("q_norm", "k_norm"):
    heads = (config.num_attention_heads if path[-2] == "q_norm"
             else config.num_key_value_heads)
    name = f"model.layers.{path[1]}.self_attn.{path[-2][0]}_layernorm.norms"
    return [f"{name}.{i}.weight" for i in range(heads)], jnp.stack
  return llama.hf_sources(path, config)


from_pretrained = llama.loader(StableLmConfig, StableLmForCausalLM, hf_sources)

FAMILY = llama.family("stablelm", MODEL_TYPES, from_pretrained)
