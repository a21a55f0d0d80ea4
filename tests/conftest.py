"""Shared pytest setup: the `gpu` marker skips on machines without an NVIDIA GPU; jax's
compiled programs are dropped after each test module; the CLI's compilation cache is a
directory of the test session's own."""

import gc
import os

import jax
import pytest


def _has_gpu() -> bool:
  try:
    return any(d.platform == "gpu" for d in jax.devices())
  except RuntimeError:
    return False


def pytest_collection_modifyitems(config, items):
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


@pytest.fixture(autouse=True, scope="module")
def _drop_compiled_programs():
  """Clears jax's caches after each module. Every XLA CPU executable maps its own code
  pages (~3 memory maps each) until it is freed, and the suite compiles tens of thousands
  (Pallas interpret mode): kept all at once they pass Linux's 65530 maps per process
  (vm.max_map_count) and the next compile segfaults."""
  yield
  jax.clear_caches()
  gc.collect()
