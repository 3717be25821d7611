"""The canary inside Hugging Face transformers' continuous batching (``generate_batch``,
``ContinuousBatchingManager``, ``PagedAttentionCache``), transformers 5.17.0 up to 5.25.

>>> with attach(model) as canary:                                    # doctest: +SKIP
...     outputs = model.generate_batch(prompts, generation_config=config)
>>> canary.report()                                                  # doctest: +SKIP

:func:`attach` puts the canary into every continuous-batching manager of a model (or into one
manager): each batch processor the manager creates gets a :class:`~kvcanary_cupy.CanarySession`
that verifies, every step, exactly the KV slots the step's attention reads (the CSR form
``cu_seq_lens_k`` + ``read_index``, or the decode path's ``block_table``), stamps the slots it
writes (``write_index``), copies canary rows when a fork copies blocks and, with ``sweep_every``,
sweeps the prefix cache's complete blocks, each once.  It takes nothing from the engine's allocator and
writes none of the engine's tensors; :meth:`TransformersCanary.detach` (or leaving the ``with``
block) restores every method it wrapped.  docs/engines.md ("Hugging Face transformers") says what
is verified, what is not, and which modes are refused.
"""

from __future__ import annotations

import logging

from ..errors import fail
from ..reporting import Violation
from ._base import CanaryOptions, EngineCanary
from ._hf_layout import SUPPORTED, layout_of, parse_version, wrap
from ._hf_step import FIRST_STORE_UNCHANGED, SHARED_BLOCK_REWRITE, StepCanary

logger = logging.getLogger("kvcanary_cupy")

__all__ = ["FIRST_STORE_UNCHANGED", "SHARED_BLOCK_REWRITE", "TransformersCanary", "attach"]


def _import_transformers():
    try:
        import transformers
        from transformers.generation.continuous_batching import ContinuousBatchingManager
    except ImportError as exc:
        raise ImportError("kv-canary: the transformers integration needs transformers: "
                          "pip install kvcanary-cupy[transformers]") from exc
    version = parse_version(transformers.__version__)
    if not SUPPORTED[0] <= version < SUPPORTED[1]:
        raise ImportError(f"kv-canary: transformers {transformers.__version__} is outside the supported range "
                          f"{SUPPORTED[0][0]}.{SUPPORTED[0][1]}.0 <= version < {SUPPORTED[1][0]}.{SUPPORTED[1][1]}")
    return version, ContinuousBatchingManager


def _refuse_model_modes(config) -> None:
    """Modes of the model the canary does not support, refused by name."""
    config = config.get_text_config() if hasattr(config, "get_text_config") else config
    layer_types = getattr(config, "layer_types", None) or ()
    if getattr(config, "sliding_window", None) is not None or any(t != "full_attention" for t in layer_types):
        fail(ValueError, "attach() does not support sliding-window attention groups yet "
                         f"(the model has layer types {sorted(set(layer_types)) or ['sliding_attention']})")


def _refuse_manager_modes(manager) -> None:
    """Modes of a manager the canary does not support, refused by name (docs/engines.md, "Refused modes")."""
    cb = manager.continuous_batching_config
    refused = []
    if cb.use_async_batching:
        refused.append("async batching (use_async_batching=True)")
    graphs = cb.use_cuda_graph
    if graphs is True or (isinstance(graphs, tuple) and any(graphs)):
        refused.append("CUDA graphs of the engine (use_cuda_graph); pass use_cuda_graph=False")
    if cb.varlen_compile_config is not None or cb.decode_compile_config is not None:
        refused.append("torch.compile of the engine (varlen_/decode_compile_config), which pads the batch")
    if getattr(manager, "distributed_helper", None) is not None and manager.distributed_helper.tp_size > 1:
        refused.append("tensor parallelism")
    if cb.cpu_offload_space:
        refused.append("CPU offload pools (cpu_offload_space > 0)")
    if refused:
        fail(ValueError, "attach() does not support " + "; ".join(refused))
    _refuse_model_modes(manager.model.config)


def _check_layers(options: CanaryOptions, config) -> None:
    layers = config.get_text_config().num_hidden_layers
    options.layers(layers)
    options.deep_layers(layers)
    if options.check_lost_stores and layers < 2:
        fail(ValueError, "check_lost_stores=True needs a model of two or more layers: the check compares layers 1 and "
                         "up (layer 0's K and V depend on the token and position alone, so equal bytes there are legitimate)")


