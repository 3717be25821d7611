"""The digest's memo of its last eager call: :class:`~kvcanary_cupy.last_call.LastCall`, which
``digest_pages`` and ``verify_digest`` use (one each) and ``kc.verify`` / ``kc.write`` share."""

# Why the digest keeps to LastCall and not validation_cache.py's CachedCall (looked at, kept apart
# on purpose; the canary ops kc.verify and kc.write now use both: the memo first, the cache when it misses):
# - Cost: the cache stamps every array inside every record argument by value, per call; a KvLayout
#   holds one tensor per layer and half, so a 64-layer pool would stamp 128 tensors (~1 us each
#   for torch) where this memo compares the layout object by identity and stamps only the index
#   arrays named at put().
# - What it saves: the cache keeps checked views and still checks and views the per-step arrays
#   every call; this memo replays the packed launches and checks nothing, the point of it.
# - Lifetime: the cache keeps its entries on an owner record (strong references to views of the
#   caller's arrays for as long as the record lives); this memo holds weak references only
#   (tests/test_digest_replay.py: the memo keeps no array alive).
# - Switches: KVCANARY_FULL_VALIDATION turns the cache off; the digest never read it, and only
#   ``strict`` or ``out=None`` skip its memo (the canary ops also skip theirs under the variable).

from __future__ import annotations

from ..last_call import LastCall, _stamp

__all__ = ["LastCall", "_stamp"]
