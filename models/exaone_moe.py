"""K-EXAONE (EXAONE MoE) in Flax NNX, decoding from a paged KV cache (`jax_paged.KVPool`).

Hugging Face's `ExaoneMoeForCausalLM` (`model_type` "exaone_moe": LG AI Research's
K-EXAONE) is EXAONE 4.0's attention (`models.exaone4`: q and k RMS-normalised per head,
local windowed layers with RoPE beside global ones without it) in pre-norm blocks
(OLMoE's: input_layernorm, post_attention_layernorm) whose MLP is a dense SwiGLU or, on
the layers mlp_layer_types names sparse (HF's default: from first_k_dense_replace on),
experts routed as DeepSeek-V3's (`deepseek.DeepseekMoE`, "noaux_tc": a sigmoid router in
float32 with a correction bias that only chooses, n_group / topk_group,
routed_scaling_factor) beside ungated shared experts: GLM-4.5's blocks
(`models.glm4_moe`). The checkpoints' multi-token-prediction weights (mtp.*) are not
loaded.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, ClassVar

import jax

from models import deepseek
from models import exaone4
from models import glm4_moe
from models import llama

MODEL_TYPES = ("exaone_moe",)


@dataclasses.dataclass(frozen=True)
class ExaoneMoeConfig(glm4_moe.Glm4MoeConfig):
  """K-EXAONE hyperparameters (`glm4_moe.Glm4MoeConfig`'s fields, read by `from_dict` from
  HF's: num_experts as num_local_experts, num_shared_experts as the shared experts'
  width; the windows as `exaone4.hf_layer_types`). The defaults are HF's
  ExaoneMoeConfig's.

  Attributes beyond Glm4MoeConfig's:
    mlp_layer_types: "dense" or "sparse" per layer; None: first_k_dense_replace decides.
  """

  vocab_size: int = 102400
  hidden_size: int = 4096
  intermediate_size: int = 16384
  num_hidden_layers: int = 32
  num_attention_heads: int = 32
  num_key_value_heads: int | None = 32
  head_dim: int | None = None  # (hidden_size // num_attention_heads, as HF's)
  max_position_embeddings: int = 2048
  rms_norm_eps: float = 1e-5
  rope_theta: float = 10000.0
  partial_rotary_factor: float = 1.0
  sliding_window: int | None = 4096
  num_local_experts: int = 64
  num_experts_per_tok: int = 8
  moe_intermediate_size: int | None = 1024
  shared_expert_intermediate_size: int | None = 1024
  routed_scaling_factor: float = 2.5
  mlp_layer_types: tuple[str, ...] | None = None
  bos_token_id: int | None = 1
  eos_token_id: int | tuple[int, ...] | None = 53
  model_type: str = "exaone_moe"

  model_types: ClassVar[tuple[str, ...]] = MODEL_TYPES
  # EXAONE 4.0's attention: per-head q / k norms; NoPE on the global layers.
  layer_rope = exaone4.Exaone4Config.layer_rope

  # Whether layer i's MLP is the experts: mlp_layer_types', else from first_k_dense_replace.
  sparse = deepseek.DeepseekConfig.sparse

  def __post_init__(self):
    super().__post_init__()
    deepseek.check_mlp_layer_types(self)

  @property
  def qk_norm(self) -> bool:
    return True

  @classmethod
  def from_dict(cls, config: dict[str, Any]) -> "ExaoneMoeConfig":
    """From a Hugging Face config dict (`llama.LlamaConfig.from_dict`), fields it omits
    taking HF's defaults; the class docstring's renames; without mlp_layer_types, HF's
    (dense below first_k_dense_replace)."""
    config = dict(config)
    layer_types = exaone4.hf_layer_types(config, cls)
    config["head_dim"] = llama.hf_head_dim(config, cls)
    if "num_experts" in config:
      config["num_local_experts"] = config.pop("num_experts")
    shared = config.pop("num_shared_experts", 1)
    config["shared_expert_intermediate_size"] = (
        shared * config.get("moe_intermediate_size", cls.moe_intermediate_size)
        if shared else None)
    if config.get("mlp_layer_types") is None:  # HF's: dense below first_k_dense_replace
      first = config.get("first_k_dense_replace", cls.first_k_dense_replace)
      config["mlp_layer_types"] = [
          "dense" if i < first else "sparse"
          for i in range(config.get("num_hidden_layers", cls.num_hidden_layers))]
    for name in ("attention_bias", "mlp_bias", "use_qk_norm"):  # (HF's has none)
      config.pop(name, None)
    # (past Glm4MoeConfig's and Llama's from_dict, which read other names and keep
    # layer_types for the Qwens alone)
    return dataclasses.replace(llama.LlamaConfig.from_dict.__func__(cls, config),
                               layer_types=tuple(layer_types))


def hf_sources(path: tuple[str, ...], config: ExaoneMoeConfig
               ) -> tuple[list[str], Callable[[list[jax.Array]], jax.Array]]:
  """`llama.Sources` of K-EXAONE's checkpoints: the correction bias the MLP's
  e_score_correction_bias, the rest `deepseek.experts_sources`'."""
  if path[2:4] == ("mlp", "correction_bias"):
    return [f"model.layers.{path[1]}.mlp.e_score_correction_bias"], llama.whole
  return deepseek.experts_sources(path, config)


from_pretrained = llama.loader(ExaoneMoeConfig, glm4_moe.Glm4MoeForCausalLM, hf_sources)

FAMILY = llama.family("exaone_moe", MODEL_TYPES, from_pretrained)
