"""Which kernels the loaded library was compiled with, for GPU tests that must dispatch one."""
import numpy as np
import pytest

from jax_fa3 import _ffi, _ops


def skip_unless_compiled(q):
  """Skips the test when q's head-dim bucket or dtype is not in this build.

  A lean build (JAX_FA3_HEAD_DIMS / JAX_FA3_DTYPES, e.g. the CPU-built library that GPU runs
  carry) has no kernel for the other buckets; their calls take the pure-JAX path by design.
  """
  config = _ffi.build_config()
  bucket = _ops.head_dim_bucket(q.shape[-1])
  dtype = _ops._KERNEL_DTYPES.get(np.dtype(q.dtype))
  if str(bucket) not in config.get("head_dims", ()) or dtype not in config.get("dtypes", ()):
    pytest.skip(f"head_dim bucket {bucket} / {dtype} is not in this build ({config})")
