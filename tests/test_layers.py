"""The package's modules import downward only, with no cycle.

Each module may import (at module or function level) the modules of the layers below its own and
the modules listed before it in its own layer. The check reads the sources with `ast` (nothing is
imported), so it runs anywhere.
"""
import ast
import pathlib

import pytest

PACKAGE = pathlib.Path(__file__).resolve().parent.parent / "jax_fa3"

COMPILED = ("_jax_fa3_cuda",)
# Lowest layer first; within a layer, a module may import those listed before it.
LAYERS = (
    ("compiled extension (built from cuda/, no Python source)", COMPILED),
    ("foundations", ("_config", "_ffi", "_batching", "_validation", "reference", "_key_ranges")),
    ("single-device kernel calls and their pure-JAX fallbacks",
     ("hadamard", "_local_attention", "_fp8_quantize", "_fp8_emulation", "_fp8_forward",
      "_fp8_backward_emulation", "_fp8_backward")),
    ("partitioning rules", ("_partitioning",)),
    ("ring attention", ("ring",)),
    ("public API",
     ("attention", "fp8", "varlen", "_cache_attention", "_fp8_cache_decode", "kvcache")),
    ("package, tools and Flax layers",
     ("__init__", "_bench", "__main__", "flax.rotation", "flax.attention_fn", "flax.linen",
      "flax.nnx_layers", "flax.__init__")),
)
ORDER = [module for _, modules in LAYERS for module in modules]


def module_name(path: pathlib.Path) -> str:
  """'ring' for jax_fa3/ring.py, 'flax.linen' for jax_fa3/flax/linen.py."""
  return ".".join(path.relative_to(PACKAGE).with_suffix("").parts)


def _as_module(dotted: str) -> str | None:
  """The package module a dotted name under jax_fa3 refers to, or None (e.g. a function)."""
  if dotted in ORDER:
    return dotted
  if dotted + ".__init__" in ORDER:
    return dotted + ".__init__"
  return None


def imported_modules(name: str, source: str) -> set[str]:
  """The package modules that the module `name` (see `module_name`) imports in `source`."""
  package = name.split(".")[:-1]
  found = set()
  for node in ast.walk(ast.parse(source)):
    if isinstance(node, ast.Import):
      candidates = [alias.name for alias in node.names]
    elif isinstance(node, ast.ImportFrom):
      if node.level:  # relative: resolve against this module's package
        base = package[:len(package) - (node.level - 1)]
        module = ".".join(["jax_fa3"] + base + ([node.module] if node.module else []))
      else:
        module = node.module or ""
      # `from jax_fa3 import ring` imports module ring; `from jax_fa3.ring import f`, module ring.
      candidates = [f"{module}.{alias.name}" if _as_module(f"{module}.{alias.name}"[8:])
                    else module for alias in node.names]
    else:
      continue
    for dotted in candidates:
      if dotted == "jax_fa3":
        found.add("__init__")
      elif dotted.startswith("jax_fa3."):
        found.add(_as_module(dotted[len("jax_fa3."):]))
  found.discard(None)
  found.discard(name)
  return found


def upward_imports(name: str, source: str) -> list[str]:
  return sorted(m for m in imported_modules(name, source) if ORDER.index(m) > ORDER.index(name))


def _sources():
  return sorted(p for p in PACKAGE.rglob("*.py") if "__pycache__" not in p.parts)


def test_every_module_has_a_layer():
  names = {module_name(p) for p in _sources()} | set(COMPILED)
  assert names == set(ORDER), (f"modules without a layer: {sorted(names - set(ORDER))}; "
                               f"listed but missing: {sorted(set(ORDER) - names)}")


@pytest.mark.parametrize("path", _sources(), ids=module_name)
def test_imports_point_down(path):
  name = module_name(path)
  upward = upward_imports(name, path.read_text())
  assert not upward, f"jax_fa3.{name} imports {upward}, which sit above it in LAYERS"


def test_the_import_graph_has_no_cycle():
  graph = {module_name(p): imported_modules(module_name(p), p.read_text()) for p in _sources()}
  done, path = set(), []

  def visit(node):
    if node in path:
      pytest.fail("import cycle: " + " -> ".join(path[path.index(node):] + [node]))
    if node in done:
      return
    path.append(node)
    for child in sorted(graph.get(node, ())):
      visit(child)
    path.pop()
    done.add(node)

  for node in sorted(graph):
    visit(node)


def test_the_check_finds_upward_imports():
  # Module level and function level, `import x` and `from x import y`, relative or not.
  source = ("import jax\nfrom jax_fa3 import _ffi, attention\n"
            "from jax_fa3._config import AttentionConfig\n"
            "def f():\n  from jax_fa3.ring import ring_attention\n  import jax_fa3.fp8\n"
            "  from . import _partitioning\n")
  assert imported_modules("_local_attention", source) == {
      "_ffi", "attention", "_config", "ring", "fp8", "_partitioning"}
  assert upward_imports("_local_attention", source) == [
      "_partitioning", "attention", "fp8", "ring"]
  assert upward_imports("flax.linen", "from jax_fa3.flax import attention_fn\n") == []
  assert upward_imports("flax.rotation", "from jax_fa3.flax import linen\n") == ["flax.linen"]
  assert upward_imports("_batching", "import jax_fa3\n") == ["__init__"]
