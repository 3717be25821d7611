"""The fault injector and timer of ``kvcanary hf``, installed on a model before the canary.

It wraps the engine's own methods on the instances a run creates: the batch preparation (faults
edit the engine state before it, the batch tensors after it), the forward inside the canary's
wrapper (a lost KV store), the prefix-cache lookup (a stale hit); it times each step and the
canary's share of it.  Its hooks sit beneath the canary's (installed first), so the canary sees
the engine as attention does, faults included.  The processors it hooks are discarded when
``generate_batch`` ends (no persistent manager), so only the model's wrapper is undone.
"""

from __future__ import annotations

import time

from ..integrations._hf_layout import FLAT_CACHE, hook_cache, layout_of, parse_version, wrap


def timed(fn, into: list, cpu_into: list | None = None, profile=None):
    """``fn``'s wall time in microseconds appended to ``into`` on each call (and this thread's CPU
    time to ``cpu_into``), under ``profile`` (a ``cProfile.Profile``) where given."""
    def call(*args, **kwargs):
        c0 = time.thread_time() if cpu_into is not None else 0.0
        t0 = time.perf_counter()
        if profile is not None:
            profile.enable()
        try:
            return fn(*args, **kwargs)
        finally:
            if profile is not None:
                profile.disable()
            into.append((time.perf_counter() - t0) * 1e6)
            if cpu_into is not None:
                cpu_into.append((time.thread_time() - c0) * 1e6)
    return call


class Harness:
    def __init__(self, model, fault, rng, progress=None, profile=None):
        import torch
        import transformers

        self.torch, self.model, self.fault, self.rng, self.progress = torch, model, fault, rng, progress
        self.version = parse_version(transformers.__version__)
        self.steps = self.step = 0
        self.written_tokens = 0  # KV stores the engine's steps made (each checked by the lost-store check)
        self._prepare, self._inner, self._outer, self._update = [], [], [], []
        self._inner_cpu, self._outer_cpu = [], []  # this thread's CPU time: what the machine's other jobs move less
        self._timers = False
        self._model_undo: list = []
        self._processor = self.io = self.layout = None
        self.profile = profile  # a cProfile.Profile of the canary's share of each step (the forward left out)

    def __enter__(self):
        wrap(self.model, "init_continuous_batching", self._wrap_init, self._model_undo)
        return self

    def __exit__(self, *exc):
        for undo in reversed(self._model_undo):
            undo()

    # -- the engine's state, for the faults ------------------------------------------------------------

    def active(self) -> dict:
        return self._processor.scheduler.active_requests

    def waiting(self) -> dict:
        return self._processor.scheduler.waiting_requests

    # -- hooks -------------------------------------------------------------------------------------------

    def _wrap_init(self, original):
        def init_continuous_batching(*args, **kwargs):
            manager = original(*args, **kwargs)
            wrap(manager, "_create_batch_processor", self._wrap_create, [])
            return manager
        return init_continuous_batching

    def _wrap_create(self, original):
        def create():
            processor = original()
            if processor is not self._processor:
                self._hook(processor)
            return processor
        return create

    def _hook(self, processor) -> None:
        self._processor, self.io = processor, processor.inputs_and_outputs
        self.layout = layout_of(processor.cache, self.version)
        self.step, self._timers = 0, False
        keep: list = []
        hook_cache(self.layout, lambda src, dst: None, keep)  # the faults' own record of complete blocks' places
        wrap(processor, "prepare_next_batch", self._wrap_prepare, keep)
        wrap(processor.model_runner, "compute_batch", self._wrap_compute, keep)
        cache = processor.cache
        if self.version >= FLAT_CACHE:
            allocator = cache.cache_allocators["full_attention"]
            wrap(allocator, "match_prefix_blocks", lambda original: lambda prompt_ids: self.fault_prefix(original(prompt_ids)), keep)
        elif hasattr(cache, "search_prefix_match"):
            wrap(cache, "search_prefix_match", self._wrap_search_517, keep)

    def fault_prefix(self, blocks):
        return blocks if self.fault is None else self.fault.prefix_blocks(self, list(blocks))

    def _wrap_search_517(self, original):
        """5.17 looks up and references the matched blocks in one call: the fault's choice of first block
        is put behind that block's hash for the call's duration (a stale entry), then the entry restored."""
        def search_prefix_match(request_id, prompt_ids):
            manager, size = self.layout.cache._block_manager, self.layout.block_size
            if self.fault is None or len(prompt_ids) < size:
                return original(request_id, prompt_ids)
            first = manager.compute_hash(None, prompt_ids[:size], group_id=0)
            block = manager._hash_to_id.get(first)
            if block is None:
                return original(request_id, prompt_ids)
            chosen = self.fault.prefix_blocks(self, [block])
            manager._hash_to_id[first] = chosen[0]
            try:
                return original(request_id, prompt_ids)
            finally:
                manager._hash_to_id[first] = block
        return search_prefix_match

    def _wrap_prepare(self, original):
        def prepare_next_batch():
            if not self._timers:  # the canary has hooked the processor by now: time around its wrapper
                self._timers = True
                wrap(self._processor.model_runner, "compute_batch",
                     lambda fn: timed(fn, self._outer, self._outer_cpu, self.profile), [])
                wrap(self._processor, "update_batch", lambda fn: timed(fn, self._update), [])
            t0 = time.perf_counter()
            if self.fault is not None:
                self.fault.before_prepare(self)
            ready = original()
            if ready:
                if self.fault is not None:
                    self.fault.after_prepare(self)
                self._prepare.append((time.perf_counter() - t0) * 1e6)
                self.written_tokens += sum(fs.query_length for fs in self.io.requests_in_batch)  # untimed
            return ready
        return prepare_next_batch

    def _wrap_compute(self, original):
        def compute_batch(model, batch_data):
            c0 = time.thread_time()
            t0 = time.perf_counter()
            if self.profile is not None:
                self.profile.disable()
            if self.fault is None:
                original(model, batch_data)
            else:
                self.fault.around_compute(self, lambda: original(model, batch_data))
            if self.profile is not None:
                self.profile.enable()
            self.step += 1
            self.steps += 1
            if self.progress is not None:
                self.progress(1)
            self._inner.append((time.perf_counter() - t0) * 1e6)  # the progress bar is not the canary's
            self._inner_cpu.append((time.thread_time() - c0) * 1e6)
        return compute_batch

    @property
    def step_us(self) -> list:
        """Wall time of each engine step: preparing the batch, the forward with the canary's calls, the update."""
        return [p + c + u for p, c, u in zip(self._prepare, self._outer, self._update)]

    @property
    def canary_us(self) -> list:
        """The canary's share of each step: its compute_batch wrapper around the forward (and what it stages)."""
        return [outer - inner for outer, inner in zip(self._outer, self._inner)]

    @property
    def canary_cpu_us(self) -> list:
        """The same share in this thread's CPU time (the forward's other threads excluded either way)."""
        return [outer - inner for outer, inner in zip(self._outer_cpu, self._inner_cpu)]
