"""The compiled kernels' SASS, checked on the CPU (CI builds the whole sm_90a library).

tools/sass_report.py counts, per kernel, the instructions that show the FlashAttention-3 design
(HGMMA/QGMMA: wgmma; UTMALDG/UTMASTG: TMA; USETMAXREG: the register split between producer and
consumers) and local-memory traffic (LDL/STL: register spills). This pins them: every attention
kernel uses wgmma of its type (QGMMA for fp8, the FP8 issue's "SASS shows QGMMA"), TMA loads and
setmaxnreg, no kernel has its wgmmas serialized by ptxas (each waited for at once), and no
kernel spills more than it does today. The known spills (SPILL_BUDGET): the fp8 d128 128-row
forward 12 bytes under its 208-register cap, outside the K/V loop, its 192-row kernel 4 bytes
(one load per K/V block, measured faster than without), and the fp8 input pass's block kernel
20-48. A new spill anywhere fails here before it costs speed.
Skipped without the installed kernels library (a pure-JAX install) or cuobjdump and nvdisasm (the
test extra's nvidia-cuda-cuobjdump and nvidia-cuda-nvdisasm provide them).
"""
import os
import pathlib
import re

import pytest

import jax_fa3
from repo_script import load_script


# Local-memory instructions (LDL + STL) allowed per kernel; every other kernel: none.
# fp8 d128 with 128-row tiles: 12 bytes (3 STL + 3 LDL, all per tile, none in the K/V loop) under
# its 208-register cap (cuda/flash_fwd/fp8/traits.h), since the row sums' tensor-core accumulator
# (fp8/row_sum.h) takes 4 of them.
# The fp8 input pass's block kernel: 20-48 bytes under its 85-register cap (three CTAs per SM,
# cuda/quantize/rotate_quantize.cu), kept because it measured faster than 92 registers without
# spills (q rotated at 16k tokens, H200: 52 vs 64 µs at d=128, 79 vs 88 at d=256); d = 32, 64 fit.
# fp8 d128 with 192-row tiles: 4 bytes (one STL before the K/V loop, one LDL per K/V block),
# since the S GEMM's descriptors were sliced by a warp-uniform warpgroup index (consumer.h): that
# took ten instructions and eight R2URs out of the loop and measured 2% faster with the spill
# (kernel alone, 2x16x8192, H200: 921-929 vs 901-908 TFLOP/s).
# The input pass's staged block kernel (64-token blocks at d 160-256, rotated once): fp16 at
# d = 160-224 only, 2-4 instructions under the same 85-register cap (bf16 and float32 fit).
SPILL_BUDGET = {r"flash_fwd_kernel<fwd::Fp8KernelTraits<128, 128> >": 6,
                r"flash_fwd_kernel<fwd::Fp8KernelTraits<128, 192> >": 2,
                r"rotate_quantize_block_kernel<[\w:]+, [48]>": 10,
                r"rotate_quantize_block_kernel<[\w:]+, [3567]>": 24,
                r"rotate_quantize_staged_block_kernel<__half, [567]>": 4}


def _sass_report():
  return load_script("tools/sass_report.py")


@pytest.fixture(scope="module")
def kernels():
  library = pathlib.Path(os.environ.get(
      "JAX_FA3_KERNELS_LIB", pathlib.Path(jax_fa3.__file__).parent / "libjax_fa3_kernels.so"))
  if not library.exists():
    pytest.skip(f"no compiled kernels library at {library} (pure-JAX install; set "
                "JAX_FA3_KERNELS_LIB to check a build elsewhere)")
  report = _sass_report()
  if report.find_cuobjdump() is None:
    pytest.skip("cuobjdump with nvdisasm not found (pip install nvidia-cuda-cuobjdump "
                "nvidia-cuda-nvdisasm)")
  # Short names, e.g. "void fwd::flash_fwd_kernel<fwd::Fp8KernelTraits<128> >".
  return [(report.short_name(name), counts) for name, counts in report.kernel_counts(str(library))]


def _matching(kernels, pattern):
  found = [(name, counts) for name, counts in kernels if re.search(pattern, name)]
  assert found, f"no kernel matches {pattern}"
  return found


@pytest.mark.parametrize("pattern,mma", [
    (r"flash_fwd_kernel<fwd::KernelTraits<", "HGMMA"),
    (r"flash_fwd_kernel<fwd::Fp8KernelTraits<", "QGMMA"),
    (r"flash_bwd_kernel<flash_bwd::BwdTraits<", "HGMMA"),
])
def test_attention_kernels_use_wgmma_tma_and_setmaxnreg(kernels, pattern, mma):
  for name, counts in _matching(kernels, pattern):
    other = "HGMMA" if mma == "QGMMA" else "QGMMA"
    assert counts[mma] > 0 and counts[other] == 0, (name, counts)
    assert counts["UTMALDG"] > 0, (name, counts)
    assert counts["USETMAXREG"] == 2, (name, counts)  # producer down, consumers up
    if "fwd" in pattern:
      assert counts["UTMASTG"] > 0, (name, counts)  # O leaves through a TMA store


def test_fp8_backward_kernels_use_both_wgmma_types_tma_and_setmaxnreg(kernels):
  # S^T, dV and dK in e4m3 (QGMMA), dP^T and dQ in 16 bits (HGMMA): cuda/flash_bwd/fp8_traits.cuh.
  for name, counts in _matching(kernels, r"flash_bwd_kernel<flash_bwd::BwdTraitsFp8<"):
    assert counts["QGMMA"] > 0 and counts["HGMMA"] > 0, (name, counts)
    assert counts["UTMALDG"] > 0 and counts["USETMAXREG"] == 2, (name, counts)


def test_wgmma_is_not_serialized(kernels):
  # Waited-for-at-once wgmmas are the last of a batch the code waits on right away (at most 3
  # per kernel today, of 8-44: the fp8 kernels' tail-split row-max loop waits on its S GEMM too);
  # a kernel ptxas serialized has nearly all of them so (21 of 28 in a d128
  # experiment, 2026-12-01, benchmarks/RESULTS.md).
  serialized = []
  for name, counts in kernels:
    gmma = counts["HGMMA"] + counts["QGMMA"]
    if gmma and 2 * counts["GMMA_THEN_WAIT"] > gmma:
      serialized.append(f"{name}: {counts['GMMA_THEN_WAIT']} of {gmma} wgmmas waited at once")
  assert not serialized, "\n".join(serialized)


def test_no_kernel_spills_beyond_its_budget(kernels):
  over = []
  for name, counts in kernels:
    budget = next((b for p, b in SPILL_BUDGET.items() if re.search(p, name)), 0)
    local = counts["LDL"] + counts["STL"]
    if local > budget:
      over.append(f"{name}: {local} local-memory instructions (budget {budget})")
  assert not over, "\n".join(over)
