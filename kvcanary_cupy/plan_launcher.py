"""The bound plan of a :class:`~kvcanary_cupy.CanaryPlanner`: its output buffers, capacities and
SWA settings bound once, every engine table taken in its common case (see :mod:`kvcanary_cupy.launchers`)."""

from __future__ import annotations

from . import binding, interop
from .args import PlanArgs, PlanOutputs, TableView
from .backends import get_backend
from .bound import BoundState, bound_words, full_validation_forced, viewed_in_place
from .interop import array_module, backend_view, common_placement, import_cupy
from .plans import is_clean, mark_clean, scan_state
from .runtime import launch_stream
from .tables import MAX_TABLE_TOKENS, BlockTable, PagedKvIndices, ReqToToken, TableKind
from .validation import check_count, check_int64


class _BoundPlan(BoundState):
    """A planner's bound plan: its capacities and SWA settings, the setters of its per-step fields,
    the table fields last written (``table_shape``, ``table_kind``) with what they decide of the
    layout (``narrow_row_tokens``, ``narrow_layout``: configs.narrow_layout), and the launches of
    each ``(layout, bs, has_pool)`` seen."""

    __slots__ = ("verify_capacity", "write_req_capacity", "window", "has_lut", "set_inputs", "set_optional", "table_shape",
                 "table_kind", "narrow_row_tokens", "narrow_layout", "kernels")


_REQ_TO_TOKEN, _VIRTUAL_PAGES, _BLOCK, _PAGED_KV = (TableKind.REQ_TO_TOKEN, TableKind.VIRTUAL_PAGES, TableKind.BLOCK,
                                                   TableKind.PAGED_KV)  # an enum member read costs ~0.1 us


def _step_table(arrays, table, bs_rows: int):
    """The table of one call, common case only, as ``(kind, entries, kv_indptr, virtual_to_physical,
    rows, pool_rows, row_tokens, shape)``: its kind (tables.TableKind), its arrays as the backend
    takes them, its rows (of entries), the expected-token pool rows a plan may index, the bound of
    its rows' lengths in tokens (configs.table_layout) and ``shape``, the arguments of
    :func:`configs.table_fields` (what changes only when the table's layout does; page size and
    null block first).  None when it is not the common case.

    ``bs_rows`` is the batch size for a table whose rows are the batch rows (PagedKvIndices)."""
    cls = type(table)
    if cls is BlockTable:
        entries = arrays.table(table.block_table, True)
        if entries is None:
            return None
        entries, rows, cols, stride, wide = entries
        tokens = cols * table.block_size
        if tokens > MAX_TABLE_TOKENS:
            return None
        shape = (table.block_size, table.null_block, cols, stride, wide, False, 0)
        return _BLOCK, entries, None, None, rows, rows, tokens, shape
    if cls is PagedKvIndices:
        indptr, indices = arrays.indices(table.kv_indptr, bs_rows + 1), arrays.indices(table.kv_indices, -1)
        if indptr is None or indices is None:
            return None
        (kv_indptr, _, indptr_wide), (entries, rows, wide) = indptr, indices
        tokens = rows * table.page_size
        if tokens > MAX_TABLE_TOKENS:
            return None
        return _PAGED_KV, entries, kv_indptr, None, rows, bs_rows, tokens, (table.page_size, 0, 0, 0, wide, indptr_wide, 0)
    if cls is ReqToToken:
        entries, v2p = arrays.table(table.req_to_token), table.virtual_to_physical
    else:  # a bare req_to_token
        entries, v2p = arrays.table(table), None
    if entries is None:
        return None
    entries, rows, cols, stride, _ = entries
    if v2p is None:  # a req_to_token row holds a token per column
        return _REQ_TO_TOKEN, entries, None, None, rows, rows, cols, (1, 0, cols, stride, False, False, 0)
    pages = arrays.leading(v2p)
    if pages is None:
        return None
    v2p, num_pages = pages
    if num_pages < 1:
        return None
    return _VIRTUAL_PAGES, entries, None, v2p, rows, rows, cols, (table.page_size, 0, cols, stride, False, False, num_pages)


