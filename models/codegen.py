"""CodeGen in Flax NNX, decoding from a paged KV cache (`jax_paged.KVPool`).

Hugging Face's `CodeGenForCausalLM` (`model_type` "codegen": Salesforce's CodeGen 350M-16B
mono / multi / nl, CodeGen2) is GPT-J's model (`models.gptj`: one LayerNorm per block
feeding attention and MLP in parallel, RoPE over interleaved pairs of the first
rotary_dim features, biases on fc_in, fc_out and the LM head) whose q, k and v come from
one qkv_proj in its model-parallel layout: 4 blocks of rows, each [q, v, k] of a quarter
of the heads (`qkv_rows`), reordered at load into our q, k, v (q's and k's rows into
rotate-half order, as GPT-J's), and a LoRA adapter's qkv_proj columns with them. Config
names and defaults HF's CodeGenConfig's (GPT-J's names, CodeGen-6B's shape).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, ClassVar

import jax
import numpy as np

from jax_paged import lora
from models import gptj
from models import llama

MODEL_TYPES = ("codegen",)
_MP_NUM = 4  # (HF's CodeGenAttention.mp_num: fixed)


@dataclasses.dataclass(frozen=True)
class CodeGenConfig(gptj.GPTJConfig):
  """CodeGen hyperparameters (`gptj.GPTJConfig`'s; the defaults HF's CodeGenConfig's)."""

  model_type: str = "codegen"

  model_types: ClassVar[tuple[str, ...]] = MODEL_TYPES

  def __post_init__(self):
    super().__post_init__()
    if self.hidden_size % (_MP_NUM * self.head_dim):
      raise ValueError(f"num_attention_heads ({self.num_attention_heads}) must be a "
                       f"multiple of {_MP_NUM} (CodeGen's qkv_proj holds {_MP_NUM} blocks "
                       "of whole heads)")

  @classmethod
  def from_dict(cls, config: dict[str, Any]) -> "CodeGenConfig":
    """`gptj.GPTJConfig.from_dict` (n_ctx, the context, is n_positions)."""
    config = dict(config)
    config.pop("n_ctx", None)
    return super().from_dict(config)


def qkv_rows(config: CodeGenConfig) -> np.ndarray:
  """qkv_proj's rows in our qkv's order: q's, k's (each in rotate-half order, GPT-J's) and
  v's, picked from its 4 blocks of [q, v, k] rows."""
  d = config.hidden_size
  local = d // _MP_NUM
  block = np.arange(_MP_NUM)[:, None] * 3 * local + np.arange(local)  # [blocks, local]
  q, v, k = (block + i * local for i in range(3))
  rope = llama.deinterleave(d, config.rotary_dim, config.head_dim, first=True)
  return np.concatenate([q.reshape(-1)[rope], k.reshape(-1)[rope], v.reshape(-1)])


class CodeGenForCausalLM(gptj.GPTJForCausalLM):
  """CodeGen with a biased LM head: GPT-J's model (its Args)."""

  def lora_targets(self) -> dict[str, lora.Target]:
    """GPT-J's targets, q / k / v as CodeGen's one qkv_proj (its columns where the load
    put its rows)."""
    columns = tuple(np.argsort(qkv_rows(self.config)).tolist())
    targets = super().lora_targets()
    for i, layer in enumerate(self.layers):
      prefix = f"transformer.h.{i}.attn."
      for name in ("q_proj", "k_proj", "v_proj"):
        del targets[prefix + name]
      targets[prefix + "qkv_proj"] = lora.Target(layer.self_attn.qkv, columns=columns)
    return targets


def hf_sources(path: tuple[str, ...], config: CodeGenConfig
               ) -> tuple[list[str], Callable[[list[jax.Array]], jax.Array]]:
  """`gptj.hf_sources`, q / k / v from qkv_proj (`qkv_rows`)."""
  if path[2:] == ("self_attn", "qkv", "kernel"):  # (no bias)
    rows = qkv_rows(config)
    return ([f"transformer.h.{path[1]}.attn.qkv_proj.weight"],
            lambda parts: llama.linear_rows([parts[0][rows]]))
  return gptj.hf_sources(path, config)


from_pretrained = llama.loader(CodeGenConfig, CodeGenForCausalLM, hf_sources)

FAMILY = llama.family("codegen", MODEL_TYPES, from_pretrained)
