"""A :class:`~kvcanary_cupy.CanarySession` over ``torch.distributed``: one canary per rank, one verdict.

Every rank keeps its own canary, planner and log.  Every ``reduce_every``-th ``end_step`` (and at
``check()``), each rank fills its own row of a ``[world_size, width]`` int64 buffer (its totals,
how many new violations and health problems it handled since the last reduction, its table shape
and, with ``replicated_kv``, a window of its TAIL real-KV fingerprints), leaves the other rows
zero and starts an asynchronous SUM all-reduce of it over the session's dedicated group: every
rank then holds every rank's row.  The row is built, reduced and decoded on one worker thread
per session (kvcanary_cupy/rank_worker.py): ``end_step`` only takes a snapshot of the session's
numbers and of the replicated window, records (on a GPU) an event on the step's stream that the
worker's side stream waits for, hands the job over and picks up the previous job's verdict.  The
next reduction (``reduce_every`` steps later, on every rank at the
same step count) reads the result and applies the verdict: when any rank found something, every
rank applies its policy on that same step, with a report naming the ranks.  Only a result still
in flight a whole reduction later is waited for (counted in ``stats["reduce_waits"]``): then a
peer is that far behind and the model's own collectives wait for it too.

Why a dedicated group: collectives on one group run in the order they were issued, so the
canary's all-reduce on the model's group would sit between the model's own collectives (and
serialise with their point-to-point transfers); a rank that issued one more or one less canary
collective than its peers would pair it with a model collective and hang or corrupt both.
docs/distributed.md explains the rest.
"""

from __future__ import annotations

import socket
import weakref
from functools import partial

import numpy as np

from .args import STAGE_HEADER_FIELDS
from .constants import CANARY_FIELD_REAL_KV_HASH, MAX_REAL_KV_SOURCES, FailReason
from .errors import CanaryUsageError, fail
from .hashing import to_unsigned
from .interop import backend_view
from .rank_exchange import DeviceExchange, HostExchange
from .rank_verdict import Verdict, _Contribution
from .rank_worker import ReductionWorker
from .reporting import ReplicaMismatch, ViolationReport, reason_name, tag_name

#: Slots of the TAIL canary compared across ranks per reduction (``replicated_kv=True``): the
#: window moves on by this much each reduction, so a pool of ``n`` slots is compared in full
#: every ``ceil(n / REPLICATED_WINDOW)`` reductions.
REPLICATED_WINDOW = 4096
#: Replicated-KV mismatches remembered (so that each is reported once); past this the oldest is forgotten.
MAX_SEEN_MISMATCHES = 65536
#: Each rank's totals in the reduction, summed into ``RankReducer.totals`` (names of ``session.stats``).
TOTALS = ("steps", "handled_steps", "verified_entries", "violations", "rows_read", "dropped_rows",
          "distinct_violations", "verify_skipped_steps", "verify_skipped_sweeps", "health_failures",
          "out_of_range_skipped", "sweeps", "staging_waits", "evicted_violations", "untracked_rows",
          "unattributed_entries")
_VERDICT = ("new_violations", "health_problems")
_SHAPE = ("table_rows", "table_cols")
_REASONS = tuple(reason_name(m) for m in FailReason)
#: Seconds a reduction may take beyond the group's own timeout before end_step/check stop waiting
#: for the worker thread with a TimeoutError (the collective itself raises at the group's timeout).
WAIT_MARGIN_S = 30.0


def import_torch_distributed():
    """``(torch, torch.distributed)``, or one ImportError line naming the extra."""
    try:
        import torch
        import torch.distributed as dist
    except ImportError as exc:
        raise ImportError("kv-canary: process_group needs torch.distributed: pip install kvcanary-cupy[torch]") from exc
    if not dist.is_available():
        raise ImportError("kv-canary: process_group needs torch.distributed, which this torch build lacks")
    return torch, dist


def device_id(placement) -> str:
    """The session's device as a fleet names it: ``GPU-<uuid> pci=<bus id>``, or ``cpu@<host>``."""
    if placement.backend == "numpy":
        return f"cpu@{socket.gethostname()}"
    from .interop import import_cupy

    props = import_cupy().cuda.runtime.getDeviceProperties(placement.device)
    pci = f"{props.get('pciDomainID', 0):04x}:{props.get('pciBusID', 0):02x}:{props.get('pciDeviceID', 0):02x}.0"
    raw = props.get("uuid", b"")
    if isinstance(raw, (bytes, bytearray)) and len(raw) == 16:
        h = raw.hex()
        return f"GPU-{h[:8]}-{h[8:12]}-{h[12:16]}-{h[16:20]}-{h[20:]} pci={pci}"
    return f"pci={pci}"


