"""The fault classes of the digested transfer path (``kvcanary sim --faults transfer``), each modelled
on a reported transfer or offload bug and acting at one stage of :class:`~.transfer_path.DigestPath`."""

from __future__ import annotations

import numpy as np

from .faults import Fault
from .session import canary_buffers
from .transfer_path import host_array


class TransferFault(Fault):
    """A fault of the digested transfer path: it acts on the next transfer of a request no other
    fault depends on, and hurts that request (its decode blocks are the blast radius)."""

    drops_record = False
    acts_on_transfer = True  # what DigestPath asks of the live fault

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
        others = [b for b in sorted(held - set(req.blocks)) if tuple(int(x) for x in host_array(tail[b * bs, :2]).tolist()) != first]
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
