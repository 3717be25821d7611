"""CanarySession: the KV canary inside an engine's step loop.

Per step, an engine calls :meth:`CanarySession.pre_forward` before the model reads the KV cache
(plan, HEAD verify, HEAD write), :meth:`~CanarySession.post_forward` after it (TAIL verify and
write, with real-KV fingerprints) and :meth:`~CanarySession.end_step` outside any CUDA graph, which
stages the step's log and hands the violations of earlier steps to the ``on_violation`` policy.

The package has three rooms: :mod:`.loop` (the class and its step loop), :mod:`.staging` (the
records and their transport to the host) and :mod:`.violations` (bookkeeping, report and policy).
"""

from .loop import VERIFY_HEADROOM, CanarySession
from .staging import STAGED_RECORDS
from .violations import LOG_SUMMARY_AT, MAX_DISTINCT_VIOLATIONS, MAX_READERS, MESSAGE_MAX_LINES, POLICIES, RING_GROUPS

__all__ = ["CanarySession", "LOG_SUMMARY_AT", "MAX_DISTINCT_VIOLATIONS", "MAX_READERS", "MESSAGE_MAX_LINES", "POLICIES",
           "RING_GROUPS", "STAGED_RECORDS", "VERIFY_HEADROOM"]
