#!/usr/bin/env bash
# One GPU call for the verify/write kernels: their GPU tests, compute-sanitizer over a fuzz subset,
# the benchmark and (when present) an untracked probe_kernels.py, each stage under a time limit so
# the call returns inside its budget.  Logs under $OUT.
#   bash scripts/gpu_kernels.sh [fuzz-chunks]
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 KVCANARY_EXPECT_GPU=1 CUPY_CACHE_DIR=${CUPY_CACHE_DIR:-/tmp/kvcanary-cupy-cache}
{
  date -u +%Y-%m-%dT%H:%MZ
  nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.max.sm --format=csv
  python3 -c "import cupy, torch, numpy; print('cupy', cupy.__version__, 'torch', torch.__version__, 'numpy', numpy.__version__, 'nvrtc', cupy.cuda.nvrtc.getVersion())"
} > "$OUT/env.log" 2>&1
cat "$OUT/env.log"
python3 -m pip install -q --no-deps --no-build-isolation --no-index -e . > "$OUT/install.log" 2>&1 || { tail "$OUT/install.log"; exit 1; }
stage() {  # stage NAME SECONDS CMD...
  local name=$1 limit=$2; shift 2
  local t0=$SECONDS
  timeout "$limit" "$@" > "$OUT/$name.log" 2>&1
  local rc=$?
  echo "=== $name rc=$rc $((SECONDS - t0))s"; tail -n "${TAIL:-6}" "$OUT/$name.log"
}
python3 -c "import kvcanary_cupy as kc; kc.warmup()" > "$OUT/warmup.log" 2>&1; echo "=== warmup $SECONDS s"
chunks=${1:-"cupy or torch_cuda"}  # e.g. "cupy-0 or torch_cuda-250" for two of the 16 fuzz chunks
TAIL=12 stage tests 170 python3 -m pytest -q -p no:cacheprovider tests/test_multi_buffer.py tests/test_verify.py \
  tests/test_write.py tests/test_gpu_graphs.py tests/test_session.py tests/test_session_graphs.py tests/test_alignment.py \
  tests/test_fuzz_differential.py -k "not test_gpu_matches_numpy or $chunks"
stage bench 95 python3 benchmarks/bench_canary.py --out "$OUT/bench.txt"
stage memcheck 35 compute-sanitizer --tool memcheck --error-exitcode 1 python3 scripts/sanitizer_fuzz.py --cases 8
stage racecheck 25 compute-sanitizer --tool racecheck --error-exitcode 1 python3 scripts/sanitizer_fuzz.py --cases 2
[ -f probe_kernels.py ] && TAIL=20 stage probe 45 python3 probe_kernels.py
cat "$OUT/bench.txt" 2>/dev/null
