"""A pure-Python digest (docs/transfer.md "The digest"), from logical KV bytes: the oracle of the
digest tests.  Plain loops over Python ints, written from the format, not from the library."""

from __future__ import annotations

from canary_builders import ANCHOR_H, MASK64, sm64

SEED, STRIDE, ROT, REC = 0x4B56444947455354, 0x9E3779B97F4A7C15, 0x5A5A, 0xFFFF


def key(l, c, h, p):
    return sm64(SEED ^ sm64(l << 48 | c << 47 | h << 32 | p))


def layers(sample_key, total, n):
    if n == 0 or n >= total:
        return list(range(total))
    first = sm64((sample_key & MASK64) ^ ROT) % total
    return [(first + i * total // n) % total for i in range(n)]


def window(sample_key, layer, strip_words, window_bytes):
    w = window_bytes // 8
    if w == 0 or w >= strip_words:
        return range(strip_words)
    pick = sm64((sample_key & MASK64) ^ ((layer + 1) * STRIDE & MASK64)) % (strip_words // w)
    return range(pick * w, pick * w + w)


def kv_sum(kv, start, end, sample_key, *, total_layers, sample_layers=0, window_bytes=0, layer_offset=0, head_offset=0):
    """(KV, words) of positions [start, end) of one request's logical bytes kv [L, halves, n, H, strip]."""
    num_layers, halves, _, heads, strip = kv.shape
    acc = words = 0
    for l in layers(sample_key, total_layers, sample_layers):
        if not layer_offset <= l < layer_offset + num_layers:
            continue
        for c in range(halves):
            for p in range(start, end):
                for h in range(heads):
                    k = key(l, c, head_offset + h, p)
                    raw = kv[l - layer_offset, c, p, h].tobytes()
                    for w in window(sample_key, l, strip // 8, window_bytes):
                        word = int.from_bytes(raw[8 * w: 8 * w + 8], "little")
                        acc += sm64(word ^ ((k + w * STRIDE) & MASK64))
                        words += 1
    return acc & MASK64, words


def rec_sum(tokens, start, end, prev_hash):
    """REC of positions [start, end) holding ``tokens[p]`` at position p, chained from ``prev_hash``."""
    acc = 0
    for p in range(start, end):
        acc += sm64((int(tokens[p]) & MASK64) ^ key(REC, 0, 0, p)) + sm64(p ^ key(REC, 1, 0, p))
    return (acc + sm64(prev_hash ^ key(REC, 0, 1, start))) & MASK64


def chain_at(tokens, start):
    """The prev_hash the record at ``start`` carries in a chain of ``tokens`` from position 0."""
    from canary_builders import hmix3

    h = ANCHOR_H
    for p in range(start):
        h = hmix3(h, int(tokens[p]), p)
    return h
