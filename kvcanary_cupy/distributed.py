"""A :class:`~kvcanary_cupy.CanarySession` over ``torch.distributed``: one canary per rank, one verdict.

Every rank keeps its own canary, planner and log.  Every ``reduce_every``-th ``end_step`` (and at
``check()``), each rank fills its own row of a ``[world_size, width]`` int64 buffer (its totals,
how many new violations and health problems it handled since the last reduction, its table shape
and, with ``replicated_kv``, a window of its TAIL real-KV fingerprints), leaves the other rows
zero and starts an asynchronous SUM all-reduce of it over the session's dedicated group: every
rank then holds every rank's row.  On a GPU the row is copied and reduced on a side stream
ordered after the step's kernels, and copied back to pinned memory behind an event, so the host
never waits in the step.  The next reduction (``reduce_every`` steps later, on every rank at the
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

import logging
import socket
from dataclasses import dataclass

import numpy as np

from .args import STAGE_HEADER_FIELDS
from .constants import CANARY_FIELD_REAL_KV_HASH, MAX_REAL_KV_SOURCES, FailReason
from .errors import fail
from .hashing import to_unsigned
from .interop import backend_view
from .reporting import REPLICATED_KV_MISMATCH, ReplicaMismatch, ViolationReport, reason_name, tag_name

logger = logging.getLogger("kvcanary_cupy")

#: Slots of the TAIL canary compared across ranks per reduction (``replicated_kv=True``): the
#: window moves on by this much each reduction, so a pool of ``n`` slots is compared in full
#: every ``ceil(n / REPLICATED_WINDOW)`` reductions.
REPLICATED_WINDOW = 4096
#: Each rank's totals in the reduction, summed into ``RankReducer.totals`` (names of ``session.stats``).
TOTALS = ("steps", "handled_steps", "verified_entries", "violations", "rows_read", "dropped_rows",
          "distinct_violations", "verify_skipped_steps", "verify_skipped_sweeps", "health_failures",
          "out_of_range_skipped", "sweeps", "staging_waits", "evicted_violations", "untracked_rows",
          "unattributed_entries")
_VERDICT = ("new_violations", "health_problems")
_SHAPE = ("table_rows", "table_cols")
_REASONS = tuple(reason_name(m) for m in FailReason)


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


def all_reduce_fn(dist, group, tensor):
    """A function starting the in-place SUM all-reduce of ``tensor`` over ``group`` and returning
    its work: the group's own method with options made once (a third of ``dist.all_reduce``'s
    host time, which checks its arguments at every call), or ``dist.all_reduce`` where a torch
    build lacks it."""
    method = getattr(group, "allreduce", None)
    options = getattr(dist, "AllreduceOptions", None)
    if method is None or options is None:
        return lambda: dist.all_reduce(tensor, group=group, async_op=True)
    opts, tensors = options(), [tensor]
    opts.reduceOp = dist.ReduceOp.SUM
    if hasattr(opts, "asyncOp"):
        opts.asyncOp = True  # as dist.all_reduce(..., async_op=True) sets it
    return lambda: method(tensors, opts)


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


@dataclass
class _Contribution:
    """What a rank put into one reduction: the findings it handled since the previous one."""

    new: dict
    problems: list
    undelivered: dict
    step: int  # 0-based step of the end_step that issued it
    offset: int  # first slot of its replicated window
    slots: int


@dataclass
class Verdict:
    """One reduction's result as every rank sees it (plus this rank's own findings in it)."""

    contribution: _Contribution
    rank: int
    new_by_rank: dict  # rank -> new violations it handled (nonzero only)
    problems_by_rank: dict  # rank -> health problems (nonzero only)
    mismatches: tuple = ()  # of ReplicaMismatch not reported before
    world_size: int = 1
    device: str = ""

    @property
    def ranks(self) -> list:
        """The ranks with new violations or replicated-KV mismatches."""
        found = set(self.new_by_rank)
        for m in self.mismatches:
            found.update((m.rank, m.other_rank))
        return sorted(found)

    @property
    def flagged(self) -> bool:
        return bool(self.new_by_rank or self.problems_by_rank or self.mismatches)

    @property
    def violations_anywhere(self) -> bool:
        return bool(self.new_by_rank or self.mismatches)

    def remote_problems(self) -> list:
        return [f"kv-canary: rank {r} handled {n} health problem(s) by step {self.contribution.step} "
                "(that rank's log has the message)" for r, n in sorted(self.problems_by_rank.items()) if r != self.rank]

    def where(self) -> str:
        """The headline's distributed part: this rank, and what every rank found."""
        counts = ", ".join(f"rank {r}: {n}" for r, n in sorted(self.new_by_rank.items())) or "none"
        mismatches = f"; {len(self.mismatches)} {REPLICATED_KV_MISMATCH}(es)" if self.mismatches else ""
        return (f" on rank {self.rank} ({self.device}); over the {self.world_size} ranks by step "
                f"{self.contribution.step}: new violations on ranks {self.ranks} ({counts}){mismatches}")

    def joined(self, later: "Verdict") -> "Verdict":
        """This verdict and a later one, applied as one (``check()`` reads two at once)."""
        a, b = self.contribution, later.contribution
        both = _Contribution({**a.new, **b.new}, a.problems + b.problems, {**a.undelivered, **b.undelivered},
                             b.step, b.offset, b.slots)
        add = lambda x, y: {r: x.get(r, 0) + y.get(r, 0) for r in sorted(set(x) | set(y))}
        return Verdict(both, self.rank, add(self.new_by_rank, later.new_by_rank),
                       add(self.problems_by_rank, later.problems_by_rank), self.mismatches + later.mismatches,
                       self.world_size, self.device)


