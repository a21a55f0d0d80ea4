"""The generation CLI end to end, in a subprocess, on CPU."""

import collections
import json
import math
import os
import re
import subprocess
import sys

import jax
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run_cli(*args, timeout=120, env=None):
  env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""),
             JAX_PLATFORMS="cpu", **(env or {}))
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


def test_compilation_cache_serves_a_later_run(tmp_path):
  """The first run fills --compilation-cache; the second loads every program from it (jax
  logs each hit and miss with these flags) and prints the same completions."""
  cache = tmp_path / "programs"
  args = ("--model", "tiny", "--max-new-tokens", "6", "--prompt", "cached", "--no-progress",
          "--compilation-cache", str(cache))
  log = {"JAX_LOG_COMPILES": "1", "JAX_EXPLAIN_CACHE_MISSES": "1"}
  first = run_cli(*args, env=log)
  assert first.returncode == 0, first.stderr
  entries = sorted(os.listdir(cache))
  assert len(entries) >= 3, entries
  second = run_cli(*args, env=log)
  assert second.returncode == 0, second.stderr
  hit, miss = "Persistent compilation cache hit", "PERSISTENT COMPILATION CACHE MISS"
  assert hit not in first.stderr and miss in first.stderr, first.stderr
  assert hit in second.stderr and miss not in second.stderr, second.stderr
  assert sorted(os.listdir(cache)) == entries
  assert second.stdout.split("requests:")[0] == first.stdout.split("requests:")[0]


def test_compilation_cache_directory(monkeypatch, tmp_path):
  from jax_paged import cli  # pylint: disable=import-outside-toplevel
  monkeypatch.setenv("JAX_COMPILATION_CACHE_DIR", "/jax/own")
  assert cli.default_compilation_cache() == "/jax/own"
  monkeypatch.delenv("JAX_COMPILATION_CACHE_DIR")
  monkeypatch.setenv("XDG_CACHE_HOME", "/xdg")
  assert cli.default_compilation_cache() == "/xdg/jax_paged/xla"
  monkeypatch.delenv("XDG_CACHE_HOME")
  monkeypatch.setenv("HOME", str(tmp_path))
  assert cli.default_compilation_cache() == str(tmp_path / ".cache" / "jax_paged" / "xla")
  (tmp_path / "file").write_text("")
  with pytest.raises(cli.CLIError, match=f"--compilation-cache {tmp_path / 'file'}/x: "
                                          "cannot create it"):
    cli.use_compilation_cache(str(tmp_path / "file" / "x"))


@pytest.mark.parametrize("kind", ["byte_level_bpe", "sentencepiece_bpe"])
def test_token_bytes_spell_what_the_tokenizer_encodes(tmp_path, kind):
  """`Codec.token_bytes` (the guides' vocabulary): the bytes of a text's tokens are its
  UTF-8 bytes (SentencePiece's added leading space aside); special tokens have none."""
  tokenizers = pytest.importorskip("tokenizers")
  from jax_paged import cli, Vocabulary  # pylint: disable=import-outside-toplevel
  corpus = ["the paged cache holds ünïcode 中文 and emoji 😀 {\"json\": [1, 2]}"] * 20
  bpe = (tokenizers.ByteLevelBPETokenizer() if kind == "byte_level_bpe"
         else tokenizers.SentencePieceBPETokenizer())
  bpe.train_from_iterator(corpus, vocab_size=400, min_frequency=1,
                          special_tokens=["<unk>", "<|endoftext|>"])
  bpe.save(str(tmp_path / "tokenizer.json"))
  codec = cli.load_tokenizer(str(tmp_path))
  token_bytes = codec.token_bytes()
  assert len(token_bytes) == codec.vocab_size and token_bytes[:2] == (None, None)
  for text in ["the cache", "ünïcode 中文 😀", '{"json": [1, 2]}', "emoji and code"]:
    spelled = b"".join(token_bytes[i] for i in codec.encode(text))
    assert spelled in (text.encode(), b" " + text.encode()), (text, spelled)
  transformers = pytest.importorskip("transformers")  # a fast tokenizer: its backend's
  fast = transformers.PreTrainedTokenizerFast(tokenizer_object=bpe._tokenizer)
  assert Vocabulary.from_tokenizer(fast, (1,)).token_bytes == token_bytes


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


