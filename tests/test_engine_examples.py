"""The examples run as the README and docs/engines.md say, and find the bug each one plants.

Each engine example exits non-zero unless its steps verify clean up to the planted bug and then
report violations; the GPU variants run the same on CUDA (skipped without a GPU)."""

import os
import subprocess
import sys

import pytest

from conftest import get_backend_or_skip

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXAMPLES = ["quickstart.py", "engines_sglang.py", "engines_vllm.py", "engines_flashinfer.py"]


def run_example(name, *args):
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    return subprocess.run([sys.executable, os.path.join(ROOT, "examples", name), *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300)


@pytest.mark.parametrize("name", EXAMPLES)
@pytest.mark.parametrize("device", ["cpu", "cupy"])
def test_example_runs_and_catches_its_bug(name, device):
    if device == "cupy":
        get_backend_or_skip("cupy")
    done = run_example(name, *(["--gpu"] if device == "cupy" else []))
    assert done.returncode == 0, done.stdout + done.stderr
    assert "kv_canary violation:" in done.stdout
    assert "total_violations=0" not in done.stdout


def _doc_snippets(path):
    text = open(os.path.join(ROOT, path), encoding="utf-8").read()
    return [block.split("\n", 1)[1] for block in text.split("```")[1::2] if block.startswith("python\n")]


@pytest.mark.parametrize("index", range(len(_doc_snippets("docs/engines.md"))))
def test_engine_doc_snippets_run(index):
    """Every Python block of docs/engines.md runs as written (each asserts its own numbers)."""
    exec(compile(_doc_snippets("docs/engines.md")[index], f"docs/engines.md block {index}", "exec"), {})


def test_engine_doc_has_a_snippet_per_engine():
    assert len(_doc_snippets("docs/engines.md")) == 3
