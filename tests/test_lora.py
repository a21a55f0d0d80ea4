"""LoRA adapters (`jax_paged.lora`, `Engine(max_loras=...)`): against PEFT on Hugging Face
models, against merged weights, and the slots' and prefix cache's bookkeeping.

Adapters are PEFT checkpoints saved with random A and B (`init_lora_weights=False`: B is
zero by default, which would hide every error), loaded through `LoraAdapter.load`; the
base models are random Hugging Face GPT-2 and Llama (GQA) checkpoints (and a Phi-3, whose
adapters target its fused qkv_proj and gate_up_proj, a Gemma 3, a StarCoder2 and a
GPT-NeoX). Every run mixes requests of several adapters and of the base model in one
batch.
"""

import json
import os

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import jax_paged
from jax_paged import lora
from jax_paged import nn as paged_nn
from jax_paged.kernels import linear as linear_lib
from models import gemma3, gpt2, gpt_neox, llama, starcoder2

PAGE = 8
VOCAB = 97
GPT2_TARGETS = ["c_attn", "c_proj", "c_fc"]
LLAMA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
TARGETS = {"gpt2": GPT2_TARGETS, "llama": LLAMA_TARGETS, "gemma3": LLAMA_TARGETS,
           "phi3": ["qkv_proj", "o_proj", "gate_up_proj", "down_proj"],
           "starcoder2": ["q_proj", "k_proj", "v_proj", "o_proj", "c_fc", "c_proj"],
           "gpt_neox": ["query_key_value", "dense", "dense_h_to_4h", "dense_4h_to_h"]}


def hf_base(kind: str):
  torch = pytest.importorskip("torch")
  transformers = pytest.importorskip("transformers")
  torch.manual_seed(0)
  if kind == "gpt2":
    config = transformers.GPT2Config(vocab_size=VOCAB, n_positions=96, n_embd=32, n_layer=2,
                                     n_head=4, bos_token_id=None, eos_token_id=None)
    return transformers.GPT2LMHeadModel(config).eval()
  config_cls, model_cls = {
      "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
      "gemma3": (transformers.Gemma3TextConfig, transformers.Gemma3ForCausalLM),
      "phi3": (transformers.Phi3Config, transformers.Phi3ForCausalLM),
      "starcoder2": (transformers.Starcoder2Config, transformers.Starcoder2ForCausalLM),
      "gpt_neox": (transformers.GPTNeoXConfig, transformers.GPTNeoXForCausalLM)}[kind]
  config = config_cls(
      vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
      num_attention_heads=4, max_position_embeddings=96, initializer_range=0.1,
      bos_token_id=None, eos_token_id=None, pad_token_id=None, attn_implementation="eager",
      **({} if kind == "gpt_neox" else dict(num_key_value_heads=2)))  # (GPT-NeoX: MHA)
  return model_cls(config).eval()


def save_with_adapters(kind: str, root) -> tuple[str, str, dict[str, str]]:
  """(kind, base checkpoint dir, {adapter name: its PEFT dir}): two adapters of different
  ranks, the second with rsLoRA scaling and a per-module alpha, on every linear."""
  torch = pytest.importorskip("torch")
  peft = pytest.importorskip("peft")
  base = os.path.join(root, "base")
  hf_base(kind).save_pretrained(base)
  targets = TARGETS[kind]
  configs = {"a": dict(r=4, lora_alpha=8),
             "b": dict(r=2, lora_alpha=4, use_rslora=True,
                       alpha_pattern={targets[1]: 16})}
  adapters = {}
  for seed, (name, kwargs) in enumerate(configs.items(), 1):
    torch.manual_seed(seed)
    model = peft.get_peft_model(hf_base(kind), peft.LoraConfig(
        target_modules=targets, init_lora_weights=False,
        fan_in_fan_out=kind == "gpt2", **kwargs))
    adapters[name] = os.path.join(root, name)
    model.save_pretrained(adapters[name])
  return kind, base, adapters


