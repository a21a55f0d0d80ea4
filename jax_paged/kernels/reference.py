"""Plain jax.numpy references: the ground truth every kernel is tested against.

Written for clarity, not speed. They are also the library's CPU path (XLA compiles them
well enough for CPU generation), so they are jittable and take the same arguments as the
Pallas kernels.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jax_paged.kernels import validation


def gather_pages(pages: jax.Array, page_table: jax.Array, lengths: jax.Array, *,
                 tokens_minor: bool = False) -> jax.Array:
  """Gathers each sequence's K or V from its pages into a contiguous array.

  Args:
    pages: [Hkv, num_pages, page_size, D], or with `tokens_minor` [Hkv, num_pages, D,
      page_size] (a quantized pool's V).
    page_table: int32 [B, max_pages_per_seq].
    lengths: int32 [B].

  Returns:
    [B, Hkv, max_pages_per_seq * page_size, D]. Positions at or past a sequence's length
    hold page 0's data: table entries past the last used page are garbage (possibly out of
    range) and are never used as indices.
  """
  page_size = pages.shape[3 if tokens_minor else 2]
  max_pages = page_table.shape[1]
  page_table = validation.clamp_page_ids(page_table, pages.shape[1])
  lengths = validation.clamp_lengths(lengths, max_pages * page_size)
  used_pages = (lengths + page_size - 1) // page_size
  live = jnp.arange(max_pages)[None, :] < used_pages[:, None]
  safe_table = jnp.where(live, page_table, 0)
  gathered = pages[:, safe_table]  # [Hkv, B, max_pages, page_size, D]
  if tokens_minor:  # only the gathered pages are transposed
    gathered = jnp.swapaxes(gathered, -1, -2)
  b = page_table.shape[0]
  gathered = gathered.reshape(pages.shape[0], b, max_pages * page_size, gathered.shape[-1])
  return gathered.transpose(1, 0, 2, 3)


def _gather_kv(k_pages, v_pages, k_scales, v_scales, layer, page_table, lengths):
  """Each sequence's K and V, f32 [B, Hkv, max_pages_per_seq * page_size, D], gathered
  from one layer (None: the pools are one layer; else an int or traced index, clamped into
  range) and dequantized with their scales where quantized (V pages then token-minor)."""
  if layer is not None:
    layer = jnp.clip(layer, 0, k_pages.shape[0] - 1)

  def gather(pages, tokens_minor=False):
    if layer is not None:
      pages = jax.lax.dynamic_index_in_dim(pages, layer, keepdims=False)
    return gather_pages(pages, page_table, lengths,
                        tokens_minor=tokens_minor).astype(jnp.float32)

  k, v = gather(k_pages), gather(v_pages, tokens_minor=v_scales is not None)
  if k_scales is not None:  # one scale per token and kv head
    k, v = k * gather(k_scales[..., None]), v * gather(v_scales[..., None])
  return k, v


def paged_decode_attention(q: jax.Array, k_pages: jax.Array, v_pages: jax.Array,
                           page_table: jax.Array, lengths: jax.Array, *,
                           layer: int | jax.Array | None = None,
                           k_scales: jax.Array | None = None,
                           v_scales: jax.Array | None = None,
                           scale: float | None = None, logits_soft_cap: float | None = None,
                           sliding_window: int | None = None,
                           alibi_slopes: jax.Array | None = None,
                           sinks: jax.Array | None = None, return_lse: bool = False,
                           attention_chunk: int | None = None):
  """One query token per sequence attending to its paged K/V cache.

  Args:
    q: [B, H, D] float32 / bfloat16 / float16.
    k_pages, v_pages: [Hkv, num_pages, page_size, D], H % Hkv == 0; with `layer`, whole
      pools [num_layers, Hkv, num_pages, page_size, D]. A float dtype, or int8 /
      float8_e4m3fn with scales, whose v_pages are token-minor [..., D, page_size]
      (`kv_quant.v_pages_shape`).
    k_scales, v_scales: float32 k_pages.shape[:-1] for int8 / float8 pages (one scale per
      token per kv head: K = k_pages * k_scales, `kv_quant.dequantize`), else None. The
      pages are dequantized in f32 and attended to exactly as float pages.
    page_table: int32 [B, max_pages_per_seq], physical page ids in [0, num_pages) for the
      pages a sequence uses (the rest is never read).
    lengths: int32 [B] in [0, max_pages_per_seq * page_size], tokens in each sequence's
      cache (0 = empty). Concrete values out of range raise ValueError; traced ones are
      clamped, as the kernel clamps them (lengths into that range, page ids into
      [0, num_pages)).
    layer: None, or the pools' layer to attend to (an int, or an integer scalar array,
      clamped into [0, num_layers)).
    scale: logits = scale * q.k; defaults to D ** -0.5.
    logits_soft_cap: c > 0 gives logits = c * tanh(logits / c).
    sliding_window: W > 0 limits a sequence of length L to positions [L - W, L).
    alibi_slopes: float32 [H] or None: ALiBi (Press et al.; BLOOM's, MPT's) adds
      slope_h * (j - (L - 1)) to head h's logit of the key at position j (after a soft
      cap), the query at position L - 1.
    sinks: float32 [H] or None: attention sinks (GPT-OSS's): head h's softmax also counts
      a logit sinks[h] that has no value, so its weights sum to less than 1.
    return_lse: also return the log-sum-exp of the final logits (the sink's included).
    attention_chunk: C > 0 limits a sequence of length L to the positions of its last
      token's chunk of C, [floor((L - 1) / C) * C, L) (Llama 4's chunked attention).

  Returns:
    out [B, H, D] in q's dtype, and if `return_lse`, lse float32 [B, H] (natural log).
    A sequence of length 0 gives out 0 and lse -inf (with sinks: the sink's logit).
  """
  k_layer = validation.check_decode_call(
      q, k_pages, v_pages, page_table, lengths, layer=layer, scale=scale,
      logits_soft_cap=logits_soft_cap, sliding_window=sliding_window,
      strict_kernel_shapes=False, k_scales=k_scales, v_scales=v_scales,
      alibi_slopes=alibi_slopes, sinks=sinks, attention_chunk=attention_chunk)
  lengths = validation.clamp_lengths(lengths, page_table.shape[1] * k_layer.shape[2])
  b, h, d = q.shape
  hkv = k_layer.shape[0]
  scale = d ** -0.5 if scale is None else scale
  k, v = _gather_kv(k_pages, v_pages, k_scales, v_scales, layer, page_table, lengths)
  qg = q.astype(jnp.float32).reshape(b, hkv, h // hkv, d)
  logits = jnp.einsum("bkgd,bktd->bkgt", qg, k, precision=jax.lax.Precision.HIGHEST) * scale
  if logits_soft_cap is not None:
    logits = logits_soft_cap * jnp.tanh(logits / logits_soft_cap)
  pos = jnp.arange(k.shape[2])[None, :]
  if alibi_slopes is not None:
    offset = (pos - (lengths[:, None] - 1)).astype(jnp.float32)  # [B, S]
    logits += alibi_slopes.reshape(hkv, h // hkv)[None, :, :, None] * offset[:, None, None]
  mask = pos < lengths[:, None]
  mask &= pos >= validation.first_visible_key(lengths[:, None] - 1, sliding_window,
                                              attention_chunk)
  mask = mask[:, None, None, :]
  logits = jnp.where(mask, logits, -jnp.inf)
  lse = _with_sinks(jax.nn.logsumexp(logits, axis=-1), sinks, (1, hkv, h // hkv))
  probs = jnp.where(mask, jnp.exp(logits - jnp.where(jnp.isfinite(lse), lse, 0.0)[..., None]),
                    0.0)
  out = jnp.einsum("bkgt,bktd->bkgd", probs, v, precision=jax.lax.Precision.HIGHEST)
  out = out.reshape(b, h, d).astype(q.dtype)
  if return_lse:
    return out, lse.reshape(b, h)
  return out


def paged_prefill_attention(q: jax.Array, k_pages: jax.Array, v_pages: jax.Array,
                            page_table: jax.Array, q_start: jax.Array, q_lengths: jax.Array,
                            *, layer: int | jax.Array | None = None,
                            scale: float | None = None,
                            logits_soft_cap: float | None = None,
                            sliding_window: int | None = None,
                            k_scales: jax.Array | None = None,
                            v_scales: jax.Array | None = None,
                            alibi_slopes: jax.Array | None = None,
                            sinks: jax.Array | None = None,
                            attention_chunk: int | None = None) -> jax.Array:
  """Several query tokens per sequence attending causally to its paged K/V cache.

  Row b's query t (t < q_lengths[b]) sits at position p = q_start[b] + t and attends to the
  keys at positions [0, p] (with `sliding_window` W: [p - W + 1, p]; with
  `attention_chunk` C: [floor(p / C) * C, p]), all read from the pages: this chunk's own
  K/V are already written there.

  Args:
    q: [B, T, H, D] float32 / bfloat16 / float16.
    k_pages, v_pages: [Hkv, num_pages, page_size, D], H % Hkv == 0; with `layer`, whole
      pools [num_layers, Hkv, num_pages, page_size, D]; int8 / float8 v_pages token-minor
      [..., D, page_size] (as `paged_decode_attention` takes them).
    page_table: int32 [B, max_pages_per_seq], physical page ids in [0, num_pages) for the
      pages a sequence uses (its first q_start + q_lengths tokens; the rest is never read).
    q_start: int32 [B] >= 0, tokens cached before this chunk.
    q_lengths: int32 [B] in [0, T], real query tokens in each row (the rest is padding).
      q_start + q_lengths <= max_pages_per_seq * page_size. Concrete values out of range
      raise ValueError; traced ones are clamped (`validation.clamp_prefill`; page ids into
      [0, num_pages)).
    layer: None, or the pools' layer to attend to (an int, or an integer scalar array,
      clamped into [0, num_layers)).
    scale: logits = scale * q.k; defaults to D ** -0.5.
    logits_soft_cap: if set, logits = cap * tanh(logits / cap) before the softmax (Gemma
      2's attention soft-capping).
    sliding_window: W > 0 limits the query at position p to keys [p - W + 1, p].
    k_scales, v_scales: for int8 / float8 pages, their scales (as `paged_decode_attention`
      takes them: the pages it gathers are dequantized in f32); else None.
    alibi_slopes: float32 [H] or None: ALiBi adds slope_h * (j - p) to head h's logit of
      the key at position j for the query at position p (after a soft cap).
    sinks: float32 [H] or None: attention sinks, as `paged_decode_attention` counts them.
    attention_chunk: C > 0 limits the query at position p to keys [floor(p / C) * C, p]
      (Llama 4's chunked attention: its chunk's keys).

  Returns:
    out [B, T, H, D] in q's dtype; padding queries (t >= q_lengths[b]) give exactly 0.
  """
  k_layer = validation.check_prefill_call(
      q, k_pages, v_pages, page_table, q_start, q_lengths, layer=layer, scale=scale,
      logits_soft_cap=logits_soft_cap, sliding_window=sliding_window,
      strict_kernel_shapes=False, k_scales=k_scales, v_scales=v_scales,
      alibi_slopes=alibi_slopes, sinks=sinks, attention_chunk=attention_chunk)
  b, t, h, d = q.shape
  q_start, q_lengths = validation.clamp_prefill(
      q_start, q_lengths, num_tokens=t, capacity=page_table.shape[1] * k_layer.shape[2])
  hkv = k_layer.shape[0]
  scale = d ** -0.5 if scale is None else scale
  lengths = q_start + q_lengths
  k, v = _gather_kv(k_pages, v_pages, k_scales, v_scales, layer, page_table, lengths)
  key_pos = jnp.arange(k.shape[2])
  # Positions past a sequence's length hold page 0's data, whatever it is (NaN included):
  # zero them, as a zero weight times NaN would still be NaN.
  live = (key_pos[None, :] < lengths[:, None])[:, None, :, None]
  k, v = jnp.where(live, k, 0.0), jnp.where(live, v, 0.0)
  qg = q.astype(jnp.float32).reshape(b, t, hkv, h // hkv, d)
  logits = jnp.einsum("btkgd,bksd->bkgts", qg, k,
                      precision=jax.lax.Precision.HIGHEST) * scale
  if logits_soft_cap is not None:
    logits = logits_soft_cap * jnp.tanh(logits / logits_soft_cap)
  pos = q_start[:, None] + jnp.arange(t)[None, :]  # [B, T]
  if alibi_slopes is not None:
    offset = (key_pos[None, None, :] - pos[:, :, None]).astype(jnp.float32)  # [B, T, S]
    logits += (alibi_slopes.reshape(hkv, h // hkv)[None, :, :, None, None]
               * offset[:, None, None])
  mask = key_pos[None, None, :] <= pos[:, :, None]  # [B, T, S]
  mask &= key_pos[None, None, :] >= validation.first_visible_key(
      pos[:, :, None], sliding_window, attention_chunk)
  mask &= (jnp.arange(t)[None, :] < q_lengths[:, None])[:, :, None]
  mask = mask[:, None, None]  # [B, 1, 1, T, S]
  logits = jnp.where(mask, logits, -jnp.inf)
  # -inf for a padding query (with sinks: the sink's logit; its weights are masked)
  lse = _with_sinks(jax.nn.logsumexp(logits, axis=-1), sinks, (1, hkv, h // hkv, 1))
  probs = jnp.where(mask, jnp.exp(logits - jnp.where(jnp.isfinite(lse), lse, 0.0)[..., None]),
                    0.0)
  out = jnp.einsum("bkgts,bksd->btkgd", probs, v, precision=jax.lax.Precision.HIGHEST)
  return out.reshape(b, t, h, d).astype(q.dtype)


def _with_sinks(lse: jax.Array, sinks: jax.Array | None, shape: tuple[int, ...]
                ) -> jax.Array:
  """The log-sum-exp `lse` of a softmax's logits with each head's sink logit counted
  (`sinks` [H] reshaped to `shape`, broadcasting against lse), or lse itself."""
  return lse if sinks is None else jnp.logaddexp(lse, sinks.reshape(shape))


def paged_latent_attention(q: jax.Array, k_pages: jax.Array, v_pages: jax.Array,
                           page_table: jax.Array, q_positions: jax.Array,
                           lengths: jax.Array, *, value_dim: int, scale: float,
                           layer=None, k_scales: jax.Array | None = None,
                           v_scales: jax.Array | None = None) -> jax.Array:
  """Multi-head latent attention (DeepSeek's MLA, its up-projections absorbed into q and
  the output) over pages that hold one latent vector per token.

  Each token's latent [c; k_rope] (width 2 * D: the compressed K/V c, then the rotated
  key shared by every head) is stored as the K (first D) and V (last D) of the pool's one
  kv head, so that an ordinary `KVPool` (int8 / float8 ones too) holds it. Every query
  head attends with scores scale * q . latent and sums c = latent[:value_dim].

  Args:
    q: [B, T, H, 2 * D], the queries in latent space ([q_nope W_UK; q_rope]).
    k_pages, v_pages: [num_layers, 1, num_pages, page_size, D] with `layer` (a quantized
      pool's v_pages token-minor), or one layer's [1, num_pages, page_size, D].
    page_table: int32 [B, max_pages_per_seq].
    q_positions: int32 [B, T], each query's position: it attends to the keys at
      positions <= its own and < its row's length.
    lengths: int32 [B], tokens in each row's pages (0: the row attends to nothing).
    value_dim: the width of c (kv_lora_rank), <= 2 * D.
    scale: the softmax scale.
    k_scales, v_scales: a quantized pool's scales.

  Returns:
    float32 [B, T, H, value_dim]; 0 for a query with no key to attend to.
  """
  k, v = _gather_kv(k_pages, v_pages, k_scales, v_scales, layer, page_table, lengths)
  latent = jnp.concatenate([k[:, 0], v[:, 0]], axis=-1)  # [B, S, 2 D]
  key_positions = jnp.arange(latent.shape[1])
  # Past a row's length the gathered values are another page's (or garbage): zeroed, so
  # that even a non-finite one is not multiplied by its zero probability.
  latent = jnp.where((key_positions[None, :] < lengths[:, None])[..., None], latent, 0.0)
  scores = jnp.einsum("bthd,bsd->bths", q.astype(jnp.float32), latent,
                      precision=jax.lax.Precision.HIGHEST) * scale
  visible = ((key_positions[None, None, :] <= q_positions[:, :, None])
             & (key_positions[None, None, :] < lengths[:, None, None]))[:, :, None, :]
  scores = jnp.where(visible, scores, -jnp.inf)
  p = jnp.exp(scores - jnp.max(scores, axis=-1, keepdims=True, initial=-1e30))
  p = p / jnp.maximum(jnp.sum(p, axis=-1, keepdims=True), 1e-30)
  return jnp.einsum("bths,bsd->bthd", p, latent[..., :value_dim],
                    precision=jax.lax.Precision.HIGHEST)


def merge_attention_states_n(o: jax.Array, lse: jax.Array) -> tuple[jax.Array, jax.Array]:
  """Merges N partial attention states along the leading axis.

  Args:
    o: [N, ..., D] partial outputs, each normalised over its own keys.
    lse: float32 [N, ...], each partial's log-sum-exp; +inf or -inf marks an empty state.

  Returns:
    (o [..., D] in o's dtype, lse float32 [...]). All-empty inputs give o = 0 and
    lse = -inf; never NaN.
  """
  validation.check_merge_n_args(o, lse)
  lse = jnp.where(lse == jnp.inf, -jnp.inf, lse)
  m = jnp.max(lse, axis=0)
  m_safe = jnp.where(m == -jnp.inf, 0.0, m)
  w = jnp.exp(lse - m_safe)  # 0 for empty states
  total = jnp.sum(w, axis=0)
  out_lse = jnp.where(total > 0, m_safe + jnp.log(total), -jnp.inf)
  # An empty state's output is meaningless (it may even be NaN): it contributes exactly 0.
  weighted = jnp.where(w[..., None] > 0, o.astype(jnp.float32) * w[..., None], 0.0)
  out = jnp.sum(weighted, axis=0) / jnp.where(total > 0, total, 1.0)[..., None]
  return out.astype(o.dtype), out_lse


def merge_attention_states(o_a: jax.Array, lse_a: jax.Array, o_b: jax.Array,
                           lse_b: jax.Array) -> tuple[jax.Array, jax.Array]:
  """Merges two partial attention states (vLLM's merge_attn_states).

  Args:
    o_a, o_b: [..., D] float32 / bfloat16 / float16 partial outputs.
    lse_a, lse_b: float32 [...] (= o.shape[:-1]) their log-sum-exps.

  Returns:
    (o, lse) with lse = log(exp(lse_a) + exp(lse_b)) and
    o = o_a * exp(lse_a - lse) + o_b * exp(lse_b - lse), computed stably. An lse of +inf
    counts as -inf (empty); two empty states give o = 0, lse = -inf.
  """
  validation.check_merge_args(o_a, lse_a, o_b, lse_b)
  return merge_attention_states_n(jnp.stack([o_a, o_b]), jnp.stack([lse_a, lse_b]))
