"""What every engine integration shares: its options, its attach/detach lifecycle, the shape of its
report and stats, and the labelling of violations with the engine's request ids.

An integration subclasses :class:`EngineCanary`: it builds one :class:`~kvcanary_cupy.CanarySession`
per KV pool group it covers (through :meth:`EngineCanary.new_session`, which applies the options),
records the request ids of each step's batch rows (:meth:`EngineCanary.label_step`) and of each
sweep's sequences (:meth:`EngineCanary.label_sweep`), and undoes its hooks in
:meth:`EngineCanary._uninstall`.  Everything here is engine-independent.
"""

from __future__ import annotations

import collections
import logging
import threading
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from ..constants import DEFAULT_RING_CAPACITY, MAX_REAL_KV_SOURCES, RealKvHashMode
from ..errors import CanaryViolationError, fail
from ..reporting import Violation, ViolationReport
from ..session import MESSAGE_MAX_LINES, POLICIES, CanarySession
from ..validation import check_count, check_int

logger = logging.getLogger("kvcanary_cupy")

#: The options every integration's ``attach`` takes (and nothing the user must compute from engine
#: internals: sizes, tables and KV views come from the engine).
OPTION_NAMES = ("on_violation", "ring_capacity", "check_expected_tokens", "fingerprint_layers", "real_kv_hash_mode",
                "sweep_every", "verify_capacity")
#: The coverage options past the 32-byte record (docs/format.md section 9), taken by the integrations
#: that implement them (``from_options(..., coverage=True)``; transformers).
COVERAGE_OPTION_NAMES = ("deep_kv_layers", "deep_check_period", "check_lost_stores")
#: Default steps within which the deep rotation re-fingerprints every slot (as ``kvcanary sim``).
DEFAULT_DEEP_CHECK_PERIOD = 4
#: Steps (and sweeps) whose row labels are kept: a violation reaches the policy at most
#: ``STAGED_RECORDS`` stagings after its step, far inside this window.
LABEL_WINDOW = 256


