"""The benchmarks' CPU paths: they drive the library as the engine does (its jitted decode
loop, its sampling settings), so they must keep up with its signatures."""

import sys

import numpy as np
from flax import nnx

from benchmarks import bench_decode_step
from benchmarks import bench_beam
from benchmarks import bench_generate
from benchmarks import bench_openai_server
from benchmarks import bench_prefix
from benchmarks import bench_score
from benchmarks import bench_serving
from jax_paged import Engine, Request
from jax_paged.serving import runner as runner_lib
from models import gpt2

CONFIG = gpt2.GPT2Config(vocab_size=97, n_positions=96, n_embd=32, n_layer=2, n_head=4)


def test_decode_step_benchmark_runs_the_engine_loop():
  model = gpt2.GPT2LMHeadModel(CONFIG, rngs=nnx.Rngs(0))
  kv = bench_decode_step.filled_pool(model, 4, 10, 64, 8, seed=1)
  loop, leaves = bench_decode_step.engine_loop(runner_lib.ModelRunner(model))
  tokens, kv = bench_decode_step.decode_chunk(loop, leaves, kv, 4, 4)
  assert np.asarray(tokens).shape == (4, 4) and (np.asarray(tokens) >= 0).all()
  np.testing.assert_array_equal(kv.lengths, [14] * 4)


def test_generate_benchmark_tiny_with_sampling(monkeypatch, tmp_path):
  monkeypatch.setenv("OUT", str(tmp_path))
  monkeypatch.setattr(sys, "argv", ["bench_generate.py", "--tiny", "--skip-mixed",
                                    "--sampling", "greedy", "temperature", "top-p",
                                    "greedy-penalties"])
  bench_generate.main()
  table = (tmp_path / "bench_generate.md").read_text()
  assert "paged engine, temperature 0.8 (" in table
  assert "paged engine, temperature 0.8, top_p 0.95 (" in table
  assert ("paged engine, repetition_penalty 1.2, frequency_penalty 0.5, presence_penalty 0.5 ("
          in table)


def test_score_benchmark_tiny(monkeypatch, tmp_path):
  monkeypatch.setenv("OUT", str(tmp_path))
  monkeypatch.setattr(sys, "argv", ["bench_score.py", "--tiny"])
  bench_score.main()
  table = (tmp_path / "bench_score.md").read_text()
  assert table.count("| paged engine, ") == 3
  model = gpt2.GPT2LMHeadModel(CONFIG, rngs=nnx.Rngs(0))
  engine = Engine(model, max_batch=2, num_pages=16, page_size=8)
  scores = bench_score.engine_scores(engine, [[1, 2, 3], [4, 5]])
  assert [len(s) for s in scores] == [3, 2] and scores[0][0] is None
  assert bench_score.engine_scores(engine, [[1, 2, 3]], score=False) == [None]


def test_serving_benchmark_tiny(monkeypatch, tmp_path):
  """Arrivals served continuously (add_request / step) and a batch at a time: every
  request gets all its tokens, each after its arrival."""
  monkeypatch.setenv("OUT", str(tmp_path))
  monkeypatch.setattr(sys, "argv", ["bench_serving.py", "--tiny"])
  bench_serving.main()
  table = (tmp_path / "bench_serving.md").read_text()
  assert table.count("| continuous, 16 steps per call |") == 2
  assert table.count("| a batch at a time, 128 steps per call |") == 2
  model = gpt2.GPT2LMHeadModel(CONFIG, rngs=nnx.Rngs(0))
  requests = [Request([i + 1] * (i + 2), 3 + i) for i in range(5)]
  arrivals = np.array([0.0, 0.0, 0.05, 0.1, 0.3])
  for serve in (bench_serving.serve_continuous, bench_serving.serve_batched):
    served = serve(Engine(model, max_batch=2, num_pages=64, page_size=8), requests, arrivals)
    np.testing.assert_array_equal(served.tokens, [3, 4, 5, 6, 7])
    assert (served.first >= arrivals).all() and (served.last >= served.first).all()


