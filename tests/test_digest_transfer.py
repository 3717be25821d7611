"""A prefill -> decode transfer between two pools of different layouts, page sizes and page ids,
checked by digests (issue 24): the fault matrix, each with its verdict, in FULL and sampled
modes; hundreds of clean transfers all MATCH; restamp after a verified receive.

:func:`transfer` takes the sender's and the receiver's backends; its sides (:func:`setup`,
:func:`send`, :func:`receive`) also run in two processes over torch.distributed
(tests/transfer_harness.py: gloo on the host, NCCL between two GPUs).  Here the "link" is a host
copy of the sent positions; the faults are injected where it lands.
"""

import numpy as np
import pytest

import kvcanary_cupy as kc
from conftest import get_backend_or_skip
from digest_pools import Model, build_pool, layout_of

V = kc.DigestVerdict
SENDER, RECEIVER = ("vllm-NHD", 16), ("flashinfer-HND", 8)
FULL, SAMPLED = kc.DigestSpec.full(3), kc.DigestSpec(3)


def _tokens_pool(pool, model, override=None):
    t = np.zeros(pool.table.shape, np.int32)
    for r, toks in enumerate(model.tokens if override is None else override):
        t[pool.rows[r], : len(toks)] = toks
    return t


def sender_digest(ab, pool, model, spec, starts, ends, keys, table=None):
    tensors, layout = layout_of(pool, model, ab)
    rows = np.array(pool.rows, np.int64)
    out = kc.DigestBatch.allocate(len(rows), like=ab.like)
    kc.digest_pages(layout, ab.asarray(pool.table if table is None else table), ab.asarray(rows), ab.asarray(starts),
                    ab.asarray(ends), spec=spec, sample_keys=ab.asarray(keys),
                    records=ab.asarray(pool.canary) if spec.records else None, out=out)
    return out.to_bytes()  # the 64-byte records that travel with the transfer


def receiver_verdicts(ab, pool, model, spec, starts, ends, keys, wire, log):
    tensors, layout = layout_of(pool, model, ab)
    rows = np.array(pool.rows, np.int64)
    kw = {"records": ab.asarray(pool.canary), "expected_tokens": ab.asarray(_tokens_pool(pool, model))} if spec.records else {}
    actual = kc.DigestBatch.allocate(len(rows), like=ab.like)
    kc.digest_pages(layout, ab.asarray(pool.table), ab.asarray(rows), ab.asarray(starts), ab.asarray(ends), spec=spec,
                    sample_keys=ab.asarray(keys), out=actual, **kw)
    expected = kc.DigestBatch.from_records([None if w is None else w for w in wire], like=ab.like)
    codes = kc.verify_digest(expected, actual, log=log, kernel_kind=kc.DigestLaunchTag.TRANSFER)
    return [V(int(c)) for c in ab.to_numpy(codes)]