def test_user_errors_in_a_real_process_are_one_line(tmp_path):
  """The cases that once printed tracebacks, through the installed entry point: a bad flag,
  a prompts file that is not UTF-8, a truncated weights file. (The other bad inputs run
  in-process below: the same `main`, ~3 s less each.)"""
  prompts = tmp_path / "prompts.txt"
  prompts.write_bytes(b"caf\xe9\n")
  checkpoint = tmp_path / "gpt2"
  checkpoint.mkdir()
  (checkpoint / "config.json").write_text('{"model_type": "gpt2", "vocab_size": 300, '
                                          '"n_positions": 64, "n_embd": 32, "n_layer": 2, '
                                          '"n_head": 2}')
  (checkpoint / "model.safetensors").write_bytes(b"\x40\x00\x00\x00\x00\x00\x00\x00{\"")
  for args, message in [
      (["--model", "tiny", "--prompt", "x", "--page-size", "0"],
       "argument --page-size: must be a positive integer, got 0"),
      (["--model", "tiny", "--prompts-file", str(prompts)],
       f"--prompts-file {prompts}: not UTF-8 text"),
      (["--checkpoint", str(checkpoint), "--prompt-ids", "1"],
       f"{checkpoint / 'model.safetensors'}: not a readable safetensors file"),
  ]:
    proc = run_cli(*args, "--no-progress")
    assert proc.returncode == 2, (args, proc.stderr)
    assert message in proc.stderr and "Traceback" not in proc.stderr, proc.stderr


def _main(capsys, *args) -> tuple[int, str, str]:
  """`jax-paged-generate ARGS` in this process: (exit status, stdout, stderr). With no
  compilation cache: turned on here it would keep every later test's programs too."""
  from jax_paged import cli  # pylint: disable=import-outside-toplevel
  try:
    status = cli.main([*args, "--no-compilation-cache"])
  except SystemExit as e:  # argparse's usage errors
    status = e.code
  captured = capsys.readouterr()
  return status, captured.out, captured.err


@pytest.mark.parametrize("args,message", [
    (["--max-batch", "x"], "argument --max-batch: expected a positive integer, got 'x'"),
    (["--memory-fraction", "0"], "argument --memory-fraction: must be a fraction in (0, 1]"),
    (["--memory-fraction", "0.5"], "--memory-fraction sizes the pool from an accelerator"),
    (["--top-p", "1.5"], "argument --top-p: must be in (0, 1], got 1.5"),
    (["--min-p", "-0.1"], "argument --min-p: must be in [0, 1], got -0.1"),
    (["--temperature", "-1"], "argument --temperature: must be a number >= 0"),
    (["--prompt-ids", "1,x"], "argument --prompt-ids: expected comma-separated token ids"),
    (["--prompt-ids", "300"], "token ids [300] outside [0, vocab_size=256)"),
    (["--n", "0"], "argument --n: must be a positive integer, got 0"),
    (["--n", "40"], "n must be an int in [1, max_batch=32]"),
    (["--top-logprobs", "21"], "argument --top-logprobs: must be in [1, 20], got 21"),
    (["--stop", ""], "argument --stop: expected a non-empty text"),
    (["--logit-bias", "5"], "argument --logit-bias: expected comma-separated ID:BIAS pairs"),
    (["--logit-bias", "300:1"], "logit_bias token 300 is not a token id in [0, vocab_size=256)"),
    (["--logit-bias", "3:-101"], "logit_bias[3] must be a number in [-100, 100]"),
    (["--min-tokens", "-1"], "argument --min-tokens: must be an integer >= 0"),
    (["--temperature", "inf"], "argument --temperature: must be a number >= 0, got inf"),
    (["--repetition-penalty", "0"], "argument --repetition-penalty: must be a number > 0"),
    (["--repetition-penalty", "nan"], "argument --repetition-penalty: must be a number > 0"),
    (["--frequency-penalty", "2.5"],
     "argument --frequency-penalty: must be a number in [-2, 2], got 2.5"),
    (["--presence-penalty", "x"],
     "argument --presence-penalty: expected a number in [-2, 2], got 'x'"),
    (["--guided-regex", "(a)\\1"], "--guided-regex: '(a)\\\\1': backreferences"),
    (["--guided-json", "{\"type\": 3}"], "--guided-json: #/type: 3 is not a JSON schema"),
    (["--guided-json", "@/no/such.json"], "--guided-json @/no/such.json: cannot read it"),
    (["--guided-regex", "a", "--guided-choice", "b"], "not allowed with argument"),
    (["--speculative-config", "{\"num_speculative_tokens\": 0}"],
     "argument --speculative-config: speculative config: num_speculative_tokens must be"),
    (["--speculative-config", "{\"method\": \"eagle\"}"], "method 'eagle' is not supported"),
    (["--speculative-config", "{\"num_speculative_tokens\": 2}", "--beam-width", "2"],
     "--speculative-config do not apply"),
])
def test_bad_arguments_are_one_line_errors(capsys, args, message):
  status, _, err = _main(capsys, "--model", "tiny", "--prompt", "x", "--no-progress", *args)
  assert status == 2 and message in err and "Traceback" not in err


