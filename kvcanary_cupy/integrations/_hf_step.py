"""The canary in one ``ContinuousBatchProcessor``'s step: what its attention reads and writes.

Per step (``ModelRunner.compute_batch``): the batch's own tensors (``cu_seq_lens_q`` / ``_k``,
``read_index``, ``write_index``, ``block_table``, ``input_ids``, ``position_ids``) go to
``CanarySession.pre_forward`` before the forward and ``post_forward`` / ``end_step`` after it.
The engine's tensors are read, never written: where the canary's slots differ from the engine's
indices (5.17's ``slot_offset``) or its dtypes from the session's, they are shifted or widened into
the canary's own buffers, on the engine's compute stream.
"""

from __future__ import annotations

import collections
import contextlib
from typing import Any

import numpy as np

from ..ops import copy_pages
from ..plans import RealKvSource
from ..tables import BlockTable, PagedKvIndices
from ._base import LABEL_WINDOW
from ._hf_layout import FLAT_CACHE, Layout, hook_cache, wrap

#: The label of 5.17's in-place rewrite of a complete, shared block (docs/engines.md).
SHARED_BLOCK_REWRITE = "engine_rewrote_shared_block"
#: The label of a lost-store row in a slot the canary had never stamped (docs/engines.md): transformers
#: allocates its cache with torch.empty, so a slot's first store is compared with recycled memory,
#: which an earlier run of the same prompts leaves holding the very KV this store writes.
FIRST_STORE_UNCHANGED = "first_store_unchanged_bytes"


#: The expected-token pool handed to the session is a multiple of this many columns wide (_pool_views).
POOL_COLUMN_STEP = 64


class _History:
    """The engine's token history of one request (``initial_tokens + generated_tokens``), int32, grown in place."""

    __slots__ = ("state", "tokens", "n", "prompt")

    def __init__(self, state):
        self.state, self.prompt = state, len(state.initial_tokens)
        self.tokens = np.zeros(max(64, 2 * (self.prompt + len(state.generated_tokens))), np.int32)
        self.tokens[: self.prompt] = state.initial_tokens
        self.n = self.prompt

    def update(self) -> np.ndarray:
        generated = self.state.generated_tokens
        end = self.prompt + len(generated)
        if end > self.tokens.shape[0]:
            grown = np.zeros(2 * end, np.int32)
            grown[: self.n] = self.tokens[: self.n]
            self.tokens = grown
        if end == self.n + 1:  # a decode step's one new token: a scalar store
            self.tokens[self.n] = generated[-1]
            self.n = end
        elif end > self.n:
            self.tokens[self.n : end] = generated[self.n - self.prompt :]
            self.n = end
        return self.tokens


class _StreamSwitch:
    """``torch.cuda.stream(stream)`` for a stream whose device is known: torch's context looks the
    current device up several times on each entry, which costs more than the switch itself."""

    __slots__ = ("_cuda", "_stream", "_index", "_device", "_previous")

    def __init__(self, torch, stream):
        self._cuda, self._stream, self._index = torch.cuda, stream, stream.device_index

    def __enter__(self):
        cuda = self._cuda
        self._device = cuda.current_device()
        self._previous = cuda.current_stream(self._index)
        cuda.set_stream(self._stream)  # makes the stream's device current, as torch's context does

    def __exit__(self, *exc):
        cuda = self._cuda
        cuda.set_stream(self._previous)
        if self._device != self._index:
            cuda.set_device(self._device)


