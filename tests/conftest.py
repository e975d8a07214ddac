import gc
import os
import sys
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")

import pytest  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

import lightning_smp  # noqa: E402  (registers the strategy names)
from lightning_smp import config as smp_config  # noqa: E402

#: Where `make install` puts transformers (the Makefile says why it is not in site-packages). The tests that train a
#: Hugging Face model run in this process or in ranks forked from it, which find it through this path; the processes
#: the tests start (scripts, torchrun, kernels) do not, and do not pay for importing it.
HUGGING_FACE = Path(sys.prefix) / "hugging-face"
if HUGGING_FACE.is_dir():
    sys.path.append(str(HUGGING_FACE))

_DIST_ENV = ("MASTER_ADDR", "MASTER_PORT", "RANK", "LOCAL_RANK", "WORLD_SIZE", "NODE_RANK", "GROUP_RANK",
             "PL_GLOBAL_SEED")
#: every place an SMP config can come from: none leaks in from the machine or out to the next test
_SMP_ENV = (smp_config.ENV_CONFIG, smp_config.ENV_SAGEMAKER, smp_config.ENV_CLI, smp_config.ENV_INIT,
            "TORCHFT_LIGHTHOUSE", "REPLICA_GROUP_ID", "NUM_REPLICA_GROUPS")


def _reset_smp_sources() -> None:
    lightning_smp.shutdown()
    for name in _SMP_ENV:
        os.environ.pop(name, None)
    smp_config.sources._env_layer_cached.cache_clear()


@pytest.fixture(autouse=True)
def _restore_process_state():
    """Every test starts without SMP sources and leaves no process group, env variable or thread change behind."""
    saved = {k: os.environ.get(k) for k in (*_DIST_ENV, *_SMP_ENV)}
    threads = torch.get_num_threads()
    _reset_smp_sources()
    yield
    _reset_smp_sources()
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
        # free what still holds the groups (a sharded model, a mesh) now: collected later inside a forked rank,
        # a gloo group's destructor waits for worker threads that did not survive the fork, and that rank hangs
        gc.collect()
    for key, value in saved.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value
    torch.set_num_threads(threads)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """The edit-loop tier, ``pytest -m "not slow"``, runs every test function once: its first parametrization (the
    first engine, backend, degree, ...); the others are marked ``slow`` here and run in the full suite (``make test``,
    CI), as do the tests marked ``slow`` by hand (script launchers, torchrun, scenario matrices)."""
    seen: set[tuple[str, str]] = set()
    for item in items:
        if getattr(item, "callspec", None) is None:
            continue
        function = (item.nodeid.split("::")[0], getattr(item, "originalname", item.name))
        if function in seen:
            item.add_marker(pytest.mark.slow)
        seen.add(function)