def test_guided_completions_match(capsys, tmp_path):
  """--guided-regex / --guided-json / --guided-choice: each sampled completion matches."""
  schema = tmp_path / "schema.json"
  schema.write_text('{"type": "object", "properties": {"ok": {"type": "boolean"}}, '
                    '"required": ["ok"]}')
  for flags, check in [
      (["--guided-regex", r"[A-Z]{2}-\d{3}"], lambda t: re.fullmatch(r"[A-Z]{2}-\d{3}", t)),
      (["--guided-json", f"@{schema}"], lambda t: json.loads(t).keys() == {"ok"}),
      (["--guided-choice", "yes", "no way"], lambda t: t in ("yes", "no way"))]:
    status, out, err = _main(capsys, "--model", "tiny", "--prompt", "a", "--prompt", "bc",
                             "--n", "3", "--temperature", "1", "--no-progress", *flags)
    assert status == 0, err
    texts = [line for line in out.splitlines() if not line.startswith(("---", "requests",
                                                                       "time", "KV", "prefix",
                                                                       "preemptions",
                                                                       "throughput"))]
    assert len(texts) == 6 and all(check(t) for t in texts), out


def test_out_of_device_memory_is_a_one_line_error(capsys, monkeypatch):
  """A pool the device cannot hold (another process holds memory that jax reports free)
  ends in one line naming the pool and what to change; other runtime errors propagate."""
  from jax_paged import cli  # pylint: disable=import-outside-toplevel

  def fail(message):
    def generate(*_, **__):
      raise jax.errors.JaxRuntimeError(message)
    return generate

  monkeypatch.setattr(cli.Engine, "generate",
                      fail("RESOURCE_EXHAUSTED: Out of memory allocating 99 bytes.\nmore"))
  status, _, err = _main(capsys, "--model", "tiny", "--prompt", "x", "--num-pages", "64")
  assert status == 2 and "Traceback" not in err and err.strip().splitlines()[-1] == (
      "jax-paged-generate: error: out of device memory with a KV pool of 64 pages: give a "
      "smaller --num-pages (RESOURCE_EXHAUSTED: Out of memory allocating 99 bytes.)")
  monkeypatch.setattr(cli.Engine, "generate", fail("INTERNAL: not memory"))
  with pytest.raises(jax.errors.JaxRuntimeError, match="INTERNAL: not memory"):
    _main(capsys, "--model", "tiny", "--prompt", "x", "--num-pages", "64")


