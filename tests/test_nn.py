"""`jax_paged.nn.PagedAttention` (GQA, RoPE, sliding window) against dense causal attention
in numpy."""

import re
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import jax_paged
from jax_paged import nn
from jax_paged import pool as pool_lib
from jax_paged.kernels import validation

E, H, HKV, D, PAGE = 96, 4, 2, 64, 8


def _dense_causal(q: np.ndarray, k: np.ndarray, v: np.ndarray, scale: float,
                  window: int | None = None, soft_cap: float | None = None,
                  slopes: np.ndarray | None = None) -> np.ndarray:
  """q [T, H, D], k/v [T, Hkv, D] -> causal GQA attention [T, H, D], in float64; with a
  window W, query i sees keys (i - W, i] (Hugging Face Mistral's mask); with a soft cap C,
  logits are C * tanh(logits / C) (Gemma 2's); with ALiBi's slopes [H], head h's logit of
  key j gets slopes[h] * j added (BLOOM's absolute form)."""
  t, h, d = q.shape
  group = h // k.shape[1]
  k, v = np.repeat(k, group, axis=1), np.repeat(v, group, axis=1)
  logits = np.einsum("qhd,shd->hqs", q, k) * scale
  if soft_cap is not None:
    logits = soft_cap * np.tanh(logits / soft_cap)
  i, j = np.arange(t)[:, None], np.arange(t)[None, :]
  if slopes is not None:
    logits = logits + slopes[:, None, None] * j[None]
  visible = (j <= i) & (j > i - (t if window is None else window))
  logits = np.where(visible, logits, -np.inf)
  probs = np.exp(logits - logits.max(-1, keepdims=True))
  probs /= probs.sum(-1, keepdims=True)
  return np.einsum("hqs,shd->qhd", probs, v)


def _bias(linear: nnx.Linear) -> np.ndarray | float:
  return 0.0 if linear.bias is None else np.asarray(linear.bias[...], np.float64)


def _rotate(x: np.ndarray, rope: nn.RotaryEmbedding) -> np.ndarray:
  """x [T, heads, D] with token t at position t, rotated pair by pair (x[i], x[i + D/2])
  in float64."""
  angles = np.arange(x.shape[0])[:, None, None] * rope.inv_freq().astype(np.float64)
  x1, x2 = np.split(x, 2, axis=-1)
  cos, sin = np.cos(angles), np.sin(angles)
  return np.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)


def _dense_attention(layer: nn.PagedAttention, x: np.ndarray) -> np.ndarray:
  """Causal GQA attention of one unpadded sequence x [T, E] (token t at position t), in
  float64 numpy."""
  w = np.asarray(layer.qkv.kernel[...], np.float64)
  qkv = x.astype(np.float64) @ w + _bias(layer.qkv)
  if layer.clip_qkv is not None:
    qkv = np.clip(qkv, -layer.clip_qkv, layer.clip_qkv)
  q, k, v = np.split(qkv, [H * D, (H + HKV) * D], axis=-1)
  t = x.shape[0]
  q, k, v = q.reshape(t, H, D), k.reshape(t, HKV, D), v.reshape(t, HKV, D)
  if layer.rope is not None:
    q, k = _rotate(q, layer.rope), _rotate(k, layer.rope)
  slopes = None if layer.alibi_slopes is None else np.asarray(layer.alibi_slopes[...])
  y = _dense_causal(q, k, v, layer.scale, layer.sliding_window, layer.logits_soft_cap,
                    slopes).reshape(t, H * D)
  return y @ np.asarray(layer.out.kernel[...], np.float64) + _bias(layer.out)


