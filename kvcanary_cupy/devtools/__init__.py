"""Developer tooling: kernel ABI and compile checks, the fake CuPy device, ``kvcanary bench``.

Nothing here is imported by ``import kvcanary_cupy``; the ``kvcanary bench`` command, the tests,
``scripts/`` and ``benchmarks/`` import it when they need it.
"""