def test_model_families_once_each_and_checked(capsys, monkeypatch):
  """Entry points registered twice (a checkout on PYTHONPATH beside its installed copy)
  give each family once; one that is not a ModelFamily is a CLI error naming it."""
  import importlib.metadata  # pylint: disable=import-outside-toplevel
  from jax_paged import cli  # pylint: disable=import-outside-toplevel

  def entry(name, value):
    return importlib.metadata.EntryPoint(name, value, cli.ENTRY_POINT_GROUP)

  registered = [entry("gpt2", "models.gpt2:FAMILY"), entry("llama", "models.llama:FAMILY")]
  monkeypatch.setattr(importlib.metadata, "entry_points", lambda group: registered * 2)
  families = cli.model_families()
  from models import gpt2, llama  # pylint: disable=import-outside-toplevel
  assert [f.model_types for f in families] == [gpt2.FAMILY.model_types, llama.MODEL_TYPES]
  with pytest.raises(SystemExit):
    cli.parse_args(["--help"], families)
  help_text = " ".join(capsys.readouterr().out.split())
  supported = ", ".join(sorted(("gpt2",) + llama.MODEL_TYPES))
  assert f"one of {supported}, its" in help_text
  registered.append(entry("bad", "models.gpt2:GPT2Config"))
  with pytest.raises(cli.CLIError, match="entry point bad = models.gpt2:GPT2Config in group "
                     "jax_paged.models is a type, not a jax_paged.ModelFamily"):
    cli.model_families()


def test_compilation_cache_flags_exclude_each_other(capsys):
  status, _, err = _main(capsys, "--model", "tiny", "--prompt", "x",
                         "--compilation-cache", "d")
  assert status == 2 and "--no-compilation-cache: not allowed with argument" in err


def test_bad_files_are_named(capsys, tmp_path):
  (tmp_path / "config.json").write_text("{not json")
  status, _, err = _main(capsys, "--checkpoint", str(tmp_path), "--prompt", "x")
  assert status == 2 and f"{tmp_path / 'config.json'}: not a readable JSON file" in err
  (tmp_path / "config.json").write_text('{"model_type": "bert"}')
  status, _, err = _main(capsys, "--checkpoint", str(tmp_path), "--prompt", "x")
  # The list is every installed family's model types, sorted (pyproject's entry points).
  from jax_paged import cli  # pylint: disable=import-outside-toplevel
  known = sorted(t for f in cli.model_families() for t in f.model_types)
  assert {"gpt2", "llama", "gpt_oss"} <= set(known)
  assert status == 2 and (f"model_type 'bert' is not supported (supported: {', '.join(known)})"
                          in err)


def test_prompt_ids_clamp_notice_and_truncated_weights(capsys, tmp_path):
  """A checkpoint without a tokenizer runs from --prompt-ids (text prompts are refused),
  a lowered --max-new-tokens is announced, and a truncated model.safetensors is named."""
  transformers = pytest.importorskip("transformers")
  pytest.importorskip("torch")
  config = transformers.GPT2Config(vocab_size=50, n_positions=16, n_embd=32, n_layer=2,
                                   n_head=2)
  transformers.GPT2LMHeadModel(config).save_pretrained(tmp_path)
  status, _, err = _main(capsys, "--checkpoint", str(tmp_path), "--prompt", "hi")
  assert status == 2 and "has no tokenizer" in err and "--prompt-ids" in err
  status, out, err = _main(capsys, "--checkpoint", str(tmp_path), "--prompt-ids", "1,2,3",
                           "--max-new-tokens", "20", "--ignore-eos", "--no-progress")
  assert status == 0, err
  assert "--max-new-tokens 20 lowered to 14" in err and "generated tokens: 14" in out
  status, _, err = _main(capsys, "--checkpoint", str(tmp_path), "--prompt-ids", "1",
                         "--stop", "x")
  assert status == 2 and "--stop needs text, and this checkpoint has no tokenizer" in err
  status, _, err = _main(capsys, "--checkpoint", str(tmp_path), "--prompt-ids", "1",
                         "--max-model-len", "8")
  assert status == 2 and "--max-model-len: the gpt2 family's models (model_type 'gpt2') do " \
                         "not take it" in err
  status, _, err = _main(capsys, "--model", "tiny", "--prompt", "x", "--max-model-len", "8")
  assert status == 2 and "--max-model-len applies to a --checkpoint" in err
  weights = tmp_path / "model.safetensors"
  weights.write_bytes(weights.read_bytes()[:100])
  status, _, err = _main(capsys, "--checkpoint", str(tmp_path), "--prompt-ids", "1")
  assert status == 2 and f"{weights}: not a readable safetensors file" in err


