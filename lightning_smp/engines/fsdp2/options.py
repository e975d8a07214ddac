"""The arguments FSDP2 takes: the FSDP1 arguments it refuses, those passed through to ``fully_shard``, and the
Trainer's precision and offload settings as FSDP2's ``MixedPrecisionPolicy`` and ``OffloadPolicy``."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from lightning_smp.engines.base import ShardingPlan
from lightning_smp.errors import UnsupportedOptionError
from lightning_smp.names import HYBRID_SHARD_ZERO2, SHARD_GRAD_OP

#: FSDP1 arguments refused under FSDP2, each with what to do instead
FSDP1_ONLY = {
    "use_orig_params": "drop it: FSDP2 always keeps the original parameters (as DTensor shards)",
    "limit_all_gathers": "drop it: FSDP2 bounds in-flight all-gathers itself",
    "forward_prefetch": "drop it, or call FSDPModule.set_modules_to_forward_prefetch() on the wrapped modules",
    "backward_prefetch": "drop it, or call FSDPModule.set_modules_to_backward_prefetch() on the wrapped modules",
    "sync_module_states": "drop it: replicas always start from global rank 0's weights",
    "process_group": "pass hybrid_shard_degree or device_mesh instead (FSDP2 shards over a DeviceMesh)",
    "param_init_fn": "create the model under trainer.init_module(empty_init=True); modules are materialized with"
                     " reset_parameters()",
    "device_id": "drop it: the Trainer's devices decide",
    "ignored_modules": "pass ignored_params={...} (FSDP2's equivalent)",
    "ignored_states": "pass ignored_params={...} (FSDP2's equivalent)",
    "auto_wrap_policy_kwargs": "drop it",
    "reshard_after_forward": "choose sharding_strategy: HYBRID_SHARD reshards after forward, _HYBRID_SHARD_ZERO2"
                             " keeps parameters gathered until backward",
    "mesh": "pass device_mesh (or hybrid_shard_degree) to the strategy",
    "mp_policy": "pass mixed_precision=MixedPrecisionPolicy(...), or the Trainer's precision",
    "offload_policy": "pass cpu_offload=True or cpu_offload=CPUOffloadPolicy(...)",
}
#: ``fully_shard`` arguments passed through as they are
FSDP2_OPTIONS = ("shard_placement_fn", "ignored_params")


def check_options(options: Mapping[str, Any], mixed_precision: Any, cpu_offload: Any) -> None:
    """Refuse every argument ``fully_shard`` does not take, naming its FSDP2 equivalent."""
    for key in options:
        if key in FSDP1_ONLY:
            raise UnsupportedOptionError(
                f"{key}={options[key]!r} is an FSDP1 argument that fsdp_version=2 (fully_shard) does not take."
                f" Fix: {FSDP1_ONLY[key]}."
            )
        if key not in (*FSDP2_OPTIONS, "auto_wrap_policy"):
            raise UnsupportedOptionError(
                f"{key}={options[key]!r} is not an argument of fully_shard (fsdp_version=2). Arguments passed"
                f" through to it: {', '.join(FSDP2_OPTIONS)}. Fix: drop it, or use fsdp_version=1."
            )
    if mixed_precision is not None and type(mixed_precision).__name__ != "MixedPrecisionPolicy":
        raise UnsupportedOptionError(
            f"mixed_precision={type(mixed_precision).__name__}(...) is an FSDP1 config; fsdp_version=2 takes a"
            " torch.distributed.fsdp.MixedPrecisionPolicy. Fix: pass MixedPrecisionPolicy(param_dtype=...,"
            " reduce_dtype=...), or only the Trainer's precision."
        )
    if not isinstance(cpu_offload, (bool, type(None))) and type(cpu_offload).__name__ not in (
            "CPUOffload", "CPUOffloadPolicy", "OffloadPolicy"):
        raise UnsupportedOptionError(
            f"cpu_offload={cpu_offload!r} is not an offload config. Fix: pass True, or CPUOffloadPolicy(...)."
        )


def shard_kwargs(plan: ShardingPlan) -> dict[str, Any]:
    """What every ``fully_shard`` call for ``plan`` is given (the root's ``reshard_after_forward`` aside)."""
    kwargs: dict[str, Any] = {
        "reshard_after_forward": plan.layout.sharding_strategy not in (HYBRID_SHARD_ZERO2, SHARD_GRAD_OP),
        "mp_policy": _mixed_precision_policy(plan),
        "offload_policy": _offload_policy(plan),
        **{k: v for k, v in plan.options.items() if k in FSDP2_OPTIONS},
    }
    if plan.mesh is not None:
        kwargs["mesh"] = plan.mesh
    return kwargs


def _mixed_precision_policy(plan: ShardingPlan) -> Any:
    """The ``MixedPrecisionPolicy`` for ``plan``: the user's, else the Trainer's precision mapped to FSDP2."""
    from torch.distributed.fsdp import MixedPrecisionPolicy

    if isinstance(plan.mixed_precision, MixedPrecisionPolicy):
        return plan.mixed_precision
    # "*-mixed": parameters gathered and computed in low precision, gradients reduced in fp32 (FSDP2's recommended
    # setting; the sharded parameters and optimizer state stay fp32). "*-true" and "32-true": the module itself has
    # the dtype (the precision plugin converts it), nothing is cast.
    low = {"bf16-mixed": torch.bfloat16, "16-mixed": torch.float16}.get(plan.precision)
    if low is None:
        return MixedPrecisionPolicy()
    return MixedPrecisionPolicy(param_dtype=low, reduce_dtype=torch.float32)


def _offload_policy(plan: ShardingPlan) -> Any:
    from torch.distributed.fsdp import CPUOffloadPolicy, OffloadPolicy

    offload = plan.cpu_offload
    if isinstance(offload, OffloadPolicy):
        return offload
    if offload is not None and getattr(offload, "offload_params", False):
        # pinned memory needs an accelerator: a CPU-only build of torch refuses pin_memory=True
        return CPUOffloadPolicy(pin_memory=plan.device.type != "cpu")
    return OffloadPolicy()


__all__ = ["FSDP1_ONLY", "FSDP2_OPTIONS", "check_options", "shard_kwargs"]
