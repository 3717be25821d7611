"""Shared builders and independent pure-Python oracles for the kv-canary test suite.

Everything here is written from the format (docs/format.md) and the README's rules, not from
the library: the hash primitives, the real-KV fold and the plan / write / verify oracles are plain
per-request / per-entry loops over Python ints.  Tests build their inputs in NumPy, move them
to the backend under test with ``ab.asarray`` and compare ``ab.to_numpy`` of every output
against these oracles.
"""

from __future__ import annotations

from collections import Counter

import numpy as np

from kvcanary_cupy import VerifyPlan, ViolationLog, WritePlan
from kvcanary_cupy.devtools.spin import spin  # noqa: F401 - the tests' stand-in GPU work

# ---------------------------------------------------------------------------------------------
# hash primitives (docs/format.md §2), independent of kvcanary_cupy.hashing

MASK64 = (1 << 64) - 1
ANCHOR = 0xC0FFEE1234567890


def sm64(x: int) -> int:
    x &= MASK64
    x ^= x >> 30
    x = (x * 0xBF58476D1CE4E5B9) & MASK64
    x ^= x >> 27
    x = (x * 0x94D049BB133111EB) & MASK64
    x ^= x >> 31
    return x


def hmix3(a: int, b: int, c: int) -> int:
    h = sm64(a)
    h = sm64(h ^ (b & MASK64))
    return sm64(h ^ (c & MASK64))


def signed(u: int) -> int:
    u &= MASK64
    return u - (1 << 64) if u >= 1 << 63 else u


def unsigned(v: int) -> int:
    return int(v) & MASK64


ANCHOR_H = sm64(ANCHOR)  # 0xDE7FAE23A9A1B716
ANCHOR_S = signed(ANCHOR_H)

# fail-reason bits as literals (docs/format.md §6), so tests do not take them from the library
CHAIN, POSITION, REAL_KV, WRITE_TOKEN, WRITE_POSITION, TOKEN = 1, 2, 4, 8, 16, 32


def record_hash(rec) -> int:
    """slot_hash of a stored record ``(token, position, prev_hash, ...)``: mix3(prev, token, pos)."""
    return hmix3(int(rec[2]), int(rec[0]), int(rec[1]))


def chain(tokens, positions, start_hash: int = ANCHOR_H):
    """Stored prev_hashes (unsigned) of a chain written in order, and the next running value."""
    out, running = [], start_hash
    for t, p in zip(tokens, positions):
        out.append(running)
        running = hmix3(running, int(t), int(p))
    return out, running


def fold_strips(strips) -> int:
    """Real-KV fold (docs/format.md §3) of one ``bytes`` strip per source, in source order."""
    acc = 0
    for strip in strips:
        strip = bytes(strip)
        h = 0
        for i in range(0, len(strip), 8):
            h = sm64(h ^ int.from_bytes(strip[i : i + 8], "little"))
        acc = sm64(acc ^ h)
    return acc


class HostSource:
    """A real-KV source seen from the oracle: ``data`` is ``uint8 [rows, row_bytes]`` (NumPy)."""

    def __init__(self, data: np.ndarray, page_size: int, nbpt: int, read_bytes: int):
        self.data = np.ascontiguousarray(data).view(np.uint8).reshape(data.shape[0], -1)
        self.page_size, self.nbpt, self.read_bytes = page_size, nbpt, read_bytes

    def strip(self, slot: int, nbytes: int) -> bytes:
        row, col = slot // self.page_size, (slot % self.page_size) * self.nbpt
        return self.data[row, col : col + nbytes].tobytes()


def real_kv(sources, mode, slot: int) -> int:
    """Expected real_kv_hash (unsigned) of ``slot``; 0 for NONE or no sources."""
    mode = int(mode)
    if mode == 0 or not sources:
        return 0
    return fold_strips(s.strip(slot, 16 if mode == 1 else s.read_bytes) for s in sources)


# ---------------------------------------------------------------------------------------------
# array builders


def linear_rtt(rows: int, max_seq_len: int) -> np.ndarray:
    """``req_to_token[rp, p] = rp * max_seq_len + p`` (int32), the "linear" table of the worked examples."""
    return (np.arange(rows, dtype=np.int64)[:, None] * max_seq_len + np.arange(max_seq_len)).astype(np.int32)


def i64(values) -> np.ndarray:
    return np.asarray(values, dtype=np.int64)


