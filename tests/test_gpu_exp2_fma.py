"""exp2 on the FMA pipe (cuda/flash_fwd/exp2_fma.h), checked on the GPU against exp2 in double.

The fp8 d64 forward computes every 4th softmax exponential this way. tests/cuda/check_exp2_fma.cu
evaluates it on every float32 in [-130, 10] at a 1/4096 stride plus edge values: relative error
below 2e-4 where 2^x is a normal float (the cubic's fit error is 1.0e-4; P is then rounded to e4m3,
6%), exactly +0 at and below -127 (masked scores are -inf: an empty row must still sum to 0), a
nonnegative denormal in between, and NaN for NaN.
"""
import pytest

from test_cuda_layouts import _compile_and_run

pytestmark = pytest.mark.gpu


def test_exp2_fma_matches_exp2(tmp_path):
  # --use_fast_math as in the kernel build: the FTZ behaviour below 2^-126 is part of the check.
  out = _compile_and_run(tmp_path, "check_exp2_fma",
                         nvcc_flags=("-O3", "-arch=sm_90a", "--use_fast_math"), with_cute=False)
  assert out.rstrip().endswith(": ok")
