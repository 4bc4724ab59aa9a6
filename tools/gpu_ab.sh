#!/usr/bin/env bash
# A/B of kernel builds on one GPU machine, in one run: each variant (a source tree and a kernels
# library built elsewhere) is installed into its own folder with `pip install --target`, then one
# benchmark command runs for every variant in turn, ROUNDS times, so that the variants alternate
# on the same GPU (timings drift between machines and over minutes; compare only within a run).
#
#   tools/gpu_ab.sh NAME=TREE:LIB[:COMMIT] [NAME=TREE:LIB[:COMMIT] ...] -- COMMAND [ARGS...]
#
#   TREE  a source tree (a directory, or a .tar / .tar.gz of `git ls-files`) whose Python and
#         benchmarks belong with LIB
#   LIB   its libjax_fa3_kernels.so (or .so.gz)
#   COMMIT the commit TREE and LIB were made from, exported to COMMAND as JAX_FA3_BENCH_COMMIT
#         (the benchmarks' JSON headers record it; an unpacked tree is no git checkout)
#   COMMAND runs in an empty folder (no source tree on its path) with PYTHONPATH=<the variant's
#         install folder>, so it imports that variant's installed jax_fa3. In ARGS, {tree} becomes
#         the variant's unpacked tree (its benchmarks: {tree}/benchmarks/bench_decode.py), {name}
#         its name and {round} the round (e.g. --json "$OUT/decode_{name}_{round}.json", $OUT
#         expanded by the calling shell).
#
# Example: ROUNDS=2 tools/gpu_ab.sh base=.gpu/base.tar.gz:.gpu/base.so.gz \
#            new=.gpu/new.tar.gz:.gpu/new.so.gz -- python3 {tree}/benchmarks/bench_decode.py \
#            --batches 1,8 --caches 32768 --json "$OUT/decode_{name}_{round}.json"
# Logs: $OUT (default ./gpu_out)/ab_install_<name>.log; the command's output goes to stdout.
set -uo pipefail
export PYTHONUNBUFFERED=1
OUT="${OUT:-$PWD/gpu_out}"
ROUNDS="${ROUNDS:-2}"
WORK="${AB_WORK:-/tmp/jax_fa3_ab}"
mkdir -p "$OUT" "$WORK"

names=()
declare -A commits
while [[ $# -gt 0 && "$1" != "--" ]]; do
  spec="$1"; shift
  name="${spec%%=*}"; rest="${spec#*=}"
  tree="${rest%%:*}"; lib="${rest#*:}"; commit=""
  if [[ "$lib" == *:* ]]; then commit="${lib#*:}"; lib="${lib%%:*}"; fi
  if [[ -z "$name" || "$name" == "$spec" || -z "$tree" || -z "$lib" || "$lib" == "$rest" ]]; then
    echo "gpu_ab: a variant is NAME=TREE:LIB[:COMMIT], got '$spec'" >&2; exit 2
  fi
  commits["$name"]="$commit"
  src="$WORK/tree_$name"; site="$WORK/site_$name"
  rm -rf "$src" "$site" && mkdir -p "$src"
  if [[ -d "$tree" ]]; then cp -r "$tree"/. "$src"/; else tar -xf "$tree" -C "$src"; fi
  so="$WORK/lib_$name/libjax_fa3_kernels.so"
  mkdir -p "$(dirname "$so")"
  if [[ "$lib" == *.gz ]]; then gunzip -c "$lib" > "$so"; else cp "$lib" "$so"; fi
  if ! python3 -m pip install -q --no-build-isolation --no-deps --target "$site" \
      -C "cmake.define.JAX_FA3_PREBUILT_KERNELS=$so" "$src" > "$OUT/ab_install_$name.log" 2>&1; then
    echo "gpu_ab: installing $name failed:" >&2; tail -20 "$OUT/ab_install_$name.log" >&2; exit 1
  fi
  names+=("$name")
done
[[ "${1:-}" == "--" ]] && shift
if [[ ${#names[@]} -eq 0 || $# -eq 0 ]]; then
  echo "usage: tools/gpu_ab.sh NAME=TREE:LIB[:COMMIT] [...] -- COMMAND [ARGS...]" >&2; exit 2
fi

mkdir -p "$WORK/run" && cd "$WORK/run"
for round in $(seq 1 "$ROUNDS"); do
  for name in "${names[@]}"; do
    args=()
    for a in "$@"; do
      a="${a//\{name\}/$name}"; a="${a//\{tree\}/$WORK/tree_$name}"; args+=("${a//\{round\}/$round}")
    done
    echo "== $name, round $round: ${args[*]}"
    JAX_FA3_BENCH_COMMIT="${commits[$name]:-${JAX_FA3_BENCH_COMMIT:-}}" \
      PYTHONPATH="$WORK/site_$name${PYTHONPATH:+:$PYTHONPATH}" "${args[@]}"
  done
done
