"""DeepSeek-V2 / V3 and GLM-4.7-Flash (multi-head latent attention, routed and shared
experts) on the paged pool against Hugging Face transformers' models (CPU, f32), loaded
from their `save_pretrained` directories.

The HF models are random (norms, V3's correction bias too): 8 experts in 4 groups, 2
kept groups, 2 experts per token. V2: q projected directly, YaRN RoPE with DeepSeek's
mscales, group-limited greedy routing scaled by 1.5; V3: q through its low-rank
bottleneck, the sigmoid router with its correction bias, renormalised and scaled by 2.5;
GLM-4.7-Flash ("glm4_moe_lite") V3's with its dense / sparse layers from mlp_layer_types
and a scale of 1.8.
"""

import functools
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers

import jax_paged
from jax_paged import latent_attention, reference, weight_quant
from jax_paged.kernels import kv_quant, paged_latent_attention
from jax_paged.serving.runner import ModelRunner
from models import deepseek
from tests.test_llama import (PAGE, VOCAB, _hf_last_logits, _padded, _prompts,
                              assert_bf16_tracks_hf, assert_generate_and_engines_give_hfs_tokens,
                              assert_installed_cli_gives_hfs_tokens,
                              assert_kernels_give_references_and_hfs_tokens, assert_logits_track_hf)

CONFIG = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
              num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4,
              n_routed_experts=8, num_experts_per_tok=2, n_shared_experts=1,
              first_k_dense_replace=1, kv_lora_rank=56, qk_rope_head_dim=8,
              qk_nope_head_dim=16, v_head_dim=16, n_group=4, topk_group=2,
              max_position_embeddings=64, bos_token_id=None, eos_token_id=None,
              attn_implementation="eager")
VARIANTS = {
    "deepseek_v2": (transformers.DeepseekV2ForCausalLM, transformers.DeepseekV2Config, dict(
        q_lora_rank=None, topk_method="group_limited_greedy", routed_scaling_factor=1.5,
        rope_scaling={"rope_type": "yarn", "factor": 4.0, "mscale": 0.707,
                      "mscale_all_dim": 0.8, "original_max_position_embeddings": 16})),
    "deepseek_v3": (transformers.DeepseekV3ForCausalLM, transformers.DeepseekV3Config, dict(
        q_lora_rank=24, routed_scaling_factor=2.5, norm_topk_prob=True)),
    "glm4_moe_lite": (transformers.Glm4MoeLiteForCausalLM, transformers.Glm4MoeLiteConfig,
                      dict(q_lora_rank=24, routed_scaling_factor=1.8, norm_topk_prob=True,
                           mlp_layer_types=["dense", "sparse"])),
}


@pytest.fixture(scope="module", params=list(VARIANTS))
def saved(request, tmp_path_factory):
  """(HF model, its save_pretrained directory) of each model type."""
  model_class, config_class, fields = VARIANTS[request.param]
  torch.manual_seed(0)
  hf = model_class(config_class(**CONFIG, **fields)).eval()
  with torch.no_grad():
    for name, p in hf.named_parameters():
      if "norm" in name:
        p.uniform_(0.5, 1.5)
      else:
        p.normal_(0.0, 0.1)
    for name, b in hf.named_buffers():
      if "e_score_correction_bias" in name:
        b.normal_(0.0, 0.1)
  path = tmp_path_factory.mktemp(request.param)
  hf.save_pretrained(path)
  return hf, path


def test_prefill_and_decode_logits_match_hf(saved):
  """Logits over a prefill and decode steps (positions past YaRN's original context of
  16); the pool holds one latent per token: one kv head of (56 + 8) / 2."""
  hf, path = saved
  model = deepseek.from_pretrained(path)
  assert isinstance(model, jax_paged.PagedModel)
  assert (model.spec.num_kv_heads, model.spec.head_dim) == (1, 32)
  assert isinstance(model.layers[0].mlp, deepseek.llama.MLP)
  assert isinstance(model.layers[1].mlp, deepseek.DeepseekMoE)
  assert_logits_track_hf(hf, model, [3, 8, 13], 7)


def test_generate_and_engine_give_hfs_tokens(saved):
  """generate; an engine preempting in a tiny pool; one whose prompts share a cached
  prefix and whose long prompt is prefilled in chunks: HF's greedy tokens (V2: the
  engine's paths are the model's prefill and decode, which V3 and GLM-4.7-Flash share)."""
  hf, path = saved
  model = deepseek.from_pretrained(path)
  assert_generate_and_engines_give_hfs_tokens(
      hf, model, engines=model.config.model_type == "deepseek_v2")


