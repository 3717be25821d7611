"""The transfer digest's fixed format (docs/transfer.md): constants, sampling spec, verdicts, wire record.

Everything here is host-side and pure: no array framework, no device.  The numbers are part of
format version 1; a test pins them (tests/test_digest_format.py) and ``kernels/digest.cu`` repeats
the ones the kernels use (tests/cuda/test_kernels_compile.py keeps both equal).
"""

from __future__ import annotations

import enum
import functools
import struct
from dataclasses import dataclass

from ..errors import fail, public_api
from ..hashing import splitmix64
from ..validation import check_int

DIGEST_FORMAT_VERSION = 1
DIGEST_HASH_ID = 1  # keyed splitmix64 sum
DIGEST_MAGIC = 0x4744564B  # b"KVDG" read as a little-endian uint32
DIGEST_SEED = 0x4B56444947455354  # b"KVDIGEST" as a big-endian uint64
DIGEST_WORD_STRIDE = 0x9E3779B97F4A7C15  # golden ratio: spreads the word index across the strip key
DIGEST_LAYER_ROTATION = 0x5A5A  # sample_key ^ this picks the first sampled layer
DIGEST_REC_LAYER = 0xFFFF  # the pseudo-layer of the provenance terms
DIGEST_MAX_LAYERS = DIGEST_REC_LAYER  # global layers are < 2**16 and never the pseudo-layer
DIGEST_MAX_HEADS = 1 << 15
DIGEST_MAX_POSITION = 1 << 32  # positions are < 2**32 (the low 32 bits of a coordinate)
DIGEST_RECORD_BYTES = 64
DIGEST_RECORD_FIELDS = 8  # int64 columns of a DigestBatch row: the wire record's bytes

# Flags of the wire record's header (bits of its u16 flags field).
FLAG_PRESENT = 1  # a digest was computed for this row
FLAG_RECORDS = 2  # the provenance component was computed
FLAG_FULL = 4  # every layer and every byte was hashed (spec.is_full)


class DigestVerdict(enum.IntEnum):
    """What :func:`verify_digest` concludes for one request; only ``MATCH`` passes.

    ``MATCH``: every component equal.  ``MISMATCH_KV``: the KV bytes (or the number of words
    hashed) differ: bytes that never landed, landed partly, landed in the wrong place or layout, or
    changed.  ``MISMATCH_PROVENANCE``: the bytes agree but the tokens, positions or chain seam they
    belong to do not (the sender digested another request's pages; the receiver's cached prefix
    belongs to other tokens).  ``MISSING``: no sender record, or either side hashed no word (an
    empty or fully out-of-range range): nothing was checked.  ``INCOMPARABLE``: the two digests
    were computed under different specs, layouts' compat fields, format versions, ranges or sample
    keys.  Precedence when several hold: MISSING > INCOMPARABLE > MISMATCH_KV >
    MISMATCH_PROVENANCE > MATCH.

    Examples
    --------
    >>> DigestVerdict(3).name
    'MISSING'
    """

    MATCH = 0
    MISMATCH_KV = 1
    MISMATCH_PROVENANCE = 2
    MISSING = 3
    INCOMPARABLE = 4


class DigestLaunchTag(enum.IntEnum):
    """The launch tags of digest verdicts in a :class:`ViolationLog`, after SGLang's twelve.

    A log that takes them needs ``num_kinds >= DIGEST_NUM_KINDS`` (15):
    ``kc.ViolationLog.allocate(num_kinds=kc.DIGEST_NUM_KINDS)``.  ``TRANSFER``: a prefill ->
    decode (or any peer) transfer; ``OFFLOAD``: a block written to a lower tier (host, disk) and
    checked there; ``RELOAD``: a block loaded back from a tier.

    Examples
    --------
    >>> int(DigestLaunchTag.TRANSFER)
    12
    """

    TRANSFER = 12
    OFFLOAD = 13
    RELOAD = 14


DIGEST_NUM_KINDS = 15


class DigestFailReason(enum.IntFlag):
    """The ``fail_reason_bits`` of a digest verdict's violation row, above SGLang's six bits.

    ``DIGEST_MISMATCH_KV`` (KV sum or word count differ), ``DIGEST_MISMATCH_REC`` (provenance
    sum differs), ``DIGEST_MISSING`` (no record, or no word hashed), ``DIGEST_INCOMPARABLE``
    (signature or version differ), ``DIGEST_RANGE`` (start, end or sample key differ; set with
    ``DIGEST_INCOMPARABLE``).

    Examples
    --------
    >>> int(DigestFailReason.DIGEST_MISMATCH_KV)
    64
    """

    DIGEST_MISMATCH_KV = 1 << 6
    DIGEST_MISMATCH_REC = 1 << 7
    DIGEST_MISSING = 1 << 8
    DIGEST_INCOMPARABLE = 1 << 9
    DIGEST_RANGE = 1 << 10


