"""Test oracles: what a rank should hold under FSDP1, written from the flat-parameter rules
(:mod:`lightning_smp.engines.fsdp1.flat`) independently of the library's measurement and of the planner, so that the
memory report and the planner are checked against arithmetic, not against themselves."""

from __future__ import annotations

from collections.abc import Sequence

from lightning_smp.engines.fsdp1.flat import flat_param_numel, local_param_numels, local_shard_numel


def rank_bytes(
    units: Sequence[Sequence[int]], shard_size: int, shard_rank: int, group_size: int | None = None,
    dtype_bytes: int = 4, state_tensors_per_element: int = 2, state_bytes_per_param: int = 4,
) -> dict[str, int]:
    """Bytes one rank holds under FSDP1 (``use_orig_params=True``) at the optimizer step, padding included.

    Args:
        units: the original parameters' element counts of every FSDP unit that owns parameters.
        shard_size: ranks a unit is sharded over (1 for ``NO_SHARD``).
        shard_rank: this rank's index in its shard group.
        group_size: FSDP's process group size (the world for ``NO_SHARD``); defaults to ``shard_size``.
        dtype_bytes: element size of parameters, gradients and optimizer state.
        state_tensors_per_element: optimizer state tensors shaped like the parameter (Adam/AdamW: 2, SGD with
            momentum: 1, plain SGD: 0).
        state_bytes_per_param: optimizer state bytes per parameter that do not scale with it (Adam's 0-d ``step``:
            4). Only parameters with at least one local element get state on this rank.

    Returns ``params_bytes``, ``grads_bytes`` (the local flat shard: padding included), ``optimizer_bytes`` and
    ``padding_bytes`` (padding inside this rank's parameter shard).
    """
    params = optimizer = padding = 0
    for numels in units:
        shard = local_shard_numel(numels, shard_size, group_size, dtype_bytes)
        local = local_param_numels(numels, shard_size, shard_rank, group_size, dtype_bytes)
        params += shard * dtype_bytes
        padding += (shard - sum(local)) * dtype_bytes
        optimizer += sum(n * state_tensors_per_element * dtype_bytes + state_bytes_per_param for n in local if n)
    return {"params_bytes": params, "grads_bytes": params, "optimizer_bytes": optimizer, "padding_bytes": padding}


def unsharded_bytes(
    units: Sequence[Sequence[int]], dtype_bytes: int = 4, state_tensors_per_element: int = 2,
    state_bytes_per_param: int = 4,
) -> dict[str, int]:
    """Bytes a DDP replica of the same model and optimizer holds: no sharding, no padding."""
    numels = [n for unit in units for n in unit]
    params = sum(numels) * dtype_bytes
    optimizer = sum(n * state_tensors_per_element * dtype_bytes + state_bytes_per_param for n in numels)
    return {"params_bytes": params, "grads_bytes": params, "optimizer_bytes": optimizer}


def floor_bytes(unsharded_total: int, shard_degree: int, padding_bytes: float = 0) -> float:
    """The least a rank can hold when everything is split ``shard_degree`` ways: ``unsharded / degree + padding``.

    ``padding_bytes`` is FSDP's share of padding per rank (parameters and gradients), which no sharding avoids.
    """
    return unsharded_total / max(shard_degree, 1) + padding_bytes


def padding_per_rank(units: Sequence[Sequence[int]], shard_size: int, group_size: int | None = None,
                     dtype_bytes: int = 4) -> float:
    """FSDP padding (alignment and group-size padding) per rank of one tensor kind, averaged over the shard group."""
    total = sum(flat_param_numel(n, group_size or shard_size, dtype_bytes) - sum(n) for n in units)
    return total * dtype_bytes / shard_size
