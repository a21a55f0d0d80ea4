"""Hunyuan MoE in Flax NNX, decoding from a paged KV cache (`jax_paged.KVPool`).

Hugging Face's `HunYuanMoEV1ForCausalLM` (`model_type` "hunyuan_v1_moe": Tencent's
Hunyuan-A13B, -Pretrain and -Instruct) is Hunyuan's attention (`models.hunyuan`: per-head
q / k norms after RoPE, the NTK-alpha RoPE, biases with attention_bias) over blocks whose
MLP is, on every layer, num_experts routed SwiGLU experts of intermediate_size (a float32
softmax router; the moe_topk best of each token, renormalised) beside one ungated shared
MLP of the same width (`deepseek.DeepseekMoE`'s "greedy" router and shared experts; split
by tensor parallelism as the other MoEs). num_experts and moe_topk may be per-layer lists
in HF's config; one value for every layer is what this model takes.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, ClassVar

import jax
from flax import nnx

from models import deepseek
from models import hunyuan
from models import llama
from models import moe

MODEL_TYPES = ("hunyuan_v1_moe",)


@dataclasses.dataclass(frozen=True)
class HunyuanMoeConfig(moe.MoeConfig):
  """Hunyuan MoE hyperparameters (`moe.MoeConfig`'s fields; `from_dict` reads HF's
  num_experts as num_local_experts, moe_topk as num_experts_per_tok, and gives the experts
  and the shared MLP intermediate_size; every layer sparse, MoeConfig's default). The
  defaults are HF's HunYuanMoEV1Config's."""

  vocab_size: int = 290943
  hidden_size: int = 4096
  intermediate_size: int = 11008
  num_hidden_layers: int = 32
  num_attention_heads: int = 32
  num_key_value_heads: int | None = None
  max_position_embeddings: int = 2048
  rms_norm_eps: float = 1e-5
  rope_theta: float = 10000.0
  num_local_experts: int = 1
  num_experts_per_tok: int = 1
  norm_topk_prob: bool = True
  bos_token_id: int | None = 1
  eos_token_id: int | tuple[int, ...] | None = 2
  model_type: str = "hunyuan_v1_moe"

  model_types: ClassVar[tuple[str, ...]] = MODEL_TYPES
  # `deepseek.DeepseekMoE`'s router: a softmax's top k, renormalised (norm_topk_prob).
  topk_method: ClassVar[str] = "greedy"
  n_group: ClassVar[None] = None
  topk_group: ClassVar[None] = None
  routed_scaling_factor: ClassVar[float] = 1.0

  # Hunyuan's attention: per-head q / k norms after RoPE, o's bias with attention_bias.
  qk_norm = hunyuan.HunyuanConfig.qk_norm
  qk_norm_after_rope = hunyuan.HunyuanConfig.qk_norm_after_rope
  out_bias = hunyuan.HunyuanConfig.out_bias

  @classmethod
  def from_dict(cls, config: dict[str, Any]) -> "HunyuanMoeConfig":
    """From a Hugging Face config dict (`hunyuan.ntk_alpha_rope`'s RoPE, then
    `llama.LlamaConfig.from_dict`), HF's expert fields renamed (the class docstring); a
    per-layer list of num_experts or moe_topk must hold one value."""
    config = hunyuan.ntk_alpha_rope(config, cls)
    for theirs, ours in (("num_experts", "num_local_experts"),
                         ("moe_topk", "num_experts_per_tok")):
      value = config.pop(theirs, getattr(cls, ours))
      if isinstance(value, (list, tuple)):
        if len(set(value)) != 1:
          raise ValueError(f"{theirs} must be one value for every layer, got {value!r}")
        value = value[0]
      config[ours] = value
    width = config.get("intermediate_size", cls.intermediate_size)
    config["moe_intermediate_size"] = config["shared_expert_intermediate_size"] = width
    for name in ("norm_topk_prob", "decoder_sparse_step", "mlp_only_layers"):
      config.pop(name, None)
    # (past MoeConfig.from_dict, which keeps the expert fields for the Qwens alone)
    return llama.LlamaConfig.from_dict.__func__(cls, config)


class DecoderLayer(moe.DecoderLayer):
  """Llama's block with `deepseek.DeepseekMoE` for its MLP."""

  def _make_mlp(self, config: HunyuanMoeConfig, layer: int, **kwargs) -> nnx.Module:
    del layer
    return deepseek.DeepseekMoE(config, **kwargs)


class HunyuanMoeForCausalLM(moe.MoeForCausalLM):
  """Hunyuan MoE with an LM head: `moe.MoeForCausalLM` over these blocks (its Args)."""

  decoder_layer = DecoderLayer


# HF's router (gate.wg), experts (Qwen-MoE's names) and shared MLP (shared_mlp).
_EXPERTS = ("mlp", "gate.wg", ("gate_proj", "up_proj", "down_proj"))


@hunyuan.norm_names
def hf_sources(path: tuple[str, ...], config: HunyuanMoeConfig
               ) -> tuple[list[str], Callable[[list[jax.Array]], jax.Array]]:
  """`llama.Sources` of Hunyuan MoE's checkpoints: `moe.hf_sources` under HF's names for
  the router, experts and shared MLP, the q / k norms as `hunyuan`'s."""
  return moe.hf_sources(path, config, _EXPERTS, shared_name="shared_mlp")


from_pretrained = llama.loader(HunyuanMoeConfig, HunyuanMoeForCausalLM, hf_sources)

FAMILY = llama.family("hunyuan_v1_moe", MODEL_TYPES, from_pretrained)
