"""The canary inside vLLM 0.32's CPU engine (kvcanary_cupy.integrations.vllm and ``kvcanary vllm``).

Runs in the vLLM venv of scripts/vllm_check.sh (vLLM's CPU build is 3.5 GB, not in the test extra);
the main suite skips this module in one line.  A real ``vllm.LLM`` serves a tiny random-weight
Llama (no download) with prefix caching; the workload's requests share a two-block prompt, so some
read blocks that others write in the same step.
"""

import os
import types

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed (scripts/vllm_check.sh runs these tests in its own venv)")
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")

import vllm  # noqa: E402

import kvcanary_cupy as kc  # noqa: E402
from kvcanary_cupy.integrations import vllm as kv  # noqa: E402
from kvcanary_cupy.integrations import vllm_run  # noqa: E402
from kvcanary_cupy.integrations.vllm_faults import FAULTS  # noqa: E402
from kvcanary_cupy.integrations.vllm_layouts import has_strided_sources  # noqa: E402

PARAMS = vllm.SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)
PROMPTS = vllm_run.workload(0, 10)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return vllm_run.tiny_llama(str(tmp_path_factory.mktemp("tiny-llama")))


@pytest.fixture(scope="module")
def engines(model_dir):
    made = {}

    def get(dtype):
        if dtype not in made:
            made[dtype] = vllm_run.start_engine(model_dir, dtype=dtype)
        return made[dtype]

    return get


def generate(llm):
    return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, PARAMS, use_tqdm=False)]


AMX = bool(getattr(__import__("torch").cpu, "_is_amx_tile_supported", lambda: False)())


# bfloat16 takes vLLM's AMX kernels where the CPU has AMX tiles (the CPU backend takes only
# blocks of 32k): K and V are packed there, not fingerprinted; chains, positions and tokens are.
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("mode", ["PARTIAL", "ALL"])
def test_a_clean_run_reports_nothing_and_changes_no_output(engines, dtype, mode):
    block_size = 32
    llm = engines(dtype)
    llm.reset_prefix_cache()
    reference = generate(llm)
    llm.reset_prefix_cache()
    runner = llm.llm_engine.engine_core.engine_core.model_executor.driver_worker.worker.model_runner
    with kv.attach(llm, real_kv_hash_mode=mode, on_violation="raise") as canary:
        got = generate(llm)
    assert got == reference
    stats = canary.stats
    assert stats["violations"] == 0 and canary.report().violations == ()
    assert stats["engine_steps"] == stats["steps"] >= PARAMS.max_tokens
    assert stats["verified_entries"] > 1000 and stats["same_step_verified"] > 0  # the same-step prefix hits happened
    assert stats["fingerprinted_layers"] == (0 if AMX and dtype == "bfloat16" and block_size == 32 else 2)
    assert stats["out_of_range_skipped"] == 0
    assert "_model_forward" not in vars(runner)  # detached: the runner's own method again


@pytest.mark.parametrize("name", list(FAULTS))
def test_every_fault_class_is_caught_and_names_its_victims(engines, name):
    import random

    llm = engines("float32")
    fault = FAULTS[name](random.Random(7))
    _, report, stats, _, _ = vllm_run.run_episode(llm, PROMPTS, PARAMS, fault, mode="PARTIAL")
    assert fault.fired_step is not None and fault.victims
    hits = [v for v in report.violations if set(v.request_ids) & fault.victims or v.slot_idx in fault.slots]
    assert len(hits) == len(report.violations)  # nothing outside the fault's requests and slots
    if name == "cached_block_bit_flip_k" and not has_strided_sources():
        assert hits == []  # K is stored transposed: fingerprinted only through a strided source
        return
    assert hits
    named = {r for v in hits for r in v.request_ids}
    assert all(r.split("-")[0].isdigit() for r in named)  # vLLM's request ids ("3-9ad3dcf2"), not batch rows
    if name.startswith("cached_block_bit_flip"):
        assert named == fault.victims  # every request that read the flipped block
    else:
        assert named & fault.victims


def test_sweeps_verify_the_prefix_caches_blocks_and_find_a_flip_nobody_reads(engines):
    llm = engines("float32")
    llm.reset_prefix_cache()
    reference = generate(llm)
    llm.reset_prefix_cache()
    with kv.attach(llm, sweep_every=3, on_violation="ignore") as canary:
        assert generate(llm) == reference
        canary.check()
        clean = canary.stats
        assert clean["violations"] == 0 and clean["sweeps"] >= 3 and clean["blocks_swept"] >= 3 * 8
        # Every request finished: the cached blocks are held by no one.  A stray write into one of them
        pool = llm.llm_engine.engine_core.engine_core.scheduler.kv_cache_manager.block_pool
        block = min(b.block_id for b in pool.cached_block_hash_to_block._cache.values() if not isinstance(b, dict))
        kv0 = canary._runner.kv_caches[0]
        kv0.view(kv0.shape[0], kv0.shape[1], -1).view(__import__("torch").int32)[block, 0, 32 * 32 + 2 * 32] ^= 1 << 9
        assert canary.sweep() >= 8
        canary.check()
    hits = canary.report().violations
    assert [(v.slot_idx, v.request_ids) for v in hits] == [(block * 32 + 2, (f"block {block}",))]
    assert hits[0].reasons == "verify_real_kv_hash"


