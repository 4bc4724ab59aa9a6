"""exp2 on the FMA pipe (cuda/flash_fwd/exp2_fma.h), checked on the GPU against exp2 in double.

The fp8 d64 forward computes every 4th softmax exponential this way. tests/cuda/check_exp2_fma.cu
evaluates it on every float32 in [-130, 10] at a 1/4096 stride plus edge values: relative error
below 2e-4 where 2^x is a normal float (the cubic's fit error is 1.0e-4; P is then rounded to e4m3,
6%), exactly +0 at and below -127 (masked scores are -inf: an empty row must still sum to 0), a
nonnegative denormal in between, and NaN for NaN.
"""
import subprocess

import pytest

from test_cuda_layouts import REPO, _nvcc

pytestmark = pytest.mark.gpu


def test_exp2_fma_matches_exp2(tmp_path):
  nvcc = _nvcc()
  if nvcc is None:
    pytest.skip("needs nvcc")
  exe = tmp_path / "check_exp2_fma"
  build = subprocess.run(
      [nvcc, "-std=c++17", "-O3", "-arch=sm_90a", "--use_fast_math", "-I", str(REPO / "cuda"),
       "-o", str(exe), str(REPO / "tests" / "cuda" / "check_exp2_fma.cu")],
      capture_output=True, text=True, timeout=600)
  assert build.returncode == 0, build.stderr[-3000:]
  run = subprocess.run([str(exe)], capture_output=True, text=True, timeout=120)
  assert run.returncode == 0 and run.stdout.rstrip().endswith(": ok"), run.stdout + run.stderr
