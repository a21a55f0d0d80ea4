"""Shared pytest setup: the `gpu` marker skips on machines without an NVIDIA GPU; jax's
compiled programs are dropped after each test module."""

import gc

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


@pytest.fixture(autouse=True, scope="module")
def _drop_compiled_programs():
  """Clears jax's caches after each module. Every XLA CPU executable maps its own code
  pages (~3 memory maps each) until it is freed, and the suite compiles tens of thousands
  (Pallas interpret mode): kept all at once they pass Linux's 65530 maps per process
  (vm.max_map_count) and the next compile segfaults."""
  yield
  jax.clear_caches()
  gc.collect()