def canary(num_slots: int, records=None) -> np.ndarray:
    """A host canary buffer ``int64 [num_slots, 4]``; ``records`` maps slot -> (tok, pos, prev[, rkv])."""
    buf = np.zeros((num_slots, 4), np.int64)
    for slot, rec in (records or {}).items():
        rec = list(rec) + [0] * (4 - len(rec))
        buf[slot] = [signed(v) if v > 0 else v for v in rec]
    return buf


def stamp_chain(buf: np.ndarray, slots, tokens, positions, start_hash: int = ANCHOR_H) -> None:
    """Write a clean chain into a host buffer (in place)."""
    hashes, _ = chain(tokens, positions, start_hash)
    for s, t, p, h in zip(slots, tokens, positions, hashes):
        buf[s, :4] = [t, p, signed(h), 0]


def make_log(ab, capacity: int = 1024, num_kinds: int = 12) -> ViolationLog:
    return ViolationLog.allocate(capacity, num_kinds, like=ab.like)


def make_write_plan(ab, offsets, seeds, num_valid=None, capacity=None) -> WritePlan:
    """A caller-built WritePlan: ``offsets`` has len(seeds)+1 entries (zero-padded to capacity+1)."""
    cap = len(seeds) if capacity is None else capacity
    off = np.zeros(cap + 1, np.int64)
    off[: len(offsets)] = offsets
    sd = np.full(cap, -1, np.int64)
    sd[: len(seeds)] = seeds
    nv = len(seeds) if num_valid is None else num_valid
    return WritePlan(
        write_offsets=ab.asarray(off),
        write_seed_slot_indices=ab.asarray(sd),
        write_num_valid_reqs=ab.asarray(np.array([nv], np.int32)),
        verify_offsets=ab.asarray(np.zeros(cap + 1, np.int64)),
    )


def make_verify_plan(ab, slots, positions, prevs, tokens=None, num_valid=None, enable=1, capacity=None) -> VerifyPlan:
    """A caller-built VerifyPlan (expected tokens default to -1); entries past the list are junk."""
    n = len(slots)
    cap = n if capacity is None else capacity
    cols = []
    for values in (slots, [-1] * n if tokens is None else tokens, positions, prevs):
        arr = np.full(cap, 0x5A5A, np.int64)  # junk past the valid entries
        arr[:n] = values
        cols.append(ab.asarray(arr))
    return VerifyPlan(
        *cols,
        verify_num_valid=ab.asarray(np.array([n if num_valid is None else num_valid], np.int32)),
        enable=ab.asarray(np.array([enable], np.int32)),
        out_of_range_count=ab.asarray(np.zeros(1, np.int64)),
    )


def host(ab, record) -> dict:
    """Host copies of every array of a plan or log record."""
    return {k: ab.to_numpy(v) for k, v in record.arrays().items()}


def ring_rows(log_host: dict) -> list:
    """The stored ring rows as a sorted list of tuples (a multiset: GPU threads write in any order)."""
    n = min(int(log_host["write_index"][0]), log_host["ring"].shape[0])
    return sorted(tuple(int(x) for x in row) for row in log_host["ring"][:n])


def sorted_rows(rows) -> list:
    return sorted(tuple(int(x) for x in r) for r in rows)


def is_sub_multiset(small, big) -> bool:
    return not (Counter(small) - Counter(big))


def count_free_calls(monkeypatch) -> dict:
    """Count the calls of the free plan, write and verify that bound launchers fall back to (the
    module attributes: ``kc.plan``/``kc.write``/``kc.verify`` called directly are not counted)."""
    from kvcanary_cupy import ops, planner

    counts = {"plan": 0, "write": 0, "verify": 0}

    def counting(name, fn):
        def wrapper(*args, **kwargs):
            counts[name] += 1
            return fn(*args, **kwargs)
        return wrapper

    monkeypatch.setattr(ops, "write", counting("write", ops.write))
    monkeypatch.setattr(ops, "verify", counting("verify", ops.verify))
    monkeypatch.setattr(planner, "plan_step", counting("plan", planner.plan_step))
    return counts


# ---------------------------------------------------------------------------------------------
# oracles (docs/format.md §4 plus the README's out-of-range rules)


