"""``make demo`` (``examples/demo.py``): what a newcomer sees first."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_demo_prints_the_mesh_one_memory_table_and_one_filled_communication_table(tmp_path: Path) -> None:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "COLUMNS": "200"}
    done = subprocess.run([sys.executable, str(REPO / "examples" / "demo.py"), "--max-steps", "4"], cwd=tmp_path,
                          env=env, capture_output=True, text=True, timeout=280)
    out = done.stdout + done.stderr
    assert done.returncode == 0, out[-3000:]
    assert "shard groups (all-gather / reduce-scatter inside): [0, 1]  [2, 3]" in out
    assert "replicate groups (1/2 gradient all-reduce across): [0, 2]  [1, 3]" in out
    assert out.count("Memory per rank at") == 1 and "Memory per rank at fit_end (step 4)" in out
    assert out.count("Collectives per rank in one optimizer step") == 1
    comm = out[out.index("Collectives per rank in one optimizer step"):]
    rows = [line for line in comm.splitlines() if re.match(r"^│\s+\d+ │", line)]
    assert len(rows) >= 4 * 3  # every rank: replicate all-reduce, shard all-gather and reduce-scatter
    assert not [row for row in rows if re.search(r"│\s+-\s+│", row)], "a communication cell is empty"
    # the progress bar counts the steps of one epoch, not "Epoch 0/-2"
    assert "Epoch 0/0" in out and "/-2" not in out
    assert (tmp_path / "lightning_logs" / "demo" / "memory_report.json").is_file()


def _fabric_train(tmp_path: Path, *args: str) -> str:
    tmp_path.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "COLUMNS": "200"}
    done = subprocess.run([sys.executable, str(REPO / "examples" / "fabric_train.py"), "--out", str(tmp_path / "out"),
                           *args], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=280)
    out = done.stdout + done.stderr
    assert done.returncode == 0, out[-3000:]
    return out


def _losses(out: str) -> dict[int, float]:
    return {int(step): float(loss) for step, loss in re.findall(r"^step (\d+): loss ([0-9.]+)$", out, re.MULTILINE)}


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_fabric_example_trains_saves_and_resumes_exactly(tmp_path: Path) -> None:
    """examples/fabric_train.py on 4 CPU ranks (Fabric's script launcher): the report after the first step, sharded
    checkpoints, and a resumed run whose losses continue the uninterrupted run's."""
    whole = _fabric_train(tmp_path / "whole", "--max-steps", "6", "--save-every", "3")
    assert "Memory per rank at manual (step 1)" in whole and "defer_all_reduce" in whole
    assert sorted(p.name for p in (tmp_path / "whole" / "out").iterdir()) == ["last", "step-000003", "step-000006"]
    first = _fabric_train(tmp_path / "parts", "--max-steps", "3", "--save-every", "3")
    resumed = _fabric_train(tmp_path / "parts", "--max-steps", "6", "--save-every", "3", "--resume")
    assert "at step 3" in resumed
    assert _losses(first) == {k: v for k, v in _losses(whole).items() if k <= 3}
    assert _losses(resumed) == {k: v for k, v in _losses(whole).items() if k > 3}
