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
