"""``kvcanary sim`` end to end: every fault class caught (or not) as declared, no false positives,
the JSON schema, determinism, the CLI, and the one-line messages without matplotlib or a GPU."""

import json
import os
import subprocess
import sys

import pytest

import kvcanary_cupy
from conftest import EXPECT_GPU
from kvcanary_cupy import cli
from kvcanary_cupy.interop import cuda_unavailable_reason
from kvcanary_cupy.sim import FAULTS, SimConfig, run, simulate
from kvcanary_cupy.sim.engine import EngineConfig
from kvcanary_cupy.sim.report import PLOT_HINT
from kvcanary_cupy.sim.tables import ADDRESSING_MODES

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repository (examples/)
PACKAGE_PARENT = os.path.dirname(os.path.dirname(kvcanary_cupy.__file__))  # so subprocesses import this copy
FAULT_KEYS = ["name", "description", "injected", "detected", "detection_rate", "latency_steps_median",
              "latency_steps_max", "first_reason", "detectable", "why_not_detectable", "contained"]


@pytest.fixture(scope="module", params=ADDRESSING_MODES)
def faulty_run(request):
    """One short run per addressing mode injecting every class in turn, as often as the engine allows."""
    return request.param, simulate(SimConfig(steps=240, seed=1, rate=1.0, addressing=request.param))


@pytest.mark.parametrize("name", list(FAULTS))
def test_fault_class_is_caught_as_declared(faulty_run, name):
    addressing, (results, stats) = faulty_run
    f = next(r for r in results if r.name == name)
    assert f.injected >= 1
    assert f.detectable == FAULTS[name].detectable_with(addressing)
    assert f.description and (f.why_not_detectable is None) == f.detectable
    if f.detectable:
        assert f.detected == f.injected and f.first_reason and max(f.latencies) < SimConfig.window
        # contained from the reports alone: no request kept reading the fault's poisoned KV
        assert f.to_json()["contained"]["leaked_requests"] == 0
    else:
        assert f.detected == 0 and f.first_reason is None
    assert stats.unattributed == 0, stats.unattributed_examples


def test_fault_classes_cover_the_issue_and_name_their_bug():
    assert len(FAULTS) >= 12
    blind = {n for n, f in FAULTS.items() if not f.detectable}  # under SGLang's coverage; a zeroed entry is a hole now
    assert blind == {"kv_store_dropped", "unfingerprinted_layer_bitflip"}
    sglang_coverage = EngineConfig(deep_kv=False, lost_stores=False)
    assert all(f.detectable_with(m, sglang_coverage) == f.detectable for f in FAULTS.values() for m in ADDRESSING_MODES)
    # The simulator's default coverage (deep fingerprints, lost-store check) sees the other two.
    assert {n for n, f in FAULTS.items() if not f.detectable_with("sglang")} == set()
    assert {n for n, f in FAULTS.items() if not f.detectable_with("sglang", EngineConfig(lost_stores=False))} == {
        "kv_store_dropped"}
    assert {n for n, f in FAULTS.items() if not f.detectable_with("vllm", EngineConfig(deep_kv=False))} == {
        "unfingerprinted_layer_bitflip"}


def test_sglang_coverage_leaves_the_two_classes_blind():
    """With the coverage options off, a dropped KV store and a flip in layer 1 are missed, as SGLang's canary misses them."""
    config = SimConfig(steps=160, seed=2, rate=1.0, faults=("kv_store_dropped", "unfingerprinted_layer_bitflip"),
                       engine=EngineConfig(deep_kv=False, lost_stores=False))
    results, stats = simulate(config)
    assert all(f.injected >= 1 and f.detected == 0 and not f.detectable for f in results)
    assert stats.unattributed == 0


def test_tables_with_a_null_block_see_the_same_run():
    """req_to_token (through the page map) and a block table address the same slots, the null block
    included: the same run, fault for fault.  (A CSR table differs only for a zeroed entry; the CLI
    test below compares it without that class.)"""
    config = dict(steps=160, seed=4, rate=1.0)
    sglang, vllm = simulate(SimConfig(addressing="sglang", **config)), simulate(SimConfig(addressing="vllm", **config))
    assert sglang[0] == vllm[0] and sum(f.injected for f in sglang[0]) >= 15
    assert sglang[1].violations == vllm[1].violations > 0 and sglang[1].engine_counters == vllm[1].engine_counters


