"""Tensor parallelism over the devices of one host (Megatron-LM's split, with jax.sharding).

A model is split over a 1-D mesh axis (`AXIS`, "tp") of N devices:

* attention: each device holds H / N query heads and Hkv / N kv heads, or where Hkv < N
  (MQA, few-kv-head GQA; N a multiple of Hkv) a copy of the one kv head its q heads
  read: each kv head replicated N / Hkv times (vLLM's; `pool_kv_heads`), its K / V
  projection columns copied at shard time. The fused q/k/v projection is
  column-parallel and the output projection row-parallel: its partial products are
  summed over the devices (one all-reduce, `nn.project_add` and friends);
* the pool's K/V [L, Hkv, P, page, D] is split on the kv-head axis (`P(None, "tp")`):
  every device holds its heads' pages of every layer. The page table, lengths, free
  stack and reference counts are replicated: one scheduler and one bookkeeping on the
  host, whose plans every device executes identically;
* the MLP: its first projection column-parallel, its second row-parallel (one
  all-reduce); a mixture of experts' the same way, each device holding its share of
  every expert's intermediate columns (`nn.GroupedLinear`);
* embeddings and the LM head replicated. A vocabulary-sharded head would read 1 / N of
  the head per device, but sampling needs whole rows of logits (an all-gather of [B,
  vocab] f32 per step) and the embedding a masked lookup plus an all-reduce. Measured on
  two H100s (Llama-3.1-8B shape, TP 2, batch 64): the replicated head's greedy kernel
  takes 0.37 ms of a 6.8 ms step (0.61 of 10.56 ms at batch 256), so sharding it would
  save at most ~0.18 ms (~0.3) less an all-gather of each device's best token (~20-30 µs
  like the all-reduces): the simpler layout was kept (benchmarks/RESULTS.md, "Tensor
  parallel").

How it runs: the runner wraps each jitted step (reservation, forward, sampling) in one
`jax.shard_map` over the mesh. Inside, every array is a device's local block and the
model is a *local* copy of itself (`ShardedModel.graphdef`: attention layers with H / N
and Hkv / N heads, row-parallel projections marked with the axis they sum over), so the
Pallas kernels (paged decode and prefill attention, the cache write, the decode
reservation with its copy-on-write of K/V pages, the linear kernels) run unchanged on
their device's heads: a `pallas_call` cannot be partitioned by XLA, and under
`shard_map` nothing needs to be. The only communication is the `psum` after each
row-parallel projection (XLA lowers it to an NCCL all-reduce). The bookkeeping is
computed redundantly on every device from identical inputs, so it stays identical
(`check_vma=False`: shard_map then trusts the replicated `out_specs`, which the Pallas
reservation kernel, mixing replicated and sharded operands, could not prove).

Fused projections pack several blocks along their output columns (`qkv`: [q heads | k
heads | v heads]; a SwiGLU `gate_up`: [gate | up]). A plain column split would give
device 0 all q heads, so `shard_model` reorders the columns once, at shard time, to
[q_0 k_0 v_0 | q_1 k_1 v_1 | ...] (section j's i-th 1 / N after section j-1's): device
i's block is then its own q heads, kv heads (head i * Hkv / N onwards, the group of its
q heads) and their v, in the local layer's own [q | k | v] layout.

A model opts in with `tensor_parallel_splits()` (see `PagedModel`): its linears outside
attention to split and how (`Split`, e.g. its MLP's); every `nn.PagedAttention` is split
by head here (`attention_splits`), so nothing in `nn` or the kernels knows the mesh.
"""

from __future__ import annotations

import dataclasses
from typing import Literal, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from jax_paged import nn as paged_nn
from jax_paged import pool as pool_lib
from jax_paged.kernels import kv_quant

AXIS = "tp"


@dataclasses.dataclass(frozen=True)
class Split:
  """How one `nnx.Linear` (kernel [K, N], bias [N]) is split over the mesh axis; or one
  `nn.GroupedLinear` (kernel [groups, K, N]), every group's kernel alike.

  Attributes:
    kind: "column": the output columns (and bias) split, each device computing its own
      columns; "row": the input rows split, each device's partial product summed over
      the devices, the bias (replicated) added once after the sum.
    sections: for "column", the widths of the blocks packed along the columns (summing
      to N; None = one block), each split evenly: device i gets the i-th 1 / N of every
      section, in order.
  """

  kind: Literal["column", "row"]
  sections: tuple[int, ...] | None = None


COLUMN = Split("column")
ROW = Split("row")


