"""NanoChat in Flax NNX, decoding from a paged KV cache (`jax_paged.KVPool`).

Hugging Face's `NanoChatForCausalLM` (`model_type` "nanochat": Karpathy's nanochat-d20,
-d32 and the models trained with it) is Llama's model (`models.llama`) with
* every RMS norm weightless (x / rms(x)): the blocks' two, each head of q and k after RoPE
  (Llama 4's), the final norm, and one more on the token embeddings before the first
  block; here RMSNorms of weight one that the loader sets (the fused add-and-norm kernels
  take them as they are);
* RoPE turning each pair by minus its angle (HF's rotate_half (x2, -x1):
  `nn.RotaryEmbedding(reverse=True)`);
* Nemotron's plain relu^2 MLP (`models.nemotron`) under the names fc1 / fc2;
* the logits soft-capped to C tanh(logits / C) (final_logit_softcapping, Gemma 2's);
* HF's NanoChatConfig defaults (nanochat-d20's shape) for omitted fields.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, ClassVar, Mapping

import jax
import jax.numpy as jnp

from jax_paged import nn as paged_nn
from jax_paged.kernels import validation
from models import llama
from models import nemotron

MODEL_TYPES = ("nanochat",)


@dataclasses.dataclass(frozen=True)
class NanoChatConfig(llama.LlamaConfig):
  """NanoChat hyperparameters under Hugging Face's field names (`llama.LlamaConfig`'s and
  final_logit_softcapping, C > 0 or None; defaults HF's NanoChatConfig's).
  attention_bias puts biases on q, k, v and o."""

  vocab_size: int = 50304
  hidden_size: int = 768
  intermediate_size: int = 8192
  num_hidden_layers: int = 12
  num_attention_heads: int = 6
  hidden_act: str = "relu2"
  bos_token_id: int | None = 0
  eos_token_id: int | tuple[int, ...] | None = 1
  final_logit_softcapping: float | None = 15.0
  model_type: str = "nanochat"

  model_types: ClassVar[tuple[str, ...]] = MODEL_TYPES
  activations: ClassVar[Mapping[str, Callable[[jax.Array], jax.Array]]] = {
      "relu2": nemotron.relu2}
  plain_mlp: ClassVar[bool] = True

  def __post_init__(self):
    super().__post_init__()
    validation.check_positive_number("final_logit_softcapping",
                                     self.final_logit_softcapping, optional=True)

  @property
  def rope(self) -> paged_nn.RotaryEmbedding:
    """Llama's rotary embedding, each pair turning by minus its angle."""
    return dataclasses.replace(super().rope, reverse=True)

  @property
  def qk_norm(self) -> bool:
    return True

  @property
  def qk_norm_after_rope(self) -> bool:
    return True

  @property
  def out_bias(self) -> bool:
    return self.attention_bias

  @classmethod
  def from_dict(cls, config: dict[str, Any]) -> "NanoChatConfig":
    """`llama.LlamaConfig.from_dict` (omitted fields: the class's defaults, HF's)."""
    config = dict(config)
    config.pop("sliding_window", None)  # (HF's NanoChat has none)
    return llama.LlamaConfig.from_dict.__func__(cls, config)


class NanoChatForCausalLM(nemotron.NemotronForCausalLM):
  """NanoChat with an LM head: `llama.LlamaForCausalLM` (its Args) with the token
  embeddings normalised before the first block and the logits soft-capped, LoRA targets
  under HF's names (q / k / v / o_proj, fc1, fc2: `nemotron.NemotronForCausalLM`'s
  renames)."""

  mlp_names: ClassVar[Mapping[str, str]] = {"c_fc": "fc1", "c_proj": "fc2"}

  def _embed(self, tokens: jax.Array) -> jax.Array:
    """The token embeddings, RMS-normalised (by the final norm's module, as HF's: weight
    one)."""
    x = self.embed_tokens(tokens)
    return self.norm(x).astype(x.dtype)

  def logits(self, h: jax.Array) -> jax.Array:
    """float32 logits, capped to C * tanh(logits / C) with final_logit_softcapping C (the
    greedy argmax needs no cap: tanh is increasing)."""
    logits = super().logits(h)
    cap = self.config.final_logit_softcapping
    return logits if cap is None else cap * jnp.tanh(logits / cap)



def hf_sources(path: tuple[str, ...], config: NanoChatConfig
               ) -> tuple[list[str], Callable[[list[jax.Array]], jax.Array]]:
  """`nemotron.plain_mlp_sources` with the plain MLP under fc1 / fc2 and every norm's
  weight one (HF's norms have none: no tensor read)."""
  if path[-1] == "weight":  # an RMSNorm's: [head_dim] for q / k, else [hidden_size]
    width = config.head_dim if path[-2] in ("q_norm", "k_norm") else config.hidden_size
    return [], lambda _: jnp.ones((width,), jnp.float32)
  return nemotron.plain_mlp_sources(path, config, NanoChatForCausalLM.mlp_names)


from_pretrained = llama.loader(NanoChatConfig, NanoChatForCausalLM, hf_sources)

FAMILY = llama.family("nanochat", MODEL_TYPES, from_pretrained)
