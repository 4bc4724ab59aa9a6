"""benchmarks/kernel_times.py, the per-kernel breakdown of a call from a jax.profiler trace: its
scenario parsing and its summary of device events (the trace itself needs a GPU)."""
import pytest

from repo_script import load_script


@pytest.fixture(scope="module")
def tool():
  return load_script("benchmarks/kernel_times.py")


@pytest.mark.parametrize("spec", ["decode:jax_fa3:1", "padded:varlen", "step:bf16:128",
                                  "fp8:128", "ring:1:2:3"])
def test_bad_scenarios_name_the_expected_forms(tool, spec):
  with pytest.raises(ValueError, match="decode:PEER:BATCH:CACHE"):
    tool.parse(spec, grad=False)


def test_fp8_scenario_is_the_call_from_bf16(tool):
  # 16k tokens at width 2048: d128 8k is 2 rows of 16 heads, bf16 inputs.
  fn, (q, k, v) = tool.parse("fp8:128:8192:causal", grad=False)
  assert q.shape == k.shape == v.shape == (2, 8192, 16, 128) and q.dtype.name == "bfloat16"
  assert callable(fn)


def test_donating_peer_is_refused(tool):
  with pytest.raises(ValueError, match="donates its caches"):
    tool.parse("decode:jax_fa3_append:1:256", grad=False)


def test_report_sums_per_kernel_and_per_call(tool, capsys):
  # Two calls: kernel A (3 + 5 µs) and B (2 µs, once), the calls' span 0 .. 20 µs.
  events = [("Stream #1", "A", 0, 3000), ("Stream #1", "B", 4000, 2000),
            ("Stream #1", "A", 15000, 5000)]
  tool.report("case", 1e-5, events, calls=2)
  lines = capsys.readouterr().out.splitlines()
  assert lines[0] == "== case: 10.0 µs per call (back-to-back)"
  assert lines[1].split()[:3] == ["4.0", "µs", "x1"] and lines[1].endswith("A")
  assert lines[2].split()[:3] == ["1.0", "µs", "x0.5"] and lines[2].endswith("B")
  assert lines[3].split()[:2] == ["5.0", "µs"] and "10.0 µs first start to last end" in lines[3]


def test_report_says_when_the_trace_has_no_device_events(tool, capsys):
  tool.report("case", 1e-3, [], calls=1)
  assert "no GPU events" in capsys.readouterr().out
