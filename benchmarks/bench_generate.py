"""End-to-end generation throughput: the paged engine vs a contiguous cache vs Hugging Face.

GPT-2 124M with random weights, bf16, greedy (unless `--sampling` says otherwise), EOS
ignored. Two workloads:

* mixed: 256 requests, prompt lengths uniform in 32..512, 256 new tokens each. The engine
  and a classic contiguous max-length KV cache in JAX (static batches, every sequence
  reserving prompt_max + new tokens) get the SAME KV memory; the pool simply fits more
  sequences. Also swept over the engine's batch capacity (PNG), and with
  `--cache-dtypes bfloat16 int8` over KV cache dtypes at the same KV bytes (an int8 pool,
  scales included, holds 1.88x the pages at GPT-2's head dim 64).
* fixed: batch 128, prompt 256, 256 new tokens: the engine vs Hugging Face transformers'
  `generate` with `cache_implementation="static"` (torch.compile'd; warmed up on the same
  shapes) and with the default dynamic cache. `--sampling temperature top-p top-k` adds
  the engine and Hugging Face's static cache drawing with those settings (`SAMPLINGS`).

Each figure is the median of three timed runs after an identical untimed one, so
compilation is excluded.

    PYTHONPATH=. python benchmarks/bench_generate.py            # on the GPU
    PYTHONPATH=. python benchmarks/bench_generate.py --tiny     # smoke test on CPU
"""

from __future__ import annotations

import argparse
import functools
import os
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from benchmarks import common
from jax_paged import Engine, Request
from jax_paged import pool as pool_lib
from models import gpt2


