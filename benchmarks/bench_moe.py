"""Mixture-of-experts layers (`models.moe.SparseMoE`): the experts' grouped matmuls through
`jax_paged.grouped_matmul`'s kernel vs XLA's `lax.ragged_dot`, in the same run.

Per shape (`--shapes`; random bf16 weights, two weight sets alternated so no call finds its
experts in L2) and token count (`--tokens`): the whole layer's GPU kernel time (router, top-k,
sort, both grouped matmuls, activation, weighting and the scatter-add back to the tokens;
`common.kernel_seconds`, median over the weight sets) of each route, against the floor: the
weights of the experts the tokens hit (router included), read once at the HBM read ceiling.
At a few tokens a layer is bound by those bytes; at thousands (prefill) by the tensor cores,
so the rows also give the kernel's TF/s. The largest |difference| of the two routes' outputs
says they compute the same thing (bf16 rounding). A second table: the same layers with
int8 experts (`weight_quant.quantize_weights`: per expert and column) through the kernel,
against their own floor (half the bytes, scales included) and the bf16 kernel's time.

    PYTHONPATH=. python benchmarks/bench_moe.py          # on the GPU
    PYTHONPATH=. python benchmarks/bench_moe.py --tiny   # smoke test on CPU (interpret mode)
"""

from __future__ import annotations

import argparse
import os
from unittest import mock

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from benchmarks import common
from jax_paged import weight_quant
from jax_paged.kernels import grouped_matmul as gm
from models import deepseek
from models import glm4_moe
from models import gpt_oss
from models import llama4
from models import moe

# Whole models' shapes (HF's config.json; `benchmarks/profile_decode_step.py` steps them).
MIXTRAL_8X7B = moe.MoeConfig(
    vocab_size=32000, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
    num_attention_heads=32, num_key_value_heads=8, rms_norm_eps=1e-5, rope_theta=1e6,
    num_local_experts=8, num_experts_per_tok=2, model_type="mixtral")
QWEN3_30B_A3B = moe.MoeConfig(
    vocab_size=151936, hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768,
    num_hidden_layers=48, num_attention_heads=32, num_key_value_heads=4, head_dim=128,
    max_position_embeddings=40960, rms_norm_eps=1e-6, rope_theta=1e6, num_local_experts=128,
    num_experts_per_tok=8, norm_topk_prob=True, model_type="qwen3_moe")
# DeepSeek-V2-Lite (HF's config.json): MLA over a 512 + 64 latent, 2 shared and 64 routed
# experts (6 per token), layer 0 dense, YaRN RoPE.
DEEPSEEK_V2_LITE = deepseek.DeepseekConfig(
    vocab_size=102400, hidden_size=2048, intermediate_size=10944, moe_intermediate_size=1408,
    num_hidden_layers=27, num_attention_heads=16, num_local_experts=64, num_experts_per_tok=6,
    shared_expert_intermediate_size=2 * 1408, first_k_dense_replace=1, kv_lora_rank=512,
    q_lora_rank=None, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128,
    max_position_embeddings=163840, rope_scaling={
        "rope_type": "yarn", "factor": 40, "original_max_position_embeddings": 4096,
        "beta_fast": 32, "beta_slow": 1, "mscale": 0.707, "mscale_all_dim": 0.707})
# gpt-oss-20b (HF's config.json): 24 layers alternating a 128-token window and full
# attention with sinks, 64 q heads of 64 over 8, 32 experts of 2880 (4 per token).
GPT_OSS_20B = gpt_oss.GptOssConfig(
    num_hidden_layers=24, num_local_experts=32, eos_token_id=200002,
    layer_types=("sliding_attention", "full_attention") * 12)
# GLM-4.5-Air (HF's config.json): 46 layers (layer 0 dense), 96 q heads of 128 over 8 with
# RoPE on half of each head and q / k / v biases, 128 experts of 1408 (8 per token) and a
# shared one, DeepSeek-V3's router over one group.
GLM_4_5_AIR = glm4_moe.Glm4MoeConfig(
    hidden_size=4096, num_hidden_layers=46, num_attention_heads=96, num_key_value_heads=8,
    head_dim=128, attention_bias=True, rope_theta=1e6,
    eos_token_id=(151329, 151336, 151338))
# Llama-4-Scout-17B-16E (its text_config): 48 layers, 40 q heads of 128 over 8, chunked
# attention (8192) on three layers of four, NoPE layers between, 16 experts of 8192 (one
# per token, its input scaled) beside a shared one on every layer.
LLAMA_4_SCOUT = llama4.Llama4Config.from_dict({
    "attention_chunk_size": 8192, "head_dim": 128, "hidden_size": 5120,
    "interleave_moe_layer_step": 1, "intermediate_size": 8192, "intermediate_size_mlp": 16384,
    "max_position_embeddings": 10485760, "num_attention_heads": 40, "num_experts_per_tok": 1,
    "num_hidden_layers": 48, "num_key_value_heads": 8, "num_local_experts": 16,
    "rope_scaling": {"factor": 16.0, "high_freq_factor": 1.0, "low_freq_factor": 1.0,
                     "original_max_position_embeddings": 8192, "rope_type": "llama3"},
    "rope_theta": 500000.0, "vocab_size": 202048, "eos_token_id": [200001, 200007, 200008]})
# (hidden, experts' intermediate width, experts, experts per token)
SHAPES = {name: (c.hidden_size, c.expert_width, c.num_local_experts, c.num_experts_per_tok)
          for name, c in (("mixtral-8x7b", MIXTRAL_8X7B), ("qwen3-30b-a3b", QWEN3_30B_A3B))}
