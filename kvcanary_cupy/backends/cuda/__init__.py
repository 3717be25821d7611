"""The GPU side, one concern per module, each importing only those before it:

``abi`` (every C mirror) and ``device`` (every query of the device: the seam a fake device
replaces), ``compile`` (kernel families, NVRTC through CuPy, the loaded kernels), ``configs`` (the
launch policy: kernels and grids), ``params`` (parameter records, patched in place), ``launch``
(the overlapped-or-plain launch of a record) and ``ops`` (each op's launches: the face that
:func:`kvcanary_cupy.backends.get_backend` returns and the bound launchers use).
"""