def timed(fn, before=None, runs: int = 3):
  """(result, seconds) of the median (by time) of `runs` identical calls after an untimed
  one (which compiles); `before` (untimed) runs ahead of each: an engine's
  `reset_prefix_cache`, or a timed call would find every prompt cached by the one before.
  One run of the mixed workload varied ~7% from process to process (H100, bf16 71.7k vs
  76.9k new tokens/s)."""
  results = []
  for i in range(runs + 1):
    if before is not None:
      before()
    start = time.perf_counter()
    result = fn()
    if i:
      results.append((time.perf_counter() - start, result))
  seconds, result = sorted(results, key=lambda r: r[0])[runs // 2]
  return result, seconds


# ----------------------------------------------------------------- contiguous baseline
def contiguous_generate(model: gpt2.GPT2LMHeadModel, prompts: list[list[int]], new: int,
                        batch: int, max_len: int) -> list[list[int]]:
  """Static batches of `batch` sequences over a contiguous [layers, B, max_len, H, D] cache,
  the classic Flax decoding loop (prefill, then a jitted scan of greedy decode steps)."""
  graphdef, params = nnx.split(model)
  outs = []
  for lo in range(0, len(prompts), batch):
    chunk = prompts[lo:lo + batch]
    lengths = np.zeros((batch,), np.int32)
    tokens = np.zeros((batch, max_len - new), np.int32)
    for i, p in enumerate(chunk):
      tokens[i, :len(p)] = p
      lengths[i] = len(p)
    out = _contiguous_run(graphdef, params, jnp.asarray(tokens), jnp.asarray(lengths),
                          new=new, max_len=max_len)
    outs += np.asarray(out)[:len(chunk)].tolist()
  return outs


def _stack(model, tokens, positions, cache_k, cache_v, attend):
  """The model's own forward pass (`GPT2LMHeadModel._forward`, fused blocks and all) with
  attend(attention layer, layer index, q, k, v, cache_k, cache_v) -> (y [B, T, H, D],
  cache_k, cache_v) in place of the paged attention. Returns (f32 logits, caches)."""
  def attend_contiguous(attn, h, caches, layer):
    q, k, v = attn._project(h)
    y, cache_k, cache_v = attend(attn, layer, q, k, v, *caches)
    return y.reshape(y.shape[:2] + (-1,)), (cache_k, cache_v)

  h, (cache_k, cache_v) = model._forward(tokens, positions, (cache_k, cache_v),
                                         attend_contiguous)
  return model._logits(h), cache_k, cache_v


@functools.partial(jax.jit, static_argnums=0, static_argnames=("new", "max_len"))
def _contiguous_run(graphdef, params, tokens, lengths, *, new: int, max_len: int):
  model = nnx.merge(graphdef, params)
  c = model.config
  b, t = tokens.shape
  rows = jnp.arange(b)
  cache = jnp.zeros((c.n_layer, b, max_len, c.n_head, c.head_dim), model.dtype)

  def attend_prompt(attn, i, q, k, v, ck, cv):
    y = jax.nn.dot_product_attention(q, k, v, scale=attn.scale, is_causal=True,
                                     key_value_seq_lengths=lengths)
    return y, ck.at[i, :, :t].set(k), cv.at[i, :, :t].set(v)

  logits, cache_k, cache_v = _stack(model, tokens, jnp.arange(t)[None], cache, cache,
                                    attend_prompt)
  first = jnp.argmax(logits[rows, lengths - 1], axis=-1).astype(jnp.int32)

  def step(carry, _):
    token, pos, ck, cv = carry

    def attend_cache(attn, i, q, k, v, ck, cv):
      ck, cv = ck.at[i, rows, pos].set(k[:, 0]), cv.at[i, rows, pos].set(v[:, 0])
      y = jax.nn.dot_product_attention(q, ck[i], cv[i], scale=attn.scale,
                                       key_value_seq_lengths=pos + 1)
      return y, ck, cv

    logits, ck, cv = _stack(model, token[:, None], pos[:, None], ck, cv, attend_cache)
    nxt = jnp.argmax(logits[:, 0], axis=-1).astype(jnp.int32)
    return (nxt, pos + 1, ck, cv), nxt

  _, rest = jax.lax.scan(step, (first, lengths, cache_k, cache_v), None, length=new - 1)
  return jnp.concatenate([first[:, None], rest.T], axis=1)


# ----------------------------------------------------------------- Hugging Face
# The fixed workload's sampling settings (`--sampling`), as `Request` takes them.
SAMPLINGS = {"greedy": {}, "temperature": dict(temperature=0.8),
             "top-p": dict(temperature=0.8, top_p=0.95),
             "top-k": dict(temperature=0.8, top_k=50),
             "top-k-top-p": dict(temperature=0.8, top_k=50, top_p=0.95),
             "min-p": dict(temperature=1.0, min_p=0.05),
             # Each token's log-probability too (Hugging Face: `output_logits` and
             # `compute_transition_scores`, normalized).
             "greedy-logprobs": dict(logprobs=True),
             "top-p-logprobs": dict(temperature=0.8, top_p=0.95, logprobs=True),
             # And the 20 most likely tokens' at each step (HF: a top-k of the logits'
             # log_softmax).
             "greedy-top-logprobs": dict(logprobs=True, top_logprobs=20),
             # Penalized: HF's `repetition_penalty`; frequency and presence penalties are
             # OpenAI's / vLLM's, which HF lacks (no HF row).
             "greedy-repetition": dict(repetition_penalty=1.2),
             "top-p-repetition": dict(temperature=0.8, top_p=0.95, repetition_penalty=1.2),
             "greedy-penalties": dict(repetition_penalty=1.2, frequency_penalty=0.5,
                                      presence_penalty=0.5),
             # Logit bias on 8 tokens and min_tokens (HF: `sequence_bias`; its
             # `min_new_tokens` is set on every row already).
             "greedy-logit-bias": dict(logit_bias={t: -5.0 for t in range(8)},
                                       min_tokens=16)}


def hf_generate(config: gpt2.GPT2Config, batch: int, prompt: int, new: int, static: bool,
                **sampling):
  import torch
  import transformers
  hf_config = transformers.GPT2Config(
      vocab_size=config.vocab_size, n_positions=config.n_positions, n_embd=config.n_embd,
      n_layer=config.n_layer, n_head=config.n_head)
  model = transformers.GPT2LMHeadModel(hf_config).to("cuda", torch.bfloat16).eval()
  return hf_tokens_per_s(model, config.vocab_size, batch, prompt, new, static, **sampling)


def hf_tokens_per_s(model, vocab_size: int, batch: int, prompt: int, new: int,
                    static: bool, temperature: float = 0.0, top_k: int = 0,
                    top_p: float = 1.0, min_p: float = 0.0, logprobs: bool = False,
                    top_logprobs: int = 0,
                    repetition_penalty: float = 1.0, logit_bias: dict | None = None,
                    min_tokens: int = 0) -> float:
  """New tokens/s of a Hugging Face causal LM (on "cuda") generating `new` tokens (greedy,
  or sampled with `Request`'s settings) after random prompts of `batch` x `prompt` tokens:
  `generate` with a static cache (which transformers compiles with torch.compile) or the
  dynamic one, the median of three timed calls after an identical one. With `logprobs`,
  each token's log-probability from the logits `generate` returns (and with
  `top_logprobs` the most likely tokens'); with `repetition_penalty`, HF's; with
  `logit_bias`, HF's `sequence_bias` (`min_tokens`: `min_new_tokens` is set anyway)."""
  import torch
  ids = torch.randint(0, vocab_size, (batch, prompt), device="cuda")
  kwargs = dict(max_new_tokens=new, min_new_tokens=new, pad_token_id=0,
                attention_mask=torch.ones_like(ids), do_sample=temperature > 0)
  if temperature > 0:  # (top_k 0: Hugging Face's default of 50 off)
    kwargs.update(temperature=temperature, top_k=top_k, top_p=top_p)
    if min_p:
      kwargs.update(min_p=min_p)
  if repetition_penalty != 1.0:
    kwargs.update(repetition_penalty=repetition_penalty)
  if logit_bias:
    kwargs.update(sequence_bias={(t,): b for t, b in logit_bias.items()})
  if static:
    # transformers compiles the forward with torch.compile itself for a static cache.
    kwargs.update(cache_implementation="static")

  if logprobs:
    kwargs.update(output_logits=True, return_dict_in_generate=True)

  def run():
    with torch.inference_mode():
      out = model.generate(ids, **kwargs)
      if logprobs:
        model.compute_transition_scores(out.sequences, out.logits, normalize_logits=True)
        if top_logprobs:
          torch.stack(out.logits, dim=1).float().log_softmax(-1).topk(top_logprobs)
        out = out.sequences
    torch.cuda.synchronize()
    return out

  out, seconds = timed(run)
  assert out.shape[1] == prompt + new
  return batch * new / seconds


# ----------------------------------------------------------------- main
def plot_sweep(sweep: dict, contiguous_tps: float, contiguous_batch: int, n_req: int) -> None:
  """tokens/s vs the engine's batch capacity, one line per (admission policy, cache
  dtype)."""
  try:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(6, 4))
    for (admission, cache_dtype), points in sweep.items():
      ax.plot(list(points), list(points.values()), "o-",
              label=f"paged engine, {admission}, {cache_dtype.name} cache")
    ax.axhline(contiguous_tps, color="gray", ls="--",
               label=f"contiguous cache, batch {contiguous_batch}")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("engine batch capacity (same KV memory)")
    ax.set_ylabel("new tokens/s")
    ax.set_title(f"GPT-2 generation, {n_req} mixed requests")
    ax.legend()
    fig.tight_layout()
    fig.savefig(os.path.join(common.out_dir(), "generate_throughput.png"), dpi=120)
  except ImportError:
    print("matplotlib missing: no PNG")