def table_shape(table) -> tuple:
    """``(rows, columns)`` of a step's 2-D table (a req_to_token or block table, plain or wrapped);
    ``(0, 0)`` for a CSR table, whose arrays change length every step (never compared)."""
    for x in (table, getattr(table, "req_to_token", None), getattr(table, "block_table", None)):
        shape = getattr(x, "shape", None)
        if shape is not None and len(shape) == 2:
            return int(shape[0]), int(shape[1])
    return 0, 0


def _agreed_values(session, reducer) -> dict:
    """What every rank's session must agree on (pool size, canary size, capacities, the reduction's shape)."""
    c = session.planner.capacities
    values = dict(num_slots=session.num_slots, max_batch_size=session.max_batch_size,
                  verify_capacity=c.verify_capacity, ring_capacity=session.log.capacity,
                  swa_window_size=session.planner.swa_window_size, reduce_every=reducer.reduce_every,
                  replicated_kv=int(reducer.replicated_kv), real_kv_sources=len(session.real_kv_sources))
    for i in range(MAX_REAL_KV_SOURCES):
        src = session.real_kv_sources[i] if i < len(session.real_kv_sources) else None
        values[f"real_kv_sources[{i}] slots (KV pool size)"] = 0 if src is None else src.num_rows * src.page_size
        values[f"real_kv_sources[{i}].num_bytes_per_token"] = 0 if src is None else src.num_bytes_per_token
        values[f"real_kv_sources[{i}].read_bytes"] = 0 if src is None else src.read_bytes
    return values