def make_mesh(tensor_parallel: int, devices: Sequence[jax.Device] | None = None) -> Mesh:
  """A 1-D mesh (axis `AXIS`) over the first `tensor_parallel` devices (default: the
  local devices of the default backend)."""
  devices = list(jax.local_devices() if devices is None else devices)
  if isinstance(tensor_parallel, bool) or not isinstance(tensor_parallel, int) or (
      tensor_parallel < 1):
    raise ValueError(f"tensor_parallel must be a positive int, got {tensor_parallel!r}")
  if tensor_parallel > len(devices):
    raise ValueError(f"tensor_parallel={tensor_parallel} needs that many devices, but "
                     f"{len(devices)} {devices[0].platform if devices else ''} device(s) "
                     "are available")
  return Mesh(np.asarray(devices[:tensor_parallel]), (AXIS,))


def mesh_size(mesh: Mesh) -> int:
  """N, the devices along `AXIS`; raises ValueError for a mesh without that one axis."""
  if not isinstance(mesh, Mesh) or tuple(mesh.axis_names) != (AXIS,):
    raise ValueError(f"mesh must be a jax.sharding.Mesh with the one axis {AXIS!r} "
                     f"(tensor_parallel.make_mesh), got {mesh!r}")
  return int(mesh.shape[AXIS])


def pool_specs(quantized: bool = False) -> pool_lib.KVPool:
  """The pool's partition specs: K/V (and a quantized pool's scales) split on the kv-head
  axis, the rest replicated."""
  kv = P(None, AXIS)
  return pool_lib.KVPool(k_pages=kv, v_pages=kv, page_table=P(), lengths=P(),
                         free_pages=P(), num_free=P(), refcounts=P(),
                         k_scales=kv if quantized else None,
                         v_scales=kv if quantized else None)


def pool_shardings(mesh: Mesh, quantized: bool = False) -> pool_lib.KVPool:
  return jax.tree.map(lambda spec: NamedSharding(mesh, spec), pool_specs(quantized))


def pool_kv_heads(num_kv_heads: int, n: int) -> int:
  """The kv heads of the pool of a model of `num_kv_heads` split over n devices: its own
  (a multiple of n: each device holds num_kv_heads / n), or with fewer than n, each
  replicated n / num_kv_heads times (vLLM's), so that each device holds the one kv head
  its q heads read (`shard_model` copies its K / V projection columns).

  Raises:
    ValueError: neither count divides the other.
  """
  if num_kv_heads % n and n % num_kv_heads:
    raise ValueError(
        f"tensor parallel {n} splits the kv heads over {n} devices, but the model has "
        f"num_kv_heads={num_kv_heads}: neither a multiple of {n} nor a divisor of it "
        f"(to replicate); use a tensor parallel size dividing {num_kv_heads} or a "
        f"multiple of it")
  return max(num_kv_heads, n)


def _take_columns(linear: nnx.Module, order: np.ndarray) -> None:
  """Makes `linear`'s output columns its columns `order` (a gather: columns may repeat;
  a permutation reorders them), with its bias, int8 scales and LoRA B. Its kernel is
  [..., K, N], or stored [..., N, K] (`transposed`)."""
  kernel = linear.kernel[...]
  transposed = getattr(linear, "transposed", False)
  linear.kernel.value = jnp.take(kernel, order, axis=kernel.ndim - (2 if transposed else 1))
  for name in ("bias", "kernel_scale", "lora_b"):
    value = getattr(linear, name, None)
    if value is not None:
      value.value = value[...][..., order]
  linear.out_features = int(order.size)