class TransformersCanary(EngineCanary):
    """The canary attached to a transformers model or continuous-batching manager (see :func:`attach`).

    ``report()`` names the request ids behind each violation and labels 5.17's in-place rewrite of
    a shared prefix block ``finding="engine_rewrote_shared_block"`` and a lost-store row in a slot the
    canary had never stamped ``finding="first_store_unchanged_bytes"``; ``stats`` is the sessions'
    stats summed with ``engine_steps``, ``fork_copied_blocks`` and ``swept_blocks``.
    """

    engine = "transformers"

    def __init__(self, target, options: CanaryOptions):
        super().__init__(options)
        self.version, manager_type = _import_transformers()
        self._undo: list = []
        self._steps: list[StepCanary] = []
        self._hooked: set = set()
        if isinstance(target, manager_type):
            _check_layers(options, target.model.config)  # names a bad fingerprint_layers / deep_kv_layers now
            self._hook_manager(target)
        elif hasattr(target, "init_continuous_batching"):
            _refuse_model_modes(target.config)
            _check_layers(options, target.config)
            wrap(target, "init_continuous_batching", self._wrap_init, self._undo)
            cached = getattr(target, "_cached_continuous_batching_manager", None)
            if isinstance(cached, manager_type):
                self._hook_manager(cached)
        else:
            fail(TypeError, f"attach() takes a transformers model with continuous batching or a ContinuousBatchingManager, "
                            f"got {type(target).__module__}.{type(target).__name__}")

    def _wrap_init(self, original):
        def init_continuous_batching(*args, **kwargs):
            manager = original(*args, **kwargs)
            if self.attached:
                self._hook_manager(manager)
            return manager
        return init_continuous_batching

    def _hook_manager(self, manager) -> None:
        if id(manager) in self._hooked:
            return
        _refuse_manager_modes(manager)
        self._hooked.add(id(manager))

        def create(original):
            def _create_batch_processor():
                processor = original()
                if self.attached:
                    self._hook_processor(processor)
                return processor
            return _create_batch_processor

        wrap(manager, "_create_batch_processor", create, self._undo)
        processor = getattr(manager, "batch_processor", None)
        if processor is not None:
            self._hook_processor(processor)

    def _hook_processor(self, processor) -> None:
        if any(s.processor is processor for s in self._steps):
            return
        if processor.model_runner.pad_inputs:
            fail(ValueError, "attach() does not support a padded batch (CUDA graphs or torch.compile of the engine)")
        self._steps.append(StepCanary(self, processor, layout_of(processor.cache, self.version), len(self.sessions)))

    def _uninstall(self) -> None:
        for step in self._steps:
            step.uninstall()
        for undo in reversed(self._undo):
            undo()
        self._undo.clear()

    def classify(self, session_index: int, v: Violation) -> str | None:
        """5.17 recomputes a prompt's last token into its complete, shared prefix block while other
        requests read it: the readers' TAIL verify sees the block's bytes change in that step.  A
        lost-store row whose slot held no record (previous prev_hash 0: never stamped since attach)
        compared the store with the allocator's leftovers, which the canary never saw."""
        if v.reasons == "write_kv_not_stored" and v.stored_chain_hash == 0:
            return FIRST_STORE_UNCHANGED
        step = next((s for s in self._steps if s.index == session_index), None)
        if step is not None and v.reasons == "verify_real_kv_hash" and (v.first_step, v.slot_idx) in step.rewrites:
            return SHARED_BLOCK_REWRITE
        return None

    def writers(self, session_index: int, v: Violation) -> tuple:
        """A lost-store row names the request whose step wrote the slot (it reads those bytes next)."""
        step = next((s for s in self._steps if s.index == session_index), None)
        if step is None or v.reasons != "write_kv_not_stored":
            return ()
        return step.writer_of(v.first_step, v.slot_idx, v.position)

    @property
    def fingerprinted_layers(self) -> tuple:
        """The model layers whose K and V bytes each processor's TAIL buffer fingerprints."""
        return tuple(s.fingerprinted for s in self._steps)

    @property
    def deep_kv_layers(self) -> tuple:
        """The model layers whose every K and V byte each processor's deep fingerprints fold."""
        return tuple(s.deep_layers for s in self._steps)


def attach(model_or_manager, **options) -> TransformersCanary:
    """Attach the canary to a transformers model (every continuous-batching manager it creates or
    caches) or to one ``ContinuousBatchingManager``.

    Parameters
    ----------
    model_or_manager
        A model with ``generate_batch`` / ``init_continuous_batching``, or a manager.
    **options
        The options of :class:`~kvcanary_cupy.integrations._base.CanaryOptions`: ``on_violation``
        (default ``"log"``), ``ring_capacity``, ``check_expected_tokens`` (default on: the engine's
        own token history is the expected-token pool), ``fingerprint_layers``,
        ``real_kv_hash_mode`` (default PARTIAL), ``sweep_every``, ``verify_capacity``; and the
        coverage past the record, off by default: ``deep_kv_layers`` (``"all"`` or layer indices:
        every byte of their K and V fingerprinted, each slot re-checked within
        ``deep_check_period`` steps, default 4) and ``check_lost_stores`` (a store the forward
        should have made and did not: ``write_kv_not_stored``).

    Returns
    -------
    TransformersCanary
        A context manager; ``detach()`` restores the engine.

    Raises
    ------
    ImportError
        transformers missing, or outside the supported versions (the message names the range).
    TypeError, ValueError
        An unknown option, or a mode the canary does not support (named: async batching, CUDA graphs
        or torch.compile of the engine, tensor parallelism, sliding-window groups, CPU offload pools).
    """
    return TransformersCanary(model_or_manager, CanaryOptions.from_options("transformers", options, coverage=True))
