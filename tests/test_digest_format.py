"""The digest's fixed bytes (issue 24): pinned record bytes, signature, keys and digests, the
pure-Python oracle against the NumPy reference, and the record's decoding errors."""

import numpy as np
import pytest

import kvcanary_cupy as kc
from digest_oracle import kv_sum, key, rec_sum
from kvcanary_cupy.digest import reference


def test_record_bytes_are_pinned():
    r = kc.DigestRecord(signature=0x1122334455667788, sample_key=0xA5, start=16, end=48, kv=0xDEADBEEF, rec=2**64 - 1,
                        words=1024, flags=3)
    assert r.to_bytes().hex() == (
        "4b564447" "0100" "0300" "8877665544332211" "a500000000000000" "1000000000000000" "3000000000000000"
        "efbeadde00000000" "ffffffffffffffff" "0004000000000000")
    assert kc.DigestRecord.from_bytes(r.to_bytes()) == r
    assert np.frombuffer(r.to_bytes(), "<i8").tolist() == r.to_row()


@pytest.mark.parametrize("buf, message", [
    (b"\0" * 63, "is 64 bytes, got 63"),
    (b"XXXX" + b"\1\0" + b"\0" * 58, "magic must be 0x4744564b"),
    (b"KVDG" + b"\2\0" + b"\0" * 58, "format version must be 1, got 2"),
])
def test_from_bytes_refuses_other_formats(buf, message):
    with pytest.raises(ValueError, match=message):
        kc.DigestRecord.from_bytes(buf)


def test_strip_key_and_signature_are_pinned():
    assert hex(key(3, 1, 7, 1000)) == hex(int(reference.strip_key(3, 1, 7, 1000)))
    assert hex(key(0, 0, 0, 0)) == "0x6f8a4126a3a211ae"
    k = [np.zeros((8, 2, 8), np.uint16)]
    layout = kc.KvLayout.from_sglang(k, k, dtype="bfloat16")
    assert hex(kc.DigestSpec(num_layers_total=80).signature(layout)) == "0x3bca7e3f32739f09"
    # page size, physical layout and shard position are not compat fields; dtype and heads are
    assert kc.DigestSpec(80).signature(layout) == kc.DigestSpec(80).signature(
        kc.KvLayout.from_sglang(k, k, page_size=4, dtype="bfloat16"))
    assert kc.DigestSpec(80).signature(layout) != kc.DigestSpec(80).signature(kc.KvLayout.from_sglang(k, k, dtype="float16"))
    assert kc.DigestSpec(80).signature(layout) != kc.DigestSpec(80, window_bytes=16).signature(layout)


def _sequential_pool():
    """2 layers x K/V x 2 heads x 16 bytes, 6 slots; byte b of (l, c, slot, h) = l*64 + c*32 + slot*4 + h + b."""
    b = np.arange(16, dtype=np.uint8)
    k = [np.zeros((6, 2, 16), np.uint8) for _ in range(2)]
    v = [np.zeros((6, 2, 16), np.uint8) for _ in range(2)]
    for l in range(2):
        for s in range(6):
            for h in range(2):
                k[l][s, h] = l * 64 + s * 4 + h + b
                v[l][s, h] = l * 64 + 32 + s * 4 + h + b
    return k, v


def test_a_digest_is_pinned():
    k, v = _sequential_pool()
    layout = kc.KvLayout.from_sglang(k, v, dtype="float8_e4m3fn")
    rtt = np.array([[0] * 4, [5, 2, 3, 1]], np.int32)
    out = kc.digest_pages(layout, rtt, np.array([1]), np.array([0]), np.array([4]), spec=kc.DigestSpec.full(2, records=False),
                          sample_keys=np.array([7]))
    (rec,) = out.to_records()
    assert (hex(rec.kv), rec.rec, rec.words, rec.start, rec.end, rec.sample_key) == (hex(9077527627313141115), 0, 64, 0, 4, 7)
    # the oracle, from the logical bytes in position order
    logical = np.stack([np.stack([np.stack([x[l][[5, 2, 3, 1]] for x in (k, v)])]) for l in range(2)])[:, 0]
    assert kv_sum(logical, 0, 4, 7, total_layers=2) == (rec.kv, rec.words)


