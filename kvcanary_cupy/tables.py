"""The engine tables a plan reads a request's KV slots from.

``plan`` and ``CanaryPlanner.plan`` take any of these as ``table`` (a bare 2-D int32 array means
``ReqToToken(array)``).  Each maps (request, position p) to a KV slot, the index of the canary row:

- :class:`ReqToToken` (SGLang): ``slot = req_to_token[row, p]``; row 0 is the CUDA-graph padding
  row.  With ``virtual_to_physical`` (SGLang's unified pool) the table holds virtual token ids
  ``t`` and ``slot = v2p[t // page_size] * page_size + t % page_size``.
- :class:`BlockTable` (vLLM): ``slot = block_table[row, p // block_size] * block_size + p % block_size``.
- :class:`PagedKvIndices` (FlashInfer CSR): request r (the batch row) owns pages
  ``kv_indices[kv_indptr[r]:kv_indptr[r+1]]``, ``slot = page * page_size + p % page_size``.

The records check their scalars when built; their arrays are checked by the plan that reads them.
Slot arithmetic is int64, saturated into ``[-(2**63 - 1), 2**63 - 1]``.
"""

from __future__ import annotations

import enum
from dataclasses import KW_ONLY, dataclass, fields, replace
from typing import Any

import numpy as np

from .args import TableView
from .errors import fail
from .validation import INT32_MAX, check_1d, check_2d_rows, check_int, check_integer_dtype, contiguous_input, require

MAX_TABLE_TOKENS = 2**62  # bound of a row's length in tokens: positions and slots stay far from overflow


class TableKind(enum.IntEnum):
    """A table's kind; its value is the kTable of its general layout in kernels/plan.cu (some block
    and page tables take a narrow one: kvcanary_cupy.backends.cuda.abi.TableLayout)."""

    REQ_TO_TOKEN = 0
    VIRTUAL_PAGES = 1
    BLOCK = 2
    PAGED_KV = 3


def _check_size(value, name: str) -> int:
    value = check_int(value, name, minimum=1)
    if value > INT32_MAX:
        fail(ValueError, f"{name} must be at most {INT32_MAX}, got {value}")
    return value


class _Table:
    def arrays(self) -> dict[str, Any]:
        """The table's arrays by argument name (None when not given)."""
        return {f.name: getattr(self, f.name) for f in fields(self) if f.name in self.ARRAYS}

    def with_arrays(self, convert):
        """The same table with every array replaced by ``convert(array, its argument name)``."""
        return replace(self, **{k: convert(v, k) for k, v in self.arrays().items()})


@dataclass(frozen=True)
class ReqToToken(_Table):
    """SGLang's ``req_to_token`` (int32 ``[R, L]``, rows contiguous, row 0 = padding row).

    ``req_to_token[rp, p]`` is the KV slot of position ``p`` of the request in pool row ``rp``;
    :func:`plan` indexes it with ``req_pool_indices``.  A bare int32 array passed as a table means
    ``ReqToToken(array)``.

    Parameters
    ----------
    req_to_token : int32 array [R, L]
        Rows contiguous (any row stride); pool row 0 marks a CUDA-graph padding request and slot
        0 is the padding slot.
    virtual_to_physical : int64 array [num_virtual_pages + 1], optional
        When given, ``req_to_token`` holds virtual token ids, mapped through pages of
        ``page_size`` tokens; an unbound page (-1) addresses the padding slot 0.  Pass the map as
        it is *now*: after a compaction moves pages, move their canary rows with
        :func:`kvcanary_cupy.move_pages`.
    page_size : int
        Tokens per virtual page, ``>= 1``; only with ``virtual_to_physical``.

    Raises
    ------
    ValueError
        A ``page_size`` below 1, or other than 1 without ``virtual_to_physical``.

    Examples
    --------
    >>> table = kc.ReqToToken(np.arange(64, dtype=np.int32).reshape(4, 16))
    >>> vp, _ = kc.plan(np.array([2]), np.array([3]), np.array([1]), table, verify_capacity=8)
    >>> vp.verify_slot_indices[:3].tolist()
    [32, 33, 34]
    """

    ARRAYS = ("req_to_token", "virtual_to_physical")
    req_to_token: Any
    _: KW_ONLY
    virtual_to_physical: Any = None
    page_size: int = 1

    def __post_init__(self):
        require(self.req_to_token, "ReqToToken.req_to_token")
        _check_size(self.page_size, "ReqToToken.page_size")
        if self.virtual_to_physical is None and self.page_size != 1:
            fail(ValueError, f"ReqToToken.page_size={self.page_size} applies to virtual_to_physical, which is None; "
                             "pass the virtual-to-physical page map or leave page_size=1")

    @property
    def kind(self) -> TableKind:
        return TableKind.REQ_TO_TOKEN if self.virtual_to_physical is None else TableKind.VIRTUAL_PAGES


