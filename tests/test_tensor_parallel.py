"""Tensor parallelism (`jax_paged.tensor_parallel`, `Engine(mesh=...)`) on 4 fake CPU devices.

The checks run in subprocesses started with XLA_FLAGS=--xla_force_host_platform_device_count=4
(the device count is fixed when jax starts, so the main pytest process keeps its one
device): this file is also their script (`python tests/test_tensor_parallel.py CASE`),
each case printing one JSON object that the tests below assert on. On a host with two
GPUs, `test_two_gpus_match_one_gpu` runs the engine case in the main process on them.
"""

from __future__ import annotations

import functools
import json
import os
import re
import subprocess
import sys

import numpy as np
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@functools.lru_cache(maxsize=None)
def _run_case(case: str) -> dict:
  # (With conftest's flags for a fast CPU compile: the cases are compile-bound.)
  env = dict(os.environ, PYTHONPATH=ROOT, JAX_PLATFORMS="cpu",
             XLA_FLAGS=" ".join([os.environ.get("XLA_FLAGS", ""),
                                 "--xla_force_host_platform_device_count=4"]).strip())
  out = subprocess.run([sys.executable, os.path.abspath(__file__), case], env=env, cwd=ROOT,
                       capture_output=True, text=True, timeout=600)
  assert out.returncode == 0, out.stderr[-4000:]
  return json.loads(out.stdout.strip().splitlines()[-1])


# ----------------------------------------------------------------- the tests (main process)

@pytest.mark.parametrize("model", ["gpt2", "llama"])
def test_engine_tokens_match_one_device(model):
  """Continuous batching with preemption, prefix caching and parallel samples (forks):
  TP 2 gives one device's greedy tokens (TP 4 runs the forwards only: the engine around
  them does not depend on the device count, and its runs are most of this case's time)."""
  result = _run_case("engine")[model]
  assert result["preemptions"] > 0 and result["cached_prompt_tokens"] > 0  # exercised
  ref = result["tokens"]["1"]
  assert any(len(t) for t in ref)
  assert re.fullmatch("[a-d]{3,10}", bytes(ref[-1]).decode())  # the guided request
  assert result["tokens"]["2"] == ref
  if model == "llama":
    # Draft-model speculation at TP 2 (the model its own draft): the same tokens, drafts
    # kept.
    assert result["drafted_tokens"] == ref and result["accepted_tokens"] > 0
  if model == "gpt2":
    # Speculative decoding at TP 2: the same tokens, drafts kept.
    assert result["speculative_tokens"] == ref and result["accepted_tokens"] > 0
    # Beam search at TP 2: the same hypotheses, scores within 1e-5.
    ref, got = result["beams"]["1"], result["beams"]["2"]
    assert [b[0] for b in got] == [b[0] for b in ref]
    np.testing.assert_allclose([b[1] for b in got], [b[1] for b in ref], rtol=1e-5)
  # Log-probabilities (a greedy request's, two samples' with their top 3): TP's f32 within
  # 1e-5 of one device's, the same most likely tokens.
  ref = sorted(result["logprobs"]["1"], key=lambda e: e[:2])
  assert len(ref) == 14 + 2 * 8 and any(e[3] for e in ref)
  got = sorted(result["logprobs"]["2"], key=lambda e: e[:2])
  assert [e[:2] for e in got] == [e[:2] for e in ref]
  np.testing.assert_allclose([e[2] for e in got], [e[2] for e in ref], atol=1e-5)
  assert [[t for t, _ in e[3] or ()] for e in got] == [[t for t, _ in e[3] or ()]
                                                        for e in ref]
  # The prompt log-probabilities of request 3 (13 tokens, the top 2 at each) alike.
  (ref,) = result["prompt_logprobs"]["1"]
  assert ref[0] == 3 and len(ref[1]) == 12
  (got,) = result["prompt_logprobs"]["2"]
  np.testing.assert_allclose(got[1], ref[1], atol=1e-5)
  assert [[t for t, _ in top] for top in got[2]] == [[t for t, _ in top] for top in ref[2]]


@pytest.mark.parametrize("model", ["gpt2", "llama"])
def test_logits_and_pool_match_one_device(model):
  """Prefill, a decode step and a prefill over the cached tokens (start): f32 logits within
  1e-5 of one device's, and the gathered pool within 1e-6 of one device's pool (relative:
  the normalised K of Qwen3's heads is f32 rounding apart); with an int8 pool (scales
  split by kv head) as well, at TP 2."""
  result = _run_case("engine")[model]
  for prefix, n in (("", "2"), ("", "4"), ("int8_", "2")):
    for step, err in result[prefix + "logit_errors"][n].items():
      assert err < 1e-5, (prefix, n, step, err)
    assert result[prefix + "pool_errors"][n] < 1e-6, (prefix, n)
  assert result["int8_code_steps"] == {"2": 0}


