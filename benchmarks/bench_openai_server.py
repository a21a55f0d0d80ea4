"""What serving over HTTP costs: the same arrivals served in process and by jax-paged-serve.

GPT-2 124M with random weights, bf16, EOS ignored, greedy; bench_serving's workload (N
requests, prompts of uniform length in [32, 512] tokens, uniform [16, 256] new tokens,
Poisson arrivals) at each rate. Two ways, each an engine of 256 slots, 16 decode steps
per call, pages enough for every slot's longest request:

* in process: each request `Engine.add_request`ed as it arrives, between `step()`s
  (bench_serving's continuous way);
* over HTTP: `python -m jax_paged.openai_server` in a subprocess, each request a streamed
  `POST /v1/completions` (token ids in, `return_token_ids` out) sent by a client thread
  started at its arrival; a token counts when its chunk reaches the client. The server's
  process runs the engine's thread and one thread per connection; this one the clients.

Per rate and way: new tokens/s from the first arrival to the last token; time to first
token from each request's arrival (mean, p50, p99); time per output token after the first;
latency to the last token. Every pass draws fresh prompt tokens (the same lengths and
arrivals), so that no pass reads another's pages from the prefix cache; each way first
compiles its batch shapes (`Engine.warmup()`; the server's `--warmup greedy`, from the
programs the first left in a compilation cache) and serves every rate's workload untimed
`--passes` times.

    PYTHONPATH=. python benchmarks/bench_openai_server.py          # on the GPU
    PYTHONPATH=. python benchmarks/bench_openai_server.py --tiny   # smoke test on CPU
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from benchmarks import bench_serving, common
from jax_paged import Engine, Request, cli
from models import gpt2

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


# jax-paged-serve with this checkout's GPT-2 (the entry points need `pip install -e .`,
# which the GPU machine has not had).
LAUNCH = ("import sys; from jax_paged import openai_server; "
          "sys.exit(openai_server.main(sys.argv[1:], family_refs=['models.gpt2:FAMILY']))")


class Server:
  """jax-paged-serve in a subprocess, until `close()`."""

  def __init__(self, args: list[str], log_path: str):
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    self.proc = subprocess.Popen([sys.executable, "-c", LAUNCH, *args],
                                 env=env, cwd=ROOT, stderr=subprocess.PIPE, text=True)
    self.log = open(log_path, "w")
    for line in self.proc.stderr:
      self.log.write(line)
      found = re.search(r"at http://([^:/]+):(\d+)/v1", line)
      if found:
        self.host, self.port = found.group(1), int(found.group(2))
        break
    else:
      raise RuntimeError(f"the server did not start: see {log_path}")
    # Drained on, so that the server never blocks on a full pipe.
    threading.Thread(target=lambda: self.log.writelines(self.proc.stderr), daemon=True).start()

  def close(self) -> None:
    self.proc.send_signal(signal.SIGTERM)
    self.proc.wait(timeout=120)
    self.log.close()


def stream(server: Server, request: Request, clock: bench_serving.Clock, k: int) -> None:
  """One streamed completion; each chunk's tokens recorded for request k as it comes."""
  conn = http.client.HTTPConnection(server.host, server.port, timeout=600)
  body = {"prompt": np.asarray(request.prompt).tolist(), "max_tokens": request.max_new_tokens,
          "temperature": 0, "ignore_eos": True, "stream": True, "return_token_ids": True}
  conn.request("POST", "/v1/completions", json.dumps(body),
               {"Content-Type": "application/json"})
  response = conn.getresponse()
  if response.status != 200:
    raise RuntimeError(f"HTTP {response.status}: {response.read()[:500]!r}")
  for line in response:
    if line.startswith(b"data: {"):
      chunk = json.loads(line[6:])
      t = clock.now()
      for _ in range(sum(len(c["token_ids"]) for c in chunk["choices"])):
        clock.took(k, t)
  conn.close()


def serve_http(server: Server, requests: list[Request], arrivals: np.ndarray
               ) -> bench_serving.Served:
  """Each request streamed from a thread of its own, started at its arrival."""
  clock = bench_serving.Clock(arrivals)
  threads = []
  for k, request in enumerate(requests):
    clock.wait_until(arrivals[k])
    threads.append(threading.Thread(target=stream, args=(server, request, clock, k)))
    threads[-1].start()
  for t in threads:
    t.join()
  return clock.served


def fresh_tokens(workload, vocab_size: int, seed: int):
  """The workload with new random prompt tokens (same lengths, new tokens, arrivals)."""
  requests, arrivals = workload
  rng = np.random.default_rng(seed)
  return [Request(rng.integers(0, vocab_size, len(r.prompt)), r.max_new_tokens)
          for r in requests], arrivals


