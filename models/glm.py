"""GLM-4 (dense) in Flax NNX, decoding from a paged KV cache (`jax_paged.KVPool`).

Hugging Face's `GlmForCausalLM` (`model_type` "glm": THUDM's glm-4-9b, glm-4-9b-chat in
transformers' format) and `Glm4ForCausalLM` ("glm4": GLM-4-9B-0414, GLM-4-32B-0414,
GLM-Z1) are Llama's decoder (`models.llama`: GQA, RMSNorm, SwiGLU; its loader, engine,
tensor parallel splits) with:

* RoPE on the first half of each head's features (partial_rotary_factor 0.5) over
  interleaved pairs (x0, x1), (x2, x3), ...: q_proj's and k_proj's rows and biases are
  reordered per head at load into rotate-half order (`llama.deinterleave`), which leaves
  q . k unchanged (their LoRA columns follow: `GlmForCausalLM.lora_targets`);
* biases on q, k and v (attention_bias), none on o; gate and up fused in the checkpoint
  (gate_up_proj: gate's rows, then up's), as ours;
* GLM-4-0414's blocks ("glm4") also normalise each branch's output before its residual
  add (post_self_attn_layernorm, post_mlp_layernorm: HF's "sandwich" norms).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, ClassVar

import jax
import numpy as np

from jax_paged import lora
from jax_paged import nn as paged_nn
from jax_paged import pool as pool_lib
from models import llama

MODEL_TYPES = ("glm", "glm4")


@dataclasses.dataclass(frozen=True)
class GlmConfig(llama.LlamaConfig):
  """GLM-4 hyperparameters under Hugging Face's field names (`llama.LlamaConfig`'s and its
  `from_dict`; the defaults HF's GlmConfig / Glm4Config's, glm-4-9b's shape, which a
  config.json omitting a field gets there too)."""

  vocab_size: int = 151552
  hidden_size: int = 4096
  intermediate_size: int = 13696
  num_hidden_layers: int = 40
  num_attention_heads: int = 32
  num_key_value_heads: int | None = 2
  head_dim: int | None = 128
  max_position_embeddings: int = 131072
  rms_norm_eps: float = 1.5625e-07
  rope_theta: float = 10000.0
  partial_rotary_factor: float = 0.5
  attention_bias: bool = True
  bos_token_id: int | None = None
  eos_token_id: int | tuple[int, ...] | None = (151329, 151336, 151338)
  model_type: str = "glm"

  model_types: ClassVar[tuple[str, ...]] = MODEL_TYPES
  # Whether the checkpoint holds gate and up as one gate_up_proj (GLM's; ERNIE's apart).
  fused_gate_up: ClassVar[bool] = True

  @property
  def post_norms(self) -> bool:
    """Whether each branch's output is normalised before its residual add (GLM-4-0414's)."""
    return self.model_type == "glm4"

  @classmethod
  def from_dict(cls, config: dict[str, Any]) -> "GlmConfig":
    """`llama.LlamaConfig.from_dict`; an eos_token_id of null is GLM's eos ids (HF's
    GlmConfig / Glm4Config replace it so)."""
    config = dict(config)
    if config.get("eos_token_id") is None:
      config.pop("eos_token_id", None)
    return super().from_dict(config)
class DecoderLayer(llama.DecoderLayer):
  """Llama's block; with the config's `post_norms`, each branch's output RMS-normalised
  before its residual add (one kernel with the projection, the add and the next norm:
  `project_add_norm`'s `parts_norm`)."""

  def __init__(self, config: GlmConfig, layer: int, **kwargs):
    super().__init__(config, layer, **kwargs)
    make = lambda: config.make_norm(kwargs["param_dtype"])
    self.post_self_attn_layernorm = make() if config.post_norms else None
    self.post_mlp_layernorm = make() if config.post_norms else None

  def __call__(self, x: jax.Array, h: jax.Array, kv: pool_lib.KVPool, layer: int,
               attend: llama.Attend, next_norm: paged_nn.RMSNorm,
               adapters: jax.Array | None = None
               ) -> tuple[jax.Array, jax.Array, pool_lib.KVPool]:
    """As `models.llama.DecoderLayer`'s."""
    a, kv = attend(self.self_attn, h, kv, layer)
    x, h = paged_nn.project_add_norm(self.self_attn.out, a, x, self.post_attention_layernorm,
                                     adapters=adapters, parts_norm=self.post_self_attn_layernorm)
    x, h = paged_nn.project_add_norm(self.mlp.down, self.mlp.hidden(h, adapters), x,
                                     next_norm, adapters=adapters,
                                     parts_norm=self.post_mlp_layernorm)
    return x, h, kv


class GlmForCausalLM(llama.LlamaForCausalLM):
  """GLM-4 with an LM head: `llama.LlamaForCausalLM` over these blocks (its Args)."""

  decoder_layer = DecoderLayer

  def lora_targets(self) -> dict[str, lora.Target]:
    """Hugging Face module name -> where its LoRA update lands: Llama's, but q_proj's and
    k_proj's columns where the load's RoPE reorder put their rows (`reordered_targets`),
    and the fused gate_up_proj (`fused_gate_up`) whole."""
    targets = reordered_targets(self, super().lora_targets())
    if self.config.fused_gate_up:
      for i, layer in enumerate(self.layers):
        prefix = f"model.layers.{i}.mlp."
        del targets[f"{prefix}gate_proj"], targets[f"{prefix}up_proj"]
        targets[f"{prefix}gate_up_proj"] = lora.Target(layer.mlp.gate_up)
    return targets


def reordered_targets(model: llama.LlamaForCausalLM, targets: dict[str, lora.Target]
                      ) -> dict[str, lora.Target]:
  """`targets` (Llama's `lora_targets` of `model`) with q_proj's and k_proj's columns
  where `rope_reordered`'s load put their rows."""
  c = model.config
  q, kv = c.num_attention_heads * c.head_dim, c.num_key_value_heads * c.head_dim
  targets = dict(targets)
  for i, layer in enumerate(model.layers):
    for name, offset, width in (("q_proj", 0, q), ("k_proj", q, kv)):
      columns = offset + np.argsort(_rotated_rows(c, width))
      targets[f"model.layers.{i}.self_attn.{name}"] = lora.Target(
          layer.self_attn.qkv, columns=tuple(columns.tolist()))
  return targets


def _rotated_rows(config: GlmConfig, width: int) -> np.ndarray:
  """The order of a q or k projection's `width` rows (whole heads) in rotate-half
  layout: each head's first rotary_dim rows deinterleaved."""
  return llama.deinterleave(width, config.rotary_dim, config.head_dim, first=True)


def rope_reordered(sources: llama.Sources) -> llama.Sources:
  """`sources` with q_proj's and k_proj's rows (weights and biases) reordered from
  interleaved-pair RoPE into rotate-half order (`_rotated_rows`; the config's rotary_dim
  features of each head)."""

  def reordered(path: tuple[str, ...], config: llama.LlamaConfig
                ) -> tuple[list[str], Callable[[list[jax.Array]], jax.Array]]:
    names, assemble = sources(path, config)
    if path[2:-1] != ("self_attn", "qkv"):
      return names, assemble
    q = config.num_attention_heads * config.head_dim
    kv = config.num_key_value_heads * config.head_dim
    q_rows, k_rows = _rotated_rows(config, q), _rotated_rows(config, kv)
    return names, lambda parts: assemble([parts[0][q_rows], parts[1][k_rows], parts[2]])

  return reordered


@rope_reordered
def hf_sources(path: tuple[str, ...], config: GlmConfig
               ) -> tuple[list[str], Callable[[list[jax.Array]], jax.Array]]:
  """`llama.Sources` of GLM-4's checkpoints: q / k / v with q's and k's rows reordered
  (`rope_reordered`), gate_up_proj as it is (`fused_gate_up`), the rest as
  `llama.hf_sources` (the post norms under their HF names)."""
  if config.fused_gate_up and path[2:-1] == ("mlp", "gate_up"):  # (no bias)
    return [f"model.layers.{path[1]}.mlp.gate_up_proj.weight"], llama.linear_rows
  return llama.hf_sources(path, config)


from_pretrained = llama.loader(GlmConfig, GlmForCausalLM, hf_sources)

FAMILY = llama.family("glm", MODEL_TYPES, from_pretrained)
