"""Beam search: `jax_paged.beam_search` vs Hugging Face's `generate(num_beams=k)`.

GPT-2 124M with random weights (Hugging Face's initialisation, loaded by ours), bf16:
`--batch` prompts of `--prompt` random tokens, `--new` new tokens each (random weights
never stop a beam early), `--beams` beams per prompt, length penalty 1, early_stopping
False. Ours runs every prompt's beams in one wave
(batch x beams pool rows); Hugging Face's the same batch at once with its dynamic cache
(eager attention kernels, SDPA), and with its static cache compiled where that works.
Each time is the median of three timed runs after an identical untimed one. Reported:
time, beam tokens/s (batch x beams x new / time), the best hypotheses matching Hugging
Face's (bf16 near-ties make some differ), and the pool's peak pages against beams that
shared nothing past the prompt.

    PYTHONPATH=. python benchmarks/bench_beam.py            # on the GPU
    PYTHONPATH=. python benchmarks/bench_beam.py --tiny     # smoke test on CPU
"""

from __future__ import annotations

import argparse
import os
import tempfile

import jax.numpy as jnp
import numpy as np
from flax import nnx

import jax_paged
from benchmarks import common
from benchmarks.bench_generate import timed
from models import gpt2


def hf_model(directory: str):
  """Hugging Face's GPT-2 124M with random weights (float32, CPU), saved to `directory`
  so that ours loads the same weights (`gpt2.from_pretrained`)."""
  import torch
  import transformers
  torch.manual_seed(0)
  model = transformers.GPT2LMHeadModel(transformers.GPT2Config()).eval()
  model.save_pretrained(directory)
  return model


def hf_beams(model, prompts: np.ndarray, new: int, beams: int, cache: str | None):
  """A function running Hugging Face's beam search (bf16, on "cuda") over prompts [B, T]:
  each prompt's best hypothesis' new tokens, int [B, new]."""
  import torch
  import transformers
  model = model.to("cuda", torch.bfloat16)
  ids = torch.as_tensor(prompts, device="cuda")
  extra = {} if cache is None else dict(cache_implementation=cache,
                                        compile_config=transformers.CompileConfig())

  def run():
    with torch.inference_mode():
      out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new,
                           min_new_tokens=new, num_beams=beams, do_sample=False,
                           early_stopping=False, length_penalty=1.0, pad_token_id=0,
                           **extra)
      torch.cuda.synchronize()
    return out[:, prompts.shape[1]:].tolist()

  return run


def main():
  p = argparse.ArgumentParser()
  p.add_argument("--tiny", action="store_true", help="a tiny model and workload (CPU smoke)")
  p.add_argument("--batch", type=int, default=64)
  p.add_argument("--prompt", type=int, default=256)
  p.add_argument("--new", type=int, default=128)
  p.add_argument("--beams", type=int, default=4)
  p.add_argument("--steps-per-call", type=int, default=32)
  args = p.parse_args()
  hf = None
  if args.tiny:
    config = gpt2.GPT2Config(vocab_size=256, n_positions=128, n_embd=64, n_layer=2, n_head=4)
    args.batch, args.prompt, args.new, dtype, page_size = 3, 20, 12, jnp.float32, 8
    model = gpt2.GPT2LMHeadModel(config, dtype=dtype, rngs=nnx.Rngs(0))
  else:
    dtype, page_size = jnp.bfloat16, 16
    with tempfile.TemporaryDirectory() as directory:
      hf = hf_model(directory)
      model = gpt2.from_pretrained(directory, dtype=dtype)
    config = model.config
  rng = np.random.default_rng(0)
  prompts = rng.integers(0, config.vocab_size, (args.batch, args.prompt))
  k = args.beams
  unshared = args.batch * k * -(-(args.prompt + args.new - 1) // page_size)
  lines = [f"# bench_beam: {common.header()}", "",
           f"GPT-2 {config.n_layer}L/{config.n_embd}, {jnp.dtype(dtype).name}: {args.batch} "
           f"prompts of {args.prompt} random tokens, {k} beams, {args.new} new tokens each "
           f"(median of 3).", "",
           "| system | time (ms) | beam tokens/s | best beams as HF's | KV pages (peak) |",
           "|---|---|---|---|---|"]
  emit = common.emitter(lines)
  print("\n".join(lines), flush=True)
  as_lists = prompts.tolist()
  (beams, report), sec = timed(lambda: jax_paged.beam_search(
      model, as_lists, args.new, beam_width=k, page_size=page_size, max_batch=args.batch * k,
      steps_per_call=args.steps_per_call))
  ours = [b[0].tokens for b in beams]
  rate = args.batch * k * args.new / sec
  if args.tiny:
    emit(f"| jax_paged.beam_search | {sec * 1e3:.1f} | {rate:,.0f} | | "
         f"{report.peak_pages_in_use} (unshared {unshared}) |")
  for cache in (None, "static"):
    label = "Hugging Face generate, " + ("dynamic cache" if cache is None else
                                         "static cache, compiled")
    if args.tiny:
      break
    try:
      want, hf_sec = timed(hf_beams(hf, prompts, args.new, k, cache))
    except Exception as e:  # pylint: disable=broad-except
      emit(f"| {label} | failed: {type(e).__name__}: {str(e).splitlines()[0][:120]} | | | |")
      continue
    if cache is None:
      same = sum(a == b for a, b in zip(ours, want))
      prefix = np.median(common.matched_prefix(ours, want))
      emit(f"| jax_paged.beam_search | {sec * 1e3:.1f} | {rate:,.0f} | {same} of "
           f"{args.batch} (median common prefix {prefix:.0f}) | "
           f"{report.peak_pages_in_use} (unshared {unshared}) |")
    emit(f"| {label} | {hf_sec * 1e3:.1f} | {args.batch * k * args.new / hf_sec:,.0f} | | |")
  with open(os.path.join(common.out_dir(), "bench_beam.md"), "w") as f:
    f.write("\n".join(lines) + "\n")


if __name__ == "__main__":
  main()
