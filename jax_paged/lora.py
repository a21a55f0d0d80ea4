"""LoRA adapters served beside the base model, many in one batch (S-LoRA, vLLM's multi-LoRA).

A LoRA adapter adds a low-rank update to some of a model's linears: y = x W + s x A B,
A [K, r], B [r, N], s = alpha / r (alpha / sqrt(r) with rsLoRA). Served, the base
weights stay as they are and each row of a batch names its adapter, or none:

* `attach` gives each adapted `nnx.Linear` `max_loras` slots: `lora_a` [K, W] and
  `lora_b` [W, N] (`LoraWeight`), every slot's A side by side and its B stacked. A slot
  is R = max_rank columns per adapted module the linear holds (a fused q/k/v projection
  holds three: each module's block of A, and its rows of B nonzero only in its own
  columns); W = max_loras * R rounded up to a power of two.
* `low_rank(proj, h, adapters)` is every row's update as two factors: x times all the
  slots' A at once ([rows, W], a sliver of the base GEMM) with the columns of other
  slots than the row's zeroed, and all the B; the linear kernels add their product as
  one more step of the base GEMM (`jax_paged.kernels.linear`'s `low_rank`), XLA
  elsewhere (`delta`). Per-row gathers of A and B instead would read [rows, K, R] bytes
  per linear per step (as much as the base weights at batch 256, rank 16, K = 4096).
  Slot -1 is the base model.
* `LoraAdapter.load` reads a PEFT checkpoint (adapter_config.json and
  adapter_model.safetensors / .bin), the scaling folded into B (`save` writes one);
  `SlotLayout` places an adapter in a slot (`check` names any module, rank or shape the
  model cannot take).

The layers of `jax_paged.nn` add the update to their projections (in the f32
accumulator, before any bias, activation or norm); a model lists where each checkpoint
module lands with `lora_targets()` (see `jax_paged.PagedModel`) and passes each row's
slot down as `adapters`. The serving layer assigns slots (`Engine(max_loras=...)`).
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import re
from typing import Mapping

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jax_paged import weight_quant

# The prefix PEFT gives every tensor name of a saved causal LM adapter.
_PEFT_PREFIX = "base_model.model."


class LoraWeight(nnx.Variable):
  """A linear's LoRA slots: `lora_a` [K, W] or `lora_b` [W, N]."""


@dataclasses.dataclass(frozen=True)
class Target:
  """Where an adapted checkpoint module lands: the output columns [offset, offset +
  width) of `linear` (a fused projection holds several modules; width None = all), or,
  given `columns`, the linear's column of each of the module's output columns in turn (a
  module whose columns the model reorders at load: GPT-NeoX's query_key_value, head by
  head in the checkpoint, q then k then v in the linear)."""

  linear: nnx.Linear
  offset: int = 0
  width: int | None = None
  columns: tuple[int, ...] | None = None

  @property
  def placement(self) -> range | tuple[int, ...]:
    """The linear's columns of the module's output columns, in the module's order."""
    if self.columns is not None:
      return self.columns
    n = self.linear.out_features
    return range(self.offset, n if self.width is None else self.offset + self.width)


def attached(proj: nnx.Linear) -> bool:
  """Whether `proj` has LoRA slots (`attach`)."""
  return getattr(proj, "lora_a", None) is not None


def _by_linear(targets: Mapping[str, Target]) -> dict[int, list[tuple[str, Target]]]:
  groups: dict[int, list[tuple[str, Target]]] = {}
  for name, target in targets.items():
    groups.setdefault(id(target.linear), []).append((name, target))
  return groups


def attach(targets: Mapping[str, Target], *, max_loras: int, max_rank: int) -> None:
  """Gives each linear of `targets` `max_loras` empty slots of rank `max_rank` per module
  it holds (zeros, in its parameter dtype)."""
  for group in _by_linear(targets).values():
    linear = group[0][1].linear
    k, n = linear.in_features, linear.out_features
    # A power of two (>= 16) of columns: the linear kernels' tiles take the update's
    # product as one more step (`jax_paged.kernels.linear`); the padding stays zero.
    width = max(16, 1 << (max_loras * max_rank * len(group) - 1).bit_length())
    dtype = weight_quant.param_dtype(linear)  # (an int8 linear's slots: its float dtype)
    linear.lora_a = LoraWeight(jnp.zeros((k, width), dtype))
    linear.lora_b = LoraWeight(jnp.zeros((width, n), dtype))
    linear.lora_slot_width = max_rank * len(group)  # (static: in the graph, not a leaf)


