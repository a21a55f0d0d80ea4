"""Multi-head latent attention (DeepSeek-V2 / V3's MLA) over the paged pool.

MLA caches one latent vector per token instead of K and V per head: c = norm(x W_DKV)
(kv_lora_rank wide, 512 in DeepSeek's models) and one rotated key k_rope shared by every
head (qk_rope_head_dim, 64): 576 values per token and layer where DeepSeek-V2-Lite's 16
heads of K (192) and V (128) would be 5,120. Each head's key and value are up-projections
of c (W_UK, W_UV, Hugging Face's kv_b_proj); attention never forms them: W_UK is absorbed
into the query (q_nope W_UK is a query in c's space) and W_UV into the output (the heads
attend over c, then project), so every head reads the same latent, as the heads of MQA
read one K/V head.

The latent lives in an ordinary `KVPool` of one kv head: its first half as the token's K,
its second as its V (`reference.paged_latent_attention`), so that every pool operation
(reserve, write, copy-on-write, prefix caching, int8 / float8 pages) holds it unchanged:
`spec_head_dim` gives the pool's head dim. Prefill and decode attend through
`kernels.paged_latent_attention`'s Triton kernels on a GPU (int8 / float8 pages
dequantized in registers), XLA's `reference.paged_latent_attention` elsewhere.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from jax_paged import nn as paged_nn
from jax_paged import pool as pool_lib
from jax_paged.kernels import paged_latent_attention
from jax_paged.kernels import reference


def spec_head_dim(kv_lora_rank: int, rope_dim: int) -> int:
  """The pool head dim holding one token's latent as its K and V halves."""
  width = kv_lora_rank + rope_dim
  if width % 2:
    raise ValueError(f"kv_lora_rank + qk_rope_head_dim must be even (the latent is stored "
                     f"as a K and a V half), got {kv_lora_rank} + {rope_dim}")
  return width // 2


