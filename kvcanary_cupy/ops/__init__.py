"""The public operations: plan, write, verify, plan_and_verify, scatter_req_token_ids, move_pages and copy_pages.

Each one validates every argument (shapes, dtypes, devices, capacities: no device sync), views
the caller's arrays without copying, picks the backend from the arrays' device (NumPy on the
CPU, CUDA kernels through CuPy on the GPU) and launches on the caller's stream.  A rejected
call changes nothing.  ``strict=True`` adds host-side checks of the values (a device sync).
"""

from .canary import verify, write
from .planning import plan, plan_and_verify
from .pool import copy_pages, move_pages, scatter_req_token_ids

__all__ = ["copy_pages", "move_pages", "plan", "plan_and_verify", "scatter_req_token_ids", "verify", "write"]
