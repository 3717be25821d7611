"""One decoded violation: a ring row of the log (docs/format.md section 5), with what a session
adds to it (repeats, steps, the batch rows that read the slot, rank and device), a replica
mismatch between ranks, and the names of launch tags and fail reasons."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, fields
from typing import NamedTuple

from .constants import CanaryLaunchTag, FailReason
from .hashing import to_unsigned

_WRITE_BITS = FailReason.WRITE_TOKEN_MISMATCH | FailReason.WRITE_POSITION_MISMATCH

#: What each fail reason means, in words (docs/guide.md explains which slot each one names).
REASON_WORDS = {
    FailReason.VERIFY_CHAIN_HASH_MISMATCH: "chain hash mismatch",
    FailReason.VERIFY_POSITION_MISMATCH: "position mismatch",
    FailReason.VERIFY_REAL_KV_HASH_MISMATCH: "real KV bytes changed",
    FailReason.WRITE_TOKEN_MISMATCH: "written token is not the expected input",
    FailReason.WRITE_POSITION_MISMATCH: "written position is not the expected one",
    FailReason.VERIFY_TOKEN_MISMATCH: "stored token is not the expected token",
    FailReason.WRITE_KV_NOT_STORED: "the forward did not store this slot's KV",
    FailReason.VERIFY_DEEP_KV_MISMATCH: "KV bytes of some layer changed",
    FailReason.VERIFY_TABLE_HOLE: "a read position's table entry addresses the padding slot",
}

def tag_name(kind: int) -> str:
    """The launch tag's name, or ``KIND_<n>`` for a kind past the 12 tags."""
    try:
        return CanaryLaunchTag(kind).name
    except ValueError:
        return f"KIND_{kind}"


def reason_members(bits: int) -> list:
    return [member for member in FailReason if int(bits) & member.value]


class Reader(NamedTuple):
    """One read of a violating slot (docs/guide.md, "Containment"): the session step (a sweep: the
    last step ended before it), the batch row (a sweep: the index of the swept sequence), the
    label the engine gave that row (``row_labels`` of ``pre_forward`` / ``sweep``; None where it
    gave none) and whether a sweep read it."""

    step: int
    batch_row: int
    row_label: int | str | None = None
    sweep: bool = False


def reason_name(member: FailReason) -> str:
    """``"verify_chain_hash"`` for VERIFY_CHAIN_HASH_MISMATCH: the names of ``FailReason.label``."""
    return FailReason.label(member.value)


