"""MiniCPM3 in Flax NNX, decoding from a paged KV cache (`jax_paged.KVPool`).

Hugging Face's `MiniCPM3ForCausalLM` (`model_type` "minicpm3": OpenBMB's MiniCPM3-4B) is
DeepSeek-V2's multi-head latent attention (`models.deepseek`: the latent cached in the
pool, its decode and prefill kernels) over dense Llama MLPs on every layer, with
* RoPE over rotate-half pairs as the checkpoint stores them (no interleaved rows to
  reorder: rope_interleave False);
* MiniCPM's three multipliers as Granite's (`llama.LlamaConfig`): the embeddings times
  scale_emb, each residual branch times scale_depth / sqrt(num_hidden_layers), the logits
  divided by hidden_size / dim_model_base;
* HF's MiniCPM3Config defaults (MiniCPM3-4B's shape) for omitted fields.
Served like DeepSeek's models: one device, no LoRA adapters.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, ClassVar

from models import deepseek
from models import llama

MODEL_TYPES = ("minicpm3",)

# HF's MiniCPM3Config defaults (MiniCPM3-4B's shape).
_HF_DEFAULTS = dict(
    vocab_size=73448, hidden_size=2560, intermediate_size=6400, num_hidden_layers=62,
    num_attention_heads=40, max_position_embeddings=32768, initializer_range=0.1,
    rms_norm_eps=1e-5, bos_token_id=1, eos_token_id=2, tie_word_embeddings=True,
    kv_lora_rank=256, q_lora_rank=768, qk_nope_head_dim=64, qk_rope_head_dim=32,
    scale_emb=12, scale_depth=1.4, dim_model_base=256)


@dataclasses.dataclass(frozen=True)
class MiniCPM3Config(deepseek.DenseDeepseekConfig):
  """MiniCPM3 hyperparameters (`deepseek.DenseDeepseekConfig`'s: every layer dense; RoPE
  not interleaved; `from_dict` reads MiniCPM's scale_emb / scale_depth / dim_model_base
  into Llama's multipliers)."""

  model_type: str = "minicpm3"
  rope_interleave: bool = False

  model_types: ClassVar[tuple[str, ...]] = MODEL_TYPES

  @classmethod
  def from_dict(cls, config: dict[str, Any]) -> "MiniCPM3Config":
    """From a Hugging Face MiniCPM3 config dict (omitted fields: HF's defaults); v_head_dim
    None as hidden_size / num_attention_heads, scale_depth None as sqrt(num_hidden_layers)
    and dim_model_base None as hidden_size, as HF reads them."""
    config = {**_HF_DEFAULTS, **config}
    config.setdefault("model_type", cls.model_type)
    layers, hidden = config["num_hidden_layers"], config["hidden_size"]
    if config.get("v_head_dim") is None:
      config["v_head_dim"] = hidden // config["num_attention_heads"]
    scale_emb = config.pop("scale_emb")
    scale_depth = config.pop("scale_depth")
    scale_depth = math.sqrt(layers) if scale_depth is None else scale_depth
    base = config.pop("dim_model_base")
    base = hidden if base is None else base
    parsed = super().from_dict(config)
    return dataclasses.replace(parsed, embedding_multiplier=float(scale_emb),
                               residual_multiplier=scale_depth / math.sqrt(layers),
                               logits_scaling=hidden / base)


from_pretrained = llama.loader(MiniCPM3Config, deepseek.DeepseekForCausalLM,
                               deepseek.hf_sources)

FAMILY = llama.family("minicpm3", MODEL_TYPES, from_pretrained)