# A Llama-style layer: RoPE, a window shorter than the sequences, q/k/v bias but none on out.
_ROPE_WINDOW = dict(rope=nn.RotaryEmbedding(D, theta=500.0), sliding_window=6, out_bias=False)
# Gemma 2's: logits soft-capped (1.0 bites: the logits here are of order 1), which sends a
# fresh prompt's attention through the paged prefill path.
_ROPE_WINDOW_CAP = dict(_ROPE_WINDOW, logits_soft_cap=1.0)
# BLOOM's / MPT's positions (ALiBi: a fresh prompt through the paged prefill path) with
# OLMo's clamp of q / k / v (0.5 bites: the projections here are of order 1), no RoPE: the
# clamp keeps decode off the fused projection-and-write kernel.
_ALIBI_CLIP = dict(alibi_slopes=nn.alibi_slopes(H), clip_qkv=0.5)


@pytest.mark.parametrize("decode_impl,options", [
    ("auto", {}), ("kernel", {}), ("reference", {}), ("kernel", _ROPE_WINDOW),
    ("reference", _ROPE_WINDOW), ("kernel", _ROPE_WINDOW_CAP), ("kernel", _ALIBI_CLIP),
    ("reference", _ALIBI_CLIP)])
def test_prefill_then_decode_matches_dense_attention(decode_impl, options):
  rng = np.random.default_rng(0)
  layer = nn.PagedAttention(E, H, D, num_kv_heads=HKV, decode_impl=decode_impl,
                            rngs=nnx.Rngs(int(rng.integers(1 << 30))), **options)
  layer_idx = 1  # the layer's pages sit between other layers' pages
  kv = jax_paged.KVPool.create(num_layers=3, num_kv_heads=HKV, head_dim=D, num_pages=24,
                               page_size=PAGE, max_seqs=5, max_pages_per_seq=5,
                               dtype=jnp.float32)
  lengths = np.array([3, 8, 17])
  ids = jnp.array([4, 0, 2], jnp.int32)
  seqs = [rng.standard_normal((n, E)).astype(np.float32) for n in lengths]
  x = np.zeros((3, lengths.max(), E), np.float32)
  for i, s in enumerate(seqs):
    x[i, :len(s)] = s
  kv, slots, ok = pool_lib.reserve(kv, ids, jnp.asarray(lengths, jnp.int32))
  assert np.asarray(ok).all()
  y, kv = jax.jit(layer.prefill, static_argnums=2)(jnp.asarray(x), kv, layer_idx, slots,
                                                   jnp.asarray(lengths, jnp.int32))
  for i, s in enumerate(seqs):
    np.testing.assert_allclose(y[i, :len(s)], _dense_attention(layer, s), atol=1e-4)
  for name in ("logits_soft_cap", "alibi_slopes", "clip_qkv"):
    if name in options:  # the option bites
      without = nn.PagedAttention(E, H, D, num_kv_heads=HKV, rngs=nnx.Rngs(0),
                                  **{**options, name: None})
      nnx.update(without, nnx.state(layer, nnx.Param))
      assert np.abs(_dense_attention(without, seqs[2])
                    - _dense_attention(layer, seqs[2])).max() > 1e-2, name
  # Padding was never written: only the real tokens' slots are non-zero in this layer.
  written = np.abs(np.asarray(kv.k_pages[layer_idx])).sum(axis=(0, 3)).reshape(-1) > 0
  assert written.sum() == lengths.sum()
  assert not np.asarray(kv.k_pages)[[0, 2]].any()

  decode = jax.jit(layer.decode, static_argnums=2)
  active = np.array([True, False, True])
  for _ in range(10):  # crosses page boundaries
    new = rng.standard_normal((3, E)).astype(np.float32)
    kv, slots, _ = pool_lib.reserve(kv, ids, jnp.asarray(active, jnp.int32), max_new_tokens=1)
    attend = jnp.where(jnp.asarray(active), kv.lengths[ids], 0)
    y, kv = decode(jnp.asarray(new), kv, layer_idx, slots[:, 0], kv.page_table[ids], attend)
    for i in np.flatnonzero(active):
      seqs[i] = np.concatenate([seqs[i], new[i:i + 1]])
      np.testing.assert_allclose(y[i], _dense_attention(layer, seqs[i])[-1], atol=1e-4)
    assert not np.asarray(y[1] - _bias(layer.out)).any()  # inactive: attention out 0
  np.testing.assert_array_equal(kv.lengths[ids], [13, 8, 27])


