"""The canary inside Hugging Face transformers' real continuous batching (tiny random-weight models
built from configs, nothing downloaded): clean configurations report nothing unexplained and generate
the same tokens as without the canary; every fault class is caught, or missed where the design is
blind; the engine is left as it was; unsupported modes and versions are refused by name.  Runs on
CPU torch here and in CI, on CUDA torch in the GPU run (``device`` parameter)."""

import dataclasses
import sys

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from kvcanary_cupy import FailReason, ViolationReport  # noqa: E402
from kvcanary_cupy.hf import CLEAN_CONFIGS, FAULTS, HfEngineConfig  # noqa: E402
from kvcanary_cupy.hf.runner import configs, run_engine, tiny_llama, workload  # noqa: E402
from kvcanary_cupy.integrations._base import CanaryOptions  # noqa: E402
from kvcanary_cupy.integrations._hf_layout import FLAT_CACHE, parse_version  # noqa: E402
from kvcanary_cupy.integrations.transformers import SHARED_BLOCK_REWRITE, attach  # noqa: E402

VERSION = parse_version(transformers.__version__)
ENGINE = HfEngineConfig()


@pytest.fixture(scope="module", params=["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def model(request):
    if request.param == "cuda" and not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    return tiny_llama(ENGINE, request.param, seed=0)


def _tokens(outputs) -> dict:
    return {k: list(v.generated_tokens) for k, v in outputs.items()}


@pytest.mark.parametrize("name", list(CLEAN_CONFIGS))
def test_clean_configurations_report_nothing_unexplained_and_generate_the_same_tokens(model, name):
    overrides = CLEAN_CONFIGS[name]
    plain = run_engine(model, ENGINE, overrides, seed=7, canary=False)
    seen = run_engine(model, ENGINE, overrides, seed=7)
    assert _tokens(seen.outputs) == _tokens(plain.outputs)
    assert all(v.error is None for v in seen.outputs.values())
    assert seen.violations == ()
    s = seen.stats
    assert s["engine_steps"] == seen.steps == plain.steps > 0
    assert s["verified_entries"] > 0 and s["out_of_range_skipped"] == 0 and s["verify_skipped_steps"] == 0
    assert s["health_failures"] == 0 and s["dropped_rows"] == 0
    if overrides.get("num_return_sequences", 1) > 1:
        assert s["fork_copied_blocks"] > 0  # the forks' last, incomplete blocks were copied, their canary rows with them
    if overrides.get("allow_block_sharing", True):
        assert s["swept_blocks"] > 0
    if name == "tight_cache_soft_resets":
        assert len(seen.outputs) == 8 and s["engine_steps"] > plain.steps - 1


#: What each class the record alone cannot see is first reported as, with the job's coverage options.
COVERAGE_REASONS = {"bitflip_unfingerprinted_layer": "verify_deep_kv", "lost_kv_store": "write_kv_not_stored"}


@pytest.mark.parametrize("name", list(FAULTS))
def test_each_fault_class_is_caught_or_documented_as_missed(model, name):
    fault = FAULTS[name]()
    outcome = run_engine(model, ENGINE, fault.overrides, seed=11, fault=fault)
    assert fault.fired_step is not None, f"{name} never fired"
    before = [v for v in outcome.violations if v.first_step < fault.fired_step]
    after = [v for v in outcome.violations if v.first_step >= fault.fired_step]
    assert before == []
    if not fault.detectable_with():
        assert after == [], f"{name} is documented as missed by design but was reported"
        return
    assert after, f"{name} was not reported"
    assert min(v.first_step for v in after) - fault.fired_step <= 1  # the deep rotation's period is 2 steps
    if name in COVERAGE_REASONS:
        assert min(after, key=lambda v: v.first_step).reasons == COVERAGE_REASONS[name]
    named = {r for v in after for r in v.request_ids}
    request_victims = [v for v in fault.victims if not v.startswith("block ")]
    # A misdirected write, a double free and a stale hit are reported by whoever reads the slots they
    # spoiled (the writer may have finished); the other faults spoil what their victims themselves read.
    if request_victims and name not in ("write_index_off_by_one", "double_free", "stale_prefix_hit"):
        assert named & set(request_victims), (named, fault.victims)
    assert named  # every report row names the requests (or the swept cached paths) behind it


def test_every_class_is_visible_with_the_jobs_coverage_and_two_are_blind_with_the_record_alone(model):
    """kvcanary hf runs with deep fingerprints of every layer and the lost-store check; without them
    (--sglang-coverage) a flip outside the fingerprinted layers and a lost store are missed, as documented."""
    record_only = HfEngineConfig.sglang_coverage()
    assert all(f.detectable_with() for f in FAULTS.values())
    assert {n for n, f in FAULTS.items() if not f.detectable_with(engine=record_only)} == set(COVERAGE_REASONS)
    for name in COVERAGE_REASONS:
        fault = FAULTS[name]()
        outcome = run_engine(model, record_only, fault.overrides, seed=11, fault=fault)
        assert fault.fired_step is not None and outcome.violations == (), name
        assert not {"verify_deep_kv", "write_kv_not_stored"} & set(outcome.stats["violations_by_reason"])


@pytest.mark.parametrize("flags, blind", [((), set()), (("--sglang-coverage",), set(COVERAGE_REASONS))])
def test_kvcanary_hf_lists_the_classes_its_coverage_cannot_see(capsys, flags, blind):
    from kvcanary_cupy.cli import main

    assert main(["hf", "--list-faults", *flags]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert [line.split(":")[0] for line in lines] == list(FAULTS)
    assert {line.split(":")[0] for line in lines if "[blind by design:" in line} == blind


def test_coverage_options_reach_the_session(model):
    """deep_kv_layers="all": every layer's K and V, every slot re-fingerprinted within deep_check_period
    steps; check_lost_stores compares layers 1 and up (layer 0's bytes depend on the token and position alone)."""
    cb, gen, _, _ = configs(ENGINE, {})
    with attach(model, deep_kv_layers="all", deep_check_period=3, check_lost_stores=True) as canary:
        model.generate_batch([[1, 2, 3, 4, 5]], generation_config=gen, continuous_batching_config=cb, progress_bar=False)
    coverage = canary.sessions[0].coverage
    layers = ENGINE.num_layers
    assert canary.deep_kv_layers == (tuple(range(layers)),) and canary.fingerprinted_layers == ((0, 1, 2, 3),)
    assert coverage.deep.count == 2 * layers and coverage.lost.count == 2 * (layers - 1)
    assert coverage.lost.bytes_per_slot == 2 * (layers - 1) * 16  # PARTIAL, the session's mode
    assert coverage.deep_check_period == 3 and canary.sessions[0].tail_canary.shape[1] == 6
    with attach(model) as plain:  # off by default: SGLang's 32-byte record
        model.generate_batch([[1, 2, 3]], generation_config=gen, continuous_batching_config=cb, progress_bar=False)
    assert plain.sessions[0].coverage.deep is None and plain.sessions[0].coverage.lost is None
    assert plain.deep_kv_layers == ((),) and plain.sessions[0].tail_canary.shape[1] == 4


def test_a_lost_store_row_in_a_slot_never_stamped_is_a_labelled_finding(model):
    """A slot's first store since attach is compared with the allocator's leftovers (the cache is
    torch.empty): a row there (its former record's prev_hash 0) is labelled, reported, not unexplained."""
    from kvcanary_cupy.integrations.transformers import FIRST_STORE_UNCHANGED
    from kvcanary_cupy.reporting import Violation

    canary = attach(model, check_lost_stores=True)
    lost = FailReason.WRITE_KV_NOT_STORED.value
    fresh = Violation(2, 9, 1, 0, 318, 0, 1, lost)
    reused = Violation(2, 9, 1, 57, 318, 0x5DA1989DCE7DACFD, 1, lost)
    assert canary.classify(0, fresh) == FIRST_STORE_UNCHANGED and canary.classify(0, reused) is None
    canary.detach()


def test_the_517_rewrite_of_a_shared_block_is_a_labelled_finding(model):
    """5.17 recomputes the last token of a prompt that is exactly its cached blocks into the shared,
    complete block while others read it; 5.23 and later stop the prefix match before that token."""
    outcome = run_engine(model, ENGINE, {}, seed=3)
    assert outcome.violations == ()
    if VERSION >= FLAT_CACHE:
        assert outcome.findings == ()
        return
    assert outcome.findings
    for v in outcome.findings:
        assert v.finding == SHARED_BLOCK_REWRITE and v.reasons == "verify_real_kv_hash" and v.launch_tag == "TAIL_K_FULL"
        assert v.request_ids
    assert outcome.stats["findings"] == len(outcome.findings)


def _manager(model, **overrides):
    cb, gen, _, _ = configs(ENGINE, overrides)
    manager = model.init_continuous_batching(generation_config=gen, continuous_batching_config=cb)
    manager.warmup()  # creates the batch processor, its cache and scheduler (no graphs: a no-op otherwise)
    return manager


def _free(cache):
    """The allocator's free capacity (5.17: free blocks; 5.23 on: free bytes)."""
    return cache.get_num_free_blocks() if hasattr(cache, "get_num_free_blocks") else cache.compute_free_capacity(relative=False)


def _instance_state(*objects) -> list:
    return [dict(vars(o)) for o in objects]


def test_detach_leaves_the_engine_as_it_was(model):
    manager = _manager(model)
    processor = manager.batch_processor
    parts = (model, manager, processor, processor.model_runner, processor.cache)
    before = _instance_state(*parts)
    free = _free(processor.cache)
    canary = attach(manager)
    assert "compute_batch" in vars(processor.model_runner) and "_create_batch_processor" in vars(manager)
    assert _free(processor.cache) == free  # nothing taken from the allocator
    canary.detach()
    canary.detach()  # idempotent
    assert _instance_state(*parts) == before
    with attach(model) as c:
        assert "init_continuous_batching" in vars(model)
    assert "init_continuous_batching" not in vars(model) and not c.attached
    manager.destroy()


def test_report_names_request_ids_and_round_trips_through_json(model):
    outcome = run_engine(model, ENGINE, {}, seed=11, fault=FAULTS["read_index_other_request"]())
    report = ViolationReport((*outcome.violations, *outcome.findings), len(outcome.violations), 8,
                             *(np.zeros(12, np.int64),) * 4)
    back = ViolationReport.from_json(report.to_json())
    assert [v.request_ids for v in back.violations] == [v.request_ids for v in report.violations]
    assert all(r.startswith("req_") for v in outcome.violations for r in v.request_ids)
    assert [v.finding for v in back.violations] == [v.finding for v in report.violations]


@pytest.mark.parametrize("mode, overrides, needle", [
    ("async", {"use_async_batching": True}, "async batching"),
    ("offload", {"cpu_offload_space": 1.0}, "CPU offload pools"),
])
def test_unsupported_manager_modes_are_refused_by_name(model, mode, overrides, needle):
    cb, gen, _, _ = configs(ENGINE, overrides)
    manager = model.init_continuous_batching(generation_config=gen, continuous_batching_config=cb)
    with pytest.raises(ValueError, match=f"^kv-canary: attach\\(\\) does not support {needle}"):
        attach(manager)
    assert "_create_batch_processor" not in vars(manager)


def test_cuda_graphs_and_compile_of_the_engine_are_refused_by_name(model):
    cb, gen, _, _ = configs(ENGINE, {})
    manager = model.init_continuous_batching(generation_config=gen, continuous_batching_config=cb)
    manager.continuous_batching_config.use_cuda_graph = (True, False)  # as decide_use_cuda_graphs leaves it on a GPU
    with pytest.raises(ValueError, match=r"^kv-canary: attach\(\) does not support CUDA graphs of the engine"):
        attach(manager)
    manager.continuous_batching_config.use_cuda_graph = (False, False)
    manager.continuous_batching_config.varlen_compile_config = transformers.CompileConfig()
    with pytest.raises(ValueError, match=r"^kv-canary: attach\(\) does not support torch.compile of the engine"):
        attach(manager)


def test_sliding_window_models_are_refused_by_name():
    config = transformers.MistralConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                                        num_key_value_heads=2, vocab_size=128, sliding_window=16)
    model = transformers.MistralForCausalLM(config)
    with pytest.raises(ValueError, match=r"^kv-canary: attach\(\) does not support sliding-window attention groups"):
        attach(model)
    assert "init_continuous_batching" not in vars(model)


def test_bad_options_targets_and_versions_are_refused(model, monkeypatch):
    with pytest.raises(TypeError, match=r"^kv-canary: transformers attach\(\) got unknown option\(s\) sweep; the options are"):
        attach(model, sweep=3)
    with pytest.raises(ValueError, match=r"^kv-canary: on_violation must be one of"):
        attach(model, on_violation="shout")
    with pytest.raises(TypeError, match=r"^kv-canary: attach\(\) takes a transformers model with continuous batching"):
        attach(object())
    with pytest.raises(TypeError, match=r"^kv-canary: check_lost_stores must be a bool, got int"):
        attach(model, check_lost_stores=1)
    with pytest.raises(ValueError, match=r"^kv-canary: deep_check_period must be >= 1"):
        attach(model, deep_kv_layers="all", deep_check_period=0)
    with pytest.raises(ValueError, match=r"^kv-canary: deep_kv_layers \[9\] past the model's 5 layers"):
        attach(model, deep_kv_layers=[0, 9])
    one_layer = tiny_llama(HfEngineConfig(num_layers=1), "cpu", seed=0)
    with pytest.raises(ValueError, match=r"^kv-canary: check_lost_stores=True needs a model of two or more layers"):
        attach(one_layer, check_lost_stores=True)
    with pytest.raises(TypeError, match=r"^kv-canary: vLLM attach\(\) got unknown option\(s\) deep_kv_layers"):
        CanaryOptions.from_options("vLLM", {"deep_kv_layers": "all"})  # the coverage options are transformers' own
    assert "init_continuous_batching" not in vars(model)
    # transformers' lazy module may have been re-registered since this file imported it: patch the live one
    monkeypatch.setattr(sys.modules["transformers"], "__version__", "5.16.1")
    with pytest.raises(ImportError, match=r"^kv-canary: transformers 5.16.1 is outside the supported range 5.17.0 <= version < 5.26$"):
        attach(model)


def test_fingerprinted_layers_follow_the_option(model):
    with attach(model, fingerprint_layers=[2]) as canary:
        cb, gen, _, _ = configs(ENGINE, {})
        model.generate_batch([[1, 2, 3, 4, 5]], generation_config=gen, continuous_batching_config=cb, progress_bar=False)
    assert canary.fingerprinted_layers == ((2,),)
    with pytest.raises(ValueError, match=r"^kv-canary: fingerprint_layers \[7\] past the model's 5 layers"):
        attach(model, fingerprint_layers=[7])
    assert "init_continuous_batching" not in vars(model)


def test_the_decode_path_block_table_names_the_slots_the_csr_form_does(model):
    """The flash decode path (block_table, no read/write index) needs flash-attn, absent here: at every
    decode-only step of a real run, the engine's own fill_block_table builds that step's block table, and
    the canary's BlockTable form of it plans exactly the slots (and write slots) of the CSR form."""
    import kvcanary_cupy as kc
    from kvcanary_cupy.integrations._hf_layout import wrap

    cb, gen, requests, block = configs(ENGINE, {})
    prompts = workload(np.random.default_rng(2), requests, block, ENGINE.vocab_size)
    checked = []

    def inner(original, canary):
        def compute_batch(model_, batch_data):
            step = canary._steps[0]
            io, layout = step.io, step.layout
            fs_list = io.requests_in_batch
            if batch_data["read_index"][layout.group].numel() and all(fs.query_length == 1 for fs in fs_list):
                bs, pasts = len(fs_list), [fs.state.position_offset - 1 for fs in fs_list]
                width = max(len(layout.block_tables()[fs.state.request_id]) for fs in fs_list)
                bt = torch.full((layout.cache.num_groups if hasattr(layout.cache, "num_groups") else 1, bs, width), -1,
                                dtype=torch.int32, device=step.device)
                for i, (fs, p) in enumerate(zip(fs_list, pasts)):
                    layout.cache.fill_block_table(fs.state.request_id, p, 1, bt[:, i])
                pre, ext = step._pre[:bs].clone(), step._ext[:bs].clone()
                csr = kc.PagedKvIndices(batch_data["cu_seq_lens_k"][: bs + 1] if not isinstance(batch_data["cu_seq_lens_k"], dict)
                                        else batch_data["cu_seq_lens_k"]["full_attention"][: bs + 1],
                                        torch.as_tensor(step._shifted(batch_data["read_index"][layout.group], "_read")).clone(), 1)
                vp_csr, _ = kc.plan(None, pre, ext, csr, verify_capacity=4096)
                vp_bt, _ = kc.plan(step._rows[:bs], pre, ext, step._block_table(bt[layout.group]), verify_capacity=4096)
                n = int(vp_csr.verify_num_valid[0])
                assert n == int(vp_bt.verify_num_valid[0]) > 0
                for key in ("verify_slot_indices", "verify_expected_positions", "verify_prev_slot_indices"):
                    assert getattr(vp_csr, key)[:n].tolist() == getattr(vp_bt, key)[:n].tolist()
                loc = step._shifted(batch_data["write_index"][layout.group], "_loc")[:bs].tolist()
                assert step._decode_slots(fs_list, pasts, layout.block_tables()).tolist() == loc
                checked.append(bs)
            original(model_, batch_data)
        return compute_batch

    manager = model.init_continuous_batching(generation_config=gen, continuous_batching_config=cb)
    manager.warmup()
    processor = manager.batch_processor
    undo = []
    canary = attach(manager, on_violation="raise")
    # beneath the canary's wrapper: the canary's pre_forward for the step has run, the forward has not
    canary._steps[0].uninstall()
    wrap(processor.model_runner, "compute_batch", lambda original: inner(original, canary), undo)
    canary._steps[0]._undo = []
    wrap(processor.model_runner, "compute_batch", canary._steps[0]._wrap_compute, canary._steps[0]._undo)
    manager.start()
    ids = manager.add_requests(inputs=prompts, max_new_tokens=ENGINE.max_new_tokens)
    done = set()
    while len(done) < len(ids):
        result = manager.get_result(timeout=1)
        if result is not None and result.is_finished():
            done.add(result.request_id)
        assert manager.is_running() or len(done) == len(ids)
    manager.stop(block=True)
    canary.detach()
    for u in undo:
        u()
    manager.destroy()
    assert len(checked) >= 3  # several decode-only steps compared


@pytest.mark.parametrize("fault", [None, "write_index_off_by_one", "read_index_other_request", "sampled_tokens_swapped"])
def test_the_gpu_path_torch_ops_on_cpu_tensors_do_what_the_cpu_path_does(model, fault, monkeypatch):
    """The step's torch ops of a GPU processor (lengths, shifted indices, widened tokens, the pool's
    copy out of its host rows, the views kept a shape), run on CPU tensors: the same tokens,
    findings and counts as the CPU path's NumPy views, clean and with faults."""
    from kvcanary_cupy.integrations import _hf_step

    if model.device.type != "cpu":
        pytest.skip("the CPU path's run to compare with")
    overrides = CLEAN_CONFIGS["prefix_sharing_chunked_prefill"]
    # without the lost-store check, whose first stores compare with whatever the allocator recycled
    engine = dataclasses.replace(ENGINE, check_lost_stores=False)

    def run():
        f = None if fault is None else FAULTS[fault]()
        outcome = run_engine(model, engine, f.overrides if f else overrides, seed=11, fault=f)
        return _tokens(outcome.outputs), [v.format() for v in outcome.violations], outcome.stats

    want = run()

    class Event:  # what the pool uses of torch.cuda.Event: on CPU tensors a copy has run when it returns
        def record(self, stream=None):
            pass

        def synchronize(self):
            pass

    init = _hf_step.StepCanary.__init__

    def torch_path(self, *args, **kwargs):
        init(self, *args, **kwargs)
        self._cpu = False

    def new_pool(self, shape):  # the GPU layout (host rows and a device pool beside them), without pinned memory
        self._pool_view = torch.zeros(shape, dtype=torch.int32)
        self._pool_host = self._pool_view.numpy()
        self._pool = torch.zeros(shape, dtype=torch.int32)
        self._heads["_pool"].clear()
        return self._pool_host

    monkeypatch.setattr(_hf_step.StepCanary, "__init__", torch_path)
    monkeypatch.setattr(_hf_step.StepCanary, "_new_pool", new_pool)
    monkeypatch.setattr(torch.cuda, "Event", Event)
    got = run()
    assert got == want
    assert want[2]["verified_entries"] > 0 and (want[1] == []) == (fault is None)