def main():
  p = argparse.ArgumentParser()
  p.add_argument("--tiny", action="store_true", help="a tiny model and workload (CPU smoke)")
  p.add_argument("--skip-hf", action="store_true")
  p.add_argument("--skip-mixed", action="store_true", help="only the fixed workload")
  p.add_argument("--skip-fixed", action="store_true", help="only the mixed workload")
  p.add_argument("--cache-dtypes", nargs="+", default=["bfloat16"],
                 help="KV cache dtypes of the mixed workload's engine runs, each given the "
                      "bf16 pool's bytes (bfloat16, int8, float8_e4m3fn)")
  p.add_argument("--admissions", nargs="+", default=["optimistic", "peak"],
                 choices=["optimistic", "peak"], help="the mixed workload's admission policies")
  p.add_argument("--capacities", type=int, nargs="+", help="engine batch capacities to sweep")
  p.add_argument("--steps-per-call", type=int, nargs="+", default=[32, 128],
                 help="engine decode steps per device call, each timed on the fixed workload "
                      "(the best is compared with Hugging Face) and with peak admission on "
                      "the mixed one")
  p.add_argument("--sampling", nargs="+", default=["greedy"], choices=list(SAMPLINGS),
                 help="the fixed workload's sampling settings, each timed for the engine (at "
                      "the best steps per call) and Hugging Face's static cache")
  p.add_argument("--contiguous-batch", type=int, default=64,
                 help="the contiguous baseline's batch; fixes the shared KV memory")
  args = p.parse_args()

  if args.tiny:
    config = gpt2.GPT2Config(vocab_size=256, n_positions=128, n_embd=64, n_layer=2, n_head=4)
    n_req, lo, hi, new, fixed = 24, 4, 32, 16, (8, 16, 16)
    dtype, page_size, capacities = jnp.float32, 8, [8, 16]
    args.contiguous_batch, args.skip_hf = 8, True
  else:
    config = gpt2.GPT2Config()
    n_req, lo, hi, new, fixed = 256, 32, 512, 256, (128, 256, 256)
    dtype, page_size, capacities = jnp.bfloat16, 16, [32, 64, 128, 256]
  capacities = args.capacities or capacities
  model = gpt2.GPT2LMHeadModel(config, dtype=dtype, rngs=nnx.Rngs(0))
  rng = np.random.default_rng(0)
  prompts = [rng.integers(0, config.vocab_size, rng.integers(lo, hi + 1)).tolist()
             for _ in range(n_req)]
  max_len = hi + new
  kv_slots = args.contiguous_batch * max_len  # the shared KV memory, in token slots
  num_pages = kv_slots // page_size
  page_bytes = lambda cache_dtype: pool_lib.size_pool(  # all layers, K + V, scales
      num_layers=config.n_layer, num_kv_heads=config.n_head, head_dim=config.head_dim,
      page_size=page_size, dtype=cache_dtype, available_bytes=1 << 40).bytes_per_page
  kv_bytes = num_pages * page_bytes(dtype)  # the contiguous cache's, in the compute dtype
  pages_of = {jnp.dtype(name): kv_bytes // page_bytes(name) for name in args.cache_dtypes}
  lines = [f"# bench_generate: {common.header()}", "",
           f"GPT-2 {config.n_layer}L/{config.n_embd}, {jnp.dtype(dtype).name}, greedy "
           "(but the rows that name sampling settings)."]
  if not args.skip_mixed:
    lines += [f"Mixed: {n_req} requests, prompts {lo}..{hi}, {new} new; KV memory {kv_slots} "
              f"token slots ({kv_bytes / 2**20:.0f} MiB) for both paged ({num_pages} pages of "
              f"{page_size}) and contiguous (batch {args.contiguous_batch} x {max_len}); other "
              "cache dtypes get the same bytes: "
              + ", ".join(f"{dt.name} {n} pages" for dt, n in pages_of.items()) + ".", "",
              "| system | cache | batch capacity | time (s) | new tokens/s | decode steps | "
              "sequences per step | ms per step | prefill s | preemptions |",
              "|---|---|---|---|---|---|---|---|---|---|"]
  total = n_req * new
  print("\n".join(lines), flush=True)

  def emit(line: str) -> None:
    lines.append(line)
    print(line, flush=True)

  def emit_all(new_lines: list[str]) -> None:
    for line in new_lines:
      emit(line)

  if not args.skip_mixed:
    contiguous, sec = timed(lambda: contiguous_generate(model, prompts, new,
                                                        args.contiguous_batch, max_len))
    contiguous_tps = total / sec
    emit(f"| contiguous cache (JAX, static batches) | {jnp.dtype(dtype).name} | "
         f"{args.contiguous_batch} | {sec:.2f} | {contiguous_tps:,.0f} | | | | | |")

    sweep = {}  # (admission, cache dtype) -> capacity -> best tokens/s
    runs = {}  # (cache dtype, admission, capacity, steps per call) -> (tokens/s, report, outs)
    # Optimistic admission at the default 32 steps per call; peak admission (the better one
    # here) at the two largest capacities and every --steps-per-call.
    configs = ([("optimistic", cap, 32) for cap in capacities]
               + [("peak", cap, spc) for cap in capacities[-2:] for spc in args.steps_per_call])
    for cache_dtype in pages_of:
      for admission, cap, spc in configs:
        if admission not in args.admissions:
          continue
        eng = Engine(model, max_batch=cap, num_pages=pages_of[cache_dtype],
                     page_size=page_size, steps_per_call=spc, admission=admission,
                     cache_dtype=cache_dtype)
        (outs, r), sec = timed(lambda: eng.generate([Request(p, new) for p in prompts]),
                               before=eng.reset_prefix_cache)
        runs[cache_dtype, admission, cap, spc] = (total / sec, r, outs)
        points = sweep.setdefault((admission, cache_dtype), {})
        points[cap] = max(points.get(cap, 0.0), total / sec)
        emit(f"| paged engine, {admission} admission, {spc} steps per call | "
             f"{cache_dtype.name} | {cap} | {sec:.2f} | {total / sec:,.0f} | "
             f"{r.decode_steps} | {r.decode_tokens / r.decode_steps:.1f} | "
             f"{1e3 * r.decode_s / r.decode_steps:.2f} | {r.prefill_s:.2f} | "
             f"{r.preemptions} |")
    best_of = {}  # cache dtype -> its best run's key
    for key in runs:
      if key[0] not in best_of or runs[key][0] > runs[best_of[key[0]]][0]:
        best_of[key[0]] = key
    for cache_dtype, best in best_of.items():
      tps, report, outs = runs[best]
      agree = np.mean([a[:8] == b[:8] for a, b in zip(outs, contiguous)])
      label = (f"{cache_dtype.name} cache, {best[1]} admission, capacity {best[2]}, {best[3]} "
               "steps per call")
      emit_all(["", f"Paged engine best / contiguous at equal KV memory: "
                f"**{tps / contiguous_tps:.2f}x** ({label}). First 8 tokens agree with "
                f"the contiguous run on {agree:.0%} of requests (bf16 ties and a quantized "
                "cache may differ).", "",
                f"Engine report ({label}, timed run):", "", "```", str(report), "```"])
    bf16 = jnp.dtype(jnp.bfloat16)
    if bf16 in best_of:
      for cache_dtype, best in best_of.items():
        if cache_dtype != bf16:
          emit_all(["", f"{cache_dtype.name} cache best / bf16 cache best at equal KV "
                    f"memory: **{runs[best][0] / runs[best_of[bf16]][0]:.2f}x**."])
    plot_sweep(sweep, contiguous_tps, args.contiguous_batch, n_req)

  if args.skip_fixed:
    write_lines(lines)
    return

  b, prompt_len, new_f = fixed
  fixed_prompts = [rng.integers(0, config.vocab_size, prompt_len).tolist() for _ in range(b)]
  emit_all(["", f"Fixed: batch {b}, prompt {prompt_len}, {new_f} new tokens.", "",
            "| system | new tokens/s | ours / it |", "|---|---|---|"])

  def engine_tps(steps_per_call: int, **sampling) -> float:
    eng = Engine(model, max_batch=b, num_pages=b * -(-(prompt_len + new_f) // page_size),
                 page_size=page_size, steps_per_call=steps_per_call)
    requests = [Request(p, new_f, seed=i, **sampling) for i, p in enumerate(fixed_prompts)]
    _, sec = timed(lambda: eng.generate(requests), before=eng.reset_prefix_cache)
    return b * new_f / sec

  def hf_rows(ours: float, systems, **sampling) -> None:
    for name, static in systems:
      try:
        tps = hf_generate(config, b, prompt_len, new_f, static, **sampling)
        emit(f"| {name} | {tps:,.0f} | {ours / tps:.2f} |")
      except Exception as e:  # report, don't hide: the table says what failed
        emit(f"| {name} | failed: {type(e).__name__}: {str(e)[:120]} | |")

  best = {spc: engine_tps(spc) for spc in args.steps_per_call}
  for spc, tps in best.items():
    emit(f"| paged engine, {spc} steps per call | {tps:,.0f} | |")
  greedy = max(best.values())
  static_hf = ("HF transformers, static cache + torch.compile", True)
  if not args.skip_hf:
    hf_rows(greedy, (static_hf, ("HF transformers, dynamic cache", False)))
  for name in args.sampling:
    if name == "greedy":
      continue
    settings = SAMPLINGS[name]
    ours = engine_tps(max(best, key=best.get), **settings)
    label = ", ".join(f"{k} {v}" for k, v in settings.items())
    emit(f"| paged engine, {label} ({ours / greedy:.2f}x greedy) | {ours:,.0f} | |")
    if not args.skip_hf and not {"frequency_penalty", "presence_penalty"} & set(settings):
      hf_rows(ours, [(f"{static_hf[0]}, {label}", True)], **settings)

  write_lines(lines)


def write_lines(lines: list[str]) -> None:
  with open(os.path.join(common.out_dir(), "bench_generate.md"), "w") as f:
    f.write("\n".join(lines) + "\n")


if __name__ == "__main__":
  main()
