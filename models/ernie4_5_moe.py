"""ERNIE 4.5 MoE in Flax NNX, decoding from a paged KV cache (`jax_paged.KVPool`).

Hugging Face's `Ernie4_5_MoeForCausalLM` (`model_type` "ernie4_5_moe": Baidu's
ERNIE-4.5-21B-A3B and ERNIE-4.5-300B-A47B, -PT and -Base-PT) is ERNIE 4.5's attention
(`models.ernie4_5`: GQA with RoPE over every feature of each head on interleaved pairs,
q_proj's and k_proj's rows reordered at load, `glm.rope_reordered`) over GLM-4.5's MoE
blocks (`models.glm4_moe`) with its own router and layer schedule:

* the router's softmax (in float32) plus a per-expert correction bias chooses each
  token's moe_k experts; their unbiased probabilities, divided by their sum (at least
  moe_norm_min), weight them (`ErnieMoE.route`);
* moe_num_shared_experts ungated shared experts (one MLP of that many experts' width);
* experts on layer i when moe_layer_start_index <= i <= moe_layer_end_index and
  (i + 1) % moe_layer_interval == 0, a dense MLP of intermediate_size elsewhere.

The checkpoints' multi-token-prediction layers (num_nextn_predict_layers) are not
loaded: decoding predicts one token per step. use_bias (no released checkpoint has it;
HF's model would put a bias on the LM head too) is refused.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, ClassVar

import jax
from jax import lax
import jax.numpy as jnp
from flax import nnx

from jax_paged import lora
from jax_paged.kernels import validation
from models import deepseek
from models import glm
from models import glm4_moe
from models import llama

MODEL_TYPES = ("ernie4_5_moe",)


@dataclasses.dataclass(frozen=True)
class Ernie4_5MoeConfig(glm4_moe.Glm4MoeConfig):  # pylint: disable=invalid-name (HF's)
  """ERNIE 4.5 MoE hyperparameters (`glm4_moe.Glm4MoeConfig`'s fields, read by `from_dict`
  from HF's names: moe_num_experts as num_local_experts, moe_k as num_experts_per_tok,
  moe_num_shared_experts as the shared experts' width). The defaults are HF's
  Ernie4_5_MoeConfig's (ERNIE-4.5-21B-A3B's shape), which a config.json omitting a field
  gets there too; first_k_dense_replace, n_group and topk_group are unused.

  Attributes beyond Glm4MoeConfig's:
    moe_layer_start_index, moe_layer_end_index, moe_layer_interval: the experts' layers
      (`sparse`); an end of None: the last layer.
    moe_norm_min: the least sum the chosen experts' probabilities are divided by.
  """

  vocab_size: int = 103424
  hidden_size: int = 2560
  intermediate_size: int = 12288
  num_hidden_layers: int = 28
  num_attention_heads: int = 20
  num_key_value_heads: int | None = 4
  head_dim: int | None = None  # None: hidden_size // num_attention_heads (HF's)
  max_position_embeddings: int = 131072
  rms_norm_eps: float = 1e-5
  rope_theta: float = 500000.0
  partial_rotary_factor: float = 1.0
  num_local_experts: int = 64
  num_experts_per_tok: int = 6
  moe_intermediate_size: int | None = 1536
  shared_expert_intermediate_size: int | None = 2 * 1536
  tie_word_embeddings: bool = True
  bos_token_id: int | None = 1
  eos_token_id: int | tuple[int, ...] | None = 2
  moe_layer_start_index: int = 1
  moe_layer_end_index: int | None = None
  moe_layer_interval: int = 1
  moe_norm_min: float = 1e-12
  model_type: str = "ernie4_5_moe"

  model_types: ClassVar[tuple[str, ...]] = MODEL_TYPES

  def __post_init__(self):
    super().__post_init__()
    end = self.num_hidden_layers - 1
    if self.moe_layer_end_index is None:
      object.__setattr__(self, "moe_layer_end_index", end)
    for name in ("moe_layer_start_index", "moe_layer_end_index"):
      value = getattr(self, name)
      if not (isinstance(value, int) and 0 <= value <= end):
        raise ValueError(f"{name} must be a layer index in [0, {end}], got {value!r}")
    validation.check_positive_int("moe_layer_interval", self.moe_layer_interval)
    validation.check_positive_number("moe_norm_min", self.moe_norm_min)

  def sparse(self, layer: int) -> bool:
    """Whether layer `layer`'s MLP is the experts (HF's Ernie4_5_MoeDecoderLayer's test)."""
    return ((layer + 1) % self.moe_layer_interval == 0
            and self.moe_layer_start_index <= layer <= self.moe_layer_end_index)

  @property
  def qk_norm(self) -> bool:
    return False

  @classmethod
  def from_dict(cls, config: dict[str, Any]) -> "Ernie4_5MoeConfig":
    """From a Hugging Face config dict (`llama.LlamaConfig.from_dict`: transformers 4's
    top-level rope_theta or 5's rope_parameters), fields it omits taking HF's defaults;
    HF's expert fields renamed (the class docstring); a moe_layer_end_index of -1 the
    last layer; head_dim, when absent, hidden_size // num_attention_heads."""
    config = dict(config)
    if config.pop("use_bias", False):
      raise ValueError("use_bias true is not supported for ERNIE 4.5 MoE (no released "
                       "checkpoint has biases; HF's would bias the LM head too)")
    config["head_dim"] = llama.hf_head_dim(config, cls)
    for ours, theirs in (("num_local_experts", "moe_num_experts"),
                         ("num_experts_per_tok", "moe_k")):
      if config.get(theirs) is not None:
        config[ours] = config.pop(theirs)
    shared = config.pop("moe_num_shared_experts", 2)
    config["shared_expert_intermediate_size"] = (
        shared * config.get("moe_intermediate_size", cls.moe_intermediate_size)
        if shared else None)
    if config.get("moe_layer_end_index") == -1:
      config["moe_layer_end_index"] = None
    return llama.LlamaConfig.from_dict.__func__(cls, config)


