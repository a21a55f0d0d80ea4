"""GPT-2 in Flax NNX, decoding from a paged KV cache (`jax_paged.KVPool`).

The model is nanoGPT's: learned positions, pre-LayerNorm blocks, a gelu_new MLP and an LM
head tied to the token embedding. Its attention is `jax_paged.nn.PagedAttention`, so the
K/V cache lives in the pool's pages.

It meets `jax_paged.PagedModel`: `spec` gives the pool's shape, `prefill` and `decode`
are the forwards over the pool that `jax_paged`'s runner jits, reserving the new tokens'
slots and donating the pool; the model only computes. Serve it with `jax_paged.Engine` or
`jax_paged.generate`; `FAMILY` is how the CLI finds it (the `jax_paged.models` entry point).

`from_pretrained` loads Hugging Face GPT-2 checkpoints (config.json + model.safetensors or
pytorch_model.bin). HF's Conv1D stores weights as [in, out], which is already the layout
of an `nnx.Linear` kernel, and `c_attn` packs q, k, v along `out` exactly as
`PagedAttention.qkv` does, so no weight is transposed or split.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import os
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jax_paged import lora
from jax_paged import nn as paged_nn
from jax_paged import pool as pool_lib
from jax_paged import tensor_parallel
from jax_paged.paged_model import ModelFamily, ModelSpec, last_tokens


def gelu_tanh(x: jax.Array) -> jax.Array:
  """GELU's tanh approximation (HF's gelu_new, `jax.nn.gelu(approximate=True)`), written
  as x * sigmoid(2u) for u = sqrt(2 / pi) * (x + 0.044715 x^3): the same function as
  0.5 x (1 + tanh(u)), without the tanh that Pallas-Triton lowers to a branching libdevice
  call per element in the MLP GEMM's epilogue."""
  return x * jax.nn.sigmoid(2 * math.sqrt(2 / math.pi) * (x + 0.044715 * x * x * x))


# Hugging Face's activation names (GPT-2's activation_function, StarCoder2's hidden_act).
ACTIVATIONS: dict[str, Callable[[jax.Array], jax.Array]] = {
    "gelu_new": gelu_tanh,
    "gelu_pytorch_tanh": gelu_tanh,
    "gelu": functools.partial(jax.nn.gelu, approximate=False),
    "relu": jax.nn.relu,
    "silu": jax.nn.silu,
}


@dataclasses.dataclass(frozen=True)
class GPT2Config:
  """GPT-2 hyperparameters under Hugging Face's field names (defaults: GPT-2 124M)."""

  vocab_size: int = 50257
  n_positions: int = 1024
  n_embd: int = 768
  n_layer: int = 12
  n_head: int = 12
  n_inner: int | None = None  # MLP width; None means 4 * n_embd
  activation_function: str = "gelu_new"
  layer_norm_epsilon: float = 1e-5
  scale_attn_weights: bool = True
  scale_attn_by_inverse_layer_idx: bool = False
  initializer_range: float = 0.02
  bos_token_id: int | None = 50256
  eos_token_id: int | None = 50256

  def __post_init__(self):
    if self.n_embd % self.n_head:
      raise ValueError(f"n_embd ({self.n_embd}) must be a multiple of n_head ({self.n_head})")
    if self.activation_function not in ACTIVATIONS:
      raise ValueError(f"activation_function {self.activation_function!r} is not supported; "
                       f"use one of {sorted(ACTIVATIONS)}")

  @property
  def head_dim(self) -> int:
    return self.n_embd // self.n_head

  @property
  def num_kv_heads(self) -> int:
    """K/V heads: one per head (a subclass's own: `models.gpt_bigcode`'s multi-query)."""
    return self.n_head

  @property
  def alibi(self) -> bool:
    """ALiBi biases on the attention logits in place of learned positions (`wpe`): False
    (a subclass's own: `models.bloom`'s)."""
    return False

  @property
  def alibi_slopes(self) -> np.ndarray | None:
    """With `alibi`, the attention layers' slopes (`nn.alibi_slopes`), else None."""
    return paged_nn.alibi_slopes(self.n_head) if self.alibi else None

  @classmethod
  def from_dict(cls, config: dict[str, Any]) -> "GPT2Config":
    """From a Hugging Face config dict; fields this model does not use are ignored."""
    if config.get("tie_word_embeddings", True) is False:
      raise ValueError("GPT2LMHeadModel ties its LM head to wte: tie_word_embeddings=False "
                       "is not supported")
    names = {f.name for f in dataclasses.fields(cls)}
    return cls(**{k: v for k, v in config.items() if k in names})


