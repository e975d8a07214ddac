"""FSDP1's flat-parameter arithmetic, as pure functions: how many elements each rank holds.

FSDP flattens the parameters of one unit into a ``FlatParameter``. With ``use_orig_params=True`` (Lightning's
default) each parameter starts at a 16-byte aligned offset, and the total is padded to a multiple of the
shard group size so that every rank holds an equal chunk. Under ``NO_SHARD`` a rank holds the whole padded
flat parameter.
"""

from __future__ import annotations

from collections.abc import Sequence

#: FSDP aligns original parameters inside the flat parameter to this many bytes (use_orig_params=True).
ALIGNMENT_BYTES = 16


def flat_param_numel(param_numels: Sequence[int], group_size: int, dtype_bytes: int = 4, aligned: bool = True) -> int:
    """Elements of one FSDP unit's unsharded ``FlatParameter``, padding included.

    Args:
        param_numels: element counts of the unit's own parameters, in registration order.
        group_size: ranks FSDP shards over (the shard group; for ``NO_SHARD`` the whole world).
        dtype_bytes: element size of the forward/backward dtype (4 for fp32, 2 for bf16 mixed precision).
        aligned: ``use_orig_params=True`` (alignment padding and group-size padding) or ``False`` (neither).
    """
    if not aligned:
        return sum(param_numels)
    align = ALIGNMENT_BYTES // dtype_bytes
    total = 0
    for numel in param_numels:
        total += (-total) % align
        total += numel
    return total + (-total) % group_size


def local_shard_numel(
    param_numels: Sequence[int], shard_size: int, group_size: int | None = None, dtype_bytes: int = 4,
    aligned: bool = True,
) -> int:
    """Elements one rank holds of one FSDP unit: the padded flat parameter divided over ``shard_size`` ranks.

    ``group_size`` is the size of FSDP's process group (defaults to ``shard_size``; under ``NO_SHARD`` it is the
    whole world while ``shard_size`` is 1).
    """
    total = flat_param_numel(param_numels, group_size or shard_size, dtype_bytes, aligned)
    return -(-total // shard_size)


# ---------------------------------------------------------------------------------------------- bytes and floors


def param_offsets(param_numels: Sequence[int], dtype_bytes: int = 4, aligned: bool = True) -> list[int]:
    """Start offset (in elements) of each parameter inside the unsharded flat parameter."""
    align = ALIGNMENT_BYTES // dtype_bytes if aligned else 1
    offsets, total = [], 0
    for numel in param_numels:
        total += (-total) % align
        offsets.append(total)
        total += numel
    return offsets


def local_param_numels(
    param_numels: Sequence[int], shard_size: int, shard_rank: int, group_size: int | None = None,
    dtype_bytes: int = 4, aligned: bool = True,
) -> list[int]:
    """Elements of each original parameter that rank ``shard_rank`` of its shard group holds (0 when none).

    This is the size of the view FSDP gives each original parameter (``use_orig_params=True``) and so the size of
    per-element optimizer state such as Adam's ``exp_avg``.
    """
    chunk = local_shard_numel(param_numels, shard_size, group_size, dtype_bytes, aligned)
    start, stop = shard_rank * chunk, (shard_rank + 1) * chunk
    return [
        max(0, min(stop, offset + numel) - max(start, offset))
        for offset, numel in zip(param_offsets(param_numels, dtype_bytes, aligned), param_numels)
    ]


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