class StepCanary:
    """The canary of one processor (one full-attention KV group): its session, buffers and hooks."""

    def __init__(self, owner, processor, layout: Layout, index: int):
        import torch

        self.torch, self.owner, self.processor, self.layout, self.index = torch, owner, processor, layout, index
        io = processor.inputs_and_outputs
        self.io = io
        first_k = next(iter(layout.kv.values()))[0]
        self.device = first_k.device
        self.stream = io.compute_stream
        max_bs = io.max_requests_per_batch
        max_tokens = io.write_index_storage.shape[1]
        reads = io.read_index_storage.shape[1]
        options = owner.options
        chosen, deep = options.layers(len(layout.layers)), options.deep_layers(len(layout.layers))
        self.fingerprinted = tuple(layout.layers[i] for i in chosen)
        self.deep_layers = tuple(layout.layers[i] for i in deep)
        coverage = {}
        if deep:  # every slot re-fingerprinted within deep_check_period steps
            coverage.update(deep_kv_sources=self._sources(deep),
                            deep_check_slots=max(1, -(-(layout.num_slots - 1) // options.deep_check_period)))
        if options.check_lost_stores:  # layers past the model's first: their K and V depend on the whole prefix
            later = [i for i, layer in enumerate(layout.layers) if layer != 0]
            coverage.update(check_lost_stores=True, lost_kv_sources=self._sources(later),
                            max_step_tokens=max(max_tokens, max_bs, 1))
        i64 = dict(dtype=torch.int64, device=self.device)
        self.session = owner.new_session(layout.num_slots, max_batch_size=max_bs, like=first_k,
                                         real_kv_sources=self._sources(chosen),
                                         verify_capacity=options.verify_capacity or max(reads, 1), **coverage)
        self._sweep_every = options.sweep_every
        self._ext, self._pre = torch.zeros(max_bs, **i64), torch.zeros(max_bs, **i64)
        self._zeros, self._rows = torch.zeros(max_bs + 1, **i64), torch.arange(max_bs, **i64)
        self._cpu = self.device.type == "cpu"
        self._loc = torch.zeros(max_tokens, **i64)
        # the step's ids and positions widened on the CPU only (on a GPU the writes read the engine's int32 rows)
        self._ids, self._pos = (torch.zeros(max_tokens, **i64) for _ in range(2)) if self._cpu else (None, None)
        self._slots = torch.zeros(max_bs, **i64)  # the decode path's write slots
        self._pages = torch.zeros(tuple(io.block_table.shape[1:]), **i64)  # its block table as canary pages (5.17)
        self._read = torch.zeros(reads, **i64) if layout.slot_offset else None
        # on the CPU the step's small int arithmetic runs in NumPy on views of these buffers (a torch op
        # costs several times a ufunc call there), and the session takes those NumPy views as they are
        self._np = {name: getattr(self, name).numpy() for name in ("_ext", "_pre", "_ids", "_pos", "_loc", "_read")
                    if getattr(self, name) is not None} if self._cpu else None
        self._heads: dict = collections.defaultdict(dict)
        self._pool_copied = None  # on a GPU: recorded after each step's copy of the host pool to the device
        self._new_pool((max_bs, max(64, layout.block_size)))  # _pool_host, its torch view and (GPU) device copy
        self._pool_fill = [(None, 0)] * max_bs  # per pool row: (history, tokens of it the row holds)
        self._histories: dict = {}
        self.rewrites: set = set()  # (step, canary slot) of writes into complete blocks (5.17's shared rewrite)
        # step -> (request id, past length, query length, its block list) of each batch row, for naming a
        # lost store's writer (the engine's own lists: it pops them when a request ends, never clears them)
        self._writes = collections.OrderedDict() if options.check_lost_stores else None
        self.step = 0
        self._sweep_at = 0
        self._undo: list = []
        wrap(processor.model_runner, "compute_batch", self._wrap_compute, self._undo)
        hook_cache(layout, self._on_copy, self._undo)

    def _sources(self, layers) -> tuple:
        """K and V of each of the group's ``layers`` (indices into ``layout.layers``), one row per engine index."""
        layout, sources = self.layout, []
        for i in layers:
            for t in layout.kv[layout.layers[i]]:
                flat = t.reshape(t.shape[0], -1)
                width = flat.shape[1] * flat.element_size()
                sources.append(RealKvSource(flat, 1, width, width, slot_offset=layout.slot_offset))
        return tuple(sources)

    def uninstall(self) -> None:
        for undo in reversed(self._undo):
            undo()
        self._undo.clear()

    def _on_stream(self):
        return _StreamSwitch(self.torch, self.stream) if self.stream is not None else contextlib.nullcontext()

    # -- the step -------------------------------------------------------------------------------------

    def _wrap_compute(self, original):
        def compute_batch(model, batch_data):
            # one switch to the engine's compute stream for the whole step: the forward enters it again
            # itself, and two torch.cuda.stream contexts a step cost more host time than the canary's launches
            with self._on_stream():
                self._pre_forward(batch_data)
                original(model, batch_data)
                self.session.post_forward()
                self.step += 1
                self.owner.count("engine_steps")
                self.session.end_step()
                if self._sweep_every and self.step % self._sweep_every == 0:
                    self._sweep()
        return compute_batch

    def _kept(self, kind: str, key, make):
        """``make()`` (torch views of the canary's buffers), kept per ``key`` among the ``kind`` ones
        (at most 256 kept a kind): a view costs a microsecond, a lookup a few dozen nanoseconds."""
        views = self._heads[kind]
        found = views.get(key)
        if found is None:
            if len(views) >= 256:
                views.clear()
            found = views[key] = make()
        return found

    def _head(self, name: str, n: int):
        """``getattr(self, name)[:n]``, one torch view a length."""
        return self._kept(name, n, lambda: getattr(self, name)[:n])

    def _pages_view(self, rows: int, cols: int):
        """``self._pages[:rows, :cols]``, one torch view a shape."""
        return self._kept("_pages", (rows, cols), lambda: self._pages[:rows, :cols])

    def _pool_views(self, bs: int, width: int):
        """(pool rows to fill, host rows they come from, the pool handed to the session) of a step of
        ``bs`` rows and at least ``width`` columns (on the CPU all three the host pool's NumPy view):
        views kept a shape, dropped with the pool.  The width is rounded up to POOL_COLUMN_STEP columns (the
        session reads a row only below its valid length, the row's past tokens), so that a decode
        run, one column wider each step, keeps its views for that many steps."""
        width = min(-(-max(width, 1) // POOL_COLUMN_STEP) * POOL_COLUMN_STEP, self._pool_host.shape[1])

        def make():
            if self._cpu:  # the host pool itself, a NumPy view
                pool = self._pool_host[:bs, :width]
                return pool, pool, pool
            return self._pool[:bs, :width], self._pool_view[:bs, :width], self._pool[:bs, :width]
        return self._kept("_pool", (bs, width), make)

    def _shifted(self, x, name: str):
        """``x`` as canary slots: itself, or ``x + slot_offset`` in the buffer ``name`` (no allocation)."""
        if not self.layout.slot_offset:
            return x
        n = x.shape[0]
        if self._cpu:
            out = self._np[name][:n]
            np.add(x.numpy(), self.layout.slot_offset, out=out)
            return out
        out = self._head(name, n)
        self.torch.add(x, self.layout.slot_offset, out=out)
        return out

    def _lengths(self, cu_q, cu_k, bs: int):
        """(new tokens, past tokens) of each batch row, from the cumulative lengths, in the canary's buffers."""
        if self._cpu:
            q, k = cu_q.numpy(), cu_k.numpy()
            ext, pre = self._np["_ext"][:bs], self._np["_pre"][:bs]
            np.subtract(q[1 : bs + 1], q[:bs], out=ext)
            np.subtract(k[1 : bs + 1], k[:bs], out=pre)
            pre -= ext
            return ext, pre
        ext, pre = self._head("_ext", bs), self._head("_pre", bs)
        sub = self.torch.sub
        sub(cu_q[1 : bs + 1], cu_q[:bs], out=ext)
        sub(cu_k[1 : bs + 1], cu_k[:bs], out=pre)
        pre.sub_(ext)
        return ext, pre

    def _step_tokens(self, batch_data: dict, tokens: int):
        """The step's input ids and positions: on a GPU the engine's int32 rows as they are (a copy
        costs a launch), on the CPU widened into int64 buffers (NumPy's decode write is quickest so)."""
        if self._cpu:
            ids, pos = self._np["_ids"][:tokens], self._np["_pos"][:tokens]
            np.copyto(ids, batch_data["input_ids"].numpy()[0, :tokens])
            np.copyto(pos, batch_data["position_ids"].numpy()[0, :tokens])
            return ids, pos
        return batch_data["input_ids"][0, :tokens], batch_data["position_ids"][0, :tokens]

    def _pre_forward(self, batch_data: dict) -> None:
        layout, requests = self.layout, self.io.requests_in_batch
        bs = len(requests)
        cu_k = batch_data["cu_seq_lens_k"]
        if isinstance(cu_k, dict):
            cu_k = cu_k["full_attention"]
        ext, pre = self._lengths(batch_data["cu_seq_lens_q"], cu_k, bs)
        block_table = batch_data.get("block_table")
        tables = layout.block_tables()
        pasts = [fs.state.position_offset - fs.query_length for fs in requests]
        if block_table is not None:  # the decode fast path reads the block table (flash_attn_with_kvcache)
            table = self._block_table(block_table[layout.group, :bs])
            rp = self._rows[:bs]
            loc = self._decode_slots(requests, pasts, tables)
        else:
            read = batch_data["read_index"][layout.group]
            if read.numel() == 0:  # fresh prefills only: nothing is read
                table = PagedKvIndices(self._zeros[: bs + 1], read, page_size=1)
            else:
                table = PagedKvIndices(cu_k[: bs + 1], self._shifted(read, "_read"), page_size=1)
            rp = None
            loc = self._shifted(batch_data["write_index"][layout.group], "_loc")
        ids, pos = self._step_tokens(batch_data, loc.shape[0])
        self._note_rewrites(requests, pasts, tables)
        if self._writes is not None:
            self._writes[self.step] = [(fs.state.request_id, p, fs.query_length, tables.get(fs.state.request_id, ()))
                                       for fs, p in zip(requests, pasts)]
            if len(self._writes) > LABEL_WINDOW:
                self._writes.popitem(last=False)
        pool = self._expected(requests, pasts) if self.owner.options.check_expected_tokens else None
        self.session.pre_forward(rp, pre, ext, table, ids, pos, loc, expected_tokens=pool,
                                 expected_tokens_valid_lens=pre if pool is not None else None,
                                 row_labels=[fs.state.request_id for fs in requests])

    def _block_table(self, rows):
        """The decode path's block table as canary pages (5.17: block + page_base; 5.23: already in pages)."""
        base = self.layout.page_base
        if base:
            out = self._pages_view(rows.shape[0], rows.shape[1])
            self.torch.add(rows, base, out=out)
            rows = out
        return BlockTable(rows, self.layout.block_size, null_block=base - 1)

    def _decode_slots(self, requests, pasts, tables):
        """The decode path writes each request's token at its past length (no write_index is built)."""
        layout = self.layout
        slots = [layout.canary_page(tables[fs.state.request_id][p // layout.block_size]) * layout.block_size
                 + p % layout.block_size for fs, p in zip(requests, pasts)]
        out = self._head("_slots", len(slots))
        out.copy_(self.torch.tensor(slots, dtype=self.torch.int64))
        return out

    def _note_rewrites(self, requests, pasts, tables) -> None:
        """Writes into complete blocks this step (5.17 recomputes a prompt's last token into its cached block)."""
        layout, size = self.layout, self.layout.block_size
        if layout.version >= FLAT_CACHE or not layout.cache.use_prefix_sharing:  # 5.23 never writes a complete block
            return
        blocks_by_id = layout.cache._block_manager._id_to_block  # layout.is_complete, inline: a lookup per block
        for fs, past in zip(requests, pasts):
            blocks = tables.get(fs.state.request_id, ())
            end = past + fs.query_length
            for b in range(past // size, min((end - 1) // size + 1, len(blocks))):
                block = blocks_by_id.get(blocks[b])
                if block is not None and block.is_complete:
                    for p in range(max(past, b * size), min(end, (b + 1) * size)):
                        self.rewrites.add((self.step, layout.canary_page(blocks[b]) * size + p % size))

    def writer_of(self, step: int, slot: int, position: int) -> tuple:
        """The request ids of step ``step``'s rows that wrote ``position`` into canary slot ``slot``."""
        size, rows = self.layout.block_size, (self._writes or {}).get(step, ())
        return tuple(r for r, past, q, blocks in rows if past <= position < past + q and position // size < len(blocks)
                     and self.layout.canary_page(blocks[position // size]) * size + position % size == slot)

    def _expected(self, requests, pasts):
        """The expected-token pool, one row per batch row: the engine's own history of the request.

        On a GPU the rows are kept in pinned memory and copied to the device pool behind the step's
        work; a row is rewritten only after the last step's copy out of it has run (an event)."""
        width = max(pasts, default=0)
        if self._pool_copied is not None:  # the last step's copy out of the pinned rows (a device a step behind
            self._pool_copied.synchronize()  # would otherwise copy this step's rows for it)
        host, fill = self._pool_host, self._pool_fill
        if width > host.shape[1] or len(requests) > host.shape[0]:
            host = self._new_pool((max(host.shape[0], len(requests)), 2 * width))
            fill = self._pool_fill = [(None, 0)] * host.shape[0]
        live = {}
        for i, (fs, past) in enumerate(zip(requests, pasts)):
            state = fs.state
            h = self._histories.get(state.request_id)
            if h is None or h.state is not state:
                h = _History(state)
            live[state.request_id] = h
            held, n = fill[i]  # row i already holds the first n tokens of held's history (a token's place never changes)
            if held is not h:
                n = 0
            if past == n + 1:
                host[i, n] = h.update()[n]
                fill[i] = (h, past)
            elif past > n:
                host[i, n:past] = h.update()[n:past]
                fill[i] = (h, past)
            elif held is not h:
                fill[i] = (h, 0)
        if len(self._histories) > 4 * host.shape[0]:
            self._histories = live
        else:
            self._histories.update(live)
        rows, source, pool = self._pool_views(len(requests), width)
        if self._cpu:  # the host pool is the session's
            return pool
        rows.copy_(source, non_blocking=True)
        if self._pool_copied is None:
            self._pool_copied = self.torch.cuda.Event()
        self._pool_copied.record(self.stream)
        return pool

    def _new_pool(self, shape) -> np.ndarray:
        """A host pool of ``shape`` (pinned on a GPU, its device copy beside it) and its torch view (the
        caller has waited for the last step's copy out of the old one)."""
        torch = self.torch
        if self._cpu:
            self._pool_host = np.zeros(shape, np.int32)
            self._pool_view = torch.from_numpy(self._pool_host)
        else:
            self._pool_view = torch.zeros(shape, dtype=torch.int32, pin_memory=True)
            self._pool_host = self._pool_view.numpy()
            self._pool = torch.zeros(shape, dtype=torch.int32, device=self.device)
        self._heads["_pool"].clear()  # views of the old pool
        return self._pool_host

    # -- forks and the prefix cache -----------------------------------------------------------------

    def _on_copy(self, src_blocks, dst_blocks) -> None:
        """A fork copied engine blocks: copy their canary rows in both buffers (after the engine's copy)."""
        torch, layout = self.torch, self.layout
        src = torch.tensor([layout.canary_page(b) for b in src_blocks], dtype=torch.int64, device=self.device)
        dst = torch.tensor([layout.canary_page(b) for b in dst_blocks], dtype=torch.int64, device=self.device)
        for buf in (self.session.head_canary, self.session.tail_canary):
            copy_pages(buf, buf, src, dst, page_size=layout.block_size)
        self.owner.count("fork_copied_blocks", len(src_blocks))

    def sweep_triples(self, budget: int):
        """The prefix cache's complete blocks reachable from the root through the engine's own parent
        links (each with its and its parent's recorded hashes), at most ``budget`` slots, rotating over
        sweeps: ``(blocks, [(canary page, start position, predecessor slot)])``."""
        layout, size = self.layout, self.layout.block_size
        hashed = layout.hashed_blocks()
        known = {b: link for b in hashed if (link := layout.parent(b, hashed)) is not None}
        reachable = []
        for block in sorted(known):
            b, depth = block, known[block][0]
            while b is not None and b in known and known[b][0] == depth:
                b, depth = known[b][1], depth - 1
            if b is None and depth == -1:
                reachable.append(block)
        if not reachable:
            return [], []
        start = self._sweep_at % len(reachable)
        chosen = (reachable[start:] + reachable[:start])[: max(budget // size, 0)]
        self._sweep_at = start + len(chosen)
        triples = []
        for b in chosen:
            depth, parent = known[b]
            prev = -1 if parent is None else layout.canary_page(parent) * size + size - 1
            triples.append((layout.canary_page(b), depth * size, prev))
        return chosen, triples

    def _sweep(self) -> None:
        """Sweep the prefix cache's complete blocks, each once (CanarySession.sweep_blocks)."""
        blocks, triples = self.sweep_triples(self.session.planner.capacities.verify_capacity)
        if not triples:
            return
        columns = np.asarray(triples, np.int64).T
        to = (lambda a: self.torch.as_tensor(a).to(self.device)) if self.device.type != "cpu" else (lambda a: a)
        self.session.sweep_blocks(*(to(np.ascontiguousarray(c)) for c in columns), block_size=self.layout.block_size,
                                  labels=[f"cached-block-{b}" for b in blocks])
        self.owner.count("swept_blocks", len(blocks))