@dataclass(frozen=True)
class CanaryOptions:
    """The options of an engine integration's ``attach`` (docs/engines.md, "Options").

    Parameters
    ----------
    on_violation : {"raise", "log", "ignore"} or callable
        As for :class:`~kvcanary_cupy.CanarySession`, applied to request-labelled reports.  Default
        ``"log"``: an engine's step loop (often a background thread) keeps running.
    ring_capacity : int
        Violation rows a step keeps per launch group.
    check_expected_tokens : bool
        Check every stored token against the engine's own token history (default on).
    fingerprint_layers : "all", "none" or a sequence of layer indices
        The layers whose K and V bytes the TAIL buffer fingerprints (each layer takes two of the
        ``MAX_REAL_KV_SOURCES`` sources).  Default: the first layers that fit.
    real_kv_hash_mode : RealKvHashMode or its name
        ``PARTIAL`` (default: 16 bytes a slot per source), ``ALL`` or ``NONE``.
    sweep_every : int
        Sweep the engine's cached blocks every this many steps (0: never).
    verify_capacity : int, optional
        The most slots one step may verify; default sized from the engine's pool.
    deep_kv_layers : None, "none", "all" or a sequence of layer indices
        The layers whose K and V, every byte, go into each written slot's deep fingerprint
        (``CanarySession``'s ``deep_kv_sources``; any number of layers).  Default None: off.
    deep_check_period : int
        With ``deep_kv_layers``: every slot is re-fingerprinted within this many steps, so a flip in
        any of those layers is reported within them (``deep_check_slots`` is sized from the pool).
    check_lost_stores : bool
        Report a write slot whose bytes the forward left unchanged (``write_kv_not_stored``).  The
        integration picks the bytes compared (docs/engines.md).  Default off.
    """

    on_violation: Any = "log"
    ring_capacity: int = DEFAULT_RING_CAPACITY
    check_expected_tokens: bool = True
    fingerprint_layers: Any = None
    real_kv_hash_mode: RealKvHashMode = RealKvHashMode.PARTIAL
    sweep_every: int = 0
    verify_capacity: int | None = None
    deep_kv_layers: Any = None
    deep_check_period: int = DEFAULT_DEEP_CHECK_PERIOD
    check_lost_stores: bool = False

    @classmethod
    def from_options(cls, engine: str, options: dict, *, coverage: bool = False) -> "CanaryOptions":
        """The options of ``attach(..., **options)`` (with ``coverage``, the coverage options too): an
        unknown name is a TypeError naming it and the known ones."""
        known = OPTION_NAMES + (COVERAGE_OPTION_NAMES if coverage else ())
        unknown = sorted(set(options) - set(known))
        if unknown:
            fail(TypeError, f"{engine} attach() got unknown option(s) {', '.join(unknown)}; "
                            f"the options are {', '.join(known)}")
        o = cls(**options)
        policy = o.on_violation
        if not (callable(policy) or (isinstance(policy, str) and policy in POLICIES)):
            fail(ValueError, f"on_violation must be one of {POLICIES} or a callable taking a ViolationReport, got {policy!r}")
        check_count(o.ring_capacity, "ring_capacity", positive=True)
        if not isinstance(o.check_expected_tokens, bool):
            fail(TypeError, f"check_expected_tokens must be a bool, got {type(o.check_expected_tokens).__name__}")
        try:
            mode = RealKvHashMode[o.real_kv_hash_mode] if isinstance(o.real_kv_hash_mode, str) else RealKvHashMode(o.real_kv_hash_mode)
        except (KeyError, ValueError, TypeError):
            fail(ValueError, f"real_kv_hash_mode must be a RealKvHashMode or one of NONE, PARTIAL, ALL, got {o.real_kv_hash_mode!r}")
        check_int(o.sweep_every, "sweep_every", minimum=0)
        if o.verify_capacity is not None:
            check_count(o.verify_capacity, "verify_capacity")
        check_int(o.deep_check_period, "deep_check_period", minimum=1)
        if not isinstance(o.check_lost_stores, bool):
            fail(TypeError, f"check_lost_stores must be a bool, got {type(o.check_lost_stores).__name__}")
        return replace(o, real_kv_hash_mode=mode, fingerprint_layers=_layer_names(o.fingerprint_layers, "fingerprint_layers"),
                       deep_kv_layers=_layer_names(o.deep_kv_layers, "deep_kv_layers"))

    def layers(self, num_layers: int) -> tuple[int, ...]:
        """The fingerprinted layers of a model of ``num_layers`` layers (each takes a K and a V source)."""
        per_layer = 2
        fit = MAX_REAL_KV_SOURCES // per_layer
        chosen = self.fingerprint_layers
        if self.real_kv_hash_mode == RealKvHashMode.NONE or chosen == "none":
            return ()
        if chosen is None:
            return tuple(range(min(num_layers, fit)))
        if chosen == "all":
            chosen = tuple(range(num_layers))
        bad = [i for i in chosen if i >= num_layers]
        if bad:
            fail(ValueError, f"fingerprint_layers {bad} past the model's {num_layers} layers")
        if len(chosen) > fit:
            fail(ValueError, f"fingerprint_layers names {len(chosen)} layers; at most {fit} fit the "
                             f"{MAX_REAL_KV_SOURCES} real-KV sources of a session (K and V each take one)")
        return tuple(sorted(set(chosen)))

    def deep_layers(self, num_layers: int) -> tuple[int, ...]:
        """The layers of a model of ``num_layers`` layers whose every byte the deep fingerprints fold."""
        chosen = self.deep_kv_layers
        if chosen in (None, "none"):
            return ()
        chosen = tuple(range(num_layers)) if chosen == "all" else chosen
        bad = [i for i in chosen if i >= num_layers]
        if bad:
            fail(ValueError, f"deep_kv_layers {bad} past the model's {num_layers} layers")
        return tuple(sorted(set(chosen)))