def oracle_plan(rp, prefix, extend, rtt, *, verify_capacity, write_req_capacity=None, window=0, lut=None,
                pool=None, valid_lens=None, offset=0):
    """Per-request loop implementing §3.4 and the project's out-of-range rules."""
    rp, prefix, extend = [[int(x) for x in a] for a in (rp, prefix, extend)]
    bs = len(rp)
    wcap = bs if write_req_capacity is None else write_req_capacity
    rows, row_len = rtt.shape
    errors = 0

    def tr(v):
        nonlocal errors
        v = int(v)
        if lut is None or v < 0:
            return v
        if v > len(lut) - 1:
            errors += 1
            v = len(lut) - 1
        return int(lut[v])

    starts, vlens, wlens, seeds = [], [], [], []
    for r in range(bs):
        if rp[r] == 0:
            starts.append(0), vlens.append(0), wlens.append(0), seeds.append(-1)
            continue
        rp_ok = 0 <= rp[r] < rows
        prefix_ok = 0 <= prefix[r] <= row_len
        extend_ok = 0 <= extend[r] <= (2**63 - 1) // len(extend)
        errors += (not rp_ok) + (not prefix_ok) + (not extend_ok)
        if pool is not None:
            errors += not (0 <= int(valid_lens[r]) <= pool.shape[1])
        ws = max(prefix[r] - window, 0) if window > 0 else 0
        end = min(max(prefix[r], 0), row_len)
        vlens.append(max(end - ws, 0) if rp_ok else 0)
        starts.append(ws)
        wlens.append(extend[r] if extend_ok else 0)
        if rp_ok and prefix_ok and prefix[r] > 0 and wlens[-1] > 0:
            seeds.append(tr(rtt[rp[r], prefix[r] - 1]))
        else:
            seeds.append(-1)
    total = sum(vlens)
    enabled = total <= verify_capacity
    entries = []  # (slot, expected_token, position, prev)
    if enabled:
        for r in range(bs):
            for p in range(starts[r], starts[r] + vlens[r]):
                slot = tr(rtt[rp[r], p])
                prev = tr(rtt[rp[r], p - 1]) if p > 0 else -1
                tok = -1
                if pool is not None:
                    q = p + offset
                    if 0 <= q < min(int(valid_lens[r]), pool.shape[1]):
                        tok = int(pool[rp[r], q])
                entries.append((slot, tok, p, prev))
    woff = [0] * (wcap + 1)
    voff = [0] * (wcap + 1)
    for r in range(bs):
        woff[r + 1] = woff[r] + wlens[r]
        voff[r + 1] = voff[r] + vlens[r]
    return {
        "entries": entries,
        "verify_num_valid": min(total, verify_capacity),
        "enable": int(enabled),
        "total_verify": total,
        "write_offsets": woff,
        "verify_offsets": voff,
        "write_seed_slot_indices": seeds + [-1] * (wcap - bs),
        "write_num_valid_reqs": bs,
        "out_of_range": errors,
    }


def plan_entries(vp_host: dict) -> list:
    """The valid entries of a host VerifyPlan as (slot, expected_token, position, prev) tuples."""
    n = int(vp_host["verify_num_valid"][0])
    cols = [vp_host[k][:n] for k in ("verify_slot_indices", "verify_expected_tokens",
                                     "verify_expected_positions", "verify_prev_slot_indices")]
    return [tuple(int(c[i]) for c in cols) for i in range(n)]


