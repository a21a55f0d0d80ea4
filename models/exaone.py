"""EXAONE 3.x in Flax NNX, decoding from a paged KV cache (`jax_paged.KVPool`).

Hugging Face's EXAONE (`model_type` "exaone": LG AI Research's EXAONE-3.0-7.8B, EXAONE-3.5
2.4B / 7.8B / 32B, EXAONE Deep), which HF serves as `LlamaForCausalLM`, is Llama's model
(`models.llama`: its attention, blocks, loader, engine, adapters and tensor parallel
splits; llama3 RoPE scaling among its configs') under EXAONE's own names: the config's
num_layers, layer_norm_epsilon and activation_function (HF's attribute_map), and the
checkpoint's transformer.wte / transformer.h.N.attn.attention.{q,k,v,out}_proj /
ln_1 / ln_2 / mlp.c_fc_0 (gate), c_fc_1 (up), c_proj (down) / transformer.ln_f, as the Hub
and HF's `save_pretrained` both store them. LoRA adapters are PEFT's over HF's Llama
modules (q_proj ... down_proj under model.layers), as transformers serves EXAONE.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, ClassVar

import jax

from models import llama

MODEL_TYPES = ("exaone",)

# Llama's tensor names -> EXAONE's (HF's conversion mapping, reversed).
_NAMES = (("model.embed_tokens.", "transformer.wte."), ("model.layers.", "transformer.h."),
          ("model.norm.", "transformer.ln_f."), (".self_attn.o_proj", ".attn.attention.out_proj"),
          (".self_attn.", ".attn.attention."), (".input_layernorm.", ".ln_1."),
          (".post_attention_layernorm.", ".ln_2."), (".mlp.gate_proj", ".mlp.c_fc_0"),
          (".mlp.up_proj", ".mlp.c_fc_1"), (".mlp.down_proj", ".mlp.c_proj"))


def exaone_name(name: str) -> str:
  """A Llama tensor name ("model.layers.0.self_attn.q_proj.weight") as EXAONE's
  checkpoints name it ("transformer.h.0.attn.attention.q_proj.weight")."""
  for ours, theirs in _NAMES:
    name = name.replace(ours, theirs)
  return name


@dataclasses.dataclass(frozen=True)
class ExaoneConfig(llama.LlamaConfig):
  """EXAONE 3.x hyperparameters under Hugging Face's field names (`llama.LlamaConfig`'s;
  defaults HF's ExaoneConfig's, EXAONE-3.0-7.8B's shape, where a config.json omits them;
  attention_bias on q / k / v / o, mlp_bias on the MLP, as HF's Llama)."""

  vocab_size: int = 102400
  intermediate_size: int = 14336
  num_key_value_heads: int | None = 8
  max_position_embeddings: int = 4096
  rms_norm_eps: float = 1e-5
  rope_theta: float = 500000.0
  eos_token_id: int | tuple[int, ...] | None = 361
  model_type: str = "exaone"

  model_types: ClassVar[tuple[str, ...]] = MODEL_TYPES

  @property
  def out_bias(self) -> bool:
    return self.attention_bias

  @classmethod
  def from_dict(cls, config: dict[str, Any]) -> "ExaoneConfig":
    """`llama.LlamaConfig.from_dict`, EXAONE's field names read as HF's attribute_map
    reads them (num_layers, layer_norm_epsilon, activation_function)."""
    config = dict(config)
    for theirs, ours in (("num_layers", "num_hidden_layers"),
                         ("layer_norm_epsilon", "rms_norm_eps"),
                         ("activation_function", "hidden_act")):
      if theirs in config:
        config[ours] = config.pop(theirs)
    config.pop("sliding_window", None)  # (HF's EXAONE has none)
    return llama.LlamaConfig.from_dict.__func__(cls, config)


def hf_sources(path: tuple[str, ...], config: ExaoneConfig
               ) -> tuple[list[str], Callable[[list[jax.Array]], jax.Array]]:
  """`llama.hf_sources` under EXAONE's tensor names (`exaone_name`)."""
  names, assemble = llama.hf_sources(path, config)
  return [exaone_name(n) for n in names], assemble


from_pretrained = llama.loader(ExaoneConfig, llama.LlamaForCausalLM, hf_sources)

FAMILY = llama.family("exaone", MODEL_TYPES, from_pretrained)