def _layer_names(layers, name: str):
    """``layers`` checked: None, "all", "none" or a tuple of layer indices."""
    if layers is None or layers in ("all", "none"):
        return layers
    if isinstance(layers, str) or not isinstance(layers, Sequence):
        fail(TypeError, f"{name} must be 'all', 'none' or a sequence of layer indices, got {layers!r}")
    return tuple(check_int(i, f"{name}[i]", minimum=0) for i in layers)


class _Labels:
    """Request ids of the last ``LABEL_WINDOW`` steps' batch rows and sweeps' sequences."""

    def __init__(self):
        self.steps: collections.OrderedDict = collections.OrderedDict()
        self.sweeps: collections.OrderedDict = collections.OrderedDict()

    @staticmethod
    def _put(table, key, ids) -> None:
        table[key] = tuple(ids)
        while len(table) > LABEL_WINDOW:
            table.popitem(last=False)

    def ids(self, v: Violation) -> tuple:
        table = self.sweeps if v.launch_tag.startswith("SWEEP") else self.steps
        rows = table.get(v.first_step)
        if rows is None:
            return ()
        return tuple(dict.fromkeys(rows[r] for r in v.batch_rows if 0 <= r < len(rows)))


class EngineCanary:
    """The canary attached to an engine: a context manager; :meth:`detach` restores the engine.

    Subclasses set ``engine`` (its name in messages), build their sessions with
    :meth:`new_session`, call :meth:`label_step` / :meth:`label_sweep` as the engine runs, may
    label engine findings through :meth:`classify`, and implement :meth:`_uninstall`.
    """

    engine = "engine"

    def __init__(self, options: CanaryOptions):
        self.options = options
        self.sessions: list[CanarySession] = []
        self._labels = _Labels()
        self._labelled: dict = {}  # (session index, violation key) -> (request ids, finding)
        self._lock = threading.Lock()
        self._counts = collections.Counter(engine_steps=0)
        self._attached = True

    # -- for subclasses ------------------------------------------------------------------------------

    def new_session(self, num_slots: int, *, max_batch_size: int, **kwargs) -> CanarySession:
        """A session with the options applied (``kwargs``, the integration's own settings, win); its
        policy labels violations first."""
        o = self.options
        index = len(self.sessions)
        settings = dict(ring_capacity=o.ring_capacity, verify_capacity=o.verify_capacity,
                        check_expected_tokens=o.check_expected_tokens,
                        real_kv_hash_mode=o.real_kv_hash_mode if kwargs.get("real_kv_sources") else RealKvHashMode.NONE)
        settings.update(kwargs)  # what the integration knows of the engine (sizes, sources) comes last
        session = CanarySession(num_slots, max_batch_size=max_batch_size,
                                on_violation=lambda report: self._deliver(index, report), **settings)
        self.sessions.append(session)
        return session

    def label_step(self, step: int, request_ids: Sequence) -> None:
        """The request id of each batch row of session step ``step`` (call it before its ``end_step``)."""
        with self._lock:
            self._labels._put(self._labels.steps, step, (str(r) for r in request_ids))

    def label_sweep(self, step: int, request_ids: Sequence) -> None:
        """The request id (or block label) of each sequence of the sweep run after session step ``step``."""
        with self._lock:
            self._labels._put(self._labels.sweeps, step, (str(r) for r in request_ids))

    def count(self, name: str, n: int = 1) -> None:
        """Add ``n`` to the integration's own counter ``name`` (reported in :attr:`stats`)."""
        with self._lock:
            self._counts[name] += n

    def classify(self, session_index: int, v: Violation) -> str | None:
        """The engine finding ``v`` is (a documented label), or None: unexplained.  Default: None."""
        return None

    def writers(self, session_index: int, v: Violation) -> tuple:
        """The request ids that wrote ``v``'s slot in its step, for a write row no read names (a lost
        store: its writer will read the former owner's KV).  Default: none known."""
        return ()

    def _uninstall(self) -> None:
        raise NotImplementedError

    # -- the lifecycle ---------------------------------------------------------------------------------

    def __enter__(self):
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        self.detach(check=exc_type is None)

    @property
    def attached(self) -> bool:
        return self._attached

    def detach(self, *, check: bool = True) -> None:
        """Restore the engine exactly as it was; with ``check``, first handle every staged step
        (the policy applies).  Idempotent."""
        if not self._attached:
            return
        try:
            if check:
                self.check()
        finally:
            self._attached = False
            self._uninstall()

    def check(self) -> int:
        """Handle every staged step of every session (a host sync); returns the slots skipped as out of range."""
        return sum(s.check() for s in self.sessions)

    # -- results -------------------------------------------------------------------------------------

    def _label(self, index: int, v: Violation) -> Violation:
        known = self._labelled.get((index, v.key))
        if known is None:
            known = (self._labels.ids(v) or self.writers(index, v), self.classify(index, v))
            self._labelled[(index, v.key)] = known
        return replace(v, request_ids=known[0] or v.request_ids, finding=known[1])  # or the session's own (row_labels)

    def _deliver(self, index: int, report: ViolationReport) -> None:
        """A session's policy: label the new violations, then apply the user's ``on_violation``."""
        with self._lock:
            report = replace(report, violations=tuple(self._label(index, v) for v in report.violations))
        unexplained = tuple(v for v in report.violations if v.finding is None)
        for v in report.violations:
            if v.finding is not None:
                logger.info("kv-canary %s finding %s: %s", self.engine, v.finding, v.format())
        policy = self.options.on_violation
        if callable(policy):
            policy(report)
        elif policy == "log":
            for v in unexplained:
                logger.warning("%s requests=%s", v.format(), ",".join(v.request_ids) or "-")
        elif policy == "raise" and unexplained:
            lines = [f"{v.format()} requests={','.join(v.request_ids) or '-'}" for v in unexplained[:MESSAGE_MAX_LINES]]
            raise CanaryViolationError(f"kv-canary: {len(unexplained)} new violation(s) in {self.engine}:\n"
                                       + "\n".join(lines), report)

    def report(self) -> ViolationReport:
        """Every distinct violation of every session, rows labelled with request ids and findings;
        counters summed.  Safe to call from another thread while the engine runs."""
        reports = [s.report() for s in self.sessions]
        with self._lock:
            rows = tuple(self._label(i, v) for i, r in enumerate(reports) for v in r.violations)
        if not reports:
            zeros = np.zeros(1, np.int64)
            return ViolationReport((), 0, 0, zeros, zeros, zeros, zeros, rows_read=0, steps=0)
        total = lambda name: sum(getattr(r, name) for r in reports)
        return ViolationReport(rows, total("total_violations"), reports[0].ring_capacity,
                               *(total(k) for k in ("violation_counters", "slot_run_counters", "kernel_run_counters",
                                                    "out_of_range_counters")),
                               rows_read=total("rows_read"), steps=self._counts["engine_steps"])

    @property
    def stats(self) -> dict:
        """The sessions' stats summed (dicts merged), plus the integration's own counters
        (``engine_steps``: engine steps the canary covered; ``findings``: violations labelled as
        engine findings).  Safe to read from another thread."""
        merged: dict = {}
        for s in self.sessions:
            for k, v in s.stats.items():
                if isinstance(v, dict):
                    into = merged.setdefault(k, {})
                    for kk, n in v.items():
                        into[kk] = into.get(kk, 0) + n
                else:
                    merged[k] = merged.get(k, 0) + v
        with self._lock:
            merged.update(self._counts)
            merged["findings"] = sum(1 for _, finding in self._labelled.values() if finding is not None)
        merged["sessions"] = len(self.sessions)
        return merged

    def __repr__(self) -> str:
        s = self.stats
        state = "attached" if self._attached else "detached"
        return (f"{type(self).__name__}({state}, sessions={s['sessions']}, engine_steps={s['engine_steps']}, "
                f"violations={s.get('violations', 0)}, findings={s['findings']})")