def test_which_fresh_prompts_attend_through_the_pages(monkeypatch):
  """The paged prefill kernel takes fresh prompts with a soft cap anywhere, and on a GPU
  those cuDNN does not take (head dims past 128, f32) where the kernel does (not head dim
  48); cuDNN the rest."""
  kv = jax_paged.KVPool.create(num_layers=1, num_kv_heads=1, head_dim=D, num_pages=2,
                               page_size=PAGE, max_seqs=1, max_pages_per_seq=2)

  def routed(head_dim, dtype, **options):
    layer = nn.PagedAttention(E, 2, head_dim, rngs=nnx.Rngs(0), **options)
    return layer._prompt_through_pages(jnp.zeros((1, 4, 2, head_dim), dtype), kv)

  assert routed(D, jnp.float32, logits_soft_cap=5.0)
  assert routed(D, jnp.float32, alibi_slopes=nn.alibi_slopes(2))
  assert not routed(256, jnp.bfloat16) and not routed(D, jnp.float32)  # on the CPU: XLA
  monkeypatch.setattr(nn.jax, "default_backend", lambda: "gpu")
  assert routed(256, jnp.bfloat16) and routed(D, jnp.float32)
  assert not routed(D, jnp.bfloat16) and not routed(128, jnp.float16)
  assert not routed(48, jnp.float32)


def test_reference_path_warns_only_on_a_gpu(monkeypatch):
  def warned(head_dim, page_size):
    with warnings.catch_warnings(record=True) as caught:
      warnings.simplefilter("always")
      validation.warn_if_reference_on_gpu("paged decode attention", head_dim, page_size)
    return [str(w.message) for w in caught if w.category is validation.ReferencePathWarning]

  assert not warned(64, 3)  # off a GPU the reference path is the plain-XLA choice
  monkeypatch.setattr(validation.jax, "default_backend", lambda: "gpu")
  message, = warned(64, 3)
  assert "page size 3" in message and "[8, 128]" in message
  assert warned(72, 16)
  assert not warned(64, 16) and not warned(128, 128)


@pytest.mark.gpu
def test_decode_with_a_page_size_the_kernel_does_not_take_warns_on_gpu():
  rng = np.random.default_rng(3)
  layer = nn.PagedAttention(E, H, D, num_kv_heads=HKV, rngs=nnx.Rngs(3))
  kv = jax_paged.KVPool.create(num_layers=1, num_kv_heads=HKV, head_dim=D, num_pages=8,
                               page_size=12, max_seqs=2, max_pages_per_seq=4,
                               dtype=jnp.float32)
  ids = jnp.array([0, 1], jnp.int32)
  seqs = rng.standard_normal((2, 20, E)).astype(np.float32)
  kv, slots, _ = pool_lib.reserve(kv, ids, jnp.array([19, 19], jnp.int32))
  with jax.default_matmul_precision("highest"):
    _, kv = layer.prefill(jnp.asarray(seqs[:, :19]), kv, 0, slots, jnp.array([19, 19]))
  kv, slots, _ = pool_lib.reserve(kv, ids, jnp.array([1, 1], jnp.int32), max_new_tokens=1)
  with pytest.warns(validation.ReferencePathWarning, match="page size 12"), \
       jax.default_matmul_precision("highest"):  # f32 GEMMs, not TF32
    y, _ = layer.decode(jnp.asarray(seqs[:, 19]), kv, 0, slots[:, 0], kv.page_table[ids],
                        kv.lengths[ids])
  for i in range(2):
    np.testing.assert_allclose(y[i], _dense_attention(layer, seqs[i])[-1], atol=1e-4)


