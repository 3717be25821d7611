"""A small continuous-batching serving engine over paged KV pools, with the canary in its loop.

Two pools, each with its own KV bytes, block allocator and canary session: pool ``prefill``
admits requests (prefix-cache lookup), runs chunked prefill and, for colocated requests, decode;
a finished prefill of a disaggregated request is transferred (KV bytes and canary rows) to pool
``decode``, which decodes it.  Requests may decode speculatively (several draft tokens per step,
rejected ones rolled back), may be aborted, and blocks may be moved by compaction (with their
canary rows, through ``kc.move_pages``).  Each step hands the canary the engine tables of the
chosen addressing mode (``tables.py``).  The engine is correct by construction: a clean run
reports no violation.

Faults (``faults.py``) act through the hook object ``Engine.hook`` (the live episode) and by
editing the engine's structures; :meth:`Engine.repair` restores a consistent state afterwards.
"""

from __future__ import annotations

import time
from collections import Counter, deque
from contextlib import contextmanager
from dataclasses import dataclass, field

import numpy as np

from .containment import Aftermaths, contain
from .kvpool import KvPool, prefix_contexts, step_contexts
from .session import (
    BOUND_HOST_US,
    Sightings,
    allocate_move_workspace,
    call_ops,
    canary_buffers,
    copy_canary_rows,
    make_session,
    move_canary_pages,
)
from .tables import NULL_BLOCK, PageMap, session_table


