"""Weight-only int8 quantization (`jax_paged.weight_quant`, `--quantization int8`).

The quantizer's error bound; the linear kernels (Pallas interpret mode) with int8
weights against the XLA reference and against the dequantized float weights; a quantized
model served by the engine against its dequantized twin (every linear's weights replaced
by q * scale in float32: the same function, computed another way), GPT-2 and a GQA Llama
loaded from Hugging Face checkpoints; LoRA on top; the CLI; bad inputs.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import jax_paged
from jax_paged import lora, weight_quant
from jax_paged import pool as pool_lib
from jax_paged.kernels import linear
from models import gpt2, llama
from tests.test_lora import VOCAB, hf_base

PAGE = 8


def _rng_array(rng, shape, dtype=jnp.float32, scale=1.0):
  return jnp.asarray(scale * rng.standard_normal(shape), dtype)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_quantize_keeps_each_weight_within_half_a_step_of_its_column(dtype):
  rng = np.random.default_rng(0)
  w = np.array(_rng_array(rng, (40, 24), dtype), np.float32)
  w[:, 3] = 0.0  # an all-zero column: scale 1, zeros
  w[7, 5] = 50.0  # an outlier sets its own column's step only
  q, scale = weight_quant.quantize(jnp.asarray(w, dtype))
  q, scale = np.asarray(q), np.asarray(scale)
  assert q.dtype == np.int8 and scale.dtype == np.float32 and scale.shape == (24,)
  assert np.abs(q).max() <= 127 and (np.abs(q).max(axis=0)[np.abs(w).max(0) > 0] == 127).all()
  np.testing.assert_allclose(scale, np.where(np.abs(w).max(0) > 0, np.abs(w).max(0) / 127, 1),
                             rtol=1e-6)
  assert (q[:, 3] == 0).all()
  assert (np.abs(q * scale - w) <= scale / 2 * (1 + 1e-6)).all()
  assert np.abs(q[:, 0] * scale[0] - w[:, 0]).max() < 0.05 * np.abs(w[:, 0]).max()


@pytest.mark.parametrize("transposed", [False, True])
@pytest.mark.parametrize("dtype,tol", [(jnp.float32, 1e-5), (jnp.bfloat16, 2e-2)])
def test_linear_kernels_with_int8_weights_match_the_reference(dtype, tol, transposed):
  """`linear` (bias, tanh-gelu, q/k/v sections, a low-rank update) and `linear_partials`
  in interpret mode, the kernel [K, N] or transposed [N, K]: equal to XLA's product of the
  same int8 weights, and (f32) to x @ the dequantized weights."""
  rng = np.random.default_rng(1)
  x = _rng_array(rng, (5, 96), dtype)
  q, scale = weight_quant.quantize(_rng_array(rng, (96, 192)))
  stored = q.T if transposed else q
  bias = _rng_array(rng, (192,), dtype)
  low_rank = (_rng_array(rng, (5, 16), dtype), _rng_array(rng, (16, 192), dtype, 0.1))
  gelu = jax.nn.gelu  # tanh approximation: lowered in the kernel
  want = linear.linear_reference(x, q, bias, activation=gelu, low_rank=low_rank, scale=scale)
  got = linear.linear(x, stored, bias, activation=gelu, low_rank=low_rank, scale=scale,
                      sections=(64, 64, 64), interpret=True, transposed=transposed)
  np.testing.assert_allclose(np.concatenate([np.asarray(g, np.float32) for g in got], -1),
                             np.asarray(want, np.float32), rtol=tol, atol=tol)
  parts = linear.linear_partials(x, stored, scale=scale, splits=3, interpret=True,
                                 transposed=transposed)
  assert parts.shape[0] > 1
  want = linear.scaled_product(x, q, scale)
  np.testing.assert_allclose(parts.sum(0), want, rtol=tol, atol=tol)
  np.testing.assert_allclose(linear.scaled_product(x, stored, scale, transposed), want,
                             rtol=1e-6, atol=1e-6)
  if dtype == jnp.float32:
    dequantized = q.astype(jnp.float32) * scale
    np.testing.assert_allclose(want, jnp.dot(x, dequantized, precision="highest"), rtol=1e-5,
                               atol=1e-5)


def test_int8_transposed_tiles_step_deeper():
  """An int8 [N, K] kernel's programs: 32 columns of 256-deep steps, or a wide output's 128
  columns 128 deep up to 16 rows (64 past them), 4 warps; split-K at a long K in 4 units
  up to 16 rows, 8 past them; a bf16 kernel's tiles unchanged."""
  assert linear.whole_k_tiles(1, 4096, 6144, 2, int8_transposed=True) == (16, 32, 256, 4)
  assert linear.whole_k_tiles(1, 768, 2304, 2, (768,) * 3, int8_transposed=True) == (
      16, 32, 256, 4)
  assert linear.whole_k_tiles(16, 4096, 28672, 2, (14336,) * 2,
                              int8_transposed=True) == (16, 128, 128, 4)
  assert linear.whole_k_tiles(64, 4096, 28672, 2, int8_transposed=True) == (64, 128, 64, 4)
  assert linear.whole_k_tiles(1, 4096, 6144, 2) == (16, 32, 128, 4)
  # f32 activations at 64 rows: 256-deep steps would not fit shared memory.
  assert linear.whole_k_tiles(64, 4096, 6144, 4, int8_transposed=True).block_k == 128
  assert linear.default_splits(14336, 4096, 64, int8_transposed=True) == 8
  assert linear.default_splits(14336, 4096, 1, int8_transposed=True) == 4