def test_parallel_samples_and_no_prefix_caching(capsys):
  args = ("--model", "tiny", "--prompt", "shared pages", "--max-new-tokens", "6",
          "--temperature", "1.0", "--n", "3", "--no-progress")
  status, out, _ = _main(capsys, *args)
  assert status == 0 and "generated tokens: 18" in out
  samples = [line for line in out.splitlines() if line.startswith("--- [0.")]
  assert [line.split()[1] for line in samples] == ["[0.0]", "[0.1]", "[0.2]"]
  status, again, _ = _main(capsys, *args, "--no-prefix-caching")
  assert status == 0
  texts = lambda out: out.split("requests:")[0]
  assert texts(again) == texts(out)  # the same samples, pages shared or not
  assert "0 of 12 prompt tokens" in again
  # Three samples on one prompt's pages (forked, prefix caching or not) hold more live
  # tokens than their pages have slots.
  assert "; above 100%: sequences shared pages)" in again


def test_speculative_decoding_prints_the_same_text_and_its_drafts(capsys):
  args = ("--model", "tiny", "--prompt", "abcabcabcabcabc", "--prompt", "xyz", "--n", "2",
          "--temperature", "0.8", "--max-new-tokens", "24", "--no-progress")
  status, out, _ = _main(capsys, *args)
  assert status == 0
  status, spec, _ = _main(capsys, *args, "--speculative-config",
                          '{"method": "ngram", "num_speculative_tokens": 3, '
                          '"prompt_lookup_max": 2, "prompt_lookup_min": 1}')
  assert status == 0
  texts = lambda out: out.split("requests:")[0]
  assert texts(spec) == texts(out) and "speculative decoding: " in spec


def test_a_draft_checkpoint_prints_the_same_text_and_its_drafts(capsys, tmp_path):
  """--speculative-config {"model": DIR, ...}: a draft checkpoint (GPT-2, one layer of
  the target's heads) loaded as the model is; the same tokens as without it, drafts
  counted; a draft of other heads or a missing directory named."""
  transformers = pytest.importorskip("transformers")
  pytest.importorskip("torch")
  for name, layers, heads in (("target", 2, 2), ("draft", 1, 2), ("other", 1, 4)):
    transformers.GPT2LMHeadModel(transformers.GPT2Config(
        vocab_size=50, n_positions=64, n_embd=32, n_layer=layers, n_head=heads)
    ).save_pretrained(tmp_path / name)
  args = ("--checkpoint", str(tmp_path / "target"), "--prompt-ids", "1,2,3", "--prompt-ids",
          "4,5", "--max-new-tokens", "20", "--ignore-eos", "--no-progress")
  status, out, err = _main(capsys, *args)
  assert status == 0, err
  draft = lambda path: ["--speculative-config", json.dumps(
      {"model": str(path), "num_speculative_tokens": 3})]
  status, spec, err = _main(capsys, *args, *draft(tmp_path / "draft"))
  assert status == 0, err
  texts = lambda out: out.split("requests:")[0]
  assert texts(spec) == texts(out) and "speculative decoding: " in spec
  assert f"drafts by {tmp_path / 'draft'} (1 layers)" in err
  status, _, err = _main(capsys, *args, *draft(tmp_path / "other"))
  assert status == 2 and "the draft model's num_kv_heads (4) must be the target's (2)" in err
  status, _, err = _main(capsys, *args, *draft(tmp_path / "none"))
  assert status == 2 and f"--speculative-config: draft model {tmp_path / 'none'}: not a " \
                         "directory" in err


