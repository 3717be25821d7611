"""The canary stepped by transformers' own background generation thread while the test's thread reads
report() / stats and calls check() (docs/guide.md, "Threads")."""

import threading

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from kvcanary_cupy.hf import FAULTS, HfEngineConfig  # noqa: E402
from kvcanary_cupy.hf.harness import Harness  # noqa: E402
from kvcanary_cupy.hf.runner import configs, tiny_llama, workload  # noqa: E402
from kvcanary_cupy.integrations.transformers import attach  # noqa: E402

import numpy as np  # noqa: E402

ENGINE = HfEngineConfig()


def test_the_engine_thread_steps_while_another_thread_checks_and_reads():
    model = tiny_llama(ENGINE, "cpu", seed=0)
    cb, gen, requests, block = configs(ENGINE, {})
    prompts = workload(np.random.default_rng(5), requests, block, ENGINE.vocab_size)
    fault = FAULTS["sampled_tokens_swapped"]()  # gives the checks something to count
    with Harness(model, fault, np.random.default_rng(6)):
        manager = model.init_continuous_batching(generation_config=gen, continuous_batching_config=cb)
        canary = attach(manager, on_violation="ignore")
        stepping = set()
        manager.warmup()
        step = canary._steps[0]
        original = step.session.end_step

        def end_step():
            stepping.add(threading.get_ident())
            original()

        step.session.end_step = end_step
        manager.start()
        ids = manager.add_requests(inputs=prompts, max_new_tokens=ENGINE.max_new_tokens)
        done, snapshots = set(), []
        while len(done) < len(ids):
            canary.check()
            stats, report = canary.stats, canary.report()
            snapshots.append((stats["steps"], stats["rows_read"], len(report.violations)))
            result = manager.get_result(timeout=0.05)
            if result is not None and result.is_finished():
                done.add(result.request_id)
        manager.stop(block=True)
        canary.detach()
        manager.destroy()
    assert stepping and threading.get_ident() not in stepping  # the engine's own thread ran every end_step
    final = canary.stats
    report = canary.report()
    assert final["steps"] == final["engine_steps"] > 0 and final["pending_steps"] == 0
    assert fault.fired_step is not None and report.violations
    assert final["rows_read"] == sum(v.repeats for v in report.violations) + final["untracked_rows"]
    steps = [s[0] for s in snapshots]
    assert len(snapshots) > 1 and steps == sorted(steps) and steps[-1] <= final["steps"]