class LatentAttention(nnx.Module):
  """DeepSeek's multi-head latent attention with its latent cached in a `KVPool`.

  Parameters (Hugging Face's modules, as kernels [in, out]): `q_proj` [hidden, H * (dn +
  dr)], or with a q_lora_rank `q_a_proj` [hidden, q_lora_rank], `q_a_norm` and `q_b_proj`
  [q_lora_rank, H * (dn + dr)] (each head's dn "nope" columns, then its dr rotated ones);
  `kv_a_proj` [hidden, kv_lora_rank + dr] (c's columns, then k_rope's) and `kv_a_norm`;
  `w_uk` [H, dn, kv_lora_rank] and `w_uv` [H, dv, kv_lora_rank], kv_b_proj's key and
  value rows per head; `out` [H * dv, hidden].

  The pool: one kv head of `spec_head_dim(kv_lora_rank, dr)` per layer.

  Args:
    hidden_size: the model's width.
    num_heads: H.
    qk_nope_head_dim, qk_rope_head_dim, v_head_dim: dn, dr, dv.
    kv_lora_rank: c's width.
    q_lora_rank: None (q projected directly: DeepSeek-V2-Lite) or the width of q's
      low-rank bottleneck.
    rope: the `RotaryEmbedding` of dr (applied in the rotate-half layout: a checkpoint's
      interleaved pairs are reordered when loaded).
    scale: the softmax scale (DeepSeek's 1 / sqrt(dn + dr), times YaRN's mscale squared).
    bias: biases on q_a / kv_a and out (HF's attention_bias).
    norm_eps: the epsilon of q_a_norm and kv_a_norm.
    decode_impl: "auto" or "kernel" (`kernels.paged_latent_attention`'s Triton kernels, at
      prefill and decode, on a GPU for a pool of widths they take; XLA's reference
      otherwise) or "reference" (XLA's everywhere, for comparisons).
  """

  def __init__(self, hidden_size: int, num_heads: int, *, qk_nope_head_dim: int,
               qk_rope_head_dim: int, v_head_dim: int, kv_lora_rank: int,
               q_lora_rank: int | None, rope: paged_nn.RotaryEmbedding, scale: float,
               bias: bool = False, norm_eps: float = 1e-6,
               decode_impl: paged_nn.DecodeImpl = "auto",
               kernel_init: nnx.Initializer = nnx.initializers.lecun_normal(),
               dtype=None, param_dtype=jnp.float32, rngs: nnx.Rngs):
    if rope.head_dim != qk_rope_head_dim:
      raise ValueError(f"rope must be a RotaryEmbedding of head_dim={qk_rope_head_dim}, got "
                       f"{rope.head_dim}")
    self.num_heads = num_heads
    self.nope_dim, self.rope_dim, self.v_dim = qk_nope_head_dim, qk_rope_head_dim, v_head_dim
    self.kv_lora_rank = kv_lora_rank
    self.head_dim = spec_head_dim(kv_lora_rank, qk_rope_head_dim)
    self.rope = rope
    self.scale = float(scale)
    if decode_impl not in ("auto", "kernel", "reference"):
      raise ValueError(f"decode_impl must be 'auto', 'kernel' or 'reference', got "
                       f"{decode_impl!r}")
    self.decode_impl = decode_impl
    self.dtype = dtype
    linear = lambda i, o, use_bias: nnx.Linear(  # noqa: E731
        i, o, use_bias=use_bias, kernel_init=kernel_init, dtype=dtype,
        param_dtype=param_dtype, rngs=rngs)
    q_width = num_heads * (qk_nope_head_dim + qk_rope_head_dim)
    if q_lora_rank is None:
      self.q_proj = linear(hidden_size, q_width, False)
      self.q_a_proj = self.q_a_norm = self.q_b_proj = None
    else:
      self.q_proj = None
      self.q_a_proj = linear(hidden_size, q_lora_rank, bias)
      self.q_a_norm = paged_nn.RMSNorm(q_lora_rank, epsilon=norm_eps, param_dtype=param_dtype)
      self.q_b_proj = linear(q_lora_rank, q_width, False)
    self.kv_a_proj = linear(hidden_size, kv_lora_rank + qk_rope_head_dim, bias)
    self.kv_a_norm = paged_nn.RMSNorm(kv_lora_rank, epsilon=norm_eps, param_dtype=param_dtype)
    # kv_b_proj's rows as they are: each head's dn key rows, then its dv value rows.
    self.w_uk = nnx.Param(kernel_init(rngs.params(), (num_heads, qk_nope_head_dim,
                                                      kv_lora_rank), param_dtype))
    self.w_uv = nnx.Param(kernel_init(rngs.params(), (num_heads, v_head_dim, kv_lora_rank),
                                      param_dtype))
    self.out = linear(num_heads * v_head_dim, hidden_size, bias)

  def _project(self, x: jax.Array, positions: jax.Array
               ) -> tuple[jax.Array, jax.Array, jax.Array]:
    """x [..., hidden] at positions int [...] -> (q in latent space [..., H, 2 D], the
    latent's K and V halves [..., 1, D]), in the compute dtype."""
    dtype = self.dtype or x.dtype
    if self.q_proj is not None:
      q = paged_nn.dense(self.q_proj, x)
    else:
      q = paged_nn.dense(self.q_b_proj, self.q_a_norm(paged_nn.dense(self.q_a_proj, x)))
    q = q.reshape(x.shape[:-1] + (self.num_heads, self.nope_dim + self.rope_dim))
    q_nope, q_rope = q[..., :self.nope_dim], q[..., self.nope_dim:]
    c, k_rope = paged_nn.dense(self.kv_a_proj, x, sections=(self.kv_lora_rank, self.rope_dim))
    c = self.kv_a_norm(c).astype(dtype)
    q_rope = self.rope(q_rope, positions)
    k_rope = self.rope(k_rope[..., None, :], positions)[..., 0, :]
    q_latent = jnp.einsum("...hn,hnr->...hr", q_nope, self.w_uk[...].astype(dtype))
    q = jnp.concatenate([q_latent, q_rope.astype(dtype)], axis=-1)
    latent = jnp.concatenate([c, k_rope.astype(dtype)], axis=-1)[..., None, :]
    return q, latent[..., :self.head_dim], latent[..., self.head_dim:]

  def _up_project(self, o: jax.Array, dtype) -> jax.Array:
    """The heads' attention over c, o [B, T, H, kv_lora_rank] -> [B, T, H * dv] in
    `dtype`, up-projected by w_uv."""
    o = jnp.einsum("bthr,hvr->bthv", o.astype(dtype), self.w_uv[...].astype(dtype))
    return o.reshape(o.shape[:2] + (-1,))

  def _use_kernel(self, kv: pool_lib.KVPool) -> bool:
    """Whether prefill and decode call `paged_latent_{prefill,decode}_attention` (the
    Triton kernels on a GPU, XLA's reference elsewhere): unless decode_impl is
    "reference", for a pool of widths and page size they take."""
    return (self.decode_impl != "reference"
            and paged_latent_attention.kernel_supports(self.head_dim, self.kv_lora_rank,
                                                       kv.page_size))

  def prefill(self, x: jax.Array, kv: pool_lib.KVPool, layer: int, slots: jax.Array,
              lengths: jax.Array, *, start: jax.Array | None = None,
              page_table: jax.Array | None = None, project: bool = True,
              adapters: jax.Array | None = None) -> tuple[jax.Array, pool_lib.KVPool]:
    """New tokens of several sequences, as `nn.PagedAttention.prefill` (its Args and
    Returns; no LoRA slots: `adapters` must be None). The new tokens' latents are written,
    then every query attends through the pages (the prefix cached before `start` too), so
    a quantized pool's prompt sees the cache as decoding will."""
    if adapters is not None:
      raise ValueError("LatentAttention takes no LoRA adapters")
    dtype = self.dtype or x.dtype
    positions = jnp.arange(x.shape[1])[None, :] + (0 if start is None else start[:, None])
    q, k, v = self._project(x, positions)
    kv = pool_lib.write_kv(kv, layer, slots, k, v)
    start, page_table, lengths = paged_nn.prefill_pages(slots, lengths, kv.page_size, start,
                                                        page_table)
    if self._use_kernel(kv):
      o = paged_latent_attention.paged_latent_prefill_attention(
          paged_nn.pool_query(q, kv), kv.k_pages, kv.v_pages, page_table, start, lengths,
          value_dim=self.kv_lora_rank, scale=self.scale, layer=layer, k_scales=kv.k_scales,
          v_scales=kv.v_scales)
    else:
      o = reference.paged_latent_attention(
          q, kv.k_pages, kv.v_pages, page_table, positions, start + lengths,
          value_dim=self.kv_lora_rank, scale=self.scale, layer=layer, k_scales=kv.k_scales,
          v_scales=kv.v_scales)
    y = self._up_project(o, dtype)
    return (paged_nn.projection(self.out, y) if project else y), kv

  def decode(self, x: jax.Array, kv: pool_lib.KVPool, layer: int, slots: jax.Array,
             page_table: jax.Array, lengths: jax.Array, *, project: bool = True,
             adapters: jax.Array | None = None) -> tuple[jax.Array, pool_lib.KVPool]:
    """One new token per sequence, as `nn.PagedAttention.decode` (its Args and Returns;
    `adapters` must be None)."""
    if adapters is not None:
      raise ValueError("LatentAttention takes no LoRA adapters")
    dtype = self.dtype or x.dtype
    positions = jnp.maximum(lengths - 1, 0)
    q, k, v = self._project(x, positions)
    kv = pool_lib.write_kv(kv, layer, slots, k, v)
    if self._use_kernel(kv):
      o = paged_latent_attention.paged_latent_decode_attention(
          paged_nn.pool_query(q, kv), kv.k_pages, kv.v_pages, page_table, lengths,
          value_dim=self.kv_lora_rank, scale=self.scale, layer=layer, k_scales=kv.k_scales,
          v_scales=kv.v_scales)[:, None]
    else:
      o = reference.paged_latent_attention(
          q[:, None], kv.k_pages, kv.v_pages, page_table, positions[:, None], lengths,
          value_dim=self.kv_lora_rank, scale=self.scale, layer=layer, k_scales=kv.k_scales,
          v_scales=kv.v_scales)
    y = self._up_project(o, dtype)[:, 0]
    return (paged_nn.projection(self.out, y) if project else y), kv