def test_bias_flags():
  layer = nn.PagedAttention(E, H, D, num_kv_heads=HKV, qkv_bias=True, out_bias=False,
                            rngs=nnx.Rngs(0))
  assert layer.qkv.bias is not None and layer.out.bias is None
  layer = nn.PagedAttention(E, H, D, qkv_bias=False, rngs=nnx.Rngs(0))
  assert layer.qkv.bias is None and layer.out.bias is not None


def test_rejects_bad_arguments():
  with pytest.raises(ValueError, match="multiple of num_kv_heads"):
    nn.PagedAttention(E, 4, D, num_kv_heads=3, rngs=nnx.Rngs(0))
  with pytest.raises(ValueError, match="decode_impl"):
    nn.PagedAttention(E, 4, D, decode_impl="triton", rngs=nnx.Rngs(0))
  with pytest.raises(ValueError, match="sliding_window must be a positive int or None, got 0"):
    nn.PagedAttention(E, 4, D, sliding_window=0, rngs=nnx.Rngs(0))
  with pytest.raises(ValueError, match="attention_chunk must be a positive int or None, got -8"):
    nn.PagedAttention(E, 4, D, attention_chunk=-8, rngs=nnx.Rngs(0))
  with pytest.raises(ValueError, match="query_temperature must be a QueryTemperature"):
    nn.PagedAttention(E, 4, D, query_temperature=(8192, 0.1), rngs=nnx.Rngs(0))
  with pytest.raises(ValueError, match="query_temperature's beta must be a positive"):
    nn.PagedAttention(E, 4, D, query_temperature=nn.QueryTemperature(8192, 0.0),
                      rngs=nnx.Rngs(0))
  with pytest.raises(ValueError, match="query_temperature's offset must be an int >= 0"):
    nn.PagedAttention(E, 4, D, query_temperature=nn.QueryTemperature(8192, 0.1, -1),
                      rngs=nnx.Rngs(0))
  with pytest.raises(ValueError, match="logits_soft_cap must be a positive finite number or None, "
                                       "got 0.0"):
    nn.PagedAttention(E, 4, D, logits_soft_cap=0.0, rngs=nnx.Rngs(0))
  with pytest.raises(ValueError, match="alibi_slopes must be 4 finite numbers"):
    nn.PagedAttention(E, 4, D, alibi_slopes=nn.alibi_slopes(3), rngs=nnx.Rngs(0))
  with pytest.raises(ValueError, match="clip_qkv must be a positive finite number"):
    nn.PagedAttention(E, 4, D, clip_qkv=-1.0, rngs=nnx.Rngs(0))
  with pytest.raises(ValueError, match="num_heads must be a positive int"):
    nn.alibi_slopes(0)
  with pytest.raises(ValueError, match="qk_norm_after_rope needs a head_norm of each head"):
    nn.PagedAttention(E, 4, D, qk_norm_after_rope=True, rngs=nnx.Rngs(0))
  with pytest.raises(ValueError, match="rope must be a RotaryEmbedding of head_dim=64"):
    nn.PagedAttention(E, 4, D, rope=nn.RotaryEmbedding(32), rngs=nnx.Rngs(0))
  with pytest.raises(ValueError, match=r"rope_type must be one of \('default', 'linear', "
                                       r"'llama3', 'yarn', 'longrope'\), got 'dynamic'"):
    nn.RotaryEmbedding(D, rope_type="dynamic")
  with pytest.raises(ValueError, match="longrope needs ext_factors: a tuple of 8 positive "):
    nn.RotaryEmbedding(D, rope_type="longrope", rotary_dim=16, ext_factors=(1.0,) * 7 + (0.0,))
  with pytest.raises(ValueError, match="ext_factors are longrope's; rope_type is 'yarn'"):
    nn.RotaryEmbedding(D, rope_type="yarn", ext_factors=(1.0,) * 32)
  with pytest.raises(ValueError, match="attention_factor must be a positive finite number"):
    nn.RotaryEmbedding(D, rope_type="yarn", attention_factor=0.0)
  with pytest.raises(ValueError, match="yarn rope needs 0 < beta_slow < beta_fast"):
    nn.RotaryEmbedding(D, rope_type="yarn", beta_fast=1.0, beta_slow=32.0)
  with pytest.raises(ValueError, match="head_dim must be a positive even int"):
    nn.RotaryEmbedding(7)
  with pytest.raises(ValueError, match="low_freq_factor <= high_freq_factor"):
    nn.RotaryEmbedding(D, rope_type="llama3", factor=8.0, low_freq_factor=4.0,
                       high_freq_factor=1.0)


