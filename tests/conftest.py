"""Shared pytest setup: float64 on, GPU tests skipped (with the reason) without a Hopper GPU."""
import os

import jax
import pytest

jax.config.update("jax_enable_x64", True)

import jax_fa3  # noqa: E402  (after x64 is enabled)


def pytest_collection_modifyitems(config, items):
  if jax_fa3.kernels_available():
    return
  skip = pytest.mark.skip(reason=f"no Hopper GPU kernels here: {jax_fa3.kernels_unavailable_reason()}")
  for item in items:
    if "gpu" in item.keywords:
      item.add_marker(skip)


def pytest_report_header(config):
  return (f"jax {jax.__version__}, devices {jax.devices()}, jax_fa3 kernels: "
          f"{jax_fa3.kernels_available()} ({jax_fa3.kernels_unavailable_reason() or 'ok'}), "
          f"XLA_FLAGS={os.environ.get('XLA_FLAGS', '')}")
