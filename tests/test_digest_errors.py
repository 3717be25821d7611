"""Bad input to the digest API gets a ValueError/TypeError naming the argument, what was expected
and what came, before anything runs (issue 24)."""

import numpy as np
import pytest

import kvcanary_cupy as kc


def _layout(layers=3, **kw):
    k = [np.zeros((16, 2, 8), np.float16) for _ in range(layers)]
    return kc.KvLayout.from_sglang(k, k, **kw)


def _call(layout=None, **kw):
    layout = layout or _layout()
    args = dict(table=np.zeros((2, 8), np.int32), req_pool_indices=np.array([1]), starts=np.array([0]), ends=np.array([4]),
                spec=kc.DigestSpec(3, records=False), sample_keys=np.array([1]))
    args.update(kw)
    return kc.digest_pages(layout, args.pop("table"), args.pop("req_pool_indices"), args.pop("starts"), args.pop("ends"), **args)


@pytest.mark.parametrize("build, message", [
    (lambda: kc.KvLayout.from_strides([[np.zeros(4096, np.uint8)]], page_stride=64, token_stride=12, head_stride=16,
                                      strip_bytes=16, page_size=4, num_pages=4, num_heads=1),
     "KvLayout token_stride must be a multiple of 8 bytes, got 12"),
    (lambda: kc.KvLayout.from_sglang([np.zeros((16, 2, 3), np.float16)]),
     "KvLayout strip_bytes must be a multiple of 8 bytes, got 6"),
    (lambda: kc.KvLayout.from_strides([[np.zeros(256, np.uint8)]], page_stride=64, token_stride=16, head_stride=16,
                                      strip_bytes=16, page_size=4, num_pages=5, num_heads=1),
     r"KvLayout buffers\[0\]\[0\] is too small for the layout: 5 pages reach byte 320 but the tensor spans 256 bytes"),
    (lambda: kc.KvLayout.from_sglang([np.zeros((16, 2, 8), np.float16)], None, head_offset=1, num_heads_total=2),
     r"KvLayout head_offset \(1\) \+ num_heads \(2\) exceeds num_heads_total \(2\)"),
    (lambda: kc.KvLayout.from_flashinfer([np.zeros((4, 2, 8, 2, 8), np.float16)], "NDH"), "kv_layout must be 'NHD' or 'HND', got 'NDH'"),
    (lambda: kc.DigestSpec(80, window_bytes=12), "DigestSpec.window_bytes must be a multiple of 8 bytes"),
    (lambda: kc.DigestSpec(0), "DigestSpec.num_layers_total must be >= 1, got 0"),
    (lambda: _call(spec=kc.DigestSpec(2, records=False)), r"spec.num_layers_total \(2\) < layout.layer_offset \+ num_layers \(3\)"),
    (lambda: _call(ends=np.array([4, 4])), r"ends length must be bs \(len\(starts\)\)=1, got 2"),
    (lambda: _call(starts=np.array([0], np.int32)), "starts must have dtype int64, got int32"),
    (lambda: _call(spec=kc.DigestSpec(3)), "spec.records=True needs records="),
    (lambda: _call(records=np.zeros((16, 4), np.int64)), "spec.records=False turns off"),
    (lambda: _call(table=kc.BlockTable(np.zeros((2, 2), np.int32), 4)), r"the table's page size \(4\) must equal layout.page_size \(1\)"),
    (lambda: _call(req_pool_indices=None), "req_pool_indices is required with a ReqToToken table"),
    (lambda: _call(out=kc.DigestBatch.allocate(0)), "bs=1 exceeds out's capacity 0"),
    (lambda: _call(layout="nope"), "layout must be a KvLayout, got str"),
    (lambda: _call(strict=True, table=np.zeros((2, 2), np.int32)),
     r"strict: request 0 \(positions \[0, 4\)\) is out of range: its table row, start < 0"),
    (lambda: _call(strict=True, table=np.array([[0] * 8, [1, 2, -5, 99, 4, 5, 6, 7]], np.int32)),
     r"strict: request 0 \(positions \[0, 4\)\) has 2 position\(s\) whose slot is outside the pool or the canary"),
    (lambda: _call(strict=True, spec=kc.DigestSpec(3), records=np.zeros((16, 4), np.int64), starts=np.array([2]),
                   expected_tokens=np.zeros((2, 8), np.int32), seam=np.array([16])),
     r"strict: request 0 \(positions \[2, 4\)\): its seam record \(the slot before start\) is out of range"),
])
def test_bad_input_is_named(build, message):
    with pytest.raises((TypeError, ValueError), match=message):
        build()


def test_verify_digest_names_a_log_too_small_for_the_digest_tags():
    batch = kc.DigestBatch.allocate(1)
    with pytest.raises(ValueError, match=r"kernel_kind must be in \[0, 12\).*got 12; allocate it with num_kinds=15"):
        kc.verify_digest(batch, batch, log=kc.ViolationLog.allocate(4))
    log = kc.ViolationLog.allocate(4, num_kinds=kc.DIGEST_NUM_KINDS)
    with pytest.raises(ValueError, match="actual holds 1 rows but expected 2"):
        kc.verify_digest(kc.DigestBatch.allocate(2), batch, log=log)
    with pytest.raises(TypeError, match="expected must be a DigestBatch, got ndarray"):
        kc.verify_digest(np.zeros((1, 8), np.int64), batch, log=log)


def test_a_missing_digest_never_passes_and_strict_says_so():
    log = kc.ViolationLog.allocate(4, num_kinds=kc.DIGEST_NUM_KINDS)
    zero = kc.DigestBatch.allocate(2)
    codes = kc.verify_digest(zero, zero, log=log)
    assert codes.tolist() == [kc.DigestVerdict.MISSING] * 2
    with pytest.raises(ValueError, match="strict: 2 of 2 digests did not match; first: request 0 MISSING"):
        kc.verify_digest(zero, zero, log=log, strict=True)
    assert log.read().total_violations == 4  # the strict call logged before it raised
