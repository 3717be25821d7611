"""CuPy and PyTorch are optional: the NumPy backend works without them, GPU features name the extra."""

import subprocess
import sys
import textwrap

import pytest

import kvcanary_cupy as kc
from kvcanary_cupy import interop

EXTRA_HINT = r"^kv-canary: this needs CuPy, which is not installed: install CuPy with `pip install kvcanary-cupy\[cu1[23]\]`"


def test_missing_cupy_names_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "cupy", None)  # `import cupy` now raises ImportError
    with pytest.raises(ImportError, match=EXTRA_HINT) as info:
        interop.import_cupy()
    assert "kvcanary-cupy[cu12]" in str(info.value) and "kvcanary-cupy[cu13]" in str(info.value)
    assert isinstance(info.value.__cause__, ImportError)
    with pytest.raises(ImportError, match=EXTRA_HINT):
        kc.warmup()


def test_numpy_step_without_cupy_or_torch():
    """In a fresh interpreter where neither can be imported: the package imports, a NumPy step runs
    and never imports them, and warmup() names the extra."""
    script = textwrap.dedent("""
        import sys
        sys.modules["cupy"] = None
        sys.modules["torch"] = None
        import numpy as np
        import kvcanary_cupy as kc

        rtt = np.arange(1, 33, dtype=np.int32).reshape(2, 16)
        vp, wp = kc.plan(np.array([1]), np.array([2]), np.array([1]), rtt, verify_capacity=4)
        canary = kc.allocate_canary_buffer(40)
        log = kc.ViolationLog.allocate(4)
        kc.verify(canary, vp, log=log)
        kc.write(canary, wp, np.array([5]), np.array([2]), np.array([19]), log=log)
        assert int(log.kernel_run_counters[0]) == 2
        # never-written prefix slots 17, 18: a chain-head and a position mismatch; the write at
        # position 2 after seed slot 18 (position 0): a chain-position mismatch
        assert [(v.slot_idx, v.fail_reason_bits) for v in log.read().violations] == [(17, 1), (18, 2), (19, 16)]
        try:
            kc.warmup()
        except ImportError as exc:
            print(exc)
        assert sys.modules["cupy"] is None and sys.modules["torch"] is None
    """)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert "pip install kvcanary-cupy[cu13]" in done.stdout