def detach(targets: Mapping[str, Target]) -> None:
  """Removes `attach`'s slots (a no-op for a linear without them)."""
  for group in _by_linear(targets).values():
    linear = group[0][1].linear
    for name in ("lora_a", "lora_b", "lora_slot_width"):
      if hasattr(linear, name):
        delattr(linear, name)


def low_rank(proj: nnx.Linear, h: jax.Array, adapters: jax.Array | None
             ) -> tuple[jax.Array, jax.Array] | None:
  """(xa [..., W], lora_b [W, N]) in the compute dtype: each row's update of proj(h) is
  xa @ lora_b, xa being h @ lora_a with every column outside the row's slot zeroed. None
  when `proj` has no slots or `adapters` is None.

  Args:
    proj: an `nnx.Linear` with slots (`attach`); under tensor parallelism a device's
      block of it (a row-parallel one gives this device's partial sum).
    h: [B, ..., K], the projection's input.
    adapters: int32 [B], each row's slot in [0, max_loras), or -1 for none.
  """
  if adapters is None or not attached(proj):
    return None
  dtype = proj.dtype or h.dtype
  xa = jnp.dot(h.astype(dtype), proj.lora_a[...].astype(dtype),
               preferred_element_type=jnp.float32)
  slot = jnp.arange(xa.shape[-1]) // proj.lora_slot_width  # (padding: slot >= S)
  mine = adapters.reshape(adapters.shape + (1,) * (h.ndim - 1)) == slot
  return jnp.where(mine, xa, 0.0).astype(dtype), proj.lora_b[...].astype(dtype)


def delta(proj: nnx.Linear, h: jax.Array, adapters: jax.Array | None) -> jax.Array | None:
  """float32 [..., N]: each row's LoRA update of proj(h) (`low_rank`'s product), or
  None."""
  factors = low_rank(proj, h, adapters)
  if factors is None:
    return None
  return jnp.dot(*factors, preferred_element_type=jnp.float32)


def linear_paths(model: nnx.Module, targets: Mapping[str, Target]) -> list[tuple]:
  """Each adapted linear's path in the model's graph, in `attach`'s order."""
  paths = {id(node): path for path, node in nnx.iter_graph(model)}
  return [paths[id(group[0][1].linear)] for group in _by_linear(targets).values()]


def slot_leaves(paths: list[tuple], key_paths) -> list[tuple[int, int]]:
  """The (lora_a, lora_b) indices among the model state's leaves (whose key paths, from
  `jax.tree_util.tree_flatten_with_path`, are `key_paths`) of the linears at `paths`."""
  index = {tuple(k.key for k in kp if isinstance(k, jax.tree_util.DictKey)): i
           for i, kp in enumerate(key_paths)}
  return [(index[p + ("lora_a",)], index[p + ("lora_b",)]) for p in paths]


