"""Constants and enums of the kv-canary format (docs/format.md).

Values are part of the on-device format: canary buffers and violation rows written by
kvcanary-cupy mean the same thing as those written by SGLang's kv-canary.  The CUDA header
``kernels/canary_common.cuh`` repeats them; a test keeps both in sync.
"""

from __future__ import annotations

import enum

CANARY_CHAIN_ANCHOR = 0xC0FFEE1234567890
REQ_POOL_IDX_PADDING = 0
TOKEN_TO_KV_SLOT_PADDING = 0

CANARY_FIELDS_PER_SLOT = 4
CANARY_FIELD_TOKEN = 0
CANARY_FIELD_POSITION = 1
CANARY_FIELD_PREV_HASH = 2
CANARY_FIELD_REAL_KV_HASH = 3
CANARY_SLOT_BYTES = 32

VIOLATION_FIELDS = 8
VIOLATION_FIELD_KERNEL_KIND = 0
VIOLATION_FIELD_SLOT_IDX = 1
VIOLATION_FIELD_POSITION = 2
VIOLATION_FIELD_STORED_TOKEN = 3
VIOLATION_FIELD_EXPECTED_TOKEN = 4
VIOLATION_FIELD_STORED_CHAIN_HASH = 5
VIOLATION_FIELD_EXPECTED_AUX = 6
VIOLATION_FIELD_FAIL_REASON_BITS = 7

# Real-KV sources of one canary buffer (SGLang's ABI took 4; raised for strided per-head and per-layer sources).
MAX_REAL_KV_SOURCES = 8
# (count, stride) levels of a strided source's pieces (RealKvSource.pieces; kMaxPieceLevels).
MAX_PIECE_LEVELS = 2
REAL_KV_SOURCE_FIELDS_PER_ENTRY = 3
REAL_KV_SOURCE_FIELD_PAGE_SIZE = 0
REAL_KV_SOURCE_FIELD_NUM_BYTES_PER_TOKEN = 1
REAL_KV_SOURCE_FIELD_READ_BYTES = 2
REAL_KV_PARTIAL_BYTES = 16

# Canary buffers one write or verify launch takes with one plan (e.g. the K and V halves).
MAX_CANARY_BUFFERS = 4

SPLITMIX64_MUL1 = 0xBF58476D1CE4E5B9
SPLITMIX64_MUL2 = 0x94D049BB133111EB
SPLITMIX64_SHIFT1 = 30
SPLITMIX64_SHIFT2 = 27
SPLITMIX64_SHIFT3 = 31

#: ``splitmix64(CANARY_CHAIN_ANCHOR)``: the prev_hash every chain head must carry.
CANARY_CHAIN_ANCHOR_HASH = 0xDE7FAE23A9A1B716

DEFAULT_RING_CAPACITY = 1024