def _replicate_kv_heads(node: paged_nn.PagedAttention, n: int) -> np.ndarray:
  """Gives an attention layer of fewer kv heads than n devices n kv heads, each of its
  own repeated n / num_kv_heads times in turn (device i's q heads, the i-th 1 / n, read
  the i-th copy: their own kv head's), by copying its K and V projection columns (and
  a per-head k norm's weights). Returns the qkv columns' order (what a later write of
  them, a LoRA adapter's B, must apply)."""
  h, hkv, d = node.num_heads, node.num_kv_heads, node.head_dim
  copies = np.repeat(np.arange(hkv), n // hkv)  # the kv head of each new head
  k_cols = (copies[:, None] * d + np.arange(d)).reshape(-1)
  order = np.concatenate([np.arange(h * d), h * d + k_cols, (h + hkv) * d + k_cols])
  _take_columns(node.qkv, order)
  if isinstance(node.k_norm, paged_nn.HeadLayerNorm):
    node.k_norm.scale.value = node.k_norm.scale[...][copies]
  node.num_kv_heads = n
  return order


def _column_order(width: int, sections: Sequence[int], n: int) -> np.ndarray:
  """Column permutation putting device i's 1 / n of every section together, in order."""
  starts = np.cumsum([0, *sections[:-1]])
  blocks = [np.arange(s + i * w // n, s + (i + 1) * w // n)
            for i in range(n) for s, w in zip(starts, sections)]
  order = np.concatenate(blocks)
  assert order.size == width
  return order


@dataclasses.dataclass(frozen=True)
class ShardedModel:
  """A model split over a mesh: what the runner's shard_map needs.

  Attributes:
    graphdef: the local model's structure (attention layers with H / N and Hkv / N heads,
      row-parallel linears marked), which `nnx.merge` joins to a device's blocks.
    leaves: the parameters (`jax.tree.leaves` of the state), global arrays placed on the
      mesh with `specs`.
    treedef: their structure.
    specs: a `PartitionSpec` per leaf (a tuple, hashable).
    mesh: the mesh.
    paths: each leaf's key path (`jax.tree_util.tree_flatten_with_path` of the state).
    column_orders: the path of each column-parallel linear whose columns were reordered
      (several sections) -> the order (`_column_order`): what a later write of its
      columns (a LoRA adapter's B) must apply too.
  """

  graphdef: nnx.GraphDef
  leaves: list
  treedef: object
  specs: tuple
  mesh: Mesh
  paths: tuple = ()
  column_orders: dict = dataclasses.field(default_factory=dict)


def _spec(rank: int, axis: int) -> P:
  """A PartitionSpec of `rank` axes splitting `axis` over the mesh axis."""
  return P(*(AXIS if i == axis else None for i in range(rank)))


def _path(key_path) -> tuple:
  return tuple(k.key for k in key_path if isinstance(k, jax.tree_util.DictKey))


def attention_splits(model: nnx.Module) -> list[tuple[nnx.Linear, Split]]:
  """The splits of every `nn.PagedAttention` in a model, by head: `qkv` column-parallel
  with its q, k and v sections each split (a device gets its q heads and their kv
  heads), `out` row-parallel. Sections from the layers' (global) head counts."""
  splits = []
  for _, node in nnx.iter_graph(model):
    if isinstance(node, paged_nn.PagedAttention):
      h, hkv, d = node.num_heads, node.num_kv_heads, node.head_dim
      splits += [(node.qkv, Split("column", (h * d, hkv * d, hkv * d))), (node.out, ROW)]
  return splits


def shard_model(model: nnx.Module, mesh: Mesh) -> ShardedModel:
  """Splits a model's parameters over `mesh` (Megatron-style, see the module docstring).

  Every `nn.PagedAttention` is split by head (per-head q / k norm weights,
  `nn.HeadLayerNorm`, and ALiBi slopes with it); the model lists its other linears to split
  (`tensor_parallel_splits()`, e.g. its MLP's); every other parameter (embeddings,
  norms, the LM head, row-parallel biases) is replicated.

  Raises:
    TypeError: the model has no `tensor_parallel_splits`.
    ValueError: a head count or a split width is not a multiple of N (naming both).
  """
  n = mesh_size(mesh)
  if not callable(getattr(model, "tensor_parallel_splits", None)):
    raise TypeError(f"{type(model).__name__} cannot run tensor parallel: it lists no "
                    "`tensor_parallel_splits()` (see jax_paged.PagedModel)")
  # A copy with its own Variables (sharing the arrays; nnx.merge of a split alone would
  # reuse the Variables): reordered and relabelled below, the caller's model untouched.
  graphdef, state = nnx.split(model)
  local = nnx.merge(graphdef, jax.tree.map(lambda x: x, state))
  replicated = {}  # qkv linear id -> its columns' order after replicating its kv heads
  for path, node in nnx.iter_graph(local):
    if isinstance(node, paged_nn.PagedAttention):
      if node.num_heads % n:
        raise ValueError(f"tensor parallel {n}: attention {'/'.join(map(str, path))} has "
                         f"num_heads={node.num_heads}, not a multiple of {n}")
      if pool_kv_heads(node.num_kv_heads, n) > node.num_kv_heads:
        replicated[id(node.qkv)] = _replicate_kv_heads(node, n)
  splits = attention_splits(local) + list(local.tensor_parallel_splits())
  head_norms, per_head = [], []  # (the paths of per-q-head vectors: slopes, sinks)
  for path, node in nnx.iter_graph(local):
    if isinstance(node, paged_nn.PagedAttention):
      where = "/".join(map(str, path))
      if n > 1 and node.qk_norm_all_heads:
        raise ValueError(f"tensor parallel {n}: attention {where} normalises q and k over "
                         "all heads together (OLMo's q/k norms), which a device holding "
                         "some of the heads cannot compute; run it on one device")
      node.num_heads //= n
      node.num_kv_heads //= n
      head_norms += [m for m in (node.q_norm, node.k_norm)
                     if isinstance(m, paged_nn.HeadLayerNorm)]
      per_head += [path + (name,) for name in ("alibi_slopes", "sinks")
                   if getattr(node, name) is not None]
  ids = {id(node): path for path, node in nnx.iter_graph(local)}
  specs, orders = {}, {}
  for norm in head_norms:  # (a weight per head: a device's heads' rows)
    specs[ids[id(norm)] + ("scale",)] = P(AXIS)
  for path in per_head:  # (a slope or a sink per q head: a device's heads')
    specs[path] = P(AXIS)
  for linear, split in splits:
    path = ids[id(linear)]
    where = "/".join(map(str, path))
    k, width = linear.in_features, linear.out_features
    # The kernel's axes: [..., K, N], or stored [..., N, K] (`transposed`: int8 weights,
    # `weight_quant.Int8Linear` and a quantized `nn.GroupedLinear`); a grouped linear's
    # leading groups' axis (and its kernel_scale's) stays whole on every device.
    kernel = linear.kernel[...]
    last, second = kernel.ndim - 1, kernel.ndim - 2
    col_axis, row_axis = (second, last) if getattr(linear, "transposed", False) else (
        last, second)
    scaled = getattr(linear, "kernel_scale", None) is not None
    if split.kind == "column":
      sections = split.sections or (width,)
      if sum(sections) != width or any(s % n for s in sections):
        raise ValueError(f"tensor parallel {n}: {where} has column sections {sections} "
                         f"(of {width} columns); each must be a multiple of {n}")
      if n > 1 and len(sections) > 1:
        order = _column_order(width, sections, n)
        # (A write of the original columns gathers through the replication too.)
        orders[path] = replicated.get(id(linear), np.arange(width))[order]
        _take_columns(linear, order)
      specs[path + ("kernel",)] = _spec(kernel.ndim, col_axis)
      # (a bias [N], or a grouped linear's [groups, N]: its columns split)
      specs[path + ("bias",)] = _spec(kernel.ndim - 1, kernel.ndim - 2)
      if scaled:  # (a row's scales whole)
        specs[path + ("kernel_scale",)] = _spec(kernel.ndim - 1, kernel.ndim - 2)
      specs[path + ("lora_b",)] = P(None, AXIS)  # (LoRA's A replicated: x A is whole)
    elif split.kind == "row":
      if k % n:
        raise ValueError(f"tensor parallel {n}: {where} has {k} input rows, not a "
                         f"multiple of {n}")
      specs[path + ("kernel",)] = _spec(kernel.ndim, row_axis)
      specs[path + ("lora_a",)] = P(AXIS, None)  # (each device's partial x A, summed)
      # Read by nn.projection / project_add / project_add_norm (a grouped linear's by its
      # caller, which sums where it has combined the rows).
      linear.reduce_axis = AXIS
    else:
      raise ValueError(f"Split.kind must be 'column' or 'row', got {split.kind!r}")
  graphdef, state = nnx.split(local)
  flat, treedef = jax.tree_util.tree_flatten_with_path(state)
  leaf_specs = tuple(specs.get(_path(kp), P()) for kp, _ in flat)
  leaves = [jax.device_put(x, NamedSharding(mesh, spec))
            for (_, x), spec in zip(flat, leaf_specs)]
  return ShardedModel(graphdef=graphdef, leaves=leaves, treedef=treedef, specs=leaf_specs,
                      mesh=mesh, paths=tuple(kp for kp, _ in flat), column_orders=orders)


def create_pool(spec, mesh: Mesh, **kwargs) -> pool_lib.KVPool:
  """An empty pool for a model spec (`ModelSpec.create_pool` arguments), created in
  place on the mesh: each device allocates only its kv heads' pages (of
  `pool_kv_heads`: replicated where the model has fewer kv heads than devices)."""
  spec = dataclasses.replace(spec, num_kv_heads=pool_kv_heads(spec.num_kv_heads,
                                                              mesh_size(mesh)))
  dtype = kwargs.get("dtype")
  quantized = dtype is not None and kv_quant.is_quantized(dtype)
  return jax.jit(lambda: spec.create_pool(**kwargs),
                 out_shardings=pool_shardings(mesh, quantized))()


def per_device(fn, mesh: Mesh, specs: Sequence[P], num_args: int):
  """fn(leaves, kv, *args) -> (out, kv) run as one shard_map over the mesh: the
  parameters (one spec per leaf, `ShardedModel.specs`) and the pool's K/V as each
  device's blocks, the other arguments and `out` replicated (identical on every
  device)."""
  def call(leaves, kv, *args):  # the pool's specs follow its dtype (scales or not)
    pool = pool_specs(kv.quantized)
    return jax.shard_map(fn, mesh=mesh, in_specs=(list(specs), pool) + (P(),) * num_args,
                         out_specs=(P(), pool), check_vma=False)(leaves, kv, *args)

  return call
