"""CanaryPlanner: what an engine holds: capacities, buffers allocated once, a plan per step."""

from __future__ import annotations

import sys
import warnings
from dataclasses import dataclass
from typing import Any

import numpy as np

from .errors import CanaryCapacityWarning, fail, public_api, trimmed_argument_error
from .interop import Array, import_cupy, is_torch_tensor, placement_of, to_numpy
from .runtime import refuse_during_capture
from .plan_launcher import PlanLauncher
from .ops import plan as plan_step
from .plans import VerifyPlan, WritePlan
from .tables import as_table
from .validation import INT32_MAX, check_int


@dataclass(frozen=True)
class CanaryCapacities:
    """Capacities of the per-step buffers; always >= 0 (never a -1 sentinel).

    Parameters
    ----------
    verify_capacity : int
        The most verify entries (slots read) one step may plan.  A step with more skips its
        whole verify, counted and warned (:meth:`CanaryPlanner.verify_overflowed`): size it for
        the summed prefix lengths of the largest batch (:meth:`from_engine` takes 3 x the KV pool).
    write_req_capacity : int
        The most requests one step may hold (the batch limit).  A larger batch is refused with a
        ValueError.
    notes : tuple of str
        What :meth:`from_engine` clamped, in words (empty when nothing was).

    Examples
    --------
    >>> kc.CanaryCapacities(verify_capacity=3000, write_req_capacity=64)
    CanaryCapacities(verify_capacity=3000, write_req_capacity=64, notes=())
    """

    verify_capacity: int
    write_req_capacity: int
    notes: tuple = ()  # what was clamped, in words

    @classmethod
    @public_api
    def from_engine(
        cls,
        *,
        kv_pool_size: int,
        max_running_requests: int,
        req_to_token_pool_size: int = 0,
        cuda_graph_max_bs: int = 0,
        verify_headroom: int = 3,
    ) -> "CanaryCapacities":
        """Capacities from an engine's numbers, with every step clamped into ``[0, 2**31 - 1]``.

        ``verify_capacity = verify_headroom * kv_pool_size`` (radix sharing lets the summed
        prefixes of a batch exceed the pool: 3x is the reference's headroom);
        ``write_req_capacity = max(max_running_requests, req_to_token_pool_size, cuda_graph_max_bs)``.
        Any of these may be computed by the engine as a difference (``pool_size - num_running``)
        and come out negative: it is clamped to 0 and the clamp is reported in ``notes``.

        Parameters
        ----------
        kv_pool_size : int
            KV slots in the pool (the canary's ``num_slots``).
        max_running_requests : int
            The engine's batch limit.
        req_to_token_pool_size, cuda_graph_max_bs : int
            Other bounds of a batch's size (0 when the engine has none).
        verify_headroom : int
            Verify entries per pool slot.

        Returns
        -------
        CanaryCapacities

        Raises
        ------
        TypeError
            A number that is not an int (bools included).

        Examples
        --------
        >>> caps = kc.CanaryCapacities.from_engine(kv_pool_size=1000, max_running_requests=64)
        >>> caps.verify_capacity, caps.write_req_capacity
        (3000, 64)
        >>> kc.CanaryCapacities.from_engine(kv_pool_size=10 - 20, max_running_requests=4).notes
        ('kv_pool_size=-10 is negative; clamped to 0',)
        """
        notes = []

        def clamp(name: str, value) -> int:
            value = check_int(value, name)
            if value < 0:
                notes.append(f"{name}={value} is negative; clamped to 0")
                return 0
            if value > INT32_MAX:
                notes.append(f"{name}={value} overflows int32; clamped to {INT32_MAX}")
                return INT32_MAX
            return value

        pool = clamp("kv_pool_size", kv_pool_size)
        headroom = clamp("verify_headroom", verify_headroom)
        verify = clamp("verify_capacity (verify_headroom * kv_pool_size)", headroom * pool)
        write = clamp(
            "write_req_capacity",
            max(
                clamp("max_running_requests", max_running_requests),
                clamp("req_to_token_pool_size", req_to_token_pool_size),
                clamp("cuda_graph_max_bs", cuda_graph_max_bs),
            ),
        )
        return cls(verify, write, tuple(notes))

    @classmethod
    @public_api
    def from_block_pool(cls, *, num_blocks: int, block_size: int, max_num_seqs: int, max_model_len: int | None = None,
                        warn_bytes: int | None = None) -> "CanaryCapacities":
        """Capacities from a paged engine's block pool (``num_blocks``: vLLM's ``num_gpu_blocks``;
        ``block_size``, ``max_num_seqs``, ``max_model_len``), warning when the canary would be large.

        The pool has ``num_blocks * block_size`` slots (:meth:`canary_slots`); ``verify_capacity``
        is :meth:`from_engine`'s ``3 x`` the pool, bounded by ``max_num_seqs * max_model_len``
        when given (no batch can read more: each request's prefix is shorter than the model's
        length).  A :class:`CanaryCapacityWarning` names the bytes when a session's buffers
        (:meth:`session_bytes`) would exceed ``warn_bytes`` (default :data:`LARGE_CANARY_BYTES`).

        Parameters
        ----------
        num_blocks, block_size : int
            The pool's blocks (vLLM's ``num_gpu_blocks``) and slots per block.
        max_num_seqs : int
            The engine's batch limit (``write_req_capacity``).
        max_model_len : int, optional
            The longest sequence the engine serves.
        warn_bytes : int, optional
            The size past which a warning names the bytes.

        Examples
        --------
        >>> kc.CanaryCapacities.from_block_pool(num_blocks=64, block_size=32, max_num_seqs=8, max_model_len=512)
        CanaryCapacities(verify_capacity=4096, write_req_capacity=8, notes=())
        """
        blocks, size = check_int(num_blocks, "num_blocks", minimum=0), check_int(block_size, "block_size", minimum=1)
        seqs = check_int(max_num_seqs, "max_num_seqs", minimum=1)
        caps = cls.from_engine(kv_pool_size=blocks * size, max_running_requests=seqs)
        if max_model_len is not None:
            bound = seqs * check_int(max_model_len, "max_model_len", minimum=1)
            caps = cls(min(caps.verify_capacity, bound), caps.write_req_capacity, caps.notes)
        limit = LARGE_CANARY_BYTES if warn_bytes is None else check_int(warn_bytes, "warn_bytes", minimum=0)
        need = cls.session_bytes(blocks * size, caps)
        if need > limit:
            warnings.warn(f"kv-canary: a canary for {blocks} blocks x {size} slots ({blocks * size} slots, "
                          f"verify_capacity={caps.verify_capacity}) takes {need / 2**20:.0f} MiB (two canary buffers, "
                          "the plans and the same-step marks); give the engine a smaller KV pool, or the canary a "
                          "smaller verify_capacity, to use less", CanaryCapacityWarning, stacklevel=2)
        return caps

    @staticmethod
    def session_bytes(num_slots: int, capacities: "CanaryCapacities") -> int:
        """Bytes a :class:`CanarySession` with ``same_step_reads`` allocates for ``num_slots`` slots
        (HEAD and TAIL buffers of 32 bytes a slot, 8 bytes of same-step marks, 32 bytes a verify
        entry, ~32 bytes a request).

        Parameters
        ----------
        num_slots : int
            The canary's slots.
        capacities : CanaryCapacities
            The session's capacities.
        """
        return num_slots * (2 * 32 + 8) + capacities.verify_capacity * 32 + capacities.write_req_capacity * 32


