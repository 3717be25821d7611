"""The simulator's digested transfer path and its fault classes (``--transfer-digest full|default``).

With a transfer digest, a finished disaggregated prefill moves to the decode pool through a host
tier (an offload buffer in host memory): the prefill pool digests the request (sender: its TAIL
canary records give the provenance) and the record travels with the KV; the host tier digests what
it holds (``DigestLaunchTag.OFFLOAD``) and the decode pool digests its own memory once the KV
landed (``DigestLaunchTag.TRANSFER``), each against the sender's record, from the request's own
tokens.  A verdict other than MATCH is a sighting on the request's first decode slot (the runner
attributes it like any canary violation).  The fault classes below each model a reported
transfer or offload bug; each acts at one stage of this path.
"""

from __future__ import annotations

import numpy as np

from ..digest import DIGEST_NUM_KINDS, DigestBatch, DigestLaunchTag, DigestSpec, DigestVerdict, KvLayout, digest_pages, verify_digest
from ..hashing import splitmix64
from ..plans import ViolationLog
from ..reporting import Violation
from .engine import Engine, Pool, Request
from .faults import Episode, Fault
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

    def __init__(self, engine: Engine, mode: str):
        c = engine.config
        xp = engine.xp
        like = None if xp is np else xp.zeros(1, xp.int64)
        self.spec = DigestSpec.full(c.num_layers) if mode == "full" else DigestSpec(c.num_layers)
        self.host = KvPool(np, c.num_slots, num_layers=c.num_layers, row_bytes=c.kv_row_bytes)
        # the HEAD and TAIL canary rows that ride with the blocks (the digest reads the TAIL ones)
        self.host_canaries = tuple(np.zeros((c.num_slots, 4), np.int64) for _ in range(2))
        self.layouts = {name: pool_layout(pool.kv) for name, pool in engine.pools.items()}
        self.host_layout = pool_layout(self.host)
        self.logs = {"device": ViolationLog.allocate(4, num_kinds=DIGEST_NUM_KINDS, like=like),
                     "host": ViolationLog.allocate(4, num_kinds=DIGEST_NUM_KINDS)}
        self.verdicts = {DigestLaunchTag.OFFLOAD.name: {}, DigestLaunchTag.TRANSFER.name: {}}
        self.sightings: list = []

    def _digest(self, engine, layout, canary, slots, req: Request, *, sender: bool, host: bool) -> DigestBatch:
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

    def _check(self, engine, sent: bytes | None, got: DigestBatch, tag: DigestLaunchTag, req: Request, slot: int, host: bool):
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

    def transfer(self, engine: Engine, src: Pool, dst: Pool, req: Request, copy_to: list, new_blocks: list) -> None:
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
        self.host.data[:, :, block_slots] = _host(src.kv.data[:, :, engine.dev(block_slots)])
        for host_rows, rows in zip(self.host_canaries, canary_buffers(src.session)):
            host_rows[block_slots] = _host(rows[engine.dev(block_slots)])
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


def _host(a) -> np.ndarray:
    return a if isinstance(a, np.ndarray) else a.get()


def _live_transfer_fault(engine, req):
    """The transfer fault that fired on this transfer of ``req`` (it acts on this transfer only)."""
    ep = engine.hook
    if isinstance(ep, Episode) and isinstance(ep.fault, TransferFault) and ep.state.get("req") is req \
            and not ep.state.get("done"):
        ep.state["done"] = True
        return ep.fault
    return None


class TransferFault(Fault):
    """A fault of the digested transfer path: it acts on the next transfer of a request no other
    fault depends on, and hurts that request (its decode blocks are the blast radius)."""

    drops_record = False

    def inject(self, engine, ep):
        return engine.digest is not None

    def on_transfer(self, engine, ep, req, dst_blocks):
        if req in engine.protected or not self.ready(engine, ep, req):
            return dst_blocks
        ep.touch_blocks(engine.pools["decode"], dst_blocks)
        ep.hurt(engine, req)
        ep.fire(engine)
        ep.state["req"] = req
        return self.destination(engine, ep, list(dst_blocks))

    def ready(self, engine, ep, req) -> bool:
        """Whether this transfer of ``req`` offers the fault a target (else it waits for the next)."""
        return True

    def destination(self, engine, ep, dst_blocks: list) -> list:
        return dst_blocks

    def sender_blocks(self, engine, ep, req) -> list:
        return list(req.blocks)

    def at_rest(self, engine, path, req, slots) -> None:
        pass

    def landed_blocks(self, n: int):
        return np.arange(n)

    def scramble(self, rows):
        return rows


