"""Gemma 2 and VaultGemma in Flax NNX, decoding from a paged KV cache (`jax_paged.KVPool`).

Hugging Face's `Gemma2ForCausalLM` (`model_type` "gemma2": Gemma 2 2B, 9B, 27B) is Gemma
3's text decoder (`models.gemma3`: four unit-offset RMS norms per block, scores scaled by
query_pre_attn_scalar^-1/2, GeGLU, scaled embeddings, sliding and full layers) with:

* attention logits soft-capped to C * tanh(logits / C), C = attn_logit_softcapping, in
  the decode and prefill kernels (`nn.PagedAttention(logits_soft_cap=)`), and the final
  logits to final_logit_softcapping's;
* no q / k norms;
* one RoPE (rope_theta, and any scaling) for every layer, sliding and full alternating
  (layer 0 sliding) unless layer_types says otherwise.

`VaultGemmaForCausalLM` ("vaultgemma": Google's VaultGemma 1B, trained with differential
privacy) is Gemma 2's model without the branch outputs' norms (post_attention_layernorm,
post_feedforward_layernorm): each block normalises only its inputs.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, ClassVar, Mapping

import jax.numpy as jnp

from jax_paged import nn as paged_nn
from jax_paged.paged_model import ModelFamily
from models import gemma3
from models import llama

MODEL_TYPES = ("gemma2", "vaultgemma")


@dataclasses.dataclass(frozen=True)
class Gemma2Config(gemma3.Gemma3Config):
  """Gemma 2 hyperparameters under Hugging Face's field names and defaults (Gemma2Config's:
  Gemma 2 2B). As `gemma3.Gemma3Config`, but every layer's RoPE is rope_theta's (with
  rope_scaling), so rope_local_base_freq is not read; every second layer is full
  (sliding_window_pattern 2)."""

  vocab_size: int = 256000
  max_position_embeddings: int = 8192
  rope_theta: float = 10_000.0
  sliding_window_pattern: int = 2
  attn_logit_softcapping: float | None = 50.0
  final_logit_softcapping: float | None = 30.0
  model_type: str = "gemma2"

  model_types: ClassVar[tuple[str, ...]] = MODEL_TYPES
  qk_norm: ClassVar[bool] = False

  @property
  def post_norms(self) -> bool:
    return self.model_type != "vaultgemma"

  def rope(self, layer: int) -> paged_nn.RotaryEmbedding:
    """Every layer's rotary embedding (sliding or not)."""
    del layer
    return llama.rotary(self.head_dim, self.rope_theta, self.rope_scaling,
                        self.max_position_embeddings)

  @classmethod
  def from_dict(cls, config: dict[str, Any]) -> "Gemma2Config":
    """From a Hugging Face config dict (transformers 4's rope_theta / rope_scaling or 5's
    rope_parameters); fields this model does not use are ignored, settings it does not
    support refused by name."""
    config = cls._hf_common(config)
    rope = config.pop("rope_parameters", None)
    if rope is not None:  # transformers 5
      if not isinstance(rope, Mapping):
        raise ValueError(f"rope_parameters must be a dict, got {rope!r}")
      config["rope_theta"] = rope.get("rope_theta", 10_000.0)
      config["rope_scaling"] = rope
    return cls._from_hf_fields(config)


class Gemma2ForCausalLM(gemma3.Gemma3ForCausalLM):
  """Gemma 2 with an LM head: Gemma 3's model over a `Gemma2Config` (its blocks without q
  / k norms, soft-capped attention and final logits)."""


def from_pretrained(path, *, dtype=jnp.float32, param_dtype=None,
                    decode_impl: paged_nn.DecodeImpl = "auto") -> Gemma2ForCausalLM:
  """Loads a Hugging Face Gemma 2 checkpoint directory (`models.llama`'s
  `load_pretrained`: its files, errors and eos ids).

  Args:
    path: as `models.llama.load_pretrained`'s.
    dtype, param_dtype, decode_impl: as for `models.llama.LlamaForCausalLM`.
  """
  return llama.load_pretrained(path, Gemma2Config.from_dict, functools.partial(
      Gemma2ForCausalLM, dtype=dtype, param_dtype=param_dtype, decode_impl=decode_impl))


FAMILY = ModelFamily(
    name="gemma2",
    model_types=MODEL_TYPES,
    from_pretrained=lambda path, dtype: from_pretrained(path, dtype=dtype),
    presets={},
)