@dataclass(frozen=True)
class BlockTable(_Table):
    """vLLM's block table (int32 or int64 ``[R, W]``, rows contiguous): every row is real.

    Position ``p`` of the request in row ``r`` is slot ``block_table[r, p // block_size] *
    block_size + p % block_size``.

    Parameters
    ----------
    block_table : int32 or int64 array [R, W]
        Block ids per request row, rows contiguous; :func:`plan` indexes it with
        ``req_pool_indices`` (no padding row: every row is real).
    block_size : int
        Tokens per block, ``1 <= block_size < 2**31``.
    null_block : int
        An entry equal to it (vLLM's null block 0, what sliding-window groups point
        out-of-window blocks at) addresses the padding slot 0.

    Raises
    ------
    TypeError, ValueError
        A ``block_size`` out of range or a ``null_block`` that is not an int64.

    Examples
    --------
    >>> table = kc.BlockTable(np.array([[3, 1]], np.int32), block_size=4)
    >>> vp, _ = kc.plan(np.array([0]), np.array([6]), np.array([1]), table, verify_capacity=8)
    >>> vp.verify_slot_indices[:6].tolist()
    [12, 13, 14, 15, 4, 5]
    """

    ARRAYS = ("block_table",)
    block_table: Any
    block_size: int
    _: KW_ONLY
    null_block: int = 0

    def __post_init__(self):
        require(self.block_table, "BlockTable.block_table")
        _check_size(self.block_size, "BlockTable.block_size")
        null = check_int(self.null_block, "BlockTable.null_block")
        if not -(2**63) <= null < 2**63:
            fail(ValueError, f"BlockTable.null_block must fit int64, got {null}")

    kind = TableKind.BLOCK


@dataclass(frozen=True)
class PagedKvIndices(_Table):
    """FlashInfer's CSR page table.  Rows are batch rows: plan with ``req_pool_indices=None``.

    Batch row r owns pages ``kv_indices[kv_indptr[r]:kv_indptr[r+1]]``; its position ``p`` is
    slot ``page * page_size + p % page_size`` of its page ``p // page_size``.

    Parameters
    ----------
    kv_indptr : int32 or int64 array [bs + 1]
        Each batch row's range in ``kv_indices``.
    kv_indices : int32 or int64 array [nnz]
        Page ids.
    page_size : int
        Tokens per page, ``1 <= page_size < 2**31``.

    Raises
    ------
    TypeError, ValueError
        A ``page_size`` out of range.

    Examples
    --------
    >>> table = kc.PagedKvIndices(np.array([0, 2]), np.array([3, 1]), page_size=4)
    >>> vp, _ = kc.plan(None, np.array([6]), np.array([1]), table, verify_capacity=8)
    >>> vp.verify_slot_indices[:6].tolist()
    [12, 13, 14, 15, 4, 5]
    """

    ARRAYS = ("kv_indptr", "kv_indices")
    kv_indptr: Any
    kv_indices: Any
    page_size: int

    def __post_init__(self):
        require(self.kv_indptr, "PagedKvIndices.kv_indptr")
        require(self.kv_indices, "PagedKvIndices.kv_indices")
        _check_size(self.page_size, "PagedKvIndices.page_size")

    kind = TableKind.PAGED_KV


TABLE_TYPES = (ReqToToken, BlockTable, PagedKvIndices)


def as_table(table):
    """``table`` as one of the table records: a bare array means ``ReqToToken(table)``."""
    if isinstance(table, TABLE_TYPES):
        return table
    if hasattr(table, "shape") and hasattr(table, "dtype"):
        return ReqToToken(table)
    fail(TypeError, f"table must be a ReqToToken, BlockTable or PagedKvIndices (or a 2-D int32 req_to_token array), "
                    f"got {type(table).__module__}.{type(table).__name__}")


def _checked_tokens(what: str, num: int, size_name: str, size: int) -> int:
    """``num * size``, the bound of a row's length in tokens, checked: positions stay below 2**62
    (the kernels divide them by the page size with a multiply)."""
    if num * size > MAX_TABLE_TOKENS:
        fail(ValueError, f"{what} {num} x {size_name} {size} = {num * size} tokens exceeds 2**62")
    return num * size


def table_view(table, views: dict, bs: int, xp) -> TableView:
    """Checks the backend views of ``table``'s arrays (``views`` by argument name) for a batch of
    ``bs`` requests; returns them as the backends' :class:`~kvcanary_cupy.args.TableView`."""
    kind = table.kind
    if kind in (TableKind.REQ_TO_TOKEN, TableKind.VIRTUAL_PAGES):
        rtt = views["req_to_token"]
        check_2d_rows(rtt, "req_to_token", np.int32)
        v2p = views["virtual_to_physical"]
        if v2p is not None:
            check_1d(v2p, "virtual_to_physical", np.int64, min_length=1)
            v2p = contiguous_input(v2p, "virtual_to_physical", xp)
        return TableView(kind, rtt, None, v2p, table.page_size, null_block=0, pool_rows=rtt.shape[0],
                         pool_rows_why=f"req_to_token.shape[0]={rtt.shape[0]} rows (one per request pool row)",
                         row_tokens=rtt.shape[1])  # a token per column
    if kind == TableKind.BLOCK:
        bt = views["block_table"]
        check_integer_dtype(bt, "block_table")
        check_2d_rows(bt, "block_table", bt.dtype)
        tokens = _checked_tokens("block_table width", bt.shape[1], "block_size", table.block_size)
        return TableView(kind, bt, None, None, table.block_size, null_block=int(table.null_block), pool_rows=bt.shape[0],
                         pool_rows_why=f"block_table.shape[0]={bt.shape[0]} rows (one per block-table row)", row_tokens=tokens)
    indptr, indices = views["kv_indptr"], views["kv_indices"]
    for name, x in (("kv_indptr", indptr), ("kv_indices", indices)):
        check_integer_dtype(x, name)
    check_1d(indptr, "kv_indptr", indptr.dtype, bs + 1, length_name="bs + 1")
    check_1d(indices, "kv_indices", indices.dtype)
    tokens = _checked_tokens("kv_indices length", indices.shape[0], "page_size", table.page_size)
    return TableView(kind, contiguous_input(indices, "kv_indices", xp), contiguous_input(indptr, "kv_indptr", xp), None,
                     table.page_size, null_block=0, pool_rows=bs,
                     pool_rows_why=f"bs={bs} rows (one per batch row: the rows of a PagedKvIndices table)", row_tokens=tokens)
