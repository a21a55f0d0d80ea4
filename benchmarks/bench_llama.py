"""A Llama-3.2-1B-shaped model on the paged pool (GPU, bf16, random weights): the decode
step against its bytes floor, and end-to-end generation against Hugging Face.

Shape: 16 layers, hidden 2048, 32 q heads over 8 kv heads of 64 (GQA), SwiGLU 8192,
vocabulary 128256, tied embeddings, llama3 RoPE. `--shape` picks another family's
(`SHAPES`): Pythia-1.4B's (`models.gpt_neox`: 24 layers, hidden 2048, 16 heads of 128,
RoPE on a quarter of each, the parallel residual, exact GELU 8192, vocabulary 50304) or
StarCoder2-3B's (`models.starcoder2`: 30 layers, hidden 3072, 24 q heads over 2 kv heads
of 128, tanh GELU 12288, vocabulary 49152, a 4096-token window, biases) or Phi-4-mini's
(Phi-3's model: 32 layers, hidden 3072, 24 q heads over 8 kv heads of 128, RoPE on 96
features of each with LongRoPE's short factors, SwiGLU 8192, vocabulary 200064, tied
embeddings) or Phi-2's (`models.phi`: 32 layers, hidden 2560, 32 heads of 80, RoPE on 32
features of each, one LayerNorm per block feeding the attention and the tanh GELU 10240 MLP
in parallel, biases, a biased head over 51200 tokens; a 2048-token context: pass
`--context 1536`) or Gemma-2B's (`models.gemma`: 18 layers, hidden 2048, 8 q heads over one
kv head of 256, GeGLU 16384, vocabulary 256000, tied embeddings scaled by sqrt(hidden))
or StableLM 2 1.6B's (`models.stablelm`: 24 layers, hidden 2048, 32 heads of 64, RoPE on
16 features of each, LayerNorms, q / k / v biases, SwiGLU 5632, vocabulary 100352) or
Command R7B's (`models.cohere`, Cohere2: 32 layers, hidden 4096, 32 q heads over 8 kv heads
of 128, the parallel block, three 4096-token windowed RoPE layers per full NoPE one,
SwiGLU 14336, vocabulary 256000, tied and scaled logits) or GPT-J-6B's (`models.gptj`: 28
layers, hidden 4096, 16 heads of 256, interleaved RoPE on 64 features of each, the
parallel block, tanh GELU 16384, a biased head over 50400 tokens; a 2048-token context:
pass `--context 1536`) or Minitron-4B's (`models.nemotron`: 32 layers, hidden 3072, 24 q
heads over 8 kv heads of 128, RoPE on half of each, 1P LayerNorms, relu^2 9216, vocabulary
256000) or Falcon-7B's (`models.falcon`: 32 layers, hidden 4544, 71 q heads over one kv
head of 64, one LayerNorm for the parallel branches, exact GELU 18176, vocabulary 65024,
tied; a 2048-token context: pass `--context 1536`) or Falcon-RW-1B's (24 layers, hidden
2048, 32 heads of 64, ALiBi, the sequential block, biases, exact GELU 8192, vocabulary
50304, tied; served to 4096 positions here) or StarCoderBase-1B's / StarCoder-15B's
(`models.gpt_bigcode`: 24 / 40 layers, hidden 2048 / 6144, 16 / 48 q heads over one kv
head of 128 (multi-query), learned positions, tanh GELU 8192 / 24576, vocabulary 49152,
tied) or BLOOM-560M's / BLOOM-7B1's (`models.bloom`: 24 / 30 layers, hidden 1024 / 4096,
16 / 32 heads of 64 / 128, ALiBi, an embedding LayerNorm, tanh GELU 4096 / 16384,
vocabulary 250880, tied; served to 4096 positions here, BLOOM's 2048 by default) or
GLM-4-9B-0414's (`models.glm`: 40 layers, hidden 4096, 32 q heads over 2 kv heads of 128,
interleaved RoPE on half of each, q / k / v biases, post norms, SwiGLU 13696, vocabulary
151552).

* Decode step, every sequence at `--context` tokens (pages randomly permuted), at each
  `--batches`: timed inside the engine's device loop (`--iters` greedy steps per jitted
  call, median of 7 fresh-pool calls; `bench_decode_step.time_device_loop`). Its floor is
  (weight bytes + live K/V bytes at the calls' mean context) / the read ceiling, measured
  in the same run as the GPU kernel time of `jnp.sum` over 4 GiB of bf16
  (`common.read_ceiling_gbs(kernel=True)`). The paged attention kernel alone (layer 0,
  x layers) is timed beside it.
* End to end: batch 128, prompt 512, 256 new tokens, greedy, EOS ignored: the engine vs
  Hugging Face transformers' `LlamaForCausalLM.generate` with a static cache (compiled by
  transformers with torch.compile) and with the dynamic cache, in the same run
  (`bench_generate.hf_tokens_per_s`); each figure the median of three timed calls after an
  identical untimed one (`bench_generate.timed`).

    PYTHONPATH=. python benchmarks/bench_llama.py [--shape llama-3.2-1b] [--batches 64 256]
        [--context 2048] [--iters 64] [--skip-decode-step] [--skip-e2e] [--skip-hf]
"""