class MLP(nnx.Module):
  def __init__(self, config: GPT2Config, *, dtype, param_dtype, rngs: nnx.Rngs):
    width = config.n_inner or 4 * config.n_embd
    init = nnx.initializers.normal(config.initializer_range)
    self.c_fc = nnx.Linear(config.n_embd, width, kernel_init=init, dtype=dtype,
                           param_dtype=param_dtype, rngs=rngs)
    self.c_proj = nnx.Linear(width, config.n_embd, kernel_init=init, dtype=dtype,
                             param_dtype=param_dtype, rngs=rngs)
    self.activation = ACTIVATIONS[config.activation_function]

  def hidden(self, x: jax.Array, adapters: jax.Array | None = None) -> jax.Array:
    """activation(c_fc(x)) [..., width] (one kernel at decode's few rows,
    `jax_paged.nn.dense`; with the rows' LoRA `adapters`); the block applies `c_proj`
    with its residual add (`jax_paged.nn.project_add_norm`)."""
    return paged_nn.dense(self.c_fc, x, activation=self.activation, adapters=adapters)


# attend(attention layer, normalised x, pool, layer index) -> (attention output before
# the layer's `out` projection, pool)
Attend = Callable[[paged_nn.PagedAttention, jax.Array, pool_lib.KVPool, int],
                  tuple[jax.Array, pool_lib.KVPool]]


class Block(nnx.Module):
  """A pre-LayerNorm block: ln_1, the attention (`_make_attention`'s: a subclass's own),
  ln_2, the MLP, each branch added to the residual stream."""

  def __init__(self, config: GPT2Config, layer: int, *, dtype, param_dtype,
               decode_impl: paged_nn.DecodeImpl, rngs: nnx.Rngs):
    norm = functools.partial(paged_nn.LayerNorm, config.n_embd,
                             epsilon=config.layer_norm_epsilon, dtype=dtype,
                             param_dtype=param_dtype)
    self.ln_1 = norm()
    self.attn = self._make_attention(config, layer, decode_impl=decode_impl, dtype=dtype,
                                     param_dtype=param_dtype, rngs=rngs)
    self.ln_2 = norm()
    self.mlp = MLP(config, dtype=dtype, param_dtype=param_dtype, rngs=rngs)

  def _make_attention(self, config: GPT2Config, layer: int, **kwargs
                      ) -> paged_nn.PagedAttention:
    """Block `layer`'s attention (kwargs: decode_impl, dtype, param_dtype, rngs): GPT-2's
    c_attn (q / k / v biases) and c_proj, its logits scaled per scale_attn_weights and
    scale_attn_by_inverse_layer_idx, ALiBi where the config has it."""
    scale = config.head_dim ** -0.5 if config.scale_attn_weights else 1.0
    if config.scale_attn_by_inverse_layer_idx:
      scale /= layer + 1
    return paged_nn.PagedAttention(
        config.n_embd, config.n_head, config.head_dim, num_kv_heads=config.num_kv_heads,
        scale=scale, alibi_slopes=config.alibi_slopes,
        kernel_init=nnx.initializers.normal(config.initializer_range), **kwargs)

  def __call__(self, x: jax.Array, h: jax.Array, kv: pool_lib.KVPool, layer: int,
               attend: Attend, next_norm: paged_nn.LayerNorm,
               adapters: jax.Array | None = None
               ) -> tuple[jax.Array, jax.Array, pool_lib.KVPool]:
    """x [..., n_embd] the residual stream and h = ln_1(x) -> (the new stream, its
    `next_norm` (the next block's ln_1, or ln_f), the pool). Each residual add is fused
    with the projection before it and the norm after it (`project_add_norm`);
    `adapters`: the rows' LoRA slots, or None."""
    a, kv = attend(self.attn, h, kv, layer)
    x, h = paged_nn.project_add_norm(self.attn.out, a, x, self.ln_2, adapters=adapters)
    x, h = paged_nn.project_add_norm(self.mlp.c_proj, self.mlp.hidden(h, adapters), x,
                                     next_norm, adapters=adapters)
    return x, h, kv