def _json_without_timings(path):
    with open(path) as f:
        doc = json.load(f)
    doc.pop("cost")
    return doc


def _cli(tmp_path, *args):
    env = dict(os.environ, PYTHONPATH=PACKAGE_PARENT)
    return subprocess.run([sys.executable, "-m", "kvcanary_cupy", *args], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=300)


def test_cli_writes_the_schema_and_the_same_seed_gives_the_same_json(tmp_path):
    faults = ",".join(n for n in FAULTS if n != "zeroed_table_entry")
    args = ["sim", "--steps", "40", "--seed", "5", "--rate", "1", "--plot", "", "--quiet", "--faults", faults]
    first = _cli(tmp_path, *args, "--json", "a.json")
    second = _cli(tmp_path, *args, "--json", "b.json", "--addressing", "flashinfer")
    assert first.returncode == 0 and second.returncode == 0, first.stderr + second.stderr
    assert first.stdout == ""  # --quiet: no table
    a, b = _json_without_timings(tmp_path / "a.json"), _json_without_timings(tmp_path / "b.json")
    assert set(a) == {"partial", "steps_run", "config", "faults", "clean"}
    assert set(a["clean"]) == {"steps", "false_positives"}
    assert a["clean"] == {"steps": 40, "false_positives": 0}
    assert a["partial"] is False and a["steps_run"] == {"faulty": 40, "clean": 40}
    assert [list(f) for f in a["faults"]] == [FAULT_KEYS] * (len(FAULTS) - 1)
    assert sum(f["injected"] for f in a["faults"]) >= 3
    # Two processes, one seed: the same result.  (Without a zeroed entry, req_to_token and a CSR
    # table address the same slots, so only the config differs.)
    assert a["config"].pop("addressing") == "sglang" and b["config"].pop("addressing") == "flashinfer"
    assert a == b


