"""jax_paged: paged-KV-cache LLM decoding for Flax models on NVIDIA GPUs.

Kernels (Pallas, lowered through Triton on GPU; plain XLA on CPU):
  paged_decode_attention, merge_attention_states, merge_attention_states_n
Ground truth in plain jax.numpy: `jax_paged.reference`.
The functional KV page pool: KVPool, `jax_paged.pool` (reserve, write_kv, release, ...).
Flax NNX layers: `jax_paged.nn.PagedAttention` (paged KV cache), `jax_paged.nn.LayerNorm`
(one-kernel layer norm, `jax_paged.layer_norm`), `jax_paged.nn.project_add_norm` (a
projection's residual add fused with the next layer norm), `jax_paged.nn.dense` (a linear
layer + activation as one GEMM-with-epilogue kernel at decode's few rows,
`jax_paged.linear`).
Generation: generate (one static batch), Engine / Request / TokenEvent (continuous
batching); the CLI is `jax-paged-generate` (`python -m jax_paged.generate`).
"""

from jax_paged import reference
from jax_paged import pool
from jax_paged.pool import KVPool, PoolExhausted
from jax_paged import nn
from jax_paged.static_batch import generate
from jax_paged.paged_attention import paged_decode_attention
from jax_paged.merge_attention import merge_attention_states, merge_attention_states_n
from jax_paged.engine import Engine, Request, TokenEvent

__all__ = [
    "Engine", "KVPool", "PoolExhausted", "Request", "TokenEvent", "generate",
    "merge_attention_states", "merge_attention_states_n", "nn", "paged_decode_attention",
    "pool", "reference",
]
