"""Weight-only int8 quantization of a model's linears (W8A16, vLLM's `--quantization`).

Decoding a few rows per step reads every weight once per step: at small batches a step
is bound by those bytes. `quantize_weights(model)` replaces each `nnx.Linear` of a model
by an `Int8Linear`: its kernel int8 with one float32 scale per output column (symmetric,
scale = max |w| / 127 over the column's K weights, so each weight's error is at most half
a step of its own column), half the bytes of bf16. Activations, embeddings, the LM head,
norms, biases and the KV cache keep their dtypes. Measured (H200, benchmarks/RESULTS.md
"Int8 weights"): 0.57-0.66x the weight bytes, and at batch 1-16 1.35-1.47x bf16's
decoding throughput for the Llama-3.1-8B shape (1.14-1.16x Llama-3.2-1B, 1.00-1.03x GPT-2).

A mixture's experts (`jax_paged.nn.GroupedLinear`) quantize themselves the same way, one
scale per expert and column, read by `jax_paged.grouped_matmul`'s kernel.

`jax_paged.kernels.linear` reads the int8 tiles and scales the f32 accumulator in its
epilogue (decode's few rows); elsewhere (prompts, CPU) XLA converts the weights and
scales the product (`linear.scaled_product`). Kernels are stored transposed, [N, K]:
K-contiguous int8 tiles reach the tensor cores at speed (Llama-3.1-8B's gate/up at 1 row
32 µs, bf16's 55, [K, N] int8's 49; its down projection 17 vs 33 and 45;
benchmarks/LOG.md, "twenty-ninth"). `jax_paged.nn`'s projections take either
module; LoRA slots (`jax_paged.lora`) and tensor parallelism (`jax_paged.tensor_parallel`)
work on top of quantized weights.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from jax_paged.kernels import linear

# The int8 range used: symmetric, -127 .. 127 (no -128, so negating a weight is exact).
_QMAX = 127


class Int8Linear(nnx.Module):
  """A linear layer with int8 weights: y = (x @ kernel) * kernel_scale + bias.

  Attributes:
    kernel: int8 [in_features, out_features], or with `transposed` [out_features,
      in_features].
    kernel_scale: float32 [out_features], each output column's step.
    bias: [out_features] (the original's dtype) or None.
    dtype: the compute dtype (as `nnx.Linear`'s: None = the inputs' and `param_dtype`'s
      common dtype).
    param_dtype: the dtype the weights had before quantization (LoRA slots take it).
    transposed: the kernel's layout (static; `quantize_linear` stores [N, K], the fast one).
  """

  def __init__(self, kernel: jax.Array, kernel_scale: jax.Array, bias: jax.Array | None,
               *, dtype=None, param_dtype=jnp.float32, transposed: bool = False):
    if kernel.ndim != 2 or kernel.dtype != jnp.int8:
      raise ValueError(f"kernel must be int8 [in_features, out_features] (transposed: "
                       f"[out_features, in_features]), got {kernel.dtype}{list(kernel.shape)}")
    self.transposed = bool(transposed)
    self.out_features, self.in_features = kernel.shape[::1 if transposed else -1]
    out = (self.out_features,)
    if kernel_scale.shape != out or kernel_scale.dtype != jnp.float32:
      raise ValueError(f"kernel_scale must be float32 [out_features] = {out}, "
                       f"got {kernel_scale.dtype}{list(kernel_scale.shape)}")
    if bias is not None and bias.shape != out:
      raise ValueError(f"bias must have shape [out_features] = {out}, got "
                       f"{list(bias.shape)}")
    self.kernel = nnx.Param(kernel)
    self.kernel_scale = nnx.Param(kernel_scale)
    self.bias = None if bias is None else nnx.Param(bias)
    self.dtype = dtype
    self.param_dtype = jnp.dtype(param_dtype)

  def __call__(self, x: jax.Array) -> jax.Array:
    """x [..., in_features] -> [..., out_features] in the compute dtype."""
    dtype = self.dtype or jnp.result_type(x, self.param_dtype)
    y = linear.scaled_product(x.astype(dtype), self.kernel[...], self.kernel_scale[...],
                              self.transposed)
    if self.bias is not None:
      y += self.bias[...].astype(jnp.float32)
    return y.astype(dtype)


Linear = nnx.Linear | Int8Linear


def weights(proj: Linear) -> tuple[jax.Array, dict]:
  """(kernel, keywords): proj's kernel as stored and, for an `Int8Linear`, the
  `kernels.linear` keywords that read it (`scale`: f32 [N]; `transposed`), else {}."""
  if isinstance(proj, Int8Linear):
    return proj.kernel[...], dict(scale=proj.kernel_scale[...], transposed=proj.transposed)
  return proj.kernel[...], {}


def columns(proj: Linear) -> int:
  """N, the output columns of proj's kernel as stored (under tensor parallelism, inside
  the per-device model, a device's share; `out_features` stays the whole)."""
  return linear.columns(proj.kernel[...], isinstance(proj, Int8Linear) and proj.transposed)


def dequantize(proj: Int8Linear) -> jax.Array:
  """float32 [in_features, out_features]: the weights an `Int8Linear` computes with."""
  kernel = proj.kernel[...].astype(jnp.float32)
  return (kernel.T if proj.transposed else kernel) * proj.kernel_scale[...]


def param_dtype(proj: Linear):
  """The floating dtype of proj's weights (an int8 linear's before quantization)."""
  return proj.param_dtype if isinstance(proj, Int8Linear) else proj.kernel[...].dtype


@jax.jit
def quantize(kernel: jax.Array) -> tuple[jax.Array, jax.Array]:
  """kernel [K, N] (floating) -> (int8 [K, N], float32 [N] scales): per column, scale =
  max |w| / 127 (1 for an all-zero column) and q = round(w / scale)."""
  w = kernel.astype(jnp.float32)
  amax = jnp.max(jnp.abs(w), axis=0)
  scale = jnp.where(amax > 0, amax / _QMAX, 1.0)
  return jnp.clip(jnp.round(w / scale), -_QMAX, _QMAX).astype(jnp.int8), scale


def quantize_linear(proj: nnx.Linear) -> Int8Linear:
  """An `Int8Linear` of proj's weights (bias, dtype kept), its kernel stored [N, K]."""
  q, scale = quantize(proj.kernel[...])
  return Int8Linear(q.T, scale, None if proj.bias is None else proj.bias[...],
                    dtype=proj.dtype, param_dtype=proj.kernel[...].dtype, transposed=True)


def _child(node, key):
  return node[key] if isinstance(key, int) else getattr(node, key)


def quantize_weights(model: nnx.Module) -> int:
  """Replaces, in place, every `nnx.Linear` reachable in `model` by its `Int8Linear`
  (a linear held in two places becomes one quantized module in both), and quantizes
  every module that knows its own int8 form (a `quantize_int8()` method returning whether
  it changed: `jax_paged.nn.GroupedLinear`, a mixture's experts). Embeddings (`nnx.Embed`,
  tied or separate LM heads included) are not linears and stay as they are.

  Returns:
    how many linears and self-quantizing modules were quantized (0 if there were none, or
    they already were).

  Raises:
    ValueError: a linear already has LoRA slots (`jax_paged.lora.attach`): quantize
      first, then attach.
  """
  found: dict[int, tuple[nnx.Linear, list[tuple]]] = {}
  own: dict[int, nnx.Module] = {}  # modules that quantize themselves
  for path, node in nnx.iter_graph(model):
    if callable(getattr(node, "quantize_int8", None)):
      own[id(node)] = node
    elif isinstance(node, nnx.Linear):
      if getattr(node, "lora_a", None) is not None:
        raise ValueError(f"{'/'.join(map(str, path))} has LoRA slots: quantize the weights "
                         "before attaching adapters (Engine(max_loras=...) attaches them)")
      found.setdefault(id(node), (node, []))[1].append(path)
  count = sum(node.quantize_int8() for node in own.values())
  for proj, paths in found.values():
    quantized = quantize_linear(proj)
    for path in paths:
      parent = model
      for key in path[:-1]:
        parent = _child(parent, key)
      if isinstance(path[-1], int):
        parent[path[-1]] = quantized
      else:
        setattr(parent, path[-1], quantized)
  return len(found) + count
