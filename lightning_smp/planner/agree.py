"""The planner on every rank of a run at once: one budget for all, and one outcome for all.

Each rank plans alone from its own model (planning needs no collective), with the smallest rank's budget; then the
outcomes are compared. A rank that failed, or ranks that chose differently (their models or settings differ), fail
every rank with the same error, instead of leaving the others waiting in the first collective of a mesh. Used by
both strategies (:meth:`lightning_smp.core.HybridShardCore.choose_degree`) and by plain ``FSDP(...)`` calls under
:func:`lightning_smp.init`.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.nn import Module

from lightning_smp.collectives import Collectives
from lightning_smp.config import CALIBRATE
from lightning_smp.errors import HybridShardConfigError
from lightning_smp.planner.budget import default_budget
from lightning_smp.planner.calibrate import calibrate
from lightning_smp.planner.choose import plan
from lightning_smp.planner.result import Plan
from lightning_smp.sizes import parse_bytes


def plan_on_every_rank(module: Module, *, configured_budget: int | str | None, device: torch.device, local_ranks: int,
                       configured_links: str | None = None, **plan_kwargs: Any) -> Plan:
    """:func:`~.choose.plan` for ``module`` with ``plan_kwargs`` on every rank; the same :class:`Plan` everywhere.

    The budget is ``configured_budget``, else :func:`~.budget.default_budget` of ``device`` shared by
    ``local_ranks``; the smallest over the ranks is used. ``configured_links`` is a preset, a JSON file, or
    ``"calibrate"``: measured here on every rank (:func:`~.calibrate.calibrate`, which agrees on one figure).

    Raises:
        HybridShardConfigError: on every rank alike: nothing fits (the planner's own message), a rank could not
            plan (naming it), or the ranks chose different degrees.
    """
    collectives = Collectives.current(device)
    local = default_budget(device, local_ranks) if configured_budget is None else parse_bytes(configured_budget)
    budget = min(collectives.all_gather(local))
    links: Any = configured_links
    if configured_links == CALIBRATE:
        links = calibrate(plan_kwargs.get("devices_per_node"), device=device)
    chosen: Plan | None = None
    failure: Exception | None = None
    try:
        chosen = plan(module, budget_bytes=budget, device=device, links=links, **plan_kwargs)
    except Exception as err:  # noqa: BLE001  # every rank must learn of it, or the others hang; re-raised below
        failure = err
    outcomes = collectives.all_gather((None, str(failure)) if chosen is None else (chosen.degree, None))
    messages = [message for _, message in outcomes if message is not None]
    if messages:
        if failure is not None and len(messages) == len(outcomes) and len(set(messages)) == 1 and isinstance(
                failure, HybridShardConfigError):
            raise failure  # the same error on every rank (nothing fits): as it is
        rank = next(r for r, (_, message) in enumerate(outcomes) if message is not None)
        raise HybridShardConfigError(
            f"hybrid_shard_degree='auto' could not be planned on rank {rank}: {outcomes[rank][1]}"
        ) from failure
    if len({degree for degree, _ in outcomes}) > 1 or chosen is None:
        raise HybridShardConfigError(
            "hybrid_shard_degree='auto' chose different degrees on different ranks"
            f" ({[degree for degree, _ in outcomes]}, by rank): the model, its example input or the strategy's"
            " arguments differ between ranks. Fix: build the same model on every rank, or pass a number as"
            " hybrid_shard_degree."
        )
    return chosen


__all__ = ["plan_on_every_rank"]
