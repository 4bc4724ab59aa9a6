"""Imports one of the repository's scripts (benchmarks/, tools/, examples/) by path: they are not
packages, and the tests call their functions directly."""
import importlib.util
import pathlib
import sys

REPO = pathlib.Path(__file__).resolve().parent.parent


def load_script(relative_path, name=None):
  """The module at REPO / relative_path, imported as `name` (default: the file's stem)."""
  path = REPO / relative_path
  spec = importlib.util.spec_from_file_location(name or path.stem, path)
  module = importlib.util.module_from_spec(spec)
  sys.modules[spec.name] = module  # dataclasses resolve annotations through sys.modules
  spec.loader.exec_module(module)
  return module