from __future__ import annotations

import argparse
import functools
import os

import jax.numpy as jnp
import numpy as np
from flax import nnx

from benchmarks import bench_decode_step
from benchmarks import bench_generate
from benchmarks import common
from jax_paged import Engine, Request
from jax_paged.serving import runner as runner_lib
from models import (bloom, cohere, falcon, gemma, glm, gpt_bigcode, gpt_neox, gptj, llama,
                    nemotron, phi, stablelm, starcoder2)

# --shape -> (config class, model class, Hugging Face config.json fields): ours read from
# the fields by the config's from_dict, Hugging Face's model built from the same fields.
SHAPES = {
    "llama-3.2-1b": (llama.LlamaConfig, llama.LlamaForCausalLM, dict(
        model_type="llama", vocab_size=128256, hidden_size=2048, intermediate_size=8192,
        num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8, head_dim=64,
        max_position_embeddings=131072, rms_norm_eps=1e-5, rope_theta=500000.0,
        tie_word_embeddings=True, bos_token_id=128000,
        eos_token_id=[128001, 128008, 128009],
        rope_scaling={"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0,
                      "high_freq_factor": 4.0, "original_max_position_embeddings": 8192})),
    "pythia-1.4b": (gpt_neox.GPTNeoXConfig, gpt_neox.GPTNeoXForCausalLM, dict(
        model_type="gpt_neox", vocab_size=50304, hidden_size=2048, intermediate_size=8192,
        num_hidden_layers=24, num_attention_heads=16, max_position_embeddings=2048,
        rotary_pct=0.25, rotary_emb_base=10000, use_parallel_residual=True,
        hidden_act="gelu", layer_norm_eps=1e-5, bos_token_id=0, eos_token_id=0)),
    "starcoder2-3b": (starcoder2.Starcoder2Config, starcoder2.Starcoder2ForCausalLM, dict(
        model_type="starcoder2", vocab_size=49152, hidden_size=3072, intermediate_size=12288,
        num_hidden_layers=30, num_attention_heads=24, num_key_value_heads=2,
        max_position_embeddings=16384, sliding_window=4096, rope_theta=999999.4420358813,
        norm_epsilon=1e-5, use_bias=True, hidden_act="gelu_pytorch_tanh",
        tie_word_embeddings=True, bos_token_id=0, eos_token_id=0)),
    # (The factors' values do not change the work: a ramp of Phi-4-mini's range.)
    "phi-4-mini": (llama.LlamaConfig, llama.LlamaForCausalLM, dict(
        model_type="phi3", vocab_size=200064, hidden_size=3072, intermediate_size=8192,
        num_hidden_layers=32, num_attention_heads=24, num_key_value_heads=8,
        max_position_embeddings=131072, original_max_position_embeddings=4096,
        partial_rotary_factor=0.75, rms_norm_eps=1e-5, rope_theta=10000.0,
        rope_scaling={"rope_type": "longrope",
                      "short_factor": np.linspace(1.0, 3.0, 48).tolist(),
                      "long_factor": np.linspace(1.0, 64.0, 48).tolist()},
        tie_word_embeddings=True, bos_token_id=199999, eos_token_id=199999,
        pad_token_id=199999)),
    "phi-2": (phi.PhiConfig, phi.PhiForCausalLM, dict(
        model_type="phi", vocab_size=51200, hidden_size=2560, intermediate_size=10240,
        num_hidden_layers=32, num_attention_heads=32, max_position_embeddings=2048,
        partial_rotary_factor=0.4, rope_theta=10000.0, hidden_act="gelu_new",
        layer_norm_eps=1e-5, tie_word_embeddings=False, bos_token_id=50256,
        eos_token_id=50256)),
    "gemma-2b": (gemma.GemmaConfig, gemma.GemmaForCausalLM, dict(
        model_type="gemma", vocab_size=256000, hidden_size=2048, intermediate_size=16384,
        num_hidden_layers=18, num_attention_heads=8, num_key_value_heads=1, head_dim=256,
        max_position_embeddings=8192, hidden_act="gelu", rms_norm_eps=1e-6,
        rope_theta=10000.0, tie_word_embeddings=True, bos_token_id=2, eos_token_id=1,
        pad_token_id=0)),
    "stablelm-2-1.6b": (stablelm.StableLmConfig, stablelm.StableLmForCausalLM, dict(
        model_type="stablelm", vocab_size=100352, hidden_size=2048, intermediate_size=5632,
        num_hidden_layers=24, num_attention_heads=32, num_key_value_heads=32,
        max_position_embeddings=4096, partial_rotary_factor=0.25, rope_theta=10000.0,
        use_qkv_bias=True, layer_norm_eps=1e-5, tie_word_embeddings=False,
        bos_token_id=100257, eos_token_id=100257)),
    "command-r7b": (cohere.CohereConfig, cohere.CohereForCausalLM, dict(
        model_type="cohere2", vocab_size=256000, hidden_size=4096, intermediate_size=14336,
        num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
        max_position_embeddings=8192, sliding_window=4096, rope_theta=50000.0,
        layer_norm_eps=1e-5, logit_scale=0.25, tie_word_embeddings=True, bos_token_id=5,
        eos_token_id=255001, pad_token_id=0)),
    "gpt-j-6b": (gptj.GPTJConfig, gptj.GPTJForCausalLM, dict(
        model_type="gptj", vocab_size=50400, n_embd=4096, n_layer=28, n_head=16, rotary_dim=64,
        n_positions=2048, activation_function="gelu_new", layer_norm_epsilon=1e-5,
        tie_word_embeddings=False, bos_token_id=50256, eos_token_id=50256)),
    "minitron-4b": (nemotron.NemotronConfig, nemotron.NemotronForCausalLM, dict(
        model_type="nemotron", vocab_size=256000, hidden_size=3072, intermediate_size=9216,
        num_hidden_layers=32, num_attention_heads=24, num_key_value_heads=8, head_dim=128,
        max_position_embeddings=4096, partial_rotary_factor=0.5, rope_theta=10000.0,
        hidden_act="relu2", norm_eps=1e-5, tie_word_embeddings=False, bos_token_id=2,
        eos_token_id=3)),
    "falcon-7b": (falcon.FalconConfig, falcon.FalconForCausalLM, dict(
        model_type="falcon", vocab_size=65024, hidden_size=4544, num_hidden_layers=32,
        num_attention_heads=71, multi_query=True, new_decoder_architecture=False,
        parallel_attn=True, bias=False, layer_norm_epsilon=1e-5, rope_theta=10000.0,
        max_position_embeddings=2048, tie_word_embeddings=True, bos_token_id=11,
        eos_token_id=11)),
    "falcon-rw-1b": (falcon.FalconConfig, falcon.FalconForCausalLM, dict(
        model_type="falcon", vocab_size=50304, hidden_size=2048, num_hidden_layers=24,
        num_attention_heads=32, multi_query=False, new_decoder_architecture=False,
        parallel_attn=False, bias=True, alibi=True, layer_norm_epsilon=1e-5,
        max_position_embeddings=4096, tie_word_embeddings=True, bos_token_id=1,
        eos_token_id=2)),
    "starcoderbase-1b": (gpt_bigcode.GPTBigCodeConfig, gpt_bigcode.GPTBigCodeForCausalLM, dict(
        model_type="gpt_bigcode", vocab_size=49152, n_positions=8192, n_embd=2048, n_layer=24,
        n_head=16, n_inner=8192, multi_query=True, activation_function="gelu_pytorch_tanh",
        layer_norm_epsilon=1e-5, bos_token_id=0, eos_token_id=0)),
    "starcoder-15b": (gpt_bigcode.GPTBigCodeConfig, gpt_bigcode.GPTBigCodeForCausalLM, dict(
        model_type="gpt_bigcode", vocab_size=49152, n_positions=8192, n_embd=6144, n_layer=40,
        n_head=48, n_inner=24576, multi_query=True, activation_function="gelu_pytorch_tanh",
        layer_norm_epsilon=1e-5, bos_token_id=0, eos_token_id=0)),
    "glm-4-9b": (glm.GlmConfig, glm.GlmForCausalLM, dict(
        model_type="glm4", vocab_size=151552, hidden_size=4096, intermediate_size=13696,
        num_hidden_layers=40, num_attention_heads=32, num_key_value_heads=2, head_dim=128,
        max_position_embeddings=32768, partial_rotary_factor=0.5, rms_norm_eps=1e-5,
        attention_bias=True, tie_word_embeddings=False, eos_token_id=[151329, 151336, 151338])),
    "bloom-560m": (bloom.BloomConfig, bloom.BloomForCausalLM, dict(
        model_type="bloom", vocab_size=250880, n_positions=4096, hidden_size=1024, n_layer=24,
        n_head=16, layer_norm_epsilon=1e-5, bos_token_id=1, eos_token_id=2)),
    "bloom-7b1": (bloom.BloomConfig, bloom.BloomForCausalLM, dict(
        model_type="bloom", vocab_size=250880, n_positions=4096, hidden_size=4096, n_layer=30,
        n_head=32, layer_norm_epsilon=1e-5, bos_token_id=1, eos_token_id=2)),
}
LLAMA_3_2_1B = llama.LlamaConfig.from_dict(SHAPES["llama-3.2-1b"][2])
PAGE_SIZE = bench_decode_step.PAGE_SIZE