@pytest.fixture(scope="module", params=["gpt2", "llama"])
def saved(request, tmp_path_factory):
  """`save_with_adapters` of GPT-2 and of Llama."""
  return save_with_adapters(request.param, tmp_path_factory.mktemp(request.param))


@pytest.fixture(scope="module")
def saved_llama(tmp_path_factory):
  """`save_with_adapters` of Llama alone: for the engine's adapter bookkeeping (slots,
  chunks, preemption, beams, drafts, the prefix cache, warm-up), which does not depend on
  the model holding the slots (each model's adapters against PEFT: `saved`)."""
  return save_with_adapters("llama", tmp_path_factory.mktemp("llama_bookkeeping"))


def _load(kind: str, path: str):
  return {"gpt2": gpt2, "gemma3": gemma3, "starcoder2": starcoder2,
          "gpt_neox": gpt_neox}.get(kind, llama).from_pretrained(path)


def _serving(saved, model=None, **kwargs) -> jax_paged.Engine:
  """An engine over the base model (or `model`) with both adapters registered, slots of
  rank 4."""
  kind, base, adapters = saved
  engine = jax_paged.Engine(_load(kind, base) if model is None else model, page_size=PAGE,
                            max_lora_rank=4, **kwargs)
  for name, path in adapters.items():
    engine.add_lora(name, path)
  return engine


def _prompts(seed: int, count: int, lo: int = 3, hi: int = 30) -> list[list[int]]:
  rng = np.random.default_rng(seed)
  return [rng.integers(0, VOCAB, size=int(n)).tolist() for n in rng.integers(lo, hi, count)]


def _peft_logprobs(saved, adapter: str | None, tokens: list[int]) -> np.ndarray:
  """float64 [len(tokens) - 1]: each token's log-probability after those before it, from
  PEFT's model with `adapter` (None: the base model)."""
  torch = pytest.importorskip("torch")
  peft = pytest.importorskip("peft")
  kind, _, adapters = saved
  model = hf_base(kind)
  if adapter is not None:
    model = peft.PeftModel.from_pretrained(model, adapters[adapter]).eval()
  with torch.no_grad():
    logits = model(torch.tensor([tokens])).logits[0].double()
  logprobs = torch.log_softmax(logits, -1)[:-1]
  return logprobs[torch.arange(len(tokens) - 1), torch.tensor(tokens[1:])].numpy()


def test_prompt_and_token_logprobs_match_peft_in_a_mixed_batch(saved):
  _assert_logprobs_match_peft(saved)


@pytest.mark.parametrize("kind", ["phi3", "gemma3", "starcoder2", "gpt_neox"])
def test_other_families_adapters_match_peft(tmp_path, kind):
  """Phi-3's adapters on qkv_proj and gate_up_proj (each over all of our fused kernel's
  columns); Gemma 3's on its Llama-named modules, between its extra norms; StarCoder2's
  on its attention's and its plain MLP's c_fc and c_proj (biased); GPT-NeoX's on its
  query_key_value (its columns interleaved by head), attention.dense and MLP, beside the
  parallel residual."""
  _assert_logprobs_match_peft(save_with_adapters(kind, tmp_path))


def _assert_logprobs_match_peft(saved):
  engine = _serving(saved, max_batch=8, num_pages=64, max_loras=2)
  names = ["a", None, "b", "a", "b", None]
  requests = [jax_paged.Request(p, max_new_tokens=6, lora=name, logprobs=True,
                                prompt_logprobs=True)
              for p, name in zip(_prompts(1, len(names)), names)]
  events = list(engine.stream(requests))
  for i, (r, name) in enumerate(zip(requests, names)):
    mine = [e for e in events if e.request_id == i]
    tokens = list(r.prompt) + [e.token for e in mine]
    got = np.array(list(mine[0].prompt_logprobs[1:]) + [e.logprob for e in mine])
    want = _peft_logprobs(saved, name, tokens)
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4, err_msg=f"request {i}")


