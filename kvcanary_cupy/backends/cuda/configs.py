"""The launch policy: which kernels a call launches and with what grid, from host-known shapes only.

Every choice that depends on a batch's size or the device lives here, so that a grid can be tuned
without touching the launch code.  The thresholds a test or a script may move to force a code path
are fields of one frozen :class:`LaunchPolicy`; :func:`overridden` swaps it for the duration of a
block (nothing else patches this module).  docs/design-notes.md keeps the measurements behind the
defaults.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
from typing import NamedTuple

import numpy as np

from ...args import TableView
from ...plans import SCAN_STATE_TILES
from ...tables import TableKind
from ...validation import INT32_MAX, INT32_MIN
from . import device as cuda_device
from .abi import (PLAN_SMALL_MAX_ROWS, PLAN_THREADS, PLAN_VERIFY_BLOCKS_PER_SM, SCAN_ROWS_PER_LANE, SCATTER_MAX_GROUP_ROWS,
                  TABLE_NARROW, THREADS, WRITE_THREADS, TableLayout, plan_verify_one_block)
from .compile import get_function, kernel_name, plan_family, step_family


class LaunchConfig(NamedTuple):
    """A kernel launch's shape: a 1-D grid (2-D where ``grid_y > 1``) of 1-D blocks."""

    grid: int
    block: int
    shared_mem: int = 0  # dynamic shared memory, bytes
    grid_y: int = 1

    def grid_dims(self) -> tuple:
        """The grid as a CuPy launch takes it."""
        return (self.grid,) if self.grid_y == 1 else (self.grid, self.grid_y)


@dataclasses.dataclass(frozen=True)
class LaunchPolicy:
    """The thresholds the launch choices read; a field left None asks the device."""

    #: A batch of up to this many requests plans in plan_small (at most the kernel's kPlanSmallRows).
    plan_small_max_rows: int = PLAN_SMALL_MAX_ROWS
    #: ... else up to this many plan in one launch (plan_fused); more take plan_offsets + plan_entries.
    plan_fused_max_rows: int = 4096
    #: A two-launch plan of at least this many requests exchanges its blocks' totals through the
    #: WritePlan's scan state instead of each block reading every row before its share.
    plan_scan_state_min_rows: int = 2_000
    #: plan_verify runs PLAN_VERIFY_BLOCKS_PER_SM blocks per SM from this many verify entries per
    #: request: its check is latency-bound and gains from the warps, but every block scans every row.
    plan_verify_packed_min_entries_per_row: int = 1024
    #: The rows of one scan tile (None: as many as a block's opt-in shared memory holds).
    scan_tile_rows: int | None = None
    #: The blocks of a one-launch plan (None: :func:`plan_one_launch_blocks`'s count).
    one_launch_blocks: int | None = None
    #: Blocks of one kernel an SM holds at once (None: CUDA's occupancy calculator).
    resident_blocks: int | None = None


_policy = LaunchPolicy()


def policy() -> LaunchPolicy:
    """The policy in force."""
    return _policy


@contextlib.contextmanager
def overridden(**changes):
    """Within the block, launches follow the policy with ``changes`` (fields of :class:`LaunchPolicy`):
    how tests and the sanitizer force a code path.  Launchers bound inside keep the kernels they chose."""
    global _policy
    saved = _policy
    _policy = dataclasses.replace(saved, **changes)
    try:
        yield _policy
    finally:
        _policy = saved


PLAN_SCAN_RESERVED_SMEM = 2048  # bytes of a scan block's shared memory kept for its static arrays
WRITE_SCHEDULERS_PER_SM = 4  # warp schedulers of an SM (sm_80, sm_90)
BLOCKS_PER_SM = 8  # scatter groups and page moves (not persistent grids)
ATTRIBUTE_BLOCKS_PER_SM = 2  # the attribution grid: small, since it usually exits at once
INT64_MAX = 2**63 - 1
POSITION_BITS = 62  # positions and virtual token ids divided by the page size are below 2**62


