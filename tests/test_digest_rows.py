"""Canary rows riding with offloaded KV blocks (issue 24, docs/transfer.md "Offload tiers and
reload"): ``kc.copy_pages`` copies a request's rows into a staging buffer at offload and from it
into the pages a reload gives the request; the KV goes the same way.  At the new slots the rows
verify (TAIL verify, no restamp) and the receiver's digest MATCHes the digest taken before the
offload, on every backend; through the old table, now another owner's pages, both fail."""

import numpy as np

import kvcanary_cupy as kc
from conftest import get_backend_or_skip
from digest_pools import Model, build_pool, layout_of

PS, N = 4, 13  # a 13-token request on 4 pages of 4 slots
SPEC = kc.DigestSpec.full(3)


def _digest(ab, pool, model, table, *, receiver: bool):
    """Request 0's digest through ``table`` (sender: provenance from the rows; receiver: from its tokens)."""
    _, layout = layout_of(pool, model, ab)
    row = pool.rows[0]
    kw = {}
    if receiver:
        tokens = np.zeros(table.shape, np.int32)
        tokens[row, :N] = model.tokens[0]
        kw["expected_tokens"] = ab.asarray(tokens)
    out = kc.DigestBatch.allocate(1, like=ab.like)
    kc.digest_pages(layout, ab.asarray(table), ab.asarray(np.array([row], np.int64)), ab.asarray(np.zeros(1, np.int64)),
                    ab.asarray(np.array([N], np.int64)), spec=SPEC, sample_keys=ab.asarray(np.array([3], np.int64)),
                    records=pool.canary_on, out=out, **kw)
    return out


def _violations(ab, pool, table) -> int:
    vp, _ = kc.plan(ab.asarray(np.array([pool.rows[0]], np.int64)), ab.asarray(np.array([N], np.int64)),
                    ab.asarray(np.zeros(1, np.int64)), ab.asarray(table), verify_capacity=16)
    log = kc.ViolationLog.allocate(16, like=ab.like)
    kc.verify(pool.canary_on, vp, log=log)
    return log.read().total_violations


def test_offload_and_reload_verify_at_the_new_slots(ab):
    rng = np.random.default_rng(8)
    model = Model.random(rng, [N])
    pool = build_pool("sglang", model, page_size=PS, num_pages=12, rng=rng)
    pool.write(0, model)
    pool.stamp(0, model)
    row = pool.rows[0]
    rows_before = pool.canary.copy()
    pool.canary_on = get_backend_or_skip("numpy").asarray(pool.canary)
    sent = _digest(get_backend_or_skip("numpy"), pool, model, pool.table, receiver=False)  # before the offload

    pages = (pool.table[row, :N:PS] // PS).astype(np.int64)
    free = np.setdiff1d(np.arange(1, 12), pages)[: len(pages)]  # the reload lands in pages nobody held
    # The KV: offloaded to a host tier, the old pages reused by another owner, reloaded into `free`.
    tier = [[v[pages].copy() for v in layer] for layer in pool.views]
    for layer, kept in zip(pool.views, tier):
        for v, k in zip(layer, kept):
            v[pages] = rng.integers(0, 256, k.shape, dtype=np.uint8)
            v[free] = k
    # The rows, on the backend: offload to staging, the old pages' rows overwritten, reload into `free`.
    canary = pool.canary_on = ab.asarray(pool.canary)
    staging = kc.allocate_canary_buffer(len(pages) * PS, like=canary)
    workspace = kc.allocate_canary_buffer(len(pages) * PS, like=canary)  # capture-safe form: no allocation inside
    order = ab.asarray(np.arange(len(pages), dtype=np.int64))
    kc.copy_pages(canary, staging, ab.asarray(pages), order, page_size=PS, workspace=workspace)
    other = kc.allocate_canary_buffer(len(pages) * PS, like=canary)
    kc.copy_pages(other, canary, order, ab.asarray(pages), page_size=PS, workspace=workspace)
    count = ab.asarray(np.zeros(1, np.int64))
    kc.copy_pages(staging, canary, order, ab.asarray(free), page_size=PS, workspace=workspace, out_of_range_count=count)

    new_table = pool.table.copy()
    pos = np.arange(N)
    new_table[row, :N] = free[pos // PS] * PS + pos % PS
    old_slots, new_slots = pool.table[row, :N], new_table[row, :N]
    np.testing.assert_array_equal(ab.to_numpy(canary)[new_slots], rows_before[old_slots])  # the rows, at their new slots
    np.testing.assert_array_equal(ab.to_numpy(staging)[pos], rows_before[old_slots])  # copied, the staging source kept
    assert not ab.to_numpy(canary)[old_slots].any() and int(ab.to_numpy(count)[0]) == 0

    assert _violations(ab, pool, new_table) == 0
    got = _digest(ab, pool, model, new_table, receiver=True)
    expected = kc.DigestBatch.from_records(sent.to_records(), like=ab.like)
    log = kc.ViolationLog.allocate(4, num_kinds=kc.DIGEST_NUM_KINDS, like=ab.like)
    codes = kc.verify_digest(expected, got, log=log, kernel_kind=kc.DigestLaunchTag.RELOAD)
    assert ab.to_numpy(codes).tolist() == [kc.DigestVerdict.MATCH]
    np.testing.assert_array_equal(ab.to_numpy(got.records)[0, 5:], sent.records[0, 5:])  # kv, rec, words

    # A reload reported done through the old table reads the next owner's pages: both checks fail.
    assert _violations(ab, pool, pool.table) == N
    stale = _digest(ab, pool, model, pool.table, receiver=True)
    codes = kc.verify_digest(expected, stale, log=log, kernel_kind=kc.DigestLaunchTag.RELOAD)
    assert ab.to_numpy(codes).tolist() == [kc.DigestVerdict.MISMATCH_KV]