def test_saved_adapters_read_back_as_peft_reads_them(saved, tmp_path):
  """`LoraAdapter.save` of a loaded adapter (ranks and alphas per module): `load` gives the
  same updates, and PEFT the same logits as from the original checkpoint."""
  kind, _, adapters = saved
  adapter = lora.LoraAdapter.load(adapters["b"])
  adapter.save(tmp_path / "copy")
  again = lora.LoraAdapter.load(tmp_path / "copy")
  assert again.weights.keys() == adapter.weights.keys()
  for name, (a, b) in adapter.weights.items():
    np.testing.assert_allclose(again.weights[name][0], a, rtol=1e-6)
    np.testing.assert_allclose(again.weights[name][1], b, rtol=1e-6)
  tokens = _prompts(5, 1)[0]
  want = _peft_logprobs(saved, "b", tokens)
  got = _peft_logprobs((kind, None, {"b": str(tmp_path / "copy")}), "b", tokens)
  np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


def _merged(model, adapter: lora.LoraAdapter):
  """`model` with `adapter` merged into its weights (W + A^T B^T per module)."""
  for name, target in model.lora_targets().items():
    if name in adapter.weights:
      a, b = adapter.weights[name]
      kernel = target.linear.kernel[...]
      target.linear.kernel[...] = kernel.at[:, np.asarray(target.placement)].add(
          jnp.asarray(a.T @ b.T))
  return model


def _alone(kind, base, adapters, requests) -> list[list[int]]:
  """Each request's tokens from an engine without LoRA over the merged weights."""
  out = []
  for r in requests:
    model = (_load(kind, base) if r.lora is None
             else _merged(_load(kind, base), lora.LoraAdapter.load(adapters[r.lora])))
    engine = jax_paged.Engine(model, max_batch=4, num_pages=64, page_size=PAGE)
    tokens, _ = engine.generate([jax_paged.Request(r.prompt, max_new_tokens=r.max_new_tokens,
                                                   temperature=r.temperature, seed=r.seed,
                                                   n=r.n)])
    out.append(tokens[0])
  return out


def test_more_adapters_than_slots_chunks_and_preemption_give_the_merged_models_tokens(saved_llama):
  """One slot for two adapters (a request waits until the other's sequences have left
  it), parallel samples, prompts prefilled in chunks of 16 tokens, and a pool so small
  that sequences are preempted and readmitted (their adapter's slot acquired again)."""
  kind, base, adapters = saved_llama
  engine = _serving(saved_llama, max_batch=8, num_pages=12, max_prefill_tokens=16, max_loras=1)
  names = ["a", "b", None, "b", "a", "a"]
  requests = [jax_paged.Request(p, max_new_tokens=20, lora=name, temperature=1.0, seed=i,
                                n=2 if i == 3 else 1)
              for i, (p, name) in enumerate(zip(_prompts(2, len(names), 10, 40), names))]
  tokens, report = engine.generate(requests)
  assert report.preemptions > 0
  assert tokens == _alone(kind, base, adapters, requests)
  assert engine.adapters.take_loads() == []


def test_beam_search_with_an_adapter_is_the_merged_models(saved_llama):
  kind, base, adapters = saved_llama
  prompts = _prompts(8, 3)
  got, _ = jax_paged.beam_search(_load(kind, base), prompts, 6, beam_width=3, page_size=PAGE,
                                 max_batch=6, lora=adapters["a"])
  merged = _merged(_load(kind, base), lora.LoraAdapter.load(adapters["a"]))
  want, _ = jax_paged.beam_search(merged, prompts, 6, beam_width=3, page_size=PAGE,
                                  max_batch=6)
  assert [[b.tokens for b in hyps] for hyps in got] == [[b.tokens for b in hyps]
                                                         for hyps in want]
  np.testing.assert_allclose([b.score for hyps in got for b in hyps],
                             [b.score for hyps in want for b in hyps], rtol=1e-5)


