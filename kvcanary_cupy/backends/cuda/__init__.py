"""The GPU side's parts, one concern per module: ``device`` (every query of the device) and
``launch`` (launches that overlap the work before them).  ``backends/cupy_backend.py`` builds the
kernels' launches on them."""
