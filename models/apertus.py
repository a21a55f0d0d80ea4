"""Apertus in Flax NNX, decoding from a paged KV cache (`jax_paged.KVPool`).

Hugging Face's `ApertusForCausalLM` (`model_type` "apertus": the Swiss AI Initiative's
Apertus-8B and -70B, base and Instruct) is Llama's model (`models.llama`: GQA with llama3
RoPE, its loader, engine and tensor parallel splits) with each head of q and k
RMS-normalised before RoPE (Qwen3's), pre-norms named attention_layernorm and
feedforward_layernorm, and Nemotron's plain MLP (`models.nemotron`: up_proj, down_proj,
no gate) whose activation is xIELU (Huang et al., 2024) with two learned scalars per layer
(`Xielu`); HF's ApertusConfig defaults (Apertus-8B's shape) for omitted fields.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Callable, ClassVar, Mapping

import jax
import jax.numpy as jnp
from flax import nnx

from jax_paged import nn as paged_nn
from models import llama
from models import nemotron

MODEL_TYPES = ("apertus",)


@dataclasses.dataclass(frozen=True)
class ApertusConfig(llama.LlamaConfig):
  """Apertus hyperparameters under Hugging Face's field names (`llama.LlamaConfig`'s;
  defaults HF's ApertusConfig's). attention_bias puts biases on q, k, v and o."""

  vocab_size: int = 131072
  hidden_size: int = 4096
  intermediate_size: int = 14336
  num_hidden_layers: int = 32
  num_attention_heads: int = 32
  hidden_act: str = "xielu"
  max_position_embeddings: int = 65536
  rms_norm_eps: float = 1e-5
  rope_theta: float = 12_000_000.0
  rope_scaling: Any = (("factor", 8.0), ("high_freq_factor", 4.0), ("low_freq_factor", 1.0),
                       ("original_max_position_embeddings", 8192), ("rope_type", "llama3"))
  bos_token_id: int | None = 1
  eos_token_id: int | tuple[int, ...] | None = 2
  model_type: str = "apertus"

  model_types: ClassVar[tuple[str, ...]] = MODEL_TYPES
  # (xIELU has learned parameters: `XieluMLP` makes it, not the config.)
  activations: ClassVar[Mapping[str, Callable[[jax.Array], jax.Array] | None]] = {
      "xielu": None}
  plain_mlp: ClassVar[bool] = True

  @property
  def qk_norm(self) -> bool:
    return True

  @property
  def out_bias(self) -> bool:
    return self.attention_bias

  @classmethod
  def from_dict(cls, config: dict[str, Any]) -> "ApertusConfig":
    """`llama.LlamaConfig.from_dict` (omitted fields: the class's defaults, HF's; a
    config without RoPE settings gets HF's llama3 scaling); mlp_bias refused (HF's
    Apertus MLP has none)."""
    config = dict(config)
    if config.get("mlp_bias"):
      raise ValueError("mlp_bias is not supported (HF's Apertus MLP has no biases)")
    config.pop("sliding_window", None)  # (HF's Apertus has none)
    if not any(config.get(k) is not None
               for k in ("rope_parameters", "rope_scaling", "rope_theta")):
      config["rope_parameters"] = {"rope_theta": cls.rope_theta, **dict(cls.rope_scaling)}
    return llama.LlamaConfig.from_dict.__func__(cls, config)


class Xielu(nnx.Module):
  """xIELU (HF's XIELUActivation): for x > 0, a_p x^2 + beta x; else (expm1(min(x, eps))
  - x) a_n + beta x, with a_p = softplus(alpha_p), a_n = beta + softplus(alpha_n).

  Parameters (HF's, a layer's own): alpha_p, alpha_n float [1]; beta, eps float [] (HF's
  buffers, 0.5 and -1e-6), in param_dtype; computed in x's dtype, as HF's."""

  def __init__(self, *, param_dtype):
    softplus_inverse = lambda y: math.log(math.expm1(y))
    self.alpha_p = nnx.Param(jnp.full((1,), softplus_inverse(0.8), param_dtype))
    self.alpha_n = nnx.Param(jnp.full((1,), softplus_inverse(0.8 - 0.5), param_dtype))
    self.beta = nnx.Param(jnp.asarray(0.5, param_dtype))
    self.eps = nnx.Param(jnp.asarray(-1e-6, param_dtype))

  def __call__(self, x: jax.Array) -> jax.Array:
    """x [...] -> the same shape and dtype."""
    beta, eps = (p[...].astype(x.dtype) for p in (self.beta, self.eps))
    alpha_p = jax.nn.softplus(self.alpha_p[...]).astype(x.dtype)
    alpha_n = beta + jax.nn.softplus(self.alpha_n[...]).astype(x.dtype)
    return jnp.where(x > 0, alpha_p * x * x + beta * x,
                     (jnp.expm1(jnp.minimum(x, eps)) - x) * alpha_n + beta * x)


class XieluMLP(llama.PlainMLP):
  """c_proj(act_fn(c_fc(x))): Apertus's up_proj / down_proj MLP (`llama.PlainMLP`'s
  projections; `act_fn` its `Xielu`, HF's name, in place of PlainMLP's `activation`,
  None here: the config has no parameter-free one)."""

  def __init__(self, config: ApertusConfig, *, dtype, param_dtype, rngs: nnx.Rngs):
    super().__init__(config, dtype=dtype, param_dtype=param_dtype, rngs=rngs)
    self.act_fn = Xielu(param_dtype=param_dtype)

  def hidden(self, x: jax.Array, adapters: jax.Array | None = None) -> jax.Array:
    """act_fn(c_fc(x)) [..., intermediate] (the GEMM one kernel at decode's few rows, the
    activation after it: its learned scalars are not a kernel's static epilogue)."""
    return self.act_fn(paged_nn.dense(self.c_fc, x, adapters=adapters))


class DecoderLayer(llama.DecoderLayer):
  """Llama's block with `XieluMLP`."""

  def _make_mlp(self, config: ApertusConfig, layer: int, **kwargs) -> nnx.Module:
    del layer
    return XieluMLP(config, **kwargs)


class ApertusForCausalLM(nemotron.NemotronForCausalLM):
  """Apertus with an LM head: `llama.LlamaForCausalLM` over these blocks (its Args), LoRA
  targets under HF's names (Nemotron's: q / k / v / o_proj, up_proj, down_proj)."""

  decoder_layer = DecoderLayer


# Our modules -> Apertus's HF names (the rest: Nemotron's plain MLP, Llama's).
_NORMS = {"input_layernorm": "attention_layernorm",
          "post_attention_layernorm": "feedforward_layernorm"}


def hf_sources(path: tuple[str, ...], config: ApertusConfig
               ) -> tuple[list[str], Callable[[list[jax.Array]], jax.Array]]:
  """`nemotron.plain_mlp_sources` under Apertus's names: the pre-norms (`_NORMS`) and each
  MLP's xIELU scalars (mlp.act_fn.*)."""
  if path[0] == "layers" and path[2] in _NORMS:
    return [f"model.layers.{path[1]}.{_NORMS[path[2]]}.weight"], llama.whole
  if path[0] == "layers" and path[2:4] == ("mlp", "act_fn"):
    return [f"model.layers.{path[1]}.mlp.act_fn.{path[4]}"], llama.whole
  return nemotron.plain_mlp_sources(path, config)


from_pretrained = llama.loader(ApertusConfig, ApertusForCausalLM, hf_sources)

FAMILY = llama.family("apertus", MODEL_TYPES, from_pretrained)
