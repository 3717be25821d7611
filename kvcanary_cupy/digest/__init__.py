"""Transfer digests: relocation-invariant checksums of KV that moves (docs/transfer.md).

:class:`KvLayout` describes a pool, :class:`DigestSpec` what is sampled, :func:`digest_pages`
digests requests' KV into a :class:`DigestBatch` of 64-byte :class:`DigestRecord` rows,
:func:`verify_digest` compares two of them into :class:`DigestVerdict` codes (failing closed),
and :func:`restamp` writes canary records for received or reloaded positions.
"""

from .format import (DIGEST_FORMAT_VERSION, DIGEST_NUM_KINDS, DIGEST_RECORD_BYTES, DigestFailReason, DigestLaunchTag,
                     DigestRecord, DigestSpec, DigestVerdict)
from .layout import KvLayout
from .pages import DigestBatch, digest_pages
from .verdicts import restamp, verify_digest

__all__ = ["DIGEST_FORMAT_VERSION", "DIGEST_NUM_KINDS", "DIGEST_RECORD_BYTES", "DigestBatch", "DigestFailReason",
           "DigestLaunchTag", "DigestRecord", "DigestSpec", "DigestVerdict", "KvLayout", "digest_pages", "restamp",
           "verify_digest"]
