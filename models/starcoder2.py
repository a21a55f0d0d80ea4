"""StarCoder2 in Flax NNX, decoding from a paged KV cache (`jax_paged.KVPool`).

Hugging Face's `Starcoder2ForCausalLM` (`model_type` "starcoder2": BigCode's StarCoder2
3B, 7B, 15B) is Llama's model (`models.llama`: RoPE, GQA through `nn.PagedAttention`, its
loader, engine and adapters) with:

* LayerNorms (a weight and a bias, norm_epsilon) where Llama has RMS norms, the final one
  too; each residual add is fused with the next LayerNorm in one kernel after the
  projection (`nn.project_add_norm`), as GPT-2's are;
* a plain MLP, c_proj(gelu(c_fc(x))) (hidden_act, HF's tanh-approximated GELU in every
  checkpoint), not a gated one: c_fc's GEMM and the activation are one kernel at decode
  (`nn.dense`);
* biases on q, k, v, o, c_fc and c_proj (use_bias);
* a sliding window on every layer where the config gives one (StarCoder2-3B's 4096);
* HF's Starcoder2Config defaults (a tied head) for the fields a config.json omits.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, ClassVar

import jax

from jax_paged import nn as paged_nn
from models import gpt2
from models import llama

MODEL_TYPES = ("starcoder2",)


@dataclasses.dataclass(frozen=True)
class Starcoder2Config(llama.LlamaConfig):
  """StarCoder2 hyperparameters under Hugging Face's field names (`llama.LlamaConfig`'s,
  defaults Starcoder2Config's: StarCoder2 3B's shape; rms_norm_eps unused).

  Attributes beyond `llama.LlamaConfig`'s:
    norm_epsilon: the LayerNorms' epsilon.
  HF's use_bias sets attention_bias (q, k, v and o) and mlp_bias (c_fc and c_proj).
  """

  vocab_size: int = 49152
  hidden_size: int = 3072
  intermediate_size: int = 12288
  num_hidden_layers: int = 30
  num_attention_heads: int = 24
  num_key_value_heads: int | None = 2
  hidden_act: str = "gelu_pytorch_tanh"
  max_position_embeddings: int = 4096
  initializer_range: float = 0.018042
  norm_epsilon: float = 1e-5
  attention_bias: bool = True
  mlp_bias: bool = True
  tie_word_embeddings: bool = True
  bos_token_id: int | None = 50256
  eos_token_id: int | tuple[int, ...] | None = 50256
  model_type: str = "starcoder2"

  model_types: ClassVar[tuple[str, ...]] = MODEL_TYPES
  activations: ClassVar[dict[str, Callable[[jax.Array], jax.Array]]] = {
      name: gpt2.ACTIVATIONS[name] for name in ("gelu_pytorch_tanh", "gelu_new", "gelu")}
  plain_mlp: ClassVar[bool] = True

  def make_norm(self, param_dtype) -> paged_nn.LayerNorm:
    """A LayerNorm (a weight and a bias) of norm_epsilon."""
    return paged_nn.LayerNorm(self.hidden_size, epsilon=self.norm_epsilon,
                              param_dtype=param_dtype)

  @property
  def out_bias(self) -> bool:
    return self.attention_bias

  @classmethod
  def from_dict(cls, config: dict[str, Any]) -> "Starcoder2Config":
    """`llama.LlamaConfig.from_dict` (omitted fields: the class's defaults, HF's); use_bias
    read as attention_bias and mlp_bias."""
    config = dict(config)
    bias = config.pop("use_bias", True)
    config.update(attention_bias=bias, mlp_bias=bias)
    return llama.LlamaConfig.from_dict.__func__(cls, config)


class Starcoder2ForCausalLM(llama.LlamaForCausalLM):
  """StarCoder2 with an LM head, attending through a `KVPool`: `LlamaForCausalLM` over a
  `Starcoder2Config` (its LayerNorms and plain MLP; its Args)."""


from_pretrained = llama.loader(Starcoder2Config, Starcoder2ForCausalLM)

FAMILY = llama.family("starcoder2", MODEL_TYPES, from_pretrained)