class RankReducer:
    """The distributed part of a session with a ``process_group`` (``session.distributed``).

    Built by :class:`~kvcanary_cupy.CanarySession`, which calls :meth:`end_step` and
    :meth:`check` from its own.  Construction is a collective: every rank's session checks that
    all ranks agree on the pool size, the canary size and the capacities (a ValueError naming
    the rank and the value otherwise).

    Attributes
    ----------
    rank, world_size : int
        This rank and the group's size.
    device : str
        This rank's device (``GPU-<uuid> pci=<bus id>`` or ``cpu@<host>``), as reports carry it.
    per_rank : tuple of dict
        Every rank's totals (:data:`TOTALS`, ``violations_by_tag``, ``violations_by_reason``) as
        of the last reduction read.
    totals : dict
        Their sums: the whole group's counts.
    stats : dict
        ``reductions`` (issued), ``reduce_waits`` (a result still in flight when needed),
        ``replicated_slots_compared``, ``replica_mismatches``.
    """

    def __init__(self, session, process_group, *, reduce_every: int, replicated_kv: bool, allow_default_group: bool):
        torch, dist = import_torch_distributed()
        if not isinstance(process_group, dist.ProcessGroup):
            fail(TypeError, f"process_group must be a torch.distributed ProcessGroup (dist.new_group(...)), "
                            f"got {type(process_group).__name__}")
        if not allow_default_group and _is_default_group(dist, process_group):
            fail(ValueError, "process_group is the default (WORLD) group, which the model's own collectives use: the "
                             "canary's all-reduce would queue between them (a rank whose canary issued one more or less "
                             "would hang the model). Pass a dedicated group, dist.new_group(backend=...), or "
                             "allow_default_group=True if nothing else uses this group")
        backend = str(dist.get_backend(process_group)).lower()
        on_gpu = session._placement.backend == "cupy"
        want = "nccl" if on_gpu else "gloo"
        if backend != want:
            fail(ValueError, f"process_group has backend {backend!r}, but the session's arrays are "
                             f"{session._placement.describe()}: pass a {want!r} group (gloo for NumPy arrays and CPU "
                             "tensors, nccl for CUDA arrays)")
        self._torch, self._dist, self._group = torch, dist, process_group
        self.rank, self.world_size = dist.get_rank(process_group), dist.get_world_size(process_group)
        self.reduce_every, self.replicated_kv = reduce_every, bool(replicated_kv)
        self.device = device_id(session._placement)
        self._on_gpu = on_gpu
        self._num_kinds = session.log.num_kinds
        self._window = min(session.num_slots, REPLICATED_WINDOW) if replicated_kv else 0
        self._host_width = len(_VERDICT) + len(TOTALS) + len(_SHAPE) + self._num_kinds + len(_REASONS)
        column = None
        if replicated_kv:
            column = self._canary_column(session.tail_canary)
        rows, width = self.world_size, self._host_width + self._window
        if on_gpu:
            self._exchange = DeviceExchange(torch, dist, process_group, self.rank, rows, width, self._host_width,
                                             column, session._placement.device, session._transport.launch_stream)
        else:
            self._exchange = HostExchange(torch, dist, process_group, self.rank, rows, width, self._host_width, column)
        # the thread holds the worker, never this reducer: dropping the session stops it (and so does exit)
        self._worker = ReductionWorker(f"kvcanary-reduce-rank{self.rank}", _group_timeout(torch, dist, process_group,
                                       on_gpu) + WAIT_MARGIN_S, setup=self._exchange.setup_thread if on_gpu else None)
        self._finalizer = weakref.finalize(self, self._worker.close)
        self._check_agreement(_agreed_values(session, self))
        self._stat_columns = _stat_columns()
        # the kernels' out-of-range counters in a handled record's header (as session._out_of_range_skipped reads them)
        self._kernel_out_of_range = slice(session._layout.counters + 3 * self._num_kinds, session._layout.ring)
        self._table_shape = (0, 0)
        self._offset = 0
        self._seen_mismatches = {}  # (slot, rank, value, reference) reported, oldest first
        self._totals_rows = [[0] * self._host_width for _ in range(self.world_size)]  # as last reduced
        self.stats = dict(reductions=0, reduce_waits=0, replicated_slots_compared=0, replica_mismatches=0)

    # -- the session's hooks -------------------------------------------------------------------

    def note_table(self, table) -> None:
        """pre_forward's table (its shape goes into the next reduction, to be compared)."""
        self._table_shape = table_shape(table)

    def end_step(self, session) -> None:
        """At every ``reduce_every``-th step: read the previous reduction, start this one, apply the verdict."""
        if session._stats["steps"] % self.reduce_every == 0:
            self._reduce(session, wait=False)

    def check(self, session) -> None:
        """``check()`` on every rank: read the reduction in flight, reduce everything handled now, wait, apply."""
        self._reduce(session, wait=True)

    def close(self) -> None:
        """Stop the worker thread (after the reduction it runs, if any); later reductions are refused."""
        self._finalizer()

    @property
    def worker_thread(self):
        """The worker thread (None before the first reduction)."""
        return self._worker.thread

    def gather_report(self, report: ViolationReport, dst: int):
        """Every rank's ``report`` merged on rank ``dst`` (None on the others); a blocking collective."""
        data = np.frombuffer(report.to_json().encode(), np.uint8)
        sizes = self._gather_rows(np.array([len(data)], np.int64))[:, 0]
        padded = np.zeros(int(sizes.max()), np.int64)
        padded[: len(data)] = data
        rows = self._gather_rows(padded)
        if self.rank != dst:
            return None
        reports = [ViolationReport.from_json(rows[r, : sizes[r]].astype(np.uint8).tobytes().decode())
                   for r in range(self.world_size)]
        return ViolationReport.merge(*reports)

    @property
    def per_rank(self) -> tuple:
        base, k = len(_VERDICT), self._num_kinds
        shape_at = base + len(TOTALS)
        tags_at = shape_at + len(_SHAPE)
        out = []
        for row in self._totals_rows:
            d = dict(zip(TOTALS, row[base:shape_at]))
            d["violations_by_tag"] = {tag_name(i): n for i, n in enumerate(row[tags_at : tags_at + k]) if n}
            d["violations_by_reason"] = {name: n for name, n in zip(_REASONS, row[tags_at + k :]) if n}
            out.append(d)
        return tuple(out)

    @property
    def totals(self) -> dict:
        per_rank = self.per_rank
        out = {k: sum(r[k] for r in per_rank) for k in TOTALS}
        for key in ("violations_by_tag", "violations_by_reason"):
            out[key] = {}
            for r in per_rank:
                for name, n in r[key].items():
                    out[key][name] = out[key].get(name, 0) + n
        return out

    # -- internals -----------------------------------------------------------------------------

    def _canary_column(self, canary):
        """The TAIL canary's real_kv_hash column, viewed by the exchange's framework."""
        if not self._on_gpu:
            return backend_view(canary, "tail_canary")[:, CANARY_FIELD_REAL_KV_HASH]
        torch = self._torch
        tensor = canary if isinstance(canary, torch.Tensor) else torch.from_dlpack(canary)
        return tensor[:, CANARY_FIELD_REAL_KV_HASH]

    def _gather_rows(self, values: np.ndarray) -> np.ndarray:
        """Every rank's ``values`` (int64, the same length on every rank), blocking."""
        torch = self._torch
        if self._worker.pending():  # one thread issues collectives at a time: every rank in the same order
            self._worker.wait()
        rows = torch.zeros((self.world_size, len(values)), dtype=torch.int64)
        rows[self.rank] = torch.from_numpy(np.ascontiguousarray(values, np.int64))
        if self._on_gpu:
            rows = rows.to(self._exchange.buffer.device)
        self._dist.all_reduce(rows, group=self._group)
        return rows.cpu().numpy()

    def _check_agreement(self, values: dict) -> None:
        names = list(values)
        rows = self._gather_rows(np.array([values[k] for k in names], np.int64))
        for j, name in enumerate(names):
            column = rows[:, j]
            odd = [r for r in range(self.world_size) if column[r] != column[0]]
            if odd:
                fail(ValueError, f"the ranks of process_group disagree on {name}: rank 0 has {int(column[0])}, "
                                 + ", ".join(f"rank {r} has {int(column[r])}" for r in odd)
                                 + "; build every rank's session with the same sizes")

    def _snapshot(self, session, new: int, problems: int) -> tuple:
        """On the step's thread: what this rank's row needs of the session, as of now, with as
        little work as possible (the row itself is built on the worker by :meth:`_fill_row`).
        ``session._latest`` is replaced, never changed, when a record is handled: a reference is
        a snapshot; the two dicts are copied."""
        return (new, problems, session._stats.copy(), session._latest,
                sum(r.origin == "step" for r in session._pending), len(session._distinct),
                session._plan_out_of_range["step"] + session._plan_out_of_range["sweep"],
                session._rows_by_reason.copy(), self._table_shape)

    def _fill_row(self, snapshot: tuple) -> None:
        """On the worker: this rank's row into the exchange's staging: the verdict, then
        ``session.stats``'s numbers (read from the session's bookkeeping directly: ``stats``
        builds dicts and arrays; the clean multi-rank test checks the two agree), the table
        shape, the exact violations per kind and the rows read per reason."""
        new, problems, st, latest, pending_steps, distinct, plan_out_of_range, by_reason, shape = snapshot
        by_tag = latest[STAGE_HEADER_FIELDS : STAGE_HEADER_FIELDS + self._num_kinds]  # exact violations per kind
        violations = sum(by_tag)
        out_of_range = sum(latest[self._kernel_out_of_range]) + plan_out_of_range  # session._out_of_range_skipped()
        derived = (st["steps"] - pending_steps, violations, violations - st["rows_read"], distinct, out_of_range)
        self._exchange.staging[: self._host_width] = (
            [new, problems] + [derived[key] if key.__class__ is int else st[key] for key in self._stat_columns]
            + list(shape) + by_tag + [by_reason[name] for name in _REASONS])

    def _job(self, snapshot: tuple, c: "_Contribution"):
        """The worker's part of one reduction: the row, the collective, the decode."""
        self._fill_row(snapshot)
        return self._decode(self._exchange.run(c.slots), c)

    def _reduce(self, session, *, wait: bool) -> None:
        verdict = self._collect()
        self._issue(session)
        if wait:
            later = self._collect()
            verdict = later if verdict is None else verdict.joined(later)
        if verdict is not None:
            session._deliver(verdict.contribution.new, verdict.contribution.problems,
                             verdict.contribution.undelivered, verdict)

    def _issue(self, session) -> None:
        """On the step's thread: this rank's row and window, then the collective on the worker."""
        if self._worker.closed:
            fail(CanaryUsageError, "the session was closed (session.close()): its process_group reductions are stopped")
        new, problems, undelivered = session._take_new()
        offset, slots = self._offset, 0
        if self._window:
            slots = min(self._window, session.num_slots - offset)
            self._offset = 0 if offset + slots >= session.num_slots else offset + slots
        snapshot = self._snapshot(session, len(new), len(problems))
        self._exchange.prepare(offset, slots)
        c = _Contribution(new, problems, undelivered, session._stats["steps"] - 1, offset, slots)
        self._worker.submit(partial(self._job, snapshot, c), f"the canary's reduction issued at step {c.step}")
        self.stats["reductions"] += 1

    def _collect(self):
        """The verdict of the reduction in flight (waiting, bounded, if the worker has not finished it), or None."""
        if not self._worker.pending():
            return None
        if not self._worker.ready():
            self.stats["reduce_waits"] += 1
        verdict, self._totals_rows = self._worker.result()
        return verdict

    def _decode(self, rows: np.ndarray, c: _Contribution):
        """On the worker: the reduced rows as a Verdict, and the rows' host part (for ``per_rank``)."""
        h = self._host_width
        shape_at = len(_VERDICT) + len(TOTALS)
        host = rows[:, :h].tolist()
        shapes = [tuple(row[shape_at : shape_at + len(_SHAPE)]) for row in host]
        if shapes.count(shapes[0]) != len(shapes):
            self._check_table_shapes(shapes)
        mismatches = self._mismatches(rows[:, h : h + c.slots], c) if c.slots else ()
        verdict = Verdict(c, self.rank, {r: row[0] for r, row in enumerate(host) if row[0]},
                          {r: row[1] for r, row in enumerate(host) if row[1]}, mismatches, self.world_size, self.device)
        return verdict, host

    def _check_table_shapes(self, shapes: list) -> None:
        known = [r for r, shape in enumerate(shapes) if any(shape)]  # (0, 0): no 2-D table seen yet
        odd = [r for r in known if shapes[r] != shapes[known[0]]] if known else []
        if odd:
            first = known[0]
            fail(ValueError, f"the ranks of process_group disagree on the table shape: rank {first} has {shapes[first]}, "
                             + ", ".join(f"rank {r} has {shapes[r]}" for r in odd)
                             + "; every rank must run the same schedule over tables of one shape")

    def _mismatches(self, hashes: np.ndarray, c: _Contribution) -> tuple:
        """The new mismatches of one window: per slot whose ranks differ, each rank holding another
        value than the most common one (ties: the lowest rank's), named with the lowest rank holding it."""
        self.stats["replicated_slots_compared"] += c.slots  # the worker thread: these two keys have no other writer
        found = []
        for j in np.flatnonzero((hashes != hashes[0]).any(axis=0)).tolist():
            column = hashes[:, j].tolist()
            counts = {}
            for value in column:
                counts[value] = counts.get(value, 0) + 1
            reference = max(counts, key=lambda v: (counts[v], -column.index(v)))
            ref_rank = column.index(reference)
            for r, value in enumerate(column):
                key = (c.offset + j, r, value, reference)
                if value != reference and key not in self._seen_mismatches:
                    if len(self._seen_mismatches) >= MAX_SEEN_MISMATCHES:  # forget the oldest (reported again if seen)
                        del self._seen_mismatches[next(iter(self._seen_mismatches))]
                    self._seen_mismatches[key] = None
                    found.append(ReplicaMismatch(c.offset + j, r, ref_rank, to_unsigned(value), to_unsigned(reference),
                                                 c.step))
        self.stats["replica_mismatches"] += len(found)
        return tuple(found)


_DERIVED = ("handled_steps", "violations", "dropped_rows", "distinct_violations", "out_of_range_skipped")


def _stat_columns() -> tuple:
    """:data:`TOTALS` in order, each a ``session._stats`` key or the index of a derived value (``_DERIVED``)."""
    return tuple(_DERIVED.index(key) if key in _DERIVED else key for key in TOTALS)


def _group_timeout(torch, dist, group, on_gpu: bool) -> float:
    """The group's collective timeout in seconds (its backend's options), else torch's default."""
    try:
        backend = group._get_backend(torch.device("cuda" if on_gpu else "cpu"))
        return backend.options._timeout.total_seconds()
    except Exception:  # a torch without these internals
        return dist.default_pg_timeout.total_seconds()


def _is_default_group(dist, group) -> bool:
    if not dist.is_initialized():
        return False
    return group is dist.group.WORLD or group == dist.distributed_c10d._get_default_group()
