"""The benchmark from a source checkout: the same as ``kvcanary bench`` (see kvcanary_cupy/devtools/bench/).

    python benchmarks/bench_canary.py [--backend cupy|numpy] [--workloads W1,W2,W3,W4]
                                      [--sections ops,tables,capacity,host] [--out FILE] [--json FILE]
"""

import sys

from kvcanary_cupy.devtools.bench import main

if __name__ == "__main__":
    sys.exit(main())
