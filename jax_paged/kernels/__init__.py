"""The Pallas kernels (lowered through Triton on a GPU) with their plain-XLA references.

One kernel per module, in the style of jax's `jax.experimental.pallas.ops.gpu`: the kernel
body, a wrapper that builds the grid, a public entry that validates its arguments and picks
the compiled kernel (GPU), interpret mode (`interpret=True`, tests) or plain XLA (CPU).

  paged_attention   paged decode attention, split-KV (flash-decoding), MHA / GQA / MQA
  paged_prefill     paged prefill attention: query chunks over a paged (cached) prefix,
                    causal, flash-attention style
  merge_attention   merging attention states by their log-sum-exp
  reference         the plain-jnp ground truth of those three
  linear            GEMMs with fused epilogues at decode's few rows; a tied LM head's argmax
  grouped_matmul    rows sorted by group times each group's weights (mixture-of-experts),
                    reading only the groups that have rows
  layer_norm        layer and RMS norms, and the residual add + norm of a pre-norm block
  cache_write       K/V into the pool's pages (and the q/k/v projection that stores them)
  kv_quant          int8 / float8 cache dtypes: per-token scales, quantize / dequantize
  decode_reserve    a decode step's page reservation
  page_copy         copies of whole pages (copy-on-write, a fork's own last pages)
  triton_backend    backend choice, compiler params, the kernel-or-XLA decision
  validation        argument checks shared by kernels and references
"""