SHAPES["tiny"] = (64, 96, 8, 2)


def layer_routes(config: moe.MoeConfig, interpret: bool | None):
  """{route: (the layer's states over two weight sets, jitted (state, x) -> y)}: the
  kernel, XLA's ragged_dot, and int8 experts through the kernel."""
  def build(i, int8):
    layer = moe.SparseMoE(config, dtype=jnp.bfloat16, param_dtype=jnp.bfloat16,
                          rngs=nnx.Rngs(i))
    if int8:
      weight_quant.quantize_weights(layer)
    return nnx.split(layer)

  def run(graph):
    return jax.jit(lambda state, x: nnx.merge(graph, state)(x, interpret=interpret))

  def xla(graph):
    reference = lambda x, w, sizes, **_: gm.grouped_matmul_reference(x, w, sizes)

    def fn(state, x):
      with mock.patch.object(gm, "grouped_matmul", reference):
        return nnx.merge(graph, state)(x)
    return jax.jit(fn)

  routes = {}
  for route, int8, make in (("kernel", False, run), ("ragged_dot", False, xla),
                            ("int8", True, run)):
    graph, state = build(0, int8)
    routes[route] = ([state, build(1, int8)[1]], make(graph))
  return routes


def main():
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--shapes", nargs="+", default=["mixtral-8x7b", "qwen3-30b-a3b"],
                 choices=sorted(SHAPES))
  p.add_argument("--tokens", type=int, nargs="+", default=[1, 4, 16, 64, 256, 1024, 4096])
  p.add_argument("--tiny", action="store_true", help="a tiny layer on CPU, interpret mode")
  args = p.parse_args()
  interpret = None
  seconds = common.kernel_seconds
  ceiling = None
  if args.tiny:
    args.shapes, args.tokens, interpret = ["tiny"], [1, 8], True
    seconds = lambda fn, *a: common.time_fn(fn, *a, calls=1, reps=1)
    ceiling = 1e12  # nominal: no GPU to measure
  ceiling = ceiling or common.read_ceiling_gbs(kernel=True) * 1e9
  lines, int8_rows = [], []
  emit = common.emitter(lines)
  emit(f"# bench_moe: {common.header()}; read ceiling {ceiling / 1e9:,.0f} GB/s", "",
       "| shape | tokens | experts hit | floor µs | kernel µs (x floor) | kernel TF/s "
       "| ragged_dot µs (x floor) | **ragged_dot / kernel** | max abs Δ |",
       "|---|---|---|---|---|---|---|---|---|")
  for name in args.shapes:
    hidden, width, experts, top_k = SHAPES[name]
    config = moe.MoeConfig(hidden_size=hidden, intermediate_size=width,
                           moe_intermediate_size=width, num_local_experts=experts,
                           num_experts_per_tok=top_k, num_attention_heads=32,
                           norm_topk_prob=True)
    routes = layer_routes(config, interpret)
    router_bytes = hidden * experts * 2
    expert_bytes = 3 * hidden * width * 2
    int8_expert_bytes = 3 * hidden * width + (2 * 2 * width + hidden) * 4  # + scales
    for tokens in args.tokens:
      x = jax.random.normal(jax.random.key(tokens), (tokens, hidden), jnp.bfloat16)
      times, outs = {}, {}
      for route, (states, fn) in routes.items():
        times[route] = float(np.median([seconds(fn, state, x) for state in states]))
        outs[route] = np.asarray(fn(states[0], x), np.float32)
      states = routes["kernel"][0]
      router = np.asarray(x.astype(jnp.float32)
                          @ states[0]["router"][...].astype(jnp.float32))
      hit = len(set(np.argsort(-router, axis=1)[:, :top_k].reshape(-1).tolist()))
      floor = (hit * expert_bytes + router_bytes) / ceiling
      int8_floor = (hit * int8_expert_bytes + router_bytes) / ceiling
      kernel, xla, int8 = times["kernel"], times["ragged_dot"], times["int8"]
      flops = 2 * tokens * top_k * 3 * hidden * width
      emit(f"| {name} | {tokens} | {hit} | {floor * 1e6:,.1f} | {kernel * 1e6:,.1f} "
           f"({kernel / floor:.2f}x) | {flops / kernel / 1e12:,.0f} | {xla * 1e6:,.1f} "
           f"({xla / floor:.2f}x) | **{xla / kernel:.2f}** "
           f"| {np.abs(outs['kernel'] - outs['ragged_dot']).max():.1e} |")
      scale = np.abs(outs["kernel"]).max()
      int8_rows.append(
          f"| {name} | {tokens} | {int8_floor * 1e6:,.1f} | {int8 * 1e6:,.1f} "
          f"({int8 / int8_floor:.2f}x) | **{int8 / kernel:.2f}** "
          f"| {np.abs(outs['int8'] - outs['kernel']).max() / scale:.1e} |")
    del routes
  emit("", "int8 experts (per expert and output column) through the kernel:", "",
       "| shape | tokens | int8 floor µs | int8 µs (x floor) | **int8 / bf16 kernel** "
       "| max abs Δ / max abs (vs bf16) |", "|---|---|---|---|---|---|", *int8_rows)
  with open(os.path.join(common.out_dir(), "bench_moe.md"), "w") as f:
    f.write("\n".join(lines) + "\n")


if __name__ == "__main__":
  main()
