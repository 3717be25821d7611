"""A toy serving engine for the CanarySession tests: a req_to_token table, a free list of KV slots
and fixed-size step arrays (NumPy), so that the same steps can run eagerly on every backend or be
replayed through a captured CUDA graph.

Requests live in pool rows 1..max_reqs.  A step prefills the rows it sees for the first time
(``prefill`` tokens) and decodes one token for the others.  The batch is padded to ``bs`` rows
(pool row 0, nothing to extend) and the flat tokens to ``tokens`` (slot 0, position 0).  Token
ids are ``token_id(row, position)``, so an expected-token pool can be built from the table.
"""

from __future__ import annotations

import numpy as np

STEP_KEYS = ("rp", "prefix", "extend", "ids", "pos", "loc")


def token_id(row, position):
    return 1000 * np.asarray(row, np.int64) + np.asarray(position, np.int64)


class ToyEngine:
    def __init__(self, num_slots=512, max_reqs=8, max_len=64, bs=8, tokens=64, prefill=6, seed=0):
        rng = np.random.default_rng(seed)
        self.num_slots, self.bs, self.tokens, self.prefill = num_slots, bs, tokens, prefill
        self.rtt = np.zeros((max_reqs + 1, max_len), np.int32)
        self.lens = np.zeros(max_reqs + 1, np.int64)
        self.free = [int(s) for s in rng.permutation(np.arange(1, num_slots))]

    def step(self, rows) -> dict:
        """The padded arrays of one step over pool ``rows`` (batch row i = rows[i]); advances lengths."""
        rows = [int(r) for r in rows]
        assert len(rows) <= self.bs
        rp = np.zeros(self.bs, np.int64)
        prefix = np.zeros(self.bs, np.int64)
        extend = np.zeros(self.bs, np.int64)
        ids, pos, loc = [], [], []
        for i, r in enumerate(rows):
            n = self.prefill if self.lens[r] == 0 else 1
            rp[i], prefix[i], extend[i] = r, self.lens[r], n
            for p in range(self.lens[r], self.lens[r] + n):
                self.rtt[r, p] = self.free.pop()
                loc.append(self.rtt[r, p])
                pos.append(p)
                ids.append(int(token_id(r, p)))
            self.lens[r] += n
        pad = self.tokens - len(loc)
        assert pad >= 0
        as64 = lambda v: np.asarray(list(v) + [0] * pad, np.int64)
        return dict(rp=rp, prefix=prefix, extend=extend, ids=as64(ids), pos=as64(pos), loc=as64(loc))

    def expected_tokens(self) -> np.ndarray:
        """The expected-token pool ``[rows, max_len]`` int32 of every position written so far."""
        rows, cols = self.rtt.shape
        pool = token_id(np.arange(rows)[:, None], np.arange(cols)[None, :]).astype(np.int32)
        return np.where(np.arange(cols)[None, :] < self.lens[:, None], pool, -1).astype(np.int32)


def schedule(num_steps, max_reqs=8, seed=1):
    """Pool rows per step: a changing subset of 2..bs running requests (rows join, never leave early)."""
    rng = np.random.default_rng(seed)
    out = []
    for step in range(num_steps):
        live = min(max_reqs, 2 + step)
        rows = sorted(rng.choice(np.arange(1, live + 1), size=rng.integers(2, live + 1), replace=False).tolist())
        out.append(rows)
    return out