def test_rotary_embedding_rotates_pairs_by_position():
  """Each (x[i], x[i + D/2]) pair turns by position * inv_freq[i]: norms are kept, position 0
  is the identity, and q.k after rotation depends only on the distance between positions."""
  rope = nn.RotaryEmbedding(D, theta=10000.0)
  rng = np.random.default_rng(4)
  q, k = (jnp.asarray(rng.standard_normal((1, 2, D)), jnp.float32) for _ in range(2))
  np.testing.assert_allclose(rope(q, jnp.array([0])), q, rtol=1e-6)
  np.testing.assert_allclose(jnp.linalg.norm(rope(q, jnp.array([37])), axis=-1),
                             jnp.linalg.norm(q, axis=-1), rtol=1e-5)
  dot = lambda i, j: float(jnp.sum(rope(q, jnp.array([i])) * rope(k, jnp.array([j]))))
  np.testing.assert_allclose(dot(3, 10), dot(20, 27), rtol=1e-4)
  assert rope(q.astype(jnp.bfloat16), jnp.array([5])).dtype == jnp.bfloat16
  # "linear" is the default frequencies slowed `factor` times.
  np.testing.assert_allclose(nn.RotaryEmbedding(D, rope_type="linear", factor=4.0).inv_freq(),
                             rope.inv_freq() / 4, rtol=1e-6)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_head_layer_norm_normalises_each_head_with_its_own_weight(dtype):
  """`nn.HeadLayerNorm` on [T, heads, D]: each head's features normalised and times that
  head's row of the weight (random, per head), as torch's LayerNorm per head."""
  torch = pytest.importorskip("torch")
  rng = np.random.default_rng(6)
  norm = nn.HeadLayerNorm(3, head_dim=D, epsilon=1e-4)
  norm.scale[...] = jnp.asarray(rng.uniform(0.5, 1.5, (3, D)), jnp.float32)
  x = jnp.asarray(3.0 + rng.standard_normal((5, 3, D)), dtype)
  y = norm(x)
  assert y.shape == x.shape and y.dtype == dtype
  x64 = torch.tensor(np.asarray(x.astype(jnp.float32)), dtype=torch.float64)
  want = np.stack([torch.nn.functional.layer_norm(
      x64[:, h], (D,), torch.tensor(np.asarray(norm.scale[h]), dtype=torch.float64),
      eps=1e-4).numpy() for h in range(3)], axis=1)
  tol = 1e-5 if dtype == jnp.float32 else 2e-2
  np.testing.assert_allclose(np.asarray(y.astype(jnp.float32)), want, rtol=tol, atol=tol)