def oracle_write(buf, offsets, seeds, num_valid, input_ids, positions, out_cache_loc, *, kind=0,
                 expected_tokens=None, expected_positions=None, pos_assert=True, sources=(), mode=0):
    """Per-request serial walk (§3.5).  Mutates ``buf`` (host int64 [N, >=4]).

    Returns ``(rows, written, out_of_range)``; rows are in request/entry order.
    """
    n_slots = buf.shape[0]
    cap = len(seeds)
    t_len = len(input_ids)
    num_valid = min(max(int(num_valid), 0), cap)
    rows, written, oor = [], 0, 0
    for r in range(num_valid):
        s_raw, e_raw = int(offsets[r]), int(offsets[r + 1])
        start = min(max(s_raw, 0), t_len)
        end = min(max(e_raw, start), t_len)
        oor += s_raw < 0 or s_raw > t_len or e_raw < s_raw or e_raw > t_len
        seed = int(seeds[r])
        if seed >= n_slots:
            oor += 1
            seed = -1
        if seed > 0:  # seed 0 is the padding slot: no predecessor, like -1 (README)
            running = record_hash(buf[seed])
            running_pos = int(buf[seed, 1])
        else:
            running, running_pos = ANCHOR_H, None
        check_pos = seed > 0 and pos_assert
        for i in range(start, end):
            slot = int(out_cache_loc[i])
            if slot >= n_slots:
                oor += 1
                continue
            if slot < 0:
                continue
            tok, pos = int(input_ids[i]), int(positions[i])
            if expected_tokens is not None:
                bits = (WRITE_TOKEN if tok != int(expected_tokens[i]) else 0) | (
                    WRITE_POSITION if pos != int(expected_positions[i]) else 0)
                if bits:
                    rows.append((kind, slot, pos, tok, int(expected_tokens[i]), signed(running),
                                 int(expected_positions[i]), bits))
            if check_pos:
                if pos != running_pos + 1:
                    rows.append((kind, slot, pos, tok, tok, signed(running), running_pos + 1, WRITE_POSITION))
                running_pos = pos
            if slot != 0:  # writes to the padding slot are counted and chained but not stored (README)
                buf[slot, :4] = [tok, pos, signed(running), signed(real_kv(sources, mode, slot))]
            running = hmix3(running, tok, pos)
            written += 1
    return rows, written, oor


def oracle_verify(buf, entries, *, kind=0, enable=1, check_token=False, sources=(), mode=0):
    """Per-entry check (§3.6) of ``entries`` = [(slot, expected_token, position, prev)].

    Returns ``(rows, scanned, out_of_range)``; ``entries`` are the active ones (already clamped).
    """
    if not enable:
        return [], 0, 0
    n_slots = buf.shape[0]
    rows, oor = [], 0
    for slot, exp_tok, exp_pos, prev in entries:
        if slot < 0 or slot >= n_slots:
            oor += 1
            continue
        if slot == 0:
            continue
        if prev >= n_slots:
            oor += 1
        rec = [int(x) for x in buf[slot, :4]]
        stored_chain = unsigned(rec[2])
        if prev < 0:
            want = ANCHOR_H
        elif prev == 0 or prev >= n_slots:
            want = stored_chain
        else:
            want = record_hash(buf[prev])
        tok = exp_tok if check_token else -1
        bits = CHAIN if stored_chain != want else 0
        bits |= POSITION if rec[1] != exp_pos else 0
        bits |= REAL_KV if unsigned(rec[3]) != real_kv(sources, mode, slot) else 0
        bits |= TOKEN if check_token and exp_tok != -1 and rec[0] != exp_tok else 0
        if bits:
            rows.append((kind, slot, rec[1], rec[0], tok, rec[2], signed(want), bits))
    return rows, len(entries), oor


# ---------------------------------------------------------------------------------------------
# running the API on a backend


def _conv(ab, a, dtype):
    return None if a is None else ab.asarray(np.asarray(a, dtype=dtype))


def run_plan(ab, rp, prefix, extend, rtt, *, lut=None, pool=None, valid_lens=None, **kw):
    """``kvcanary_cupy.plan`` on backend ``ab``; returns (vp, wp, vp_host, wp_host)."""
    import kvcanary_cupy

    vp, wp = kvcanary_cupy.plan(
        _conv(ab, rp, np.int64), _conv(ab, prefix, np.int64), _conv(ab, extend, np.int64),
        _conv(ab, rtt, np.int32),
        full_to_swa_index_mapping=_conv(ab, lut, np.int64),
        req_to_verify_expected_tokens=_conv(ab, pool, np.int32),
        req_to_verify_expected_tokens_valid_lens=_conv(ab, valid_lens, np.int64),
        **kw,
    )
    return vp, wp, host(ab, vp), host(ab, wp)


def assert_plan_equals_oracle(vph: dict, wph: dict, want: dict, *, out_of_range_before: int = 0) -> None:
    """Every defined output of a plan equals the oracle's (entries past num_valid are unspecified)."""
    assert int(vph["verify_num_valid"][0]) == want["verify_num_valid"]
    assert int(vph["enable"][0]) == want["enable"]
    if want["enable"]:
        assert plan_entries(vph) == want["entries"]
    assert wph["write_offsets"].tolist() == want["write_offsets"]
    assert wph["verify_offsets"].tolist() == want["verify_offsets"]
    assert wph["write_seed_slot_indices"].tolist() == want["write_seed_slot_indices"]
    assert int(wph["write_num_valid_reqs"][0]) == want["write_num_valid_reqs"]
    assert int(vph["out_of_range_count"][0]) == out_of_range_before + want["out_of_range"]


