#!/usr/bin/env bash
# The whole GPU test suite on a Hopper machine with jax_fa3 installed (e.g. after
# `STAGES=install tools/gpu_validate.sh`), in chunks that each stay under a time limit, then a
# per-file passed / failed / errors / skipped / xfailed table (tools/junit_table.py).
#
#   tools/gpu_tests.sh                 # the default chunks, in order
#   tools/gpu_tests.sh fwd bwd         # some chunks (names below)
#   tools/gpu_tests.sh tests/test_gpu_large.py tests/test_api.py   # some files, one chunk
#   CHUNK_TIMEOUT=500 PYTEST_ARGS="-k softmax_scale" tools/gpu_tests.sh fwd
#
# Writes $OUT (default ./gpu_out)/<chunk>.xml (JUnit) and <chunk>.log. A chunk killed by its
# time limit (CHUNK_TIMEOUT seconds, default 520) has no report: its files are listed as TIMEOUT;
# a chunk whose pytest died otherwise (a crash in a kernel, say) as CRASHED.
# Tests that need two GPUs skip on one.
# JOBS (default: cores / 2, at most 12) pytest-xdist workers share the GPU where pytest-xdist is
# installed: most of a test's time is XLA compiling on the host. The `large` chunk (tensors past
# 2^31 elements, ~60 GB of GPU memory a test) always runs in one process.
set -uo pipefail
export PYTHONUNBUFFERED=1
cd "$(dirname "$0")/.."
OUT="${OUT:-$PWD/gpu_out}"
mkdir -p "$OUT"
CHUNK_TIMEOUT="${CHUNK_TIMEOUT:-520}"

declare -A CHUNKS=(
  # The bf16/fp16 forward, Hadamard, exp2.
  [fwd]="tests/test_gpu_attention.py tests/test_gpu_hadamard.py tests/test_gpu_exp2_fma.py"
  # Tensors past 2^31 elements through every kernel (one process: each test holds ~60 GB).
  [large]="tests/test_gpu_large.py tests/test_gpu_int32_limits.py"
  # The backward kernel.
  [bwd]="tests/test_gpu_backward.py"
  # The key-range kernels: lengths, segment ids, varlen, the KV cache (and its split-KV merge).
  [masked]="tests/test_gpu_masked.py tests/test_gpu_split_kv_combine.py"
  # What users compose the kernels with (transformations, sharding, ring), the Flax layers.
  [compose]="tests/test_gpu_compose.py tests/test_gpu_flax.py"
  # The fp8 kernels (forward, backward) and the forward's input pass.
  [fp8]="tests/test_gpu_fp8.py tests/test_gpu_rotate_quantize.py tests/test_gpu_fp8_backward.py"
  # The public fp8 API on the kernel (about 7 minutes on the H200 alone).
  [fp8_api]="tests/test_fp8.py"
  # Not in the default run: the CPU suite's files that take the kernel path on a GPU, the SASS
  # and tool checks.
  [cpu_files]="tests/test_api.py tests/test_flax.py tests/test_sharding.py tests/test_ring.py tests/test_kernel_targets.py tests/test_sass.py tests/test_fwd_timeline_tool.py tests/test_rotate_quantize_tool.py tests/test_cuda_layouts.py"
)
ORDER=(fwd bwd masked compose fp8 fp8_api large)

requested=("$@")
[[ ${#requested[@]} -eq 0 ]] && requested=("${ORDER[@]}")
runs=()     # "name|files"
files=()
for arg in "${requested[@]}"; do
  if [[ -n "${CHUNKS[$arg]+x}" ]]; then
    runs+=("$arg|${CHUNKS[$arg]}")
  elif [[ -f "$arg" ]]; then
    files+=("$arg")
  else
    echo "unknown chunk or file: $arg (chunks: ${ORDER[*]} cpu_files)" >&2
    exit 2
  fi
done
[[ ${#files[@]} -gt 0 ]] && runs+=("files|${files[*]}")

JOBS="${JOBS:-$(( $(nproc) / 2 < 12 ? $(nproc) / 2 : 12 ))}"
parallel=()
if (( JOBS > 1 )) && python3 -c "import xdist" 2>/dev/null; then
  parallel=(-n "$JOBS")
  export XLA_PYTHON_CLIENT_PREALLOCATE=false   # the workers share the GPU's memory
fi

reports=()
timed_out=()
crashed=()
t0=$(date +%s)
for run in "${runs[@]}"; do
  name="${run%%|*}"
  read -r -a chunk_files <<< "${run#*|}"
  rm -f "$OUT/$name.xml"
  workers=("${parallel[@]}")
  [[ "$name" == large ]] && workers=()
  # shellcheck disable=SC2086  # PYTEST_ARGS is a list of words on purpose
  timeout "$CHUNK_TIMEOUT" pytest -q -rfEs -p no:cacheprovider -o junit_family=xunit1 \
    --junitxml="$OUT/$name.xml" "${workers[@]}" ${PYTEST_ARGS:-} "${chunk_files[@]}" \
    > "$OUT/$name.log" 2>&1
  rc=$?
  echo "== $name rc=$rc $(( $(date +%s) - t0 ))s: $(tail -1 "$OUT/$name.log")"
  if [[ -f "$OUT/$name.xml" ]]; then
    reports+=("$OUT/$name.xml")
  elif (( rc == 124 || rc == 137 )); then   # killed by timeout
    timed_out+=("${chunk_files[@]}")
    tail -5 "$OUT/$name.log"
  else                                      # no report without a timeout: pytest itself died
    crashed+=("${chunk_files[@]}")
    tail -5 "$OUT/$name.log"
  fi
done
echo
python3 tools/junit_table.py "${reports[@]}" --timed-out "${timed_out[@]}" --crashed "${crashed[@]}" \
  | tee "$OUT/table.txt"
exit "${PIPESTATUS[0]}"
