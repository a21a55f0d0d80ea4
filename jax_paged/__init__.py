"""jax_paged: paged-KV-cache LLM decoding for Flax models on NVIDIA GPUs.

Layers, each using only those before it:
  kernels   Pallas kernels (lowered through Triton on a GPU; plain XLA on CPU) with their
            references: paged_decode_attention, paged_prefill_attention,
            paged_latent_{decode,prefill}_attention (MLA), merge_attention_states(_n),
            grouped_matmul (mixture-of-experts); ground truth in plain jax.numpy in
            `jax_paged.reference`
  pool      the functional KV page pool: KVPool, `jax_paged.pool` (reserve, write_kv,
            release, ...)
  weight_quant   int8 weights (weight-only, per output column): Int8Linear, quantize_weights
  lora      LoRA adapters served beside the base model: LoraAdapter (PEFT checkpoints),
            the slots a model's linears hold and their per-row updates
  nn        Flax NNX layers over the pool: PagedAttention, LayerNorm, RMSNorm,
            project_add_norm, dense
  latent_attention   LatentAttention, DeepSeek's multi-head latent attention (MLA): one
            latent vector per token in the pool
  PagedModel / ModelSpec / ModelFamily   what a model gives the serving layer
  guided    structured output: Guide (a regular expression, JSON schema or choice of
            texts over a Vocabulary's tokens), Request(guide=...)
  serving   scheduler, runner, engine: Engine / Request / TokenEvent (continuous
            batching), EngineLoop (an engine on a thread of its own, for servers),
            generate (one static batch), beam_search and speculative decoding
            (NgramSpeculation, DraftSpeculation)
  cli       `jax-paged-generate` (`python -m jax_paged.cli`)
  openai_server   `jax-paged-serve`: OpenAI's completions API over HTTP (server_metrics:
                  its Prometheus metrics; tool_calls: its tool call parsers)
  openai_batch    `jax-paged-batch`: a file of OpenAI requests answered offline
Models (e.g. `models.gpt2`) use jax_paged; jax_paged never imports them.
"""

from jax_paged.kernels import reference
from jax_paged import pool
from jax_paged.pool import KVPool, PoolExhausted
from jax_paged import weight_quant
from jax_paged import lora
from jax_paged.lora import LoraAdapter
from jax_paged import nn
from jax_paged import latent_attention
from jax_paged.kernels.paged_attention import paged_decode_attention
from jax_paged.kernels.paged_prefill import paged_prefill_attention
from jax_paged.kernels.paged_latent_attention import (paged_latent_decode_attention,
                                                      paged_latent_prefill_attention)
from jax_paged.kernels.merge_attention import merge_attention_states, merge_attention_states_n
from jax_paged.kernels.grouped_matmul import grouped_matmul
from jax_paged.paged_model import ModelFamily, ModelSpec, PagedModel
from jax_paged import guided
from jax_paged.guided import Guide, Vocabulary
from jax_paged.serving.engine import Engine
from jax_paged.serving.engine_loop import EngineLoop
from jax_paged.serving.report import EngineStats, Report
from jax_paged.serving.request import Request, TokenEvent
from jax_paged.serving.speculative import DraftSpeculation, NgramSpeculation
from jax_paged.serving.static_batch import generate
from jax_paged.serving.beam_search import Beam, beam_search

__all__ = [
    "Beam", "DraftSpeculation", "Engine", "EngineLoop", "EngineStats", "Guide", "KVPool",
    "LoraAdapter", "ModelFamily", "ModelSpec", "NgramSpeculation", "PagedModel",
    "PoolExhausted", "Report", "Request", "TokenEvent", "Vocabulary", "beam_search",
    "generate", "grouped_matmul", "guided",
    "latent_attention", "lora", "merge_attention_states", "merge_attention_states_n", "nn",
    "paged_decode_attention", "paged_latent_decode_attention", "paged_latent_prefill_attention",
    "paged_prefill_attention", "pool", "reference", "weight_quant",
]