@pytest.mark.parametrize("rows", [3, 40])
def test_int8_transposed_long_k_tiles_match_the_reference(rows):
  """At a long K (2048: the int8 [N, K] tile rules), the whole-K and split-K kernels in
  interpret mode equal XLA's product of the same weights (f32)."""
  rng = np.random.default_rng(9)
  x = _rng_array(rng, (rows, 2048))
  q, scale = weight_quant.quantize(_rng_array(rng, (2048, 96)))
  bias = _rng_array(rng, (96,))
  want = linear.linear_reference(x, q, bias, scale=scale)
  got = linear.linear(x, q.T, bias, scale=scale, interpret=True, transposed=True)
  np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-4)
  parts = linear.linear_partials(x, q.T, scale=scale, interpret=True, transposed=True)
  assert parts.shape[0] == (4 if rows <= 16 else 8)
  np.testing.assert_allclose(parts.sum(0), linear.scaled_product(x, q, scale), rtol=1e-5,
                             atol=1e-4)


@pytest.mark.parametrize("transposed", [False, True])
def test_fused_projection_and_kv_write_with_int8_weights(transposed):
  """`pool.project_write_kv` with int8 weights ([K, N] or [N, K]): the Pallas kernel
  (interpret mode) gives the XLA path's q and pool, every other slot of the (random,
  nonzero) pool untouched."""
  rng = np.random.default_rng(2)
  heads, kv_heads, d = 4, 2, 32
  kv = pool_lib.KVPool.create(num_layers=2, num_kv_heads=kv_heads, head_dim=d, num_pages=6,
                              page_size=PAGE, max_seqs=3, max_pages_per_seq=2,
                              dtype=jnp.float32)
  kv = kv.replace(k_pages=_rng_array(rng, kv.k_pages.shape),
                  v_pages=_rng_array(rng, kv.v_pages.shape))
  kv, slots = pool_lib.reserve_or_raise(kv, jnp.arange(3), jnp.array([1, 1, 1]))
  slots = slots[:, 0]
  x = _rng_array(rng, (3, 64))
  q, scale = weight_quant.quantize(_rng_array(rng, (64, (heads + 2 * kv_heads) * d)))
  bias = _rng_array(rng, (q.shape[1],))
  q = q.T if transposed else q
  outs = [pool_lib.project_write_kv(kv, 1, slots, x, q, bias, q_width=heads * d,
                                    interpret=mode, scale=scale, transposed=transposed)
          for mode in (None, True)]
  np.testing.assert_allclose(outs[1][0], outs[0][0], rtol=1e-5, atol=1e-5)
  for name in ("k_pages", "v_pages"):
    np.testing.assert_allclose(getattr(outs[1][1], name), getattr(outs[0][1], name),
                               rtol=1e-5, atol=1e-5)
  untouched = np.ones(kv.k_pages.shape, bool)
  untouched[1] = False
  np.testing.assert_array_equal(np.asarray(outs[1][1].k_pages)[untouched],
                                np.asarray(kv.k_pages)[untouched])