class ErnieMoE(deepseek.DeepseekMoE):
  """ERNIE 4.5's experts: `deepseek.DeepseekMoE` (a float32 router and correction bias,
  ungated shared experts) routed by `route`."""

  def __init__(self, config: Ernie4_5MoeConfig, *, dtype, param_dtype, rngs: nnx.Rngs):
    super().__init__(config, dtype=dtype, param_dtype=param_dtype, rngs=rngs)
    self.norm_min = config.moe_norm_min

  def route(self, x: jax.Array) -> tuple[jax.Array, jax.Array]:
    """x [tokens, hidden] -> (float32 weights, int32 experts), each [tokens, top_k]: the
    top k of the router's softmax plus the correction bias, weighted by their softmax
    probabilities over max(their sum, moe_norm_min) (HF's Ernie4_5_MoeTopKRouter)."""
    logits = jnp.dot(x.astype(jnp.float32), self.router[...].astype(jnp.float32),
                     precision=lax.Precision.HIGHEST)
    probs = jax.nn.softmax(logits, axis=-1)
    experts = lax.top_k(probs + self.correction_bias[...], self.top_k)[1]
    weights = jnp.take_along_axis(probs, experts, axis=-1)
    return weights / jnp.maximum(jnp.sum(weights, axis=-1, keepdims=True),
                                 self.norm_min), experts


class DecoderLayer(glm4_moe.DecoderLayer):
  """Llama's block with a dense MLP or `ErnieMoE` for its MLP."""

  def _make_mlp(self, config: Ernie4_5MoeConfig, layer: int, **kwargs) -> nnx.Module:
    if config.sparse(layer):
      return ErnieMoE(config, **kwargs)
    return llama.MLP(config, **kwargs)


class Ernie4_5MoeForCausalLM(glm4_moe.Glm4MoeForCausalLM):  # pylint: disable=invalid-name
  """ERNIE 4.5 MoE with an LM head: `moe.MoeForCausalLM` over these blocks (its Args)."""

  decoder_layer = DecoderLayer

  def lora_targets(self) -> dict[str, lora.Target]:
    """`moe.MoeForCausalLM`'s, q_proj's and k_proj's columns where the load's RoPE reorder
    put their rows (`glm.reordered_targets`)."""
    return glm.reordered_targets(self, super().lora_targets())


@glm.rope_reordered
def hf_sources(path: tuple[str, ...], config: Ernie4_5MoeConfig
               ) -> tuple[list[str], Callable[[list[jax.Array]], jax.Array]]:
  """`llama.Sources` of ERNIE 4.5 MoE's checkpoints: the correction bias moe_statics's
  [1, experts], the rest `deepseek.experts_sources`' (Qwen-MoE's expert names,
  shared_experts), q's and k's rows reordered (`glm.rope_reordered`)."""
  if path[2:4] == ("mlp", "correction_bias"):
    return ([f"model.layers.{path[1]}.mlp.moe_statics.e_score_correction_bias"],
            lambda parts: parts[0].reshape(-1))
  return deepseek.experts_sources(path, config)


from_pretrained = llama.loader(Ernie4_5MoeConfig, Ernie4_5MoeForCausalLM, hf_sources)

FAMILY = llama.family("ernie4_5_moe", MODEL_TYPES, from_pretrained)