def sm_count() -> int:
    """The SMs of CuPy's current device."""
    return cuda_device.sm_count(cuda_device.current_id())


def resident_blocks_per_sm(family: str, name: str, block: int) -> int:
    """Blocks of ``block`` threads of one compiled kernel that one SM of the current device holds
    at once (CUDA's occupancy calculator over its registers and shared memory), asked once per
    loaded kernel."""
    if _policy.resident_blocks is not None:
        return _policy.resident_blocks
    fn = get_function(family, name)
    key = ("occupancy", fn, block)
    found = cuda_device.cache.get(key)
    if found is None:
        found = cuda_device.cache[key] = max(1, cuda_device.max_active_blocks_per_sm(fn, block))
    return found


def persistent_config(family: str, name: str, block: int = THREADS) -> LaunchConfig:
    """A grid of as many blocks as are resident at once, so it runs in one wave (a larger grid
    leaves its last blocks to start after the first ones finish); the kernels loop over a count
    read on the device."""
    return LaunchConfig(sm_count() * resident_blocks_per_sm(family, name, block), block)


def plan_scan_max_rows(device_id: int) -> int:
    """The most rows one scan tile holds: a block's opt-in shared memory, less the static arrays,
    at a verify and a write offset (int64) per row plus their ends."""
    forced = _policy.scan_tile_rows
    return (cuda_device.shared_mem_optin(device_id) - PLAN_SCAN_RESERVED_SMEM) // 16 - 1 if forced is None else forced


def plan_scan_config(rows: int, blocks: int | None = None) -> LaunchConfig:
    """``blocks`` (default: one per SM) of PLAN_THREADS, with the scan's shared arrays for ``rows``
    rows as dynamic shared memory (the kernel reads its tile size from it).  Past 48 KiB this
    relies on the kernel's opt-in, made as it was loaded (compile.LARGE_SHARED_MEM_KERNELS)."""
    return LaunchConfig(blocks or sm_count(), PLAN_THREADS, (rows + 1) * 16)


