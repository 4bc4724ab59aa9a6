"""Meshes of the 8 fake CPU devices (tests/conftest.py sets XLA_FLAGS) for the multi-device tests."""
import math

import jax
import pytest

CPUS = jax.devices("cpu")
# AxisType (Auto / Explicit meshes) exists from JAX 0.6 on; older JAX only has implicit meshes.
AXIS_TYPE = getattr(jax.sharding, "AxisType", None)


def make_mesh(shape, names, kind="auto"):
  """A mesh over the first prod(shape) CPU devices with Auto or Explicit axes (skips if unsupported)."""
  if AXIS_TYPE is None:
    if kind == "explicit":
      pytest.skip("this JAX has no Explicit mesh axes")
    return jax.make_mesh(shape, names, devices=CPUS[:math.prod(shape)])
  if kind == "explicit" and not hasattr(jax, "typeof"):
    pytest.skip("this JAX has no sharding in types")
  axis_type = AXIS_TYPE.Explicit if kind == "explicit" else AXIS_TYPE.Auto
  return jax.make_mesh(shape, names, axis_types=(axis_type,) * len(names),
                       devices=CPUS[:math.prod(shape)])