def _check_prompt_attention(dtype, window=None):
  """prompt_attention vs dense causal attention on ragged prompts; returns (fn, args)."""
  rng = np.random.default_rng(3)
  b, t, h, hkv, d = 3, 40, 8, 2, 64
  q, k, v = (rng.standard_normal((b, t, n, d)).astype(np.float32) for n in (h, hkv, hkv))
  lengths = np.array([40, 1, 23], np.int32)
  fn = jax.jit(lambda q, k, v, n: nn.prompt_attention(q, k, v, n, scale=d ** -0.5,
                                                      sliding_window=window))
  args = [jnp.asarray(a, dtype) for a in (q, k, v)] + [jnp.asarray(lengths)]
  y = np.asarray(fn(*args).astype(jnp.float32))
  tol = 1e-5 if dtype == jnp.float32 else 2e-2
  for i, n in enumerate(lengths):
    qi, ki, vi = (np.asarray(a[i, :n].astype(jnp.float32), np.float64) for a in args[:3])
    np.testing.assert_allclose(y[i, :n], _dense_causal(qi, ki, vi, d ** -0.5, window),
                               rtol=tol, atol=tol)
    assert not y[i, n:].any()  # padding rows are exactly 0
  return fn, args


@pytest.mark.parametrize("dtype,window", [(jnp.float32, None), (jnp.bfloat16, None),
                                          (jnp.float32, 7), (jnp.float32, 1)])
def test_prompt_attention_matches_dense(dtype, window):
  _check_prompt_attention(dtype, window)


@pytest.mark.gpu
@pytest.mark.parametrize("window", [None, 7])
def test_prompt_attention_uses_cudnn_on_gpu(window):
  fn, args = _check_prompt_attention(jnp.bfloat16, window)
  assert "cudnn" in fn.lower(*args).compile().as_text()


def _record_calls(monkeypatch, module, name: str, arg: int) -> list:
  """Replaces module.name by a wrapper recording the shape of its positional arg `arg`."""
  calls, fn = [], getattr(module, name)
  monkeypatch.setattr(module, name, lambda *a, **k: calls.append(a[arg].shape) or fn(*a, **k))
  return calls


def _random_linear(in_features: int, rows: int, dtype, rng):
  """An nnx.Linear(in_features, E) with a random bias, and a random input [rows, in]."""
  proj = nnx.Linear(in_features, E, dtype=dtype, param_dtype=dtype, rngs=nnx.Rngs(rows))
  proj.bias[...] = jnp.asarray(rng.standard_normal(E), dtype)
  return proj, jnp.asarray(rng.standard_normal((rows, in_features)), dtype)


@pytest.mark.parametrize("rows,dtype", [(5, jnp.float32), (7, jnp.bfloat16), (300, jnp.float32)])
def test_dense_matches_module(rows, dtype, monkeypatch):
  # Up to 256 rows: `linear.linear` (interpret mode) with bias and activation fused; 300
  # rows: the plain module.
  kernel_calls = _record_calls(monkeypatch, nn.linear, "linear", 0)
  proj, h = _random_linear(96, rows, dtype, np.random.default_rng(rows))
  gelu = jax.nn.gelu
  y = nn.dense(proj, h, activation=gelu, interpret=True)
  assert kernel_calls == ([] if rows > 256 else [(rows, 96)])
  assert y.dtype == dtype
  want = gelu(proj(h).astype(jnp.float32))
  tol = 1e-5 if dtype == jnp.float32 else 3e-2
  np.testing.assert_allclose(np.asarray(y, np.float64), np.asarray(want, np.float64),
                             rtol=tol, atol=tol)


