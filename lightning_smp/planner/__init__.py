"""The planner: what every rank will hold and send at each degree, and the degree to choose.

- :mod:`.state`: the model state of every rank, exact, from the parameter shapes (meta-device models);
- :mod:`.activations`: one micro-batch's activations, traced on fake tensors, or Korthikanti et al.'s estimate;
- :mod:`.links`: link presets and the alpha-beta time of a step's collectives;
- :mod:`.budget`: memory budgets (``"40GB"``) and the default one of a device;
- :mod:`.choose`: :func:`plan`, every candidate's figures and the recommendation.
"""

from lightning_smp.planner.activations import measure_activations, transformer_activation_bytes
from lightning_smp.planner.budget import default_budget, parse_bytes
from lightning_smp.planner.choose import DegreePlan, Plan, plan
from lightning_smp.planner.links import DEFAULT_PRESET, LINK_PRESETS, Links, links_for
from lightning_smp.planner.state import (
    OPTIMIZER_STATE,
    RankState,
    fsdp_units,
    model_state,
    optimizer_name,
    optimizer_state_layout,
)

__all__ = [
    "DEFAULT_PRESET",
    "LINK_PRESETS",
    "OPTIMIZER_STATE",
    "DegreePlan",
    "Links",
    "Plan",
    "RankState",
    "default_budget",
    "fsdp_units",
    "links_for",
    "measure_activations",
    "model_state",
    "optimizer_name",
    "optimizer_state_layout",
    "parse_bytes",
    "plan",
    "transformer_activation_bytes",
]