class GPT2LMHeadModel(nnx.Module):
  """GPT-2 with an LM head tied to `wte`, attending through a `KVPool`.

  Args:
    config: the hyperparameters.
    dtype: compute dtype (activations; the pool should match it).
    param_dtype: parameter storage dtype; defaults to `dtype`.
    decode_impl: the decode attention, see `jax_paged.nn.PagedAttention`.
    rngs: initialisation randomness (normal(initializer_range) weights, as HF does).
  """

  # The pool layer of the first block (`jax_paged.PagedModel`: a draft model's sit after
  # its target's).
  pool_layer_offset = 0
  block = Block  # (a subclass's own: `models.gpt_neo`'s)
  # Rows of `wpe` before position 0's (OPT's learned positions start at row 2).
  position_offset = 0

  def __init__(self, config: GPT2Config, *, dtype=jnp.float32, param_dtype=None,
               decode_impl: paged_nn.DecodeImpl = "auto", rngs: nnx.Rngs):
    param_dtype = dtype if param_dtype is None else param_dtype
    self.config = config
    self.dtype = dtype
    init = nnx.initializers.normal(config.initializer_range)
    self.wte = nnx.Embed(config.vocab_size, config.n_embd, embedding_init=init, dtype=dtype,
                         param_dtype=param_dtype, rngs=rngs)
    if not config.alibi:
      self.wpe = nnx.Embed(config.n_positions + self.position_offset, config.n_embd,
                           embedding_init=init, dtype=dtype, param_dtype=param_dtype,
                           rngs=rngs)
    self.h = nnx.List([self.block(config, i, dtype=dtype, param_dtype=param_dtype,
                                  decode_impl=decode_impl, rngs=rngs)
                       for i in range(config.n_layer)])
    self.ln_f = paged_nn.LayerNorm(config.n_embd, epsilon=config.layer_norm_epsilon,
                                   dtype=dtype, param_dtype=param_dtype)

  @property
  def spec(self) -> ModelSpec:
    """The pool's shape, the vocabulary and the context limit (`jax_paged.PagedModel`)."""
    c = self.config
    return ModelSpec(num_layers=c.n_layer, num_kv_heads=c.num_kv_heads, head_dim=c.head_dim,
                     vocab_size=c.vocab_size, max_positions=c.n_positions, dtype=self.dtype,
                     eos_token_id=c.eos_token_id)

  def tensor_parallel_splits(self) -> list[tuple[nnx.Linear, tensor_parallel.Split]]:
    """The MLP's c_fc column-parallel and c_proj row-parallel (`jax_paged.PagedModel`;
    the attention is split by head by `jax_paged.tensor_parallel` itself)."""
    return [split for block in self.h
            for split in ((block.mlp.c_fc, tensor_parallel.COLUMN),
                          (block.mlp.c_proj, tensor_parallel.ROW))]

  def lora_targets(self) -> dict[str, lora.Target]:
    """Hugging Face module name -> where its LoRA update lands (`jax_paged.PagedModel`):
    each block's c_attn (our fused qkv, the same layout), attn.c_proj, mlp.c_fc and
    mlp.c_proj."""
    targets = {}
    for i, block in enumerate(self.h):
      for name, linear in (("attn.c_attn", block.attn.qkv), ("attn.c_proj", block.attn.out),
                           ("mlp.c_fc", block.mlp.c_fc), ("mlp.c_proj", block.mlp.c_proj)):
        targets[f"transformer.h.{i}.{name}"] = lora.Target(linear)
    return targets

  def _forward(self, tokens: jax.Array, positions: jax.Array, kv: pool_lib.KVPool,
               attend: Attend, adapters: jax.Array | None
               ) -> tuple[jax.Array, pool_lib.KVPool]:
    """-> (ln_f of the final residual stream, pool)."""
    x = self._embed(tokens, positions)
    norms = [block.ln_1 for block in self.h] + [self.ln_f]
    h = norms[0](x)
    for layer, block in enumerate(self.h):
      x, h, kv = block(x, h, kv, self.pool_layer_offset + layer, attend, norms[layer + 1],
                       adapters)
    return h, kv

  def _embed(self, tokens: jax.Array, positions: jax.Array) -> jax.Array:
    """The residual stream's start: token plus position embeddings."""
    return self.wte(tokens) + self.wpe(positions + self.position_offset)

  def logits(self, h: jax.Array) -> jax.Array:
    """float32 logits [..., vocab] of final hidden states h [..., n_embd] (`prefill_hidden`'s;
    the LM head tied to wte)."""
    return self.wte.attend(h).astype(jnp.float32)

  def _greedy(self, h: jax.Array) -> jax.Array:
    """int32 argmax of `logits(h)` without writing the logits."""
    return paged_nn.attend_argmax(self.wte, h)

  def prefill_hidden(self, tokens: jax.Array, kv: pool_lib.KVPool, slots: jax.Array,
                     lengths: jax.Array, *, start: jax.Array | None = None,
                     page_table: jax.Array | None = None, adapters: jax.Array | None = None
                     ) -> tuple[jax.Array, pool_lib.KVPool]:
    """New tokens of several sequences (`jax_paged.PagedModel.prefill_hidden`).

    Args:
      tokens: int32 [B, T], right-padded.
      kv: the pool, with slots reserved.
      slots: int32 [B, T] from `reserve`, -1 at padding.
      lengths: int32 [B] >= 1, the new tokens per row.
      start: None for fresh sequences, or int32 [B] tokens already in each sequence's
        pages (a cached prefix, earlier chunks): the new tokens sit at positions start + t.
      page_table: int32 [B, max_pages_per_seq], the batch's rows (with `start`).
      adapters: int32 [B], each row's LoRA slot (-1: none), or None (`jax_paged.lora`).

    Returns:
      (ln_f of every new token [B, T, n_embd] in the compute dtype, pool).
    """
    t = tokens.shape[1]
    positions = jnp.arange(t)[None, :] + (0 if start is None else start[:, None])
    # Padding positions may run past n_positions: clamped (their outputs are unused).
    positions = jnp.minimum(positions, self.config.n_positions - 1)
    return self._forward(
        tokens, positions, kv,
        lambda attn, h, kv, layer: attn.prefill(h, kv, layer, slots, lengths, start=start,
                                                page_table=page_table, project=False,
                                                adapters=adapters),
        adapters)

  def prefill(self, tokens: jax.Array, kv: pool_lib.KVPool, slots: jax.Array,
              lengths: jax.Array, *, start: jax.Array | None = None,
              page_table: jax.Array | None = None, adapters: jax.Array | None = None
              ) -> tuple[jax.Array, pool_lib.KVPool]:
    """`prefill_hidden`, then float32 logits [B, vocab] of each row's last new token
    (`jax_paged.PagedModel.prefill`)."""
    h, kv = self.prefill_hidden(tokens, kv, slots, lengths, start=start,
                                page_table=page_table, adapters=adapters)
    return self.logits(last_tokens(h, lengths)), kv

  def decode(self, tokens: jax.Array, positions: jax.Array, kv: pool_lib.KVPool,
             slots: jax.Array, page_table: jax.Array, lengths: jax.Array, *,
             greedy: bool = False, adapters: jax.Array | None = None
             ) -> tuple[jax.Array, pool_lib.KVPool]:
    """One token per sequence (`jax_paged.PagedModel.decode`).

    Args:
      tokens, positions: int32 [B].
      kv: the pool, with slots reserved.
      slots: int32 [B] from `reserve`, -1 for inactive rows.
      page_table: int32 [B, max_pages_per_seq], the batch's rows of `kv.page_table`.
      lengths: int32 [B], tokens to attend to including the new one (0 = inactive).
      greedy: return the argmax tokens instead of the logits.
      adapters: int32 [B], each row's LoRA slot (-1: none), or None (`jax_paged.lora`).

    Returns:
      (float32 logits [B, vocab], or with `greedy` their int32 argmax [B], pool).
    """
    h, kv = self._forward(
        tokens, positions, kv,
        lambda attn, h, kv, layer: attn.decode(h, kv, layer, slots, page_table, lengths,
                                               project=False, adapters=adapters),
        adapters)
    return (self._greedy(h) if greedy else self.logits(h)), kv


