"""cuda/quantize/tools/rotate_quantize_timing.cu, the standalone timing tool of the fused rotate +
quantize pass (no JAX): its variants are compared with it in benchmarks/RESULTS.md. After timing
it checks the unrotated cases on the host (v's per-head scales exactly, sampled values, the fp8
kernel's V layout element by element) and prints FAILED otherwise. CPU CI builds it for sm_90a so
that it cannot rot; on a Hopper GPU it also runs on ragged shapes."""
import pytest

from test_cuda_layouts import REPO, _compile, _run_checked

TOOL = REPO / "cuda" / "quantize" / "tools" / "rotate_quantize_timing.cu"


@pytest.fixture(scope="module")
def rq_tool(tmp_path_factory):
  return _compile(tmp_path_factory.mktemp("rq_timing"), TOOL, "rotate_quantize_timing",
                  nvcc_flags=("-O3", "-arch=sm_90a", "--use_fast_math"), with_cute=False)


def test_rotate_quantize_tool_builds(rq_tool):
  assert rq_tool.exists()


@pytest.mark.gpu
@pytest.mark.parametrize("b,s,h,d", [(1, 1000, 3, 128), (2, 77, 2, 64), (1, 300, 2, 256),
                                     (1, 1, 1, 32), (1, 129, 2, 96)])
def test_rotate_quantize_tool_checks_hold(rq_tool, b, s, h, d):
  out = _run_checked(rq_tool, b, s, h, d)
  assert "check: v scales, values and kernel layout vs host: ok" in out, out