def a64(ab, values):
    """``values`` as a native int64 array of backend ``ab``."""
    return ab.asarray(np.asarray(values, dtype=np.int64))


def kv_bytes(rows: int, row_bytes: int, seed: int = 0) -> np.ndarray:
    """Random real-KV bytes ``uint8 [rows, row_bytes]``."""
    return np.random.default_rng(seed).integers(0, 256, size=(rows, row_bytes), dtype=np.uint8)


# ---------------------------------------------------------------------------------------------
# engine tables (issue: engine tables), materialised as the equivalent per-token slot table

INT64_MAX = 2**63 - 1


def paged_slot(page_id: int, page_size: int, offset: int) -> int:
    """``page_id * page_size + offset``, or +-(2**63 - 1) once |page_id| >= (2**63 - 1) // page_size (README)."""
    limit = INT64_MAX // page_size
    if page_id >= limit:
        return INT64_MAX
    if page_id <= -limit:
        return -INT64_MAX
    return page_id * page_size + offset


def block_row_slots(block_row, block_size: int, null_block: int = 0) -> list:
    """The slot of every position of one block-table row (0 where the null block is)."""
    return [0 if int(b) == null_block else paged_slot(int(b), block_size, o)
            for b in block_row for o in range(block_size)]


def virtual_slot(token: int, v2p, page_size: int) -> int:
    """The slot of virtual token id ``token``: negatives pass through, -1 pages and pages past the map give 0."""
    if token < 0:
        return token
    page = token // page_size
    if page >= len(v2p) or int(v2p[page]) == -1:
        return 0
    return paged_slot(int(v2p[page]), page_size, token % page_size)


def equivalent_req_to_token(kind: str, table: dict, rp, bs: int):
    """The plain ``req_to_token`` (int32) and ``req_pool_indices`` a plan through ``table`` equals.

    ``kind`` is "rtt" (``table["req_to_token"]``), "virtual" (+ ``virtual_to_physical``,
    ``page_size``), "block" (``block_table``, ``block_size``, ``null_block``) or "csr"
    (``kv_indptr``, ``kv_indices``, ``page_size``, every row a valid range).  Block-table and CSR
    rows shift down by one so that none is the padding row 0; the null block and unbound pages
    become 0.  CSR rows are padded to the longest one, so a prefix past a shorter row is only
    equivalent when it is within that row.
    """
    if kind == "rtt":
        return np.asarray(table["req_to_token"], np.int32), rp
    if kind == "virtual":
        rtt = table["req_to_token"]
        out = [[virtual_slot(int(t), table["virtual_to_physical"], table["page_size"]) for t in row] for row in rtt]
        return np.asarray(out, np.int64).reshape(rtt.shape).astype(np.int32), rp
    if kind == "block":
        rows = [block_row_slots(row, table["block_size"], table.get("null_block", 0)) for row in table["block_table"]]
        width = table["block_table"].shape[1] * table["block_size"]
        out = np.zeros((len(rows) + 1, width), np.int64)
        for i, row in enumerate(rows):
            out[i + 1] = row
        rp = np.asarray(rp, np.int64)
        return out.astype(np.int32), np.where(rp >= 0, rp + 1, rp)
    indptr, indices, ps = table["kv_indptr"], table["kv_indices"], table["page_size"]
    rows = [block_row_slots(indices[int(indptr[r]):int(indptr[r + 1])], ps, null_block=None) for r in range(bs)]
    out = np.zeros((bs + 1, max([len(r) for r in rows], default=0)), np.int64)
    for i, row in enumerate(rows):
        out[i + 1, :len(row)] = row
    return out.astype(np.int32), np.arange(1, bs + 1, dtype=np.int64)


def shifted_pool(pool):
    """An expected-token pool for the shifted rows of :func:`equivalent_req_to_token`."""
    return None if pool is None else np.concatenate([np.zeros((1, pool.shape[1]), pool.dtype), pool])


def outcome(fn):
    """``(type, message)`` of what ``fn()`` raises, or None: what two ways of making a call compare."""
    try:
        fn()
    except Exception as exc:  # noqa: BLE001 - the type and message are what is compared
        return type(exc), str(exc)
    return None
