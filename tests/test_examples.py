"""examples/session.ipynb runs top to bottom on the CPU (its code cells, in order, without Jupyter)."""

import json
import pathlib

import pytest

NOTEBOOK = pathlib.Path(__file__).resolve().parent.parent / "examples" / "session.ipynb"


def test_session_notebook_runs_and_finds_what_it_says(capsys):
    pytest.importorskip("pandas")  # the notebook shows report.to_pandas()
    notebook = json.loads(NOTEBOOK.read_text())
    assert notebook["nbformat"] == 4
    namespace = {}
    for cell in notebook["cells"]:
        if cell["cell_type"] == "code":
            assert cell["outputs"] == []  # committed without outputs
            exec(compile("".join(cell["source"]), f"{NOTEBOOK.name}[{cell['id']}]", "exec"), namespace)
    report = namespace["report"]
    assert len(report.violations) == 4 and {v.repeats for v in report.violations} == {4}
    assert all(v.batch_rows == (0,) for v in report.violations)
    assert [len(r.violations) for r in namespace["seen"]] == [4]
    assert namespace["step"] == 3  # the strict session raised one step after the fault
    sweep = namespace["sweeper"].report()
    assert {v.launch_tag for v in sweep.violations} == {"SWEEP_K_FULL"} and len(sweep.violations) == 2
    assert "raised: kv-canary: 4 new violation(s):" in capsys.readouterr().out