def header_word(flags: int, version: int = DIGEST_FORMAT_VERSION) -> int:
    """Column 0 of a record row: magic (bytes 0-3), version (4-5), flags (6-7), as a uint64."""
    return DIGEST_MAGIC | (version & 0xFFFF) << 32 | (flags & 0xFFFF) << 48


def _fold(values) -> int:
    h = 0
    for v in values:
        h = splitmix64(h ^ (int(v) & (2**64 - 1)))
    return h


def dtype_code(name: str) -> int:
    """A stable 64-bit code of a dtype name (``"bfloat16"``), for the signature."""
    return _fold(name.encode("utf-8"))


@dataclass(frozen=True)
class DigestSpec:
    """What a digest samples: the same spec on both sides, or the verdict is ``INCOMPARABLE``.

    Every position, every KV head and both halves of each sampled layer are always covered
    (sampling is token-complete); ``sample_layers`` and ``window_bytes`` pick how much of each.

    Parameters
    ----------
    num_layers_total : int
        The model's layer count (all pipeline stages), ``1 <= n < 2**16``: layers are sampled
        from it by their global index, so stages digesting their own layers sum to the whole.
    sample_layers : int
        Layers hashed per request, evenly spaced and rotated by the request's sample key; 0 (or
        ``>= num_layers_total``) hashes every layer.
    window_bytes : int
        Bytes hashed of each (layer, half, head, position) strip: an aligned window the sample key
        picks per layer; 0 (or at least the strip) hashes the whole strip.  A multiple of 8.
    records : bool
        Also compute the provenance component (tokens, positions, chain seam), read from the canary
        records (sender) or from the expected tokens (receiver).
    kv_token_id_vs_position_offset : int
        The receiver's expected token of position ``p`` is ``expected_tokens[row, p + offset]``
        (as :func:`plan`'s expected tokens).
    replicated : bool
        The KV is replicated across ranks (MLA, or GQA with TP above the KV-head count): compare
        per rank, never sum (part of the signature, so a summed and a replicated digest never
        compare).

    Raises
    ------
    TypeError, ValueError
        A field out of range; the message names it.

    Examples
    --------
    >>> spec = DigestSpec(num_layers_total=80)
    >>> spec.is_full, DigestSpec.full(80).is_full
    (False, True)
    """

    num_layers_total: int
    sample_layers: int = 2
    window_bytes: int = 32
    records: bool = True
    kv_token_id_vs_position_offset: int = 0
    replicated: bool = False

    @public_api
    def __post_init__(self):
        check_int(self.num_layers_total, "DigestSpec.num_layers_total", minimum=1, maximum=DIGEST_MAX_LAYERS - 1)
        check_int(self.sample_layers, "DigestSpec.sample_layers", minimum=0, maximum=DIGEST_MAX_LAYERS)
        window = check_int(self.window_bytes, "DigestSpec.window_bytes", minimum=0, maximum=2**30)
        if window % 8:
            fail(ValueError, f"DigestSpec.window_bytes must be a multiple of 8 bytes (words are hashed whole), got {window}")
        check_int(self.kv_token_id_vs_position_offset, "DigestSpec.kv_token_id_vs_position_offset",
                  minimum=-(2**31), maximum=2**31 - 1)
        for name in ("records", "replicated"):
            if not isinstance(getattr(self, name), bool):
                fail(TypeError, f"DigestSpec.{name} must be a bool, got {type(getattr(self, name)).__name__}")

    @classmethod
    def full(cls, num_layers_total: int, *, records: bool = True) -> "DigestSpec":
        """The FULL spec: every layer, every byte (``sample_layers=0, window_bytes=0``).

        Parameters
        ----------
        num_layers_total : int
            The model's layer count.
        records : bool
            Compute the provenance component too.
        """
        return cls(num_layers_total, sample_layers=0, window_bytes=0, records=records)

    @property
    def is_full(self) -> bool:
        return (self.sample_layers == 0 or self.sample_layers >= self.num_layers_total) and self.window_bytes == 0

    def signature(self, layout) -> int:
        """The nonzero 64-bit hash of every field two digests must share to be compared.

        Compat fields: format version, hash id, the layout's dtype, strip bytes, total KV heads and
        halves, this spec's fields.  Page size, physical layout (NHD/HND, strides), page ids and
        the layout's head or layer shard are *not* in it: the digest is defined on logical
        coordinates, so pools that differ in those compare.

        Parameters
        ----------
        layout : KvLayout
            The pool the digest reads.
        """
        return _signature(self, layout.dtype, layout.strip_bytes, layout.num_heads_total, layout.halves)

    def flags(self) -> int:
        """The header flags a digest under this spec carries (present, records, full)."""
        return FLAG_PRESENT | (FLAG_RECORDS if self.records else 0) | (FLAG_FULL if self.is_full else 0)


