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
import functools
from typing import Any, Callable, ClassVar

import jax
import jax.numpy as jnp

from jax_paged import nn as paged_nn
from jax_paged.paged_model import ModelFamily
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


def from_pretrained(path, *, dtype=jnp.float32, param_dtype=None,
                    decode_impl: paged_nn.DecodeImpl = "auto",
                    max_model_len: int | None = None) -> Starcoder2ForCausalLM:
  """Loads a Hugging Face StarCoder2 checkpoint directory (`models.llama`'s
  `load_pretrained`: its files, errors and eos ids).

  Args:
    path: as `models.llama.load_pretrained`'s.
    dtype, param_dtype, decode_impl: as for `models.llama.LlamaForCausalLM`.
    max_model_len: as `models.llama.from_pretrained`'s.
  """
  return llama.load_pretrained(path, Starcoder2Config.from_dict, functools.partial(
      Starcoder2ForCausalLM, dtype=dtype, param_dtype=param_dtype, decode_impl=decode_impl),
      max_model_len=max_model_len)


FAMILY = ModelFamily(
    name="starcoder2",
    model_types=MODEL_TYPES,
    from_pretrained=lambda path, dtype, **options: from_pretrained(path, dtype=dtype, **options),
    presets={},
    max_model_len=True,
)