@dataclasses.dataclass(frozen=True)
class LoraAdapter:
  """One adapter's updates.

  Attributes:
    weights: checkpoint module name (e.g. "model.layers.0.self_attn.q_proj", without
      PEFT's "base_model.model." prefix) -> (A float32 [r, K], B float32 [N, r] times the
      module's scaling), torch's layouts as PEFT saves them.
    path: where it was read from ("" if built in memory).
  """

  weights: Mapping[str, tuple[np.ndarray, np.ndarray]]
  path: str = ""

  @property
  def rank(self) -> int:
    """The largest rank of its modules."""
    return max(a.shape[0] for a, _ in self.weights.values())

  @classmethod
  def load(cls, path: str | os.PathLike) -> "LoraAdapter":
    """Reads a PEFT LoRA checkpoint directory (`PeftModel.save_pretrained`).

    Raises:
      FileNotFoundError: no adapter_config.json or weights file.
      ValueError: not a LoRA adapter, or one using what serving does not apply (DoRA,
        trained biases, modules saved whole, embedding adapters), naming it.
    """
    path = os.fspath(path)
    config_file = os.path.join(path, "adapter_config.json")
    if not os.path.isfile(config_file):
      raise FileNotFoundError(f"no adapter_config.json in {path!r}: expected a PEFT LoRA "
                              "adapter directory")
    try:
      with open(config_file, encoding="utf-8") as f:
        config = json.load(f)
      if not isinstance(config, dict):
        raise ValueError("not a JSON object")
    except (OSError, UnicodeDecodeError, ValueError) as e:
      raise ValueError(f"{config_file}: not a readable adapter config ({e})") from e
    if config.get("peft_type", "LORA") != "LORA":
      raise ValueError(f"{config_file}: peft_type {config.get('peft_type')!r}; only LoRA "
                       "adapters (peft_type \"LORA\") are served")
    for key, allowed in (("use_dora", (False, None)), ("bias", ("none", None)),
                         ("lora_bias", (False, None)), ("modules_to_save", (None, [])),
                         ("trainable_token_indices", (None,)),
                         ("layer_replication", (None,)), ("target_parameters", (None, [])),
                         ("alora_invocation_tokens", (None,)), ("use_qalora", (False, None))):
      if config.get(key) not in allowed:
        raise ValueError(f"{config_file}: {key}={config[key]!r} is not served (allowed: "
                         f"{' or '.join(map(json.dumps, allowed))}): only the low-rank "
                         "updates of linears are applied")
    tensors = _read_tensors(path)
    weights = {}
    for name in sorted(tensors):
      if ".lora_A." not in name and ".lora_B." not in name:
        raise ValueError(f"{path}: tensor {name!r} is not a LoRA A / B weight (embedding "
                         "adapters and other tensors are not served)")
      if ".lora_B." in name:
        continue
      module = name.split(".lora_A.")[0].removeprefix(_PEFT_PREFIX)
      b_name = name.replace(".lora_A.", ".lora_B.")
      if b_name not in tensors:
        raise ValueError(f"{path}: {name!r} has no {b_name!r}")
      a, b = tensors[name], tensors[b_name]
      if a.ndim != 2 or b.ndim != 2 or a.shape[0] != b.shape[1]:
        raise ValueError(f"{path}: {module!r} has A {a.shape} and B {b.shape}; expected "
                         "[r, in] and [out, r]")
      if not (np.isfinite(a).all() and np.isfinite(b).all()):
        raise ValueError(f"{path}: {module!r} holds NaN or infinite weights")
      rank = a.shape[0]
      alpha = float(_pattern_value(config.get("alpha_pattern"), module,
                                   config.get("lora_alpha", 8)))
      scaling = alpha / (math.sqrt(rank) if config.get("use_rslora") else rank)
      weights[module] = (a, b * np.float32(scaling))
    if not weights:
      raise ValueError(f"{path}: the adapter holds no LoRA weights")
    return cls(weights=weights, path=path)


  @classmethod
  def random(cls, targets: Mapping[str, Target], *, rank: int, seed: int = 0,
             scale: float = 0.1) -> "LoraAdapter":
    """An adapter of every target module with normal(0, scale) A and B (PEFT's
    `init_lora_weights=False`): for benchmarks and tests, where a trained adapter's zero
    B would hide any error."""
    rng = np.random.default_rng(seed)
    weights = {}
    for name, target in targets.items():
      width = len(target.placement)
      weights[name] = (rng.normal(0.0, scale, (rank, target.linear.in_features)
                                  ).astype(np.float32),
                       rng.normal(0.0, scale, (width, rank)).astype(np.float32))
    return cls(weights=weights, path=f"random(rank={rank}, seed={seed})")

  def save(self, path: str | os.PathLike) -> None:
    """Writes the adapter as a PEFT LoRA checkpoint directory (adapter_config.json,
    adapter_model.safetensors) that `load` and PEFT read back to the same updates: each
    module's rank and alpha equal (scaling 1: B holds it already)."""
    from safetensors.numpy import save_file  # an optional dependency: imported when used
    path = os.fspath(path)
    os.makedirs(path, exist_ok=True)
    rank = self.rank
    ranks = {name: a.shape[0] for name, (a, _) in self.weights.items()
             if a.shape[0] != rank}
    config = {"peft_type": "LORA", "r": rank, "lora_alpha": rank, "rank_pattern": ranks,
              "alpha_pattern": ranks, "bias": "none", "use_dora": False,
              "use_rslora": False, "fan_in_fan_out": False, "lora_dropout": 0.0,
              "target_modules": sorted({name.rsplit(".", 1)[-1] for name in self.weights}),
              "inference_mode": True}
    with open(os.path.join(path, "adapter_config.json"), "w", encoding="utf-8") as f:
      json.dump(config, f, indent=2)
    tensors = {}
    for name, (a, b) in self.weights.items():
      tensors[f"{_PEFT_PREFIX}{name}.lora_A.weight"] = np.ascontiguousarray(a, np.float32)
      tensors[f"{_PEFT_PREFIX}{name}.lora_B.weight"] = np.ascontiguousarray(b, np.float32)
    save_file(tensors, os.path.join(path, "adapter_model.safetensors"))