def plan_one_launch_blocks(verify_capacity: int, spare: int = 0, per_sm: int = 1) -> int:
    """Blocks of a one-launch plan: enough for a warp per 32 entries of the verify capacity, plus
    ``spare`` (plan_small's last block writes the per-request outputs beside the expansion), at
    least one and at most ``per_sm`` per SM (one wave).  The expansion gives each warp at least 32
    entries, so more blocks would only repeat the scan."""
    if _policy.one_launch_blocks is not None:
        return _policy.one_launch_blocks
    per_block = PLAN_THREADS  # 32 entries for each of its PLAN_THREADS // 32 warps
    return max(1, min(per_sm * sm_count(), -(-verify_capacity // per_block) + spare))


def write_kernel(num_targets: int, input_assert: bool, real_kv: bool) -> str:
    return kernel_name("canary_write", num_targets, input_assert, real_kv)


def write_config(name: str, write_req_capacity: int, num_buffers: int) -> LaunchConfig:
    """Per canary buffer, a warp per request up to one per SM scheduler (a prefill's requests
    each get a warp of their own), then a warp per 32 requests (a lane each), at most the
    resident warps; each buffer has warps of its own (write.cu)."""
    full = persistent_config("write", name, WRITE_THREADS)
    warps_per_block = WRITE_THREADS // 32
    spread = sm_count() * WRITE_SCHEDULERS_PER_SM
    per_buffer = min(write_req_capacity, max(-(-write_req_capacity // 32), spread))
    warps = max(num_buffers, min(max(1, per_buffer) * num_buffers, full.grid * warps_per_block))
    return LaunchConfig(-(-warps // warps_per_block), WRITE_THREADS)


def uses_scan_state() -> bool:
    """Whether a plan hands its blocks the WritePlan's scan state: it has a tile per plan_offsets block."""
    return sm_count() <= SCAN_STATE_TILES


def page_division(page_size: int) -> tuple[int, int, int]:
    """``(shift, magic, magic_shift)`` dividing a value in ``[0, 2**62)`` by ``page_size`` on the
    device without a division: ``value >> shift`` for a power of two (``shift >= 0``), else
    ``umulhi(value, magic) >> magic_shift`` with ``magic = ceil(2**(62 + l) / page_size)``,
    ``l = ceil(log2(page_size))`` (Granlund and Montgomery, 1994: exact for dividends below 2**62)."""
    if page_size & (page_size - 1) == 0:
        return page_size.bit_length() - 1, 0, 0
    bits = page_size.bit_length()  # page_size is no power of two: ceil(log2(page_size)), >= 2
    return -1, -(-(1 << (POSITION_BITS + bits)) // page_size), POSITION_BITS + bits - 64


@functools.lru_cache(maxsize=256)
def table_fields(page_size: int, null_block: int, cols: int, stride: int, entries_int64: bool, kv_indptr_int64: bool,
                 num_virtual_pages: int) -> tuple:
    """The PLAN_INPUTS fields a table sets besides its addresses and row count, as ``(name, value)``
    pairs (a bound planner writes them again only when they change)."""
    shift, magic, magic_shift = page_division(page_size)
    return (("table_cols", cols), ("table_stride", stride), ("page_size", page_size), ("page_shift", shift),
            ("page_magic", magic), ("page_magic_shift", magic_shift), ("page_id_limit", INT64_MAX // page_size),
            ("null_block", null_block), ("num_virtual_pages", num_virtual_pages), ("table_is_int64", int(entries_int64)),
            ("kv_indptr_is_int64", int(kv_indptr_int64)))


def narrow_layout(kind: int, page_size: int, null_block: int, entries_int64: bool, kv_indptr_int64: bool) -> tuple[int, int]:
    """``(max_row_tokens, layout)``: a table of ``kind`` plans through its narrow layout
    (abi.TableLayout) when its rows hold at most max_row_tokens tokens: 2**31 - 1 for a block table
    of int32 ids with a power-of-two block size and an int32 null block, or a page table of int32
    kv_indptr and kv_indices with a power-of-two page size; -1 (never) for any other table."""
    if entries_int64 or page_size & (page_size - 1):
        return -1, kind
    if kind == TableKind.BLOCK and INT32_MIN <= null_block <= INT32_MAX or kind == TableKind.PAGED_KV and not kv_indptr_int64:
        return INT32_MAX, TableLayout(kind | TABLE_NARROW)
    return -1, kind


def table_layout(kind: int, row_tokens: int, page_size: int, null_block: int, entries_int64: bool,
                 kv_indptr_int64: bool) -> int:
    """The layout the plan kernels read a table of ``kind`` in (abi.TableLayout, kTable): its
    :func:`narrow_layout` when ``row_tokens``, which bounds every row's length in tokens (a block
    table's width, a page table's kv_indices length, times the page size), is within its limit;
    else the kind's general one.  (A bound planner keeps narrow_layout per table shape.)"""
    max_row_tokens, narrow = narrow_layout(kind, page_size, null_block, entries_int64, kv_indptr_int64)
    return narrow if row_tokens <= max_row_tokens else kind


def view_layout(t: TableView) -> int:
    """:func:`table_layout` of a table's views."""
    return table_layout(t.kind, t.row_tokens, t.page_size, t.null_block, t.entries.dtype == np.int64,
                        t.kv_indptr is not None and t.kv_indptr.dtype == np.int64)


def plan_fused_scan_rows(bs: int) -> int:
    """plan_fused's kScanRows for ``bs`` requests: past 64 rows a warp the scan's blocked passes (a
    lane summing up to SCAN_ROWS_PER_LANE consecutive rows under one warp scan), up to that the
    strided passes alone, whose kernel is faster for small batches."""
    return SCAN_ROWS_PER_LANE if bs > PLAN_THREADS // 32 * 64 else 1


def plan_kernels(layout: int, bs: int, verify_capacity: int, has_lut: bool, has_pool: bool) -> tuple:
    """``(family, kernel name, LaunchConfig)`` of each launch of a plan of ``bs`` requests through a
    table of ``layout`` (:func:`table_layout`; a TableKind is its general layout), in order."""
    family, template_args = plan_family(layout), (int(layout), has_lut, has_pool)
    if bs <= _policy.plan_small_max_rows:
        name = kernel_name("plan_small", *template_args)
        return ((family, name, LaunchConfig(plan_one_launch_blocks(verify_capacity, spare=int(verify_capacity > 0)), PLAN_THREADS)),)
    if bs <= _policy.plan_fused_max_rows:
        name = kernel_name("plan_fused", *template_args, plan_fused_scan_rows(bs))
        return ((family, name, plan_scan_config(bs, plan_one_launch_blocks(verify_capacity))),)
    name = kernel_name("plan_offsets", *template_args)
    device = cuda_device.current_id()
    tile_rows = min(-(-bs // cuda_device.sm_count(device)), plan_scan_max_rows(device))
    offsets = (family, name, plan_scan_config(tile_rows))
    if verify_capacity == 0:  # a zero-capacity plan expands nothing
        return (offsets,)
    name = kernel_name("plan_entries", *template_args)
    return offsets, (family, name, persistent_config(family, name))


def plan_verify_stores_entries(bs: int) -> bool:
    """Whether plan_and_verify of ``bs`` requests stores its verify entries: a batch past one plan
    launch (``plan_fused_max_rows``) takes plan + verify through the VerifyPlan's entry arrays; a
    smaller one plans and verifies in one launch (plan_verify) and stores none."""
    return bs > _policy.plan_fused_max_rows


def plan_verify_blocks_per_sm(bs: int, verify_capacity: int, one_block: bool = False) -> int:
    """plan_verify's most blocks per SM for ``bs`` requests and ``verify_capacity`` entries
    (``plan_verify_packed_min_entries_per_row``); ``one_block``: the variant's launch bounds allow
    one (:func:`abi.plan_verify_one_block`)."""
    packed = verify_capacity >= _policy.plan_verify_packed_min_entries_per_row * max(bs, 1)
    return PLAN_VERIFY_BLOCKS_PER_SM if packed and not one_block else 1


def plan_verify_kernel(layout: int, bs: int, verify_capacity: int, has_lut: bool, has_pool: bool, check_token: bool,
                       real_kv: bool) -> tuple:
    """``(family, kernel name, LaunchConfig)`` of the fused plan + verify of ``bs`` requests through
    a table of ``layout`` (a batch that does not :func:`plan_verify_stores_entries`): plan_fused's
    configuration (its scan and expansion, with a grid sized by the verify capacity), up to
    :func:`plan_verify_blocks_per_sm` blocks per SM."""
    family = step_family(layout)
    name = kernel_name("plan_verify", int(layout), has_lut, has_pool, check_token, real_kv)
    one_block = plan_verify_one_block(int(layout), has_lut, has_pool, check_token, real_kv)
    blocks = plan_one_launch_blocks(verify_capacity, per_sm=plan_verify_blocks_per_sm(bs, verify_capacity, one_block))
    return family, name, plan_scan_config(bs, blocks)


def scatter_config(bs: int) -> tuple[LaunchConfig, int]:
    """``(launch, rows per group)``: a group per block while the batch fits the device, then
    groups of up to SCATTER_MAX_GROUP_ROWS rows so one scan of the later rows serves many."""
    blocks = sm_count() * BLOCKS_PER_SM
    group_rows = max(1, min(SCATTER_MAX_GROUP_ROWS, -(-bs // blocks)))
    return LaunchConfig(max(1, min(blocks, -(-bs // group_rows))), THREADS), group_rows


def move_config(pairs: int, page_elems: int) -> LaunchConfig:
    """A thread per element of the moved pages, at most BLOCKS_PER_SM blocks per SM."""
    return LaunchConfig(min(-(-pairs * page_elems // THREADS), sm_count() * BLOCKS_PER_SM), THREADS)


def attribute_grid(device_id: int) -> int:
    """session_attribute's blocks (it usually exits at once)."""
    return cuda_device.sm_count(device_id) * ATTRIBUTE_BLOCKS_PER_SM
