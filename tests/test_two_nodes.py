"""Two "nodes" on this machine: two torchrun launches on loopback, 2 ranks each."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from lightning_smp import HybridShardFSDPStrategy, resolve_layout
from tests.helpers import fit_and_record, free_port

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "tests" / "scripts" / "two_node_train.py"


#: (degree, whether its shard groups stay inside a node) for 2 nodes x 2 ranks
CASES = [(2, True), (4, False)]
DEGREES = tuple(degree for degree, _ in CASES)


def _launch_two_nodes(degrees: tuple[int, ...], out: Path) -> None:
    port = free_port()
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    procs = [
        subprocess.Popen(
            [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc_per_node", "2",
             "--node_rank", str(node), "--master_addr", "127.0.0.1", "--master_port", str(port),
             str(SCRIPT), "--degrees", ",".join(map(str, degrees)), "--out", str(out)],
            env=env, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        )
        for node in (0, 1)
    ]
    try:
        outputs = [p.communicate(timeout=240)[0] for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    for node, (p, output) in enumerate(zip(procs, outputs)):
        assert p.returncode == 0, f"node {node} failed:\n{output[-4000:]}"


@pytest.fixture(scope="module")
def two_node_runs(tmp_path_factory) -> Path:
    """Every degree of ``DEGREES`` fitted by one two-node launch (the interpreters start once)."""
    out = tmp_path_factory.mktemp("two_nodes")
    _launch_two_nodes(DEGREES, out)
    return out


@pytest.mark.slow
@pytest.mark.timeout(400)
@pytest.mark.parametrize(("degree", "inside_a_node"), CASES, ids=["degree2_in_node", "degree4_spans"])
def test_two_nodes(two_node_runs, tmp_path, degree, inside_a_node):
    out = two_node_runs / f"degree{degree}"
    layout = resolve_layout(4, degree)
    nodes = {r: torch.load(out / f"node{r}.pt")["node_rank"] for r in range(4)}
    assert nodes == {0: 0, 1: 0, 2: 1, 3: 1}
    for rank in range(4):
        record = torch.load(out / "records" / f"rank{rank}.pt", weights_only=False)
        assert record["shard_group"] == layout.shard_group(rank)
        assert record["replicate_group"] == layout.replicate_group(rank)
        assert ({nodes[r] for r in record["shard_group"]} == {nodes[rank]}) is inside_a_node

    # the same training on one node of 4 ranks
    torch.manual_seed(0)
    _, model, single = fit_and_record(HybridShardFSDPStrategy(hybrid_shard_degree=degree, start_method="fork"),
                                      tmp_path / "single", 4)
    two_node = torch.load(out / "weights.pt")
    for key, value in model.state_dict().items():
        assert torch.allclose(two_node[key], value, atol=1e-6, rtol=0), key
    two_node_losses = torch.load(out / "records" / "rank0.pt", weights_only=False)["losses"]
    assert max(abs(a - b) for a, b in zip(two_node_losses, single[0]["losses"])) <= 1e-6