def test_cli_table_json_and_plot(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    assert cli.main(["sim", "--steps", "40", "--faults", "off_by_one_position,zeroed_table_entry", "--rate", "1",
                     "--json", str(tmp_path / "r.json"), "--plot", str(tmp_path / "r.png")]) == 0
    out = capsys.readouterr().out
    assert "off_by_one_position" in out and "zeroed_table_entry" in out and "blind by design" not in out
    assert "clean run: 40 steps, 0 false positives" in out
    assert "containment from the reports alone:" in out and "leaked (requests that read poisoned KV after a detection): 0" in out
    doc = json.loads((tmp_path / "r.json").read_text())
    assert [f["name"] for f in doc["faults"]] == ["off_by_one_position", "zeroed_table_entry"]
    assert [f["detection_rate"] for f in doc["faults"]] == [1.0, 1.0]
    assert doc["faults"][1]["first_reason"] == "verify_table_hole"
    assert doc["faults"][1]["contained"]["leaked_requests"] == 0 and doc["faults"][1]["contained"]["requests_aborted"] >= 1
    assert doc["cost"]["canary_host_us"] > 0 and doc["cost"]["canary_device_us"] is None
    assert (tmp_path / "r.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_without_matplotlib_the_table_comes_with_one_line_about_the_plot(tmp_path, capsys, monkeypatch):
    import builtins

    real_import = builtins.__import__

    def no_matplotlib(name, *args, **kwargs):
        if name.split(".")[0] == "matplotlib":
            raise ImportError("No module named 'matplotlib'")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_matplotlib)
    assert cli.main(["sim", "--steps", "20", "--faults", "lost_write", "--json", str(tmp_path / "r.json"),
                     "--plot", str(tmp_path / "r.png")]) == 0
    out = capsys.readouterr().out
    assert "fault class" in out and out.rstrip().endswith(PLOT_HINT)
    assert (tmp_path / "r.json").exists() and not (tmp_path / "r.png").exists()


def test_bad_arguments_are_refused_with_a_message(tmp_path, capsys):
    with pytest.raises(SystemExit):
        cli.main(["sim", "--faults", "no_such_fault"])
    assert "unknown fault class no_such_fault" in capsys.readouterr().err
    assert cli.main(["sim", "--steps", "0", "--json", "", "--plot", ""]) == 2
    assert "steps must be >= 1" in capsys.readouterr().err


def test_a_negative_seed_is_one_line_and_exit_2(tmp_path, capsys):
    assert cli.main(["sim", "--seed", "-1", "--json", "", "--plot", ""]) == 2
    assert capsys.readouterr().err == "kvcanary sim: seed must be >= 0, got -1\n"
    done = _cli(tmp_path, "sim", "--seed", "-1")
    assert done.returncode == 2 and done.stderr == "kvcanary sim: seed must be >= 0, got -1\n"


@pytest.mark.parametrize("flag", ["--json", "--plot"])
@pytest.mark.parametrize("where", ["no_such_folder/out", "a_folder"])
def test_an_unusable_output_path_fails_before_the_run(tmp_path, capsys, monkeypatch, flag, where):
    (tmp_path / "a_folder").mkdir()
    started = []
    monkeypatch.setattr(cli_sim_runner(), "simulate", lambda *a, **k: started.append(1))
    other = "--plot" if flag == "--json" else "--json"
    assert cli.main(["sim", "--steps", "5", flag, str(tmp_path / where), other, ""]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"kvcanary sim: {flag} {tmp_path / where}: ") and err.count("\n") == 1
    assert ("does not exist" if where.startswith("no_such") else "is a directory") in err
    assert started == []  # refused before the first step


def test_json_and_plot_naming_one_file_are_refused(tmp_path, capsys):
    target = tmp_path / "out"
    assert cli.main(["sim", "--steps", "5", "--json", str(target), "--plot", str(target)]) == 2
    assert capsys.readouterr().err == f"kvcanary sim: --json and --plot name the same file {target}\n"
    assert not target.exists()


def test_a_read_only_folder_fails_before_the_run(tmp_path, capsys, monkeypatch):
    if os.geteuid() == 0:
        pytest.skip("root writes into read-only folders")
    folder = tmp_path / "ro"
    folder.mkdir()
    folder.chmod(0o500)
    try:
        assert cli.main(["sim", "--steps", "5", "--json", str(folder / "r.json"), "--plot", ""]) == 2
    finally:
        folder.chmod(0o700)
    assert "cannot write in" in capsys.readouterr().err


def cli_sim_runner():
    from kvcanary_cupy.sim import runner

    return runner


def test_outputs_are_written_atomically_and_their_paths_printed(tmp_path, capsys, monkeypatch):
    import kvcanary_cupy.sim.report as report

    replaced = []
    real_replace = os.replace

    def watch_replace(src, dst):
        # the whole file exists under a temporary name in the same folder before it takes the real one
        assert os.path.dirname(src) == os.path.dirname(dst) == str(tmp_path) and os.path.getsize(src) > 0
        replaced.append(os.path.basename(dst))
        real_replace(src, dst)

    monkeypatch.setattr(report.os, "replace", watch_replace)
    monkeypatch.chdir(tmp_path)
    (tmp_path / "r.json").write_text("old")
    assert cli.main(["sim", "--steps", "10", "--faults", "lost_write", "--json", "r.json", "--plot", ""]) == 0
    out = capsys.readouterr().out
    assert replaced == ["r.json"] and json.loads((tmp_path / "r.json").read_text())["partial"] is False
    assert out.rstrip().splitlines()[-1] == f"wrote {tmp_path / 'r.json'}"  # absolute
    assert sorted(os.listdir(tmp_path)) == ["r.json"]  # no temporary file left
    assert oct((tmp_path / "r.json").stat().st_mode & 0o777) != oct(0o600)  # the umask's mode, not mkstemp's


def test_a_failed_write_keeps_the_old_file_and_leaves_no_temporary(tmp_path, monkeypatch):
    import kvcanary_cupy.sim.report as report

    target = tmp_path / "r.json"
    target.write_text("old")

    def broken(f):
        f.write(b"{half")
        raise OSError("disk full")

    with pytest.raises(OSError, match="disk full"):
        report._write_atomically(str(target), broken)
    assert target.read_text() == "old" and os.listdir(tmp_path) == ["r.json"]


def _interrupt_engine_at(monkeypatch, call):
    """Engine.step raises KeyboardInterrupt at its ``call``-th call (1-based), as Ctrl-C would."""
    from kvcanary_cupy.sim import engine as engine_module

    real_step = engine_module.Engine.step
    calls = []

    def step(self):
        calls.append(1)
        if len(calls) == call:
            raise KeyboardInterrupt
        return real_step(self)

    monkeypatch.setattr(engine_module.Engine, "step", step)


@pytest.mark.parametrize("at, faulty, clean", [(13, 12, 0), (30, 20, 9)])
def test_ctrl_c_writes_what_was_measured_marked_partial_and_exits_130(tmp_path, capsys, monkeypatch, at, faulty, clean):
    pytest.importorskip("matplotlib")
    _interrupt_engine_at(monkeypatch, at)
    assert cli.main(["sim", "--steps", "20", "--rate", "1", "--faults", "lost_write,token_swap",
                     "--json", str(tmp_path / "r.json"), "--plot", str(tmp_path / "r.png")]) == 130
    captured = capsys.readouterr()
    assert "fault class" in captured.out and f"clean run: {clean} steps" in captured.out
    assert f"PARTIAL: interrupted after {faulty} of 20 faulty steps" in captured.out
    assert captured.err.splitlines()[-1].split("\r")[-1] == (
        f"kvcanary sim: interrupted; the results are partial ({faulty} faulty and {clean} clean steps of 20 each)")
    doc = json.loads((tmp_path / "r.json").read_text())
    assert doc["partial"] is True and doc["steps_run"] == {"faulty": faulty, "clean": clean}
    assert doc["clean"] == {"steps": clean, "false_positives": 0}
    assert sum(f["injected"] for f in doc["faults"]) >= 1  # what the faulty steps measured is kept
    assert (tmp_path / "r.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_sigint_to_the_process_writes_a_partial_report_and_exits_130(tmp_path):
    import re
    import select
    import signal
    import time

    env = dict(os.environ, PYTHONPATH=PACKAGE_PARENT)
    proc = subprocess.Popen([sys.executable, "-m", "kvcanary_cupy", "sim", "--steps", "100000", "--plot", "",
                             "--json", "r.json"], cwd=tmp_path, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE,
                            # a run started in the background of a shell inherits SIGINT ignored
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        seen, deadline = b"", time.monotonic() + 120
        while not re.search(rb"\| *[1-9]\d*/200000", seen):  # tqdm: at least one step done
            ready, _, _ = select.select([proc.stderr], [], [], max(0.0, deadline - time.monotonic()))
            assert ready, "no progress within 120 s: " + seen.decode(errors="replace")
            chunk = os.read(proc.stderr.fileno(), 4096)
            assert chunk, seen.decode(errors="replace")
            seen += chunk
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=120)
    finally:
        proc.kill()
    assert proc.returncode == 130, err.decode(errors="replace")
    assert b"Traceback" not in err and b"fault class" in out
    doc = json.loads((tmp_path / "r.json").read_text())
    assert doc["partial"] is True and 1 <= doc["steps_run"]["faulty"] < 100000 and doc["steps_run"]["clean"] == 0


def test_gpu_commands_without_a_gpu_print_one_line(monkeypatch, capsys):
    monkeypatch.setattr(cli, "cuda_unavailable_reason", lambda: "no CUDA GPU found (test)")
    assert cli.main(["sim", "--device", "cuda"]) == 2
    assert capsys.readouterr().err == "kvcanary sim: --device cuda: no CUDA GPU found (test)\n"
    from kvcanary_cupy.devtools import bench

    monkeypatch.setattr(bench, "cuda_unavailable_reason", lambda: "CuPy is not installed: pip install ...")
    assert cli.main(["bench"]) == 2
    assert capsys.readouterr().err.count("\n") == 1


def test_without_cupy_the_reason_names_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "cupy", None)  # import cupy raises ImportError
    reason = cuda_unavailable_reason()
    assert reason.startswith("CuPy is not installed") and "kvcanary-cupy[cu12]" in reason


@pytest.mark.skipif(cuda_unavailable_reason() is None, reason="this machine has a GPU")
@pytest.mark.parametrize("command", [["-m", "kvcanary_cupy", "sim", "--device", "cuda"], ["-m", "kvcanary_cupy", "bench"],
                                     *([os.path.join(ROOT, "examples", name), "--gpu"] for name in
                                       ("quickstart.py", "engines_sglang.py", "engines_vllm.py", "engines_flashinfer.py"))])
def test_on_this_machine_gpu_paths_fail_cleanly(command):
    env = dict(os.environ, PYTHONPATH=PACKAGE_PARENT)
    done = subprocess.run([sys.executable, *command], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2
    assert "Traceback" not in done.stderr and done.stderr.count("\n") == 1
    assert "no CUDA GPU found" in done.stderr or "CuPy is not installed" in done.stderr


def test_version_and_help_show_the_defaults(capsys):
    with pytest.raises(SystemExit) as done:
        cli.main(["--version"])
    assert done.value.code == 0 and capsys.readouterr().out == f"kvcanary {kvcanary_cupy.__version__}\n"
    with pytest.raises(SystemExit):
        cli.main(["sim", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    for shown in ["(default: 2000)", "(default: 0)", "(default: all)", "(default: 0.5)", "(default: sglang)",
                  "(default: cpu)", "(default: kvcanary-sim.json)", "(default: kvcanary-sim.png)"]:
        assert shown in text
    from kvcanary_cupy.devtools import bench

    with pytest.raises(SystemExit):
        cli.main(["bench", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "``" not in text and "four" not in text and f"on {len(bench.WORKLOADS)} serving workloads" in text
    assert all(w.name in text for w in bench.WORKLOADS.values()) and "(default: cupy)" in text


def test_warmup_without_a_gpu_raises_one_line(monkeypatch):
    pytest.importorskip("cupy")
    from kvcanary_cupy.backends.cuda import compile as cuda_compile

    monkeypatch.setattr(cuda_compile, "cuda_unavailable_reason", lambda: "no CUDA GPU found (test)")
    with pytest.raises(RuntimeError) as info:
        kvcanary_cupy.warmup()
    assert str(info.value) == "kv-canary warmup: no CUDA GPU found (test)" and info.value.__cause__ is None


@pytest.mark.skipif(cuda_unavailable_reason() is None, reason="this machine has a GPU")
def test_on_this_machine_warmup_fails_with_one_clear_line():
    pytest.importorskip("cupy")
    env = dict(os.environ, PYTHONPATH=PACKAGE_PARENT)
    done = subprocess.run([sys.executable, "-c", "import kvcanary_cupy as kc; kc.warmup()"], env=env,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 1
    assert done.stderr.splitlines()[-1] == f"RuntimeError: kv-canary warmup: {cuda_unavailable_reason()}"
    assert "cupy_backends" not in done.stderr  # raised before CuPy's own error, not chained to it


def test_bench_numpy_backend_writes_json(tmp_path, capsys):
    assert cli.main(["bench", "--backend", "numpy", "--workloads", "W3", "--json", str(tmp_path / "b.json")]) == 0
    assert "W3 small decode" in capsys.readouterr().out
    doc = json.loads((tmp_path / "b.json").read_text())
    assert doc["backend"] == "numpy" and {r["op"] for r in doc["rows"] if "section" not in r} == {"plan", "verify", "write"}
    assert {r["op"] for r in doc["rows"] if r.get("section") == "holes"} == {"verify", "verify[bound]", "plan_and_verify"}
    floored = [r for r in doc["rows"] if "section" not in r and r["op"] in ("plan", "verify")]
    assert sorted((r["op"], r["caches"]) for r in floored) == [("plan", "cold"), ("plan", "warm"), ("verify", "cold"), ("verify", "warm")]
    assert all(r["floor_ms"] > 0 and r["x_floor"] > 0 and r["floor_counts"] for r in floored)
    assert all(r["hash_ms"] > 0 for r in floored if r["op"] == "verify")


@pytest.mark.gpu
def test_cuda_run_equals_the_cpu_run():
    reason = cuda_unavailable_reason()
    if reason:
        if EXPECT_GPU:
            pytest.fail(reason)
        pytest.skip(reason)
    config = dict(steps=120, seed=2, rate=1.0)
    cpu, gpu = run(SimConfig(**config)), run(SimConfig(device="cuda", **config))
    a, b = cpu.to_json(), gpu.to_json()
    assert a["config"].pop("device") == "cpu" and b["config"].pop("device") == "cuda"
    assert a["config"] == b["config"] and a["clean"] == b["clean"] == {"steps": 120, "false_positives": 0}
    # Same bytes on both backends, so the same detections; only when a fault makes two requests write
    # one slot in one launch may the GPU's thread timing change which reason bits show first.
    for f, g in zip(a["faults"], b["faults"]):
        assert (f.pop("first_reason") is None) == (g.pop("first_reason") is None)
        assert f == g
    assert gpu.faulty.unattributed == 0 and b["cost"]["canary_device_us"] > 0