# vLLM reads VLLM_ENABLE_V1_MULTIPROCESSING once per process: the separate engine core runs from a
# fresh interpreter, with the default (multiprocessing on).
SEPARATE_ENGINE_CORE = """
import json, sys
import vllm
from kvcanary_cupy.integrations import vllm as kv, vllm_run

params = vllm.SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)
prompts = vllm_run.workload(0, 10)
gen = lambda llm: [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
common = dict(model=sys.argv[1], enforce_eager=True, block_size=32, enable_prefix_caching=True, max_num_seqs=8,
              max_model_len=512, dtype="float32", skip_tokenizer_init=True, num_gpu_blocks_override=64,
              gpu_memory_utilization=vllm_run.MEMORY_UTILIZATION)
out = {}
llm = vllm.LLM(worker_extension_cls=kv.WORKER_EXTENSION, **common)
out["client"] = type(llm.llm_engine.engine_core).__name__
reference = gen(llm)
llm.reset_prefix_cache()
with kv.attach(llm, on_violation="raise") as canary:
    out["same"] = gen(llm) == reference
    out["stats"] = canary.stats
    out["skipped"] = canary.check()
out["report"] = [type(canary.report()).__name__, len(canary.report().violations)]
with kv.attach(llm) as again:  # the first one detached in the engine core: a new one attaches
    gen(llm)
out["again_steps"] = again.stats["engine_steps"]
llm.llm_engine.engine_core.shutdown()
bare = vllm.LLM(**common)
try:
    kv.attach(bare)
except ValueError as exc:
    out["refused"] = str(exc)
print("RESULT " + json.dumps(out), flush=True)
"""


def test_a_separate_engine_core_process_brings_reports_back(model_dir):
    import json
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "VLLM_ENABLE_V1_MULTIPROCESSING"}
    env.update(VLLM_CPU_KVCACHE_SPACE="1", VLLM_CPU_OMP_THREADS_BIND="nobind")
    done = subprocess.run([sys.executable, "-c", SEPARATE_ENGINE_CORE, model_dir], env=env, capture_output=True,
                          text=True, timeout=600)
    lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    assert lines, done.stderr[-3000:]
    out = json.loads(lines[-1].removeprefix("RESULT "))
    assert out["client"] == "SyncMPClient"  # the engine core in its own process
    stats = out["stats"]  # fetched from the engine core's process
    assert out["same"] and stats["violations"] == 0 and stats["engine_steps"] >= 10
    assert stats["verified_entries"] > 1000 and out["skipped"] == 0
    assert out["report"] == ["ViolationReport", 0] and out["again_steps"] >= 10
    assert "worker_extension_cls='kvcanary_cupy.integrations.vllm.CanaryWorkerExtension'" in out["refused"]


def test_unsupported_modes_are_refused_by_name():
    config = types.SimpleNamespace(speculative_config=object(),
                                   parallel_config=types.SimpleNamespace(tensor_parallel_size=2, pipeline_parallel_size=1,
                                                                         data_parallel_size=1),
                                   scheduler_config=types.SimpleNamespace(async_scheduling=True),
                                   model_config=types.SimpleNamespace(is_encoder_decoder=False))
    assert kv.refused_modes(config) == ["speculative decoding", "tensor parallelism (tensor_parallel_size=2)",
                                        "async scheduling"]


@pytest.mark.parametrize("groups,match", [(2, "several KV-cache groups"), ("window", "sliding-window")])
def test_hybrid_and_sliding_window_caches_are_refused_by_name(groups, match):
    spec = types.SimpleNamespace(sliding_window=128 if groups == "window" else None, attention_chunk_size=None, block_size=32)
    group = types.SimpleNamespace(kv_cache_spec=spec, layer_names=["l0"])
    runner = types.SimpleNamespace(kv_cache_config=types.SimpleNamespace(kv_cache_groups=[group] * (2 if groups == 2 else 1)))
    with pytest.raises(ValueError, match=match):
        kv.VllmCanary.install(runner, kv.CanaryOptions())


def test_versions_outside_the_supported_range_are_an_import_error(monkeypatch):
    monkeypatch.setattr(vllm, "__version__", "0.31.2")
    with pytest.raises(ImportError, match=r"supports vLLM >= 0.32.0, < 0.33.0; this is vLLM 0.31.2"):
        kv.import_vllm()
    monkeypatch.setattr(vllm, "__version__", "0.32.0+cpu")
    assert kv.import_vllm() is vllm


def test_the_command_writes_the_simulators_report(tmp_path, capsys):
    from kvcanary_cupy.cli import main

    out, plot = tmp_path / "r.json", tmp_path / "r.png"
    assert main(["vllm", "--faults", "stale_block_table_entry,prefix_cache_wrong_block", "--json", str(out),
                 "--plot", str(plot), "--quiet"]) == 0
    import json

    doc = json.loads(out.read_text())
    assert set(doc) == {"partial", "steps_run", "config", "faults", "clean", "cost"}  # kvcanary sim's schema
    assert [f["name"] for f in doc["faults"]] == ["stale_block_table_entry", "prefix_cache_wrong_block"]
    assert all(f["detected"] == f["injected"] == 1 and f["victims_named"] for f in doc["faults"])
    assert doc["clean"]["false_positives"] == 0 and doc["clean"]["outputs_unchanged"] is True
    assert doc["cost"]["canary_host_us"] > 0
    if plot.exists():
        assert plot.read_bytes()[:4] == b"\x89PNG"