def test_stats_name_the_running_and_waiting_adapters(saved_llama):
  engine = _serving(saved_llama, max_batch=1, num_pages=16, max_loras=1)
  assert engine.stats()[-3:] == (1, "", "")
  for name in ("b", "a", None):
    engine.add_request(jax_paged.Request([1, 2, 3], 4, lora=name))
  engine.step()
  assert engine.stats()[-3:] == (1, "b", "a")
  while engine.has_unfinished_requests():
    engine.step()
  assert engine.stats()[-3:] == (1, "", "")


def test_speculative_decoding_serves_adapters(saved_llama):
  kind, base, adapters = saved_llama
  rng = np.random.default_rng(3)
  # Repetitive prompts, so that drafts are proposed and some kept.
  prompts = [rng.integers(0, VOCAB, size=4).tolist() * 4 for _ in range(3)]
  requests = [jax_paged.Request(p, max_new_tokens=8, lora=name)
              for p, name in zip(prompts, ["a", None, "b"])]
  engine = _serving(saved_llama, max_batch=4, num_pages=64, max_loras=2,
                    speculation=jax_paged.NgramSpeculation(num_tokens=3))
  tokens, _ = engine.generate(requests)
  assert tokens == _alone(kind, base, adapters, requests)


def test_prefix_cache_shares_pages_within_an_adapter_only(saved_llama):
  kind, base, adapters = saved_llama
  engine = _serving(saved_llama, max_batch=4, num_pages=64, max_loras=2)
  prompt = _prompts(4, 1, 3 * PAGE + 2, 3 * PAGE + 3)[0]
  first, _ = engine.generate([jax_paged.Request(prompt, max_new_tokens=4, lora="a")])
  for name in ("b", None, "a"):
    request = jax_paged.Request(prompt, max_new_tokens=4, lora=name)
    tokens, report = engine.generate([request])
    assert tokens == _alone(kind, base, adapters, [request])
    # Only adapter a's own run finds the prompt's three full pages cached.
    assert report.cached_prompt_tokens == (3 * PAGE if name == "a" else 0), name
  assert tokens == first
  # Registered again under the same name: the old adapter's pages are not reused.
  engine.add_lora("a", adapters["b"])
  _, report = engine.generate([jax_paged.Request(prompt, max_new_tokens=4, lora="a")])
  assert report.cached_prompt_tokens == 0


def test_warmup_covers_runs_of_adapters(saved_llama):
  """After warmup() a run mixing adapters (loaded into their slots mid-run, one
  reloaded) compiles nothing: every program takes the slots whichever adapters run, and
  the slot writes compiled with the engine (bf16: the adapters' arrays cast to it)."""
  import jax  # pylint: disable=import-outside-toplevel
  kind, base, _ = saved_llama
  model = (gpt2 if kind == "gpt2" else llama).from_pretrained(base, dtype=jnp.bfloat16)
  engine = _serving(saved_llama, model, max_batch=4, num_pages=64, steps_per_call=4, max_loras=1)
  engine.warmup(max_prompt_tokens=16)
  compiles = []
  listen = lambda event, seconds, **_: compiles.append(event) if (
      event == "/jax/core/compile/backend_compile_duration") else None
  jax.monitoring.register_event_duration_secs_listener(listen)
  try:
    engine.generate([jax_paged.Request(p, 6, lora=name)
                     for p, name in zip(_prompts(7, 4, 2, 16), ["a", None, "b", "a"])])
  finally:
    jax.monitoring.unregister_event_duration_listener(listen)
  assert not compiles


def _slotted_linear(rng, k: int, n: int, slots: int, rank: int):
  linear = nnx.Linear(k, n, rngs=nnx.Rngs(0))
  target = {"m": lora.Target(linear)}
  lora.attach(target, max_loras=slots, max_rank=rank)
  a = rng.normal(size=(slots, k, rank)).astype(np.float32)
  b = rng.normal(size=(slots, rank, n)).astype(np.float32)
  # (The slots' columns, then the zero padding up to a power of two.)
  linear.lora_a[...] = linear.lora_a[...].at[:, :slots * rank].set(
      a.transpose(1, 0, 2).reshape(k, slots * rank))
  linear.lora_b[...] = linear.lora_b[...].at[:slots * rank].set(b.reshape(slots * rank, n))
  return linear, a, b