def _load_checkpoint(path: str) -> dict[str, np.ndarray]:
  """All tensors of a checkpoint directory, as numpy, keyed by name."""
  safetensors_file = os.path.join(path, "model.safetensors")
  torch_file = os.path.join(path, "pytorch_model.bin")
  if os.path.exists(safetensors_file):
    from safetensors.numpy import load_file  # optional dependencies: import only when used
    try:
      return load_file(safetensors_file)
    except Exception as e:  # SafetensorError and OSError: truncated, corrupt, unreadable
      raise ValueError(f"{safetensors_file}: not a readable safetensors file ({e})") from e
  if os.path.exists(torch_file):
    import torch
    try:
      state = torch.load(torch_file, map_location="cpu", weights_only=True)
    except Exception as e:  # pickle, zip and OS errors alike
      raise ValueError(f"{torch_file}: not a readable PyTorch checkpoint ({e})") from e
    return {k: v.float().numpy() if v.dtype == torch.bfloat16 else v.numpy()
            for k, v in state.items()}
  raise FileNotFoundError(f"no weights in {path}: expected model.safetensors or "
                          "pytorch_model.bin")


def _hf_name(path: tuple[Any, ...]) -> str:
  """An nnx state path -> the Hugging Face parameter name (without `transformer.`)."""
  rename = {"qkv": "c_attn", "out": "c_proj", "kernel": "weight", "scale": "weight",
            "embedding": "weight"}
  return ".".join(rename.get(p, str(p)) for p in path)