def main():
  p = argparse.ArgumentParser()
  p.add_argument("--tiny", action="store_true", help="a tiny model and workload (CPU smoke)")
  p.add_argument("--rates", type=float, nargs="+", default=[100.0, 300.0, 1000.0],
                 help="request arrival rates (requests/s)")
  p.add_argument("--requests", type=int, default=512, help="requests per rate")
  p.add_argument("--passes", type=int, default=1,
                 help="untimed passes over every rate before the timed one (after warmup)")
  args = p.parse_args()
  # Two processes share the GPU: neither may take most of its memory up front (jax's
  # default); the pools are sized by --num-pages.
  os.environ["XLA_PYTHON_CLIENT_PREALLOCATE"] = "false"
  if args.tiny:
    preset, dtype, page, max_batch = "tiny", jnp.float32, 8, 16
    prompt_len, new_len, n_req, rates = (4, 32), (2, 16), 24, [50.0, 200.0]
  else:
    preset, dtype, page, max_batch = "gpt2", jnp.bfloat16, 16, 256
    prompt_len, new_len, n_req, rates = (32, 512), (16, 256), args.requests, args.rates
  config = gpt2.PRESETS[preset]
  num_pages = max_batch * -(-(prompt_len[1] + new_len[1]) // page)
  steps = 16
  lines = [f"# bench_openai_server: {common.header()}", "",
           f"GPT-2 {config.n_layer}L/{config.n_embd}, {jnp.dtype(dtype).name}, {max_batch} "
           f"slots, pages of {page}, {steps} steps per call; {n_req} requests, prompts of "
           f"{prompt_len[0]}-{prompt_len[1]} tokens, {new_len[0]}-{new_len[1]} new, Poisson "
           f"arrivals, greedy; per way Engine.warmup() and {args.passes} untimed passes."]
  emit = common.emitter(lines)
  rng = np.random.default_rng(0)
  workloads = [bench_serving.workload(rng, config.vocab_size, prompt_len, new_len, n_req, rate)
               for rate in rates]
  rows = {rate: [] for rate in rates}

  def serve_all(serve, target, pass_index: int) -> list[bench_serving.Served]:
    runs = []
    for i, w in enumerate(workloads):
      requests, arrivals = fresh_tokens(w, config.vocab_size, 1000 * pass_index + i)
      served = serve(target, requests, arrivals)
      assert (served.tokens == [r.max_new_tokens for r in requests]).all()
      runs.append(served)
    return runs

  # Both ways compile their batch shapes first (Engine.warmup, greedy), the server from
  # the programs this process leaves in a compilation cache of the run's own (not on the
  # CPU smoke test: minutes there).
  warm = not args.tiny
  server_args = ["--no-compilation-cache"]
  if warm:
    cache = tempfile.mkdtemp(prefix="bench_openai_server_xla_")
    cli.use_compilation_cache(cache)
    server_args = ["--compilation-cache", cache, "--warmup", "greedy"]
  model = gpt2.GPT2LMHeadModel(config, dtype=dtype, rngs=nnx.Rngs(0))
  engine = Engine(model, max_batch=max_batch, num_pages=num_pages, page_size=page,
                  steps_per_call=steps)
  compiles = []
  jax.monitoring.register_event_duration_secs_listener(
      lambda event, seconds, **_: compiles.append(seconds)
      if event == "/jax/core/compile/backend_compile_duration" else None)
  if warm:
    start = time.perf_counter()
    engine.warmup()
    emit(f"in process: warmup() {time.perf_counter() - start:.1f} s")
  for i in range(args.passes):
    serve_all(bench_serving.serve_continuous, engine, i)
  compiles.clear()
  timed = serve_all(bench_serving.serve_continuous, engine, args.passes)
  for rate, served in zip(rates, timed):
    rows[rate].append(served.row("in process (add_request / step)"))
    print(rate, rows[rate][-1], flush=True)
  emit(f"in process: {len(compiles)} compilations in the timed pass "
       f"({sum(compiles):.1f} s); the server's are not observable from here")
  del engine
  server = Server(["--model", preset, "--dtype", jnp.dtype(dtype).name, "--port", "0",
                   "--max-batch", str(max_batch), "--num-pages", str(num_pages),
                   "--page-size", str(page), "--steps-per-call", str(steps),
                   *server_args],
                  os.path.join(common.out_dir(), "bench_openai_server_server.log"))
  try:
    for i in range(args.passes):
      serve_all(serve_http, server, i)
    for rate, served in zip(rates, serve_all(serve_http, server, args.passes)):
      rows[rate].append(served.row("over HTTP (jax-paged-serve, streamed)"))
      print(rate, rows[rate][-1], flush=True)
  finally:
    server.close()
  for rate, (_, arrivals) in zip(rates, workloads):
    emit("", f"## {rate:g} requests/s ({arrivals[-1]:.2f} s of arrivals)", "",
         "| serving | new tokens/s | TTFT mean (ms) | p50 | p99 | per output token (ms) | "
         "latency (ms) |", "|---|---|---|---|---|---|---|", *rows[rate])
  with open(os.path.join(common.out_dir(), "bench_openai_server.md"), "w") as f:
    f.write("\n".join(lines) + "\n")


if __name__ == "__main__":
  main()
