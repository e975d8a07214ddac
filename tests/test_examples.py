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