def from_pretrained(path: str | os.PathLike, *, dtype=jnp.float32, param_dtype=None,
                    decode_impl: paged_nn.DecodeImpl = "auto") -> GPT2LMHeadModel:
  """Loads a Hugging Face GPT-2 checkpoint directory.

  Args:
    path: a directory with config.json and model.safetensors (or pytorch_model.bin), as
      written by `transformers`' `save_pretrained`.
    dtype, param_dtype, decode_impl: as for `GPT2LMHeadModel`.

  Raises:
    FileNotFoundError: the directory, its config.json or its weights file is missing.
    ValueError: a file is unreadable (naming it), or a weight is missing from the
      checkpoint or has the wrong shape.
  """
  path = os.fspath(path)
  config_file = os.path.join(path, "config.json")
  if not os.path.isfile(config_file):
    raise FileNotFoundError(f"no config.json in {path}")
  try:
    with open(config_file, encoding="utf-8") as f:
      config = json.load(f)
  except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
    raise ValueError(f"{config_file}: not a readable JSON file ({e})") from e
  try:
    config = GPT2Config.from_dict(config)
  except (TypeError, ValueError, AttributeError) as e:
    raise ValueError(f"{config_file}: {e}") from e
  tensors = _load_checkpoint(path)
  # Both GPT2Model ("h.0...") and GPT2LMHeadModel ("transformer.h.0...") checkpoints.
  tensors = {k.removeprefix("transformer."): v for k, v in tensors.items()}

  # Shapes only: the checkpoint supplies every value, so nothing is initialised twice.
  abstract = nnx.eval_shape(lambda: GPT2LMHeadModel(config, dtype=dtype,
                                                    param_dtype=param_dtype,
                                                    decode_impl=decode_impl,
                                                    rngs=nnx.Rngs(0)))
  graphdef, state = nnx.split(abstract)

  def load(key_path, spec: jax.ShapeDtypeStruct) -> jax.Array:
    name = _hf_name(tuple(k.key for k in key_path if isinstance(k, jax.tree_util.DictKey)))
    if name not in tensors:
      raise ValueError(f"{path}: weight {name!r} (shape {spec.shape}) is missing from the "
                       "checkpoint")
    value = tensors[name]
    if value.shape != spec.shape:
      raise ValueError(f"{path}: weight {name!r} has shape {value.shape}, expected "
                       f"{spec.shape} for config.json's hyperparameters")
    return jnp.asarray(value, spec.dtype)

  return nnx.merge(graphdef, jax.tree_util.tree_map_with_path(load, state))


# Random-weight configurations for runs without a checkpoint (the CLI's --model).
PRESETS = {
    "gpt2": GPT2Config(),
    "gpt2-medium": GPT2Config(n_embd=1024, n_layer=24, n_head=16),
    "tiny": GPT2Config(vocab_size=256, n_positions=512, n_embd=64, n_layer=2, n_head=4,
                       bos_token_id=None, eos_token_id=None),
}

def _random_model(config: GPT2Config, dtype, seed: int) -> GPT2LMHeadModel:
  return GPT2LMHeadModel(config, dtype=dtype, rngs=nnx.Rngs(seed))


FAMILY = ModelFamily(
    name="gpt2",
    model_types=("gpt2",),
    from_pretrained=lambda path, dtype: from_pretrained(path, dtype=dtype),
    presets={name: functools.partial(_random_model, config) for name, config in PRESETS.items()},
)
