"""CUDA C sources of kvcanary-cupy, shipped as package data (see kvcanary_cupy/jit.py)."""
