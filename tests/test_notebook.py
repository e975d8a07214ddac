"""``examples/hybrid_sharding.ipynb`` is stored without outputs and runs top to bottom in a real Jupyter kernel."""

from __future__ import annotations

import os
from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient

NOTEBOOK = Path(__file__).resolve().parents[1] / "examples" / "hybrid_sharding.ipynb"
#: Per-cell limit; the slowest cell (three short fits of 4 ranks) takes a few seconds on 2 CPU cores.
CELL_TIMEOUT = 240


def _code_cells(notebook: nbformat.NotebookNode) -> list[nbformat.NotebookNode]:
    return [cell for cell in notebook.cells if cell.cell_type == "code"]


def _cell(notebook: nbformat.NotebookNode, marker: str) -> nbformat.NotebookNode:
    (cell,) = [cell for cell in _code_cells(notebook) if marker in cell.source]
    return cell


def _text(cell: nbformat.NotebookNode) -> str:
    parts = []
    for output in cell.outputs:
        if output.output_type == "stream":
            parts.append(output.text)
        elif "data" in output:
            parts.append(output.data.get("text/plain", ""))
    return "".join(parts)


def test_notebook_is_stored_without_outputs() -> None:
    notebook = nbformat.read(NOTEBOOK, as_version=4)
    nbformat.validate(notebook)
    cells = _code_cells(notebook)
    assert cells
    for cell in cells:
        assert cell.outputs == [] and cell.execution_count is None, cell.source[:80]
    assert notebook.metadata.kernelspec.name == "python3"


@pytest.mark.timeout(2 * CELL_TIMEOUT)
def test_notebook_runs_top_to_bottom_in_a_real_kernel(tmp_path: Path) -> None:
    notebook = nbformat.read(NOTEBOOK, as_version=4)
    # 4 ranks on few cores: one thread each, as Lightning's launcher would choose without a limit
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    client = NotebookClient(notebook, kernel_name="python3", timeout=CELL_TIMEOUT,
                            resources={"metadata": {"path": str(tmp_path)}})
    client.execute(env=env)  # raises CellExecutionError on the first failing cell

    errors = [o for cell in _code_cells(notebook) for o in cell.outputs if o.output_type == "error"]
    assert errors == []
    # the kernel is an interactive session: the strategy forked the ranks by itself
    assert "ranks are started by fork" in _text(_cell(notebook, "trainer.fit(model, datamodule)"))
    assert "rank 1: shards with ranks [0, 1], replicates with ranks [1, 3]" in _text(_cell(notebook, "resolve_layout("))
    # results usable in the next cell (the cell itself asserts that the trained weights beat untrained ones)
    assert "global_step=16" in _text(_cell(notebook, "val_loss"))
    assert "Memory per rank at fit_end (step 16)" in _text(_cell(notebook, "print_report(memory.report)"))
    degrees = _cell(notebook, "for degree in (1, 2, 4)")
    assert any("image/png" in o.get("data", {}) for o in degrees.outputs)
    summary = _text(degrees)
    assert "degree 1:" in summary and "50% saved" in summary and "75% saved" in summary
    assert "now at global_step=24" in _text(_cell(notebook, "ckpt_path=path"))
    assert "replica_sync every 4, overlapped 2 steps, int8: global_step=10" in _text(_cell(notebook, "replica_sync={"))
    # the cell prints the library's error (its message is asserted in tests/test_degree.py)
    assert "HybridShardConfigError: hybrid_shard_degree=3 " in _text(_cell(notebook, "hybrid_shard_degree=3"))
    # everything the notebook wrote went to its temporary directory, which its last cell removed
    assert list(tmp_path.iterdir()) == []
