"""The simulator's digested transfer path (``--transfer-digest full|default``).

With a transfer digest, a finished disaggregated prefill moves to the decode pool through a host
tier (an offload buffer in host memory): the prefill pool digests the request (sender: its TAIL
canary records give the provenance) and the record travels with the KV; the host tier digests what
it holds (``DigestLaunchTag.OFFLOAD``) and the decode pool digests its own memory once the KV
landed (``DigestLaunchTag.TRANSFER``), each against the sender's record, from the request's own
tokens.  A verdict other than MATCH is a sighting on the request's first decode slot (the runner
attributes it like any canary violation).  The fault classes of this path (``sim/transfer.py``)
each model a reported transfer or offload bug and act at one stage of it: :meth:`DigestPath.transfer`
asks the live one, duck-typed, so this module imports neither the engine nor the faults.
"""

from __future__ import annotations

import numpy as np

from ..digest import DIGEST_NUM_KINDS, DigestBatch, DigestLaunchTag, DigestSpec, DigestVerdict, KvLayout, digest_pages, verify_digest
from ..hashing import splitmix64
from ..plans import ViolationLog
from ..reporting import Violation
from .kvpool import KvPool
from .session import canary_buffers

DIGEST_MODES = ("off", "full", "default")


def pool_layout(kv: KvPool) -> KvLayout:
    """The simulator's pool ``data[layer, half, slot, byte]`` as a KvLayout (one head, one strip a row)."""
    rows = kv.row_bytes
    pages = kv.data.shape[2]
    return KvLayout.from_strides([[kv.data[l, 0], kv.data[l, 1]] for l in range(kv.num_layers)], page_stride=rows,
                                 token_stride=rows, head_stride=rows, strip_bytes=rows, page_size=1, num_pages=pages,
                                 num_heads=1, dtype="uint8", name="kvcanary-sim")


