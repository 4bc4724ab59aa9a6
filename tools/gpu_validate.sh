#!/usr/bin/env bash
# One GPU validation step on a Hopper machine, each stage time-boxed, logs in $OUT (default
# ./gpu_out): install (optionally with a kernels library built elsewhere), the GPU tests of the
# forward, Hadamard and backward kernels (the backward kernel is on by default), compute-sanitizer
# memcheck and racecheck on small cases, and the backward benchmark at d=128.
#
#   tools/gpu_validate.sh [path/to/libjax_fa3_kernels.so]
#
# Stages: STAGES="install fwd bwd sanitizer bench fp8 ring" (default: all but fp8 and ring), e.g.
# STAGES="install bwd". fwd, bwd (with the compose chunk: transformations, sharding, Flax) and fp8
# (the fp8 kernel, its input pass and tests/test_fp8.py, the public API on the kernel) run
# chunks of tools/gpu_tests.sh, each under its CHUNK_TIMEOUT.
# ring needs 2+ GPUs: benchmarks/bench_ring.py, 128k tokens, 1 vs n GPUs.
# Building the kernels library on a CPU machine first (cmake; README, build options) and passing it here
# skips the 2-10 minute CUDA build on the GPU machine: only the Python binding is built there.
set -uo pipefail
export PYTHONUNBUFFERED=1
OUT="${OUT:-$PWD/gpu_out}"
mkdir -p "$OUT"
STAGES="${STAGES:-install fwd bwd sanitizer bench}"
KERNELS_SO="${1:-}"
t0=$(date +%s)
elapsed() { echo "$(( $(date +%s) - t0 ))s"; }
has() { [[ " $STAGES " == *" $1 "* ]]; }

if has install; then
  extra=()
  [[ -n "$KERNELS_SO" ]] && extra=(-C "cmake.define.JAX_FA3_PREBUILT_KERNELS=$(realpath "$KERNELS_SO")")
  python3 -m pip install --no-build-isolation --no-deps "${extra[@]}" . > "$OUT/install.log" 2>&1 \
    || { tail -30 "$OUT/install.log"; exit 1; }
  echo "== install done $(elapsed)"
fi
# The test stages are chunks of tools/gpu_tests.sh (JUnit XML, logs and a per-file table in $OUT).
if has fwd; then
  OUT="$OUT" tools/gpu_tests.sh fwd | tail -12
  echo "== forward tests rc=${PIPESTATUS[0]} $(elapsed)"
fi
if has fp8; then
  OUT="$OUT" tools/gpu_tests.sh fp8 fp8_api | tail -12
  echo "== fp8 tests rc=${PIPESTATUS[0]} $(elapsed)"
fi
if has bwd; then
  OUT="$OUT" tools/gpu_tests.sh bwd compose | tail -12
  echo "== backward tests rc=${PIPESTATUS[0]} $(elapsed)"
fi
if has sanitizer; then
  for tool in memcheck racecheck; do
    XLA_PYTHON_CLIENT_PREALLOCATE=false XLA_FLAGS=--xla_gpu_autotune_level=0 \
      timeout 150 compute-sanitizer --tool "$tool" --kernel-name kns=jax_fa3 --print-limit 20 \
      python3 benchmarks/sanitizer_cases.py --head-dims 64,128,256 --backward > "$OUT/sanitizer_$tool.log" 2>&1
    echo "== $tool rc=$? $(elapsed)"
    grep -E "ERROR SUMMARY|RACECHECK SUMMARY|azard|sanitizer cases|FAILED" "$OUT/sanitizer_$tool.log" | head -5
  done
fi
if has bench; then
  timeout 240 python3 benchmarks/bench_attention.py --head-dims 128 \
    --seqlens 2048,8192 --peers jax_fa3,cudnn,xla --min-time 0.05 --json "$OUT/bench_d128.json" --png "$OUT/bench_d128.png" \
    > "$OUT/bench_d128.log" 2>&1
  echo "== bench rc=$? $(elapsed)"
  tail -16 "$OUT/bench_d128.log"
fi
if has ring; then
  timeout "${RING_TIMEOUT:-300}" python3 benchmarks/bench_ring.py \
    --json "$OUT/ring.json" > "$OUT/ring.log" 2>&1
  echo "== ring rc=$? $(elapsed)"
  tail -8 "$OUT/ring.log"
fi