class FailReason(enum.IntFlag):
    """Bits of the ``fail_reason_bits`` column of a violation row (docs/format.md section 6).

    A verify row ORs every check its slot failed: ``VERIFY_CHAIN_HASH_MISMATCH`` (prev_hash is not
    :func:`mix3` of the predecessor's record), ``VERIFY_POSITION_MISMATCH`` (the stored position is
    not the expected one), ``VERIFY_REAL_KV_HASH_MISMATCH`` (the KV bytes changed since the
    write), ``VERIFY_TOKEN_MISMATCH`` (the stored token is not the expected token).  A write row
    carries ``WRITE_TOKEN_MISMATCH`` / ``WRITE_POSITION_MISMATCH`` (the input or chain-position
    asserts of :func:`write`).  ``VERIFY_TABLE_HOLE`` is this project's own bit (the six above are
    SGLang's): a position the step reads whose table entry addresses the padding slot (a zeroed
    entry, a block table's null block), logged only by verifies asked to (``check_holes``); its row
    layout is docs/format.md's "hole row".  Reports name a bit by :meth:`label` (``"verify_chain_hash"``).

    Examples
    --------
    >>> FailReason.label(FailReason.VERIFY_CHAIN_HASH_MISMATCH | FailReason.VERIFY_POSITION_MISMATCH)
    'verify_chain_hash+verify_position'
    """

    VERIFY_CHAIN_HASH_MISMATCH = 1 << 0
    VERIFY_POSITION_MISMATCH = 1 << 1
    VERIFY_REAL_KV_HASH_MISMATCH = 1 << 2
    WRITE_TOKEN_MISMATCH = 1 << 3
    WRITE_POSITION_MISMATCH = 1 << 4
    VERIFY_TOKEN_MISMATCH = 1 << 5
    # This project's coverage past the record (docs/format.md section 9), logged only when a
    # CanarySession is asked to (check_lost_stores, deep_kv_sources); SGLang's six bits unchanged.
    # Above the transfer digests' bits (DigestFailReason, 1 << 6 to 1 << 10), below the table-hole bit.
    WRITE_KV_NOT_STORED = 1 << 11
    VERIFY_DEEP_KV_MISMATCH = 1 << 12
    VERIFY_TABLE_HOLE = 1 << 16  # bits 6-10 are the transfer digest's (DigestFailReason)

    @staticmethod
    def label(bits: int) -> str:
        """The names of the set bits of ``bits``, lower case without ``_mismatch``, joined by ``+``.

        ``"verify_chain_hash+verify_position"`` style; ``"none"`` for 0.  These are the
        ``reasons`` of :meth:`Violation.to_dict` and the keys of ``rows_by_reason``.
        """
        bits = int(bits)
        found = _LABELS.get(bits)
        if found is None:  # an enum walk costs ~20 us: a step decoding findings asks for the same few
            names = [member.name.lower().removesuffix("_mismatch") for member in FailReason if bits & member.value]
            found = "+".join(names) if names else "none"
            if len(_LABELS) < 4096:
                _LABELS[bits] = found
        return found


_LABELS: dict = {}  # FailReason.label's, by bits


class RealKvHashMode(enum.IntEnum):
    """How much of each slot's real KV bytes is folded into ``real_kv_hash``.

    ``NONE``: nothing (the field is 0); ``PARTIAL``: the first 16 bytes of each
    :class:`RealKvSource` strip; ``ALL``: ``read_bytes`` bytes of each strip.  The write and the
    verify of one buffer must use the same mode.

    Examples
    --------
    >>> RealKvHashMode(1)
    <RealKvHashMode.PARTIAL: 1>
    """

    NONE = 0
    PARTIAL = 1  # the first 16 bytes of each source strip
    ALL = 2  # ``read_bytes`` bytes of each source strip


class CanaryLaunchTag(enum.IntEnum):
    """Launch tags: stamped into violation rows and used as counter index (``kernel_kind``).

    ``HEAD`` launches run before the model's forward, ``TAIL`` after it (with real-KV
    fingerprints), ``SWEEP`` over cached sequences outside the forward; ``K`` / ``V`` name the
    buffer (the K or V half), ``FULL`` / ``SWA`` the attention group.  Any int in ``[0,
    log.num_kinds)`` is accepted as a ``kernel_kind``; reports name kinds past the tags ``KIND_<n>``.

    Examples
    --------
    >>> int(CanaryLaunchTag.TAIL_K_FULL), CanaryLaunchTag(8).name
    (2, 'TAIL_K_SWA')
    """

    HEAD_K_FULL = 0
    HEAD_V_FULL = 1
    TAIL_K_FULL = 2
    TAIL_V_FULL = 3
    SWEEP_K_FULL = 4
    SWEEP_V_FULL = 5
    HEAD_K_SWA = 6
    HEAD_V_SWA = 7
    TAIL_K_SWA = 8
    TAIL_V_SWA = 9
    SWEEP_K_SWA = 10
    SWEEP_V_SWA = 11


NUM_LAUNCH_TAGS = len(CanaryLaunchTag)