def decode_steps(model: llama.LlamaForCausalLM, num_heads: int, ceiling: float,
                 batches: list[int], context: int, iters: int) -> None:
  """The decode step table of `model` (its pool's shape from `model.spec`; `num_heads`
  q heads)."""
  spec = model.spec
  runner = runner_lib.ModelRunner(model)
  weight_bytes = sum(x.nbytes for x in runner.leaves)
  print(f"\nDecode step: every sequence at context {context}, {iters} greedy steps per "
        f"device call; weights {weight_bytes / 1e6:.0f} MB.\n")
  print("| batch | weights + live KV MB | floor us | step us (device loop) | x floor | new "
        "tokens/s | attention us (x layers) | attention % of ceiling |")
  print("|---|---|---|---|---|---|---|---|")
  for batch in batches:
    pages_per_seq = -(-(context + iters + 1) // PAGE_SIZE)
    make_pool = functools.partial(bench_decode_step.filled_pool, model, batch, context,
                                  batch * pages_per_seq, pages_per_seq, seed=batch)
    step, kv = bench_decode_step.time_device_loop(runner, make_pool, batch, iters)
    attention = bench_decode_step.time_attention(kv, spec.num_layers, iters,
                                                 num_heads=num_heads)
    del kv
    live = context + 0.5 * iters  # the mean context of a call's steps
    kv_bytes = (2 * batch * live * spec.num_layers * spec.num_kv_heads * spec.head_dim
                * jnp.dtype(jnp.bfloat16).itemsize)
    floor = (weight_bytes + kv_bytes) / (ceiling * 1e9)
    attention_pct = kv_bytes / attention / (ceiling * 1e9)
    print(f"| {batch} | {(weight_bytes + kv_bytes) / 1e6:,.0f} | {floor * 1e6:,.0f} | "
          f"{step * 1e6:,.0f} | **{step / floor:.2f}** | {batch / step:,.0f} | "
          f"{attention * 1e6:,.0f} | {attention_pct:.0%} |", flush=True)


def hf_model(fields: dict):
  """transformers' causal LM of a `SHAPES` entry's config fields, random bf16 weights on
  the GPU."""
  import torch
  import transformers
  with torch.device("cuda"):  # (made in bf16: made in f32 first, a 15B model needs 62 GB)
    return transformers.AutoModelForCausalLM.from_config(
        transformers.AutoConfig.for_model(**fields), dtype=torch.bfloat16).eval()


def end_to_end(model: llama.LlamaForCausalLM, hf_fields: dict, batch: int, prompt: int,
               new: int, steps_per_call: list[int], skip_hf: bool) -> None:
  vocab = model.config.vocab_size
  rng = np.random.default_rng(0)
  prompts = rng.integers(0, vocab, (batch, prompt)).tolist()
  print(f"\nEnd to end: batch {batch}, prompt {prompt}, {new} new tokens, greedy.\n")
  print("| system | new tokens/s | ours / it | prefill s | decode ms per step |")
  print("|---|---|---|---|---|")
  ours = 0.0
  for spc in steps_per_call:
    eng = Engine(model, max_batch=batch, num_pages=batch * -(-(prompt + new) // PAGE_SIZE),
                 page_size=PAGE_SIZE, steps_per_call=spc)
    (_, report), sec = bench_generate.timed(
        lambda: eng.generate([Request(p, new) for p in prompts]),
        before=eng.reset_prefix_cache)
    ours = max(ours, batch * new / sec)
    print(f"| paged engine, {spc} steps per call | {batch * new / sec:,.0f} | | "
          f"{report.prefill_s:.2f} | {1e3 * report.decode_s / report.decode_steps:.2f} |",
          flush=True)
    del eng
  if skip_hf:
    return
  hf = hf_model(hf_fields)
  for name, static in (("HF transformers, static cache + torch.compile", True),
                       ("HF transformers, dynamic cache", False)):
    try:
      tps = bench_generate.hf_tokens_per_s(hf, vocab, batch, prompt, new, static)
      print(f"| {name} | {tps:,.0f} | **{ours / tps:.2f}** | | |", flush=True)
    except Exception as e:  # report, don't hide: the table says what failed
      print(f"| {name} | failed: {type(e).__name__}: {str(e)[:160]} | | | |", flush=True)


def main():
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--shape", choices=list(SHAPES), default="llama-3.2-1b")
  p.add_argument("--batches", type=int, nargs="+", default=[64, 256])
  p.add_argument("--context", type=int, default=2048)
  p.add_argument("--iters", type=int, default=64, help="decode steps per device call")
  p.add_argument("--steps-per-call", type=int, nargs="+", default=[128],
                 help="the engine's decode steps per device call, end to end")
  p.add_argument("--skip-decode-step", action="store_true")
  p.add_argument("--skip-e2e", action="store_true")
  p.add_argument("--skip-hf", action="store_true")
  args = p.parse_args()
  bench_decode_step.check_steps_per_call(p, "--iters", args.iters)
  # JAX takes 75% of the GPU when it first uses it; leave Hugging Face's torch model room.
  os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.6")

  print(f"# bench_llama --shape {args.shape}: {common.header()}")
  config_cls, model_cls, fields = SHAPES[args.shape]
  config = config_cls.from_dict(fields)
  model = model_cls(config, dtype=jnp.bfloat16, rngs=nnx.Rngs(0))
  if not args.skip_decode_step:
    ceiling = common.read_ceiling_gbs(kernel=True)
    print(f"read ceiling (jnp.sum over 4 GiB bf16, kernel time): {ceiling:.0f} GB/s")
    # (GPT-BigCode's config names it as GPT-2's does.)
    num_heads = getattr(config, "num_attention_heads", None) or config.n_head
    decode_steps(model, num_heads, ceiling, args.batches, args.context, args.iters)
  if not args.skip_e2e:
    end_to_end(model, fields, 128, 512, 256, args.steps_per_call, args.skip_hf)


if __name__ == "__main__":
  main()
