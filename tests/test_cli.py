"""The generation CLI end to end, in a subprocess, on CPU."""

import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run_cli(*args, timeout=120):
  env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""),
             JAX_PLATFORMS="cpu")
  return subprocess.run([sys.executable, "-m", "jax_paged.cli", *args], env=env,
                        capture_output=True, text=True, timeout=timeout, cwd=ROOT)


def test_tiny_model_end_to_end():
  proc = run_cli("--model", "tiny", "--max-new-tokens", "12", "--prompt", "Hello, pages",
                 "--prompt", "JAX", "--temperature", "0.8", "--top-k", "50", "--seed", "3")
  assert proc.returncode == 0, proc.stderr
  lines = proc.stdout.strip().splitlines()
  assert "tokens/s" in lines[-1]
  assert "generated tokens: 24" in proc.stdout
  assert "RANDOM weights" in proc.stderr
  assert "RuntimeWarning" not in proc.stderr and "DeprecationWarning" not in proc.stderr
  again = run_cli("--model", "tiny", "--max-new-tokens", "12", "--prompt", "Hello, pages",
                  "--prompt", "JAX", "--temperature", "0.8", "--top-k", "50", "--seed", "3",
                  "--no-progress")
  completions = lambda out: [l for l in out.splitlines() if not l.startswith(("requests",
                             "time", "KV", "preempt", "throughput"))]
  assert completions(again.stdout) == completions(proc.stdout)  # reproducible by seed


def test_checkpoint_with_tokenizer(tmp_path):
  tokenizers = pytest.importorskip("tokenizers")
  transformers = pytest.importorskip("transformers")
  pytest.importorskip("torch")  # GPT2LMHeadModel, the checkpoint's writer, needs it
  tok = tokenizers.ByteLevelBPETokenizer()
  tok.train_from_iterator(["the paged cache holds the pages of every sequence"] * 20,
                          vocab_size=300, min_frequency=1)
  tok.save_model(str(tmp_path))
  config = transformers.GPT2Config(vocab_size=tok.get_vocab_size(), n_positions=64, n_embd=32,
                                   n_layer=2, n_head=2)
  transformers.GPT2LMHeadModel(config).save_pretrained(tmp_path)
  proc = run_cli("--checkpoint", str(tmp_path), "--max-new-tokens", "5", "--prompt",
                 "the pages", "--ignore-eos", "--no-progress")
  assert proc.returncode == 0, proc.stderr
  assert f"checkpoint {tmp_path}" in proc.stderr
  assert "generated tokens: 5" in proc.stdout and "tokens/s" in proc.stdout.splitlines()[-1]


@pytest.mark.parametrize("args,message", [
    (["--checkpoint", "/no/such/dir", "--prompt", "x"], "not a directory"),
    (["--model", "tiny", "--prompt", "x" * 600], "n_positions=512"),
    (["--model", "tiny", "--num-pages", "2", "--max-new-tokens", "40", "--prompt", "x" * 20],
     "pool is too small"),
    (["--model", "tiny"], "at least one --prompt"),
])
def test_clear_errors(args, message):
  proc = run_cli(*args, "--no-progress")
  assert proc.returncode == 2
  assert message in proc.stderr and "Traceback" not in proc.stderr