class DigestPath:
    """Prefill -> host tier -> decode, with a digest checked at the host tier and on arrival."""

    def __init__(self, engine, mode: str):
        c = engine.config
        xp = engine.xp
        like = None if xp is np else xp.zeros(1, xp.int64)
        self.spec = DigestSpec.full(c.num_layers) if mode == "full" else DigestSpec(c.num_layers)
        self.host = KvPool(np, c.num_slots, num_layers=c.num_layers, row_bytes=c.kv_row_bytes)
        # the HEAD and TAIL canary rows that ride with the blocks (the digest reads the TAIL ones)
        self.host_canaries = tuple(np.zeros((c.num_slots, buf.shape[1]), np.int64)  # TAIL rows: 6 fields with deep_kv
                                   for buf in canary_buffers(engine.pools["prefill"].session))
        self.layouts = {name: pool_layout(pool.kv) for name, pool in engine.pools.items()}
        self.host_layout = pool_layout(self.host)
        self.logs = {"device": ViolationLog.allocate(4, num_kinds=DIGEST_NUM_KINDS, like=like),
                     "host": ViolationLog.allocate(4, num_kinds=DIGEST_NUM_KINDS)}
        self.verdicts = {DigestLaunchTag.OFFLOAD.name: {}, DigestLaunchTag.TRANSFER.name: {}}
        self.sightings: list = []

    def _digest(self, engine, layout, canary, slots, req, *, sender: bool, host: bool) -> DigestBatch:
        xp = np if host else engine.xp
        n = len(slots)
        table = np.zeros((2, max(n, 1)), np.int32)
        table[1, :n] = slots
        args = [xp.asarray(a) for a in (table, np.array([1], np.int64), np.array([0], np.int64), np.array([n], np.int64),
                                        np.array([splitmix64(req.rid) & (2**63 - 1)], np.int64))]
        kw = {"records": canary}
        if not sender:
            tokens = np.zeros((2, max(n, 1)), np.int32)
            tokens[1, :n] = req.tokens[:n]
            kw["expected_tokens"] = xp.asarray(tokens)
        return digest_pages(layout, args[0], args[1], args[2], args[3], spec=self.spec, sample_keys=args[4], **kw)

    def _check(self, engine, sent: bytes | None, got: DigestBatch, tag: DigestLaunchTag, req, slot: int, host: bool):
        log = self.logs["host" if host else "device"]
        log.reset()
        like = None if host or engine.xp is np else got.records
        expected = DigestBatch.from_records([sent], like=like)
        code = DigestVerdict(int(np.asarray(verify_digest(expected, got, log=log, kernel_kind=tag).tolist())[0]))
        counts = self.verdicts[tag.name]
        counts[code.name] = counts.get(code.name, 0) + 1
        if code != DigestVerdict.MATCH:
            row = [int(x) for x in np.asarray(log.ring.tolist())[0]]
            row[1] = slot  # the request's first decode slot: what the runner attributes
            self.sightings.append(("decode", Violation.from_row(row)))

    def take(self) -> list:
        seen, self.sightings = self.sightings, []
        return seen

    def transfer(self, engine, src, dst, req, copy_to: list, new_blocks: list) -> None:
        """Move ``req``'s KV and canary rows from ``src`` to ``dst`` through the host tier, digesting."""
        bs = engine.config.block_size
        fault = _live_transfer_fault(engine, req)
        n = req.computed
        pos = np.arange(n)
        send_blocks = list(req.blocks) if fault is None else fault.sender_blocks(engine, engine.hook, req)
        src_slots = np.asarray(send_blocks, np.int64)[pos // bs] * bs + pos % bs
        src_tail = canary_buffers(src.session)[1]
        with engine.timer.canary():
            sent = self._digest(engine, self.layouts[src.name], src_tail, src_slots, req, sender=True, host=False).to_bytes()
        if fault is not None and fault.drops_record:
            sent = None
        # D2H: the request's blocks into the host tier (same block ids: the tier mirrors the pool)
        block_slots = src.block_slots(send_blocks)
        self.host.data[:, :, block_slots] = host_array(src.kv.data[:, :, engine.dev(block_slots)])
        for host_rows, rows in zip(self.host_canaries, canary_buffers(src.session)):
            host_rows[block_slots] = host_array(rows[engine.dev(block_slots)])
        if fault is not None:
            fault.at_rest(engine, self, req, src_slots)
        first_slot = int(new_blocks[0]) * bs if new_blocks else 0
        with engine.timer.canary():  # the host tier holds the sent blocks at their prefill slots
            got = self._digest(engine, self.host_layout, self.host_canaries[1], src_slots, req, sender=False, host=True)
            self._check(engine, sent, got, DigestLaunchTag.OFFLOAD, req, first_slot, host=True)
        # H2D: from the host tier into the decode pool's blocks, with the canary rows riding along
        landed = np.arange(len(send_blocks)) if fault is None else fault.landed_blocks(len(send_blocks))
        for i in landed:
            s, d = src.block_slots([send_blocks[i]]), dst.block_slots([copy_to[i]])
            rows = self.host.data[:, :, s]
            if fault is not None:
                rows = fault.scramble(rows)
            dst.kv.data[:, :, engine.dev(d)] = engine.dev(rows)
            for buf, host_rows in zip(canary_buffers(dst.session), self.host_canaries):
                buf[engine.dev(d)] = engine.dev(host_rows[s])
        dst_slots = np.asarray(new_blocks, np.int64)[pos // bs] * bs + pos % bs
        with engine.timer.canary():
            got = self._digest(engine, self.layouts[dst.name], canary_buffers(dst.session)[1], dst_slots, req,
                               sender=False, host=False)
            self._check(engine, sent, got, DigestLaunchTag.TRANSFER, req, first_slot, host=False)


def host_array(a) -> np.ndarray:
    return a if isinstance(a, np.ndarray) else a.get()


def _live_transfer_fault(engine, req):
    """The transfer fault (``sim/transfer.py``) that fired on this transfer of ``req``; it acts on
    this transfer only."""
    ep = engine.hook
    fault = getattr(ep, "fault", None)
    if getattr(fault, "acts_on_transfer", False) and ep.state.get("req") is req and not ep.state.get("done"):
        ep.state["done"] = True
        return fault
    return None
