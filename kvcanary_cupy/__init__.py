"""kvcanary-cupy: a KV-cache integrity checker (kv-canary) for paged-attention inference engines.

Next to every KV slot the canary keeps a record ``(token, position, prev_hash, real_kv_hash)``
chained by a hash along each sequence.  Every step, :func:`plan` lists the slots the step reads
and writes (through the engine's own table: :class:`ReqToToken`, :class:`BlockTable` or
:class:`PagedKvIndices`), :func:`write` stamps fresh records for the new tokens and
:func:`verify` checks the records of every slot read, logging violations into a device-side
ring (:class:`ViolationLog`); :func:`plan_and_verify` plans and verifies in one launch.
:func:`move_pages` moves canary rows with moved KV pages.

NumPy arrays run on the CPU backend; CuPy arrays and CUDA torch tensors run the CUDA kernels;
both compute the same bytes.  Importing this package needs neither CuPy nor PyTorch.
:class:`CanarySession` runs all of it inside an engine's step loop and reports what it finds.

``help(kc.<name>)`` documents each public name; docs/api.md lists them all, grouped.
"""

from .constants import (
    CANARY_CHAIN_ANCHOR,
    CANARY_CHAIN_ANCHOR_HASH,
    CANARY_FIELD_POSITION,
    CANARY_FIELD_PREV_HASH,
    CANARY_FIELD_REAL_KV_HASH,
    CANARY_FIELD_TOKEN,
    CANARY_FIELDS_PER_SLOT,
    CANARY_SLOT_BYTES,
    MAX_CANARY_BUFFERS,
    MAX_REAL_KV_SOURCES,
    NUM_LAUNCH_TAGS,
    REQ_POOL_IDX_PADDING,
    TOKEN_TO_KV_SLOT_PADDING,
    VIOLATION_FIELDS,
    CanaryLaunchTag,
    FailReason,
    RealKvHashMode,
)
from .digest import (DIGEST_FORMAT_VERSION, DIGEST_NUM_KINDS, DIGEST_RECORD_BYTES, DigestBatch, DigestFailReason,
                     DigestLaunchTag, DigestRecord, DigestSpec, DigestVerdict, KvLayout, digest_pages, restamp,
                     verify_digest)
from .errors import CanaryCoverageWarning, CanaryHealthError, CanaryUsageError, CanaryViolationError
from .hashing import ANCHOR_HASH, mix3, real_kv_fold, splitmix64, to_signed, to_unsigned
from .runtime import join_stream
from .backends.cuda.compile import warmup
from .launchers import VerifyLauncher, WriteLauncher
from .ops import copy_pages, move_pages, plan, plan_and_verify, scatter_req_token_ids, verify, write
from .planner import CanaryCapacities, CanaryCapacityWarning, CanaryPlanner
from .log import ViolationLog
from .plans import RealKvSource, VerifyPlan, WritePlan, allocate_canary_buffer
from .reporting import Reader, ReplicaMismatch, Violation, ViolationReport
from .same_step import SameStepReads, resolve_same_step_reads
from .session import CanarySession
from .tables import BlockTable, PagedKvIndices, ReqToToken
from . import distributed, metrics  # submodules: kc.distributed.REPLICATED_WINDOW, kc.metrics.SessionMetrics

__version__ = "0.1.0"

__all__ = [
    "ANCHOR_HASH",
    "CANARY_CHAIN_ANCHOR",
    "CANARY_CHAIN_ANCHOR_HASH",
    "CANARY_FIELD_POSITION",
    "CANARY_FIELD_PREV_HASH",
    "CANARY_FIELD_REAL_KV_HASH",
    "CANARY_FIELD_TOKEN",
    "CANARY_FIELDS_PER_SLOT",
    "CANARY_SLOT_BYTES",
    "DIGEST_FORMAT_VERSION",
    "DIGEST_NUM_KINDS",
    "DIGEST_RECORD_BYTES",
    "MAX_CANARY_BUFFERS",
    "MAX_REAL_KV_SOURCES",
    "NUM_LAUNCH_TAGS",
    "REQ_POOL_IDX_PADDING",
    "TOKEN_TO_KV_SLOT_PADDING",
    "VIOLATION_FIELDS",
    "BlockTable",
    "CanaryCapacities",
    "CanaryHealthError",
    "CanaryCapacityWarning",
    "CanaryCoverageWarning",
    "CanaryLaunchTag",
    "CanaryPlanner",
    "CanarySession",
    "CanaryUsageError",
    "CanaryViolationError",
    "DigestBatch",
    "DigestFailReason",
    "DigestLaunchTag",
    "DigestRecord",
    "DigestSpec",
    "DigestVerdict",
    "KvLayout",
    "FailReason",
    "PagedKvIndices",
    "RealKvHashMode",
    "Reader",
    "RealKvSource",
    "ReplicaMismatch",
    "ReqToToken",
    "SameStepReads",
    "VerifyLauncher",
    "VerifyPlan",
    "Violation",
    "ViolationLog",
    "ViolationReport",
    "WriteLauncher",
    "WritePlan",
    "allocate_canary_buffer",
    "copy_pages",
    "digest_pages",
    "join_stream",
    "mix3",
    "move_pages",
    "plan",
    "plan_and_verify",
    "real_kv_fold",
    "resolve_same_step_reads",
    "restamp",
    "scatter_req_token_ids",
    "splitmix64",
    "to_signed",
    "to_unsigned",
    "verify",
    "verify_digest",
    "warmup",
    "write",
]