@dataclass(frozen=True)
class Violation:
    """One decoded ring row (docs/format.md section 5); hashes are unsigned.

    The first eight fields are the row; the others are filled by a :class:`CanarySession`.

    Parameters
    ----------
    kernel_kind : int
        The launch tag of the launch that logged it (``launch_tag`` names it).
    slot_idx : int
        The slot verified or written.
    position : int
        Verify rows: the *stored* position; write rows: the position written.
    stored_token, expected_token : int
        The token in the record (or written) and the one expected (-1: verify rows whose token
        check is off or has no truth).
    stored_chain_hash : int
        The stored prev_hash (write rows: the running hash being written).
    expected_aux : int
        Verify rows: the expected chain hash; write rows: the expected position.
    fail_reason_bits : int
        The OR of :class:`FailReason` bits (``reasons`` names them).
    expected_position : int, optional
        Verify rows: the position the step's plan expected; write rows: ``expected_aux``.
    prev_slot_idx : int, optional
        Chain failures: the predecessor slot the chain was checked against; -1 = chain head.
    batch_rows : tuple of int
        The batch rows whose verify entries read the slot in the step it was first seen.
    repeats : int
        Ring rows with this violation's ``key``.
    first_step, last_step : int, optional
        The session steps it was first and last seen in.
    readers : tuple of Reader
        Every read of the slot that produced this violation, in every step it was seen in
        (repeats included), oldest first: the newest ``kvcanary_cupy.session.MAX_READERS`` of them.
    readers_dropped : int
        Older reads past that bound: counted, not kept.
    rank : int, optional
        The rank (in the session's ``process_group``) whose canary found it; None without a group.
    device : str, optional
        That rank's device, to join with ECC / Xid logs: ``"GPU-<uuid>"`` (as ``nvidia-smi -L``
        prints it) with the PCI bus id, or ``"cpu@<host>"``; None without a group.
    request_ids : tuple of str
        The engine's ids of the requests behind ``batch_rows`` (filled by an engine integration,
        :mod:`kvcanary_cupy.integrations`; empty where unknown).
    finding : str, optional
        What an engine integration knows the violation to be when it is the engine's own
        documented behaviour rather than corruption (docs/engines.md lists the labels); None:
        unexplained.

    Examples
    --------
    >>> v = Violation.from_row([2, 17, 4, 9, -1, 5, 6, 1])
    >>> v.launch_tag, v.reasons, v.expected_chain_hash
    ('TAIL_K_FULL', 'verify_chain_hash', 6)
    """

    kernel_kind: int
    slot_idx: int
    position: int
    stored_token: int
    expected_token: int
    stored_chain_hash: int
    expected_aux: int
    fail_reason_bits: int
    expected_position: int | None = None
    prev_slot_idx: int | None = None
    batch_rows: tuple = ()
    repeats: int = 1
    first_step: int | None = None
    last_step: int | None = None
    readers: tuple = ()
    readers_dropped: int = 0
    rank: int | None = None
    device: str | None = None
    request_ids: tuple = ()
    finding: str | None = None

    def __post_init__(self):
        if self.is_write and self.expected_position is None:
            object.__setattr__(self, "expected_position", self.expected_aux)
        if self.is_hole and self.expected_position is None:
            object.__setattr__(self, "expected_position", self.position)
        object.__setattr__(self, "batch_rows", tuple(int(r) for r in self.batch_rows))
        object.__setattr__(self, "readers", tuple(r if isinstance(r, Reader) else Reader(**r) if isinstance(r, dict)
                                                  else Reader(*r) for r in self.readers))
        object.__setattr__(self, "request_ids", tuple(str(r) for r in self.request_ids))

    @classmethod
    def from_row(cls, row: Sequence[int]) -> "Violation":
        """Decode one ring row: ``row`` is its 8 int64 values (hashes become unsigned)."""
        v = [int(x) for x in row]
        plain = bool(v[7] & _PLAIN_AUX)  # write rows carry a position in expected_aux, hole rows an entry index
        return cls(v[0], v[1], v[2], v[3], v[4], to_unsigned(v[5]), v[6] if plain else to_unsigned(v[6]), v[7])

    @property
    def key(self) -> tuple:
        """What makes two rows the same violation: ``(kernel_kind, slot_idx, position, fail_reason_bits)``."""
        return (self.kernel_kind, self.slot_idx, self.position, self.fail_reason_bits)

    @property
    def is_write(self) -> bool:
        return bool(self.fail_reason_bits & _WRITE_BITS)

    @property
    def is_hole(self) -> bool:
        """A hole row (``VERIFY_TABLE_HOLE``): ``position`` is the position read, ``expected_aux`` the
        plan's entry index; no record was checked."""
        return bool(self.fail_reason_bits & FailReason.VERIFY_TABLE_HOLE)

    @property
    def launch_tag(self) -> str:
        return tag_name(self.kernel_kind)

    @property
    def reasons(self) -> str:
        return FailReason.label(self.fail_reason_bits)

    @property
    def reason_words(self) -> str:
        return ", ".join(REASON_WORDS[m] for m in reason_members(self.fail_reason_bits)) or "none"

    @property
    def expected_chain_hash(self) -> int | None:
        return None if self.is_write or self.is_hole else self.expected_aux

    def format(self) -> str:
        """One log line, as SGLang's kv-canary prints a violation (a hole: its entry index)."""
        aux = (f"expected_position={self.expected_aux}" if self.is_write else f"entry={self.expected_aux}" if self.is_hole
               else f"expected_chain_hash={self.expected_aux:#018x}")
        where = "" if self.rank is None else f" rank={self.rank} device={self.device}"
        return (
            f"kv_canary violation: launch_tag={self.launch_tag} fail_reason={self.reasons} "
            f"slot_idx={self.slot_idx} position={self.position} stored_token={self.stored_token} "
            f"expected_token={self.expected_token} stored_chain_hash={self.stored_chain_hash:#018x} {aux}{where}"
        )

    def to_dict(self) -> dict:
        """The JSON-ready record: ``launch_tag``, ``reasons`` (names), then every field by name."""
        out = {"launch_tag": self.launch_tag, "reasons": [reason_name(m) for m in reason_members(self.fail_reason_bits)]}
        for f in fields(self):
            out[f.name] = getattr(self, f.name)
        out["batch_rows"] = list(self.batch_rows)
        out["readers"] = [r._asdict() for r in self.readers]
        out["request_ids"] = list(self.request_ids)
        return out

    @classmethod
    def from_dict(cls, d: dict) -> "Violation":
        """Inverse of :meth:`to_dict`: ``d`` holds the fields by name (derived keys are ignored)."""
        return cls(**{f.name: d[f.name] for f in fields(cls) if f.name in d})


_PLAIN_AUX = _WRITE_BITS | FailReason.VERIFY_TABLE_HOLE  # rows whose expected_aux is no hash
#: The kind of violation a replicated-KV comparison finds (docs/distributed.md).
REPLICATED_KV_MISMATCH = "replicated_kv_mismatch"


@dataclass(frozen=True)
class ReplicaMismatch:
    """A ``replicated_kv_mismatch``: one slot's TAIL real-KV fingerprint differs between two ranks
    that must hold identical KV (a session built with ``replicated_kv=True``).

    Parameters
    ----------
    slot_idx : int
        The canary (and KV pool) slot.
    rank, other_rank : int
        The rank whose fingerprint differs, and a rank holding the value most ranks hold (the
        lowest such rank); both ranks of the group.
    real_kv_hash, other_real_kv_hash : int
        Their fingerprints (unsigned).
    step : int
        The 0-based session step after which the fingerprints were compared.
    """

    slot_idx: int
    rank: int
    other_rank: int
    real_kv_hash: int
    other_real_kv_hash: int
    step: int

    @property
    def kind(self) -> str:
        """``"replicated_kv_mismatch"``: the violation kind, as reports and JSON name it."""
        return REPLICATED_KV_MISMATCH

    def format(self) -> str:
        """One log line naming the slot and both ranks."""
        return (f"kv_canary {REPLICATED_KV_MISMATCH}: slot_idx={self.slot_idx} rank={self.rank} "
                f"real_kv_hash={self.real_kv_hash:#018x} other_rank={self.other_rank} "
                f"other_real_kv_hash={self.other_real_kv_hash:#018x} step={self.step}")

    def to_dict(self) -> dict:
        """The JSON-ready record: ``kind``, then every field by name (hashes unsigned)."""
        return {"kind": REPLICATED_KV_MISMATCH, **{f.name: getattr(self, f.name) for f in fields(self)}}