def _pattern_value(patterns, module: str, default):
  """PEFT's per-module override (`rank_pattern` / `alpha_pattern`: a key matches a module
  name it ends, at a dot), else `default`."""
  for key, value in (patterns or {}).items():
    if re.match(rf"(.*\.)?{key}$", module):
      return value
  return default


def _read_tensors(path: str) -> dict[str, np.ndarray]:
  """The adapter's tensors as float32 numpy (safetensors, else a torch pickle)."""
  safetensors_file = os.path.join(path, "adapter_model.safetensors")
  torch_file = os.path.join(path, "adapter_model.bin")
  if os.path.isfile(safetensors_file):
    from safetensors import safe_open  # optional dependencies: imported when used
    try:
      with safe_open(safetensors_file, framework="flax") as f:
        return {k: np.asarray(f.get_tensor(k), np.float32) for k in f.keys()}
    except Exception as e:  # SafetensorError and OSError: truncated, corrupt, unreadable
      raise ValueError(f"{safetensors_file}: not a readable safetensors file ({e})") from e
  if os.path.isfile(torch_file):
    import torch
    try:
      state = torch.load(torch_file, map_location="cpu", weights_only=True)
    except Exception as e:  # pickle, zip and OS errors alike
      raise ValueError(f"{torch_file}: not a readable PyTorch checkpoint ({e})") from e
    return {k: v.float().numpy() for k, v in state.items()}
  raise FileNotFoundError(f"no weights in {path!r}: expected adapter_model.safetensors or "
                          "adapter_model.bin")


@dataclasses.dataclass(frozen=True)
class SlotLayout:
  """How adapters fill a model's slots: per adapted linear (in `attach`'s order), its
  modules' names, their output columns and the linear's [K, N].

  Attributes:
    linears: per adapted linear, ((module name, its `Target.placement`), ...), (K, N).
    max_rank: each module's rank in a slot.
  """

  linears: tuple[tuple[tuple[tuple[str, range | tuple[int, ...]], ...], tuple[int, int]],
                ...]
  max_rank: int

  @classmethod
  def of(cls, targets: Mapping[str, Target], max_rank: int) -> "SlotLayout":
    linears = []
    for group in _by_linear(targets).values():
      k, n = group[0][1].linear.in_features, group[0][1].linear.out_features
      linears.append((tuple((name, t.placement) for name, t in group), (k, n)))
    return cls(linears=tuple(linears), max_rank=max_rank)

  def check(self, adapter: LoraAdapter) -> None:
    """Raises ValueError, naming them, for a module the model has no target for, a rank
    above `max_rank`, or a shape that is not the module's."""
    known = {name: (k, len(placement)) for modules, (k, _) in self.linears
             for name, placement in modules}
    unknown = sorted(set(adapter.weights) - set(known))
    if unknown:
      more = "..." if len(unknown) > 3 else ""
      raise ValueError(f"adapter {adapter.path!r} adapts {unknown[:3]}{more}, which the model "
                       f"does not serve; it serves modules such as {sorted(known)[:3]}")
    if adapter.rank > self.max_rank:
      raise ValueError(f"adapter {adapter.path!r} has rank {adapter.rank}, above the "
                       f"engine's max_lora_rank={self.max_rank}")
    for name, (a, b) in adapter.weights.items():
      k, width = known[name]
      if a.shape[1] != k or b.shape[0] != width:
        raise ValueError(f"adapter {adapter.path!r}: {name!r} has A {a.shape} and B "
                         f"{b.shape}; the model's module takes [r, {k}] and [{width}, r]")

  def blocks(self, adapter: LoraAdapter, dtype) -> list[tuple[np.ndarray, np.ndarray]]:
    """Per adapted linear, one slot's (A [K, R], B [R, N]) for `adapter` (zeros for the
    modules it does not adapt), in `dtype`. Raises as `check` does."""
    self.check(adapter)
    r = self.max_rank
    out = []
    for modules, (k, n) in self.linears:
      a_full = np.zeros((k, r * len(modules)), np.float32)
      b_full = np.zeros((r * len(modules), n), np.float32)
      for part, (name, placement) in enumerate(modules):
        if name not in adapter.weights:
          continue
        a, b = adapter.weights[name]
        rank = a.shape[0]
        a_full[:, part * r:part * r + rank] = a.T
        b_full[part * r:part * r + rank, np.asarray(placement)] = b.T
      out.append((a_full.astype(dtype), b_full.astype(dtype)))
    return out
