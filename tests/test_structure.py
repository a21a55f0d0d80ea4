"""The package's layering: jax_paged never imports models/, and its arrows point down."""

import ast
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGE = os.path.join(ROOT, "jax_paged")

# Each layer may import only itself and the layers listed for it (arrows point down:
# kernels <- pool, weight_quant <- lora <- nn <- latent_attention, paged_model,
# tensor_parallel, guided <-
# serving <- cli, server_metrics <- openai_server <- openai_batch; tool_calls, reasoning
# <- openai_server).
ALLOWED = {
    "kernels": {"kernels"},
    "pool": {"kernels", "pool"},
    "weight_quant": {"kernels", "weight_quant"},
    "lora": {"weight_quant", "lora"},
    "nn": {"kernels", "weight_quant", "lora", "pool", "nn"},
    "latent_attention": {"kernels", "pool", "nn", "latent_attention"},
    "sampling": {"sampling"},
    "guided": {"guided"},
    "paged_model": {"pool", "paged_model"},
    "tensor_parallel": {"kernels", "weight_quant", "lora", "pool", "nn", "tensor_parallel"},
    "serving": {"kernels", "weight_quant", "lora", "pool", "nn", "sampling", "guided",
                "paged_model", "tensor_parallel", "serving"},
    "cli": {"kernels", "weight_quant", "paged_model", "tensor_parallel", "guided", "serving",
            "cli"},
    "server_metrics": {"serving", "server_metrics"},
    "tool_calls": {"tool_calls"},
    "reasoning": {"reasoning"},
    "openai_server": {"paged_model", "guided", "serving", "cli", "server_metrics",
                      "tool_calls", "reasoning", "openai_server"},
    "openai_batch": {"serving", "cli", "openai_server", "openai_batch"},
}


def _layer(path: str) -> str:
  return os.path.relpath(path, PACKAGE).split(os.sep)[0].removesuffix(".py")


def _imports(path: str) -> list[str]:
  """Every module a file imports (absolute names; `from x import y` gives x and x.y)."""
  with open(path, encoding="utf-8") as f:
    tree = ast.parse(f.read(), path)
  names = []
  for node in ast.walk(tree):
    if isinstance(node, ast.Import):
      names += [a.name for a in node.names]
    elif isinstance(node, ast.ImportFrom) and node.module:
      names += [node.module] + [f"{node.module}.{a.name}" for a in node.names]
  return names


def _sources() -> list[str]:
  return [os.path.join(d, f) for d, _, files in os.walk(PACKAGE) for f in files
          if f.endswith(".py")]


def test_jax_paged_never_imports_models():
  offenders = [(os.path.relpath(p, ROOT), name) for p in _sources() for name in _imports(p)
               if name == "models" or name.startswith("models.")]
  assert not offenders


def test_layers_import_only_the_layers_below():
  wrong = []
  for path in _sources():
    layer = _layer(path)
    if layer == "__init__":
      continue
    for name in _imports(path):
      parts = name.split(".")
      if parts[0] != "jax_paged" or len(parts) < 2:
        continue
      if parts[1] not in ALLOWED[layer]:
        wrong.append((os.path.relpath(path, ROOT), name))
  assert not wrong


def test_importing_the_package_cli_and_server_loads_no_model():
  code = ("import sys, jax_paged, jax_paged.cli, jax_paged.openai_server, "
          "jax_paged.openai_batch; "
          "print(sorted(m for m in sys.modules if m == 'models' or m.startswith('models.')))")
  env = dict(os.environ, PYTHONPATH=ROOT, JAX_PLATFORMS="cpu")
  out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                       check=True, cwd=ROOT)
  assert out.stdout.strip() == "[]"


def test_generate_is_the_function_after_the_cli_module_is_imported():
  import jax_paged
  import jax_paged.cli  # pylint: disable=unused-import,import-outside-toplevel
  assert callable(jax_paged.generate) and jax_paged.generate.__name__ == "generate"
  with pytest.raises(ValueError, match="non-empty"):
    jax_paged.generate(None, [], 1)