class _HostExchange:
    """gloo: the rows are a CPU tensor, reduced in place on gloo's thread."""

    def __init__(self, torch, dist, group, rank: int, rows: int, width: int, column):
        self.buffer = torch.zeros((rows, width), dtype=torch.int64)
        self._all_reduce = all_reduce_fn(dist, group, self.buffer)
        self.rows = self.buffer.numpy()
        self._own = self.rows[rank]
        self._column = column  # the TAIL canary's real_kv_hash column (NumPy view), or None
        self._work = None

    def start(self, host_values: np.ndarray, offset: int, slots: int) -> None:
        self.rows.fill(0)
        own, h = self._own, len(host_values)
        own[:h] = host_values
        if slots:
            own[h : h + slots] = self._column[offset : offset + slots]
        self._work = self._all_reduce()

    def ready(self) -> bool:
        return self._work.is_completed()

    def finish(self) -> np.ndarray:
        """The reduced rows (valid until the next start)."""
        self._work.wait()
        self._work = None
        return self.rows


class _DeviceExchange:
    """NCCL: the rows live on the session's GPU; a side stream, ordered after the step's stream by
    an event, zeroes them, copies this rank's totals from pinned memory and its fingerprints from
    the TAIL canary (the step's stream then waits for that copy only), runs the all-reduce (``work.wait()`` there makes the side stream, not the host,
    wait for NCCL's), copies the result to pinned memory and records an event."""

    def __init__(self, torch, dist, group, rank: int, rows: int, width: int, column, device: int, launch_stream):
        self._torch, self._rank = torch, rank
        self._device = torch.device("cuda", device)
        self.buffer = torch.zeros((rows, width), dtype=torch.int64, device=self._device)
        self._all_reduce = all_reduce_fn(dist, group, self.buffer)
        self._host_in = None
        self._host_out = torch.zeros((rows, width), dtype=torch.int64, pin_memory=True)
        self.rows = self._host_out.numpy()
        self._column = column  # torch view of the TAIL canary's real_kv_hash column, or None
        self._side = torch.cuda.Stream(device=self._device)
        self._done = torch.cuda.Event()
        self._snapshot = torch.cuda.Event()
        self._launch_stream = launch_stream
        self._external = {}  # CuPy stream pointer -> torch.cuda.ExternalStream

    def _step_stream(self):
        ptr = self._launch_stream().ptr
        if ptr == 0:  # CuPy's null stream is the legacy default stream, torch's default stream
            return self._torch.cuda.default_stream(self._device)
        stream = self._external.get(ptr)
        if stream is None:
            stream = self._external[ptr] = self._torch.cuda.ExternalStream(ptr, device=self._device)
        return stream

    def start(self, host_values: np.ndarray, offset: int, slots: int) -> None:
        torch = self._torch
        if self._host_in is None:
            self._host_in = torch.zeros(len(host_values), dtype=torch.int64, pin_memory=True)
            self._host_in_np = self._host_in.numpy()
        self._host_in_np[:] = host_values  # its previous copy has completed: finish() came first
        h = len(host_values)
        step_stream = self._step_stream()
        self._side.wait_stream(step_stream)
        with torch.cuda.stream(self._side):
            self.buffer.zero_()
            own = self.buffer[self._rank]
            own[:h].copy_(self._host_in, non_blocking=True)
            if slots:
                own[h : h + slots].copy_(self._column[offset : offset + slots])
                # the next step's TAIL write waits for the snapshot (not for the all-reduce), so that
                # every rank compares the canary as this step left it
                self._snapshot.record(self._side)
                step_stream.wait_event(self._snapshot)
            work = self._all_reduce()  # NCCL's stream waits for the side stream's copies
            work.wait()
            self._host_out.copy_(self.buffer, non_blocking=True)
            self._done.record(self._side)

    def ready(self) -> bool:
        return self._done.query()

    def finish(self) -> np.ndarray:
        """The reduced rows (valid until the next start)."""
        self._done.synchronize()
        return self.rows


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
        self._row = np.zeros(self._host_width, np.int64)
        column = None
        if replicated_kv:
            column = self._canary_column(session.tail_canary)
        rows, width = self.world_size, self._host_width + self._window
        if on_gpu:
            self._exchange = _DeviceExchange(torch, dist, process_group, self.rank, rows, width, column,
                                             session._placement.device, session._transport.launch_stream)
        else:
            self._exchange = _HostExchange(torch, dist, process_group, self.rank, rows, width, column)
        self._check_agreement(_agreed_values(session, self))
        self._table_shape = (0, 0)
        self._in_flight = None  # the _Contribution of the reduction in flight
        self._offset = 0
        self._seen_mismatches = set()
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

    def _host_values(self, session, new: int, problems: int) -> np.ndarray:
        """This rank's row: the verdict, then ``session.stats``'s numbers read from the session's
        bookkeeping directly (``stats`` builds dicts and arrays: on the cold cache a step leaves,
        most of a reduction's host time; the clean multi-rank test checks the two agree)."""
        st, k = session._stats, self._num_kinds
        by_tag = session._latest[STAGE_HEADER_FIELDS : STAGE_HEADER_FIELDS + k]  # exact violations per kind
        violations = sum(by_tag)
        derived = {"handled_steps": st["steps"] - sum(r.kind == "step" for r in session._pending),
                   "violations": violations, "dropped_rows": violations - st["rows_read"],
                   "distinct_violations": len(session._distinct), "out_of_range_skipped": session._out_of_range_skipped()}
        by_reason = session._rows_by_reason
        self._row[:] = ([new, problems] + [derived[key] if key in derived else st[key] for key in TOTALS]
                        + list(self._table_shape) + by_tag + [by_reason[name] for name in _REASONS])
        return self._row

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
        new, problems, undelivered = session._take_new()
        offset, slots = self._offset, 0
        if self._window:
            slots = min(self._window, session.num_slots - offset)
            self._offset = 0 if offset + slots >= session.num_slots else offset + slots
        self._exchange.start(self._host_values(session, len(new), len(problems)), offset, slots)
        self._in_flight = _Contribution(new, problems, undelivered, session._stats["steps"] - 1, offset, slots)
        self.stats["reductions"] += 1

    def _collect(self):
        """The verdict of the reduction in flight (waiting for it if it has not landed), or None."""
        contribution = self._in_flight
        if contribution is None:
            return None
        if not self._exchange.ready():
            self.stats["reduce_waits"] += 1
        rows = self._exchange.finish()
        self._in_flight = None
        return self._decode(rows, contribution)

    def _decode(self, rows: np.ndarray, c: _Contribution) -> Verdict:
        h = self._host_width
        shape_at = len(_VERDICT) + len(TOTALS)
        host = self._totals_rows = rows[:, :h].tolist()  # per_rank decodes them when asked
        shapes = [tuple(row[shape_at : shape_at + len(_SHAPE)]) for row in host]
        if shapes.count(shapes[0]) != len(shapes):
            self._check_table_shapes(shapes)
        mismatches = self._mismatches(rows[:, h : h + c.slots], c) if c.slots else ()
        return Verdict(c, self.rank, {r: row[0] for r, row in enumerate(host) if row[0]},
                       {r: row[1] for r, row in enumerate(host) if row[1]}, mismatches, self.world_size, self.device)

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
        self.stats["replicated_slots_compared"] += c.slots
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
                    self._seen_mismatches.add(key)
                    found.append(ReplicaMismatch(c.offset + j, r, ref_rank, to_unsigned(value), to_unsigned(reference),
                                                 c.step))
        self.stats["replica_mismatches"] += len(found)
        return tuple(found)


def _is_default_group(dist, group) -> bool:
    if not dist.is_initialized():
        return False
    return group is dist.group.WORLD or group == dist.distributed_c10d._get_default_group()