def _dequantized_twin(model: nnx.Module) -> nnx.Module:
  """A float32 copy of a quantized model whose linears hold q * scale (plain nnx.Linear)."""
  twin = nnx.clone(model)
  for path, node in list(nnx.iter_graph(twin)):
    if isinstance(node, weight_quant.Int8Linear):
      plain = nnx.Linear(node.in_features, node.out_features, use_bias=node.bias is not None,
                         dtype=node.dtype, param_dtype=jnp.float32, rngs=nnx.Rngs(0))
      plain.kernel[...] = weight_quant.dequantize(node)
      if node.bias is not None:
        plain.bias[...] = node.bias[...]
      parent = twin
      for key in path[:-1]:
        parent = parent[key] if isinstance(key, int) else getattr(parent, key)
      if isinstance(path[-1], int):
        parent[path[-1]] = plain
      else:
        setattr(parent, path[-1], plain)
  return twin


@pytest.fixture(scope="module", params=["gpt2", "llama"])
def quantized(request, tmp_path_factory):
  """(a model loaded from a Hugging Face checkpoint and quantized, its dequantized
  twin)."""
  kind = request.param
  path = str(tmp_path_factory.mktemp(kind))
  hf_base(kind).save_pretrained(path)
  int8 = (gpt2 if kind == "gpt2" else llama).from_pretrained(path)
  # Per layer: GPT-2's c_attn, attn.c_proj, c_fc, mlp.c_proj; Llama's fused qkv, o,
  # fused gate_up, down.
  assert weight_quant.quantize_weights(int8) == 8
  assert weight_quant.quantize_weights(int8) == 0  # nothing left to quantize
  return int8, _dequantized_twin(int8)


def _requests():
  rng = np.random.default_rng(3)
  shared = rng.integers(0, VOCAB, 16).tolist()  # two full pages: a prefix cache hit
  prompts = [shared + rng.integers(0, VOCAB, k).tolist() for k in (3, 9)]
  prompts += [rng.integers(0, VOCAB, k).tolist() for k in (21, 5)]
  return [jax_paged.Request(p, 12, logprobs=True, temperature=0.9 * (i == 3), seed=i)
          for i, p in enumerate(prompts)]


def _serve(model, **kwargs):
  engine = jax_paged.Engine(model, max_batch=4, num_pages=24, page_size=PAGE,
                            steps_per_call=8, max_prefill_tokens=16, **kwargs)
  events = []
  tokens, _ = engine.generate(_requests(), on_token=events.append)
  return tokens, np.array([e.logprob for e in events if e.logprob is not None])


def test_int8_model_serves_its_dequantized_twins_tokens(quantized):
  """Chunked prefill, a cached prefix, greedy and sampled rows: the int8 model's tokens are
  its twin's, log-probabilities within f32 tolerance."""
  int8, twin = quantized
  tokens, logprobs = _serve(int8)
  twin_tokens, twin_logprobs = _serve(twin)
  assert tokens == twin_tokens
  np.testing.assert_allclose(logprobs, twin_logprobs, atol=1e-5)
  qkv = (int8.h[0].attn.qkv if hasattr(int8, "h") else int8.layers[0].self_attn.qkv)
  down = int8.h[0].mlp.c_proj if hasattr(int8, "h") else int8.layers[0].mlp.down
  assert qkv.kernel[...].dtype == jnp.int8
  # Stored [N, K], the int8 kernels' fast layout, down projections included.
  for proj in (qkv, down):
    assert proj.transposed and proj.kernel[...].shape == (proj.out_features, proj.in_features)


def test_lora_adapters_on_int8_weights(quantized):
  """Adapters on a quantized model (slots in its float dtype): the twin's tokens with the
  same adapter; the adapter changes them."""
  int8, twin = quantized
  adapter = lora.LoraAdapter.random(int8.lora_targets(), rank=4, seed=1, scale=0.5)
  prompts = [r.prompt for r in _requests()]
  requests = [jax_paged.Request(p, 8, lora=name)
              for p, name in zip([prompts[0]] + prompts[:3], ["a", None, "a", "a"])]
  outs = []
  for model in (int8, twin):
    engine = jax_paged.Engine(model, max_batch=4, num_pages=24, page_size=PAGE,
                              steps_per_call=8, max_loras=1, max_lora_rank=4)
    engine.add_lora("a", adapter)
    outs.append(engine.generate(requests)[0])
  assert outs[0] == outs[1]
  assert outs[0][0] != outs[0][1]  # one prompt, with the adapter and without


