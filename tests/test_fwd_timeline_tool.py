"""cuda/flash_fwd/tools/fwd_timeline.cu, the standalone forward timing tool (no JAX).

Every kernel variant of benchmarks/RESULTS.md is timed with it, so its correctness spot check
matters: after timing, it compares 24 rows of O (one of them the last row, in the tail blocks)
with a float64 reference on the same quantized inputs and prints FAILED past 0.1 relative row
error for fp8 (P is e4m3: 2.8-3.1% measured on the H200) and 0.01 for bf16 (0.25-0.29%). CPU CI
builds the fp8 d128 tool for sm_90a so that it cannot rot; on a Hopper GPU the same binary also
runs on ragged shapes (s not a multiple of any tile), causal and not.
"""
import pytest

from test_cuda_layouts import REPO, _compile, _run_checked

TOOL = REPO / "cuda" / "flash_fwd" / "tools" / "fwd_timeline.cu"


@pytest.fixture(scope="module")
def fp8_d128_tool(tmp_path_factory):
  return _compile(tmp_path_factory.mktemp("fwd_timeline"), TOOL, "fwd_timeline_fp8_d128",
                  nvcc_flags=("-O3", "-arch=sm_90a", "--use_fast_math", "-DTOOL_HDIM=128"))


def test_fwd_timeline_tool_builds(fp8_d128_tool):
  assert fp8_d128_tool.exists()


@pytest.mark.gpu
@pytest.mark.parametrize("batch,heads,seqlen,causal", [(1, 2, 1000, 0), (2, 3, 777, 1),
                                                       (1, 1, 1, 0), (1, 2, 4097, 1)])
def test_fwd_timeline_tool_matches_float64(fp8_d128_tool, batch, heads, seqlen, causal):
  out = _run_checked(fp8_d128_tool, batch, heads, seqlen, causal)
  assert "check: max relative row error" in out, out
