"""Llama, Mistral, Qwen2, Qwen3 and Phi-3 on the paged pool against Hugging Face transformers
(CPU, f32).

Random-init HF models (biases and norm weights randomised too: HF initialises them to 0
and 1, which would hide a misplaced tensor) are saved with `save_pretrained`, one file or
sharded, and loaded back through `models.llama.from_pretrained`, so loading is tested
along with the math.

Tolerance: logits are compared at 1e-4 absolute and relative. Both sides compute in f32
and differ only in summation order (fused q/k/v, paged vs contiguous keys); a wrong
rotation, window, mask or page gives errors of the order of the logits themselves (~1).
"""

import functools
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers
from flax import nnx
from safetensors.numpy import load_file, save_file

import jax_paged
from jax_paged import cli
from jax_paged.serving.runner import ModelRunner
from models import gpt2, llama
from tests.test_engine import assert_pages_back

PAGE = 8
VOCAB = 300
_COMMON = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
               max_position_embeddings=64, initializer_range=0.1, bos_token_id=None,
               eos_token_id=None, attn_implementation="eager")
# name -> (HF class, config kwargs, save_pretrained kwargs)
MODELS = {
    # GQA 8 q heads over 2 kv heads of 16 (head_dim given, not hidden / heads), llama3 RoPE
    # whose scaling reaches the positions tested (original context 16), untied head.
    "llama": (transformers.LlamaForCausalLM, transformers.LlamaConfig, dict(
        num_attention_heads=8, num_key_value_heads=2, head_dim=16, rope_theta=10000.0,
        rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                      "high_freq_factor": 4.0, "original_max_position_embeddings": 16}), {}),
    # Linear RoPE, biases on q/k/v/o and the MLP, MQA, tied head.
    "llama-linear": (transformers.LlamaForCausalLM, transformers.LlamaConfig, dict(
        num_attention_heads=4, num_key_value_heads=1, rope_theta=500.0,
        rope_scaling={"rope_type": "linear", "factor": 2.0}, attention_bias=True,
        mlp_bias=True, tie_word_embeddings=True), {}),
    # Every layer windowed to 5 positions, shorter than every sequence but the shortest.
    "mistral": (transformers.MistralForCausalLM, transformers.MistralConfig, dict(
        num_attention_heads=8, num_key_value_heads=2, sliding_window=5), {}),
    # q/k/v biases; layer 1 windowed (use_sliding_window from max_window_layers=1), layer 0
    # not; tied head; saved in shards.
    "qwen2": (transformers.Qwen2ForCausalLM, transformers.Qwen2Config, dict(
        num_attention_heads=8, num_key_value_heads=2, use_sliding_window=True,
        sliding_window=6, max_window_layers=1, tie_word_embeddings=True),
        dict(max_shard_size="40KB")),
    # q / k norms per head (head_dim 16: q is 128 wide, hidden 64), biases on q/k/v/o,
    # layer 1 windowed to 5 positions, YaRN RoPE (of its 8 pairs 0-1 kept, 2-4 on the
    # ramp, 5-7 interpolated; cos / sin x1.14).
    "qwen3": (transformers.Qwen3ForCausalLM, transformers.Qwen3Config, dict(
        num_attention_heads=8, num_key_value_heads=2, head_dim=16, attention_bias=True,
        use_sliding_window=True, sliding_window=5, max_window_layers=1,
        rope_scaling={"rope_type": "yarn", "factor": 4.0,
                      "original_max_position_embeddings": 1024}), {}),
    # One qkv_proj and one gate_up_proj per layer; every layer windowed to 7 positions;
    # Phi-4-mini's RoPE: on 3/4 of each head (6 of 8 features), LongRoPE's short factors
    # (the sequences stay within the original context).
    "phi3": (transformers.Phi3ForCausalLM, transformers.Phi3Config, dict(
        num_attention_heads=8, num_key_value_heads=2, sliding_window=7, pad_token_id=None,
        partial_rotary_factor=0.75, rope_scaling={"rope_type": "longrope",
                                                  "short_factor": [1.0, 1.5, 3.0],
                                                  "long_factor": [2.0, 7.0, 30.0]}), {}),
    # Granite's four multipliers (none 1), GQA, tied head.
    "granite": (transformers.GraniteForCausalLM, transformers.GraniteConfig, dict(
        num_attention_heads=8, num_key_value_heads=2, embedding_multiplier=6.0,
        residual_multiplier=0.3, attention_multiplier=0.2, logits_scaling=4.0,
        tie_word_embeddings=True), {}),
    # Granite SWA: Granite's multipliers, layer 0 full with RoPE, layer 1 windowed to 5
    # positions (HF's layer_types: every fourth full from layer 0) and a NoPE layer
    # (layer_rope_theta 0), a sink logit per head (HF's zeros: each softmax's weights then
    # sum to S / (S + 1)), GQA.
    "granite_swa": (transformers.GraniteSWAForCausalLM, transformers.GraniteSWAConfig, dict(
        num_attention_heads=8, num_key_value_heads=2, embedding_multiplier=6.0,
        residual_multiplier=0.3, attention_multiplier=0.2, logits_scaling=4.0,
        sliding_window=5, layer_rope_theta=[10000.0, 0]), {}),
    # Layer 1 a NoPE layer (no RoPE) and windowed to 5 positions (SmolLM3 windows NoPE
    # layers), biases on q/k/v/o, GQA, tied head (its default).
    "smollm3": (transformers.SmolLM3ForCausalLM, transformers.SmolLM3Config, dict(
        num_attention_heads=8, num_key_value_heads=2, no_rope_layers=[1, 0],
        use_sliding_window=True, sliding_window=5, attention_bias=True, pad_token_id=None),
        {}),
    # q/k/v biases and o's apart (attention_out_bias), MLP biases, GQA.
    "seed_oss": (transformers.SeedOssForCausalLM, transformers.SeedOssConfig, dict(
        num_attention_heads=8, num_key_value_heads=2, head_dim=16, attention_bias=True,
        attention_out_bias=True, mlp_bias=True, pad_token_id=None), {}),
    # Ministral: layer 0 windowed to 5 positions, layer 1 not (layer_types), GQA. (head_dim
    # given: HF's MinistralAttention reads a None one as it is.)
    "ministral": (transformers.MinistralForCausalLM, transformers.MinistralConfig, dict(
        num_attention_heads=8, num_key_value_heads=2, head_dim=8, sliding_window=5,
        layer_types=["sliding_attention", "full_attention"],
        rope_parameters={"rope_type": "default", "rope_theta": 20000.0}), {}),
    # CWM: layers 0 full, 1 windowed to 5 positions (HF's default layer_types: every
    # fourth full from layer 0), its default llama3 RoPE at a small original context.
    "cwm": (transformers.CwmForCausalLM, transformers.CwmConfig, dict(
        num_attention_heads=8, num_key_value_heads=2, head_dim=8, sliding_window=5,
        bos_token_id=1,  # (HF's CwmConfig takes no None)
        rope_parameters={"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0,
                         "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                         "original_max_position_embeddings": 16}), {}),
    # Ministral 3: every layer windowed to 5 positions, YaRN RoPE from an original context of
    # 8 and the llama_4_scaling of the queries (1 + 0.5 log(1 + floor(p / 8)): from 1 to
    # 1.69 over the positions tested), GQA.
    "ministral3": (transformers.Ministral3ForCausalLM, transformers.Ministral3Config, dict(
        num_attention_heads=8, num_key_value_heads=2, head_dim=8, sliding_window=5,
        pad_token_id=None, rope_parameters={
            "rope_type": "yarn", "rope_theta": 10000.0, "factor": 8.0,
            "original_max_position_embeddings": 8, "beta_fast": 32.0, "beta_slow": 1.0,
            "mscale": 1.0, "mscale_all_dim": 1.0, "llama_4_scaling_beta": 0.5,
            "max_position_embeddings": 64}), {}),
    # InternLM3 (HF serves it as Llama): biases on q/k/v/o and the MLP under its names
    # (qkv_bias, bias), GQA.
    "internlm3": (transformers.LlamaForCausalLM, transformers.InternLM3Config, dict(
        num_attention_heads=8, num_key_value_heads=2, head_dim=16, qkv_bias=True, bias=True,
        pad_token_id=None), {}),
}


def _hf_model(name: str, seed: int = 0, **overrides):
  cls, config_cls, kwargs, _ = MODELS[name]
  torch.manual_seed(seed)
  return randomised(cls(config_cls(**{**_COMMON, **kwargs, **overrides})))


def randomised(hf, norm: str = "norm"):
  """`hf` in eval mode with random biases and norm weights (those whose names hold `norm`;
  HF's zeros and ones would hide a bias or norm applied wrongly or not at all)."""
  with torch.no_grad():
    for pname, p in hf.named_parameters():
      if pname.endswith("bias"):
        p.normal_(0.0, 0.5)
      elif norm in pname:
        p.uniform_(0.5, 1.5)
  return hf.eval()


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
  """name -> (name, HF model, its save_pretrained directory), each saved once."""
  cache = {}

  def get(name: str):
    if name not in cache:
      hf = _hf_model(name)
      path = tmp_path_factory.mktemp(name)
      hf.save_pretrained(path, **MODELS[name][3])
      cache[name] = name, hf, path
    return cache[name]
  return get


@pytest.fixture(scope="module", params=list(MODELS))
def checkpoint(request, saved):
  return saved(request.param)


def _padded(prompts: list[list[int]]) -> tuple[np.ndarray, np.ndarray]:
  width = max(map(len, prompts))
  tokens = np.zeros((len(prompts), width), np.int32)
  for i, p in enumerate(prompts):
    tokens[i, :len(p)] = p
  return tokens, np.asarray([len(p) for p in prompts], np.int32)


def _hf_last_logits(hf, seqs: list[list[int]]) -> np.ndarray:
  """HF's logits of each sequence's last token, [len(seqs), vocab], in one forward of the
  right-padded batch: real tokens never see the padding after them, and HF numbers
  positions 0, 1, ... whatever the mask."""
  tokens, lengths = _padded(seqs)
  mask = np.arange(tokens.shape[1])[None, :] < lengths[:, None]
  with torch.no_grad():
    logits = hf(torch.from_numpy(tokens).long(),
                attention_mask=torch.from_numpy(mask).long()).logits.numpy()
  return logits[np.arange(len(seqs)), lengths - 1]


def _hf_generate(hf, prompt: list[int], new: int) -> list[int]:
  with torch.no_grad():
    return hf.generate(torch.tensor([prompt]), max_new_tokens=new, min_new_tokens=new,
                       do_sample=False, pad_token_id=0)[0, len(prompt):].tolist()


def _prompts(rng, lengths) -> list[list[int]]:
  return [rng.integers(1, VOCAB, n).tolist() for n in lengths]


def test_rotary_embedding_matches_hf():
  """Our frequencies and rotation against HF's LlamaRotaryEmbedding + apply_rotary_pos_emb,
  for each RoPE type at Llama 3.1 8B's settings, up to position 131071: YaRN as Qwen3's
  long-context configs set it, and with DeepSeek's mscales (its cos / sin scaled)."""
  from transformers.models.llama import modeling_llama
  rng = np.random.default_rng(0)
  for rope_scaling in (None, {"rope_type": "linear", "factor": 4.0},
                       {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                        "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
                       {"rope_type": "yarn", "factor": 4.0,
                        "original_max_position_embeddings": 32768},
                       {"rope_type": "yarn", "factor": 40.0, "beta_fast": 32, "beta_slow": 1,
                        "mscale": 1.0, "mscale_all_dim": 0.8,
                        "original_max_position_embeddings": 4096}):
    hf_config = transformers.LlamaConfig(hidden_size=4096, num_attention_heads=32,
                                         rope_theta=500000.0, rope_scaling=rope_scaling,
                                         max_position_embeddings=131072)
    ours = llama.LlamaConfig.from_dict(hf_config.to_dict()).rope
    hf_rope = modeling_llama.LlamaRotaryEmbedding(hf_config)
    np.testing.assert_allclose(ours.inv_freq(), hf_rope.inv_freq.numpy(), rtol=1e-6)
    assert ours.attention_factor == pytest.approx(hf_rope.attention_scaling, rel=1e-12)
    positions = np.array([0, 1, 7, 4095, 8191, 65537, 131071])
    q = rng.standard_normal((1, 2, len(positions), 128)).astype(np.float32)  # [B, H, T, D]
    cos, sin = hf_rope(torch.from_numpy(q), torch.from_numpy(positions)[None])
    want, _ = modeling_llama.apply_rotary_pos_emb(torch.from_numpy(q), torch.from_numpy(q),
                                                  cos, sin)
    got = ours(jnp.asarray(q[0].transpose(1, 0, 2)), jnp.asarray(positions))  # [T, H, D]
    np.testing.assert_allclose(np.asarray(got).transpose(1, 0, 2), want[0].numpy(),
                               rtol=1e-4, atol=1e-4)


def test_longrope_matches_hf():
  """LongRoPE's frequencies and rotation against HF's Phi3RotaryEmbedding (which picks
  the factors by the longest position of a forward pass), at Phi-3.5-mini's and
  Phi-4-mini's settings (RoPE on all or 3/4 of a head): short factors within the original
  context (max_model_len's default), long ones past it (max_model_len 131072)."""
  from transformers.models.phi3 import modeling_phi3
  rng = np.random.default_rng(1)
  for partial in (1.0, 0.75):
    pairs = int(128 * partial) // 2
    hf_config = transformers.Phi3Config(
        hidden_size=3072, num_attention_heads=24, num_key_value_heads=8,
        max_position_embeddings=131072, original_max_position_embeddings=4096,
        partial_rotary_factor=partial, rope_scaling={
            "rope_type": "longrope", "short_factor": (1 + 0.05 * rng.random(pairs)).tolist(),
            "long_factor": (1 + 60 * rng.random(pairs)).tolist()})
    hf_rope = modeling_phi3.Phi3RotaryEmbedding(hf_config)
    for max_model_len, length in ((None, 4096), (131072, 131072)):
      ours = llama.LlamaConfig.from_dict({**hf_config.to_dict(),
                                          "max_model_len": max_model_len}).rope
      positions = np.array([0, 1, 7, 4095, length - 1])
      q = rng.standard_normal((1, 2, len(positions), 128)).astype(np.float32)
      cos, sin = hf_rope(torch.from_numpy(q), torch.arange(length)[None])
      want, _ = modeling_phi3.apply_rotary_pos_emb(
          torch.from_numpy(q), torch.from_numpy(q), cos[:, positions], sin[:, positions])
      got = ours(jnp.asarray(q[0].transpose(1, 0, 2)), jnp.asarray(positions))
      np.testing.assert_allclose(np.asarray(got).transpose(1, 0, 2), want[0].numpy(),
                                 rtol=1e-4, atol=1e-4)


def test_longrope_long_factors_match_hf(tmp_path, capsys):
  """A Phi-3 of original context 16 served for 64 positions (max_model_len, the CLI's
  --max-model-len): every sequence rotated by the long factors, as HF rotates sequences
  past the original context: logits over prefill and decode, and greedy tokens through the
  prefix cache and chunked prefill; served by default for 16 positions only (the short
  factors), where a longer request is refused."""
  hf = _hf_model("phi3", seed=3, original_max_position_embeddings=16)
  hf.save_pretrained(tmp_path)
  model = llama.from_pretrained(tmp_path, max_model_len=64)
  assert model.spec.max_positions == 64 and model.layers[0].self_attn.rope.ext_factors == (
      2.0, 7.0, 30.0)
  assert_logits_track_hf(hf, model, [17, 22, 29], 6)
  assert assert_prefix_cache_and_chunks_give_hfs_tokens(hf, model, np.random.default_rng(6),
                                                        [4, 9]) >= 2 * PAGE
  short = llama.from_pretrained(tmp_path)
  assert short.spec.max_positions == 16
  with pytest.raises(ValueError, match="exceeds the model's n_positions=16"):
    jax_paged.generate(short, [list(range(1, 13))], 6, page_size=PAGE)
  prompt = _prompts(np.random.default_rng(7), [20])[0]
  status, out, err = _cli(capsys, "--checkpoint", str(tmp_path), "--prompt-ids",
                          ",".join(map(str, prompt)), "--max-new-tokens", "6",
                          "--max-model-len", "64", "--no-progress")
  assert status == 0, err
  assert [int(t) for t in out.splitlines()[1].split(",")] == _hf_generate(hf, prompt, 6)


def assert_logits_track_hf(hf, model, lengths: list[int], steps: int,
                           seed: int = 1) -> list[list[int]]:
  """Prompts of `lengths` random tokens prefilled into a fresh pool (at pool sequence ids
  len(lengths) .. 1), then `steps` decode steps of random tokens (not argmax: every step
  sees fresh inputs): after the prefill and each step the runner's logits are HF's for
  every sequence so far (f32: 1e-4; HF's large enough to show an error), and the pool
  holds every token. Returns the sequences."""
  runner = ModelRunner(model)
  rng = np.random.default_rng(seed)
  seqs = _prompts(rng, lengths)
  pages = -(-(max(lengths) + steps) // PAGE)
  kv = model.spec.create_pool(num_pages=len(lengths) * pages, page_size=PAGE,
                              max_seqs=len(lengths) + 1, max_pages_per_seq=pages)
  seq_ids = np.arange(len(lengths), 0, -1, dtype=np.int32)
  logits, kv = runner.prefill(kv, *_padded(seqs), seq_ids)
  for step in range(steps + 1):
    want = _hf_last_logits(hf, seqs)
    assert np.abs(want).max(axis=1).min() > 0.5
    np.testing.assert_allclose(logits, want, atol=1e-4, rtol=1e-4, err_msg=f"step {step}")
    if step < steps:
      nxt = rng.integers(1, VOCAB, len(seqs))
      seqs = [s + [int(t)] for s, t in zip(seqs, nxt)]
      logits, kv = runner.decode(kv, jnp.asarray(nxt, jnp.int32), seq_ids)
  np.testing.assert_array_equal(kv.lengths[seq_ids], [len(s) for s in seqs])
  return seqs


def test_prefill_and_decode_logits_match_hf(checkpoint):
  name, hf, path = checkpoint
  model = llama.from_pretrained(path)
  assert isinstance(model, jax_paged.PagedModel)
  if name == "qwen2":  # loaded from shards, and windowed on its upper layer only
    assert len(list(path.glob("model-*-of-*.safetensors"))) > 1
    assert [b.self_attn.sliding_window for b in model.layers] == [None, 6]
  if name == "granite_swa":  # layer 1 windowed, without RoPE; sinks on both
    assert [(b.self_attn.sliding_window, b.self_attn.rope is None, b.self_attn.sinks is None)
            for b in model.layers] == [(None, False, False), (5, True, False)]
  if name == "ministral3":  # windowed and tempered on every layer
    assert [(b.self_attn.sliding_window, b.self_attn.query_temperature)
            for b in model.layers] == [(5, jax_paged.nn.QueryTemperature(8, 0.5))] * 2
  # Prompts ending inside, at and past a page boundary, to lengths 13, 18, 23: across
  # pages 2 and 3.
  assert_logits_track_hf(hf, model, [3, 8, 13], 10)


def test_greedy_generate_matches_hf(checkpoint):
  name, hf, path = checkpoint
  model = llama.from_pretrained(path)
  prompts = _prompts(np.random.default_rng(2), [1, 5, 9, 17])
  new = 12  # every prompt crosses a page boundary while decoding
  ours = jax_paged.generate(model, prompts, new, page_size=PAGE)
  assert ours == [_hf_generate(hf, p, new) for p in prompts], name


@pytest.mark.parametrize("name", ["llama", "mistral"])
def test_beam_search_matches_hf(saved, name):
  """Beam search over GQA with llama3 RoPE, and over a sliding window shorter than the
  sequences: Hugging Face's hypotheses and scores (f32, 1e-5)."""
  from test_beam_search import _hf_beams  # pylint: disable=import-outside-toplevel
  _, hf, path = saved(name)
  model = llama.from_pretrained(path)
  prompts = _prompts(np.random.default_rng(4), [1, 6, 11])
  settings = dict(beam_width=3, eos_token_id=[5, 6, 7], num_return_sequences=2)
  beams, _ = jax_paged.beam_search(model, prompts, 12, page_size=PAGE, **settings)
  for prompt, got in zip(prompts, beams):
    want = _hf_beams(hf, prompt, 12, **settings)
    assert [b.tokens for b in got] == [w[0] for w in want], name
    np.testing.assert_allclose([b.score for b in got], [w[1] for w in want], rtol=1e-5)


def assert_generate_and_engines_give_hfs_tokens(hf, model, engines: bool = True) -> None:
  """`jax_paged.generate` over prompts of 1-15 tokens (12 new each); with `engines`, also
  an engine preempting in a tiny pool, then the same engine (its compiled steps reused)
  over prompts sharing a cached prefix, a long one prefilled in chunks: HF's greedy
  tokens each."""
  rng = np.random.default_rng(2)
  prompts = _prompts(rng, [1, 7, 9, 15])
  want = [_hf_generate(hf, p, 12) for p in prompts]
  assert jax_paged.generate(model, prompts, 12, page_size=PAGE) == want
  if engines:
    eng = _preempting_engine(model)
    assert_preempting_engine_gives(model, prompts, want, eng)
    assert assert_prefix_cache_and_chunks_give_hfs_tokens(hf, model, rng, [4, 9],
                                                          eng) >= 2 * PAGE


def _preempting_engine(model) -> jax_paged.Engine:
  """An engine of 3 slots over 7 pages (12 new tokens for prompts of 1-15 preempt),
  prefilling in chunks of 16."""
  return jax_paged.Engine(model, max_batch=3, num_pages=7, page_size=PAGE, steps_per_call=4,
                          max_prefill_tokens=16)


def assert_preempting_engine_gives(model, prompts: list[list[int]], want: list[list[int]],
                                   engine: jax_paged.Engine | None = None) -> None:
  """`engine` (default: `_preempting_engine`'s) gives `want`, 12 new tokens per prompt,
  preempting, and every page back."""
  eng = engine or _preempting_engine(model)
  outputs, report = eng.generate([jax_paged.Request(p, 12) for p in prompts])
  assert outputs == want and report.preemptions > 0
  assert_pages_back(eng)


def assert_prefix_cache_and_chunks_give_hfs_tokens(hf, model, rng, suffixes: list[int],
                                                   engine: jax_paged.Engine | None = None
                                                   ) -> int:
  """Prompts sharing a prefix of 2 pages and 3 tokens (attached to cached pages, then
  prefilled from a rotated offset), with suffixes of these lengths, and a long one
  prefilled in chunks of 16, through `engine` (default: 2 slots over 32 pages): HF's
  greedy tokens. Returns the prompt tokens read from the cache."""
  system = _prompts(rng, [2 * PAGE + 3])[0]
  prompts = [system + p for p in _prompts(rng, suffixes)] + _prompts(rng, [40])
  eng = engine or jax_paged.Engine(model, max_batch=2, num_pages=32, page_size=PAGE,
                                   max_prefill_tokens=16)
  outputs, report = eng.generate([jax_paged.Request(p, 6) for p in prompts])
  assert outputs == [_hf_generate(hf, p, 6) for p in prompts]
  return report.cached_prompt_tokens


def test_engine_under_preemption_gives_generates_tokens(saved):
  _, _, path = saved("llama")
  model = llama.from_pretrained(path)
  prompts = _prompts(np.random.default_rng(3), [1, 7, 9, 15])
  assert_preempting_engine_gives(model, prompts,
                                 jax_paged.generate(model, prompts, 12, page_size=PAGE))


@pytest.mark.parametrize("name", ["llama", "mistral"])
def test_prefix_caching_and_chunked_prefill_give_hfs_tokens(saved, name):
  """`assert_prefix_cache_and_chunks_give_hfs_tokens`, also with Mistral's window shorter
  than the prefix."""
  _, hf, path = saved(name)
  model = llama.from_pretrained(path)
  cached = assert_prefix_cache_and_chunks_give_hfs_tokens(hf, model, np.random.default_rng(5),
                                                          [4, 9, 1])
  assert cached >= 2 * 2 * PAGE


def test_config_from_dict_reads_each_model_type_as_hf_does():
  base = dict(hidden_size=64, num_attention_heads=4, num_hidden_layers=3, vocab_size=10)
  # transformers 4 style: rope_theta and rope_scaling beside each other; eos as a list.
  c = llama.LlamaConfig.from_dict({**base, "model_type": "llama", "rope_theta": 5e5,
                                   "rope_scaling": {"type": "linear", "factor": 2.0},
                                   "eos_token_id": [5, 7], "sliding_window": 2})
  assert c.rope == jax_paged.nn.RotaryEmbedding(16, theta=5e5, rope_type="linear", factor=2.0)
  assert c.eos_token_id == (5, 7) and c.window(0) is None  # Llama ignores a window
  spec = nnx.eval_shape(lambda: llama.LlamaForCausalLM(c, rngs=nnx.Rngs(0))).spec
  assert spec.eos_token_ids == (5, 7)
  hash(c)  # a model's static structure
  c = llama.LlamaConfig.from_dict({**base, "model_type": "mistral", "sliding_window": 4,
                                   "attention_bias": True})
  assert [c.window(i) for i in range(3)] == [4, 4, 4] and not c.qkv_bias and not c.out_bias
  c = llama.LlamaConfig.from_dict({**base, "model_type": "qwen2", "sliding_window": 4,
                                   "use_sliding_window": False})
  assert c.window(2) is None and c.qkv_bias and not c.out_bias
  c = llama.LlamaConfig.from_dict({**base, "model_type": "qwen2", "sliding_window": 4,
                                   "use_sliding_window": True, "max_window_layers": 2})
  assert [c.window(i) for i in range(3)] == [None, None, 4]
  c = llama.LlamaConfig.from_dict({**base, "model_type": "qwen3", "attention_bias": True})
  assert c.head_dim == 128 and c.qkv_bias and c.out_bias and c.qk_norm  # HF's defaults
  assert c.window(2) is None
  c = llama.LlamaConfig.from_dict({**base, "model_type": "phi3", "sliding_window": 4,
                                   "attention_bias": True, "layer_types": ["x"]})
  assert [c.window(i) for i in range(3)] == [4, 4, 4] and not c.qkv_bias and not c.out_bias
  with pytest.raises(ValueError, match="rope_scaling type 'dynamic' is not supported"):
    llama.LlamaConfig.from_dict({**base, "rope_scaling": {"rope_type": "dynamic", "factor": 4}})
  c = llama.LlamaConfig.from_dict({**base, "rope_scaling": {"rope_type": "yarn", "factor": 4}})
  assert (c.rope.rope_type, c.rope.factor, c.rope.original_max_position_embeddings) == (
      "yarn", 4.0, c.max_position_embeddings)
  assert c.rope.attention_factor == pytest.approx(1 + 0.1 * np.log(4))
  # HF's reading of the type: rope_type before the older "type", "default" without either.
  c = llama.LlamaConfig.from_dict({**base, "rope_scaling": {"factor": 2.0}})
  assert (c.rope_scaling, c.rope.rope_type) == (None, "default")
  c = llama.LlamaConfig.from_dict({**base, "rope_scaling": {"rope_type": "linear",
                                                            "type": "default", "factor": 2.0}})
  assert (c.rope.rope_type, c.rope.factor) == ("linear", 2.0)
  # Phi-4-mini's RoPE on 3/4 of each head, as transformers 4 and 5 write it.
  for partial in ({"partial_rotary_factor": 0.75},
                  {"rope_parameters": {"rope_type": "default", "rope_theta": 1e4,
                                       "partial_rotary_factor": 0.75}}):
    c = llama.LlamaConfig.from_dict({**base, "model_type": "phi3", **partial})
    assert (c.rotary_dim, c.rope.rotary_dim, c.rope.rope_type) == (12, 12, "default")
  with pytest.raises(ValueError, match="partial_rotary_factor 0.7 of head_dim 16 rotates "
                                       "11 features"):
    llama.LlamaConfig.from_dict({**base, "partial_rotary_factor": 0.7})
  with pytest.raises(ValueError, match=r"partial_rotary_factor must be in \(0, 1\]"):
    llama.LlamaConfig.from_dict({**base, "partial_rotary_factor": 1.5})
  # LongRoPE (Phi-3's early name "su" too), its original context beside rope_scaling:
  # the short factors up to it (max_model_len's default), the long ones past it.
  longrope = {**base, "model_type": "phi3", "max_position_embeddings": 32768,
              "original_max_position_embeddings": 4096, "rope_scaling": {
                  "type": "su", "short_factor": [1.0] * 8, "long_factor": [2.0] * 8,
                  "original_max_position_embeddings": 1}}
  c = llama.LlamaConfig.from_dict(longrope)
  assert (c.max_model_len, c.rope.rope_type, c.rope.ext_factors) == (4096, "longrope",
                                                                      (1.0,) * 8)
  assert c.rope.attention_factor == pytest.approx(np.sqrt(1 + np.log(8) / np.log(4096)))
  c = llama.LlamaConfig.from_dict({**longrope, "max_model_len": 4097})
  assert (c.max_model_len, c.rope.ext_factors) == (4097, (2.0,) * 8)
  for bad, message in (({"max_model_len": 32769}, "max_model_len must be at most "
                                                   "max_position_embeddings=32768"),
                       ({"max_model_len": 0}, "max_model_len must be a positive int"),
                       ({"rope_scaling": {"rope_type": "longrope", "short_factor": [1.0]}},
                        r"longrope needs ext_factors: a tuple of 8"),
                       ({"rope_scaling": {"rope_type": "longrope"}},
                        "longrope rope_scaling needs a short_factor list")):
    with pytest.raises(ValueError, match=message):
      llama.LlamaConfig.from_dict({**longrope, **bad})
  # Granite's multipliers (their HF defaults 1.0); others' configs do not have them.
  granite = dict(embedding_multiplier=12.0, residual_multiplier=0.22,
                 attention_multiplier=0.0078125, logits_scaling=8)
  c = llama.LlamaConfig.from_dict({**base, "model_type": "granite", **granite,
                                   "attention_bias": False, "sliding_window": 3})
  assert (c.embedding_multiplier, c.residual_multiplier, c.attention_multiplier,
          c.logits_scaling, c.window(0)) == (12.0, 0.22, 0.0078125, 8.0, None)
  c = llama.LlamaConfig.from_dict({**base, "model_type": "llama", **granite})
  assert (c.embedding_multiplier, c.residual_multiplier, c.attention_multiplier,
          c.logits_scaling) == (1.0, 1.0, None, 1.0)
  for bad, message in ((dict(logits_scaling=0), "logits_scaling must be a positive finite"),
                       (dict(embedding_multiplier=float("nan")), "embedding_multiplier must"),
                       (dict(attention_multiplier=-1.0), "attention_multiplier must be"),
                       (dict(attention_bias=True), "residual_multiplier 0.22 with "
                                                   "attention_bias or mlp_bias")):
    with pytest.raises(ValueError, match=message):
      llama.LlamaConfig.from_dict({**base, "model_type": "granite", **granite, **bad})
  # SmolLM3: HF's defaults (a NoPE layer every fourth, windows on NoPE layers only,
  # its RoPE base, tied head), as HF's config reads the same dict.
  smol = {**base, "model_type": "smollm3", "num_hidden_layers": 8, "attention_bias": True,
          "use_sliding_window": True, "sliding_window": 4}
  c = llama.LlamaConfig.from_dict(smol)
  hf = transformers.SmolLM3Config(**smol)
  assert c.no_rope_layers == tuple(hf.no_rope_layers) == (1, 1, 1, 0, 1, 1, 1, 0)
  assert [c.window(i) for i in range(8)] == [4 if t == "sliding_attention" else None
                                             for t in hf.layer_types]
  assert [c.layer_rope(i) is None for i in range(8)] == [not x for x in hf.no_rope_layers]
  assert c.rope.theta == hf.rope_parameters["rope_theta"] == 2e6
  assert c.tie_word_embeddings and c.qkv_bias and c.out_bias
  with pytest.raises(ValueError, match="no_rope_layers must give 1 .* for each of the 8"):
    llama.LlamaConfig.from_dict({**smol, "no_rope_layers": [1, 2] * 4})
  # Seed-OSS: q/k/v biases from attention_bias, o's from attention_out_bias; an empty
  # config HF's SeedOssConfig defaults (Seed-OSS-36B's shape).
  seed = {**base, "model_type": "seed_oss", "num_key_value_heads": 2}
  c = llama.LlamaConfig.from_dict({**seed, "attention_bias": True})
  assert c.qkv_bias and not c.out_bias and c.head_dim == 128
  assert llama.LlamaConfig.from_dict({**seed, "attention_out_bias": True}).out_bias
  c, hf = llama.LlamaConfig.from_dict({"model_type": "seed_oss"}), transformers.SeedOssConfig()
  assert (c.vocab_size, c.hidden_size, c.intermediate_size, c.num_hidden_layers,
          c.num_attention_heads, c.num_key_value_heads, c.head_dim, c.rms_norm_eps,
          c.max_position_embeddings, c.eos_token_id, c.qkv_bias, c.out_bias, c.mlp_bias,
          c.rope_theta) == (
              hf.vocab_size, hf.hidden_size, hf.intermediate_size, hf.num_hidden_layers,
              hf.num_attention_heads, hf.num_key_value_heads, hf.head_dim, hf.rms_norm_eps,
              hf.max_position_embeddings, hf.eos_token_id, hf.attention_bias,
              hf.attention_out_bias, hf.mlp_bias, hf.rope_parameters["rope_theta"])
  # Ministral: windows on its layer_types' sliding layers, on every layer without them.
  c = llama.LlamaConfig.from_dict({**base, "model_type": "ministral", "sliding_window": 4,
                                   "layer_types": ["full_attention", "sliding_attention",
                                                   "full_attention"],
                                   "attention_bias": True})
  assert (c.window(0), c.window(1), c.window(2), c.qkv_bias) == (None, 4, None, False)
  c = llama.LlamaConfig.from_dict({**base, "model_type": "ministral", "sliding_window": 4})
  assert (c.window(0), c.window(1)) == (4, 4)
  # CWM and IQuest-Coder: HF's defaults (CWM's RoPE, eos ids and layer_types); IQuest-Coder
  # refusing what HF's refuses.
  for model_type, config_class in (("cwm", transformers.CwmConfig),
                                   ("iquestcoder", transformers.IQuestCoderConfig)):
    c, hf = llama.LlamaConfig.from_dict({"model_type": model_type}), config_class()
    window = getattr(hf, "sliding_window", None)
    assert (c.vocab_size, c.hidden_size, c.intermediate_size, c.num_hidden_layers,
            c.num_attention_heads, c.num_key_value_heads, c.head_dim, c.rms_norm_eps,
            c.max_position_embeddings, c.bos_token_id, c.eos_token_id, c.rope_theta,
            [c.window(i) for i in range(8)]) == (
                hf.vocab_size, hf.hidden_size, hf.intermediate_size, hf.num_hidden_layers,
                hf.num_attention_heads, hf.num_key_value_heads, hf.head_dim, hf.rms_norm_eps,
                hf.max_position_embeddings, hf.bos_token_id,
                tuple(hf.eos_token_id) if isinstance(hf.eos_token_id, list) else hf.eos_token_id,
                hf.rope_parameters["rope_theta"],
                [window if t == "sliding_attention" else None
                 for t in getattr(hf, "layer_types", ["full_attention"] * 8)[:8]]), model_type
  assert dict(llama.LlamaConfig.from_dict({"model_type": "cwm"}).rope_scaling)["rope_type"] == (
      "llama3")
  with pytest.raises(ValueError, match="clip_qkv 8.0 is not supported for IQuest-Coder"):
    llama.LlamaConfig.from_dict({"model_type": "iquestcoder", "clip_qkv": 8.0})
  # InternLM3: its config.json's bias names (qkv_bias, bias); HF's InternLM3Config defaults.
  intern = {**base, "model_type": "internlm3", "num_key_value_heads": 2}
  c = llama.LlamaConfig.from_dict({**intern, "qkv_bias": True, "bias": True})
  assert c.qkv_bias and c.out_bias and c.mlp_bias and c.head_dim == 128
  with pytest.raises(ValueError, match="InternLM3 with qkv_bias different from bias"):
    llama.LlamaConfig.from_dict({**intern, "qkv_bias": True})
  c, hf = llama.LlamaConfig.from_dict({"model_type": "internlm3"}), transformers.InternLM3Config()
  assert (c.vocab_size, c.hidden_size, c.intermediate_size, c.num_hidden_layers,
          c.num_attention_heads, c.num_key_value_heads, c.head_dim, c.rms_norm_eps,
          c.max_position_embeddings, c.bos_token_id, c.eos_token_id, c.qkv_bias,
          c.mlp_bias, c.tie_word_embeddings, c.rope_theta) == (
              hf.vocab_size, hf.hidden_size, hf.intermediate_size, hf.num_hidden_layers,
              hf.num_attention_heads, hf.num_key_value_heads, hf.head_dim, hf.rms_norm_eps,
              hf.max_position_embeddings, hf.bos_token_id, hf.eos_token_id,
              hf.attention_bias, hf.mlp_bias, hf.tie_word_embeddings,
              hf.rope_parameters["rope_theta"])
  with pytest.raises(ValueError, match="model_type 'gemma' is not supported"):
    llama.LlamaConfig.from_dict({**base, "model_type": "gemma"})
  with pytest.raises(ValueError, match="hidden_act 'gelu' is not supported"):
    llama.LlamaConfig.from_dict({**base, "hidden_act": "gelu"})


def test_mistral3_image_text_checkpoints_load_their_text_model(tmp_path):
  """Mistral3ForConditionalGeneration ("mistral3": Ministral 3, Mistral Small 3.x) saved
  with a (tiny) Pixtral vision tower: its text model (Ministral 3's here: the YaRN RoPE and
  the queries' llama_4_scaling) loads alone under language_model.*, HF's text logits; its
  default ministral3 RoPE (HF's); Mistral Small's "mistral" text_config; errors."""
  text = {**_COMMON, **MODELS["ministral3"][2], "model_type": "ministral3"}
  del text["attn_implementation"]
  vision = dict(hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                num_attention_heads=2, head_dim=8, image_size=32, patch_size=16)
  torch.manual_seed(0)
  hf = randomised(transformers.Mistral3ForConditionalGeneration(transformers.Mistral3Config(
      text_config=text, vision_config=vision, image_token_index=VOCAB - 1)))
  hf.save_pretrained(tmp_path)
  model = llama.from_pretrained(tmp_path)
  assert model.config.model_type == "ministral3"
  assert model.layers[0].self_attn.query_temperature == jax_paged.nn.QueryTemperature(8, 0.5)
  assert_logits_track_hf(hf, model, [3, 13], 6)
  c = llama.LlamaConfig.from_dict({"model_type": "mistral3", "text_config": {
      "model_type": "ministral3"}, "eos_token_id": 7})
  want = transformers.Ministral3Config()
  assert (c.rope_theta, dict(c.rope_scaling)["factor"], c.llama_4_scaling_beta,
          c.hidden_size, c.eos_token_id) == (
              want.rope_parameters["rope_theta"], want.rope_parameters["factor"],
              want.rope_parameters["llama_4_scaling_beta"], want.hidden_size, 7)
  small = llama.LlamaConfig.from_dict({"model_type": "mistral3", "text_config": {
      "hidden_size": 64, "num_attention_heads": 4, "head_dim": 16, "rope_theta": 1e9,
      "sliding_window": None, "vocab_size": 10}})
  assert (small.model_type, small.query_temperature, small.rope_theta) == ("mistral", None, 1e9)
  with pytest.raises(ValueError, match="text_config model_type must be 'mistral' or"):
    llama.LlamaConfig.from_dict({"model_type": "mistral3", "text_config": {"model_type": "llama"}})
  with pytest.raises(ValueError, match="text_config must be a dict"):
    llama.LlamaConfig.from_dict({"model_type": "mistral3", "text_config": "ministral3"})


def test_from_pretrained_errors(saved, tmp_path):
  _, _, path = saved("qwen2")  # sharded: its files give both layouts' errors
  config = json.loads((path / "config.json").read_text())
  with pytest.raises(FileNotFoundError, match="config.json"):
    llama.from_pretrained(tmp_path)
  (tmp_path / "config.json").write_text(json.dumps({**config, "model_type": "gpt_neox"}))
  with pytest.raises(ValueError, match=r"config.json: model_type 'gpt_neox' is not supported"):
    llama.from_pretrained(tmp_path)
  # Pre-quantized checkpoints other than block-scaled fp8 (`test_fp8_checkpoint_...`).
  for quantization in ({"quant_method": "gptq", "bits": 4},
                       {"quant_method": "fp8", "weight_block_size": None}):
    (tmp_path / "config.json").write_text(json.dumps({**config,
                                                      "quantization_config": quantization}))
    with pytest.raises(ValueError, match=r"config.json: pre-quantized checkpoints .*"
                                         f"quant_method '{quantization['quant_method']}'"
                                         r"\) are not supported but block-scaled fp8's"):
      llama.from_pretrained(tmp_path)
  (tmp_path / "config.json").write_text(json.dumps(config))
  with pytest.raises(FileNotFoundError, match="model.safetensors or "
                                              "model.safetensors.index.json"):
    llama.from_pretrained(tmp_path)

  # A sharded checkpoint: a shard missing, truncated, or not holding what the index says.
  index = json.loads((path / "model.safetensors.index.json").read_text())
  shards = sorted(set(index["weight_map"].values()))
  for shard in shards:
    (tmp_path / shard).write_bytes((path / shard).read_bytes())
  (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
  assert isinstance(llama.from_pretrained(tmp_path), llama.LlamaForCausalLM)
  (tmp_path / shards[1]).unlink()
  with pytest.raises(FileNotFoundError, match=f"{shards[1]}: listed in .*index.json but "
                                              "missing"):
    llama.from_pretrained(tmp_path)
  data = (path / shards[1]).read_bytes()
  (tmp_path / shards[1]).write_bytes(data[:len(data) // 2])
  with pytest.raises(ValueError, match=f"{shards[1]}: not a readable safetensors file"):
    llama.from_pretrained(tmp_path)
  (tmp_path / shards[1]).write_bytes(data)
  moved = next(n for n, f in index["weight_map"].items() if f == shards[0])
  bad = {**index, "weight_map": {**index["weight_map"], moved: shards[1]}}
  (tmp_path / "model.safetensors.index.json").write_text(json.dumps(bad))
  with pytest.raises(ValueError, match=f"places '{moved}' in .*{shards[1]}, which does not "
                                       "hold it"):
    llama.from_pretrained(tmp_path)

  # One file: a weight missing, or shaped for other hyperparameters.
  for shard in shards:
    (tmp_path / shard).unlink()
  (tmp_path / "model.safetensors.index.json").unlink()
  tensors = {}
  for shard in shards:
    tensors.update(load_file(path / shard))
  del tensors["model.layers.1.self_attn.k_proj.bias"]
  save_file(tensors, tmp_path / "model.safetensors")
  with pytest.raises(ValueError, match=r"'model.layers.1.self_attn.k_proj.bias' is missing"):
    llama.from_pretrained(tmp_path)
  (tmp_path / "config.json").write_text(json.dumps({**config, "num_key_value_heads": 4}))
  with pytest.raises(ValueError, match=r"q_proj.bias \(64,\) \+ model.layers.0.self_attn."
                                       r"k_proj.bias \(16,\) \+ model.layers.0.self_attn."
                                       r"v_proj.bias \(16,\) gives shape \(96,\), expected "
                                       r"\(128,\)"):
    llama.from_pretrained(tmp_path)


def test_fp8_checkpoint_loads_dequantized(saved, tmp_path):
  """A checkpoint of HF's block-scaled fp8 (DeepSeek-V3's and Qwen3-*-FP8's layout: each
  projection float8_e4m3fn with a weight_scale_inv per block, here blocks of 24 x 40 that
  leave partial blocks at the edges) loads each weight as its blocks times their scales:
  the logits of HF's model holding those dequantized weights. A missing scale is named."""
  from safetensors.torch import save_file
  _, hf, path = saved("llama")
  rows, cols = 24, 40
  tensors, dequantized = {}, {}
  for name, w in hf.state_dict().items():
    if not name.endswith("_proj.weight"):
      tensors[name] = w.contiguous()
      continue
    blocks = torch.zeros(-(-w.shape[0] // rows), -(-w.shape[1] // cols))
    for i in range(blocks.shape[0]):
      for j in range(blocks.shape[1]):
        block = w[i * rows:(i + 1) * rows, j * cols:(j + 1) * cols]
        blocks[i, j] = block.abs().max() / 448.0
    scale = blocks.repeat_interleave(rows, 0).repeat_interleave(cols, 1)[:w.shape[0],
                                                                        :w.shape[1]]
    narrow = (w / scale).to(torch.float8_e4m3fn)
    tensors[name], tensors[f"{name}_scale_inv"] = narrow, blocks
    dequantized[name] = narrow.float() * scale
  save_file(tensors, tmp_path / "model.safetensors")
  config = json.loads((path / "config.json").read_text())
  (tmp_path / "config.json").write_text(json.dumps({**config, "quantization_config": {
      "quant_method": "fp8", "weight_block_size": [rows, cols],
      "activation_scheme": "dynamic"}}))
  model = llama.from_pretrained(tmp_path)
  reference = _hf_model("llama")
  assert not torch.equal(dequantized["model.layers.0.self_attn.q_proj.weight"],
                         reference.state_dict()["model.layers.0.self_attn.q_proj.weight"])
  reference.load_state_dict(dequantized, strict=False)
  assert_logits_track_hf(reference, model, [3, 9], 2)
  del tensors["model.layers.1.mlp.down_proj.weight_scale_inv"]
  save_file(tensors, tmp_path / "model.safetensors")
  with pytest.raises(ValueError, match="float8 weight 'model.layers.1.mlp.down_proj.weight' "
                                       "has no 'model.layers.1.mlp.down_proj.weight_scale_inv'"):
    llama.from_pretrained(tmp_path)


def test_from_pretrained_takes_generation_configs_eos_ids(saved, tmp_path):
  """HF's generate stops on generation_config.json's eos ids (Phi-3's chat turns end with
  <|end|>, which config.json does not list): so do we."""
  _, _, path = saved("phi3")
  for file in path.iterdir():
    (tmp_path / file.name).write_bytes(file.read_bytes())
  config = json.loads((tmp_path / "config.json").read_text())
  (tmp_path / "config.json").write_text(json.dumps({**config, "eos_token_id": 9}))
  generation = tmp_path / "generation_config.json"
  generation.write_text(json.dumps({"eos_token_id": [9, 17]}))
  assert llama.from_pretrained(tmp_path).spec.eos_token_ids == (9, 17)
  generation.write_text(json.dumps({"do_sample": True}))  # no eos: config.json's
  assert llama.from_pretrained(tmp_path).spec.eos_token_ids == (9,)
  generation.write_text("[1, 2]")
  with pytest.raises(ValueError, match="generation_config.json: not a JSON object"):
    llama.from_pretrained(tmp_path)


def test_from_pretrained_bf16(saved):
  _, hf, path = saved("llama")
  assert_bf16_tracks_hf(hf, llama.from_pretrained(path, dtype=jnp.bfloat16))


def assert_lora_adapters_match_peft(make_hf, load, target_modules, tmp_path) -> None:
  """Random rank-4 PEFT adapters on `target_modules` of `make_hf()`'s model (PEFT's module
  names): an engine serving them over `load(its base directory)` gives the greedy tokens
  of the adapter merged into HF's weights."""
  peft = pytest.importorskip("peft")
  base = tmp_path / "base"
  make_hf().save_pretrained(base)
  torch.manual_seed(1)
  tuned = peft.get_peft_model(make_hf(), peft.LoraConfig(
      r=4, lora_alpha=8, init_lora_weights=False, target_modules=list(target_modules)))
  tuned.save_pretrained(tmp_path / "adapter")
  merged = tuned.merge_and_unload().eval()
  engine = jax_paged.Engine(load(base), max_batch=4, num_pages=32, page_size=8, max_loras=1,
                            max_lora_rank=4)
  engine.add_lora("a", str(tmp_path / "adapter"))
  prompts = _prompts(np.random.default_rng(3), [5, 11])
  outputs, _ = engine.generate([jax_paged.Request(p, 8, lora="a") for p in prompts])
  assert outputs == [_hf_generate(merged, p, 8) for p in prompts]


def assert_bf16_tracks_hf(hf, half, f32_params: tuple[str, ...] = ()) -> None:
  """`half`, loaded in bf16 (but for the parameters named by `f32_params`, kept in f32 as
  HF keeps them), against HF's f32 logits of a prompt: within bf16's error."""
  for path, x in jax.tree_util.tree_leaves_with_path(nnx.state(half)):
    f32 = any(name in jax.tree_util.keystr(path) for name in f32_params)
    assert x.dtype == (jnp.float32 if f32 else jnp.bfloat16), path
  prompt = _prompts(np.random.default_rng(4), [9])[0]
  kv = half.spec.create_pool(num_pages=2, page_size=PAGE, max_seqs=1, max_pages_per_seq=2)
  logits, _ = ModelRunner(half).prefill(kv, *_padded([prompt]), np.array([0], np.int32))
  want = _hf_last_logits(hf, [prompt])[0]
  np.testing.assert_allclose(logits[0], want, atol=0.1 * np.abs(want).max())


# Phi-4-mini's heads: 128 features, RoPE on 96 of them, LongRoPE's short factors.
_PHI4_MINI_HEADS = dict(hidden_size=1024, head_dim=128, rope_scaling={
    "rope_type": "longrope", "short_factor": np.linspace(1.0, 3.0, 48).tolist(),
    "long_factor": np.linspace(1.0, 60.0, 48).tolist()})


@pytest.mark.gpu
@pytest.mark.parametrize("name, overrides", [
    ("llama", dict(head_dim=64)), ("mistral", dict(head_dim=64)),
    ("phi3", dict(head_dim=96, partial_rotary_factor=1.0, rope_scaling=None)),
    ("phi3", _PHI4_MINI_HEADS), ("granite", dict(head_dim=64)),
    ("smollm3", dict(head_dim=64))])
def test_triton_decode_matches_reference_and_hf_on_gpu(name, overrides, tmp_path):
  """f32, head dims the Triton kernels take (Phi-3-mini's 96; Phi-4-mini's 128 with RoPE
  on 96): the decode attention kernel (with Mistral's and Phi-3's windows, Granite's score
  scale), the q/k/v GEMM kernel and the cache-write kernel behind RoPE (on SmolLM3's NoPE
  layer the fused projection that writes K/V straight into the pages) give the reference
  path's and HF's greedy tokens."""
  hf = _hf_model(name, **overrides)
  hf.save_pretrained(tmp_path)
  assert_kernels_give_references_and_hfs_tokens(hf, functools.partial(
      llama.from_pretrained, tmp_path))


def assert_kernels_give_references_and_hfs_tokens(hf, load) -> None:
  """Greedy tokens of `load(decode_impl=...)`'s model, f32 at the highest precision: the
  kernel path's equal the reference path's and HF's."""
  prompts = _prompts(np.random.default_rng(8), [1, 8, 23, 40])
  with jax.default_matmul_precision("highest"):
    kernel = jax_paged.generate(load(decode_impl="kernel"), prompts, 24, page_size=16)
    ref = jax_paged.generate(load(decode_impl="reference"), prompts, 24, page_size=16)
  assert kernel == ref
  assert kernel == [_hf_generate(hf, p, 24) for p in prompts]


@pytest.mark.gpu
def test_bf16_logits_close_to_hf_on_gpu(tmp_path):
  """bf16 on a GPU (cuDNN prompt attention with Mistral's window, the Triton decode path)
  against HF in f32: every step's logits within bf16's error."""
  hf = _hf_model("mistral", head_dim=64)
  hf.save_pretrained(tmp_path)
  model = llama.from_pretrained(tmp_path, dtype=jnp.bfloat16)
  runner = ModelRunner(model)
  rng = np.random.default_rng(9)
  seqs = _prompts(rng, [4, 17, 30])
  kv = model.spec.create_pool(num_pages=16, page_size=16, max_seqs=3, max_pages_per_seq=4)
  seq_ids = np.arange(3, dtype=np.int32)
  logits, kv = runner.prefill(kv, *_padded(seqs), seq_ids)
  for step in range(8):
    want = _hf_last_logits(hf, seqs)
    np.testing.assert_allclose(logits, want, atol=0.05 * np.abs(want).max(),
                               err_msg=f"step {step}")
    nxt = rng.integers(1, VOCAB, 3)
    seqs = [s + [int(t)] for s, t in zip(seqs, nxt)]
    logits, kv = runner.decode(kv, jnp.asarray(nxt, jnp.int32), seq_ids)


# ----------------------------------------------------------------- CLI
FAMILIES = [gpt2.FAMILY, llama.FAMILY]


def assert_installed_cli_gives_hfs_tokens(hf, path, capsys, seed: int) -> None:
  """jax-paged-generate on the checkpoint `path` through the installed families (entry
  points: the `model_type` must find its family): HF's greedy tokens for a random
  prompt."""
  prompt = _prompts(np.random.default_rng(seed), [7])[0]
  families = cli.model_families()
  status = cli.run(cli.parse_args(["--checkpoint", str(path), "--prompt-ids",
                                   ",".join(map(str, prompt)), "--max-new-tokens", "8",
                                   "--no-progress"], families), families)
  out = capsys.readouterr().out
  assert status == 0
  assert [int(t) for t in out.splitlines()[1].split(",")] == _hf_generate(hf, prompt, 8)


def _cli(capsys, *args) -> tuple[int, str, str]:
  """`jax-paged-generate ARGS` in this process with the gpt2 and llama families (the
  installed entry points may predate the llama one): (exit status, stdout, stderr)."""
  try:
    status = cli.run(cli.parse_args(list(args), FAMILIES), FAMILIES)
  except cli.CLIError as e:
    print(f"jax-paged-generate: error: {e}", file=__import__("sys").stderr)
    status = 2
  captured = capsys.readouterr()
  return status, captured.out, captured.err


def test_cli_tiny_llama(capsys):
  status, out, err = _cli(capsys, "--model", "tiny-llama", "--prompt", "Hello, pages",
                          "--max-new-tokens", "9", "--no-progress")
  assert status == 0, err
  assert "tiny-llama with RANDOM weights" in err and "UTF-8 bytes" in err
  assert "2 kv heads of 64" in err
  assert "generated tokens: 9" in out and "tokens/s" in out.splitlines()[-1]


def test_cli_checkpoint_with_tokenizer_json_and_eos_list(capsys, tmp_path):
  """A Llama checkpoint with a tokenizer.json is picked by its model_type and prompted in
  text; with no tokenizer, by token ids, stopping at any id of config.json's eos list."""
  tokenizers = pytest.importorskip("tokenizers")
  tok = tokenizers.Tokenizer(tokenizers.models.BPE())
  tok.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel()
  tok.decoder = tokenizers.decoders.ByteLevel()
  tok.train_from_iterator(["the paged cache holds the pages of every sequence"] * 20,
                          tokenizers.trainers.BpeTrainer(vocab_size=VOCAB))
  hf = _hf_model("llama")
  hf.save_pretrained(tmp_path)
  tok.save(str(tmp_path / "tokenizer.json"))
  status, out, err = _cli(capsys, "--checkpoint", str(tmp_path), "--prompt", "the pages",
                          "--max-new-tokens", "6", "--ignore-eos", "--no-progress")
  assert status == 0, err
  assert f"checkpoint {tmp_path}" in err and f"tokenizer of {tmp_path}" in err
  assert "generated tokens: 6" in out

  (tmp_path / "tokenizer.json").unlink()
  args = ("--checkpoint", str(tmp_path), "--prompt-ids", "5,6,7", "--max-new-tokens", "10",
          "--no-progress")
  status, out, err = _cli(capsys, *args, "--ignore-eos")
  assert status == 0, err
  ids = [int(t) for t in out.splitlines()[1].split(",")]
  assert ids == _hf_generate(hf, [5, 6, 7], 10)
  stop = ids[3]
  config = json.loads((tmp_path / "config.json").read_text())
  (tmp_path / "config.json").write_text(json.dumps({**config, "eos_token_id": [299, stop]}))
  status, out, err = _cli(capsys, *args)
  assert status == 0, err
  assert [int(t) for t in out.splitlines()[1].split(",")] == ids[:ids.index(stop) + 1]


def test_cli_names_unsupported_and_broken_checkpoints(capsys, tmp_path):
  (tmp_path / "config.json").write_text('{"model_type": "falcon"}')
  status, _, err = _cli(capsys, "--checkpoint", str(tmp_path), "--prompt", "x")
  supported = ", ".join(sorted(("gpt2",) + llama.MODEL_TYPES))
  assert status == 2 and f"model_type 'falcon' is not supported (supported: {supported})" in err
  _hf_model("mistral").save_pretrained(tmp_path)
  weights = tmp_path / "model.safetensors"
  weights.write_bytes(weights.read_bytes()[:100])
  status, _, err = _cli(capsys, "--checkpoint", str(tmp_path), "--prompt-ids", "1")
  assert status == 2 and f"{weights}: not a readable safetensors file" in err
