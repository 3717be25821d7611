"""Transfer digests: relocation-invariant checksums of KV that moves (docs/transfer.md).

:class:`KvLayout` describes a pool, :class:`DigestSpec` what is sampled, :func:`digest_pages`
digests requests' KV into a :class:`DigestBatch` of 64-byte :class:`DigestRecord` rows,
:func:`verify_digest` compares two of them into :class:`DigestVerdict` codes (failing closed),
and :func:`restamp` writes canary records for received or reloaded positions, and :func:`copy_pages`
copies canary rows between buffers with the KV blocks they describe.
"""

from .format import (DIGEST_FORMAT_VERSION, DIGEST_NUM_KINDS, DIGEST_RECORD_BYTES, DigestFailReason, DigestLaunchTag,
                     DigestRecord, DigestSpec, DigestVerdict)
from .layout import KvLayout
from .pages import DigestBatch, digest_pages
from .rows import copy_pages
from .verdicts import restamp, verify_digest

__all__ = ["DIGEST_FORMAT_VERSION", "DIGEST_NUM_KINDS", "DIGEST_RECORD_BYTES", "DigestBatch", "DigestFailReason",
           "DigestLaunchTag", "DigestRecord", "DigestSpec", "DigestVerdict", "KvLayout", "copy_pages", "digest_pages", "restamp",
           "verify_digest"]