def sampled_byte(spec, key, strip, hit: bool):
    """A (layer, byte) the spec samples for sample key ``key`` (hit), or a byte of the same layer
    outside its window (which no request of that key hashes)."""
    from kvcanary_cupy.digest.reference import sampled_layers, window

    layer = sampled_layers(key, 3, spec.sample_layers)[0]
    w0, nw = window(key, layer, strip // 8, spec.window_bytes)
    if hit:
        return layer, w0 * 8 + 3
    outside = [b for b in range(strip) if not w0 * 8 <= b < (w0 + nw) * 8]
    return layer, outside[0]


def setup(seed: int, lengths):
    """A random model of requests of ``lengths`` and both pools: the sender's (vLLM-NHD, its KV and
    records written) and the receiver's (FlashInfer-HND, another page size, unrelated pages, a
    previous owner's noise).  Both ranks of a two-process transfer build the same from the seed."""
    rng = np.random.default_rng(seed)
    model = Model.random(rng, list(lengths), head_dim=32)  # 64-byte strips: two 32-byte windows
    n = len(lengths)
    keys = rng.integers(-2**63, 2**63 - 1, n)
    starts, ends = np.zeros(n, np.int64), np.array(lengths, np.int64)
    src = build_pool(SENDER[0], model, page_size=SENDER[1], num_pages=24, rng=rng)
    dst = build_pool(RECEIVER[0], model, page_size=RECEIVER[1], num_pages=40, rng=rng)
    for r in range(n):
        src.write(r, model)
        src.stamp(r, model)
    return model, keys, starts, ends, src, dst


def agreed_ranges(fault: str, starts, ends) -> None:
    """The ranges both sides agree on for ``fault`` (in place): a suffix transfer for "seam", an
    empty one for "empty"."""
    if fault == "seam":
        starts[0] = 10
    if fault == "empty":
        starts[0] = ends[0]


def send(send_ab, fault, spec, model, keys, starts, ends, src):
    """What the sender puts on the link: each request's KV ``[L, 2, n, H, strip]`` (what its table
    maps) and its 64-byte record (None: not sent)."""
    send_table, sent = src.table.copy(), model
    if fault == "wrong_owner":  # the sender maps request 0 onto request 1's pages and digests what it sends
        send_table[src.rows[0]] = src.table[src.rows[1]]
        sent = Model(model.num_layers, 2, model.num_heads, model.strip, model.dtype, [model.kv[1]] + model.kv[1:], model.tokens)
    n = len(model.tokens)
    wire = [bytes(b) for b in np.frombuffer(sender_digest(send_ab, src, model, spec, starts, ends, keys, send_table),
                                            np.uint8).reshape(n, 64)]
    if fault == "missing":
        wire[0] = None
    return [np.ascontiguousarray(sent.kv[r][:, :, : len(model.tokens[r])]) for r in range(n)], wire


def receive(recv_ab, fault, spec, model, keys, starts, ends, dst, payload, wire, log=None):
    """The receiver: lands what the link delivers (the faults of the link and of the receiver's
    own pool injected here), digests its own memory and compares; returns its verdicts and log."""
    if fault == "seam":  # a suffix transfer onto a cached prefix that belongs to other tokens
        other = model.tokens[0].copy()
        other[4] += 1
        dst.stamp(0, Model(3, 2, 2, model.strip, model.dtype, model.kv, [other]), upto=10)
    for r in range(len(model.tokens)):  # the link: positions [start, end) of what the sender sent
        pos = np.arange(starts[r], ends[r])
        if fault == "never_landed" and r == 0:
            continue
        if fault == "partial" and r == 0:
            pos = pos[: len(pos) // 2]
        if fault == "layout" and r == 0:  # NHD page bytes written as they are into HND pages
            nhd = payload[0]  # [L, 2, n, H, strip]
            for p0 in range(0, len(pos), dst.page_size):
                chunk = nhd[:, :, p0:p0 + dst.page_size]
                page = int(dst.table[dst.rows[0], p0]) // dst.page_size
                for l in range(3):
                    for c in range(2):
                        raw = np.zeros((dst.page_size, model.num_heads, model.strip), np.uint8)
                        raw[: chunk.shape[2]] = chunk[l, c]
                        dst.physical[l][page, c] = raw.reshape(model.num_heads, dst.page_size, model.strip)
            continue
        dst.write(r, model, pos, source=payload[r])
    if fault == "seam":
        dst.write(0, model, np.arange(10))  # the cached prefix's KV is right; its records are not
    if fault == "reordered":  # two of request 0's receiver pages swapped
        a, b = (int(dst.table[dst.rows[0], p]) // dst.page_size for p in (0, dst.page_size))
        for l in range(3):
            dst.physical[l][[a, b]] = dst.physical[l][[b, a]]
    if fault == "double_alloc":  # request 2's first page was also handed to request 0: 2's write lands on it
        dst.table[dst.rows[2], : dst.page_size] = dst.table[dst.rows[0], : dst.page_size]
        dst.write(2, model, np.arange(dst.page_size))
    if fault.startswith("bitflip"):
        hit = fault != "bitflip_miss"
        layer, byte = (0, 5) if spec.is_full else sampled_byte(spec, int(keys[0]), model.strip, hit)
        slot = int(dst.table[dst.rows[0], 7])
        dst.views[layer][1][slot // dst.page_size, slot % dst.page_size, 1, byte] ^= 0x10
    recv_spec = kc.DigestSpec(3, window_bytes=16) if fault == "incomparable" else spec
    log = log or kc.ViolationLog.allocate(32, num_kinds=kc.DIGEST_NUM_KINDS, like=recv_ab.like)
    return receiver_verdicts(recv_ab, dst, model, recv_spec, starts, ends, keys, wire, log), log


def transfer(send_ab, recv_ab, fault="clean", spec=FULL, *, seed=0, lengths=(37, 37, 53), log=None):
    """Send every request of a random model from the sender's pool to the receiver's (:func:`setup`),
    the link a host copy; return the receiver's verdicts and log."""
    model, keys, starts, ends, src, dst = setup(seed, lengths)
    agreed_ranges(fault, starts, ends)
    payload, wire = send(send_ab, fault, spec, model, keys, starts, ends, src)
    verdicts, log = receive(recv_ab, fault, spec, model, keys, starts, ends, dst, payload, wire, log)
    return verdicts, log, (dst, model, starts, ends, keys, wire)


FAULTS = [  # (fault, verdict of request 0 under FULL, under the default sampled spec)
    ("clean", V.MATCH, V.MATCH),
    ("never_landed", V.MISMATCH_KV, V.MISMATCH_KV),
    ("partial", V.MISMATCH_KV, V.MISMATCH_KV),
    ("wrong_owner", V.MISMATCH_PROVENANCE, V.MISMATCH_PROVENANCE),
    ("layout", V.MISMATCH_KV, V.MISMATCH_KV),
    ("reordered", V.MISMATCH_KV, V.MISMATCH_KV),
    ("double_alloc", V.MISMATCH_KV, V.MISMATCH_KV),
    ("seam", V.MISMATCH_PROVENANCE, V.MISMATCH_PROVENANCE),
    ("bitflip", V.MISMATCH_KV, V.MISMATCH_KV),  # sampled: the flipped byte lies in a sampled window
    ("bitflip_miss", V.MISMATCH_KV, V.MATCH),  # sampled: it does not (what sampling cannot see)
    ("missing", V.MISSING, V.MISSING),
    ("empty", V.MISSING, V.MISSING),
    ("incomparable", V.INCOMPARABLE, V.INCOMPARABLE),
]


@pytest.mark.parametrize("fault, full, sampled", FAULTS, ids=[f[0] for f in FAULTS])
def test_fault_matrix(ab, fault, full, sampled):
    for spec, want in ((FULL, full), (SAMPLED, sampled)):
        verdicts, log, _ = transfer(ab, ab, fault, spec, seed=len(fault))
        assert verdicts[0] == want, (fault, spec)
        assert verdicts[1] == (want if fault == "incomparable" else V.MATCH)  # a spec mismatch is every request's
        report = log.read()
        bad = [v for v in verdicts if v != V.MATCH]
        assert report.total_violations == len(bad)
        assert int(report.kernel_run_counters[kc.DigestLaunchTag.TRANSFER]) == 1
        rows = ab.to_numpy(log.ring)[: len(bad)]
        if want != V.MATCH:
            row = rows[0]
            assert (row[0], row[1]) == (kc.DigestLaunchTag.TRANSFER, -1)
            bits = {V.MISMATCH_KV: kc.DigestFailReason.DIGEST_MISMATCH_KV, V.MISSING: kc.DigestFailReason.DIGEST_MISSING,
                    V.MISMATCH_PROVENANCE: kc.DigestFailReason.DIGEST_MISMATCH_REC,
                    V.INCOMPARABLE: kc.DigestFailReason.DIGEST_INCOMPARABLE}[want]
            assert row[7] & bits


def test_a_sender_without_records_cannot_see_a_wrong_owner(ab):
    """Bytes only: the sender digests the pages it sends, so a wrong mapping passes (docs/transfer.md)."""
    spec = kc.DigestSpec(3, records=False)
    verdicts, _, _ = transfer(ab, ab, "wrong_owner", spec, seed=4)
    assert verdicts[0] == V.MATCH


def test_hundreds_of_clean_transfers_all_match(ab):
    rounds = 120 if ab.name == "numpy" else 40
    rng = np.random.default_rng(77)
    log = kc.ViolationLog.allocate(8, num_kinds=kc.DIGEST_NUM_KINDS, like=ab.like)
    checked = 0
    for i in range(rounds):
        lengths = tuple(int(x) for x in rng.integers(1, 60, 3))
        spec = (FULL, SAMPLED, kc.DigestSpec(3, sample_layers=1, window_bytes=8))[i % 3]
        verdicts, _, _ = transfer(ab, ab, "clean", spec, seed=1000 + i, lengths=lengths, log=log)
        assert verdicts == [V.MATCH] * 3, (i, lengths)
        checked += 3
    assert log.read().total_violations == 0 and checked >= 120


def test_cpu_and_gpu_sides_agree(gpu_ab):
    """A GPU sender and a CPU receiver (an offload to a host tier), and the reverse."""
    cpu = get_backend_or_skip("numpy")
    for send, recv in ((gpu_ab, cpu), (cpu, gpu_ab)):
        for fault, want in (("clean", V.MATCH), ("partial", V.MISMATCH_KV), ("bitflip", V.MISMATCH_KV)):
            verdicts, _, _ = transfer(send, recv, fault, FULL, seed=9)
            assert verdicts[0] == want


def test_restamp_after_a_verified_receive(ab):
    """The receiver restamps the received positions: its records then chain like the sender's, so a
    sender-mode digest of the receiver's pool gives the sender's record and kc.verify passes."""
    verdicts, log, (dst, model, starts, ends, keys, wire) = transfer(ab, ab, "clean", FULL, seed=21)
    assert verdicts == [V.MATCH] * 3
    canary = ab.asarray(dst.canary)
    tensors, layout = layout_of(dst, model, ab)
    rows = np.array(dst.rows, np.int64)
    missed = kc.restamp(canary, ab.asarray(dst.table), ab.asarray(rows), ab.asarray(starts), ab.asarray(ends),
                        ab.asarray(_tokens_pool(dst, model)), log=log)
    assert missed == 0
    again = kc.digest_pages(layout, ab.asarray(dst.table), ab.asarray(rows), ab.asarray(starts), ab.asarray(ends),
                            spec=FULL, sample_keys=ab.asarray(keys), records=canary)
    assert again.to_bytes() == b"".join(wire)  # the sender's records, bit for bit
    host = ab.to_numpy(canary)
    for r, toks in enumerate(model.tokens):
        slots = dst.table[dst.rows[r], : len(toks)]
        assert host[slots, 0].tolist() == toks.tolist() and host[slots, 1].tolist() == list(range(len(toks)))
    vp, _ = kc.plan(ab.asarray(rows), ab.asarray(ends), ab.asarray(np.zeros(3, np.int64)), ab.asarray(dst.table),
                    verify_capacity=256)
    vlog = kc.ViolationLog.allocate(16, like=ab.like)
    kc.verify(canary, vp, log=vlog)
    assert vlog.read().total_violations == 0


def test_a_failed_transfer_is_retried_until_it_matches(ab):
    """Abort -> resend -> MATCH: the receiver re-digests its memory after each attempt, and only the
    complete resend passes; the log holds the failed attempt's row only."""
    verdicts, log, (dst, model, starts, ends, keys, wire) = transfer(ab, ab, "partial", FULL, seed=13)
    assert verdicts[0] == V.MISMATCH_KV and verdicts[1:] == [V.MATCH, V.MATCH]
    for attempt, landed in ((1, 20), (2, len(model.tokens[0]))):  # a second partial resend, then a complete one
        dst.write(0, model, np.arange(landed))
        again = receiver_verdicts(ab, dst, model, FULL, starts, ends, keys, wire, log)
        assert again[0] == (V.MATCH if landed == len(model.tokens[0]) else V.MISMATCH_KV), attempt
    report = log.read()
    assert report.total_violations == 2 and int(report.kernel_run_counters[kc.DigestLaunchTag.TRANSFER]) == 3
