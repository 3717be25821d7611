#!/usr/bin/env bash
# The GPU run: GPU tests (failing, not skipping, without a usable GPU), compute-sanitizer over a
# fuzz subset, and the benchmarks, in one call on the GPU machine.  Logs go under $OUT.
#
#   bash scripts/gpu_check.sh [all|tests|sanitizer|bench]
# Installs nothing from the network: the package itself is installed in editable mode without
# dependencies (CuPy, torch, pytest and hypothesis come with the machine's image).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/out}
mkdir -p "$OUT"
what=${1:-all}
export PYTHONUNBUFFERED=1 KVCANARY_EXPECT_GPU=1 CUPY_CACHE_DIR=${CUPY_CACHE_DIR:-/tmp/kvcanary-cupy-cache}
status=0

{
  nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.mem --format=csv
  python3 -c "import cupy, torch, numpy; print('cupy', cupy.__version__, 'torch', torch.__version__, 'numpy', numpy.__version__, 'nvrtc', cupy.cuda.nvrtc.getVersion())"
} > "$OUT/env.log" 2>&1
cat "$OUT/env.log"

if ! python3 -m pip install -q --no-deps --no-build-isolation --no-index -e . > "$OUT/install.log" 2>&1; then
  echo "editable install failed:"; tail -20 "$OUT/install.log"; exit 1
fi

run() {  # run NAME CMD...: tee the output to $OUT/NAME.log, remember a failure
  local name=$1; shift
  echo "=== $name: $*"
  "$@" 2>&1 | tee "$OUT/$name.log" | tail -n 25
  local rc=${PIPESTATUS[0]}
  echo "=== $name exit $rc"
  [ "$rc" -eq 0 ] || status=1
}

if [ "$what" = all ] || [ "$what" = tests ]; then
  run gpu-tests python3 -m pytest -q -rs tests
  run quickstart python3 examples/quickstart.py --gpu
  run sim-cuda python3 -m kvcanary_cupy sim --device cuda --steps 400 --json "$OUT/sim-cuda.json" --plot "$OUT/sim-cuda.png"
fi
if [ "$what" = all ] || [ "$what" = sanitizer ]; then
  run memcheck compute-sanitizer --tool memcheck --error-exitcode 1 python3 scripts/sanitizer_fuzz.py --cases 40
  run racecheck compute-sanitizer --tool racecheck --error-exitcode 1 python3 scripts/sanitizer_fuzz.py --cases 6
fi
if [ "$what" = all ] || [ "$what" = bench ]; then
  run bench python3 -m kvcanary_cupy bench --out "$OUT/bench.txt" --json "$OUT/bench.json"
  run bench-session python3 benchmarks/bench_session.py --out "$OUT/bench-session.txt"
fi
exit $status