def test_logprobs_print_each_completions_tokens_and_perplexity(capsys):
  args = ("--model", "tiny", "--prompt", "log", "--prompt", "probs", "--max-new-tokens", "5",
          "--temperature", "1.0", "--n", "2", "--ignore-eos", "--no-progress")
  status, out, _ = _main(capsys, *args, "--logprobs")
  assert status == 0
  lines = [line for line in out.splitlines() if line.startswith("logprobs (mean ")]
  assert len(lines) == 4  # 2 prompts x 2 samples, each after its completion
  for line in lines:
    head, values = line.split("): ")
    values = [float(v) for v in values.split(",")]
    mean, perplexity = float(head.split()[2][:-1]), float(head.split()[4])
    assert len(values) == 5 and max(values) < 0
    assert abs(mean - sum(values) / 5) < 1e-3 and abs(perplexity / math.exp(-mean) - 1) < 1e-3
  status, plain, _ = _main(capsys, *args)
  assert status == 0 and "logprobs" not in plain
  completions = lambda out: [line for line in out.split("requests:")[0].splitlines()
                             if not line.startswith(("logprobs", "  "))]
  assert completions(out) == completions(plain)  # the same tokens
  # --top-logprobs K (implying --logprobs): a line per token, its K most likely after it.
  status, top, _ = _main(capsys, *args, "--top-logprobs", "3")
  assert status == 0 and completions(top) == completions(plain)
  assert [line for line in top.splitlines() if line.startswith("logprobs")] == lines
  per_token = [line for line in top.splitlines() if line.startswith("  ")]
  assert len(per_token) == 4 * 5
  values = [v for line in lines for v in line.split("): ")[1].split(",")]
  for line, value in zip(per_token, values):
    own, alternatives = line.rsplit(" | ", 1)
    assert own.split()[-1] == value
    ranked = [float(a.rsplit(" ", 1)[1]) for a in alternatives.split(", ")]
    assert len(ranked) == 3 and ranked == sorted(ranked, reverse=True)
    assert ranked[0] >= float(value)


def test_min_p_one_samples_the_greedy_tokens(capsys):
  args = ("--model", "tiny", "--prompt", "min p", "--max-new-tokens", "12", "--ignore-eos",
          "--no-progress")
  texts = lambda out: out.split("requests:")[0]
  status, greedy, _ = _main(capsys, *args)
  assert status == 0
  status, hot, _ = _main(capsys, *args, "--temperature", "5")
  assert status == 0 and texts(hot) != texts(greedy)
  status, kept, _ = _main(capsys, *args, "--temperature", "5", "--min-p", "1")
  assert status == 0 and texts(kept) == texts(greedy)


def test_prompt_logprobs_print_each_prompts_scores_and_perplexity(capsys):
  args = ("--model", "tiny", "--prompt", "scored", "--prompt", "x", "--max-new-tokens", "2",
          "--no-progress")
  status, out, _ = _main(capsys, *args, "--prompt-logprobs")
  assert status == 0
  (line,) = [line for line in out.splitlines() if line.startswith("--- [0] prompt logprobs")]
  head, values = line.split("): ")
  values = [float(v) for v in values.split(",")]
  assert len(values) == len("scored") - 1 and max(values) < 0
  assert abs(float(head.split()[5][:-1]) - sum(values) / len(values)) < 1e-3
  assert "--- [1] prompt logprobs: none (a one-token prompt)" in out
  status, plain, _ = _main(capsys, *args)
  assert status == 0 and "prompt logprobs" not in plain
  texts = lambda out: [line for line in out.split("requests:")[0].splitlines()
                       if "prompt logprobs" not in line and not line.startswith("  ")]
  assert texts(out) == texts(plain)
  # With --top-logprobs: a line per prompt token after the first, its value and the
  # position's most likely tokens.
  status, top, _ = _main(capsys, *args, "--prompt-logprobs", "--top-logprobs", "2")
  assert status == 0
  lines = top.split("--- [0] prompt logprobs")[1].split("--- [0] 'scored'")[0].splitlines()
  per_token = lines[1:]
  assert len(per_token) == 5
  for line, value in zip(per_token, values):
    own, alternatives = line.rsplit(" | ", 1)
    assert abs(float(own.split()[-1]) - value) < 1e-3
    assert len(alternatives.split(", ")) == 2


