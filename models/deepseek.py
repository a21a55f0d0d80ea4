"""DeepSeek-V2 / V3 (Hugging Face's DeepseekV2ForCausalLM, DeepseekV3ForCausalLM) and
GLM-4.7-Flash (Glm4MoeLiteForCausalLM, "glm4_moe_lite": V3's model, its dense and sparse
layers listed by mlp_layer_types) on the paged pool: multi-head latent attention
(`jax_paged.latent_attention`: one latent vector per token cached) and routed experts with
always-on shared experts.

The blocks are `models.moe`'s (pre-norm RMSNorm, a SwiGLU MLP on the first
first_k_dense_replace layers, experts after) with `LatentAttention` for attention. The
routers: V2's softmax over the experts, top-k among all of them ("greedy") or among the
topk_group groups holding the best experts ("group_limited_greedy"); V3's sigmoid with a
per-expert correction bias that only chooses ("noaux_tc": the groups ranked by their two
best biased scores), the chosen experts' unbiased scores weighting them. Both scale the
weights by routed_scaling_factor (after renormalising them with norm_topk_prob).

Checkpoints lay each head's rotated dims out in interleaved pairs (x0, x1), (x2, x3), ...
(V3's with rope_interleave, the default); the loader reorders those projection rows to
`RotaryEmbedding`'s rotate-half layout, which leaves every q.k unchanged.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable, ClassVar

import jax
import jax.numpy as jnp
from flax import nnx
from jax import lax

from jax_paged import latent_attention
from jax_paged import nn as paged_nn
from jax_paged.kernels import validation
from jax_paged.paged_model import ModelFamily, ModelSpec
from models import llama, moe

MODEL_TYPES = ("deepseek_v2", "deepseek_v3", "glm4_moe_lite")
_TOPK_METHODS = ("greedy", "group_limited_greedy", "noaux_tc")
# The model types whose router is V3's (noaux_tc).
_V3_ROUTED = ("deepseek_v3", "glm4_moe_lite")
# Hugging Face's DeepseekV2Config / DeepseekV3Config / Glm4MoeLiteConfig defaults
# (transformers 5.x; GLM-4.7-Flash's shape for the last), which a
# config.json omitting a field gets there too (HF's V2 has no num_experts_per_tok default:
# required here). rope_theta, rms_norm_eps, kv_lora_rank, the head widths, hidden_act
# and attention_bias default alike in both and in `DeepseekConfig`.
_HF_DEFAULTS = {
    "deepseek_v2": dict(
        vocab_size=102400, hidden_size=4096, intermediate_size=11008, num_hidden_layers=32,
        num_attention_heads=32, max_position_embeddings=2048, n_routed_experts=64,
        moe_intermediate_size=1407, n_shared_experts=2, q_lora_rank=1536,
        first_k_dense_replace=0, topk_method="greedy", routed_scaling_factor=1.0,
        norm_topk_prob=False, n_group=None, topk_group=None, bos_token_id=1, eos_token_id=2),
    "deepseek_v3": dict(
        vocab_size=129280, hidden_size=7168, intermediate_size=18432, num_hidden_layers=61,
        num_attention_heads=128, max_position_embeddings=4096, n_routed_experts=256,
        num_experts_per_tok=8, moe_intermediate_size=2048, n_shared_experts=1,
        q_lora_rank=1536, first_k_dense_replace=3, topk_method="noaux_tc",
        routed_scaling_factor=2.5, norm_topk_prob=True, n_group=8, topk_group=4,
        rope_interleave=True, bos_token_id=0, eos_token_id=1),
    "glm4_moe_lite": dict(
        vocab_size=154880, hidden_size=2048, intermediate_size=10240, num_hidden_layers=47,
        num_attention_heads=20, max_position_embeddings=202752, rms_norm_eps=1e-5,
        n_routed_experts=64, num_experts_per_tok=4, moe_intermediate_size=1536,
        n_shared_experts=1, q_lora_rank=768, qk_nope_head_dim=192, v_head_dim=256,
        topk_method="noaux_tc", routed_scaling_factor=1.8, norm_topk_prob=True, n_group=1,
        topk_group=1, rope_interleave=True, bos_token_id=0, eos_token_id=1),
}


@dataclasses.dataclass(frozen=True)
class DeepseekConfig(moe.MoeConfig):
  """DeepSeek-V2 / V3 hyperparameters under Hugging Face's field names (the defaults here:
  DeepSeek-V2-Lite's; `from_dict` fills the fields a config.json omits with Hugging Face's
  defaults, as `transformers` does).

  Attributes beyond `moe.MoeConfig`'s (num_local_experts is HF's n_routed_experts;
  shared_expert_intermediate_size is moe_intermediate_size * n_shared_experts; head_dim
  is qk_rope_head_dim, the rotary embedding's):
    kv_lora_rank, q_lora_rank (None: q projected directly), qk_nope_head_dim,
      qk_rope_head_dim, v_head_dim: MLA's widths.
    first_k_dense_replace: layers below it have a dense MLP, the rest experts.
    mlp_layer_types: "dense" or "sparse" per layer (GLM-4.7-Flash's), which decides over
      first_k_dense_replace; None: first_k_dense_replace decides.
    topk_method: "greedy", "group_limited_greedy" (V2) or "noaux_tc" (V3's sigmoid
      router with e_score_correction_bias), over n_group groups of which topk_group are
      kept.
    routed_scaling_factor: the experts' weights' multiplier.
    rope_interleave: whether the checkpoint's rotated dims are interleaved pairs (V2
      always; V3's flag).
  """

  vocab_size: int = 102400
  hidden_size: int = 2048
  intermediate_size: int = 10944
  num_hidden_layers: int = 27
  num_attention_heads: int = 16
  num_key_value_heads: int | None = None  # (MLA has no kv heads; HF ignores the field)
  max_position_embeddings: int = 163840
  rms_norm_eps: float = 1e-6
  rope_theta: float = 10000.0
  num_local_experts: int = 64
  num_experts_per_tok: int = 6
  moe_intermediate_size: int | None = 1408
  norm_topk_prob: bool = False
  kv_lora_rank: int = 512
  q_lora_rank: int | None = None
  qk_nope_head_dim: int = 128
  qk_rope_head_dim: int = 64
  v_head_dim: int = 128
  first_k_dense_replace: int = 1
  mlp_layer_types: tuple[str, ...] | None = None
  topk_method: str = "greedy"
  n_group: int | None = None
  topk_group: int | None = None
  routed_scaling_factor: float = 1.0
  rope_interleave: bool = True
  model_type: str = "deepseek_v2"

  model_types: ClassVar[tuple[str, ...]] = MODEL_TYPES

  def __post_init__(self):
    object.__setattr__(self, "head_dim", self.qk_rope_head_dim)
    super().__post_init__()
    for name in ("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"):
      validation.check_positive_int(name, getattr(self, name))
    validation.check_positive_int("q_lora_rank", self.q_lora_rank, optional=True)
    latent_attention.spec_head_dim(self.kv_lora_rank, self.qk_rope_head_dim)
    validation.check_positive_number("routed_scaling_factor", self.routed_scaling_factor)
    if self.topk_method not in _TOPK_METHODS:
      raise ValueError(f"topk_method {self.topk_method!r} is not supported; use one of "
                       f"{_TOPK_METHODS}")
    if (self.model_type in _V3_ROUTED) != (self.topk_method == "noaux_tc"):
      raise ValueError(f"topk_method {self.topk_method!r} does not go with {self.model_type}"
                       " (V3's router is noaux_tc, V2's greedy or group_limited_greedy)")
    check_mlp_layer_types(self)
    if self.topk_method != "greedy":
      check_groups(self)

  def sparse(self, layer: int) -> bool:
    """Whether layer `layer`'s MLP is the experts (mlp_layer_types', else from
    first_k_dense_replace on)."""
    if self.mlp_layer_types is not None:
      return self.mlp_layer_types[layer] == "sparse"
    return layer >= self.first_k_dense_replace

  @property
  def attention_scale(self) -> float:
    """The softmax scale: 1 / sqrt(qk_nope_head_dim + qk_rope_head_dim), times YaRN's
    mscale(factor, mscale_all_dim) squared (DeepSeek's yarn_apply_mscale)."""
    scale = (self.qk_nope_head_dim + self.qk_rope_head_dim) ** -0.5
    scaling = dict(self.rope_scaling or ())
    mscale_all_dim = scaling.get("mscale_all_dim")
    if scaling.get("rope_type", scaling.get("type", "default")) != "default" and mscale_all_dim:
      factor = llama.yarn_scaling(scaling, self.max_position_embeddings)["factor"]
      scale *= llama.yarn_mscale(factor, mscale_all_dim) ** 2
    return scale

  @classmethod
  def from_dict(cls, config: dict) -> "DeepseekConfig":
    """From a Hugging Face config dict: fields it omits take Hugging Face's defaults for
    its model_type (as `transformers` reads the same file; V2's num_experts_per_tok has
    none and is required); n_routed_experts read as num_local_experts, n_shared_experts as
    the shared expert's width; V2 always interleaves its RoPE pairs. num_key_value_heads
    and head_dim are dropped (MLA has neither; HF's attention ignores them); a hidden_act
    other than silu and the other unsupported settings are refused
    (`llama.LlamaConfig.from_dict`)."""
    config = dict(config)
    model_type = config.setdefault("model_type", cls.model_type)
    config = {**_HF_DEFAULTS.get(model_type, {}), **config}
    if config.get("num_experts_per_tok") is None and model_type in _HF_DEFAULTS:
      raise ValueError(f"a {model_type} config needs num_experts_per_tok (Hugging Face's "
                       "config has no default for it)")
    config["num_local_experts"] = config.pop("n_routed_experts", cls.num_local_experts)
    shared = config.pop("n_shared_experts", None)
    config["shared_expert_intermediate_size"] = (
        None if not shared
        else shared * config.get("moe_intermediate_size", cls.moe_intermediate_size))
    if model_type == "deepseek_v2":
      config["rope_interleave"] = True
    if model_type == "glm4_moe_lite":
      if config.get("mlp_layer_types") is None:  # HF's: layer 0 dense, the rest sparse
        layers = config["num_hidden_layers"]
        config["mlp_layer_types"] = ["dense"] + ["sparse"] * (layers - 1)
    else:
      config.pop("mlp_layer_types", None)
    for name in ("num_key_value_heads", "head_dim", "decoder_sparse_step", "mlp_only_layers",
                 "sliding_window", "layer_types"):
      config.pop(name, None)
    return llama.LlamaConfig.from_dict.__func__(cls, config)


@dataclasses.dataclass(frozen=True)
class DenseDeepseekConfig(DeepseekConfig):
  """DeepSeek's latent attention over a dense Llama MLP of intermediate_size on every
  layer, no experts (MiniCPM3's, Youtu-LLM's: `models.minicpm3`, `models.youtu`)."""

  def sparse(self, layer: int) -> bool:
    del layer
    return False

  @classmethod
  def from_dict(cls, config: dict) -> "DenseDeepseekConfig":
    """`DeepseekConfig.from_dict` with the experts' fields dropped (one placeholder expert,
    never built: `sparse` is False everywhere)."""
    config = {k: v for k, v in config.items()
              if k not in ("num_experts_per_tok", "n_routed_experts", "n_shared_experts",
                           "moe_intermediate_size", "first_k_dense_replace")}
    return super().from_dict({**config, "num_experts_per_tok": 1, "n_routed_experts": 1})


def check_mlp_layer_types(config: moe.MoeConfig) -> None:
  """Makes a config's mlp_layer_types (None, or "dense" / "sparse" per layer) a tuple;
  ValueError unless it names each layer's MLP (GLM-4.7-Flash's, K-EXAONE's field)."""
  if config.mlp_layer_types is None:
    return
  object.__setattr__(config, "mlp_layer_types", tuple(config.mlp_layer_types))
  if (len(config.mlp_layer_types) != config.num_hidden_layers
      or any(t not in ("dense", "sparse") for t in config.mlp_layer_types)):
    raise ValueError(f"mlp_layer_types must give 'dense' or 'sparse' for each of the "
                     f"{config.num_hidden_layers} layers, got {config.mlp_layer_types}")


def check_groups(config: moe.MoeConfig) -> None:
  """ValueError unless a grouped router's config (its topk_method, n_group, topk_group,
  num_local_experts, num_experts_per_tok) can choose its experts: n_group dividing the
  experts, topk_group <= n_group, and enough experts in the kept groups."""
  e, k = config.num_local_experts, config.num_experts_per_tok
  n_group, topk_group = config.n_group, config.topk_group
  if not (n_group and topk_group and e % n_group == 0 and topk_group <= n_group
          and k <= topk_group * (e // n_group)):
    raise ValueError(
        f"{config.topk_method} needs n_group dividing the {e} experts, topk_group <= "
        f"n_group and num_experts_per_tok ({k}) <= the kept groups' experts, got "
        f"n_group={n_group}, topk_group={topk_group}")


class DeepseekMoE(moe.SparseMoE):
  """DeepSeek's experts: `moe.SparseMoE` with DeepSeek's routers (the module docstring)
  and ungated shared experts (GLM-4.5's too: `models.glm4_moe`, whose config has the
  router's fields: topk_method, n_group, topk_group, routed_scaling_factor). V3's
  `correction_bias` [experts] (HF's e_score_correction_bias) is a parameter; it and the
  router are float32 whatever the param_dtype, and the router runs in float32, as HF's."""

  def __init__(self, config: DeepseekConfig, *, dtype, param_dtype, rngs: nnx.Rngs):
    super().__init__(config, dtype=dtype, param_dtype=param_dtype, rngs=rngs)
    self.router = nnx.Param(self.router[...].astype(jnp.float32))  # (HF keeps it f32)
    self.method = config.topk_method
    self.groups = (config.n_group, config.topk_group)
    self.routed_scaling_factor = config.routed_scaling_factor
    self.correction_bias = (nnx.Param(jnp.zeros((config.num_local_experts,), jnp.float32))
                            if config.topk_method == "noaux_tc" else None)

  def route(self, x: jax.Array) -> tuple[jax.Array, jax.Array]:
    """x [tokens, hidden] -> (float32 weights, int32 experts), each [tokens, top_k]."""
    logits = jnp.dot(x.astype(jnp.float32), self.router[...].astype(jnp.float32),
                     precision=lax.Precision.HIGHEST)
    if self.method == "noaux_tc":
      scores = jax.nn.sigmoid(logits)
      choice = scores + self.correction_bias[...]
      # A group's rank: the sum of its two best biased scores.
      grouped = choice.reshape(choice.shape[0], self.groups[0], -1)
      group_scores = jnp.sum(lax.top_k(grouped, 2)[0], axis=-1)
      choice = self._keep_groups(choice, group_scores, -jnp.inf)
      experts = lax.top_k(choice, self.top_k)[1]
      weights = jnp.take_along_axis(scores, experts, axis=-1)
    else:
      scores = jax.nn.softmax(logits, axis=-1)
      if self.method == "group_limited_greedy":
        grouped = scores.reshape(scores.shape[0], self.groups[0], -1)
        scores = self._keep_groups(scores, jnp.max(grouped, axis=-1), 0.0)
      weights, experts = lax.top_k(scores, self.top_k)
    if self.normalize:
      weights = weights / (jnp.sum(weights, axis=-1, keepdims=True) + 1e-20)
    return weights * self.routed_scaling_factor, experts

  def _keep_groups(self, scores: jax.Array, group_scores: jax.Array, fill: float
                   ) -> jax.Array:
    """scores [tokens, experts] with the experts outside the topk_group best groups
    (by group_scores [tokens, n_group]) set to `fill`."""
    n_group, topk_group = self.groups
    kept = lax.top_k(group_scores, topk_group)[1]  # [tokens, topk_group]
    group_kept = jnp.any(kept[:, :, None] == jnp.arange(n_group), axis=1)  # [tokens, groups]
    expert_kept = jnp.repeat(group_kept, scores.shape[-1] // n_group, axis=-1)
    return jnp.where(expert_kept, scores, fill)


class DecoderLayer(moe.DecoderLayer):
  """A DeepSeek block: `LatentAttention`, then a dense MLP or `DeepseekMoE`."""

  def _make_attention(self, config: DeepseekConfig, layer: int, *, decode_impl,
                      param_dtype, **kwargs) -> nnx.Module:
    del layer
    return latent_attention.LatentAttention(
        config.hidden_size, config.num_attention_heads,
        qk_nope_head_dim=config.qk_nope_head_dim, qk_rope_head_dim=config.qk_rope_head_dim,
        v_head_dim=config.v_head_dim, kv_lora_rank=config.kv_lora_rank,
        q_lora_rank=config.q_lora_rank, rope=config.rope, scale=config.attention_scale,
        bias=config.attention_bias, norm_eps=config.rms_norm_eps, decode_impl=decode_impl,
        kernel_init=nnx.initializers.normal(config.initializer_range),
        param_dtype=param_dtype, **kwargs)

  def _make_mlp(self, config: DeepseekConfig, layer: int, **kwargs) -> nnx.Module:
    if config.sparse(layer):
      return DeepseekMoE(config, **kwargs)
    return llama.MLP(config, **kwargs)


class DeepseekForCausalLM(moe.MoeForCausalLM):
  """DeepSeek-V2 / V3 with an LM head: `llama.LlamaForCausalLM` over these blocks (its
  Args). Its pool has one kv head holding each token's latent (`spec`). Served without
  LoRA adapters and tensor parallelism (refused by the engine: see
  `tensor_parallel_splits`, `lora_targets`)."""

  decoder_layer = DecoderLayer

  @property
  def spec(self) -> ModelSpec:
    """The pool: one kv head of `latent_attention.spec_head_dim` per layer."""
    c = self.config
    return dataclasses.replace(
        super().spec, num_kv_heads=1,
        head_dim=latent_attention.spec_head_dim(c.kv_lora_rank, c.qk_rope_head_dim))

  def tensor_parallel_splits(self):
    raise ValueError("tensor parallelism is not supported for DeepSeek's latent "
                     "attention (MLA): serve it on one device")

  def lora_targets(self):
    raise ValueError("LoRA adapters are not supported for DeepSeek models")


# ----------------------------------------------------------------- checkpoints
_ATTENTION = {"q_proj": "q_proj", "q_a_proj": "q_a_proj", "q_b_proj": "q_b_proj",
              "q_a_norm": "q_a_layernorm", "kv_a_proj": "kv_a_proj_with_mqa",
              "kv_a_norm": "kv_a_layernorm", "out": "o_proj"}


def hf_sources(path: tuple[str, ...], config: DeepseekConfig
               ) -> tuple[list[str], Callable[[list[jax.Array]], jax.Array]]:
  """`llama.Sources` of DeepSeek's checkpoints: the latent attention's modules (with the
  rotated rows reordered where interleaved, kv_b_proj split into w_uk and w_uv), the
  experts and the rest (`models.moe.hf_sources`: Qwen-MoE's expert names, the shared
  experts' module shared_experts), V3's correction bias."""
  if path[2:3] == ("self_attn",):
    prefix = f"model.layers.{path[1]}.self_attn."
    module, param = path[3], path[-1]
    h, dn, dr = config.num_attention_heads, config.qk_nope_head_dim, config.qk_rope_head_dim
    if module in ("w_uk", "w_uv"):
      # kv_b_proj [H * (dn + dv), R]: each head's dn key rows, then its dv value rows.
      def split(parts):
        w = parts[0].reshape(h, dn + config.v_head_dim, -1)
        return w[:, :dn] if module == "w_uk" else w[:, dn:]
      return [f"{prefix}kv_b_proj.weight"], split
    name = f"{prefix}{_ATTENTION[module]}.{'weight' if param == 'kernel' else param}"
    order = None
    if config.rope_interleave and module in ("q_proj", "q_b_proj"):
      order = llama.deinterleave(h * (dn + dr), dr, dn + dr)
    elif config.rope_interleave and module == "kv_a_proj":
      order = llama.deinterleave(config.kv_lora_rank + dr, dr, config.kv_lora_rank + dr)

    def assemble(parts):
      (w,) = parts
      if order is not None:
        w = w[order]
      return w.T if param == "kernel" else w
    return [name], assemble
  return experts_sources(path, config)


def experts_sources(path: tuple[str, ...], config: moe.MoeConfig
                    ) -> tuple[list[str], Callable[[list[jax.Array]], jax.Array]]:
  """`llama.Sources` of a `DeepseekMoE`'s checkpoint tensors and of all but the attention:
  the experts as Qwen-MoE's, the shared experts' module shared_experts
  (`models.moe.hf_sources`), V3's correction bias (GLM-4.5's too)."""
  if path[2:4] == ("mlp", "correction_bias"):
    return ([f"model.layers.{path[1]}.mlp.gate.e_score_correction_bias"], llama.whole)
  return moe.hf_sources(path, config, moe.QWEN_EXPERTS, shared_name="shared_experts")


def from_pretrained(path, *, dtype=jnp.float32, param_dtype=None,
                    decode_impl: paged_nn.DecodeImpl = "auto",
                    max_model_len: int | None = None) -> DeepseekForCausalLM:
  """Loads a Hugging Face DeepSeek-V2 / V3 checkpoint directory (`models.llama`'s
  `load_pretrained`: its files, errors and eos ids).

  Args:
    path: as `models.llama.load_pretrained`'s.
    dtype, param_dtype: as for `models.llama.LlamaForCausalLM`.
    decode_impl: the latent attention's (`jax_paged.latent_attention.LatentAttention`).
    max_model_len: as `models.llama.from_pretrained`'s.
  """
  return llama.load_pretrained(path, DeepseekConfig.from_dict, functools.partial(
      DeepseekForCausalLM, dtype=dtype, param_dtype=param_dtype, decode_impl=decode_impl),
      hf_sources, max_model_len=max_model_len)


def _family_from_pretrained(path: str, dtype: Any, **options) -> DeepseekForCausalLM:
  return from_pretrained(path, dtype=dtype, **options)


FAMILY = ModelFamily(
    name="deepseek",
    model_types=MODEL_TYPES,
    from_pretrained=_family_from_pretrained,
    presets={},
    max_model_len=True,
)
