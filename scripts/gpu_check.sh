#!/usr/bin/env bash
# The GPU run: GPU tests (failing, not skipping, without a usable GPU), the quickstart and the
# simulator on CUDA, compute-sanitizer over a fuzz subset and captured-graph replays, and the
# benchmarks, in one call on the GPU machine.  Each stage has a time limit so the call returns
# inside the device tool's limit; logs go under $OUT.
#
#   bash scripts/gpu_check.sh [all|tests|sanitizer|bench] [pytest args...]
#
# Stage limits (seconds) can be changed with TESTS_S (default 450: the suite outgrew 330 s a slice),
# SANITIZER_S, BENCH_S; JOBS (default 4) pytest
# processes share the GPU, each with every JOBS-th test id, and the sanitizer runs beside them;
# the benchmarks run alone afterwards.  Installs nothing from
# the network: the package itself is installed in editable mode without dependencies (CuPy, torch,
# pytest and hypothesis come with the machine's image), or run from the checkout where it cannot be.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/out}
mkdir -p "$OUT"
what=${1:-all}
shift $(( $# > 0 ? 1 : 0 ))
export PYTHONUNBUFFERED=1 KVCANARY_EXPECT_GPU=1 CUPY_CACHE_DIR=${CUPY_CACHE_DIR:-/tmp/kvcanary-cupy-cache}
status=0

{
  date -u +%Y-%m-%dT%H:%MZ
  nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.max.sm --format=csv
  python3 -c "import cupy, torch, numpy; print('cupy', cupy.__version__, 'torch', torch.__version__, 'numpy', numpy.__version__, 'nvrtc', cupy.cuda.nvrtc.getVersion())"
} > "$OUT/env.log" 2>&1
cat "$OUT/env.log"

# The editable install builds with this environment's setuptools (no network for build isolation);
# pyproject's SPDX `license` needs setuptools>=77.  Where it is older or missing (a fresh venv), or
# the install fails, run from the checkout instead: the package on PYTHONPATH, its kernels/ linked in.
if python3 -c "import sys, setuptools; print('setuptools', setuptools.__version__); sys.exit(int(setuptools.__version__.split('.')[0]) < 77)" > "$OUT/install.log" 2>&1 &&
   python3 -m pip install -q --no-deps --no-build-isolation --no-index -e . >> "$OUT/install.log" 2>&1; then
  echo "installed: editable ($(head -1 "$OUT/install.log"))"
else
  echo "no editable install (setuptools>=77 missing or the install failed, $OUT/install.log): running from the checkout"
  [ -e kvcanary_cupy/kernels ] || ln -s ../kernels kvcanary_cupy/kernels
  export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
fi
python3 -c "import importlib.resources as r, kvcanary_cupy; assert r.files('kvcanary_cupy.kernels').joinpath('plan.cu').is_file()" ||
  { echo "kvcanary_cupy or its kernels/ cannot be imported"; exit 1; }

stage() {  # stage NAME SECONDS CMD...: log to $OUT/NAME.log under a time limit, remember a failure
  local name=$1 limit=$2; shift 2
  local t0=$SECONDS
  echo "=== $name: $*"
  timeout "$limit" bash -c '"$@"' _ "$@" > "$OUT/$name.log" 2>&1  # bash -c: CMD may be an exported function
  local rc=$?
  tail -n "${TAIL:-15}" "$OUT/$name.log"
  echo "=== $name exit $rc after $((SECONDS - t0)) s$([ "$rc" -eq 124 ] && echo ' (time limit)')"
  [ "$rc" -eq 0 ] || status=1
  return "$rc"
}

python3 -c "import kvcanary_cupy as kc; kc.warmup()" > "$OUT/warmup.log" 2>&1 || { echo "warmup failed"; tail "$OUT/warmup.log"; status=1; }
pytest_slice() {  # pytest_slice I JOBS [pytest args...]: every JOBS-th test id, so that the chunks of
  # one long file (the GPU fuzz) spread over the slices too
  local i=$1 jobs=$2; shift 2
  local ids=()
  mapfile -t ids < <(python3 -m pytest -q --collect-only -p no:cacheprovider "$@" tests | grep '^tests/.*::' | awk -v i="$i" -v n="$jobs" 'NR % n == i')
  [ "${#ids[@]}" -gt 0 ] || { echo "slice $i: no tests"; return 0; }
  python3 -m pytest -q -rfEs -p no:cacheprovider "$@" "${ids[@]}"
}
sanitizer() {
  compute-sanitizer --tool memcheck --error-exitcode 1 python3 scripts/sanitizer_fuzz.py --cases "${SANITIZER_CASES:-16}" &&
    compute-sanitizer --tool racecheck --error-exitcode 1 python3 scripts/sanitizer_fuzz.py --cases 4 &&
    compute-sanitizer --tool memcheck --error-exitcode 1 python3 scripts/sanitizer_digest.py --cases 12
}
export -f pytest_slice sanitizer
pids=()
if [ "$what" = all ] || [ "$what" = tests ]; then
  jobs=${JOBS:-4}
  for i in $(seq 0 $((jobs - 1))); do
    TAIL=6 stage "gpu-tests-$i" "${TESTS_S:-450}" pytest_slice "$i" "$jobs" "$@" > "$OUT/stage-tests-$i.txt" &
    pids+=($!)
  done
fi
if [ "$what" = all ] || [ "$what" = sanitizer ]; then
  stage sanitizer "${SANITIZER_S:-300}" sanitizer > "$OUT/stage-sanitizer.txt" &
  pids+=($!)
fi
for pid in "${pids[@]}"; do wait "$pid" || status=1; done
cat "$OUT"/stage-*.txt 2>/dev/null
grep -hE "^(FAILED|ERROR)|Error:|ERROR SUMMARY|RACECHECK SUMMARY" "$OUT"/gpu-tests-*.log "$OUT"/sanitizer.log 2>/dev/null | head -60
grep -q "exit [^0]" "$OUT"/stage-*.txt 2>/dev/null && status=1
if [ "$what" = all ] || [ "$what" = tests ]; then
  stage quickstart 60 python3 examples/quickstart.py --gpu
  stage sim-cuda 120 python3 -m kvcanary_cupy sim --device cuda --steps 400 --quiet --json "$OUT/sim-cuda.json" --plot "$OUT/sim-cuda.png"
  stage sim-cuda-transfer 120 python3 -m kvcanary_cupy sim --device cuda --steps 200 --faults transfer --transfer-digest full \
    --quiet --json "$OUT/sim-cuda-transfer.json" --plot ""
fi
if [ "$what" = all ] || [ "$what" = bench ]; then
  stage bench "${BENCH_S:-240}" python3 -m kvcanary_cupy bench --out "$OUT/bench.txt" --json "$OUT/bench.json"
  stage bench-session 60 python3 benchmarks/bench_session.py --out "$OUT/bench-session.txt"
  stage bench-digest 120 python3 benchmarks/bench_digest.py --out "$OUT/bench-digest.txt"
  ngpu=$(python3 -c "import torch; print(torch.cuda.device_count())" 2>/dev/null || echo 1)
  # --profile: rank 0's cProfile of the NCCL end_step on the step's thread (12 functions by own and by cumulative time, shown by TAIL=50)
  TAIL=50 stage bench-distributed 120 python3 benchmarks/bench_distributed.py --backend nccl --world "$(( ngpu >= 2 ? 2 : 1 ))" --workloads W3,W1 --profile
  if [ "$ngpu" -ge 2 ]; then  # issue 26: the digest's share of a GPU -> GPU send of the same request
    stage bench-transfer 120 python3 benchmarks/bench_transfer.py --backend nccl
  fi
fi
exit $status