def test_penalties_change_greedy_repeats(capsys):
  """The tiny random model repeats a token greedily; the penalties (the repetition
  penalty, and each generated token's logit lowered by 2 + 2 per time) break that."""
  args = ("--model", "tiny", "--prompt-ids", "5,6,7", "--max-new-tokens", "24",
          "--ignore-eos", "--no-progress")
  most_repeated = lambda out: collections.Counter(
      out.split(" -> 24 tokens\n")[1].split("\nrequests:")[0].replace("\ufffd", "")
      ).most_common(1)[0][1]
  status, plain, _ = _main(capsys, *args)
  assert status == 0 and most_repeated(plain) >= 8
  status, penalized, _ = _main(capsys, *args, "--repetition-penalty", "3",
                               "--presence-penalty", "2", "--frequency-penalty", "2")
  assert status == 0 and most_repeated(penalized) <= 3


def test_stop_texts_cut_each_completion_and_end_its_request(capsys):
  """--stop: each sample's completion ends before the first stop text its text contains
  (whichever stop text comes first), the tokens and log-probabilities counted up to the
  token that completed it; a completion with no stop text is whole."""
  args = ("--model", "tiny", "--prompt", "Hello", "--prompt", "pages", "--max-new-tokens",
          "24", "--ignore-eos", "--no-progress", "--temperature", "1.0", "--n", "2",
          "--logprobs")
  status, plain, _ = _main(capsys, *args)
  assert status == 0
  blocks = plain.split("requests:")[0].split("--- ")[1:]
  texts = [b.split("\n")[1] for b in blocks]  # [0.0], [0.1], [1.0], [1.1]
  stop_a, stop_b = texts[0][3], texts[1][2]  # characters met early in samples 0.0, 0.1
  status, out, _ = _main(capsys, *args, "--stop", stop_a, "--stop", stop_b)
  assert status == 0
  got = out.split("requests:")[0].split("--- ")[1:]
  for want_text, block in zip(texts, got):
    head, text, values = block.split("\n")[:3]
    cuts = [at for at in (want_text.find(stop_a), want_text.find(stop_b)) if at >= 0]
    if not cuts:
      assert text == want_text and head.endswith("-> 24 tokens")
      continue
    assert text == want_text[:min(cuts)]
    assert "stopped at" in head
    n = int(head.split("-> ")[1].split()[0])
    assert 1 <= n < 24 and len(values.split("): ")[1].split(",")) == n
  assert "aborted" not in out  # (samples end at their stop texts: finished, not aborted)


def test_logit_bias_forces_a_token(capsys):
  status, out, _ = _main(capsys, "--model", "tiny", "--prompt", "x", "--max-new-tokens", "8",
                         "--no-progress", "--logit-bias", "65:100,66:-100", "--min-tokens", "3")
  assert status == 0 and "-> 8 tokens\nAAAAAAAA\n" in out


