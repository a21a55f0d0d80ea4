"""Prompt scoring: every prompt token's log-probability (`Request(prompt_logprobs=True)`,
vLLM's prompt_logprobs) vs Hugging Face's forward over the same batch.

GPT-2 124M with random weights, bf16: `--batch` prompts of `--prompt` random tokens, one
new token each (a scoring request). The engine with prompt_logprobs (and with
top_logprobs 5 too), and without (the prefill alone: what scoring adds is the LM head over
every token and its log-softmax); Hugging Face's `GPT2LMHeadModel` forward in bf16 (SDPA
attention) followed by a float32 log_softmax and a gather of each next token's, in
batches of `--hf-batch` (its logits for the whole batch at once would need
batch x prompt x 50257 x 6 bytes). Each figure is the median of three timed runs after an
identical untimed one; prompt tokens scored per second.

    PYTHONPATH=. python benchmarks/bench_score.py            # on the GPU
    PYTHONPATH=. python benchmarks/bench_score.py --tiny     # smoke test on CPU
"""

from __future__ import annotations

import argparse
import os

import jax.numpy as jnp
import numpy as np
from flax import nnx

from benchmarks import common
from benchmarks.bench_generate import timed
from jax_paged import Engine, Request
from models import gpt2


def engine_scores(engine: Engine, prompts: list[list[int]], top_logprobs: int = 0,
                  score: bool = True) -> list[tuple]:
  """Each prompt's `TokenEvent.prompt_logprobs` (None without `score`)."""
  first = {}
  engine.generate([Request(p, 1, prompt_logprobs=score, top_logprobs=top_logprobs)
                   for p in prompts],
                  on_token=lambda e: first.setdefault(e.request_id, e.prompt_logprobs))
  return [first[i] for i in range(len(prompts))]


def hf_scores(config: gpt2.GPT2Config, prompts: np.ndarray, hf_batch: int):
  """A function running Hugging Face's GPT-2 (random weights, bf16, on "cuda") over
  `prompts` [B, T] and returning each next token's log-probability, float32 [B, T - 1]."""
  import torch
  import transformers
  hf_config = transformers.GPT2Config(
      vocab_size=config.vocab_size, n_positions=config.n_positions, n_embd=config.n_embd,
      n_layer=config.n_layer, n_head=config.n_head)
  model = transformers.GPT2LMHeadModel(hf_config).to("cuda", torch.bfloat16).eval()
  ids = torch.as_tensor(prompts, device="cuda")

  def run():
    out = []
    with torch.inference_mode():
      for chunk in ids.split(hf_batch):
        logits = model(chunk).logits[:, :-1].float()
        out.append(logits.log_softmax(-1).gather(-1, chunk[:, 1:, None])[..., 0])
      torch.cuda.synchronize()
    return torch.cat(out)

  return run


def main():
  p = argparse.ArgumentParser()
  p.add_argument("--tiny", action="store_true", help="a tiny model and workload (CPU smoke)")
  p.add_argument("--batch", type=int, default=64)
  p.add_argument("--prompt", type=int, default=512)
  p.add_argument("--hf-batch", type=int, default=16)
  args = p.parse_args()
  if args.tiny:
    config = gpt2.GPT2Config(vocab_size=256, n_positions=128, n_embd=64, n_layer=2, n_head=4)
    args.batch, args.prompt, dtype, page_size = 6, 40, jnp.float32, 8
  else:
    config, dtype, page_size = gpt2.GPT2Config(), jnp.bfloat16, 16
  model = gpt2.GPT2LMHeadModel(config, dtype=dtype, rngs=nnx.Rngs(0))
  rng = np.random.default_rng(0)
  prompts = rng.integers(0, config.vocab_size, (args.batch, args.prompt))
  scored = args.batch * (args.prompt - 1)
  pages = args.batch * -(-args.prompt // page_size)
  engine = Engine(model, max_batch=args.batch, num_pages=pages, page_size=page_size,
                  prefix_caching=False)
  lines = [f"# bench_score: {common.header()}", "",
           f"GPT-2 {config.n_layer}L/{config.n_embd}, {jnp.dtype(dtype).name}: {args.batch} "
           f"prompts of {args.prompt} random tokens, one new token each; prompt tokens "
           "scored per second (median of 3).", "",
           "| system | time (ms) | prompt tokens/s |", "|---|---|---|"]
  emit = common.emitter(lines)
  print("\n".join(lines), flush=True)
  as_lists = prompts.tolist()
  for label, top, score in (("paged engine, prompt_logprobs", 0, True),
                            ("paged engine, prompt_logprobs + top_logprobs 5", 5, True),
                            ("paged engine, prefill only (no scores)", 0, False)):
    _, sec = timed(lambda: engine_scores(engine, as_lists, top, score))
    emit(f"| {label} | {sec * 1e3:.1f} | {scored / sec:,.0f} |")
  if not args.tiny:
    hf = hf_scores(config, prompts, args.hf_batch)
    _, sec = timed(hf)
    emit(f"| Hugging Face forward + log_softmax (bf16, batches of {args.hf_batch}) | "
         f"{sec * 1e3:.1f} | {scored / sec:,.0f} |")
  with open(os.path.join(common.out_dir(), "bench_score.md"), "w") as f:
    f.write("\n".join(lines) + "\n")


if __name__ == "__main__":
  main()
