"""examples/transformers.ipynb runs top to bottom on the CPU (its code cells, in order, without Jupyter)."""

import json
import pathlib

import pytest

NOTEBOOK = pathlib.Path(__file__).resolve().parent.parent / "examples" / "transformers.ipynb"


def test_transformers_notebook_runs_and_finds_what_it_says(capsys):
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    notebook = json.loads(NOTEBOOK.read_text())
    namespace = {}
    for cell in notebook["cells"]:
        if cell["cell_type"] == "code":
            assert cell["outputs"] == []  # committed without outputs
            exec(compile("".join(cell["source"]), f"{NOTEBOOK.name}[{cell['id']}]", "exec"), namespace)
    assert namespace["same"] and namespace["unexplained"] == []
    fault, found = namespace["fault"], namespace["found"]
    assert fault.fired_step is not None and found
    assert min(v.first_step for v in found) == fault.fired_step
    assert set(fault.victims) <= {r for v in found for r in v.request_ids}
    assert "same tokens: True | unexplained violations: 0" in capsys.readouterr().out