def test_beam_search_prints_best_hypotheses_with_scores(capsys):
  """--beam-width: each prompt's hypotheses, best first, as `jax_paged.beam_search` of the
  same model gives them; beam width 1 prints the greedy completion."""
  args = ("--model", "tiny", "--prompt", "beams", "--prompt", "xy", "--max-new-tokens", "6",
          "--ignore-eos", "--no-progress")
  status, out, _ = _main(capsys, *args, "--beam-width", "3", "--num-return-sequences", "2",
                         "--length-penalty", "0.5", "--early-stopping", "never")
  assert status == 0
  heads = [line for line in out.splitlines() if line.startswith("--- [")]
  assert [h.split()[1] for h in heads] == ["[0.0]", "[0.1]", "[1.0]", "[1.1]"]
  scores = [float(h.rsplit("score ", 1)[1]) for h in heads]
  assert scores[0] >= scores[1] and scores[2] >= scores[3] and max(scores) < 0
  assert "prompts: 2  beams: 3  returned tokens: 24" in out
  assert "beam tokens/s" in out.splitlines()[-1]
  status, one, _ = _main(capsys, *args, "--beam-width", "1")
  status, greedy, _ = _main(capsys, *args)
  assert status == 0
  texts = lambda out: [line for line in out.splitlines()[1:] if not line.startswith("---")]
  assert texts(one)[:2] == [line for line in greedy.splitlines()
                            if not line.startswith("---")][:2]


@pytest.mark.parametrize("args, message", [
    (["--beam-width", "2", "--temperature", "0.7", "--n", "2"],
     "--beam-width searches deterministically over a pool of its own: --temperature, --n do "
     "not apply"),
    (["--beam-width", "33"], "beam_width must be an int in [1, 32], got 33"),
    (["--beam-width", "2", "--num-return-sequences", "3"],
     "num_return_sequences must be an int in [1, beam_width=2], got 3"),
    (["--beam-width", "0"], "argument --beam-width: must be a positive integer, got 0"),
    (["--beam-width", "2", "--length-penalty", "inf"],
     "argument --length-penalty: must be a finite number, got inf"),
    (["--beam-width", "2", "--early-stopping", "maybe"], "argument --early-stopping: invalid"),
])
def test_beam_search_errors_are_one_line(capsys, args, message):
  status, _, err = _main(capsys, "--model", "tiny", "--prompt", "x", "--no-progress", *args)
  assert status == 2 and message in err.strip().splitlines()[-1], err


def test_lora_modules_serve_the_adapter_the_prompts_name(capsys, tmp_path):
  import jax.numpy as jnp  # pylint: disable=import-outside-toplevel
  from jax_paged import lora  # pylint: disable=import-outside-toplevel
  from models import gpt2  # pylint: disable=import-outside-toplevel
  targets = gpt2.FAMILY.presets["tiny"](jnp.float32, 0).lora_targets()
  lora.LoraAdapter.random(targets, rank=4, seed=1, scale=0.5).save(tmp_path / "sql")
  args = ("--model", "tiny", "--prompt", "select", "--max-new-tokens", "8", "--no-progress",
          "--ignore-eos")
  status, base, _ = _main(capsys, *args)
  assert status == 0
  status, out, err = _main(capsys, *args, "--lora-modules", f"sql={tmp_path / 'sql'}",
                           "--lora", "sql")
  assert status == 0 and "LoRA adapters sql" in err
  texts = lambda out: out.split("requests:")[0]
  assert texts(out) != texts(base)
  status, again, _ = _main(capsys, *args, "--lora-modules", f"sql={tmp_path / 'sql'}")
  assert status == 0 and texts(again) == texts(base)  # served, not named: the base model
  beams = [_main(capsys, *args, "--beam-width", "2", *extra)[1].split("requests:")[0]
           for extra in ((), ("--lora-modules", f"sql={tmp_path / 'sql'}", "--lora", "sql"))]
  assert beams[0] != beams[1] and "score" in beams[1]
  for extra, message in (
      (("--lora", "sql"), "--lora sql: not an adapter of --lora-modules (none given)"),
      (("--max-loras", "2"), "--max-loras needs --lora-modules"),
      (("--lora-modules", f"a={tmp_path}"), "no adapter_config.json in"),
      (("--lora-modules", f"a={tmp_path / 'sql'}", "--max-lora-rank", "2"),
       "has rank 4, above the engine's max_lora_rank=2")):
    status, _, err = _main(capsys, *args, *extra)
    assert status == 2 and message in err, err