class PlanLauncher:
    """The plan of a :class:`~kvcanary_cupy.CanaryPlanner`: its output buffers, capacities and SWA
    settings bound once.  ``launcher(...)`` plans into the buffers and returns True, or returns
    False (nothing done) when the inputs are not the common case or nothing could be bound: the
    planner then takes the free function.  Every table kind is taken: a bare req_to_token,
    :class:`~kvcanary_cupy.ReqToToken` (virtual pages too), :class:`~kvcanary_cupy.BlockTable` and
    :class:`~kvcanary_cupy.PagedKvIndices`."""

    def __init__(self, verify_plan, write_plan, *, verify_capacity, write_req_capacity, swa_window_size,
                 full_to_swa_index_mapping, kv_token_id_vs_position_offset):
        self.verify_plan, self.write_plan = verify_plan, write_plan
        self.settings = (verify_capacity, write_req_capacity, swa_window_size, full_to_swa_index_mapping,
                         kv_token_id_vs_position_offset)
        self._full = full_validation_forced()
        self._bind()

    def __repr__(self) -> str:
        vcap, wcap, window, lut, offset = self.settings
        where = interop.placement_of(self.verify_plan.verify_slot_indices, "verify_plan").describe()
        lut_words = "none" if lut is None else "x".join(map(str, tuple(lut.shape)))
        return (f"<PlanLauncher verify_capacity={vcap}, write_req_capacity={wcap} on {where}, "
                f"swa_window_size={window}, full_to_swa_index_mapping={lut_words}, "
                f"kv_token_id_vs_position_offset={offset}; {bound_words(self)}>")

    def _bind(self) -> None:
        """Bind, or leave nothing bound when the free function must decide (e.g. a LUT on another device)."""
        self._bound = None
        vcap, wcap, window, lut, offset = self.settings
        if self._full or not viewed_in_place([lut]):
            return
        try:
            window = check_int64(window, "swa_window_size", minimum=0)
            offset = check_int64(offset, "kv_token_id_vs_position_offset")
            vcap, wcap = check_count(vcap, "verify_capacity"), check_count(wcap, "write_req_capacity")
            named = {**binding.record_arrays("out[0]", self.verify_plan), **binding.record_arrays("out[1]", self.write_plan),
                     "full_to_swa_index_mapping": lut}
            placement = common_placement(named)
            xp = array_module(placement)
            with launch_stream(placement):
                lut_view = None if lut is None else binding.lut_view(backend_view(lut, "full_to_swa_index_mapping"), xp)
                outs = binding.plan_views("out[0]", self.verify_plan, vcap, writable=True) | binding.plan_views(
                    "out[1]", self.write_plan, wcap, writable=True)
        except (TypeError, ValueError):
            return
        state = backend_view(scan_state(self.write_plan), "write_plan's scan state", writable=True)
        args = PlanArgs(None, None, None, None, window, lut_view, None, None, offset, False, PlanOutputs(**outs), state)
        b = _BoundPlan(placement, named)
        b.verify_capacity, b.write_req_capacity, b.window, b.has_lut = vcap, wcap, window, lut is not None
        if b.numpy:
            b.args = args
        else:
            b.pack(b.gpu.plan_params(args))
            b.set_inputs = b.setter(*(f"inputs.{k}" for k in ("req_pool_indices", "prefix_lens", "extend_seq_lens", "bs", "table",
                                                       "table_rows")), "outputs.clear_whole_capacity")
            # what only some tables (kv_indptr, virtual_to_physical) and expected tokens use
            b.set_optional = b.optional_setter(*(f"inputs.{k}" for k in (
                "kv_indptr", "virtual_to_physical", "pool", "pool_stride", "pool_cols", "valid_lens")))
            b.table_shape = b.table_kind = None  # the table_fields last written, and the table's kind
            b.narrow_row_tokens, b.narrow_layout = -1, None  # configs.narrow_layout of that shape
            b.kernels = {}  # (layout, bs, has_pool) -> ((function, grid, block, shared_mem), ...)
        self._bound = b

    @staticmethod
    def _kernels(b, key: tuple) -> tuple:
        """The launches of ``key`` = ``(layout, bs, has_pool)``, looked up once (the call reads ``b.kernels`` first)."""
        if len(b.kernels) > 4096:
            b.kernels.clear()
        layout, bs, has_pool = key
        with import_cupy().cuda.Device(b.device):  # grids are sized from the bound device's SM count
            kernels = b.kernels[key] = tuple(
                (b.function(family, name), (config.grid,), (config.block,), config.shared_mem)
                for family, name, config in b.gpu.plan_kernels(layout, bs, b.verify_capacity, b.has_lut, has_pool))
        return kernels

    @staticmethod
    def _write_table_shape(b, kind, shape: tuple) -> None:
        """Writes the table fields of ``shape`` and keeps the part of the layout choice that they decide."""
        for name, value in b.gpu.table_fields(*shape):
            view, index = b.param_slots(f"inputs.{name}")
            view[index] = value
        page_size, null_block, _, _, entries_int64, kv_indptr_int64, _ = shape
        b.narrow_row_tokens, b.narrow_layout = b.gpu.narrow_layout(kind, page_size, null_block, entries_int64, kv_indptr_int64)
        b.table_shape, b.table_kind = shape, kind

    def __call__(self, req_pool_indices, prefix_lens, extend_seq_lens, table,
                 req_to_verify_expected_tokens=None, req_to_verify_expected_tokens_valid_lens=None) -> bool:
        b = self._bound
        if b is not None and b.tensors and b.moved():
            self._bind()
            b = self._bound
        if b is None:
            return False
        arrays = b.arrays
        if req_pool_indices is None:  # only a PagedKvIndices table, whose rows are the batch rows
            if type(table) is not PagedKvIndices:
                return False
            leading = arrays.leading(prefix_lens)
            if leading is None:
                return False
            rp = None
            _, bs = leading
        else:
            leading = arrays.leading(req_pool_indices)
            if leading is None or type(table) is PagedKvIndices:
                return False
            rp, bs = leading
        prefix, extend = arrays.vector(prefix_lens, bs), arrays.vector(extend_seq_lens, bs)
        t = _step_table(arrays, table, bs)
        if prefix is None or extend is None or t is None or bs > b.write_req_capacity:
            return False
        kind, entries, kv_indptr, v2p, rows, pool_rows, row_tokens, shape = t
        if b.window > 0 and not b.has_lut and kind in (_REQ_TO_TOKEN, _VIRTUAL_PAGES):
            return False
        if req_to_verify_expected_tokens is None:
            if req_to_verify_expected_tokens_valid_lens is not None:
                return False
            pool = lens = None
            pool_cols = pool_stride = 0
        else:
            found = arrays.table(req_to_verify_expected_tokens)
            lens = arrays.vector(req_to_verify_expected_tokens_valid_lens, bs)
            if found is None or lens is None:
                return False
            pool, rows_in_pool, pool_cols, pool_stride, _ = found
            if rows_in_pool < pool_rows:
                return False
        wp = self.write_plan
        clear = not is_clean(wp)
        if b.numpy:
            page_size, null_block, _, _, _, _, _ = shape
            view = TableView(kind, entries, kv_indptr, v2p, page_size, null_block, pool_rows, "", row_tokens)
            get_backend("numpy").plan(b.args._replace(
                req_pool_indices=rp, prefix_lens=prefix, extend_seq_lens=extend, table=view,
                expected_token_pool=pool, expected_token_valid_lens=lens, clear_whole_capacity=clear))
        else:
            if shape != b.table_shape or kind is not b.table_kind:
                self._write_table_shape(b, kind, shape)
            b.set_inputs((rp or 0, prefix, extend, bs, entries, rows, clear))
            b.set_optional(None if kv_indptr is None and v2p is None and lens is None else
                           (kv_indptr or 0, v2p or 0, pool or 0, pool_stride, pool_cols, lens or 0))
            key = (b.narrow_layout if row_tokens <= b.narrow_row_tokens else kind, bs, lens is not None)  # table_layout
            for fn, grid, block, shared_mem in b.kernels.get(key) or self._kernels(b, key):
                b.launch(fn, grid, block, shared_mem)
        if clear:
            mark_clean(wp)
        return True
