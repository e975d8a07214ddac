"""Starting ranks by fork or spawn, for both front ends (the Trainer's launcher and Fabric's): the start method
checked before any process starts, fork safety, and a library error that ended a rank raised again, as the same type,
in the launching process."""

from __future__ import annotations

from collections.abc import Generator
from contextlib import contextmanager

import torch
import torch.multiprocessing as mp
from lightning.fabric.strategies.launchers.multiprocessing import _check_bad_cuda_fork
from lightning.fabric.utilities.imports import _IS_INTERACTIVE

from lightning_smp import errors
from lightning_smp.errors import HybridShardConfigError, LightningSMPError


def check_start_method(start_method: str) -> None:
    """Raise :class:`HybridShardConfigError` if ``start_method`` cannot start processes on this platform."""
    available = mp.get_all_start_methods()
    if start_method in available:
        return
    where = "a notebook or IPython" if _IS_INTERACTIVE else "this session"
    raise HybridShardConfigError(
        f"start_method={start_method!r} is not available on this platform (available: {', '.join(available)})."
        f" HybridShardFSDPStrategy can train several processes from {where} only by forking."
        " Fix: run the training as a script (start_method='popen', the default outside notebooks), or pass"
        " start_method='spawn' from a script whose entry point is guarded by `if __name__ == '__main__':`."
    )


def check_fork_safety(device_type: str, start_method: str) -> None:
    """Raise :class:`HybridShardConfigError` if forking now would hand the ranks an unusable accelerator context.

    A process that has initialised CUDA (or another accelerator runtime) cannot pass it to forked children:
    they fail on their first use of the device, long after the fork. CPU ranks are unaffected.
    """
    if start_method not in ("fork", "forkserver"):
        return
    try:
        _check_bad_cuda_fork()
    except RuntimeError as err:
        why = "this process is itself a forked child"
        raise HybridShardConfigError(_bad_fork_message(start_method, "CUDA", why)) from err
    if device_type == "cpu":
        return
    module = getattr(torch, device_type, None)
    is_initialized = getattr(module, "is_initialized", None)
    if callable(is_initialized) and is_initialized():
        raise HybridShardConfigError(_bad_fork_message(start_method, device_type.upper(), "it was initialised here"))


def _bad_fork_message(start_method: str, runtime: str, why: str) -> str:
    return (
        f"HybridShardFSDPStrategy(start_method={start_method!r}) cannot fork the training processes: {runtime} is in"
        f" use in the notebook process ({why}), and forked processes cannot use it. Fix: restart the kernel and create"
        f" no {runtime} tensors or models before Trainer.fit (no `.cuda()`, `.to(device)` or `torch.cuda` calls that"
        " create a context); the strategy moves the model to each rank's device itself. In a script, use"
        " start_method='popen' (the default outside notebooks) instead."
    )


@contextmanager
def rank_errors_retyped() -> Generator[None, None, None]:
    """Around a fork/spawn launch (the Trainer's launcher and Fabric's alike): an error of this library raised inside
    a rank is raised here as the same type, as it would be in a script."""
    try:
        yield
    except mp.ProcessRaisedException as err:
        error = rank_error(str(err))
        if error is None:
            raise
        raise error from err


def rank_error(rank_traceback: str) -> LightningSMPError | None:
    """The library error that ended a rank, rebuilt from the traceback torch sends back (None for other errors)."""
    found: LightningSMPError | None = None
    position = -1
    for name in errors.__all__:
        cls = getattr(errors, name)
        prefix = f"{cls.__module__}.{cls.__qualname__}: "
        at = rank_traceback.rfind(prefix)
        if at > position:
            position, found = at, cls(rank_traceback[at + len(prefix):].strip())
    return found


__all__ = ["check_fork_safety", "check_start_method", "rank_error", "rank_errors_retyped"]