@functools.lru_cache(maxsize=256)  # a call's host time: every digest_pages call asks
def _signature(spec: DigestSpec, dtype: str, strip_bytes: int, num_heads_total: int, halves: int) -> int:
    return _fold((DIGEST_FORMAT_VERSION, DIGEST_HASH_ID, dtype_code(dtype), strip_bytes, num_heads_total, halves,
                  spec.num_layers_total, spec.sample_layers, spec.window_bytes, int(spec.records),
                  spec.kv_token_id_vs_position_offset, int(spec.replicated))) | 1


_RECORD = struct.Struct("<IHHQQqqQQQ")
assert _RECORD.size == DIGEST_RECORD_BYTES


@dataclass(frozen=True)
class DigestRecord:
    """One request's digest as it travels: 64 bytes, little-endian, format version 1.

    ``magic "KVDG" u32 | version u16 | flags u16 | signature u64 | sample_key u64 | start i64 |
    end i64 | kv u64 | rec u64 | words u64`` (docs/transfer.md, "The record").  The bytes are a
    :class:`DigestBatch` row's, so a sender ships ``batch.records[i]`` as it is and a receiver
    loads what arrived into the expected array of :func:`verify_digest`.

    Parameters
    ----------
    signature : int
        :meth:`DigestSpec.signature` of the sender's spec and layout (uint64).
    sample_key : int
        The request's sample key (uint64 bit pattern).
    start, end : int
        The positions ``[start, end)`` digested.
    kv, rec : int
        The KV and provenance sums (uint64).
    words : int
        KV words hashed; 0 means nothing was checked.
    flags : int
        Header flags (bit 0 present, bit 1 records, bit 2 full).
    version : int
        The format version, :data:`DIGEST_FORMAT_VERSION`.

    Raises
    ------
    ValueError
        A field that does not fit its width.

    Examples
    --------
    >>> r = DigestRecord(signature=1, sample_key=2, start=0, end=4, kv=5, rec=6, words=7)
    >>> DigestRecord.from_bytes(r.to_bytes()) == r, len(r.to_bytes())
    (True, 64)
    """

    signature: int
    sample_key: int
    start: int
    end: int
    kv: int
    rec: int
    words: int
    flags: int = FLAG_PRESENT | FLAG_RECORDS
    version: int = DIGEST_FORMAT_VERSION

    def __post_init__(self):
        for name, lo, hi in (("signature", 0, 2**64), ("sample_key", 0, 2**64), ("start", -(2**63), 2**63),
                             ("end", -(2**63), 2**63), ("kv", 0, 2**64), ("rec", 0, 2**64), ("words", 0, 2**64),
                             ("flags", 0, 2**16), ("version", 0, 2**16)):
            value = check_int(getattr(self, name), f"DigestRecord.{name}")
            if not lo <= value < hi:
                fail(ValueError, f"DigestRecord.{name} must be in [{lo}, {hi}), got {value}")

    def to_bytes(self) -> bytes:
        """The 64-byte wire form (little-endian)."""
        return _RECORD.pack(DIGEST_MAGIC, self.version, self.flags, self.signature, self.sample_key, self.start,
                            self.end, self.kv, self.rec, self.words)

    @classmethod
    @public_api
    def from_bytes(cls, buf) -> "DigestRecord":
        """Decode 64 bytes written by :meth:`to_bytes` (or a :class:`DigestBatch` row).

        Parameters
        ----------
        buf : bytes-like
            Exactly 64 bytes.

        Raises
        ------
        ValueError
            Another length, a wrong magic, or another format version.
        """
        buf = bytes(buf)
        if len(buf) != DIGEST_RECORD_BYTES:
            fail(ValueError, f"a DigestRecord is {DIGEST_RECORD_BYTES} bytes, got {len(buf)}")
        magic, version, flags, sig, key, start, end, kv, rec, words = _RECORD.unpack(buf)
        if magic != DIGEST_MAGIC:
            fail(ValueError, f"DigestRecord magic must be {DIGEST_MAGIC:#010x} (b'KVDG'), got {magic:#010x}")
        if version != DIGEST_FORMAT_VERSION:
            fail(ValueError, f"DigestRecord format version must be {DIGEST_FORMAT_VERSION}, got {version}; "
                             "the sender runs another kvcanary-cupy digest format")
        return cls(sig, key, start, end, kv, rec, words, flags, version)

    def to_row(self) -> list:
        """The record as the 8 int64 values of a :class:`DigestBatch` row (bit patterns)."""
        import numpy as np

        return np.frombuffer(self.to_bytes(), "<i8").tolist()

    @property
    def present(self) -> bool:
        return bool(self.flags & FLAG_PRESENT)
