"""Shared pytest setup: the longest modules run first; the `gpu` marker skips on machines
without an NVIDIA GPU; XLA's CPU backend compiles fast (no optimization; up to jax 0.10
its older emitters) where jax has no GPU plugin; jax's compiled programs are dropped after
each test module; the CLI's compilation cache is a directory of the test session's own."""

import gc
import importlib.util
import os

import jax
import pytest

if not any(importlib.util.find_spec(m) for m in ("jax_cuda12_plugin", "jax_cuda13_plugin")):
  # CPU only: the tests are compile-bound (tiny models, Pallas interpret mode). XLA's
  # backend optimization off takes ~30% off their time, and up to jax 0.10 its older CPU
  # emitters about half of the rest (its fusion emitters' compile: two warm-up tests of
  # test_engine 128 -> 69 s on the 2-core dev machine; jax 0.11 and 0.12 no longer have
  # the flag, and abort on it). Read when the backend starts (not yet:
  # nothing has asked jax for a device), and by the tests' subprocesses.
  cpu_flags = ["--xla_backend_optimization_level=0"]
  if jax.__version_info__ < (0, 11):
    cpu_flags.append("--xla_cpu_use_fusion_emitters=false")
  os.environ["XLA_FLAGS"] = " ".join([os.environ.get("XLA_FLAGS", ""), *cpu_flags]).strip()


def _has_gpu() -> bool:
  try:
    return any(d.platform == "gpu" for d in jax.devices())
  except RuntimeError:
    return False


# The modules that take longest on the CPU (CI, 2 workers: ~13, 6, 5, 3-4 minutes), run
# first: pytest-xdist's --dist loadfile hands modules to the workers in collection order,
# and a long one handed out last keeps one worker busy while the other idles.
_LONGEST_MODULES = ("test_engine", "test_tensor_parallel", "test_kv_quant", "test_lora",
                    "test_benchmarks", "test_prefix_sharing", "test_openai_server",
                    "test_cli")


def pytest_collection_modifyitems(config, items):
  def rank(item) -> int:
    module = getattr(item, "module", None)
    name = module.__name__.rpartition(".")[2] if module else ""
    return (_LONGEST_MODULES.index(name) if name in _LONGEST_MODULES
            else len(_LONGEST_MODULES))

  items.sort(key=rank)  # (stable: each module's tests keep their order)
  if _has_gpu():
    return
  skip = pytest.mark.skip(reason="needs an NVIDIA GPU")
  for item in items:
    if "gpu" in item.keywords:
      item.add_marker(skip)


@pytest.fixture(autouse=True, scope="session")
def _own_compilation_cache(tmp_path_factory):
  """The CLI keeps compiled programs under $XDG_CACHE_HOME (or $JAX_COMPILATION_CACHE_DIR):
  the CLI runs of the tests, in subprocesses, keep theirs in the session's temporary
  directory instead of the user's."""
  saved = {k: os.environ.get(k) for k in ("XDG_CACHE_HOME", "JAX_COMPILATION_CACHE_DIR")}
  os.environ["XDG_CACHE_HOME"] = str(tmp_path_factory.mktemp("cache"))
  os.environ.pop("JAX_COMPILATION_CACHE_DIR", None)
  yield
  for k, v in saved.items():
    if v is None:
      os.environ.pop(k, None)
    else:
      os.environ[k] = v


def _map_count() -> int:
  """The process's memory maps (0 where /proc does not tell)."""
  try:
    with open("/proc/self/maps", "rb") as f:
      return sum(1 for _ in f)
  except OSError:
    return 0


def _max_map_count() -> int:
  try:
    with open("/proc/sys/vm/max_map_count") as f:
      return int(f.read())
  except (OSError, ValueError):
    return 65530


_MAPS_BEFORE_CLEARING = _max_map_count() // 2


@pytest.fixture(autouse=True, scope="module")
def _drop_compiled_programs():
  """Clears jax's caches after each module. Every XLA CPU executable maps its own code
  pages (~3 memory maps each) until it is freed, and the suite compiles tens of thousands
  (Pallas interpret mode): kept all at once they pass Linux's 65530 maps per process
  (vm.max_map_count) and the next compile segfaults. (`Engine.warmup` freezes what is
  alive out of the collector's reach: unfrozen here, so that its programs can go.)"""
  yield
  jax.clear_caches()
  gc.unfreeze()
  gc.collect()


@pytest.fixture(autouse=True)
def _drop_compiled_programs_when_maps_run_high():
  """The same after a test that leaves the process over half its memory maps: one module
  (test_engine, ~60k maps) can reach the limit alone."""
  yield
  if _map_count() > _MAPS_BEFORE_CLEARING:
    jax.clear_caches()
    gc.unfreeze()
    gc.collect()