def test_delta_is_each_rows_own_adapters_update():
  rng = np.random.default_rng(0)
  linear, a, b = _slotted_linear(rng, 24, 40, 3, 4)
  h = rng.normal(size=(5, 7, 24)).astype(np.float32)
  adapters = np.array([2, -1, 0, 1, 2], np.int32)
  got = np.asarray(lora.delta(linear, jnp.asarray(h), jnp.asarray(adapters)))
  for row, s in enumerate(adapters):
    want = np.zeros((7, 40)) if s < 0 else h[row] @ a[s] @ b[s]
    np.testing.assert_allclose(got[row], want, rtol=1e-5, atol=1e-5)
  assert lora.delta(linear, jnp.asarray(h), None) is None
  assert linear.lora_a[...].shape == (24, 16)  # 3 slots of 4, padded to a power of two


def test_projection_kernels_add_the_update_before_activation_and_norm():
  """The GPU paths (Pallas interpret mode) and the plain ones against merged weights."""
  rng = np.random.default_rng(1)
  linear, a, b = _slotted_linear(rng, 64, 128, 2, 4)
  h = jnp.asarray(rng.normal(size=(6, 64)).astype(np.float32))
  residual = jnp.asarray(rng.normal(size=(6, 128)).astype(np.float32))
  adapters = jnp.asarray([1, -1, 0, 0, 1, -1], jnp.int32)
  kernel = np.asarray(linear.kernel[...])
  merged = np.stack([kernel + (a[s] @ b[s] if s >= 0 else 0) for s in np.asarray(adapters)])
  y = np.einsum("rk,rkn->rn", np.asarray(h), merged) + np.asarray(linear.bias[...])
  norm = paged_nn.LayerNorm(128)
  norm.scale[...] = jnp.asarray(rng.uniform(0.5, 1.5, 128).astype(np.float32))
  for interpret in (True, None):
    got = paged_nn.dense(linear, h, activation=jnp.tanh, sections=(32, 96),
                         interpret=interpret, adapters=adapters)
    np.testing.assert_allclose(np.concatenate(got, -1), np.tanh(y), rtol=1e-5, atol=1e-5)
    got = paged_nn.project_add(linear, h, residual, interpret=interpret, adapters=adapters)
    np.testing.assert_allclose(got, residual + y, rtol=1e-5, atol=1e-5)
    x, normed = paged_nn.project_add_norm(linear, h, residual, norm, interpret=interpret,
                                          adapters=adapters)
    np.testing.assert_allclose(x, residual + y, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(normed, norm(residual + jnp.asarray(y)), rtol=1e-5, atol=1e-5)
  with pytest.raises(ValueError, match=r"W a power of two >= 16 .* got xa float32\[6, 12\]"):
    linear_lib.linear(h, linear.kernel[...], low_rank=(h[:, :12], linear.lora_b[:12]))


def test_bad_adapters_and_requests_are_refused_by_name(saved, tmp_path):
  kind, base, adapters = saved
  with pytest.raises(ValueError, match="serves no LoRA adapters"):
    jax_paged.Engine(_load(kind, base), max_batch=2, num_pages=16,
                     page_size=PAGE).add_lora("a", adapters["a"])
  engine = jax_paged.Engine(_load(kind, base), max_batch=2, num_pages=16, page_size=PAGE,
                            max_loras=1, max_lora_rank=2)
  with pytest.raises(ValueError, match="rank 4, above the engine's max_lora_rank=2"):
    engine.add_lora("a", adapters["a"])
  engine.add_lora("b", adapters["b"])
  with pytest.raises(ValueError, match="request 0: lora 'a' is not a registered LoRA "
                                       r"adapter; the engine's adapters are \['b'\]"):
    engine.generate([jax_paged.Request([1, 2], max_new_tokens=2, lora="a")])
  with pytest.raises(FileNotFoundError, match="no adapter_config.json"):
    engine.add_lora("c", tmp_path)
  with pytest.raises(KeyError, match="no LoRA adapter named 'c'"):
    engine.remove_lora("c")
  # An adapter of a module the model does not serve (the LM head).
  weights = dict(lora.LoraAdapter.load(adapters["b"]).weights)
  weights["lm_head"] = (np.ones((2, 32), np.float32), np.ones((VOCAB, 2), np.float32))
  with pytest.raises(ValueError, match=r"adapts \['lm_head'\], which the model does not"):
    engine.add_lora("c", lora.LoraAdapter(weights))
  # What serving would not apply: DoRA, trained biases.
  for key, value in (("use_dora", True), ("bias", "all"), ("lora_bias", True)):
    copy = tmp_path / key
    copy.mkdir()
    for f in os.listdir(adapters["b"]):
      (copy / f).write_bytes(open(os.path.join(adapters["b"], f), "rb").read())
    config = json.loads((copy / "adapter_config.json").read_text())
    (copy / "adapter_config.json").write_text(json.dumps({**config, key: value}))
    with pytest.raises(ValueError, match=f"{key}="):
      engine.add_lora("c", copy)
  # Weights that are not finite.
  broken = {name: (a, b * np.nan) for name, (a, b) in weights.items() if name != "lm_head"}
  lora.LoraAdapter(broken).save(tmp_path / "nan")
  with pytest.raises(ValueError, match="holds NaN or infinite weights"):
    engine.add_lora("c", tmp_path / "nan")
  engine.remove_lora("b")
  assert engine.loras == []
  with pytest.raises(ValueError, match="max_loras must be a positive int, got -1"):
    jax_paged.Engine(_load(kind, base), max_batch=2, num_pages=16, max_loras=-1)


@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["gpt2", "llama"])
def test_gpu_kernels_serve_adapters_as_merged_weights(kind):
  """On the GPU (the Triton linear, norm, cache-write and attention kernels, head dim 64),
  f32: a batch mixing two adapters and the base model gives each merged model's tokens and
  log-probabilities."""
  import jax  # pylint: disable=import-outside-toplevel
  if kind == "gpt2":
    make = lambda: gpt2.GPT2LMHeadModel(gpt2.GPT2Config(
        vocab_size=VOCAB, n_positions=96, n_embd=256, n_layer=2, n_head=4,
        bos_token_id=None, eos_token_id=None), rngs=nnx.Rngs(3))
  else:
    make = lambda: llama.LlamaForCausalLM(llama.LlamaConfig(
        vocab_size=VOCAB, hidden_size=256, intermediate_size=384, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=96,
        eos_token_id=None), rngs=nnx.Rngs(3))
  with jax.default_matmul_precision("highest"):
    adapters = {name: lora.LoraAdapter.random(make().lora_targets(), rank=rank, seed=rank)
                for name, rank in (("a", 8), ("b", 4))}
    engine = jax_paged.Engine(make(), max_batch=8, num_pages=64, page_size=16, max_loras=2,
                              max_lora_rank=8)
    for name, adapter in adapters.items():
      engine.add_lora(name, adapter)
    names = ["a", None, "b", "a", "b", None]
    requests = [jax_paged.Request(p, max_new_tokens=12, lora=name, logprobs=True)
                for p, name in zip(_prompts(6, len(names), 5, 40), names)]
    events = list(engine.stream(requests))
    for i, (r, name) in enumerate(zip(requests, names)):
      model = make() if name is None else _merged(make(), adapters[name])
      alone = jax_paged.Engine(model, max_batch=1, num_pages=64, page_size=16)
      want = list(alone.stream([jax_paged.Request(r.prompt, 12, logprobs=True)]))
      got = [e for e in events if e.request_id == i]
      assert [e.token for e in got] == [e.token for e in want], i
      np.testing.assert_allclose([e.logprob for e in got], [e.logprob for e in want],
                                 atol=2e-4)