def test_openai_server_benchmark_tiny(monkeypatch, tmp_path):
  """The same arrivals in process and over HTTP from a server subprocess: every request
  gets all its tokens (the benchmark asserts it) both ways."""
  monkeypatch.setenv("OUT", str(tmp_path))
  monkeypatch.setenv("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # (main sets it)
  monkeypatch.setattr(sys, "argv", ["bench_openai_server.py", "--tiny"])
  bench_openai_server.main()
  table = (tmp_path / "bench_openai_server.md").read_text()
  assert table.count("| in process (add_request / step) |") == 2
  assert table.count("| over HTTP (jax-paged-serve, streamed) |") == 2


def test_prefix_benchmark_tiny(monkeypatch, tmp_path):
  monkeypatch.setenv("OUT", str(tmp_path))
  monkeypatch.setattr(sys, "argv", ["bench_prefix.py", "--tiny"])
  bench_prefix.main()
  table = (tmp_path / "bench_prefix.md").read_text()
  assert "## 1. Shared system prompt" in table and "Chunked: worst gap" in table


def test_beam_benchmark_tiny(monkeypatch, tmp_path):
  monkeypatch.setenv("OUT", str(tmp_path))
  monkeypatch.setattr(sys, "argv", ["bench_beam.py", "--tiny"])
  bench_beam.main()
  table = (tmp_path / "bench_beam.md").read_text()
  assert table.count("| jax_paged.beam_search |") == 1 and "(unshared 48)" in table


def test_speculative_benchmarks_copy_workload_quotes_each_prompt():
  """bench_speculative's copy requests: each prompt holds the span, and the guide allows
  exactly the span's tokens, one at a time, then nothing."""
  from benchmarks import bench_speculative
  words = bench_speculative.spelling(300)
  assert len(set(words)) == 300 and {len(w) for w in words} == {3}
  requests = bench_speculative.requests_of("copy", 300, 3, 40, 0, 12)
  guide = requests[0].guide
  assert all(r.guide is guide and len(r.prompt) == 40 for r in requests)
  span = requests[0].prompt[14:26]
  assert all(r.prompt[14:26] == span for r in requests)
  state = 0
  for token in span:
    assert np.flatnonzero(guide.table[state] >= 0).tolist() == [token]
    state = guide.walk(state, [token])
  assert guide.done[state]


def test_speculative_draft_benchmark_tiny(monkeypatch, capsys):
  """bench_speculative --draft on a tiny target and draft: its row, and the projected
  gain's tokens per round (1 + a + ... + a^k)."""
  from benchmarks import bench_speculative
  assert bench_speculative.kept_per_round(0.5, 2) == 1.75
  monkeypatch.setattr(sys, "argv", ["bench_speculative.py", "--tiny", "--draft"])
  bench_speculative.main()
  rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| 2 |")]
  assert len(rows) == 1 and rows[0].count("|") == 9


def test_lora_benchmark_tiny(monkeypatch, capsys):
  from benchmarks import bench_lora
  monkeypatch.setattr(sys, "argv", ["bench_lora.py", "--tiny", "--adapters", "2", "--rank",
                                    "4"])
  bench_lora.main()
  rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| tiny |")]
  assert len(rows) == 1 and rows[0].count("|") == 8


def test_weight_quant_benchmark_tiny(monkeypatch, capsys):
  from benchmarks import bench_weight_quant
  monkeypatch.setattr(sys, "argv", ["bench_weight_quant.py", "--tiny"])
  bench_weight_quant.main()
  out = capsys.readouterr().out.splitlines()
  rows = [line for line in out if line.startswith("| tiny |")]
  assert len(rows) == 3  # two batch sizes, one agreement row
  assert rows[-1].split("|")[3].strip().endswith(" of 16")  # leading tokens shared


def test_moe_benchmark_tiny(monkeypatch, tmp_path):
  from benchmarks import bench_moe
  monkeypatch.setenv("OUT", str(tmp_path))
  monkeypatch.setattr(sys, "argv", ["bench_moe.py", "--tiny"])
  bench_moe.main()
  rows = [line for line in (tmp_path / "bench_moe.md").read_text().splitlines()
          if line.startswith("| tiny |")]
  routes, int8 = rows[:2], rows[2:]
  assert len(int8) == 2 and all(row.count("|") == 10 for row in routes)
  assert all(float(row.split("|")[9]) < 1e-2 for row in routes)  # routes agree
  assert all(row.count("|") == 7 and float(row.split("|")[6]) < 5e-2 for row in int8)
