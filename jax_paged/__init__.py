"""jax_paged: paged-KV-cache LLM decoding for Flax models on NVIDIA GPUs."""

from jax_paged import reference
from jax_paged import pool
from jax_paged.pool import KVPool, PoolExhausted
from jax_paged import nn
from jax_paged.static_batch import generate
from jax_paged.paged_attention import paged_decode_attention
from jax_paged.merge_attention import merge_attention_states, merge_attention_states_n
from jax_paged.engine import Engine, Request, TokenEvent