def test_bad_inputs_are_refused_by_name():
  rng = np.random.default_rng(4)
  x = _rng_array(rng, (2, 32))
  q, scale = weight_quant.quantize(_rng_array(rng, (32, 48)))
  with pytest.raises(ValueError, match="int8 kernel needs scale"):
    linear.linear(x, q)
  with pytest.raises(ValueError, match=r"float32 \[N\] = \(48,\)"):
    linear.linear(x, q, scale=scale[:40])
  with pytest.raises(ValueError, match="int8 kernel needs scale"):
    linear.linear_partials(x, q, scale=scale.astype(jnp.bfloat16))
  with pytest.raises(ValueError, match="scale is for an int8 kernel"):
    linear.linear(x, q.astype(jnp.float32), scale=scale)
  with pytest.raises(ValueError, match=r"\[N, K\] \(transposed\) with K = x.shape\[-1\] = 32"):
    linear.linear(x, q, scale=scale, transposed=True)
  with pytest.raises(ValueError, match="kernel must be int8"):
    weight_quant.Int8Linear(q.astype(jnp.float32), scale, None)
  with pytest.raises(ValueError, match="kernel_scale must be float32"):
    weight_quant.Int8Linear(q, scale[:3], None)
  with pytest.raises(ValueError, match="bias must have shape"):
    weight_quant.Int8Linear(q, scale, scale[:3])
  model = gpt2.PRESETS["tiny"]
  model = gpt2.GPT2LMHeadModel(model, dtype=jnp.float32, rngs=nnx.Rngs(0))
  lora.attach(model.lora_targets(), max_loras=1, max_rank=2)
  with pytest.raises(ValueError, match=r"h/0/attn/\w+ has LoRA slots: quantize the weights"):
    weight_quant.quantize_weights(model)


def test_cli_quantization_int8(capsys):
  from jax_paged import cli
  args = ["--model", "tiny", "--prompt-ids", "1,2,3,4,5", "--max-new-tokens", "6",
          "--no-progress", "--no-compilation-cache", "--num-pages", "32"]
  assert cli.main(args + ["--quantization", "int8"]) == 0
  out = capsys.readouterr()
  assert "int8 weights" in out.err
  assert out.out.strip()


@pytest.mark.gpu
def test_gpu_int8_kernels_and_model():
  """On a GPU (Triton): the linear, split-K and fused projection-write kernels with int8
  weights against XLA's product of the same weights (bf16 tolerance), and an int8 GPT-2
  (heads of 64, f32; its kernels stored transposed) serving its dequantized
  twin's tokens."""
  if jax.default_backend() != "gpu":
    pytest.skip("needs a GPU")
  rng = np.random.default_rng(5)
  x = _rng_array(rng, (48, 768), jnp.bfloat16)
  q, scale = weight_quant.quantize(_rng_array(rng, (768, 2304), scale=0.02))
  bias = _rng_array(rng, (2304,), jnp.bfloat16, 0.1)
  want = np.asarray(linear.linear_reference(x, q, bias, scale=scale), np.float32)
  got = np.asarray(linear.linear(x, q, bias, scale=scale, interpret=False), np.float32)
  np.testing.assert_allclose(got, want, rtol=2e-2, atol=2e-2)
  got = np.asarray(linear.linear(x, q.T, bias, scale=scale, interpret=False, transposed=True),
                   np.float32)
  np.testing.assert_allclose(got, want, rtol=2e-2, atol=2e-2)
  for stored, transposed in ((q, False), (q.T, True)):
    parts = linear.linear_partials(x, stored, scale=scale, interpret=False,
                                   transposed=transposed)
    np.testing.assert_allclose(parts.sum(0) + bias.astype(jnp.float32), want, rtol=2e-2,
                               atol=2e-2)
  config = gpt2.GPT2Config(vocab_size=256, n_positions=128, n_embd=256, n_layer=2, n_head=4,
                           bos_token_id=None, eos_token_id=None)
  with jax.default_matmul_precision("highest"):
    int8 = gpt2.GPT2LMHeadModel(config, dtype=jnp.float32, rngs=nnx.Rngs(0))
    weight_quant.quantize_weights(int8)
    twin = _dequantized_twin(int8)
    requests = [jax_paged.Request(rng.integers(0, 256, int(k)).tolist(), 16)
                for k in (5, 17, 30)]
    outs = [jax_paged.Engine(m, max_batch=4, num_pages=32, page_size=16).generate(
        requests)[0] for m in (int8, twin)]
  assert outs[0] == outs[1]
