"""FlexOlmo in Flax NNX, decoding from a paged KV cache (`jax_paged.KVPool`).

Hugging Face's `FlexOlmoForCausalLM` (`model_type` "flex_olmo": AI2's FlexOlmo-7x7B-1T and
its RT variant) is OLMo 2's blocks (`models.olmo2`: no input norms, each branch's output
RMS-normalised before its residual add, q and k normalised across all heads, so one
device only) whose MLP is OLMoE's experts on every layer (`models.moe.SparseMoE`: a
softmax router, the num_experts_per_tok best, renormalised with norm_topk_prob), each
intermediate_size wide, stored under Qwen-MoE's names; HF's FlexOlmoConfig defaults.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, ClassVar

import jax
from flax import nnx

from models import llama
from models import moe
from models import olmo2

MODEL_TYPES = ("flex_olmo",)


@dataclasses.dataclass(frozen=True)
class FlexOlmoConfig(moe.MoeConfig):
  """FlexOlmo hyperparameters (`moe.MoeConfig`'s fields; `from_dict` reads HF's
  num_experts as num_local_experts; every layer sparse, MoeConfig's default). The
  defaults are HF's FlexOlmoConfig's."""

  vocab_size: int = 100352
  hidden_size: int = 4096
  intermediate_size: int = 11008
  num_hidden_layers: int = 32
  num_attention_heads: int = 32
  num_key_value_heads: int | None = None
  max_position_embeddings: int = 4096
  rms_norm_eps: float = 1e-6
  rope_theta: float = 500000.0
  num_local_experts: int = 7
  num_experts_per_tok: int = 5
  norm_topk_prob: bool = False
  bos_token_id: int | None = None
  eos_token_id: int | tuple[int, ...] | None = 100257
  model_type: str = "flex_olmo"

  model_types: ClassVar[tuple[str, ...]] = MODEL_TYPES
  # OLMo 2's attention: q / k norms across all heads, o's bias with attention_bias.
  qk_norm = olmo2.Olmo2Config.qk_norm
  qk_norm_all_heads = olmo2.Olmo2Config.qk_norm_all_heads
  out_bias = olmo2.Olmo2Config.out_bias

  @classmethod
  def from_dict(cls, config: dict[str, Any]) -> "FlexOlmoConfig":
    """From a Hugging Face config dict (`llama.LlamaConfig.from_dict`), fields it omits
    taking HF's defaults; num_experts read as num_local_experts."""
    config = dict(config)
    if "num_experts" in config:
      config["num_local_experts"] = config.pop("num_experts")
    for name in ("moe_intermediate_size", "shared_expert_intermediate_size",
                 "decoder_sparse_step", "mlp_only_layers", "sliding_window", "layer_types"):
      config.pop(name, None)
    # (past MoeConfig.from_dict, which reads the Qwens' names)
    return llama.LlamaConfig.from_dict.__func__(cls, config)


class DecoderLayer(olmo2.DecoderLayer):
  """OLMo 2's block with `moe.SparseMoE` for its MLP."""

  def _make_mlp(self, config: FlexOlmoConfig, layer: int, **kwargs) -> nnx.Module:
    del layer
    return moe.SparseMoE(config, **kwargs)

  def _mlp_add(self, x: jax.Array, adapters: jax.Array | None) -> jax.Array:
    """x + post_feedforward_layernorm(experts(x)), the norm and the add one kernel after
    the experts (which take no LoRA adapters)."""
    del adapters
    post = self.post_feedforward_layernorm
    x, _ = post.add(x, self.mlp(x)[None], None, None, parts_norm=post)
    return x


class FlexOlmoForCausalLM(moe.MoeForCausalLM):
  """FlexOlmo with an LM head: `moe.MoeForCausalLM` over these blocks (its Args)."""

  decoder_layer = DecoderLayer


def hf_sources(path: tuple[str, ...], config: FlexOlmoConfig
               ) -> tuple[list[str], Callable[[list[jax.Array]], jax.Array]]:
  """`llama.Sources` of FlexOlmo's checkpoints: `moe.hf_sources` under Qwen-MoE's expert
  names."""
  return moe.hf_sources(path, config, moe.QWEN_EXPERTS)


from_pretrained = llama.loader(FlexOlmoConfig, FlexOlmoForCausalLM, hf_sources)

FAMILY = llama.family("flex_olmo", MODEL_TYPES, from_pretrained)
