"""Read the decode kernel's machine code without a GPU: Triton IR -> PTX -> SASS.

jax lowers the Pallas kernel to Triton IR on any machine (lowering for the "cuda" platform
needs no GPU); a pip-installed Triton compiles that IR for sm_90a and its bundled ptxas
and cuobjdump give registers and SASS. The loop's global loads (LDG; LDGSTS = cp.async into
shared memory, i.e. software-pipelined), barriers and branches are listed in order, which
answers: are the K/V loads 16-byte vectors (LDG.E.128), is the page-table load off the
critical path, is there enough in flight?

    python -m venv /tmp/tv && /tmp/tv/bin/pip install triton==3.5.1
    PYTHONPATH=. python benchmarks/kernel_sass.py --triton-python /tmp/tv/bin/python \\
        [--batch 256 --heads 12 --kv-heads 12 --head-dim 64 --cache-dtype int8]
        [--warps 2 --stages 2 --block-n 64]

The Triton here need not be the one inside the GPU's jaxlib, so treat the output as a
close reading of what the device compiles, not the exact binary.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import tempfile

import jax
import jax.numpy as jnp
from jax._src.pallas.triton import lowering
from jax._src.pallas.triton import pallas_call_registration

from jax_paged.kernels import kv_quant
from jax_paged.kernels import paged_attention
from jax_paged.kernels import triton_backend

_COMPILE = """
import sys, triton
from triton.backends.compiler import GPUTarget
src, warps, stages = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
k = triton.compile(src, target=GPUTarget("cuda", 90, 32),
                   options={"num_warps": warps, "num_stages": stages})
open(src[:-5] + ".ptx", "w").write(k.asm["ptx"])
print(f"{k.metadata.shared} bytes shared memory")
"""

_TABLE_PAGES = 64  # the page table's width: one split walks up to 64 pages
_PAGE_SIZE = 16


def decode_kernel_ttir(batch: int, heads: int, kv_heads: int, head_dim: int, warps: int,
                       stages: int, block_n: int, page_size: int = _PAGE_SIZE,
                       cache_dtype=jnp.bfloat16) -> str:
  """The Triton IR of `paged_decode_attention`'s kernel (one split) for these shapes and
  pages of `cache_dtype` (int8 / float8_e4m3fn: with their per-token scales)."""
  modules = []
  lower = lowering.lower_jaxpr_to_triton_module

  def capture(*args, **kwargs):
    modules.append(lower(*args, **kwargs))
    return modules[-1]

  pallas_call_registration.lowering.lower_jaxpr_to_triton_module = capture
  try:
    q = jax.ShapeDtypeStruct((batch, heads, head_dim), jnp.bfloat16)
    kv = jax.ShapeDtypeStruct((kv_heads, 4096, page_size, head_dim), cache_dtype)
    v = jax.ShapeDtypeStruct(kv_quant.v_pages_shape(kv.shape, cache_dtype), cache_dtype)
    quantized = jnp.dtype(cache_dtype).itemsize == 1
    scales = jax.ShapeDtypeStruct(kv.shape[:-1], jnp.float32) if quantized else None
    table = jax.ShapeDtypeStruct((batch, _TABLE_PAGES), jnp.int32)
    lengths = jax.ShapeDtypeStruct((batch,), jnp.int32)
    layer = jax.ShapeDtypeStruct((), jnp.int32)
    # pylint: disable-next=protected-access
    fn = jax.jit(lambda *a: paged_attention._paged_decode_pallas(
        *a, scale=head_dim ** -0.5, logits_soft_cap=None, sliding_window=None,
        attention_chunk=None, num_splits=1, return_lse=False, interpret=False,
        block_n=block_n, num_warps=warps,
        num_stages=stages))
    with triton_backend.cuda_lowering_context():
      fn.trace(q, kv, v, table, lengths, layer, scales, scales, None, None).lower(
          lowering_platforms=("cuda",))
  finally:
    pallas_call_registration.lowering.lower_jaxpr_to_triton_module = lower
  return modules[0].module.operation.get_asm(enable_debug_info=False)


def main():
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--triton-python", required=True, help="a Python with `triton` installed")
  p.add_argument("--batch", type=int, default=256)
  p.add_argument("--heads", type=int, default=12)
  p.add_argument("--kv-heads", type=int, default=12)
  p.add_argument("--head-dim", type=int, default=64)
  p.add_argument("--cache-dtype", default="bfloat16",
                 choices=("bfloat16", "int8", "float8_e4m3fn"))
  p.add_argument("--warps", type=int, default=None, help="default: the kernel's choice")
  p.add_argument("--stages", type=int, default=None, help="default: the kernel's choice")
  p.add_argument("--block-n", type=int, default=None, help="default: the kernel's choice")
  p.add_argument("--out", default=tempfile.mkdtemp(), help="folder for .ttir/.ptx/.sass")
  args = p.parse_args()
  cache_dtype = jnp.dtype(args.cache_dtype)
  block_n, warps, stages = paged_attention.default_config(
      args.batch * args.kv_heads, args.heads // args.kv_heads, args.head_dim,
      cache_dtype=cache_dtype if cache_dtype.itemsize == 1 else None,
      tokens_per_split=_TABLE_PAGES * _PAGE_SIZE)  # one split over the whole table
  block_n, warps, stages = args.block_n or block_n, args.warps or warps, args.stages or stages
  os.makedirs(args.out, exist_ok=True)
  stem = os.path.join(args.out, "decode")
  with open(stem + ".ttir", "w") as f:
    f.write(decode_kernel_ttir(args.batch, args.heads, args.kv_heads, args.head_dim, warps,
                               stages, block_n, cache_dtype=cache_dtype))
  shared = subprocess.run([args.triton_python, "-c", _COMPILE, stem + ".ttir", str(warps),
                           str(stages)], check=True, capture_output=True,
                          text=True).stdout.strip()
  tools = subprocess.run([args.triton_python, "-c", "import triton, os; print(os.path.join("
                          "os.path.dirname(triton.__file__), 'backends/nvidia/bin'))"],
                         check=True, capture_output=True, text=True).stdout.strip()
  report = subprocess.run([os.path.join(tools, "ptxas"), "-arch=sm_90a", "-v", stem + ".ptx",
                           "-o", stem + ".cubin"], check=True, capture_output=True, text=True)
  sass = subprocess.run([os.path.join(tools, "cuobjdump"), "-sass", stem + ".cubin"],
                        check=True, capture_output=True, text=True).stdout
  with open(stem + ".sass", "w") as f:
    f.write(sass)
  print(f"# decode kernel B={args.batch} H={args.heads} Hkv={args.kv_heads} D={args.head_dim}"
        f" {cache_dtype.name} warps={warps} stages={stages} block_n={block_n}; files in "
        f"{args.out}")
  print(" ".join(re.findall(r"Used \d+ registers|\d+ bytes spill \w+", report.stderr)), shared)
  for line in sass.splitlines():
    m = re.search(r"/\*([0-9a-f]{4})\*/\s+(.*?);", line)
    if m and re.search(r"\b(LDG|LDGSTS|BAR|BRA|EXIT)\b", m.group(2)):
      print(m.group(1), " ".join(m.group(2).split()[:3]))


if __name__ == "__main__":
  main()
