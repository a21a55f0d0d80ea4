"""GLM-4.5 / 4.6 / 4.7 in Flax NNX, decoding from a paged KV cache (`jax_paged.KVPool`).

Hugging Face's `Glm4MoeForCausalLM` (`model_type` "glm4_moe": Z.ai's GLM-4.5, GLM-4.5-Air,
GLM-4.6, GLM-4.7) is Llama's decoder (`models.llama`: GQA, pre-norm RMSNorm) with

* RoPE on the first half of each head's features only (partial_rotary_factor 0.5, in
  rotate-half layout), biases on q, k and v (attention_bias; none on o), and optionally
  per-head q / k RMSNorms (use_qk_norm, Qwen3's);
* a dense SwiGLU MLP on the first first_k_dense_replace layers and routed experts after,
  routed as DeepSeek-V3's (`models.deepseek.DeepseekMoE`, "noaux_tc": a sigmoid router in
  float32 whose per-expert correction bias only chooses, over n_group groups of which
  topk_group are kept; the chosen experts' scores renormalised with norm_topk_prob and
  scaled by routed_scaling_factor), plus ungated shared experts every token runs.

The experts run as `models.moe`'s grouped matmuls, and split under tensor parallelism as
its (`moe.MoeForCausalLM.tensor_parallel_splits`; the router and its bias replicated).
The checkpoints' multi-token-prediction layers (num_nextn_predict_layers, stored after
the last layer) are not loaded: decoding predicts one token per step.
"""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar

from flax import nnx

from jax_paged.kernels import validation
from models import deepseek
from models import llama
from models import moe

MODEL_TYPES = ("glm4_moe",)


@dataclasses.dataclass(frozen=True)
class Glm4MoeConfig(moe.MoeConfig):
  """GLM-4.5 hyperparameters under Hugging Face's field names (`moe.MoeConfig`'s; the
  defaults HF's Glm4MoeConfig's, which a config.json omitting a field gets there too;
  num_local_experts is HF's n_routed_experts, shared_expert_intermediate_size
  moe_intermediate_size * n_shared_experts).

  Attributes beyond MoeConfig's:
    first_k_dense_replace: layers below it have a dense MLP, the rest experts.
    n_group, topk_group: the router's expert groups and how many of them it keeps.
    routed_scaling_factor: the experts' weights' multiplier.
    use_qk_norm: whether q and k are RMS-normalised per head before RoPE.
  """

  vocab_size: int = 151552
  hidden_size: int = 4096
  intermediate_size: int = 10944
  num_hidden_layers: int = 46
  num_attention_heads: int = 96
  num_key_value_heads: int | None = 8
  head_dim: int | None = 128  # (GLM-4.5's; HF's default shape has no whole one: from_dict)
  max_position_embeddings: int = 131072
  rms_norm_eps: float = 1e-5
  rope_theta: float = 10000.0
  partial_rotary_factor: float = 0.5
  num_local_experts: int = 128
  num_experts_per_tok: int = 8
  moe_intermediate_size: int | None = 1408
  shared_expert_intermediate_size: int | None = 1408
  norm_topk_prob: bool = True
  first_k_dense_replace: int = 1
  n_group: int = 1
  topk_group: int = 1
  routed_scaling_factor: float = 1.0
  use_qk_norm: bool = False
  bos_token_id: int | None = None
  eos_token_id: int | tuple[int, ...] | None = None
  model_type: str = "glm4_moe"

  model_types: ClassVar[tuple[str, ...]] = MODEL_TYPES
  # The router `deepseek.DeepseekMoE` runs (DeepSeek-V3's).
  topk_method: ClassVar[str] = "noaux_tc"

  def __post_init__(self):
    super().__post_init__()
    if not (isinstance(self.first_k_dense_replace, int) and self.first_k_dense_replace >= 0):
      raise ValueError(f"first_k_dense_replace must be an int >= 0, got "
                       f"{self.first_k_dense_replace!r}")
    validation.check_positive_number("routed_scaling_factor", self.routed_scaling_factor)
    deepseek.check_groups(self)

  def sparse(self, layer: int) -> bool:
    """Whether layer `layer`'s MLP is the experts (from first_k_dense_replace on)."""
    return layer >= self.first_k_dense_replace

  @property
  def qk_norm(self) -> bool:
    return self.use_qk_norm

  @classmethod
  def from_dict(cls, config: dict[str, Any]) -> "Glm4MoeConfig":
    """From a Hugging Face config dict (`llama.LlamaConfig.from_dict`: transformers 4's
    top-level rope_theta / partial_rotary_factor or 5's rope_parameters), fields it omits
    taking HF's defaults; n_routed_experts read as num_local_experts, n_shared_experts
    as the shared experts' width (HF's default 1; 0: none); the multi-token-prediction
    fields ignored. Without head_dim, HF's attention's hidden_size // heads rounded down
    (for HF's default shape, 4096 over 96 heads, a width whose half RoPE refuses)."""
    config = dict(config)
    config["head_dim"] = llama.hf_head_dim(config, cls)
    config["num_local_experts"] = config.pop("n_routed_experts", cls.num_local_experts)
    shared = config.pop("n_shared_experts", 1)
    config["shared_expert_intermediate_size"] = (
        shared * config.get("moe_intermediate_size", cls.moe_intermediate_size)
        if shared else None)
    # (past MoeConfig.from_dict, which keeps these fields for the Qwens alone)
    return llama.LlamaConfig.from_dict.__func__(cls, config)


class DecoderLayer(moe.DecoderLayer):
  """Llama's block with a dense MLP or `deepseek.DeepseekMoE` for its MLP."""

  def _make_mlp(self, config: Glm4MoeConfig, layer: int, **kwargs) -> nnx.Module:
    if config.sparse(layer):
      return deepseek.DeepseekMoE(config, **kwargs)
    return llama.MLP(config, **kwargs)


class Glm4MoeForCausalLM(moe.MoeForCausalLM):
  """GLM-4.5 with an LM head: `moe.MoeForCausalLM` over these blocks (its Args)."""

  decoder_layer = DecoderLayer


# (the checkpoints' expert tensors are DeepSeek's, the rest Llama's)
from_pretrained = llama.loader(Glm4MoeConfig, Glm4MoeForCausalLM, deepseek.experts_sources)

FAMILY = llama.family("glm4_moe", MODEL_TYPES, from_pretrained)