def _logits_over_steps(model, prompts: list[list[int]], dtype, page_size: int) -> np.ndarray:
  """Logits [4, len(prompts), vocab]: of a prefill of `prompts` into a fresh pool of
  `dtype`, then of 3 decode steps of fixed tokens."""
  seq_ids = np.arange(len(prompts), dtype=np.int32)
  pages = -(-(max(map(len, prompts)) + 3) // page_size)
  kv = model.spec.create_pool(num_pages=len(prompts) * pages, page_size=page_size,
                              max_seqs=len(prompts), max_pages_per_seq=pages, dtype=dtype)
  runner = ModelRunner(model)
  got, kv = runner.prefill(kv, *_padded(prompts), seq_ids)
  steps = [got]
  for token in (7, 11, 13):
    got, kv = runner.decode(kv, jnp.full((len(prompts),), token, jnp.int32), seq_ids)
    steps.append(got)
  return np.stack(steps)


def test_int8_latent_cache_and_int8_weights(saved):
  """An int8 pool holds the latent quantized per token and half (its scales): the logits
  of a prefill and decode steps within 2% of the largest of the float pool's. int8
  weights quantize q / kv_a / o and the MLPs (not the absorbed w_uk / w_uv)."""
  hf, path = saved
  model = deepseek.from_pretrained(path)
  prompts = _prompts(np.random.default_rng(3), [5, 12])
  logits = {dtype: _logits_over_steps(model, prompts, dtype, PAGE)
            for dtype in (jnp.float32, jnp.int8)}
  assert np.abs(logits[jnp.float32][0] - _hf_last_logits(hf, prompts)).max() < 1e-4
  error = np.abs(logits[jnp.int8] - logits[jnp.float32]).max()
  assert 0 < error < 0.02 * np.abs(logits[jnp.float32]).max()
  attention = model.layers[0].self_attn
  # q (or q_a and q_b), kv_a and o per layer; gate_up and down per MLP, shared or experts'.
  projections = 3 if model.config.q_lora_rank is None else 4
  assert weight_quant.quantize_weights(model) == 2 * projections + 2 + 2 * 2
  assert attention.kv_a_proj.kernel[...].dtype == jnp.int8
  assert attention.w_uk[...].dtype == jnp.float32


def test_latent_attention_matches_expanded_heads():
  """`reference.paged_latent_attention` (absorbed: every head over the cached latent)
  equals attention with each head's K = [c W_UK; k_rope] and V = c W_UV formed in full,
  at decode and at a prefill behind a cached prefix; pages past each row's length hold
  NaN and are never read."""
  rng = np.random.default_rng(0)
  b, t, h, dn, dr, r, dv, page = 2, 3, 4, 8, 4, 12, 6, 4
  lengths = np.array([9, 6], np.int32)
  latent = rng.standard_normal((b, 12, r + dr)).astype(np.float32)
  w_uk = rng.standard_normal((h, dn, r)).astype(np.float32)  # (the math's layouts)
  w_uv = rng.standard_normal((h, r, dv)).astype(np.float32)
  q_nope = rng.standard_normal((b, t, h, dn)).astype(np.float32)
  q_rope = rng.standard_normal((b, t, h, dr)).astype(np.float32)
  # Pages: row 0 in pages 5, 1, 6; row 1 in pages 2, 0; everything else NaN.
  table = np.array([[5, 1, 6], [2, 0, 3]], np.int32)
  pages = np.full((1, 1, 8, page, (r + dr) // 2 * 2), np.nan, np.float32)
  for row in range(b):
    for pos in range(lengths[row]):
      pages[0, 0, table[row, pos // page], pos % page] = latent[row, pos]
  half = (r + dr) // 2
  k_pages, v_pages = jnp.asarray(pages[..., :half]), jnp.asarray(pages[..., half:])
  positions = lengths[:, None] - t + np.arange(t)  # the last t tokens of each row
  q = np.concatenate([np.einsum("bthn,hnr->bthr", q_nope, w_uk), q_rope], axis=-1)
  got = reference.paged_latent_attention(
      jnp.asarray(q), k_pages, v_pages, jnp.asarray(table), jnp.asarray(positions),
      jnp.asarray(lengths), value_dim=r, scale=0.3, layer=0)
  got = np.einsum("bthr,hrv->bthv", np.asarray(got), w_uv)
  for row in range(b):
    c, k_rope = latent[row, :lengths[row], :r], latent[row, :lengths[row], r:]
    keys = np.concatenate([np.einsum("sr,hnr->hsn", c, w_uk),
                           np.broadcast_to(k_rope, (h,) + k_rope.shape)], axis=-1)
    values = np.einsum("sr,hrv->hsv", c, w_uv)
    query = np.concatenate([q_nope[row], q_rope[row]], axis=-1)  # [t, h, dn + dr]
    scores = np.einsum("thd,hsd->ths", query, keys) * 0.3
    scores = np.where(positions[row][:, None, None] < np.arange(lengths[row]), -np.inf, scores)
    p = np.exp(scores - scores.max(-1, keepdims=True))
    want = np.einsum("ths,hsv->thv", p / p.sum(-1, keepdims=True), values)
    np.testing.assert_allclose(got[row], want, rtol=1e-5, atol=1e-5)


def _latent_pages(rng, shape, table, lengths, cache_dtype):
  """A pool of `shape` [L, 1, pages, page, D] holding random latent halves at each row's
  first `lengths` positions of its `table` pages, NaN everywhere else; cache_dtype None
  (float32, scales None) or int8 / float8_e4m3fn (quantized per token, V token-minor,
  NaN scales elsewhere). Returns (k, v, k_scales, v_scales)."""
  k, v = (np.full(shape, np.nan, np.float32) for _ in range(2))
  page = shape[3]
  for row, length in enumerate(lengths):
    for pos in range(length):
      for x in (k, v):
        x[:, 0, table[row, pos // page], pos % page] = rng.standard_normal(
            (shape[0], shape[-1]))
  if cache_dtype is None:
    return jnp.asarray(k), jnp.asarray(v), None, None
  (k, k_scales), (v, v_scales) = (kv_quant.quantize(jnp.asarray(x), cache_dtype)
                                  for x in (k, v))
  return k, kv_quant.transpose_pages(v), k_scales, v_scales


@pytest.mark.parametrize("heads, head_dim, value_dim, splits, cache_dtype", [
    (20, 32, 48, 1, None), (16, 48, 80, 3, None), (40, 32, 64, None, None),
    (16, 48, 80, 3, jnp.int8), (20, 32, 48, None, jnp.float8_e4m3fn)])
def test_latent_kernel_matches_the_reference(heads, head_dim, value_dim, splits,
                                             cache_dtype):
  """The Triton kernel (interpret mode) against the reference on fresh random pages: head
  blocks with masked heads (20 and 40 heads in blocks of 32), halves read in pieces (48
  = 32 + 16), c spanning part or all of V, several splits, a row of length 0, int8 and
  float8 pages (scales NaN past every row's tokens: never weighted); NaN slots past the
  lengths never read; every element written (interpret mode starts the outputs as NaN)."""
  rng = np.random.default_rng(heads)
  layers, pages, page, batch = 2, 24, 8, 3
  table = rng.permutation(pages)[:batch * 6].reshape(batch, 6).astype(np.int32)
  lengths = np.array([5, 41, 0], np.int32)
  k, v, ks, vs = _latent_pages(rng, (layers, 1, pages, page, head_dim), table, lengths,
                               cache_dtype)
  q = jnp.asarray(rng.standard_normal((batch, heads, 2 * head_dim)), jnp.float32)
  table, lengths = jnp.asarray(table), jnp.asarray(lengths)
  got = paged_latent_attention.paged_latent_decode_attention(
      q, k, v, table, lengths, value_dim=value_dim, scale=0.2, layer=1, k_scales=ks,
      v_scales=vs, interpret=True, num_splits=splits, block_n=16)
  want = reference.paged_latent_attention(
      q[:, None], k, v, table, jnp.maximum(lengths - 1, 0)[:, None], lengths,
      value_dim=value_dim, scale=0.2, layer=1, k_scales=ks, v_scales=vs)[:, 0]
  assert got.shape == (batch, heads, value_dim) and np.isfinite(got).all()
  np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
  assert not np.asarray(got[2]).any()  # length 0: zeros
  with pytest.raises(ValueError, match="the latent kernel takes D a multiple of 16"):
    paged_latent_attention.paged_latent_decode_attention(
        q, k, v, table, lengths, value_dim=head_dim, scale=0.2, layer=1, k_scales=ks,
        v_scales=vs)
  for bad_table, bad_lengths, message in (
      (table, lengths + jnp.asarray([0, 8, 0]), r"lengths must be in \[0, .* = 48\]"),
      (table.astype(jnp.float32), lengths, "page_table must be int32 \\[batch=3"),
      (table, lengths[:2], r"lengths must be int32 \[batch=3\]")):
    with pytest.raises(ValueError, match=message):
      paged_latent_attention.paged_latent_decode_attention(
          q, k, v, bad_table, bad_lengths, value_dim=value_dim, scale=0.2, layer=1,
          k_scales=ks, v_scales=vs)
  if cache_dtype is None:
    with pytest.raises(ValueError, match="k_pages must have q's dtype"):
      paged_latent_attention.paged_latent_decode_attention(
          q.astype(jnp.bfloat16), k, v, table, lengths, value_dim=value_dim, scale=0.2,
          layer=1)
  else:
    with pytest.raises(ValueError, match="pages need their scales"):
      paged_latent_attention.paged_latent_decode_attention(
          q, k, v, table, lengths, value_dim=value_dim, scale=0.2, layer=1)


@pytest.mark.parametrize("heads, head_dim, value_dim, block_q, cache_dtype", [
    (20, 32, 48, None, None), (4, 48, 80, 4, None), (40, 32, 64, 1, None),
    (4, 48, 80, 4, jnp.int8), (20, 32, 48, None, jnp.float8_e4m3fn)])
def test_latent_prefill_kernel_matches_the_reference(heads, head_dim, value_dim, block_q,
                                                     cache_dtype):
  """The prefill kernel (interpret mode) against the reference on fresh random pages:
  chunks behind cached prefixes (one ending mid-block), a fresh prompt, a row of length 0,
  padding query rows (NaN in q) giving exactly 0, masked heads (20 and 40 in blocks of 32;
  4 heads x 4 tokens), halves in pieces (48 = 32 + 16), int8 and float8 pages; slots past
  every row's tokens NaN; every element written (interpret mode starts the output as
  NaN)."""
  rng = np.random.default_rng(heads)
  layers, pages, page, batch, t = 2, 32, 8, 4, 13
  q_start = np.array([5, 30, 0, 7], np.int32)
  q_len = np.array([13, 9, 11, 0], np.int32)
  table = rng.permutation(pages)[:batch * 6].reshape(batch, 6).astype(np.int32)
  k, v, ks, vs = _latent_pages(rng, (layers, 1, pages, page, head_dim), table,
                               q_start + q_len, cache_dtype)
  q = rng.standard_normal((batch, t, heads, 2 * head_dim)).astype(np.float32)
  padding = np.arange(t)[None, :] >= q_len[:, None]
  q[padding] = np.nan
  args = (jnp.asarray(q), k, v, jnp.asarray(table), jnp.asarray(q_start),
          jnp.asarray(q_len))
  kwargs = dict(value_dim=value_dim, scale=0.2, layer=1, k_scales=ks, v_scales=vs)
  got = paged_latent_attention.paged_latent_prefill_attention(
      *args, interpret=True, block_q=block_q, block_n=16, **kwargs)
  want = reference.paged_latent_attention(
      jnp.asarray(np.where(padding[..., None, None], 0.0, q)), *args[1:4],
      jnp.asarray(q_start[:, None] + np.arange(t)), jnp.asarray(q_start + q_len), **kwargs)
  got, want = np.asarray(got), np.asarray(want)
  assert got.shape == (batch, t, heads, value_dim) and np.isfinite(got).all()
  np.testing.assert_allclose(got[~padding], want[~padding], rtol=1e-5, atol=1e-5)
  assert not got[padding].any()
  # The wrapper's XLA path (no GPU here) gives the same, padding included.
  np.testing.assert_allclose(paged_latent_attention.paged_latent_prefill_attention(
      *args, **kwargs), got, rtol=1e-5, atol=1e-5)


def test_latent_prefill_kernel_refuses_bad_input():
  k = jnp.ones((1, 1, 8, 8, 32), jnp.float32)
  q = jnp.ones((2, 4, 16, 64), jnp.float32)
  table = jnp.zeros((2, 3), jnp.int32)
  start, lens = jnp.asarray([0, 21], jnp.int32), jnp.asarray([4, 4], jnp.int32)
  call = functools.partial(paged_latent_attention.paged_latent_prefill_attention,
                           value_dim=48, scale=0.1, layer=0)
  with pytest.raises(ValueError, match=r"q_start \+ q_lengths must be <= .* = 24"):
    call(q, k, k, table, start, lens)
  with pytest.raises(ValueError, match=r"q_lengths must be in \[0, num_tokens = 4\]"):
    call(q, k, k, table, start, lens + 1)
  with pytest.raises(ValueError, match=r"q_start must be int32 \[batch=2\]"):
    call(q, k, k, table, start[:1], lens)
  with pytest.raises(ValueError, match=r"q must have shape \[batch, num_tokens, num_heads"):
    call(q[0], k, k, table, start, lens)
  with pytest.raises(ValueError, match="block_q x the heads per program"):
    call(q[:, :, :4], k, k, table, start - jnp.asarray([0, 1]), lens, block_q=2)
  # int8 pages of 32 tokens: a block reads whole pages of V (token-minor).
  k8 = jnp.ones((1, 1, 2, 32, 32), jnp.int8)
  scales = jnp.ones((1, 1, 2, 32), jnp.float32)
  with pytest.raises(ValueError, match=r"block_n must be >= page_size \(32\)"):
    call(q, k8, kv_quant.transpose_pages(k8), jnp.zeros((2, 1), jnp.int32), start * 0, lens,
         k_scales=scales, v_scales=scales, block_n=16)
  with pytest.raises(ValueError, match=r"v_pages token-minor"):
    call(q, k8, k8[:, :, :, :16], jnp.zeros((2, 1), jnp.int32), start * 0, lens,
         k_scales=scales, v_scales=scales)


@pytest.mark.gpu
@pytest.mark.parametrize("model_type", list(VARIANTS))
def test_triton_kernel_gives_the_references_and_hfs_tokens_on_gpu(model_type, tmp_path):
  """f32 on a GPU: the latent decode kernel's greedy tokens equal the reference path's
  and HF's (`assert_kernels_give_references_and_hfs_tokens`)."""
  model_class, config_class, fields = VARIANTS[model_type]
  torch.manual_seed(1)
  hf = model_class(config_class(**CONFIG, **fields)).eval()
  hf.save_pretrained(tmp_path)
  assert_kernels_give_references_and_hfs_tokens(hf, functools.partial(
      deepseek.from_pretrained, tmp_path))


@pytest.mark.gpu
def test_quantized_latent_kernels_match_the_reference_path_on_gpu(saved):
  """int8 and float8 pools on a GPU, f32 at the highest precision: the latent kernels'
  logits (a prefill, then decode steps) equal the reference path's over the same pool
  dtype (both dequantize the same bytes)."""
  _, path = saved
  prompts = _prompts(np.random.default_rng(4), [5, 21])
  models = {impl: deepseek.from_pretrained(path, decode_impl=impl)
            for impl in ("kernel", "reference")}
  for dtype in (jnp.int8, jnp.float8_e4m3fn):
    with jax.default_matmul_precision("highest"):
      logits = {impl: _logits_over_steps(model, prompts, dtype, 16)
                for impl, model in models.items()}
    want = logits["reference"]
    np.testing.assert_allclose(logits["kernel"], want, atol=1e-4 * np.abs(want).max(),
                               err_msg=str(dtype))


def test_config_reads_hf_and_refuses_what_it_lacks(saved):
  hf, path = saved
  config = json.loads((path / "config.json").read_text())
  c = deepseek.DeepseekConfig.from_dict(config)
  assert (c.num_local_experts, c.shared_expert_intermediate_size, c.head_dim) == (8, 32, 8)
  assert [c.sparse(i) for i in range(2)] == [False, True]
  # The softmax scale: HF's attention module's (with V2's YaRN mscale_all_dim).
  assert c.attention_scale == pytest.approx(hf.model.layers[0].self_attn.scaling, rel=1e-6)
  if c.model_type == "deepseek_v2":
    assert c.rope.rope_type == "yarn" and c.rope_interleave and c.q_lora_rank is None
  else:
    assert (c.topk_method, c.q_lora_rank, c.norm_topk_prob) == ("noaux_tc", 24, True)
  # Fields a config.json omits: Hugging Face's defaults for its model type, as HF reads the
  # same file (V2's num_experts_per_tok has none: required).
  for model_type, fields in (("deepseek_v2", {"num_experts_per_tok": 6}),
                             ("deepseek_v3", {})):
    d = deepseek.DeepseekConfig.from_dict({"model_type": model_type, **fields})
    hf_defaults = VARIANTS[model_type][1](**fields).to_dict()
    assert d == deepseek.DeepseekConfig.from_dict(hf_defaults)
    assert (d.hidden_size, d.num_local_experts, d.first_k_dense_replace, d.q_lora_rank,
            d.shared_expert_intermediate_size) == (
        hf_defaults["hidden_size"], hf_defaults["n_routed_experts"],
        hf_defaults["first_k_dense_replace"], 1536,
        hf_defaults["n_shared_experts"] * hf_defaults["moe_intermediate_size"])
    assert latent_attention.spec_head_dim(d.kv_lora_rank, d.qk_rope_head_dim) == 288
  # GLM-4.7-Flash's defaults: V3's model of its own shape, layer 0 dense.
  d = deepseek.DeepseekConfig.from_dict({"model_type": "glm4_moe_lite"})
  hf_defaults = transformers.Glm4MoeLiteConfig().to_dict()
  assert d == deepseek.DeepseekConfig.from_dict(hf_defaults)
  assert (d.hidden_size, d.num_hidden_layers, d.num_local_experts, d.num_experts_per_tok,
          d.q_lora_rank, d.qk_nope_head_dim, d.v_head_dim, d.routed_scaling_factor,
          d.mlp_layer_types, d.topk_method, d.eos_token_id) == (
              hf_defaults["hidden_size"], hf_defaults["num_hidden_layers"],
              hf_defaults["n_routed_experts"], hf_defaults["num_experts_per_tok"],
              hf_defaults["q_lora_rank"], hf_defaults["qk_nope_head_dim"],
              hf_defaults["v_head_dim"], hf_defaults["routed_scaling_factor"],
              tuple(hf_defaults["mlp_layer_types"]), "noaux_tc", hf_defaults["eos_token_id"])
  with pytest.raises(ValueError, match="mlp_layer_types must give 'dense' or 'sparse'"):
    deepseek.DeepseekConfig.from_dict({"model_type": "glm4_moe_lite", "num_hidden_layers": 2,
                                       "mlp_layer_types": ["dense", "moe"]})
  with pytest.raises(ValueError, match="deepseek_v2 config needs num_experts_per_tok"):
    deepseek.DeepseekConfig.from_dict({"model_type": "deepseek_v2"})
  for bad, message in (
      ({"topk_method": "random"}, "topk_method 'random' is not supported"),
      ({"n_group": 3}, "needs n_group dividing the 8 experts"),
      ({"topk_group": 5}, "topk_group <= n_group"),
      ({"kv_lora_rank": 33}, "kv_lora_rank \\+ qk_rope_head_dim must be even"),
      ({"routed_scaling_factor": 0.0}, "routed_scaling_factor must be a positive"),
      ({"hidden_act": "gelu"}, "hidden_act 'gelu'"),
      ({"model_type": "mixtral"}, "model_type 'mixtral' is not supported")):
    with pytest.raises(ValueError, match=message):
      deepseek.DeepseekConfig.from_dict({**config, **bad})
  other = "greedy" if c.topk_method == "noaux_tc" else "noaux_tc"
  with pytest.raises(ValueError, match=f"topk_method '{other}' does not go with"):
    deepseek.DeepseekConfig.from_dict({**config, "topk_method": other})


def test_engine_refuses_lora_and_tensor_parallel(saved):
  _, path = saved
  model = deepseek.from_pretrained(path)
  with pytest.raises(ValueError, match="LoRA adapters are not supported for DeepSeek"):
    jax_paged.Engine(model, max_batch=2, num_pages=8, page_size=PAGE, max_loras=1)
  mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]), ("tp",))
  with pytest.raises(ValueError, match="tensor parallelism is not supported for DeepSeek"):
    jax_paged.Engine(model, max_batch=2, num_pages=8, page_size=PAGE, mesh=mesh)


def test_bf16_tracks_hf(saved):
  """bf16 weights but the router's and V3's correction bias, f32 as in HF's models."""
  hf, path = saved
  assert_bf16_tracks_hf(hf, deepseek.from_pretrained(path, dtype=jnp.bfloat16),
                        f32_params=("'router'", "'correction_bias'"))


def test_cli_finds_the_model_type(saved, capsys):
  hf, path = saved
  assert_installed_cli_gives_hfs_tokens(hf, path, capsys, seed=6)
