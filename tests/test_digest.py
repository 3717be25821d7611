"""digest_pages on every backend (issue 24): the bytes of the pure-Python oracle for every engine
pool shape, dtype and table kind; invariance under relocation, layout and page size; additivity
over position chunks, head shards and layer stages; out-of-range inputs skipped and counted."""

import numpy as np
import pytest

import kvcanary_cupy as kc
from digest_oracle import chain_at, kv_sum, rec_sum
from digest_pools import KINDS, Model, build_pool, layout_of


def tables(pool, ps, kind):
    """The pool's slots as each engine table kind (all address the same slots)."""
    rtt = pool.table
    if kind == "req_to_token":
        return kc.ReqToToken(rtt), np.arange(rtt.shape[0], dtype=np.int64)[1:]
    if kind == "block":
        return kc.BlockTable(np.ascontiguousarray(rtt[:, ::ps] // ps), ps), np.arange(rtt.shape[0], dtype=np.int64)[1:]
    if kind == "virtual":  # virtual page v maps to physical page num_pages - 1 - v
        n = pool.num_pages
        v2p = (n - 1 - np.arange(n)).astype(np.int64)
        virt = (n - 1 - rtt // ps) * ps + rtt % ps
        return kc.ReqToToken(virt.astype(np.int32), virtual_to_physical=v2p, page_size=ps), np.arange(rtt.shape[0], dtype=np.int64)[1:]
    pages = [rtt[r, ::ps] // ps for r in range(1, rtt.shape[0])]
    indptr = np.cumsum([0] + [len(p) for p in pages]).astype(np.int64)
    return kc.PagedKvIndices(indptr, np.concatenate(pages).astype(np.int32), ps), None


def put(ab, table):
    return table.with_arrays(lambda a, _: None if a is None else ab.asarray(a))


def run(ab, pool, model, spec, *, starts=None, ends=None, keys=None, table_kind="req_to_token", receiver=False, **shard):
    n = len(model.tokens)
    starts = np.zeros(n, np.int64) if starts is None else np.asarray(starts, np.int64)
    ends = np.array([len(t) for t in model.tokens], np.int64) if ends is None else np.asarray(ends, np.int64)
    keys = np.arange(n, dtype=np.int64) * 7919 - 3 if keys is None else np.asarray(keys, np.int64)
    tensors, layout = layout_of(pool, model, ab, **shard)
    table, rows = tables(pool, pool.page_size, table_kind)
    kw = {}
    if spec.records:
        kw["records"] = ab.asarray(pool.canary)
    if receiver:
        pool_tokens = np.zeros((pool.table.shape[0], pool.table.shape[1]), np.int32)
        for r, t in enumerate(model.tokens):
            pool_tokens[pool.rows[r], : len(t)] = t
        kw["expected_tokens"] = ab.asarray(pool_tokens)
    out = kc.DigestBatch.allocate(n + 2, like=ab.like)
    kc.digest_pages(layout, put(ab, table), None if rows is None else ab.asarray(rows), ab.asarray(starts), ab.asarray(ends),
                    spec=spec, sample_keys=ab.asarray(keys), out=out, **kw)
    return ab.to_numpy(out.records), int(ab.to_numpy(out.out_of_range_count)[0])


def filled(kind, model, rng, *, page_size=4, num_pages=None):
    num_pages = num_pages or sum(-(-len(t) // page_size) for t in model.tokens) + 3
    pool = build_pool(kind, model, page_size=page_size, num_pages=num_pages, rng=rng)
    for r in range(len(model.tokens)):
        pool.write(r, model)
        pool.stamp(r, model)
    return pool


SPECS = [kc.DigestSpec.full(3), kc.DigestSpec(3), kc.DigestSpec(3, sample_layers=1, window_bytes=8, records=False)]


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("dtype", ["bfloat16", "fp8", "float32"])
def test_every_pool_shape_digests_to_the_oracle(ab, kind, dtype):
    rng = np.random.default_rng(hash((kind, dtype)) % 2**32)
    model = Model.random(rng, [5, 11, 1], dtype=dtype, head_dim=8 if dtype != "fp8" else 16)
    pool = filled(kind, model, rng)
    for spec in SPECS:
        rows, skipped = run(ab, pool, model, spec)
        assert skipped == 0
        for r, kv in enumerate(model.kv):
            n, key = kv.shape[2], r * 7919 - 3
            assert (kc.to_unsigned(rows[r, 5]), int(rows[r, 7])) == kv_sum(
                kv, 0, n, key, total_layers=3, sample_layers=spec.sample_layers, window_bytes=spec.window_bytes)
            assert kc.to_unsigned(rows[r, 6]) == (rec_sum(model.tokens[r], 0, n, chain_at(model.tokens[r], 0)) if spec.records else 0)
        assert not rows[3:].any()  # rows past the batch untouched


@pytest.mark.parametrize("table_kind", ["req_to_token", "block", "virtual", "paged"])
def test_table_kinds_and_backends_give_the_same_bytes(ab, table_kind):
    rng = np.random.default_rng(5)
    model = Model.random(rng, [9, 4, 13])
    pool = filled("vllm-HND", model, rng, page_size=4)
    for spec in SPECS:
        want, _ = run(kc_numpy(), pool, model, spec)
        got, skipped = run(ab, pool, model, spec, table_kind=table_kind, starts=[0, 1, 5], ends=[9, 4, 11])
        ref, _ = run(kc_numpy(), pool, model, spec, starts=[0, 1, 5], ends=[9, 4, 11])
        assert skipped == 0 and got.tobytes() == ref.tobytes()
        assert want[0].tobytes() == got[0].tobytes()  # same full range of request 0


def kc_numpy():
    from conftest import get_backend_or_skip

    return get_backend_or_skip("numpy")


def test_relocation_layout_and_page_size_never_enter_the_digest(ab):
    rng = np.random.default_rng(11)
    model = Model.random(rng, [17, 6, 30])
    results = set()
    for kind in KINDS:
        for page_size in (1, 4, 16):
            for spec in SPECS[:2]:
                pool = filled(kind, model, rng, page_size=page_size, num_pages=60 // page_size + 8)
                rows, _ = run(ab, pool, model, spec)
                results.add((spec, rows.tobytes()))
    assert len(results) == 2  # one digest per spec, whatever the pool


def test_parts_sum_to_the_whole(ab):
    """Position chunks, TP head shards and PP layer stages each digest their part; KV and words add."""
    rng = np.random.default_rng(3)
    model = Model.random(rng, [24], num_layers=4, num_heads=4)
    spec = kc.DigestSpec(4, sample_layers=0, window_bytes=8, records=False)
    whole, _ = run(ab, filled("sglang", model, rng), model, spec)
    add = lambda rows: (sum(kc.to_unsigned(r[5]) for r in rows) % 2**64, sum(int(r[7]) for r in rows))
    chunks, _ = run(ab, filled("sglang", Model(4, 2, 4, model.strip, model.dtype, model.kv * 3, model.tokens * 3), rng),
                    Model(4, 2, 4, model.strip, model.dtype, model.kv * 3, model.tokens * 3), spec,
                    starts=[0, 8, 16], ends=[8, 16, 24], keys=[-3] * 3)
    assert add(chunks[:3]) == add(whole[:1])
    heads = []
    for lo in (0, 2):
        part = Model(4, 2, 2, model.strip, model.dtype, [model.kv[0][:, :, :, lo:lo + 2]], model.tokens)
        rows, _ = run(ab, filled("flashinfer-HND", part, rng), part, spec, head_offset=lo, num_heads_total=4)
        heads.append(rows[0])
    assert add(heads) == add(whole[:1])
    stages = []
    for lo in (0, 1):  # layers [0, 1) and [1, 4)
        hi = 1 if lo == 0 else 4
        part = Model(hi - lo, 2, 4, model.strip, model.dtype, [model.kv[0][lo:hi]], model.tokens)
        rows, _ = run(ab, filled("vllm-NHD", part, rng), part, spec, layer_offset=lo)
        stages.append(rows[0])
    assert add(stages) == add(whole[:1])
    assert len({r[1] for r in heads + stages}) == 1 and heads[0][1] == whole[0][1]  # one signature


def test_out_of_range_is_skipped_and_counted(ab):
    rng = np.random.default_rng(8)
    model = Model.random(rng, [8, 8, 8, 8])
    pool = filled("sglang", model, rng, page_size=2)
    pool.table[2, 3] = pool.num_pages * 2 + 5  # a slot past the pool
    pool.table[3, 1] = -4  # no slot
    spec = kc.DigestSpec.full(3)
    rows, skipped = run(ab, pool, model, spec, starts=[0, 0, 0, -1], ends=[pool.table.shape[1] + 1, 8, 8, 4])
    ref, ref_skipped = run(kc_numpy(), pool, model, spec, starts=[0, 0, 0, -1], ends=[pool.table.shape[1] + 1, 8, 8, 4])
    assert rows.tobytes() == ref.tobytes() and skipped == ref_skipped == 4  # 2 requests, 2 positions
    assert rows[0, 7] == 0 and rows[3, 7] == 0  # requests out of range hash nothing
    per_position = 3 * 2 * 2 * 2  # words of one position
    assert rows[1, 7] == rows[2, 7] == 7 * per_position


def test_fuzzed_cases_are_byte_identical_to_numpy(ab):
    rng = np.random.default_rng(2024)
    for case in range(8):
        kind = KINDS[case % len(KINDS)]
        lengths = list(rng.integers(1, 40, rng.integers(1, 5)))
        model = Model.random(rng, lengths, num_layers=int(rng.integers(1, 4)), num_heads=int(rng.integers(1, 4)),
                             dtype=["bfloat16", "fp8", "float32"][case % 3], head_dim=16)
        ps = int(rng.choice([1, 2, 8, 16]))
        pool = filled(kind, model, rng, page_size=ps)
        bs = len(lengths)
        starts = rng.integers(-2, 10, bs)
        ends = starts + rng.integers(-1, 40, bs)
        if case % 2:  # corrupt a few table entries
            pool.table[rng.integers(1, bs + 1, 3), rng.integers(0, pool.table.shape[1], 3)] = rng.integers(-5, 10**6, 3)
        spec = kc.DigestSpec(model.num_layers, sample_layers=int(rng.integers(0, 3)), window_bytes=int(rng.choice([0, 8, 16])),
                             records=bool(case % 3))
        keys = rng.integers(-2**63, 2**63 - 1, bs)
        for table_kind in ("req_to_token", "block"):
            got = run(ab, pool, model, spec, starts=starts, ends=ends, keys=keys, table_kind=table_kind)
            want = run(kc_numpy(), pool, model, spec, starts=starts, ends=ends, keys=keys, table_kind=table_kind)
            assert got[0].tobytes() == want[0].tobytes() and got[1] == want[1], (case, table_kind)


def test_wide_heads_are_byte_identical_to_numpy(ab):
    """Model-sized heads (up to 128 words a head, up to 9 heads): the CUDA kernel's lanes share a
    position's heads in passes and take several words of a head each, batches of loads in flight."""
    rng = np.random.default_rng(77)
    for case, (heads, head_dim, dtype) in enumerate([(8, 128, "bfloat16"), (9, 128, "bfloat16"), (1, 128, "float32"),
                                                     (3, 256, "float32"), (2, 64, "fp8"), (5, 96, "bfloat16")]):
        model = Model.random(rng, list(rng.integers(1, 30, 2)), num_layers=2, num_heads=heads, head_dim=head_dim, dtype=dtype)
        pool = filled(KINDS[case % len(KINDS)], model, rng, page_size=int(rng.choice([1, 4, 16])))
        for spec in (kc.DigestSpec.full(2), kc.DigestSpec(2, sample_layers=1, window_bytes=int(rng.choice([8, 32, 64])))):
            got = run(ab, pool, model, spec)
            want = run(kc_numpy(), pool, model, spec)
            assert got[0].tobytes() == want[0].tobytes() and got[1] == want[1], (case, spec)
            for r, kv in enumerate(model.kv):
                assert (kc.to_unsigned(got[0][r, 5]), int(got[0][r, 7])) == kv_sum(
                    kv, 0, kv.shape[2], r * 7919 - 3, total_layers=2, sample_layers=spec.sample_layers,
                    window_bytes=spec.window_bytes), (case, spec, r)


def test_mla_k_only_pools_digest_to_the_oracle(ab):
    """An MLA pool (one half, one head of kv_lora_rank + rope values) through from_mla."""
    rng = np.random.default_rng(40)
    model = Model.random(rng, [7, 19], halves=1, num_heads=1, head_dim=72)  # 144-byte rows: 576 bf16 would be 1,152
    pool = filled("sglang", model, rng, page_size=4)
    for spec in SPECS:
        rows, skipped = run(ab, pool, model, spec)
        assert skipped == 0
        for r, kv in enumerate(model.kv):
            assert (kc.to_unsigned(rows[r, 5]), int(rows[r, 7])) == kv_sum(
                kv, 0, kv.shape[2], r * 7919 - 3, total_layers=3, sample_layers=spec.sample_layers, window_bytes=spec.window_bytes)
    _, layout = layout_of(pool, model, kc_numpy())
    assert layout.halves == 1 and layout.name == "sglang-mla"


def test_vllm_blocks_first_caches_digest_as_flashinfer_ones(ab):
    """vLLM's FlashInfer-backend caches ``(nb, 2, bs, H, D)`` (``kv_first=False``), NHD and HND
    (a stride permutation), digest as the same pool described by from_flashinfer."""
    rng = np.random.default_rng(17)
    model = Model.random(rng, [12, 21])
    for kind, order in (("flashinfer-NHD", (0, 1, 2, 3, 4)), ("flashinfer-HND", (0, 1, 3, 2, 4))):
        pool = filled(kind, model, rng, page_size=8)
        tensors, flashinfer = layout_of(pool, model, ab)
        shard = {} if ab.name.startswith("torch") else {"dtype": "bfloat16"}
        logical = [t[0].permute(*order) if hasattr(t[0], "permute") else t[0].transpose(order) for t in tensors]
        vllm = kc.KvLayout.from_vllm(logical, kv_first=False, **shard)
        assert vllm.name == f"vllm-{kind[-3:]}"
        table, rows = kc.ReqToToken(ab.asarray(pool.table)), ab.asarray(np.array(pool.rows, np.int64))
        digests = []
        for layout in (flashinfer, vllm):
            out = kc.digest_pages(layout, table, rows, ab.asarray(np.zeros(2, np.int64)), ab.asarray(np.array([12, 21])),
                                  spec=SPECS[0], sample_keys=ab.asarray(np.array([1, 2])), records=ab.asarray(pool.canary))
            digests.append(ab.to_numpy(out.records).tobytes())
        assert digests[0] == digests[1]


def test_padded_pages_and_a_head_slice_through_from_strides(ab):
    """from_strides over a pool with padded pages, describing only heads [2, 4) of its 4 (a tensor-
    parallel rank's view of a shared buffer): the oracle of those heads, at their global indices."""
    rng = np.random.default_rng(23)
    heads, strip, ps, pages, pad = 4, 32, 4, 6, 48  # 48 bytes of padding after every page
    kv = rng.integers(0, 256, (2, 2, 10, heads, strip), dtype=np.uint8)  # 2 layers, K and V, 10 positions
    page_bytes = ps * heads * strip + pad
    buf = [[rng.integers(0, 256, pages * page_bytes, dtype=np.uint8) for _ in range(2)] for _ in range(2)]
    slots = np.array([5, 6, 7, 8, 13, 14, 1, 2, 3, 21])
    for l in range(2):
        for c in range(2):
            for p, s in enumerate(slots):
                at = (s // ps) * page_bytes + (s % ps) * heads * strip
                buf[l][c][at: at + heads * strip] = kv[l, c, p].reshape(-1)
    tensors = [[ab.asarray(b) for b in layer] for layer in buf]
    layout = kc.KvLayout.from_strides([[(t, 2 * strip) for t in layer] for layer in tensors], page_stride=page_bytes,
                                      token_stride=heads * strip, head_stride=strip, strip_bytes=strip, page_size=ps,
                                      num_pages=pages, num_heads=2, head_offset=2, num_heads_total=4)
    table = np.zeros((2, 10), np.int32)
    table[1] = slots
    out = kc.digest_pages(layout, ab.asarray(table), ab.asarray(np.array([1])), ab.asarray(np.array([0])),
                          ab.asarray(np.array([10])), spec=kc.DigestSpec.full(2, records=False), sample_keys=ab.asarray(np.array([4])))
    row = ab.to_numpy(out.records)[0]
    assert (kc.to_unsigned(row[5]), int(row[7])) == kv_sum(kv[:, :, :, 2:], 0, 10, 4, total_layers=2, head_offset=2)