@pytest.mark.parametrize("norm_kind", ["layer", "rms"])
@pytest.mark.parametrize("rows,dtype", [(5, jnp.float32), (7, jnp.bfloat16), (300, jnp.float32)])
def test_project_add_norm_matches_unfused(rows, dtype, norm_kind, monkeypatch):
  # 5 and 7 rows take the split-K + add_layer_norm (add_rms_norm) kernel (interpret mode);
  # 300 rows are over the fused path's limit and take the plain modules.
  fused_calls = _record_calls(monkeypatch, nn.layer_norm, f"add_{norm_kind}_norm", 1)
  rng = np.random.default_rng(rows)
  proj, h = _random_linear(192, rows, dtype, rng)
  if norm_kind == "layer":
    norm = nn.LayerNorm(E, epsilon=1e-5, dtype=dtype, param_dtype=dtype)
    norm.scale[...] = jnp.asarray(rng.uniform(0.5, 1.5, E), dtype)
    norm.bias[...] = jnp.asarray(rng.standard_normal(E), dtype)
  else:
    norm = nn.RMSNorm(E, epsilon=1e-5, param_dtype=dtype)
    norm.weight[...] = jnp.asarray(rng.uniform(0.5, 1.5, E), dtype)
  residual = jnp.asarray(rng.standard_normal((rows, E)) * 2 + 1, dtype)
  x, y = nn.project_add_norm(proj, h, residual, norm, interpret=True)
  assert fused_calls == ([] if rows > 256 else [(4, rows, E)])  # 4 K-splits of 192
  want_x = residual + proj(h)
  tol = 1e-5 if dtype == jnp.float32 else 3e-2
  assert x.dtype == y.dtype == dtype
  np.testing.assert_allclose(np.asarray(x, np.float64), np.asarray(want_x, np.float64),
                             rtol=tol, atol=tol)
  np.testing.assert_allclose(np.asarray(y, np.float64),
                             np.asarray(norm(want_x.astype(jnp.float32)), np.float64),
                             rtol=tol, atol=tol * 4)
  np.testing.assert_allclose(np.asarray(y, np.float64), np.asarray(norm(x), np.float64),
                             rtol=tol, atol=tol)


@pytest.mark.parametrize("rows,dtype", [(5, jnp.float32), (7, jnp.bfloat16), (300, jnp.float32)])
def test_project_add_norm_with_a_post_norm(rows, dtype, monkeypatch):
  """`parts_norm` (Gemma's): x = residual + post(proj(h)), one kernel after the split-K
  GEMM up to 256 rows, the plain modules past them; refused with a LayerNorm."""
  fused_calls = _record_calls(monkeypatch, nn.layer_norm, "add_rms_norm", 1)
  rng = np.random.default_rng(rows + 1)
  proj, h = _random_linear(192, rows, dtype, rng)
  post, norm = (nn.RMSNorm(E, epsilon=1e-6, param_dtype=dtype, unit_offset=True)
                for _ in range(2))
  for n in (post, norm):
    n.weight[...] = jnp.asarray(rng.standard_normal(E) * 0.5, dtype)
  residual = jnp.asarray(rng.standard_normal((rows, E)) * 2 + 1, dtype)
  x, y = nn.project_add_norm(proj, h, residual, norm, interpret=True, parts_norm=post)
  assert fused_calls == ([] if rows > 256 else [(4, rows, E)])
  want_x = residual + post(proj(h))
  tol = 1e-5 if dtype == jnp.float32 else 3e-2
  assert x.dtype == y.dtype == dtype
  np.testing.assert_allclose(np.asarray(x, np.float64), np.asarray(want_x, np.float64),
                             rtol=tol, atol=tol)
  np.testing.assert_allclose(np.asarray(y, np.float64), np.asarray(norm(x), np.float64),
                             rtol=tol, atol=tol)
  with pytest.raises(ValueError, match="parts_norm goes with RMS norms"):
    nn.project_add_norm(proj, h, residual, nn.LayerNorm(E), parts_norm=post)
  with pytest.raises(ValueError, match="parts_norm must have norm's epsilon and unit_offset"):
    nn.project_add_norm(proj, h, residual, norm,
                        parts_norm=nn.RMSNorm(E, epsilon=1e-5, unit_offset=True))


@pytest.mark.parametrize("rows,dtype", [(5, jnp.float32), (7, jnp.bfloat16), (300, jnp.float32)])
def test_project_add_matches_unfused(rows, dtype, monkeypatch):
  # 5 and 7 rows take the split-K kernel (interpret mode) with XLA's sum; 300 rows are over
  # the kernel's limit and take the plain module.
  partial_calls = _record_calls(monkeypatch, nn.linear, "linear_partials", 0)
  rng = np.random.default_rng(rows + 1)
  proj, h = _random_linear(192, rows, dtype, rng)
  residual = jnp.asarray(rng.standard_normal((rows, E)) * 2 + 1, dtype)
  x = nn.project_add(proj, h, residual, interpret=True)
  assert partial_calls == ([] if rows > 256 else [(rows, 192)])
  assert x.dtype == dtype
  tol = 1e-5 if dtype == jnp.float32 else 3e-2
  np.testing.assert_allclose(np.asarray(x, np.float64),
                             np.asarray(residual + proj(h), np.float64), rtol=tol, atol=tol)