@dataclass(frozen=True)
class EngineConfig:
    block_size: int = 16
    num_blocks: int = 320  # per pool; block 0 is the null block (its slot 0 is the padding slot)
    max_running: int = 16  # per pool
    prefill_chunk: int = 16  # prefill tokens of one request per step (chunked prefill)
    prefill_budget: int = 64  # prefill tokens per step
    arrival_rate: float = 0.45  # mean new requests per step
    max_waiting: int = 16
    shared_prompts: int = 4  # system prompts shared by many requests (prefix-cache hits)
    shared_prompt_fraction: float = 0.7
    shared_prompt_blocks: tuple = (1, 4)
    suffix_tokens: tuple = (1, 48)
    new_tokens: tuple = (4, 40)
    spec_fraction: float = 0.3  # requests that decode speculatively
    spec_tokens: int = 4  # tokens per speculative step (the real next token and 3 drafts)
    disagg_fraction: float = 0.5  # requests prefilled in one pool and decoded in the other
    abort_rate: float = 0.02  # probability per step that one running request is aborted
    compact_every: int = 16  # steps between block moves (compaction)
    sweep_every: int = 8  # steps between sweeps of the prefix cache
    num_layers: int = 2
    kv_row_bytes: int = 16  # bytes of one token's K (and V) row per layer
    # The session's coverage past SGLang's record (docs/format.md section 9), on by default here: the
    # simulator measures what the canary can see.  deep_kv: every layer's K and V fingerprinted and
    # re-fingerprinted within deep_check_period steps; lost_stores: the lost-store check.
    deep_kv: bool = True
    deep_check_period: int = 4
    lost_stores: bool = True
    transfer_digest: str = "off"  # "full" / "default": transfers go through a host tier, digested (sim/transfer.py)
    vocab: int = 32000

    @property
    def num_slots(self) -> int:
        return self.num_blocks * self.block_size

    def coverage_options(self, kv) -> dict:
        """The CanarySession coverage options of a pool with KV ``kv``."""
        return dict(deep_kv_sources=kv.every_layer_sources() if self.deep_kv else (),
                    deep_check_slots=-(-(self.num_slots - 1) // self.deep_check_period) if self.deep_kv else None,
                    check_lost_stores=self.lost_stores,
                    max_step_tokens=self.prefill_budget + self.prefill_chunk + self.max_running * self.spec_tokens)

    @property
    def verify_capacity(self) -> int:
        """Verify entries of one step or one sweep launch (a sweep is split to fit)."""
        return 3 * self.num_slots


class OutOfBlocks(RuntimeError):
    pass


class BlockAllocator:
    """Reference-counted blocks and a free list used as a stack (the last freed is reused first)."""

    def __init__(self, num_blocks: int):
        self.refcount = np.zeros(num_blocks, np.int64)
        self.free = list(range(num_blocks - 1, NULL_BLOCK, -1))

    def alloc(self) -> int:
        if not self.free:
            raise OutOfBlocks
        block = self.free.pop()
        self.refcount[block] += 1
        return block

    def retain(self, block: int) -> None:
        self.refcount[block] += 1

    def release(self, block: int) -> None:
        if block == NULL_BLOCK or self.refcount[block] <= 0:
            return
        self.refcount[block] -= 1
        if self.refcount[block] == 0:
            self.free.append(block)

    def rebuild(self, holders: Counter) -> None:
        """Reference counts from the actual holders; the free list keeps its order, without
        duplicates or held blocks, and gains the unheld blocks it lacked (after a fault)."""
        self.refcount[:] = 0
        for block, n in holders.items():
            if block != NULL_BLOCK:
                self.refcount[block] = n
        seen, free = set(), []
        for block in self.free:
            if self.refcount[block] == 0 and block not in seen:
                seen.add(block)
                free.append(block)
        missing = [b for b in range(self.refcount.shape[0] - 1, NULL_BLOCK, -1) if self.refcount[b] == 0 and b not in seen]
        self.free = missing + free


@dataclass(eq=False)
class CacheEntry:
    key: int
    block: int
    parent: int | None
    tokens: tuple
    children: int = 0
    last_used: int = 0


class PrefixCache:
    """Full blocks of finished requests keyed by (parent key, block tokens); the cache holds one
    reference on each block.  Eviction removes the least recently used leaf held by nobody else."""

    def __init__(self, block_size: int):
        self.block_size = block_size
        self.entries: dict[int, CacheEntry] = {}

    @staticmethod
    def key(parent, tokens: tuple) -> int:
        return hash((-1 if parent is None else parent, tokens))  # ints and tuples hash alike in every process

    def match(self, tokens: np.ndarray, max_blocks: int, clock: int) -> list:
        found, parent = [], None
        for i in range(max_blocks):
            key = self.key(parent, tuple(tokens[i * self.block_size: (i + 1) * self.block_size].tolist()))
            entry = self.entries.get(key)
            if entry is None:
                break
            entry.last_used = clock
            found.append(entry)
            parent = key
        return found

    def insert(self, tokens: np.ndarray, blocks: list, num_full: int, allocator: BlockAllocator, clock: int) -> None:
        parent = None
        for i in range(min(num_full, len(blocks))):
            if blocks[i] == NULL_BLOCK:
                return
            block_tokens = tuple(tokens[i * self.block_size: (i + 1) * self.block_size].tolist())
            key = self.key(parent, block_tokens)
            entry = self.entries.get(key)
            if entry is None:
                self.entries[key] = CacheEntry(key, blocks[i], parent, block_tokens, last_used=clock)
                if parent is not None:
                    self.entries[parent].children += 1
                allocator.retain(blocks[i])
            else:
                entry.last_used = clock
            parent = key

    def evictable(self, allocator: BlockAllocator) -> int:
        return sum(1 for e in self.entries.values() if allocator.refcount[e.block] == 1)

    def evict_one(self, allocator: BlockAllocator) -> bool:
        leaves = [e for e in self.entries.values() if e.children == 0 and allocator.refcount[e.block] == 1]
        if not leaves:
            return False
        self._remove(min(leaves, key=lambda e: e.last_used), allocator)
        return True

    def _remove(self, entry: CacheEntry, allocator: BlockAllocator) -> None:
        del self.entries[entry.key]
        if entry.parent is not None and entry.parent in self.entries:
            self.entries[entry.parent].children -= 1
        allocator.release(entry.block)

    def subtree_blocks(self, blocks: set) -> set:
        """The blocks of the entries holding ``blocks`` and of all their descendants."""
        keys = {e.key for e in self.entries.values() if e.block in blocks}
        grew = True
        while grew:
            more = {e.key for e in self.entries.values() if e.parent in keys} - keys
            keys |= more
            grew = bool(more)
        return {self.entries[k].block for k in keys}

    def drop(self, blocks: set, allocator: BlockAllocator) -> None:
        """Remove the entries holding ``blocks`` and their descendants (without releasing: the
        caller rebuilds the reference counts)."""
        doomed = self.subtree_blocks(blocks)
        for key in [k for k, e in self.entries.items() if e.block in doomed]:
            entry = self.entries.pop(key)
            if entry.parent in self.entries:
                self.entries[entry.parent].children -= 1

    def path(self, key: int) -> list:
        entries = []
        while key is not None:
            entries.append(self.entries[key])
            key = entries[-1].parent
        return entries[::-1]

    def leaf_paths(self) -> list:
        """The root-to-leaf block lists: every cached block lies on one of them."""
        return [[e.block for e in self.path(leaf.key)] for leaf in self.entries.values() if leaf.children == 0]


@dataclass(eq=False)
class Request:
    rid: int
    tokens: np.ndarray  # int64: the whole true sequence (prompt, then the tokens the model samples)
    prompt_len: int
    shared_len: int  # leading tokens of a shared system prompt (identical across requests)
    spec: bool
    disagg: bool
    blocks: list = field(default_factory=list)
    computed: int = 0  # tokens whose KV is written and committed
    pool: str = "prefill"
    awaiting_transfer: bool = False
    alive: bool = True
    kv_contexts: object = None  # kvpool.prefix_contexts of tokens, computed on first use

    @property
    def total_len(self) -> int:
        return int(self.tokens.shape[0])


@dataclass
class Batch:
    reqs: list
    prefix: np.ndarray  # int64 [bs]: committed tokens before the step
    extend: np.ndarray  # int64 [bs]: tokens written this step
    accept: np.ndarray  # int64 [bs]: tokens committed after the step (speculative: <= extend)
    offsets: np.ndarray  # int64 [bs + 1]
    input_ids: np.ndarray  # int64 [T]
    positions: np.ndarray  # int64 [T]
    out_cache_loc: np.ndarray  # int64 [T]
    kv_skip: set = field(default_factory=set)  # flat token indices whose KV store is lost


class NoHook:
    """The hooks a live fault episode may implement (see faults.py); all do nothing here."""

    def on_batch(self, engine, pool, batch): pass
    def on_alloc(self, engine, pool, req, block): pass
    def on_cache_hit(self, engine, pool, req, blocks): pass
    def on_transfer(self, engine, req, dst_blocks): return dst_blocks
    def on_copy(self, src_pool, src_slots, dst_pool, dst_slots): pass
    def on_step_end(self, engine): pass


class Pool:
    """One server's KV: bytes, allocator, prefix cache (prefill pool only), page map (SGLang's
    unified-pool view of the blocks) and canary session."""

    def __init__(self, name: str, config: EngineConfig, xp, like, *, cache: bool):
        self.name = name
        self.config = config
        self.allocator = BlockAllocator(config.num_blocks)
        self.page_map = PageMap(config.num_blocks)
        self.cache = PrefixCache(config.block_size) if cache else None
        self.kv = KvPool(xp, config.num_slots, num_layers=config.num_layers, row_bytes=config.kv_row_bytes)
        self.session = make_session(config.num_slots, max_batch_size=config.max_running,
                                    verify_capacity=config.verify_capacity, like=like,
                                    real_kv_sources=self.kv.real_kv_sources(), coverage=config.coverage_options(self.kv))
        self.sightings = Sightings(self.session)
        self.move_workspace = allocate_move_workspace(self.session, 1, config.block_size, like=like)  # compaction moves one block
        self.ops = {call: (call, call_ops(self.session, call))  # what the timer counts of each canary call
                    for call in ("pre_forward", "post_forward", "end_step", "sweep", "move", "copy")}
        self.running: list[Request] = []
        self.ran = False  # whether this step ran a forward (and so the canary)
        self.writers: dict = {}  # slot -> id of the request whose token this step wrote there (the engine's own batch)
        self.origin: dict = {}  # block -> (pool name, block) its KV was transferred from

    def block_slots(self, blocks) -> np.ndarray:
        bs = self.config.block_size
        return (np.asarray(blocks, np.int64)[:, None] * bs + np.arange(bs)).reshape(-1)

    def slots(self, req: Request, start: int, end: int) -> np.ndarray:
        """The slots of positions ``[start, end)`` of ``req`` (0 where its table holds the null block)."""
        bs = self.config.block_size
        pos = np.arange(start, end)
        blocks = np.asarray(req.blocks, np.int64)[pos // bs]
        return np.where(blocks == NULL_BLOCK, 0, blocks * bs + pos % bs)

    def available(self) -> int:
        """Blocks that can still be promised to a new request."""
        evictable = self.cache.evictable(self.allocator) if self.cache else 0
        reserved = sum(max(self.blocks_needed(r) - len(r.blocks), 0) for r in self.running)
        return len(self.allocator.free) + evictable - reserved

    def blocks_needed(self, req: Request) -> int:
        """Blocks ``req`` holds at most in this pool (its prompt only, in a disaggregated prefill)."""
        c = self.config
        if self.cache is not None and req.disagg:
            return -(-req.prompt_len // c.block_size)
        return -(-(req.total_len + (c.spec_tokens if req.spec else 0)) // c.block_size)

    def alloc(self) -> int:
        while not self.allocator.free and self.cache is not None and self.cache.evict_one(self.allocator):
            pass
        return self.allocator.alloc()

    def holders(self) -> Counter:
        held = Counter(b for r in self.running for b in r.blocks)
        if self.cache is not None:
            held.update(e.block for e in self.cache.entries.values())
        return held


class _CanaryWindow:
    """One canary call's window: host CPU time from the timer's last act on entry to its first on
    exit (its events and bookkeeping outside, as a generator-based context's resumption was not)."""

    __slots__ = ("timer", "ops", "start", "t0")

    def __init__(self, timer: "StepTimer", ops):
        self.timer, self.ops = timer, ops

    def __enter__(self):
        self.start = self.timer._start()
        self.t0 = time.thread_time()

    def __exit__(self, kind, value, traceback):
        t = time.thread_time()
        timer = self.timer
        timer.canary_host += t - self.t0
        timer._stop("canary", self.start)
        if kind is None:
            timer.ops += len(self.ops)
            timer.op_counts.update(self.ops)
        return False


class StepTimer:
    """Host CPU time of the canary calls per step (this thread's: other processes sharing the
    cores do not inflate it), the library ops they make (:func:`session.call_ops`) and, under
    CUDA, device time (events) of the canary calls and of the model's KV store.

    Events around eager calls also count the GPU idling while the host launches; so every
    ``sample_every``-th step (under CUDA) is a *kernel sample*: :meth:`begin_step` first holds
    the stream with the stand-in spin kernel for longer than the host took to enqueue the last
    sampled step, so that the step's canary calls are queued before the GPU reaches them and
    the events around them measure the GPU running them back to back (kernel time plus
    device-side gaps).  :meth:`enqueued`, after the step's last canary call and before anything
    waits on the device, asks whether the spin had already finished: then the GPU may have
    waited for the host inside the window (the spin too short, or a call that blocked) and the
    sample is *spoiled*: counted, not used, and the next spin is longer.  A sampled step reports
    no event time (its events are the kernel time)."""

    MIN_SPIN_S, MAX_SPIN_S = 0.5e-3, 50e-3

    def __init__(self, cupy=None, *, sample_every: int = 7):
        self.cupy = cupy
        self.sample_every = sample_every if cupy is not None else 0
        self.canary_host = 0.0
        self.ops = 0
        self.op_counts = Counter()  # the step's library ops by kind
        self.figures = BOUND_HOST_US  # host us per op kind that the ops are held against
        self._events = {"canary": [], "model": []}
        self._spare = []  # events reused across steps: creating two per call would cost host time inside the window
        self._steps = 0
        self._sampled = False
        self._spin_done = None
        self._window_start = 0.0
        self._window_s = self.MIN_SPIN_S  # the host's time from the spin to the last call of the last sample
        self._margin = 3.0
        self._spoiled = False
        self._cycles_per_s = None

    def canary(self, call=("other", ())) -> "_CanaryWindow":
        """Around one canary call (a context): ``call`` is ``(name, ops)``, its name and the library
        ops it makes (kinds of :data:`session.BOUND_HOST_US`)."""
        return _CanaryWindow(self, call[1])

    @contextmanager
    def model(self):
        start = self._start()
        yield
        self._stop("model", start)

    def _event(self):
        return self._spare.pop() if self._spare else self.cupy.cuda.Event()

    def _start(self):
        """The start event of a device window, recorded (None without CUDA)."""
        if self.cupy is None:
            return None
        start = self._event()
        start.record()
        return start

    def _stop(self, what: str, start) -> None:
        if start is not None:
            stop = self._event()
            stop.record()
            self._events[what].append((start, stop))

    def begin_step(self) -> None:
        """At a step's start: on a sampled step, hold the stream with the spin kernel."""
        self._steps += 1
        self._sampled = bool(self.sample_every) and self._steps % self.sample_every == 0
        self._spoiled = False
        if not self._sampled:
            return
        from ..devtools import spin as spin_kernel  # only under CUDA, on a sampled step: off the import path

        if self._cycles_per_s is None:
            self._cycles_per_s = spin_kernel.cycles_per_second()
            self._spin_done = self._event()
        seconds = min(max(self._window_s * self._margin, self.MIN_SPIN_S), self.MAX_SPIN_S)
        spin_kernel.spin(int(seconds * self._cycles_per_s))
        self._spin_done.record()
        self._window_start = time.perf_counter()

    def enqueued(self) -> None:
        """After the step's last canary call, before anything waits on the device."""
        if not self._sampled:
            return
        self._window_s = time.perf_counter() - self._window_start
        self._spoiled = self._spin_done.done
        if self._spoiled:
            self._margin = min(self._margin * 2, 64.0)

    def take(self) -> dict:
        """This step's figures in microseconds (device ones None on the CPU; on a sampled step the
        canary's events are its kernel time, ``kernel_sample`` says whether the sample holds); resets."""
        out = {"canary_host_us": self.canary_host * 1e6, "canary_ops": self.ops,
               "canary_bound_us": sum(self.figures[k] * n for k, n in self.op_counts.items()),
               "canary_op_counts": self.op_counts,
               "canary_device_us": None, "model_device_us": None, "canary_kernel_us": None,
               "kernel_sample": None}
        if self.cupy is not None:
            device = {}
            for what, pairs in self._events.items():
                for _, stop in pairs[-1:]:
                    stop.synchronize()
                device[what] = sum(self.cupy.cuda.get_elapsed_time(a, b) for a, b in pairs) * 1e3
                for pair in pairs:
                    self._spare.extend(pair)
                pairs.clear()
            if not self._sampled:
                out["canary_device_us"], out["model_device_us"] = device["canary"], device["model"]
            else:
                out["kernel_sample"] = "spoiled" if self._spoiled else "ok"
                if not self._spoiled:
                    out["canary_kernel_us"] = device["canary"]
        self.canary_host, self.ops, self.op_counts = 0.0, 0, Counter()
        self._sampled = False
        return out


class Engine:
    def __init__(self, config: EngineConfig, *, seed: int, addressing: str, xp, cupy=None):
        self.config = config
        self.addressing = addressing
        self.xp = xp
        like = xp.zeros(1, xp.int64) if xp is not np else None
        self.pools = {name: Pool(name, config, xp, like, cache=name == "prefill")
                      for name in ("prefill", "decode")}
        seeds = np.random.SeedSequence(seed).spawn(3)
        self.workload_rng = np.random.default_rng(seeds[0])
        self.engine_rng = np.random.default_rng(seeds[1])
        self.fault_rng = np.random.default_rng(seeds[2])
        self.shared = [  # system prompts of whole blocks
            self.workload_rng.integers(0, config.vocab, config.block_size * int(
                self.workload_rng.integers(*config.shared_prompt_blocks, endpoint=True)))
            for _ in range(config.shared_prompts)]
        self.waiting: deque[Request] = deque()
        self.step_index = 0
        self.next_rid = 0
        self.hook = NoHook()
        self.protected: set = set()  # requests a live fault depends on: never aborted or compacted
        self.timer = StepTimer(cupy)
        self.counters = Counter()
        self.aftermaths = Aftermaths()  # what contained faults left behind (ground truth, measured)
        self.digest = None
        if config.transfer_digest != "off":
            from .transfer_path import DigestPath

            self.digest = DigestPath(self, config.transfer_digest)

    # -- plumbing --------------------------------------------------------------------------

    def alloc(self, pool: Pool, req: Request) -> int:
        block = pool.alloc()
        pool.origin.pop(block, None)
        self.hook.on_alloc(self, pool, req, block)
        return block

    def take_violations(self) -> list:
        """(pool name, Violation) of every violation seen since the last take (digest verdicts included)."""
        seen = [(name, v) for name, pool in self.pools.items() for v in pool.sightings.take()]
        return seen + (self.digest.take() if self.digest is not None else [])

    def dev(self, a):
        return a if self.xp is np else self.xp.asarray(a)

    # -- workload --------------------------------------------------------------------------

    def new_request(self, prompt_head=None, shared_len=0) -> Request:
        c, rng = self.config, self.workload_rng
        if prompt_head is None and rng.random() < c.shared_prompt_fraction:
            prompt_head = self.shared[int(rng.integers(len(self.shared)))]
            shared_len = len(prompt_head)
        head = np.zeros(0, np.int64) if prompt_head is None else np.asarray(prompt_head, np.int64)
        suffix = rng.integers(0, c.vocab, int(rng.integers(*c.suffix_tokens, endpoint=True)))
        new = rng.integers(0, c.vocab, int(rng.integers(*c.new_tokens, endpoint=True)))
        prompt = np.concatenate([head, suffix]).astype(np.int64)
        req = Request(self.next_rid, np.concatenate([prompt, new]).astype(np.int64), len(prompt), shared_len,
                      spec=bool(rng.random() < c.spec_fraction), disagg=bool(rng.random() < c.disagg_fraction))
        self.next_rid += 1
        return req

    def arrivals(self) -> None:
        for _ in range(int(self.workload_rng.poisson(self.config.arrival_rate))):
            if len(self.waiting) < self.config.max_waiting:
                self.waiting.append(self.new_request())

    def admit(self) -> None:
        pool = self.pools["prefill"]
        bs = self.config.block_size
        while self.waiting and len(pool.running) < self.config.max_running:
            req = self.waiting[0]
            hits = pool.cache.match(req.tokens, (req.prompt_len - 1) // bs, self.step_index)
            for e in hits:
                pool.allocator.retain(e.block)
            req.blocks = [e.block for e in hits]
            if pool.available() < pool.blocks_needed(req) - len(hits):
                for e in hits:
                    pool.allocator.release(e.block)
                req.blocks = []
                return
            self.waiting.popleft()
            req.computed = len(hits) * bs
            pool.running.append(req)
            self.hook.on_cache_hit(self, pool, req, req.blocks)

    # -- one step --------------------------------------------------------------------------

    def step(self) -> None:
        self.timer.begin_step()
        self.arrivals()
        self.admit()
        for pool in self.pools.values():
            self.forward(pool)
        self.transfer()
        if self.step_index % self.config.compact_every == self.config.compact_every - 1:
            self.compact()
        self.maybe_abort()
        for pool in self.pools.values():
            if pool.ran:  # an idle pool has no step to end (its session would report that no canary ran)
                with self.timer.canary(pool.ops["end_step"]):
                    pool.session.end_step()
        if self.step_index % self.config.sweep_every == self.config.sweep_every - 1:
            self.sweep()
        self.hook.on_step_end(self)
        self.timer.enqueued()  # the step's canary calls are queued; check() below waits for the device
        for pool in self.pools.values():
            pool.session.check()  # the simulator's choice, for exact latencies: an engine reads one step late
            pool.ran = False
        self.step_index += 1

    def schedule(self, pool: Pool) -> Batch | None:
        c, rng = self.config, self.engine_rng
        budget = c.prefill_budget
        reqs, extend, accept = [], [], []
        for req in list(pool.running):
            if req.awaiting_transfer:
                continue
            if req.computed < req.prompt_len:
                n = min(req.prompt_len - req.computed, c.prefill_chunk, budget)
                if n == 0:
                    continue
                budget -= n
                a = n
            else:
                n = min(c.spec_tokens if req.spec else 1, req.total_len - req.computed)
                a = int(rng.integers(1, n + 1)) if req.spec else n
            try:
                while len(req.blocks) * c.block_size < req.computed + n:
                    req.blocks.append(self.alloc(pool, req))
            except OutOfBlocks:  # only after a fault broke the accounting: preempt the request
                self.counters["preempted"] += 1
                self.abort(req)
                continue
            reqs.append(req)
            extend.append(n)
            accept.append(a)
        if not reqs:
            return None
        extend = np.asarray(extend, np.int64)
        offsets = np.zeros(len(reqs) + 1, np.int64)
        np.cumsum(extend, out=offsets[1:])
        ids, pos, loc = [], [], []
        for req, n, a in zip(reqs, extend, accept):
            tokens = req.tokens[req.computed: req.computed + n].copy()
            tokens[a:] = (tokens[a:] + 1) % c.vocab  # rejected drafts: tokens the target model does not pick
            ids.append(tokens)
            pos.append(np.arange(req.computed, req.computed + n, dtype=np.int64))
            loc.append(pool.slots(req, req.computed, req.computed + n))
        return Batch(reqs, np.array([r.computed for r in reqs], np.int64), extend, np.asarray(accept, np.int64),
                     offsets, np.concatenate(ids), np.concatenate(pos), np.concatenate(loc))

    def forward(self, pool: Pool) -> None:
        batch = self.schedule(pool)
        if batch is None:
            return
        self.hook.on_batch(self, pool, batch)
        self.aftermaths.on_batch(pool, batch)
        pool.writers = {int(s): req.rid for req, lo, hi in zip(batch.reqs, batch.offsets[:-1], batch.offsets[1:])
                        for s in batch.out_cache_loc[lo:hi]}
        table = session_table(self.addressing, [r.blocks for r in batch.reqs], [r.tokens for r in batch.reqs],
                              batch.prefix, self.config.block_size, pool.page_map, self.dev)
        d = self.dev
        # The step's inputs reach the device before the canary's window, as a real engine's batch
        # tensors are there already: the canary's host time is its own.
        prefix, extend, ids, positions, loc = map(d, (batch.prefix, batch.extend, batch.input_ids, batch.positions,
                                                      batch.out_cache_loc))
        labels = [r.rid for r in batch.reqs]
        with self.timer.canary(pool.ops["pre_forward"]):
            pool.session.pre_forward(table.req_pool_indices, prefix, extend, table.table, ids, positions, loc,
                                     expected_tokens=table.expected_tokens, expected_tokens_valid_lens=prefix,
                                     row_labels=labels)
        keep = batch.out_cache_loc >= 0
        keep[list(batch.kv_skip)] = False
        with self.timer.model():
            contexts = np.asarray(self.kv_contexts(batch), np.uint64)
            pool.kv.store(d(batch.out_cache_loc[keep]), d(batch.input_ids[keep]), d(batch.positions[keep]),
                          d(contexts[keep]))
        with self.timer.canary(pool.ops["post_forward"]):
            pool.session.post_forward()
        pool.ran = True
        self.commit(pool, batch)

    @staticmethod
    def kv_contexts(batch: Batch) -> list:
        """The context of each token the step feeds: its request's committed prefix, then the
        step's tokens before it (drafts included), as a model's KV depends on them."""
        out = []
        for r, req in enumerate(batch.reqs):
            if req.kv_contexts is None:
                req.kv_contexts = prefix_contexts(req.tokens)
            start = int(batch.offsets[r])
            out += step_contexts(req.kv_contexts[int(batch.prefix[r])], batch.input_ids[start : start + int(batch.extend[r])])
        return out

    def commit(self, pool: Pool, batch: Batch) -> None:
        bs = self.config.block_size
        for req, a in zip(batch.reqs, batch.accept):
            if not req.alive:
                continue
            req.computed += int(a)
            keep = -(-req.computed // bs)
            for block in req.blocks[keep:]:  # speculative rollback: blocks of rejected drafts only
                pool.allocator.release(block)
            del req.blocks[keep:]
            if req.computed >= req.total_len:
                self.finish(pool, req)
            elif pool.cache is not None and req.disagg and req.computed >= req.prompt_len:
                req.awaiting_transfer = True

    def finish(self, pool: Pool, req: Request) -> None:
        if pool.cache is not None:
            pool.cache.insert(req.tokens, req.blocks, req.computed // self.config.block_size, pool.allocator, self.step_index)
        self.release(pool, req)

    def release(self, pool: Pool, req: Request) -> None:
        pool.running.remove(req)
        for block in req.blocks:
            pool.allocator.release(block)
        req.blocks = []
        req.alive = False

    def abort(self, req: Request) -> None:
        if not req.alive:
            return
        if req in self.waiting:
            self.waiting.remove(req)
            req.alive = False
            return
        self.release(self.pools[req.pool], req)

    def transfer(self) -> None:
        """Finished disaggregated prefills move to the decode pool: KV bytes and canary rows."""
        src, dst = self.pools["prefill"], self.pools["decode"]
        for req in [r for r in src.running if r.awaiting_transfer]:
            if len(dst.running) >= self.config.max_running or dst.available() < dst.blocks_needed(req):
                return
            new_blocks = [self.alloc(dst, req) for _ in req.blocks]
            copy_to = self.hook.on_transfer(self, req, list(new_blocks))
            if self.digest is not None:
                self.digest.transfer(self, src, dst, req, copy_to, new_blocks)
            else:
                src_slots, dst_slots = src.block_slots(req.blocks), dst.block_slots(copy_to)
                src.kv.copy_rows(self.dev(src_slots), self.dev(dst_slots), dst.kv)
                self.hook.on_copy(src, src_slots, dst, dst_slots)
                src_dev, dst_dev = self.dev(src_slots), self.dev(dst_slots)
                with self.timer.canary(src.ops["copy"]):
                    copy_canary_rows(src.session, dst.session, src_dev, dst_dev)
            src_slots, dst_slots = src.block_slots(req.blocks), dst.block_slots(copy_to)
            self.aftermaths.carry(src.name, src_slots, dst.name, dst_slots)
            dst.origin.update((b, (src.name, a)) for a, b in zip(req.blocks, copy_to))
            self.finish(src, req)  # the prefill server caches the prompt
            req.alive, req.awaiting_transfer, req.pool, req.blocks = True, False, "decode", new_blocks
            dst.running.append(req)

    def compact(self) -> None:
        """Move one block of a running request to another place, canary rows included."""
        if self.protected:
            return
        candidates = [(pool, req, i) for pool in self.pools.values() for req in pool.running
                      for i in self.exclusive_blocks(pool, req)]
        if not candidates:
            return
        pool, req, i = candidates[int(self.engine_rng.integers(len(candidates)))]
        if self.move_block(pool, req, i) is not None:
            self.counters["compactions"] += 1

    def move_block(self, pool: Pool, req: Request, i: int, *, move_canary=True, update_table=True):
        """Compaction of block ``i`` of ``req`` to a free block: its KV bytes, its canary rows
        (``kc.move_pages`` on both buffers) and its table (the request's block list and the page
        map, which SGLang's unified pool rebinds).  Returns ``(old, new)``, or None when no block is
        free.  The faults leave a piece out."""
        if not pool.allocator.free:
            return None
        old, new = req.blocks[i], pool.allocator.alloc()
        pool.kv.copy_rows(self.dev(pool.block_slots([old])), self.dev(pool.block_slots([new])))
        self.aftermaths.carry(pool.name, pool.block_slots([old]), pool.name, pool.block_slots([new]))
        self.hook.on_copy(pool, pool.block_slots([old]), pool, pool.block_slots([new]))
        if move_canary:
            src_page, dst_page = self.dev(np.array([old], np.int64)), self.dev(np.array([new], np.int64))
            with self.timer.canary(pool.ops["move"]):
                move_canary_pages(pool.session, src_page, dst_page, page_size=self.config.block_size,
                                  workspace=pool.move_workspace)
        if update_table:
            req.blocks[i] = new
            pool.page_map.rebind(old, new)
        pool.allocator.release(old)
        return old, new

    def maybe_abort(self) -> None:
        if self.engine_rng.random() >= self.config.abort_rate:
            return
        running = [r for p in self.pools.values() for r in p.running if r not in self.protected]
        if running:
            self.abort(running[int(self.engine_rng.integers(len(running)))])
            self.counters["aborted"] += 1

    def sweep(self) -> None:
        pool = self.pools["prefill"]
        paths = pool.cache.leaf_paths()
        if not paths:
            return
        bs, capacity = self.config.block_size, self.config.verify_capacity
        chunks, chunk, entries = [], [], 0
        for path in paths:  # launches of at most verify_capacity entries each
            if chunk and entries + len(path) * bs > capacity:
                chunks.append(chunk)
                chunk, entries = [], 0
            chunk.append(path)
            entries += len(path) * bs
        chunks.append(chunk)
        for chunk in chunks:
            lens = np.array([len(p) * bs for p in chunk], np.int64)
            table = session_table(self.addressing, chunk, [np.zeros(0, np.int64)] * len(chunk),
                                  np.zeros(len(chunk), np.int64), bs, pool.page_map, self.dev)
            lens = self.dev(lens)
            with self.timer.canary(pool.ops["sweep"]):
                pool.session.sweep(table.req_pool_indices, lens, table.table)

    # -- helpers for faults ----------------------------------------------------------------

    def exclusive_blocks(self, pool: Pool, req: Request) -> list:
        """Indices of ``req``'s full, committed blocks that only it holds and whose content is its
        own (past any shared system prompt): a fault there corrupts one request only."""
        bs = self.config.block_size
        cached = {e.block for e in pool.cache.entries.values()} if pool.cache else set()
        return [i for i, b in enumerate(req.blocks[: req.computed // bs])
                if b != NULL_BLOCK and i * bs >= req.shared_len and pool.allocator.refcount[b] == 1 and b not in cached]

    def canary_rows(self, pool: Pool, slot: int) -> tuple:
        return tuple(buf[slot].copy() for buf in canary_buffers(pool.session))

    def set_canary_rows(self, pool: Pool, slot: int, rows: tuple) -> None:
        for buf, row in zip(canary_buffers(pool.session), rows):
            buf[slot] = row

    def _fault_blocks(self, pool_name: str, ep) -> set:
        bs = self.config.block_size
        blocks = {s // bs for p, s in ep.touched if p == pool_name} | {b for p, b in ep.held if p == pool_name}
        return blocks - {NULL_BLOCK}

    def blast_radius(self, pool_name: str, ep) -> set:
        """Slots whose violations fault episode ``ep`` explains: the slots it touched, the blocks its
        victims read or held during the episode and those of any request that read a touched block
        (finished ones included), every block of a request holding one of those, and the cached
        blocks below them (a corrupted record also breaks its successor's chain check)."""
        pool = self.pools[pool_name]
        blocks = self._fault_blocks(pool_name, ep)
        slots = {s for p, s in ep.touched if p == pool_name}
        slots.update(pool.block_slots(sorted({b for p, b in ep.read if p == pool_name} - {NULL_BLOCK})).tolist())
        for req in pool.running:
            if req in ep.victims or blocks & set(req.blocks):
                blocks |= set(req.blocks) - {NULL_BLOCK}
        if pool.cache is not None and blocks:
            blocks |= pool.cache.subtree_blocks(blocks)
        slots.update(pool.block_slots(sorted(blocks)).tolist())
        return slots

    def contain(self, reported) -> tuple[set, set]:
        """The engine's reaction to the violations its canaries reported in a step, from the reports
        alone (:func:`containment.contain`): ``(aborted request ids, evicted (pool, block) pairs)``."""
        return contain(self, reported)

    def end_episode(self) -> None:
        """A detected fault was contained: nothing depends on its victims any more."""
        self.protected = set()
        self.hook = NoHook()

    def poisoned_slots(self, ep) -> set:
        """(pool, slot) pairs holding a fault episode's bad KV (ground truth, for measuring containment):
        the real slots it wrote or mis-addressed (not the null block's: they hold nobody's KV; the
        requests reading them through a hole are the episode's victims)."""
        if not ep.fault.poisons_kv:
            return set()
        null = set(range(NULL_BLOCK * self.config.block_size, (NULL_BLOCK + 1) * self.config.block_size))
        return {(p, s) for p, s in ep.touched if s not in null}

    def repair(self, ep) -> None:
        """After fault episode ``ep``: abort every request holding a block it touched or a victim
        held, drop those blocks from the prefix cache and rebuild reference counts and free lists
        from the live tables."""
        victims = set(ep.victims)
        for name, pool in self.pools.items():
            blocks = self._fault_blocks(name, ep)
            victims |= {r for r in pool.running if blocks & set(r.blocks)}
            pool.session.coverage.forget(pool.block_slots(sorted(blocks)))  # the rotation stops re-reporting the freed KV
            if pool.cache is not None:
                pool.cache.drop(blocks, pool.allocator)
        for req in sorted(victims, key=lambda r: r.rid):  # a fixed order: the free lists depend on it
            self.abort(req)
        for pool in self.pools.values():
            pool.allocator.rebuild(pool.holders())
        self.protected = set()
        self.hook = NoHook()