@pytest.mark.parametrize("model", ["gpt2", "llama"])
def test_pool_kv_is_sharded_by_kv_head(model):
  result = _run_case("engine")[model]
  layers, hkv, rest = result["pool_shape"][0], result["pool_shape"][1], result["pool_shape"][2:]
  for prefix, n in (("", "2"), ("", "4"), ("int8_", "2")):
    shards = result[prefix + "shards"][n]
    assert len(shards) == int(n) and len({s["device"] for s in shards}) == int(n)
    for i, s in enumerate(sorted(shards, key=lambda s: s["start"])):
      assert s["shape"] == [layers, hkv // int(n)] + rest  # only its kv heads
      assert s["start"] == i * hkv // int(n)
    assert result[prefix + "replicated"][n]  # page table, lengths, free stack, refcounts


@pytest.mark.parametrize("model", ["gpt2", "llama"])
def test_lora_adapters_match_one_device(model):
  """A batch mixing two LoRA adapters and the base model: TP 2's greedy tokens are one
  device's (B's columns reordered with the fused q/k/v and gate/up columns), and differ
  from the base model's; with int8 weights as well."""
  result = _run_case("lora")[model]
  assert result["2"] == result["1"]
  assert result["1"][0] != result["1"][1]  # the same prompt under adapter a and none
  assert result["int8_2"] == result["int8_1"]  # int8 weights: their scales split too


def test_fewer_kv_heads_than_devices_are_replicated():
  """One kv head (MQA) at TP 2 and 4, two at TP 4: each device holds a copy of the kv head
  its q heads read (`pool_kv_heads`), and the engine's greedy tokens (MQA's with a LoRA
  adapter on q / k / v / o and the MLP too) and three forwards' logits are one device's;
  the pool's copies of a head hold that head's K / V."""
  result = _run_case("replicated")
  for name, res in result.items():
    hkv = res["kv_heads"]
    for n, got in res["runs"].items():
      assert got["tokens"] == res["runs"]["1"]["tokens"], (name, n)
      assert got.get("lora_tokens") == res["runs"]["1"].get("lora_tokens"), (name, n)
      assert max(got["logit_errors"].values()) < 1e-5, (name, n)
      assert got["pool_heads"] == max(hkv, int(n)), (name, n)
      assert got["shard_heads"] == [max(hkv, int(n)) // int(n)] * int(n), (name, n)
      assert got["copies_error"] < 1e-6, (name, n)
  # (The adapter changes the tokens: its columns were applied, not dropped.)
  assert result["hkv1"]["runs"]["1"]["lora_tokens"] != result["hkv1"]["base_tokens"]


def test_alibi_slopes_are_split_with_the_heads():
  """BLOOM (ALiBi): each device's slopes are its q heads' (6 heads' slopes, not one
  geometric sequence), so TP 2 gives one device's tokens and TP 2 / 3 its logits."""
  result = _run_case("alibi")
  assert result["shard_slopes"] == [[0, 1, 2], [3, 4, 5]]
  assert result["tokens"]["2"] == result["tokens"]["1"] and any(result["tokens"]["1"])
  for n in ("2", "3"):
    assert max(result["logit_errors"][n].values()) < 1e-5, n


def test_gpt_oss_sinks_and_expert_biases_split():
  """GPT-OSS (random biases and sinks): each device's sinks are its q heads', its share
  of the experts' gate / up biases their columns', the down biases added once after the
  sum: TP 2 / 4 give one device's logits (TP 4 replicating the 2 kv heads) and tokens."""
  result = _run_case("gpt_oss")
  assert result["shard_sinks"] == [[0, 1, 2, 3], [4, 5, 6, 7]]
  assert result["tokens"]["2"] == result["tokens"]["1"] and any(result["tokens"]["1"])
  for n in ("2", "4"):
    assert max(result["logit_errors"][n].values()) < 1e-5, n


def test_glm4_moe_grouped_router_and_shared_expert_split():
  """GLM-4.5 (DeepSeek's grouped sigmoid router, replicated with its correction bias; a
  shared expert; q / k norms and biases split by head): TP 2 / 4 give one device's logits
  and tokens."""
  result = _run_case("glm4_moe")
  assert result["tokens"]["2"] == result["tokens"]["1"] and any(result["tokens"]["1"])
  for n in ("2", "4"):
    assert max(result["logit_errors"][n].values()) < 1e-5, n


@pytest.mark.parametrize("model", ["glm4", "ernie4_5"])
def test_glm_reordered_rope_rows_biases_and_post_norms_split(model):
  """GLM-4-0414 (q / k rows reordered within each head, biases, post norms) and ERNIE 4.5
  (all of each head reordered; biases on every projection, o's and down's in the
  row-parallel layers): TP 2 / 4 give one device's logits and tokens."""
  result = _run_case("glm")[model]
  assert result["tokens"]["2"] == result["tokens"]["1"] and any(result["tokens"]["1"])
  for n in ("2", "4"):
    assert max(result["logit_errors"][n].values()) < 1e-5, n


def test_the_model_is_left_unchanged():
  for model in ("gpt2", "llama"):
    assert _run_case("engine")[model]["model_unchanged"]


def test_pallas_kernels_per_device_in_interpret_mode():
  """Every kernel (cache write, fused projection-write, paged decode and prefill
  attention, the decode reservation with copy-on-write, the linear and norm kernels) in
  Pallas interpret mode under shard_map: TP 2 matches one device (GPT-NeoX's parallel
  residual, LayerNorms, plain MLP and random biases: a row-parallel projection's added
  once; StableLM's per-head q / k norm weights split by head)."""
  result = _run_case("kernels")
  for model in ("gpt2", "llama", "gemma3", "gpt_neox", "stablelm"):
    assert result[model]["tokens"]["2"] == result[model]["tokens"]["1"], model
    assert result[model]["logit_error"] < 1e-5, model


def test_errors_name_the_numbers():
  errors = _run_case("errors")
  assert "num_kv_heads=6" in errors["kv_heads"] and "divisor" in errors["kv_heads"]
  assert "num_kv_heads=6" in errors["gpt2_heads"]  # GPT-2: one kv head per head
  assert "(90, 90)" in errors["mlp_width"] and "multiple of 4" in errors["mlp_width"]
  assert "tensor_parallel=8" in errors["devices"] and "4 cpu device" in errors["devices"]
  assert "tensor_parallel_splits" in errors["no_splits"]
  assert "'tp'" in errors["axis"]
  assert "normalises q and k over all heads together" in errors["olmoe"]


def test_cli_tensor_parallel():
  result = _run_case("cli")
  assert result["rc"] == 0 and result["tokens_1"] == result["tokens_2"]
  # Tensor parallel builds the model on the host, so no GPU holds all of it.
  assert result["built_on"] == [None, "cpu"]
  assert result["rc_too_many"] == 2 and "tensor_parallel=8" in result["err_too_many"]
  assert not result["built_too_many"]  # refused before loading a model


def test_pool_sized_by_the_device_with_least_memory():
  result = _run_case("sizing")
  assert result["devices"] == [0, 1, 2, 3]
  assert result["num_pages"] == result["least"]


@pytest.mark.gpu
def test_two_gpus_match_one_gpu():
  """On two GPUs of one host (skipped with fewer), in this process: the Triton kernels
  (heads of 64) per GPU under shard_map and XLA's all-reduces between them. TP 2's greedy
  tokens equal one GPU's, its logits and pool are within f32 tolerance (an int8 pool's
  codes within one step), and each GPU holds half the kv heads."""
  import jax
  if len(jax.devices()) < 2:
    pytest.skip("needs two GPUs")
  with jax.default_matmul_precision("highest"):  # no TF32: the f32 tolerance holds
    result = case_engine(sizes=(1, 2), head_dim=64)
  for name, res in result.items():
    assert res["preemptions"] > 0 and res["cached_prompt_tokens"] > 0, name
    assert res["tokens"]["2"] == res["tokens"]["1"], name
    if name == "gpt2":
      assert res["speculative_tokens"] == res["tokens"]["1"], name
    for step, err in res["logit_errors"]["2"].items():
      assert err < 1e-5, (name, step, err)
    assert res["pool_errors"]["2"] < 1e-5 and res["int8_pool_errors"]["2"] < 1e-5, name
    # An int8 pool: a K / V value that TP's summation order moves across a rounding
    # boundary stores one code step apart (never more), which moves the logits by more
    # than f32 rounding (bounded here at 1e-2 of their largest).
    assert res["int8_code_steps"]["2"] <= 1, name
    for step, err in res["int8_logit_errors"]["2"].items():
      assert err < 1e-2, (name, step, err)
    hkv = res["pool_shape"][1]
    assert sorted(s["start"] for s in res["shards"]["2"]) == [0, hkv // 2], name
    assert {s["shape"][1] for s in res["shards"]["2"]} == {hkv // 2}, name
    assert len({s["device"] for s in res["shards"]["2"]}) == 2 and res["replicated"]["2"]


def test_moe_with_split_experts_matches_one_device():
  """A Qwen2-MoE's experts split by intermediate column (every expert on every device, a
  quarter of its columns each at TP 4), its shared expert and dense layer's MLP as
  Llama's: TP 2's and 4's tokens are one device's."""
  result = _run_case("moe")
  tokens = result["tokens"]
  assert tokens["2"] == tokens["1"] and tokens["4"] == tokens["1"]
  assert len({t for seq in tokens["1"] for t in seq}) > 3  # not one repeated token
  # int8 weights, the experts' stored [experts, N, K] with [experts, N] scales: TP 2 is
  # TP 1's (which the rounding may move from the float model's).
  assert tokens["int8 2"] == tokens["int8 1"]
  assert result["shards"] == {
      "gate_up/kernel": [4, 12, 64], "gate_up/kernel_scale": [4, 12],
      "down/kernel": [4, 64, 6], "down/kernel_scale": [4, 64],
      "shared/gate_up/kernel": [16, 64], "shared/gate_up/kernel_scale": [16],
      "shared/down/kernel": [64, 8], "shared/down/kernel_scale": [64]}


@pytest.mark.gpu
def test_two_gpus_split_experts_match_one_gpu():
  """On two GPUs (skipped with fewer): the Qwen2-MoE of `case_moe` at heads of 64, the
  grouped matmul and attention kernels per GPU on its share of every expert: TP 2's
  greedy tokens are one GPU's."""
  import jax
  if len(jax.devices()) < 2:
    pytest.skip("needs two GPUs")
  result = case_moe(sizes=(1, 2), head_dim=64)
  assert result["tokens"]["2"] == result["tokens"]["1"]
  assert result["tokens"]["int8 2"] == result["tokens"]["int8 1"]
  assert result["shards"]["gate_up/kernel"] == [4, 24, 64]


def test_make_mesh_needs_the_devices():
  """In this (one-device) process."""
  from jax_paged import tensor_parallel
  with pytest.raises(ValueError, match="tensor_parallel=2 needs that many devices"):
    tensor_parallel.make_mesh(2)
  with pytest.raises(ValueError, match="positive int"):
    tensor_parallel.make_mesh(0)


# ------------------------------------------------------ the cases (subprocesses, 4 devices)

def _models(head_dim: int | None = None):
  """A GPT-2 and a GQA Llama (Qwen3's), f32, random. `head_dim` (64 on a GPU, where
  smaller heads take the plain-XLA attention, not the kernels): the heads' width; None:
  the CPU cases' small heads (16 and 8)."""
  import jax
  import jax.numpy as jnp
  from flax import nnx
  from models import gpt2, llama
  g = gpt2.GPT2LMHeadModel(gpt2.GPT2Config(vocab_size=256, n_positions=128,
                                           n_embd=4 * (head_dim or 16), n_layer=1, n_head=4,
                                           bos_token_id=None, eos_token_id=None),
                           dtype=jnp.float32, rngs=nnx.Rngs(0))
  # GQA: 8 q heads sharing 4 kv heads (2 per group), biases on q/k/v/o and each head of q
  # and k RMS-normalised (Qwen3-style; the norms' weights made unequal).
  l = llama.LlamaForCausalLM(llama.LlamaConfig(vocab_size=256, hidden_size=64,
                                               intermediate_size=96, num_hidden_layers=2,
                                               num_attention_heads=8, num_key_value_heads=4,
                                               head_dim=head_dim, attention_bias=True,
                                               max_position_embeddings=128,
                                               model_type="qwen3", eos_token_id=None),
                             dtype=jnp.float32, rngs=nnx.Rngs(1))
  for layer in l.layers:
    for i, norm in enumerate((layer.self_attn.q_norm, layer.self_attn.k_norm)):
      norm.weight[...] = jax.random.uniform(jax.random.key(i), norm.weight.shape,
                                            minval=0.5, maxval=1.5)
  return {"gpt2": g, "llama": l}


def _requests():
  from jax_paged import Guide, Request, Vocabulary
  rng = np.random.default_rng(0)
  shared = rng.integers(0, 256, 16).tolist()  # two full pages of 8: prefix cache hits
  prompts = [shared + rng.integers(0, 256, k).tolist() for k in (3, 9, 5)]
  prompts += [rng.integers(0, 256, 13).tolist()]
  # Requests 1 and 2 penalized: their contexts and counts through the shard_map; request
  # 3 scores its prompt (the LM head over every prompt token in it).
  reqs = [Request(p, 14, logprobs=i == 0, frequency_penalty=0.7 * (i == 1),
                  repetition_penalty=1.3 if i == 2 else 1.0, prompt_logprobs=i == 3,
                  top_logprobs=2 * (i == 3)) for i, p in enumerate(prompts)]
  reqs.append(Request(shared + [7, 7, 7], 8, n=2, temperature=0.8, seed=5,  # forks
                      logprobs=True, top_logprobs=3))
  # A guided one: the guides' table replicated through the shard_map.
  guide = Guide.from_regex(r"[a-d]{3,12}", Vocabulary.of_bytes())
  reqs.append(Request(rng.integers(0, 256, 4).tolist(), 10, temperature=0.8, seed=2,
                      guide=guide))
  return reqs


def _engine(model, mesh, **kwargs):
  from jax_paged import Engine
  return Engine(model, max_batch=6, num_pages=8, page_size=8, steps_per_call=8,
                mesh=mesh, **kwargs)


def _forwards(runner, dtype) -> tuple[dict, object]:
  """A prefill, a decode step and a prefill over the cached tokens (start) into a fresh
  pool of `dtype` (None: the model's): ({step: logits}, the pool they leave)."""
  kv = runner.create_pool(num_pages=16, page_size=8, max_seqs=3, max_pages_per_seq=8,
                          dtype=dtype)
  rng = np.random.default_rng(1)
  tok = rng.integers(0, 256, (3, 16)).astype(np.int32)
  lengths = np.array([16, 5, 11], np.int32)
  ids = np.arange(3, dtype=np.int32)
  logits = {}
  logits["prefill"], kv = runner.prefill(kv, tok, lengths, ids)
  logits["decode"], kv = runner.decode(kv, tok[:, 0], ids)
  logits["prefill_start"], kv = runner.prefill(kv, tok, lengths, ids, np.asarray(kv.lengths))
  return {k: np.asarray(v) for k, v in logits.items()}, kv


def case_engine(sizes=(1, 2, 4), head_dim: int | None = None) -> dict:
  """For each model and TP size in `sizes` (1 first): three forwards' logits and pool
  (f32 and an int8 pool), how the pool is sharded; at TP 1 and 2 the engine's tokens
  (GPT-2's beams and speculative rounds too)."""
  import jax
  from jax_paged import DraftSpeculation, NgramSpeculation, beam_search, tensor_parallel
  from jax_paged.serving.runner import ModelRunner
  out = {}
  for name, model in _models(head_dim).items():
    qkv_before = np.asarray(model.h[0].attn.qkv.kernel[...] if name == "gpt2"
                            else model.layers[0].self_attn.qkv.kernel[...])
    res = {"tokens": {}, "logprobs": {}, "prompt_logprobs": {}}
    ref = {}  # TP 1's logits and pool, by pool dtype
    for n in sizes:
      mesh = None if n == 1 else tensor_parallel.make_mesh(n)
      if n in (1, 2):
        engine = _engine(model, mesh)
        events = []
        tokens, report = engine.generate(_requests(), on_token=events.append)
        res["tokens"][str(n)] = tokens
        res["logprobs"][str(n)] = [[e.request_id, e.sample, e.logprob, e.top_logprobs]
                                   for e in events if e.logprob is not None]
        res["prompt_logprobs"][str(n)] = [[e.request_id, e.prompt_logprobs[1:],
                                           e.prompt_top_logprobs[1:]]
                                          for e in events if e.prompt_logprobs is not None]
        if name == "gpt2":  # beam search: the fork onto the beams' rows
          beams, _ = beam_search(model, [r.prompt for r in _requests()[:3]], 10,
                                 beam_width=3, page_size=8, max_batch=6, mesh=mesh)
          res.setdefault("beams", {})[str(n)] = [[b.tokens, b.score] for hyps in beams
                                                 for b in hyps]
        if name == "gpt2" and n == 2:  # speculative rounds: the verify forward per device
          speculating = _engine(model, mesh, speculation=NgramSpeculation(
              num_tokens=3, min_ngram=1, max_ngram=2))
          res["speculative_tokens"] = speculating.generate(_requests())[0]
          res["accepted_tokens"] = speculating.report.accepted_tokens
        if name == "llama" and n == 2:  # a draft model (itself), split like the target
          speculating = _engine(model, mesh, speculation=DraftSpeculation(model, num_tokens=3))
          res["drafted_tokens"] = speculating.generate(_requests())[0]
          res["accepted_tokens"] = speculating.report.accepted_tokens
        if n == 1:
          res["preemptions"] = report.preemptions
          res["cached_prompt_tokens"] = report.cached_prompt_tokens
      # Logits of the three forwards, and the pool they leave; an int8 pool's too (its
      # scales split by kv head like its pages).
      runner = ModelRunner(model, mesh)
      # (An int8 pool at TP 1 and 2: its scales split like its pages.)
      for dtype in (None, "int8") if n < 4 else (None,):
        logits, kv = _forwards(runner, dtype)
        pages = jax.device_get((kv.k_pages, kv.v_pages))
        # (An int8 pool's scales with the other float / int arrays; its codes apart.)
        pool = jax.device_get((kv.page_table, kv.lengths) + (
            (kv.k_scales, kv.v_scales) if dtype else ()))
        pool, pages = (pool, pages) if dtype else (pool + pages, ())
        prefix = "int8_" if dtype else ""
        if n == 1:
          ref[dtype] = logits, pool, pages
          res["pool_shape"] = list(kv.k_pages.shape)
          continue
        ref_logits, ref_pool, ref_pages = ref[dtype]
        res.setdefault(prefix + "logit_errors", {})[str(n)] = {
            k: float(np.abs(v - ref_logits[k]).max() / np.abs(ref_logits[k]).max())
            for k, v in logits.items()}
        # Relative to each array's largest value (at least 1: exact for the int arrays).
        res.setdefault(prefix + "pool_errors", {})[str(n)] = max(
            float(np.abs(a.astype(np.float64) - b).max() / max(np.abs(b).max(), 1.0))
            for a, b in zip(pool, ref_pool))
        if dtype:  # the largest difference of a K / V code, in quantization steps
          res.setdefault("int8_code_steps", {})[str(n)] = max(
              int(np.abs(a.astype(np.int32) - b).max()) for a, b in zip(pages, ref_pages))
        res.setdefault(prefix + "shards", {})[str(n)] = [
            {"shape": list(s.data.shape), "device": str(s.device),
             "start": s.index[1].start or 0} for s in kv.k_pages.addressable_shards]
        res.setdefault(prefix + "replicated", {})[str(n)] = all(
            x.sharding.is_fully_replicated for x in
            (kv.page_table, kv.lengths, kv.free_pages, kv.num_free, kv.refcounts))
    qkv_after = np.asarray(model.h[0].attn.qkv.kernel[...] if name == "gpt2"
                           else model.layers[0].self_attn.qkv.kernel[...])
    outs = model.h[0].attn.out if name == "gpt2" else model.layers[0].self_attn.out
    res["model_unchanged"] = bool(np.array_equal(qkv_before, qkv_after)
                                  and not hasattr(outs, "reduce_axis"))
    out[name] = res
  return out


def case_replicated() -> dict:
  """Llamas of one kv head (8 q heads) and two: per TP size, the engine's tokens (one kv
  head's with a LoRA adapter too, and at TP 1 without it), three forwards' logits, and
  the pool: its heads, each device's, and the largest difference of a head's copy from
  TP 1's head."""
  import jax
  import jax.numpy as jnp
  from flax import nnx
  from jax_paged import Request, lora, tensor_parallel
  from jax_paged.serving.runner import ModelRunner
  from models import llama
  out = {}
  for hkv, sizes in ((1, (1, 2, 4)), (2, (1, 4))):
    model = llama.LlamaForCausalLM(llama.LlamaConfig(
        vocab_size=256, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
        num_attention_heads=8, num_key_value_heads=hkv, head_dim=8, attention_bias=True,
        max_position_embeddings=128, eos_token_id=None), dtype=jnp.float32,
        rngs=nnx.Rngs(hkv))
    adapter = lora.LoraAdapter.random(model.lora_targets(), rank=4, seed=1, scale=0.3)
    rng = np.random.default_rng(0)
    lora_requests = [Request(rng.integers(0, 256, k).tolist(), 10, lora="a") for k in (5, 11)]
    res = {"kv_heads": hkv, "runs": {}}
    ref = None
    for n in sizes:
      mesh = None if n == 1 else tensor_parallel.make_mesh(n)
      run = {"tokens": _engine(model, mesh).generate(_requests())[0]}
      if hkv == 1:
        engine = _engine(model, mesh, max_loras=1, max_lora_rank=4)
        engine.add_lora("a", adapter)
        run["lora_tokens"] = engine.generate(lora_requests)[0]
      if n == 1:
        res["base_tokens"] = _engine(model, mesh).generate(
            [Request(r.prompt, 10) for r in lora_requests])[0]
      logits, kv = _forwards(ModelRunner(model, mesh), None)
      k, v = (np.asarray(jax.device_get(x)) for x in (kv.k_pages, kv.v_pages))
      if n == 1:
        ref = logits, k, v
      copies = np.repeat(np.arange(hkv), k.shape[1] // hkv)
      run["copies_error"] = float(max(np.abs(k - ref[1][:, copies]).max(),
                                      np.abs(v - ref[2][:, copies]).max()))
      run["logit_errors"] = {key: float(np.abs(x - ref[0][key]).max()
                                        / np.abs(ref[0][key]).max())
                             for key, x in logits.items()}
      run["pool_heads"] = int(k.shape[1])
      run["shard_heads"] = [int(sh.data.shape[1]) for sh in kv.k_pages.addressable_shards]
      res["runs"][str(n)] = run
    out[f"hkv{hkv}"] = res
  return out


def case_alibi() -> dict:
  """A BLOOM of 6 heads of 8: per TP size, the engine's tokens (TP 1 and 2), three
  forwards' logits' largest difference from TP 1's, and (TP 2) each device's slopes as
  indices into the model's."""
  import jax
  import jax.numpy as jnp
  from flax import nnx
  from jax_paged import nn, tensor_parallel
  from jax_paged.serving.runner import ModelRunner
  from models import bloom
  model = bloom.BloomForCausalLM(bloom.BloomConfig(
      vocab_size=256, n_positions=128, n_embd=48, n_layer=2, n_head=6, bos_token_id=None,
      eos_token_id=None), dtype=jnp.float32, rngs=nnx.Rngs(0))
  slopes = list(nn.alibi_slopes(6))
  out = {"tokens": {}, "logit_errors": {}}
  ref = None
  for n in (1, 2, 3):
    mesh = None if n == 1 else tensor_parallel.make_mesh(n)
    if n < 3:
      out["tokens"][str(n)] = _engine(model, mesh).generate(_requests()[:4])[0]
    runner = ModelRunner(model, mesh)
    logits, _ = _forwards(runner, None)
    ref = ref or logits
    out["logit_errors"][str(n)] = {key: float(np.abs(x - ref[key]).max()
                                              / np.abs(ref[key]).max())
                                   for key, x in logits.items()}
    if n == 2:
      sharded = tensor_parallel.shard_model(model, mesh)
      leaf = next(x for path, x in zip(sharded.paths, sharded.leaves)
                  if "alibi_slopes" in jax.tree_util.keystr(path))
      out["shard_slopes"] = [[slopes.index(float(s)) for s in np.asarray(sh.data)]
                             for sh in leaf.addressable_shards]
  return out


def _split_runs(model) -> dict:
  """Per TP size (1, 2, 4) the engine's tokens (TP 1 and 2) and three forwards' logits'
  largest relative difference from TP 1's (f32, highest precision)."""
  import jax
  from jax_paged import tensor_parallel
  from jax_paged.serving.runner import ModelRunner
  out = {"tokens": {}, "logit_errors": {}}
  ref = None
  with jax.default_matmul_precision("highest"):
    for n in (1, 2, 4):
      mesh = None if n == 1 else tensor_parallel.make_mesh(n)
      if n < 4:
        out["tokens"][str(n)] = _engine(model, mesh).generate(_requests()[:4])[0]
      logits, _ = _forwards(ModelRunner(model, mesh), None)
      ref = ref or logits
      out["logit_errors"][str(n)] = {key: float(np.abs(x - ref[key]).max()
                                                / np.abs(ref[key]).max())
                                     for key, x in logits.items()}
  return out


def case_glm4_moe() -> dict:
  """A GLM-4.5 of 8 q heads over 2 kv heads (q / k norms, q / k / v biases), layer 0
  dense, 8 experts in 4 groups with a random correction bias and a shared expert:
  `_split_runs`."""
  from flax import nnx
  from models import glm4_moe
  model = glm4_moe.Glm4MoeForCausalLM(glm4_moe.Glm4MoeConfig(
      vocab_size=256, hidden_size=64, intermediate_size=48, num_hidden_layers=2,
      num_attention_heads=8, num_key_value_heads=2, head_dim=16, num_local_experts=8,
      num_experts_per_tok=2, moe_intermediate_size=24, shared_expert_intermediate_size=24,
      n_group=4, topk_group=2, routed_scaling_factor=2.5, use_qk_norm=True,
      attention_bias=True, max_position_embeddings=128, initializer_range=0.1),
      rngs=nnx.Rngs(0))
  rng = np.random.default_rng(3)
  for path, param in nnx.iter_graph(model):  # (zeros would hide a split)
    if path and path[-1] in ("bias", "correction_bias") and param is not None:
      param[...] = rng.normal(0.0, 0.3, param.shape).astype(np.float32)
  return _split_runs(model)


def case_glm() -> dict:
  """`_split_runs` of a GLM-4-0414 ("glm4": RoPE on half of each head, its q / k rows
  reordered at load; random q / k / v biases and post norms) and an ERNIE 4.5
  ("ernie4_5": RoPE on whole heads; random biases on every projection), both of 8 q heads
  over 2 kv heads."""
  from flax import nnx
  from models import ernie4_5, glm
  shape = dict(vocab_size=256, hidden_size=64, intermediate_size=48, num_hidden_layers=2,
               num_attention_heads=8, num_key_value_heads=2, head_dim=16, rms_norm_eps=1e-5,
               max_position_embeddings=128, initializer_range=0.1, eos_token_id=None)
  out = {}
  for name, config in (("glm4", glm.GlmConfig(**shape, model_type="glm4")),
                       ("ernie4_5", ernie4_5.Ernie4_5Config(**shape, attention_bias=True,
                                                            mlp_bias=True))):
    model = glm.GlmForCausalLM(config, rngs=nnx.Rngs(0))
    rng = np.random.default_rng(3)
    for path, param in nnx.iter_graph(model):  # (zeros and ones would hide a split)
      if path and path[-1] in ("bias", "weight") and param is not None:
        param[...] = rng.normal(1.0, 0.3, param.shape).astype(np.float32)
    out[name] = _split_runs(model)
  return out


def case_gpt_oss() -> dict:
  """A GPT-OSS of 8 q heads over 2 kv heads, 4 experts with random biases, random sinks:
  `_split_runs`, and (TP 2) each device's sinks as indices into the model's."""
  from flax import nnx
  from jax_paged import tensor_parallel
  from models import gpt_oss
  model = gpt_oss.GptOssForCausalLM(gpt_oss.GptOssConfig(
      vocab_size=256, hidden_size=64, intermediate_size=32, num_hidden_layers=2,
      num_attention_heads=8, num_key_value_heads=2, head_dim=16, num_local_experts=4,
      num_experts_per_tok=2, sliding_window=5, max_position_embeddings=128,
      initializer_range=0.1), rngs=nnx.Rngs(0))
  rng = np.random.default_rng(3)
  for path, param in nnx.iter_graph(model):  # (zero biases and sinks would hide a split)
    if path and path[-1] in ("bias", "router_bias", "sinks"):
      param[...] = rng.normal(1.0, 0.5, param.shape).astype(np.float32)
  sinks = [float(s) for s in np.asarray(model.layers[0].self_attn.sinks[...])]
  out = _split_runs(model)
  sharded = tensor_parallel.shard_model(model, tensor_parallel.make_mesh(2))
  leaf = next(x for path, x in zip(sharded.paths, sharded.leaves)
              if tensor_parallel._path(path) == ("layers", 0, "self_attn", "sinks"))
  out["shard_sinks"] = [[sinks.index(float(s)) for s in np.asarray(sh.data)]
                        for sh in leaf.addressable_shards]
  return out


def case_lora() -> dict:
  """Per model, TP 1 and 2: greedy tokens of requests under two random adapters (every
  adapted module) and none, in one batch; the same with int8 weights (`weight_quant`:
  column-parallel scales reordered and split with the columns, row-parallel ones whole)."""
  from flax import nnx
  from jax_paged import Engine, Request, lora, tensor_parallel, weight_quant
  out = {}
  for name, float_model in _models().items():
    rng = np.random.default_rng(0)
    adapters = [lora.LoraAdapter.random(float_model.lora_targets(), rank=rank, seed=rank,
                                        scale=0.3)
                for rank in (4, 2)]
    prompt = rng.integers(0, 256, 11).tolist()
    requests = [Request(prompt, 10, lora="a"), Request(prompt, 10),
                Request(rng.integers(0, 256, 6).tolist(), 10, lora="b"),
                Request(rng.integers(0, 256, 17).tolist(), 10, lora="a")]
    int8 = nnx.clone(float_model)
    weight_quant.quantize_weights(int8)
    out[name] = {}
    for weights, model in (("", float_model), ("int8_", int8)):
      for n in (1, 2):
        engine = Engine(model, max_batch=4, num_pages=16, page_size=8, steps_per_call=8,
                        mesh=None if n == 1 else tensor_parallel.make_mesh(n), max_loras=2,
                        max_lora_rank=4)
        engine.add_lora("a", adapters[0])
        engine.add_lora("b", adapters[1])
        out[name][f"{weights}{n}"] = engine.generate(requests)[0]
  return out


def case_kernels() -> dict:
  """Every kernel in Pallas interpret mode (kernel_mode's None read as True), 1 layer."""
  from jax_paged.kernels import triton_backend
  original = triton_backend.kernel_mode
  triton_backend.kernel_mode = lambda interpret, *, supported=True: original(
      True if interpret is None else interpret, supported=supported)
  import jax
  import jax.numpy as jnp
  from flax import nnx
  from jax_paged import Request, tensor_parallel
  from jax_paged.serving.runner import ModelRunner
  from models import gemma3, gpt2, gpt_neox, llama, stablelm
  models = {
      "gpt2": gpt2.GPT2LMHeadModel(gpt2.GPT2Config(vocab_size=256, n_positions=64, n_embd=64,
                                                   n_layer=1, n_head=4, bos_token_id=None,
                                                   eos_token_id=None),
                                   dtype=jnp.float32, rngs=nnx.Rngs(0)),
      "llama": llama.LlamaForCausalLM(llama.LlamaConfig(
          vocab_size=256, hidden_size=64, intermediate_size=64, num_hidden_layers=1,
          num_attention_heads=4, num_key_value_heads=2, head_dim=16,
          max_position_embeddings=64, eos_token_id=None), dtype=jnp.float32,
          rngs=nnx.Rngs(1)),
      # Gemma 3's four norms per block around the row-parallel projections, a window.
      "gemma3": gemma3.Gemma3ForCausalLM(gemma3.Gemma3Config(
          vocab_size=256, hidden_size=64, intermediate_size=64, num_hidden_layers=1,
          num_attention_heads=4, num_key_value_heads=2, head_dim=16,
          max_position_embeddings=64, sliding_window=4, eos_token_id=None),
          dtype=jnp.float32, rngs=nnx.Rngs(2)),
      # The parallel residual, LayerNorms, a plain MLP (StarCoder2's too) and biases
      # everywhere (made random below), RoPE on a quarter of each head.
      "gpt_neox": gpt_neox.GPTNeoXForCausalLM(gpt_neox.GPTNeoXConfig(
          vocab_size=256, hidden_size=64, intermediate_size=64, num_hidden_layers=1,
          num_attention_heads=4, max_position_embeddings=64, eos_token_id=None),
          dtype=jnp.float32, rngs=nnx.Rngs(3)),
  }
  # StableLM 2 12B's per-head q / k LayerNorm weights, split by head (made random below).
  models["stablelm"] = stablelm.StableLmForCausalLM(stablelm.StableLmConfig(
      vocab_size=256, hidden_size=64, intermediate_size=64, num_hidden_layers=1,
      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
      eos_token_id=None, use_parallel_residual=True, qk_layernorm=True),
      dtype=jnp.float32, rngs=nnx.Rngs(4))
  rng = np.random.default_rng(3)
  for name, random in (("gpt_neox", "bias"), ("stablelm", "_norm")):
    nnx.update(models[name], jax.tree_util.tree_map_with_path(
        lambda path, x: jnp.asarray(rng.standard_normal(x.shape), x.dtype)
        if random in jax.tree_util.keystr(path) else x, nnx.state(models[name])))
  out = {}
  for name, model in models.items():
    res = {"tokens": {}}
    logits = {}
    for n in (1, 2):
      mesh = None if n == 1 else tensor_parallel.make_mesh(n)
      # A fork (n=2) whose samples write into their shared last page: the decode
      # reservation kernel's copy-on-write, per device.
      requests = [Request([5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15], 6, n=2, temperature=1.0),
                  Request([1, 2, 3], 6)]
      engine = _engine(model, mesh, max_prefill_tokens=64)
      res["tokens"][str(n)], _ = engine.generate(requests)
      runner = ModelRunner(model, mesh)
      kv = runner.create_pool(num_pages=8, page_size=8, max_seqs=2, max_pages_per_seq=4)
      tok = np.array([[1, 2, 3, 4, 5, 6, 7, 8], [9, 8, 7, 0, 0, 0, 0, 0]], np.int32)
      lg, kv = runner.prefill(kv, tok, np.array([8, 3], np.int32), np.arange(2, dtype=np.int32))
      logits[n] = np.asarray(lg)
    res["logit_error"] = float(np.abs(logits[2] - logits[1]).max() / np.abs(logits[1]).max())
    out[name] = res
  return out


def case_errors() -> dict:
  import jax
  import jax.numpy as jnp
  from flax import nnx
  from jax.sharding import Mesh
  from jax_paged import Engine, tensor_parallel
  from models import gpt2, llama, moe

  def message(fn) -> str:
    try:
      fn()
    except (ValueError, TypeError) as e:
      return str(e)
    return "no error"

  def small_llama(**kw):
    cfg = dict(vocab_size=256, hidden_size=48, intermediate_size=96, num_hidden_layers=1,
               num_attention_heads=4, num_key_value_heads=4, head_dim=8,
               max_position_embeddings=64)
    cfg.update(kw)
    return llama.LlamaForCausalLM(llama.LlamaConfig(**cfg), dtype=jnp.float32,
                                  rngs=nnx.Rngs(0))

  mesh4 = tensor_parallel.make_mesh(4)
  engine = lambda model, mesh=mesh4: Engine(model, max_batch=2, num_pages=8, page_size=8,
                                            mesh=mesh)
  tiny_gpt2 = gpt2.GPT2LMHeadModel(
      gpt2.GPT2Config(vocab_size=256, n_positions=64, n_embd=48, n_layer=1, n_head=6),
      rngs=nnx.Rngs(0))

  class NoSplits(nnx.Module):  # meets PagedModel but lists no splits
    def __init__(self, inner):
      self.inner = inner

    @property
    def spec(self):
      return self.inner.spec

    def prefill(self, *a, **k):
      return self.inner.prefill(*a, **k)

    def decode(self, *a, **k):
      return self.inner.decode(*a, **k)

  return {
      "kv_heads": message(lambda: engine(small_llama(num_attention_heads=12,
                                                     num_key_value_heads=6))),
      "gpt2_heads": message(lambda: engine(tiny_gpt2, tensor_parallel.make_mesh(4))),
      "mlp_width": message(lambda: engine(small_llama(intermediate_size=90))),
      "devices": message(lambda: tensor_parallel.make_mesh(8)),
      "no_splits": message(lambda: engine(NoSplits(small_llama()))),
      "axis": message(lambda: engine(small_llama(),
                                     Mesh(np.asarray(jax.devices()[:2]), ("x",)))),
      "olmoe": message(lambda: engine(moe.MoeForCausalLM(moe.MoeConfig(
          model_type="olmoe", vocab_size=256, hidden_size=48, intermediate_size=16,
          num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=4,
          num_local_experts=2, max_position_embeddings=64), rngs=nnx.Rngs(0)))),
  }


def case_cli() -> dict:
  import contextlib
  import io
  import jax
  from jax_paged import cli
  from models import gpt2
  families = [gpt2.FAMILY]
  result = {}
  built_on, build = [], cli.build_model

  def recording_build(*args, **kwargs):  # where the CLI builds the model
    built_on.append(getattr(jax.config.jax_default_device, "platform", None))
    return build(*args, **kwargs)

  cli.build_model = recording_build
  for n in (1, 2):
    stdout = io.StringIO()
    args = cli.parse_args(["--model", "tiny", "--prompt-ids", "1,2,3", "--prompt", "hi",
                           "--max-new-tokens", "5", "--no-progress", "--num-pages", "16",
                           "--tensor-parallel", str(n)], families)
    with contextlib.redirect_stdout(stdout), contextlib.redirect_stderr(io.StringIO()):
      result["rc"] = cli.run(args, families)
    result[f"tokens_{n}"] = [line for line in stdout.getvalue().splitlines()
                             if not line.startswith("---")][:2]
  result["built_on"] = built_on[:]
  stderr = io.StringIO()
  with contextlib.redirect_stderr(stderr), contextlib.redirect_stdout(io.StringIO()):
    with contextlib.suppress(SystemExit):
      result["rc_too_many"] = cli.main(["--model", "tiny", "--prompt-ids", "1",
                                        "--num-pages", "8", "--tensor-parallel", "8"])
  result["err_too_many"] = stderr.getvalue()
  result["built_too_many"] = len(built_on) > 2
  return result


def case_moe(sizes=(1, 2, 4), head_dim=None) -> dict:
  """A Qwen2-MoE (experts and a shared expert on layer 0, layer 1 dense; everything
  split), TP `sizes`: the engine's greedy tokens (f32, highest precision), and the shapes
  of one device's blocks of layer 0's experts at the largest TP."""
  import jax
  from flax import nnx
  from jax_paged import Engine, Request, tensor_parallel, weight_quant
  from models import moe
  config = moe.MoeConfig(vocab_size=97, hidden_size=64, intermediate_size=48,
                         moe_intermediate_size=24, num_hidden_layers=2,
                         num_attention_heads=8, num_key_value_heads=4, num_local_experts=4,
                         mlp_only_layers=(1,), max_position_embeddings=64,
                         initializer_range=0.1, eos_token_id=None, model_type="qwen2_moe",
                         shared_expert_intermediate_size=32, attention_bias=True,
                         head_dim=head_dim)
  model = moe.MoeForCausalLM(config, rngs=nnx.Rngs(0))
  rng = np.random.default_rng(0)
  requests = [Request(rng.integers(1, 97, n).tolist(), 8) for n in (3, 9, 14)]
  tokens = {}
  with jax.default_matmul_precision("highest"):
    for n in sizes:
      mesh = None if n == 1 else tensor_parallel.make_mesh(n)
      tokens[str(n)], _ = Engine(model, max_batch=3, num_pages=16, page_size=8,
                                 mesh=mesh).generate(requests)
    # int8 weights (experts per expert and column, stored [experts, N, K]): TP 1 / 2.
    weight_quant.quantize_weights(model)
    for n in sizes[:2]:
      mesh = None if n == 1 else tensor_parallel.make_mesh(n)
      tokens[f"int8 {n}"], _ = Engine(model, max_batch=3, num_pages=16, page_size=8,
                                      mesh=mesh).generate(requests)
  sharded = tensor_parallel.shard_model(model, tensor_parallel.make_mesh(max(sizes)))
  prefix = ("layers", 0, "mlp")
  shards = {"/".join(path[3:]): list(leaf.addressable_shards[0].data.shape)
            for path, leaf in zip(map(tensor_parallel._path, sharded.paths), sharded.leaves)
            if path[:3] == prefix and path[-1] in ("kernel", "kernel_scale")}
  return {"tokens": tokens, "shards": shards}


def case_sizing() -> dict:
  """Engine(num_pages=None, mesh=4 devices) with each device reporting other free
  memory (`pool.size_pool` replaced: CPU devices report none)."""
  from jax_paged import Engine, pool, tensor_parallel
  devices, sizings = [], {}

  def size_pool(*, device, **kwargs):
    devices.append(device.id)
    sizings[device.id] = pool.PoolSizing(num_pages=[40, 24, 56, 32][device.id],
                                         bytes_per_page=1, budget_bytes=1, utilization=0.9)
    return sizings[device.id]

  pool.size_pool = size_pool
  engine = Engine(_models()["llama"], max_batch=2, page_size=8,
                  mesh=tensor_parallel.make_mesh(4))
  return {"devices": devices, "num_pages": engine.num_pages,
          "least": min(s.num_pages for s in sizings.values())}


if __name__ == "__main__":
  print(json.dumps(globals()[f"case_{sys.argv[1]}"]()))
