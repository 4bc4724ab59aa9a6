"""Shared pytest setup: float64 on, GPU tests skipped (with the reason) without a Hopper GPU."""
import os

# 8 CPU devices for the multi-device tests (tests/test_sharding.py, tests/test_ring.py); must be
# set before JAX creates its CPU client. Single-device tests are unaffected (they use device 0).
if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
  os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                             + " --xla_force_host_platform_device_count=8").strip()

import jax  # noqa: E402
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
