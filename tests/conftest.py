import os

os.environ.setdefault("OMP_NUM_THREADS", "1")

import pytest  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

import lightning_smp  # noqa: E402,F401  (registers the strategy names)

_ENV_KEYS = ("MASTER_ADDR", "MASTER_PORT", "RANK", "LOCAL_RANK", "WORLD_SIZE", "NODE_RANK", "GROUP_RANK",
             "LIGHTNING_SMP_CONFIG", "SM_HP_MP_PARAMETERS", "PL_GLOBAL_SEED")


@pytest.fixture(autouse=True)
def _restore_distributed_state():
    """Every test leaves no process group, no distributed environment variables and no thread change behind."""
    saved = {k: os.environ.get(k) for k in _ENV_KEYS}
    threads = torch.get_num_threads()
    yield
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
    for key, value in saved.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value
    torch.set_num_threads(threads)
