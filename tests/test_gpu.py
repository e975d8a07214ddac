"""The same test bodies on CUDA with NCCL; skipped on machines without enough GPUs."""

from __future__ import annotations

import pytest
import torch

from lightning_smp import HybridShardFSDPStrategy
from tests.helpers import TinyModel, fit_and_record
from tests.test_hybrid_training import CONFIGS, check_matches_ddp

GPUS = torch.cuda.device_count() if torch.cuda.is_available() else 0


@pytest.mark.gpu
@pytest.mark.timeout(600)
@pytest.mark.parametrize(("devices", "degree", "requested", "expected"), CONFIGS)
def test_hybrid_training_matches_ddp_on_cuda(tmp_path, devices, degree, requested, expected):
    if GPUS < devices:
        pytest.skip(f"needs {devices} CUDA GPUs, found {GPUS}")
    check_matches_ddp(tmp_path, devices, degree, requested, expected, accelerator="cuda")


@pytest.mark.gpu
@pytest.mark.timeout(600)
@pytest.mark.parametrize("backend", [None, "cuda:nccl,cpu:gloo"], ids=["nccl", "mixed_backend"])
def test_one_gpu_trains_with_bf16_mixed(tmp_path, backend):
    """What a single-GPU machine can check: the NCCL (or mixed) group, the mesh on "cuda", bf16 autocast."""
    if GPUS < 1:
        pytest.skip("needs a CUDA GPU")
    strategy = HybridShardFSDPStrategy(hybrid_shard_degree=1, start_method="spawn", process_group_backend=backend)
    torch.manual_seed(0)
    trainer = None
    trainer, _, records = fit_and_record(strategy, tmp_path, 1, model=TinyModel(), accelerator="cuda",
                                         precision="bf16-mixed", max_steps=3)
    assert records[0]["fsdp_strategy"] == "NO_SHARD"
    assert all(torch.isfinite(torch.tensor(records[0]["losses"])))
    assert trainer.strategy.root_device.type == "cuda"
