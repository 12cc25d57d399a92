"""examples/quickstart.ipynb, executed end to end in a Jupyter kernel.

The kernel runs this interpreter (sys.executable), from the repository root,
through a kernelspec written for the test into a temporary JUPYTER_PATH, so
neither another Python's kernelspec nor a user's IPython profile can stand in.
Skipped where nbformat, nbclient or ipykernel are not importable (on the GPU
machine, scripts/gpu.sh installs them from wheels in .whl/notebook/).

CGRAPH_NOTEBOOK_OUT=path/to/executed.ipynb writes the executed notebook there,
its outputs included and the plot embedded as a PNG, in the committed file's
format, without run timings: copy it over examples/quickstart.ipynb to commit
a notebook with the outputs of one GPU run.  The notebook is executed from
scratch either way: outputs already committed are cleared first, so they
cannot stand in for a run's.
"""

import json
import os
import pathlib
import re
import sys
import time

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
NOTEBOOK = ROOT / "examples" / "quickstart.ipynb"
CELL_TIMEOUT_S = 300  # one cell; the whole notebook takes about a minute on an H100
STARTUP_TIMEOUT_S = 120


def _need(module: str):
    return pytest.importorskip(
        module, reason=f"{module} is not importable: the notebook test needs nbformat, "
        "nbclient and ipykernel (pip install nbclient ipykernel)")


def execute(path: pathlib.Path, tmp_path: pathlib.Path, monkeypatch):
    """Run every cell of the notebook at `path` in a fresh kernel of this
    Python; fail with the failing cell's source and traceback if one raises.
    Returns the executed notebook."""
    nbformat = _need("nbformat")
    nbclient = _need("nbclient")
    _need("ipykernel")
    from nbclient.exceptions import CellExecutionError

    # A kernelspec named python3 that starts this interpreter: found first in
    # JUPYTER_PATH, so an installed python3 spec of another Python is not used.
    spec_dir = tmp_path / "jupyter" / "kernels" / "python3"
    spec_dir.mkdir(parents=True)
    (spec_dir / "kernel.json").write_text(json.dumps({
        "argv": [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"],
        "display_name": f"Python {sys.version_info.major}.{sys.version_info.minor} (tests)",
        "language": "python",
    }))
    monkeypatch.setenv("JUPYTER_PATH", str(tmp_path / "jupyter"))
    monkeypatch.setenv("JUPYTER_RUNTIME_DIR", str(tmp_path / "runtime"))
    monkeypatch.setenv("IPYTHONDIR", str(tmp_path / "ipython"))
    # The kernel imports cgraph from this checkout (its in-place build), and
    # finds whatever pytest found on PYTHONPATH (/tmp/site on the GPU machine).
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(
        p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p))

    nb = nbformat.read(path, as_version=4)
    for cell in nb.cells:  # a committed run's outputs: this run must make its own
        if cell.cell_type == "code":
            cell.outputs, cell.execution_count = [], None
    # record_timing=False: no per-cell timestamps in a notebook written to commit.
    client = nbclient.NotebookClient(
        nb, kernel_name="python3", timeout=CELL_TIMEOUT_S, record_timing=False,
        startup_timeout=STARTUP_TIMEOUT_S, resources={"metadata": {"path": str(ROOT)}})
    started = time.perf_counter()
    try:
        client.execute()
    except CellExecutionError as error:
        plain = re.sub(r"\x1b\[[0-9;]*m", "", str(error))  # the traceback's colours
        pytest.fail(f"{path.name}: a cell raised\n{plain}", pytrace=False)
    finally:
        out = os.environ.get("CGRAPH_NOTEBOOK_OUT")
        if out:  # also after a failing cell: its traceback is in the file
            pathlib.Path(out).parent.mkdir(parents=True, exist_ok=True)
            nbformat.write(nb, out)
            print(f"{path.name}: executed notebook written to {pathlib.Path(out).resolve()}")
    print(f"{path.name}: executed in {time.perf_counter() - started:.1f} s")
    return nb


def _outputs(nb):
    return [o for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", [])]


@pytest.mark.gpu
def test_quickstart_notebook_runs_end_to_end(tmp_path, monkeypatch):
    nb = execute(NOTEBOOK, tmp_path, monkeypatch)
    outputs = _outputs(nb)
    assert not [o for o in outputs if o.output_type == "error"]
    assert any("image/png" in o.get("data", {}) for o in outputs), "the plot is missing"
    text = "".join(o.get("text", "") for o in outputs if o.output_type == "stream")
    assert "kept their values" in text and "graphed2:" in text, text


def test_committed_notebook_is_valid_and_cleared_or_fully_run():
    """The committed notebook is nbformat 4, and either has its outputs
    cleared or holds those of one whole run (CGRAPH_NOTEBOOK_OUT): every
    code cell executed, in order, none raised, the plot embedded as a PNG
    (json alone; nbformat's schema check where nbformat is importable)."""
    raw = json.loads(NOTEBOOK.read_text())
    assert raw["nbformat"] == 4
    code = [cell for cell in raw["cells"] if cell["cell_type"] == "code"]
    counts = [cell["execution_count"] for cell in code]
    outputs = [o for cell in code for o in cell["outputs"]]
    if all(n is None for n in counts):
        assert outputs == [], "outputs without execution counts: clear them or rerun"
    else:
        assert None not in counts and counts == sorted(set(counts)), (
            f"execution counts {counts}: commit the outputs of one whole run "
            "(CGRAPH_NOTEBOOK_OUT), or clear them")
        errors = [o for o in outputs if o["output_type"] == "error"]
        assert not errors, f"a cell raised in the committed run: {errors[0]['ename']}"
        assert any("image/png" in o.get("data", {}) for o in outputs), "the plot is missing"
    try:
        import nbformat
    except ImportError:
        return
    nbformat.validate(nbformat.read(NOTEBOOK, as_version=4))