@pytest.mark.parametrize("chunk_words", [1, 10, None])
@pytest.mark.parametrize("window_bytes", [0, 8, 16])
def test_kv_sum_chunks_and_gathers_match_the_oracle(monkeypatch, chunk_words, window_bytes):
    """reference.kv_sum's chunks of positions (one, several with a remainder, all at once) and both
    of its gathers (whole rows where the strides are multiples of the window: 24-byte strips with
    8- and 24-byte windows; 16-byte windows of them take the strided view), over every slot of the
    pool, the padding slot 0 and the last slot (the span's last bytes) among them."""
    if chunk_words is not None:
        monkeypatch.setattr(reference, "KV_CHUNK_WORDS", chunk_words)
    rng = np.random.default_rng(window_bytes)
    L, H, n = 3, 2, 20
    kv = rng.integers(0, 256, (L, 2, n, H, 24), dtype=np.uint8)
    slots = rng.permutation(n)
    k = [np.zeros((n, H, 24), np.uint8) for _ in range(L)]
    v = [np.zeros((n, H, 24), np.uint8) for _ in range(L)]
    for p, s in enumerate(slots):
        for l in range(L):
            k[l][s], v[l][s] = kv[l, 0, p], kv[l, 1, p]
    layout = kc.KvLayout.from_sglang(k, v)
    rtt = np.zeros((2, n), np.int32)
    rtt[1] = slots
    for sample_layers in (0, 2):
        spec = kc.DigestSpec(L, sample_layers=sample_layers, window_bytes=window_bytes, records=False)
        for start, end in ((0, n), (3, 17), (5, 6)):
            out = kc.digest_pages(layout, rtt, np.array([1]), np.array([start]), np.array([end]), spec=spec,
                                  sample_keys=np.array([99]))
            (r,) = out.to_records()
            assert (r.kv, r.words) == kv_sum(kv, start, end, 99, total_layers=L, sample_layers=sample_layers,
                                             window_bytes=window_bytes)


@pytest.mark.parametrize("sample_layers, window_bytes", [(0, 0), (1, 8), (2, 0), (1, 0), (0, 8)])
def test_reference_equals_the_pure_python_oracle(sample_layers, window_bytes):
    rng = np.random.default_rng(sample_layers * 10 + window_bytes)
    L, H, n = 3, 2, 7
    kv = rng.integers(0, 256, (L, 2, n, H, 24), dtype=np.uint8)  # three words a strip
    tokens = rng.integers(1, 999, n)
    slots = rng.permutation(np.arange(1, 20))[:n]
    k = [np.zeros((20, H, 24), np.uint8) for _ in range(L)]
    v = [np.zeros((20, H, 24), np.uint8) for _ in range(L)]
    canary = np.zeros((20, 4), np.int64)
    from digest_oracle import chain_at

    for p, s in enumerate(slots):
        for l in range(L):
            k[l][s], v[l][s] = kv[l, 0, p], kv[l, 1, p]
        canary[s, :3] = [tokens[p], p, kc.to_signed(chain_at(tokens, p))]
    layout = kc.KvLayout.from_sglang(k, v)
    rtt = np.zeros((2, n), np.int32)
    rtt[1] = slots
    spec = kc.DigestSpec(L, sample_layers=sample_layers, window_bytes=window_bytes)
    for start, end in ((0, n), (2, 5), (3, 3)):
        out = kc.digest_pages(layout, rtt, np.array([1]), np.array([start]), np.array([end]), spec=spec,
                              sample_keys=np.array([-12345]), records=canary)
        (r,) = out.to_records()
        assert (r.kv, r.words) == kv_sum(kv, start, end, -12345, total_layers=L, sample_layers=sample_layers,
                                         window_bytes=window_bytes)
        assert r.rec == (rec_sum(tokens, start, end, chain_at(tokens, start)) if end > start else 0)
