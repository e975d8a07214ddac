"""Which submodules ``auto_wrap_policy`` makes units of: FSDP1's walk of the policy, which FSDP2's ``fully_shard``
units follow too (:mod:`lightning_smp.engines.fsdp2.wrap`) and each engine's prediction gives the planner
(``Prediction.units_of``)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

from torch.nn import Module

from lightning_smp.errors import UnsupportedOptionError


def wrap_targets(module: Module, policy: Any) -> list[Module]:
    """The submodules of ``module`` that ``auto_wrap_policy`` selects, innermost first (the order ``fully_shard``
    must be applied in), the root excluded.

    ``policy`` is what FSDP1 and Lightning accept: ``None``, a set (or list, tuple) of layer classes, a
    ``ModuleWrapPolicy`` / ``CustomPolicy``, or a callable ``policy(module, recurse, nonwrapped_numel)`` such as
    ``functools.partial(size_based_auto_wrap_policy, min_num_params=...)``; a callable is walked exactly as FSDP1's
    ``_recursive_wrap`` walks it.
    """
    if policy is None:
        return []
    if isinstance(policy, (set, frozenset, list, tuple)):
        classes = tuple(policy)
        return [m for m in _post_order(module) if m is not module and isinstance(m, classes)]
    from torch.distributed.fsdp.wrap import _Policy

    if isinstance(policy, _Policy):
        chosen = policy._run_policy(module, ignored_modules=set(), root_kwargs={})
        return [m for m in _post_order(module) if m is not module and m in chosen]
    if callable(policy):
        chosen_list: list[Module] = []
        _walk_callable(module, policy, chosen_list)
        return [m for m in chosen_list if m is not module]
    raise UnsupportedOptionError(
        f"auto_wrap_policy={policy!r} is not a wrapping policy. Fix: pass a set of layer classes (e.g. {{Block}}),"
        " a ModuleWrapPolicy, or an FSDP1-style callable policy."
    )


class PolicyUnits:
    """``Prediction.units_of`` of an engine whose units are what ``auto_wrap_policy`` selects (:func:`wrap_targets`):
    FSDP1's and FSDP2's; the DDP engine's too, whose buckets the planner times per the same modules. A prediction
    lists it among its bases."""

    def units_of(self, model: Module, auto_wrap_policy: Any) -> list[Module]:
        return wrap_targets(model, auto_wrap_policy)


def _post_order(module: Module) -> Iterator[Module]:
    for child in module.children():
        yield from _post_order(child)
    yield module


def _walk_callable(module: Module, policy: Callable[..., bool], chosen: list[Module]) -> int:
    # FSDP1's _recursive_wrap: a module is asked with recurse=True whether to look inside, then (with the
    # parameters its chosen descendants do not already cover) whether to wrap it; returns the parameters covered
    numel = sum(p.numel() for p in module.parameters())
    if not policy(module=module, recurse=True, nonwrapped_numel=numel):
        return 0
    covered = sum(_walk_callable(child, policy, chosen) for child in module.children())
    if policy(module=module, recurse=False, nonwrapped_numel=numel - covered):
        chosen.append(module)
        return numel
    return covered


__all__ = ["PolicyUnits", "wrap_targets"]
