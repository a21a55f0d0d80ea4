"""Youtu-LLM in Flax NNX, decoding from a paged KV cache (`jax_paged.KVPool`).

Hugging Face's `YoutuForCausalLM` (`model_type` "youtu": Tencent's Youtu-LLM-2B) is
DeepSeek-V3's multi-head latent attention (`models.deepseek`: the latent cached in the
pool; RoPE pairs interleaved in the checkpoint unless rope_interleave is false, reordered
at load) over a dense Llama MLP on every layer (`deepseek.DenseDeepseekConfig`), its head
tied to the embeddings by default; HF's YoutuConfig defaults for omitted fields. Served
like DeepSeek's models: one device, no LoRA adapters.
"""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar

from models import deepseek
from models import llama

MODEL_TYPES = ("youtu",)

# HF's YoutuConfig defaults (Youtu-LLM-2B's shape, DeepSeek-V3's MLA widths).
_HF_DEFAULTS = dict(
    vocab_size=128256, hidden_size=2048, intermediate_size=6144, num_hidden_layers=32,
    num_attention_heads=16, max_position_embeddings=131072, rms_norm_eps=1e-6,
    bos_token_id=128000, eos_token_id=128001, tie_word_embeddings=True, kv_lora_rank=512,
    q_lora_rank=1536, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128,
    rope_interleave=True)


@dataclasses.dataclass(frozen=True)
class YoutuConfig(deepseek.DenseDeepseekConfig):
  """Youtu-LLM hyperparameters (`deepseek.DenseDeepseekConfig`'s)."""

  model_type: str = "youtu"

  model_types: ClassVar[tuple[str, ...]] = MODEL_TYPES

  @classmethod
  def from_dict(cls, config: dict[str, Any]) -> "YoutuConfig":
    """From a Hugging Face Youtu config dict (omitted fields: HF's defaults; an
    initializer_range of None, HF's 2 / sqrt(5 hidden_size))."""
    config = {**_HF_DEFAULTS, "model_type": cls.model_type, **config}
    if config.get("initializer_range") is None:
      config["initializer_range"] = 2.0 / (5.0 * config["hidden_size"]) ** 0.5
    return super().from_dict(config)


from_pretrained = llama.loader(YoutuConfig, deepseek.DeepseekForCausalLM,
                               deepseek.hf_sources)

FAMILY = llama.family("youtu", MODEL_TYPES, from_pretrained)
