"""Which kernels the loaded library was compiled with, for GPU tests that must dispatch one."""
import numpy as np
import pytest

from jax_fa3 import _local_attention


def skip_unless_compiled(q):
  """Skips the test when q's head-dim bucket or dtype is not in this build.

  A lean build (JAX_FA3_HEAD_DIMS / JAX_FA3_DTYPES, e.g. the CPU-built library that GPU runs
  carry) has no kernel for the other buckets; their calls take the pure-JAX path by design.
  """
  dtype = _local_attention._KERNEL_DTYPES[np.dtype(q.dtype)]
  reason = _local_attention._not_compiled_reason(q.shape[-1], dtype)
  if reason is not None:
    pytest.skip(reason)