@pytest.mark.parametrize("dtype,jaxpr_name", [(jnp.float32, "f32"), (jnp.bfloat16, "bf16")])
def test_row_parallel_all_reduce_carries_the_compute_dtype(dtype, jaxpr_name):
  """A row-parallel projection (`reduce_axis`, as `tensor_parallel` marks it) sums its
  partial products over the mesh in the compute dtype (bf16: half an f32 sum's bytes),
  then adds the bias in f32; on a 1-device mesh that is the module's own output."""
  rng = np.random.default_rng(3)
  proj, h = _random_linear(96, 5, dtype, rng)
  proj.reduce_axis = "tp"
  f = jax.shard_map(lambda h: nn.projection(proj, h), mesh=jax.make_mesh((1,), ("tp",)),
                    in_specs=jax.sharding.PartitionSpec(),
                    out_specs=jax.sharding.PartitionSpec())
  summed = re.findall(rf"(\w+)\[5,{E}\] = psum", str(jax.make_jaxpr(f)(h)))
  assert summed == [jaxpr_name]
  y = f(h)
  assert y.dtype == dtype
  tol = 1e-5 if dtype == jnp.float32 else 2e-2
  np.testing.assert_allclose(np.asarray(y, np.float64), np.asarray(proj(h), np.float64),
                             rtol=tol, atol=tol)


@pytest.mark.parametrize("interpret", [True, None])  # the kernel; plain XLA on CPU
def test_grouped_linear_float_and_int8(interpret):
  """Each group's rows through its kernel (float64 loop); `quantize_int8` makes the weights
  int8 [groups, out, in] with per-group column scales, and the layer then computes with
  exactly the dequantized weights (f32)."""
  layer = nn.GroupedLinear(3, 40, 24, dtype=jnp.float32, rngs=nnx.Rngs(0))
  rng = np.random.default_rng(1)
  x = jnp.asarray(rng.standard_normal((11, 40)), jnp.float32)
  sizes = jnp.asarray([4, 0, 6], jnp.int32)  # and one row past the groups

  def loop(weights):
    y, start = np.zeros((11, 24)), 0
    for g, size in enumerate(np.asarray(sizes)):
      y[start:start + size] = np.asarray(x, np.float64)[start:start + size] @ weights[g]
      start += size
    return y

  np.testing.assert_allclose(layer(x, sizes, interpret=interpret),
                             loop(np.asarray(layer.kernel[...], np.float64)),
                             rtol=1e-5, atol=1e-5)
  float_kernel = np.asarray(layer.kernel[...], np.float64)
  assert layer.quantize_int8() and not layer.quantize_int8()
  assert layer.kernel[...].dtype == jnp.int8 and layer.kernel[...].shape == (3, 24, 40)
  dequantized = (np.swapaxes(np.asarray(layer.kernel[...], np.float64), 1, 2)
                 * np.asarray(layer.kernel_scale[...])[:, None, :])
  assert np.abs(dequantized - float_kernel).max() <= np.asarray(
      layer.kernel_scale[...]).max() / 2 + 1e-7  # half a step at most
  np.testing.assert_allclose(layer(x, sizes, interpret=interpret), loop(dequantized),
                             rtol=1e-5, atol=1e-5)
  with pytest.raises(ValueError, match="out_features must be a positive int, got 0"):
    nn.GroupedLinear(3, 40, 0, rngs=nnx.Rngs(0))
