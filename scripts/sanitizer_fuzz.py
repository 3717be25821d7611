"""A fuzz subset for compute-sanitizer: random steps (a third with out-of-range values) on CuPy,
each compared with NumPy, then a whole step captured in a CUDA graph and replayed with new batch
contents (both plan paths).  CuPy's memory pool is turned off so every array is its own
cudaMalloc and memcheck sees any access past it.

    compute-sanitizer --tool memcheck --error-exitcode 1 python3 scripts/sanitizer_fuzz.py --cases 40
"""

import argparse
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))

import cupy  # noqa: E402

from conftest import get_backend_or_skip  # noqa: E402
from fuzz_cases import assert_same, make_case, run_case  # noqa: E402
from test_gpu_graphs import SHAPES, _prepare, assert_snapshots_equal  # noqa: E402


def replay_graphs(cupy_ab) -> int:
    """Capture one step per plan path in a cupy.cuda.Graph and replay it over changing batches."""
    replays = 0
    for shape in sorted(SHAPES):
        steps, want, engine = _prepare(cupy_ab, shape)
        stream = cupy.cuda.Stream(non_blocking=True)
        with stream:
            engine.fill(steps[0])
            stream.begin_capture()
            engine.step()
            graph = stream.end_capture()
            for inputs, expected in zip(steps, want):
                engine.fill(inputs)
                graph.launch(stream)
                stream.synchronize()
                assert_snapshots_equal(engine.snapshot(), expected)
                replays += 1
    return replays


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--cases", type=int, default=40)
    parser.add_argument("--first", type=int, default=5000)
    args = parser.parse_args()
    cupy.cuda.set_allocator(None)
    numpy_ab, cupy_ab = get_backend_or_skip("numpy"), get_backend_or_skip("cupy")
    injected = 0
    for seed in range(args.first, args.first + args.cases):
        case = make_case(seed)
        ref = run_case(numpy_ab, case)
        assert_same(ref, run_case(cupy_ab, case), context=f"seed {seed}")
        last = ref["snapshots"][-1]
        injected += int(last["vp.out_of_range_count"][0] + last["log.out_of_range_counters"].sum() > 0)
    replays = replay_graphs(cupy_ab)
    cupy.cuda.Device().synchronize()
    print(f"sanitizer fuzz: {args.cases} cases passed, {injected} with out-of-range values; "
          f"{replays} graph replays matched NumPy")


if __name__ == "__main__":
    main()