class TransferNeverLanded(TransferFault):
    name = "transfer_never_landed"
    description = ("A transfer is reported done but none of its KV landed (vllm-project/vllm#52234: a failed NIXL "
                   "receive returned HTTP 200): the decode blocks hold a previous owner's bytes and rows.")

    def landed_blocks(self, n):
        return np.arange(0)


class TransferPartial(TransferFault):
    name = "transfer_partial"
    description = ("Only the first half of a request's blocks land (a chunked transfer whose last chunks were "
                   "lost, acknowledged before visible: vllm-project/vllm#44238); the rest keep stale bytes.")

    def landed_blocks(self, n):
        return np.arange(n // 2)


class TransferWrongOwner(TransferFault):
    name = "transfer_wrong_owner"
    description = ("The sender maps the request onto another request's cached blocks and sends (and digests) "
                   "those: right bytes, wrong owner (local-inference-lab/vllm#480, vllm-project/vllm#38715).")

    def ready(self, engine, ep, req):
        """A block of the prefill pool (cached or another request's) whose first record is another
        (token, position) than the request's first: sending it in place of block 0 changes the content."""
        pool, bs = engine.pools["prefill"], engine.config.block_size
        held = {b for r in pool.running if r is not req for b in r.blocks} | {e.block for e in pool.cache.entries.values()}
        tail = canary_buffers(pool.session)[1]
        first = (int(req.tokens[0]), 0)
        others = [b for b in sorted(held - set(req.blocks)) if tuple(int(x) for x in _host(tail[b * bs, :2]).tolist()) != first]
        if not others:
            return False
        ep.state["borrowed"] = others[int(engine.fault_rng.integers(len(others)))]
        return True

    def sender_blocks(self, engine, ep, req):
        return [ep.state["borrowed"]] + list(req.blocks[1:])


class TransferLayoutMismatch(TransferFault):
    name = "transfer_layout_mismatch"
    description = ("The receiver lays the bytes out in another order than the sender (NHD bytes into an HND "
                   "pool, LMCache/LMCache#4463): every byte lands, in the wrong place.")

    def scramble(self, rows):
        layers, halves, n, width = rows.shape
        return np.ascontiguousarray(rows.transpose(2, 0, 1, 3)).reshape(layers, halves, n, width)


class HostTierBitFlip(TransferFault):
    name = "host_tier_bitflip"
    description = ("A bit flips at rest in the host tier between offload and reload (host DRAM, a storage "
                   "round trip: vllm-project/vllm#57912 checks this hop only).")

    def at_rest(self, engine, path, req, slots):
        slot = int(slots[int(engine.fault_rng.integers(len(slots)))])  # a digested position's slot
        layer = int(engine.fault_rng.integers(path.host.num_layers))
        path.host.flip_bit(slot, layer, int(engine.fault_rng.integers(2)), int(engine.fault_rng.integers(path.host.row_bytes)), 3)


class ReloadWrongSlots(TransferFault):
    name = "reload_wrong_slots"
    description = ("The reload from the host tier writes one block into the wrong decode block (an off-by-one "
                   "in the destination list); the intended block keeps stale data.")

    def destination(self, engine, ep, dst_blocks):
        i = len(dst_blocks) - 1
        wrong = dst_blocks[i] + 1 if dst_blocks[i] + 1 < engine.config.num_blocks else dst_blocks[i] - 1
        ep.touch_blocks(engine.pools["decode"], [wrong])
        dst_blocks[i] = wrong
        return dst_blocks


class SenderSendsNoDigest(TransferFault):
    name = "sender_sends_no_digest"
    description = ("The sender sends no digest (SGLang's PD checksum passes when the prefill side never wrote "
                   "one): the KV is intact, but nothing vouches for it, which must never pass.")
    drops_record = True


TRANSFER_FAULTS = {cls.name: cls for cls in (TransferNeverLanded, TransferPartial, TransferWrongOwner,
                                             TransferLayoutMismatch, HostTierBitFlip, ReloadWrongSlots,
                                             SenderSendsNoDigest)}