#: Bytes of canary buffers past which :meth:`CanaryCapacities.from_block_pool` warns.
LARGE_CANARY_BYTES = 256 * 2**20


class CanaryPlanner:
    """Holds one (VerifyPlan, WritePlan) pair at fixed addresses and refills it every step.

    Inputs of another framework on the buffers' device are used in place; inputs on another
    device are copied there (a convenience for notebooks: not capture-safe).  A shrinking batch
    leaves nothing stale: seeds past the batch are -1 and offsets past it are 0.

    The buffers, capacities and SWA settings are bound once (:mod:`kvcanary_cupy.launchers`): a
    plan whose inputs are contiguous arrays of the buffers' framework and device costs only their
    checks and its launches.  The settings are read-only for that reason.

    Parameters
    ----------
    capacities : CanaryCapacities
        ``verify_capacity`` (entries per step) and ``write_req_capacity`` (requests per step).
        Clamp notes in it warn a :class:`CanaryCapacityWarning`.
    like : array, optional
        The framework and device of the buffers; None: NumPy.
    swa_window_size, full_to_swa_index_mapping, kv_token_id_vs_position_offset
        As for :func:`plan`, fixed for the planner's life.

    Attributes
    ----------
    verify_plan : VerifyPlan
    write_plan : WritePlan
        The buffers every :meth:`plan` fills; bind launchers to them.

    Raises
    ------
    TypeError
        ``capacities`` is not a :class:`CanaryCapacities`.

    Examples
    --------
    >>> planner = kc.CanaryPlanner(kc.CanaryCapacities(verify_capacity=32, write_req_capacity=4))
    >>> req_to_token = np.arange(64, dtype=np.int32).reshape(4, 16)
    >>> vp, wp = planner.plan(np.array([2]), np.array([7]), np.array([1]), req_to_token)
    >>> vp is planner.verify_plan, int(vp.verify_num_valid[0])
    (True, 7)
    """

    @public_api
    def __init__(self, capacities: CanaryCapacities, *, like: Array | None = None, swa_window_size: int = 0,
                 full_to_swa_index_mapping: Array | None = None, kv_token_id_vs_position_offset: int = 0):
        if not isinstance(capacities, CanaryCapacities):
            fail(TypeError, f"capacities must be a CanaryCapacities, got {type(capacities).__name__}; use CanaryCapacities.from_engine(...)")
        self.capacities = capacities
        if capacities.notes:
            warnings.warn("kv-canary: CanaryPlanner capacities were clamped: " + "; ".join(capacities.notes),
                          CanaryCapacityWarning, stacklevel=3)  # past public_api's wrapper
        self.verify_plan = VerifyPlan.allocate(capacities.verify_capacity, like=like)
        self.write_plan = WritePlan.allocate(capacities.write_req_capacity, like=like)
        self._like = self.verify_plan.enable
        self._placement = placement_of(self._like, "like")
        self._swa = (swa_window_size, full_to_swa_index_mapping, kv_token_id_vs_position_offset)
        self._overflow_reported = False
        self._launcher = PlanLauncher(
            self.verify_plan, self.write_plan, verify_capacity=capacities.verify_capacity,
            write_req_capacity=capacities.write_req_capacity, swa_window_size=swa_window_size,
            full_to_swa_index_mapping=full_to_swa_index_mapping,
            kv_token_id_vs_position_offset=kv_token_id_vs_position_offset)

    def __repr__(self) -> str:
        c = self.capacities
        window = f", swa_window_size={self.swa_window_size}" if self.swa_window_size else ""
        bound = "bound" if self._launcher._bound is not None else "not bound (every plan takes kc.plan)"
        return (f"<CanaryPlanner verify_capacity={c.verify_capacity}, write_req_capacity={c.write_req_capacity} "
                f"on {self._placement.describe()}{window}; plan launcher {bound}>")

    @property
    def swa_window_size(self) -> int:
        return self._swa[0]

    @property
    def full_to_swa_index_mapping(self):
        return self._swa[1]

    @property
    def kv_token_id_vs_position_offset(self) -> int:
        return self._swa[2]

    @classmethod
    @public_api
    def from_engine(cls, *, like: Array | None = None, swa_window_size: int = 0,
                    full_to_swa_index_mapping: Array | None = None, kv_token_id_vs_position_offset: int = 0,
                    **engine_numbers: int) -> "CanaryPlanner":
        """``CanaryPlanner(CanaryCapacities.from_engine(**engine_numbers), ...)``.

        Parameters
        ----------
        like, swa_window_size, full_to_swa_index_mapping, kv_token_id_vs_position_offset
            As for :class:`CanaryPlanner`.
        **engine_numbers : int
            The keywords of :meth:`CanaryCapacities.from_engine` (``kv_pool_size``,
            ``max_running_requests``, ...).

        Returns
        -------
        CanaryPlanner

        Examples
        --------
        >>> kc.CanaryPlanner.from_engine(kv_pool_size=1000, max_running_requests=64)
        <CanaryPlanner verify_capacity=3000, write_req_capacity=64 on numpy; plan launcher bound>
        """
        return cls(CanaryCapacities.from_engine(**engine_numbers), like=like, swa_window_size=swa_window_size,
                   full_to_swa_index_mapping=full_to_swa_index_mapping,
                   kv_token_id_vs_position_offset=kv_token_id_vs_position_offset)

    def _to_buffers(self, x, name: str):
        """``x`` on the buffers' device: used in place when it already is, copied otherwise."""
        if x is None:
            return None
        p = placement_of(x, name)
        if p.backend == self._placement.backend and p.device == self._placement.device:
            return x
        for where in (p, self._placement):
            refuse_during_capture(where, f"{name} is a {p.describe()} array and the planner's buffers are "
                                         f"{self._placement.describe()} arrays: kv-canary would copy it there",
                                  f"pass {name} on the buffers' device (copy it there before capturing)")
        if self._placement.backend == "numpy":
            return to_numpy(x)
        cupy = import_cupy()
        with cupy.cuda.Device(self._placement.device):
            host = to_numpy(x)
            if is_torch_tensor(self._like):
                return sys.modules["torch"].from_numpy(np.ascontiguousarray(host)).to(self._like.device)
            return cupy.asarray(host)

    def plan(self, req_pool_indices: Array | None, prefix_lens: Array, extend_seq_lens: Array, table: Any, *,
             req_to_verify_expected_tokens: Array | None = None,
             req_to_verify_expected_tokens_valid_lens: Array | None = None,
             strict: bool = False) -> tuple[VerifyPlan, WritePlan]:
        """Plan one step into the held buffers: :func:`kvcanary_cupy.plan` with ``out=`` them.

        Capture-safe when the inputs are on the buffers' device.

        Parameters
        ----------
        req_pool_indices, prefix_lens, extend_seq_lens, table
            As for :func:`kvcanary_cupy.plan` (``req_pool_indices`` is None with a
            :class:`~kvcanary_cupy.PagedKvIndices`); ``len(prefix_lens)`` at most
            ``write_req_capacity``.
        req_to_verify_expected_tokens, req_to_verify_expected_tokens_valid_lens, strict
            As for :func:`kvcanary_cupy.plan`.

        Returns
        -------
        (VerifyPlan, WritePlan)
            ``(self.verify_plan, self.write_plan)``.

        Raises
        ------
        TypeError, ValueError
            A bad argument, as :func:`kvcanary_cupy.plan` raises it.

        Examples
        --------
        See :class:`CanaryPlanner`.
        """
        try:
            if not strict and self._launcher(req_pool_indices, prefix_lens, extend_seq_lens, table,
                                             req_to_verify_expected_tokens, req_to_verify_expected_tokens_valid_lens):
                return self.verify_plan, self.write_plan
            conv = self._to_buffers
            return plan_step(
                conv(req_pool_indices, "req_pool_indices"), conv(prefix_lens, "prefix_lens"),
                conv(extend_seq_lens, "extend_seq_lens"), as_table(table).with_arrays(conv),
                verify_capacity=self.capacities.verify_capacity,
                write_req_capacity=self.capacities.write_req_capacity,
                swa_window_size=self.swa_window_size,
                full_to_swa_index_mapping=conv(self.full_to_swa_index_mapping, "full_to_swa_index_mapping"),
                req_to_verify_expected_tokens=conv(req_to_verify_expected_tokens, "req_to_verify_expected_tokens"),
                req_to_verify_expected_tokens_valid_lens=conv(req_to_verify_expected_tokens_valid_lens,
                                                              "req_to_verify_expected_tokens_valid_lens"),
                kv_token_id_vs_position_offset=self.kv_token_id_vs_position_offset,
                out=(self.verify_plan, self.write_plan),
                strict=strict,
            )
        except (TypeError, ValueError) as exc:  # public_api, inline: its wrapper costs ~0.15-0.3 us a call
            trimmed = trimmed_argument_error(exc)
            if trimmed is None:
                raise
            raise trimmed  # the same exception, its traceback ending here

    def verify_overflowed(self) -> bool:
        """Whether the last plan overflowed ``verify_capacity`` (its verify is then skipped).

        Reads one int from the device (a host sync); warns a :class:`CanaryCapacityWarning` once
        per planner on the first overflow.

        Returns
        -------
        bool

        Examples
        --------
        >>> planner = kc.CanaryPlanner(kc.CanaryCapacities(verify_capacity=4, write_req_capacity=1))
        >>> _ = planner.plan(np.array([2]), np.array([7]), np.array([1]), np.arange(64, dtype=np.int32).reshape(4, 16))
        >>> planner.verify_overflowed()  # 7 entries: its verify was skipped (and a warning says so)
        True
        """
        overflowed = int(to_numpy(self.verify_plan.enable)[0]) == 0
        if overflowed and not self._overflow_reported:
            self._overflow_reported = True
            warnings.warn(
                f"kv-canary: the verify plan overflowed verify_capacity={self.capacities.verify_capacity}: this step's "
                "verify is skipped; raise verify_headroom or kv_pool_size in CanaryCapacities.from_engine",
                CanaryCapacityWarning, stacklevel=2)
        return overflowed
