"""Phi-1, Phi-1.5 and Phi-2 in Flax NNX, decoding from a paged KV cache (`jax_paged.KVPool`).

Hugging Face's `PhiForCausalLM` (`model_type` "phi": Microsoft's phi-1, phi-1_5, phi-2) is
Llama's model (`models.llama`: RoPE, attention through `nn.PagedAttention`, its loader,
engine and adapters) with:

* one LayerNorm per block feeding both branches, added in parallel to the stream:
  x + dense(attention(ln(x))) + fc2(gelu(fc1(ln(x)))) (the attention's add fused with its
  projection, `nn.project_add`; the MLP's with the next LayerNorm, `nn.project_add_norm`);
* RoPE on the first partial_rotary_factor of each head's features (Phi-2's 0.4: 32 of 80);
* biases on q, k, v, dense, fc1, fc2 and the LM head (whose bias moves the argmax: greedy
  decoding takes it from the logits, not from `nn.attend_argmax`'s kernel);
* HF's PhiConfig defaults (phi-1's shape) for the fields a config.json omits.
q / k LayerNorms (qk_layernorm) are refused by name: no released Phi checkpoint has them.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, ClassVar, Mapping

import jax
import jax.numpy as jnp
from flax import nnx

from jax_paged import lora
from jax_paged import nn as paged_nn
from jax_paged import pool as pool_lib
from models import gpt2
from models import llama

MODEL_TYPES = ("phi",)


@dataclasses.dataclass(frozen=True)
class PhiConfig(llama.LlamaConfig):
  """Phi hyperparameters under Hugging Face's field names (`llama.LlamaConfig`'s, defaults
  PhiConfig's; rms_norm_eps unused).

  Attributes beyond `llama.LlamaConfig`'s:
    layer_norm_eps: the LayerNorms' epsilon.
  Every projection has a bias (attention_bias and mlp_bias are always set).
  """

  vocab_size: int = 51200
  hidden_size: int = 2048
  intermediate_size: int = 8192
  num_hidden_layers: int = 24
  num_attention_heads: int = 32
  hidden_act: str = "gelu_new"
  partial_rotary_factor: float = 0.5
  attention_bias: bool = True
  mlp_bias: bool = True
  layer_norm_eps: float = 1e-5
  model_type: str = "phi"

  model_types: ClassVar[tuple[str, ...]] = MODEL_TYPES
  activations: ClassVar[Mapping[str, Callable[[jax.Array], jax.Array]]] = gpt2.ACTIVATIONS
  plain_mlp: ClassVar[bool] = True

  def make_norm(self, param_dtype) -> paged_nn.LayerNorm:
    """A LayerNorm (a weight and a bias) of layer_norm_eps."""
    return paged_nn.LayerNorm(self.hidden_size, epsilon=self.layer_norm_eps,
                              param_dtype=param_dtype)

  @property
  def out_bias(self) -> bool:
    return True

  @classmethod
  def from_dict(cls, config: dict[str, Any]) -> "PhiConfig":
    """`llama.LlamaConfig.from_dict` (omitted fields: the class's defaults, HF's); every
    projection biased; ValueError for qk_layernorm."""
    if config.get("qk_layernorm"):
      raise ValueError("qk_layernorm (LayerNorms on q and k) is not supported")
    config = {**config, "attention_bias": True, "mlp_bias": True}
    config.pop("sliding_window", None)  # (HF's Phi has none)
    return llama.LlamaConfig.from_dict.__func__(cls, config)


class DecoderLayer(llama.DecoderLayer):
  """A Phi block: one LayerNorm, the attention and the plain MLP in parallel from it."""

  def __init__(self, config: PhiConfig, layer: int, *, dtype, param_dtype,
               decode_impl: paged_nn.DecodeImpl, rngs: nnx.Rngs):
    self.input_layernorm = config.make_norm(param_dtype)
    self.self_attn = self._make_attention(config, layer, decode_impl=decode_impl,
                                          dtype=dtype, param_dtype=param_dtype, rngs=rngs)
    self.mlp = self._make_mlp(config, layer, dtype=dtype, param_dtype=param_dtype,
                              rngs=rngs)

  def __call__(self, x: jax.Array, h: jax.Array, kv: pool_lib.KVPool, layer: int,
               attend: llama.Attend, next_norm: paged_nn.LayerNorm,
               adapters: jax.Array | None = None
               ) -> tuple[jax.Array, jax.Array, pool_lib.KVPool]:
    """As `models.llama.DecoderLayer`'s: x the residual stream and h = input_layernorm(x)
    -> (x + dense(attention(h)) + fc2(mlp(h)), its `next_norm`, the pool)."""
    m = self.mlp.hidden(h, adapters)
    a, kv = attend(self.self_attn, h, kv, layer)
    x = paged_nn.project_add(self.self_attn.out, a, x, adapters=adapters)
    x, h = paged_nn.project_add_norm(self.mlp.down, m, x, next_norm, adapters=adapters)
    return x, h, kv


class BiasedHead:
  """A `llama.LlamaForCausalLM` mixin: an LM head with a bias, `lm_head_bias` [vocab] in
  param_dtype (HF's lm_head.bias), where the config's `lm_head_bias` (default True) says
  so (Phi's, GPT-J's, Phi-MoE's)."""

  def __init__(self, config, *, dtype=jnp.float32, param_dtype=None,
               decode_impl: paged_nn.DecodeImpl = "auto", rngs: nnx.Rngs):
    super().__init__(config, dtype=dtype, param_dtype=param_dtype, decode_impl=decode_impl,
                     rngs=rngs)
    self.lm_head_bias = nnx.Param(jnp.zeros(
        (config.vocab_size,), dtype if param_dtype is None else param_dtype)) if getattr(
            config, "lm_head_bias", True) else None

  def logits(self, h: jax.Array) -> jax.Array:
    """float32 logits [..., vocab] of final hidden states h [..., hidden_size], the head's
    bias added."""
    logits = super().logits(h)
    return logits if self.lm_head_bias is None else (
        logits + self.lm_head_bias[...].astype(jnp.float32))

  def _greedy(self, h: jax.Array) -> jax.Array:
    """int32 argmax of `logits(h)` (a bias moves it: `nn.attend_argmax` has none)."""
    if self.lm_head_bias is None:
      return super()._greedy(h)
    return jnp.argmax(self.logits(h), axis=-1).astype(jnp.int32)


class PhiForCausalLM(BiasedHead, llama.LlamaForCausalLM):
  """Phi with a biased LM head (`BiasedHead`), attending through a `KVPool`:
  `LlamaForCausalLM`'s forwards, pool and tensor parallel splits over Phi's blocks (its
  Args)."""

  decoder_layer = DecoderLayer

  def lora_targets(self) -> dict[str, lora.Target]:
    """Hugging Face module name -> where its LoRA update lands (`jax_paged.PagedModel`):
    q_proj, k_proj and v_proj in our fused qkv's columns, dense, fc1 and fc2 whole."""
    renames = {".self_attn.o_proj": ".self_attn.dense", ".mlp.c_fc": ".mlp.fc1",
               ".mlp.c_proj": ".mlp.fc2"}
    targets = {}
    for name, target in super().lora_targets().items():
      for ours, theirs in renames.items():
        name = name.replace(ours, theirs)
      targets[name] = target
    return targets


# Our modules under HF's Phi names (the rest are Llama's: q / k / v, the norms).
_NAMES = {"self_attn.out": "self_attn.dense", "mlp.c_fc": "mlp.fc1", "mlp.c_proj": "mlp.fc2"}


def hf_sources(path: tuple[str, ...], config: PhiConfig
               ) -> tuple[list[str], Callable[[list[jax.Array]], jax.Array]]:
  """`llama.load_pretrained`'s `Sources` for Phi's tensor names."""
  if path == ("lm_head_bias",):
    return ["lm_head.bias"], llama.whole
  if path[0] == "norm":
    return [f"model.final_layernorm.{'weight' if path[1] == 'scale' else path[1]}"], llama.whole
  if path[0] == "layers" and ".".join(path[2:-1]) in _NAMES:
    name = f"model.layers.{path[1]}.{_NAMES['.'.join(path[2:-1])]}"
    if path[-1] == "kernel":
      return [f"{name}.weight"], llama.linear_rows
    return [f"{name}.{path[-1]}"], llama.whole
  return llama.hf_sources(path, config)


from_pretrained = llama.loader(PhiConfig, PhiForCausalLM, hf_sources)

FAMILY = llama.family("phi", MODEL_TYPES, from_pretrained)
