"""The planner: what every rank will hold and send at each degree, and the degree to choose.

- :mod:`.state`: the model state of every rank, exact, from the parameter shapes (meta-device models);
- :mod:`.activations`: one micro-batch's activations, traced on fake tensors, or Korthikanti et al.'s estimate;
- :mod:`.links`: link presets and the alpha-beta time of a step's collectives;
- :mod:`.calibrate`: the links and the compute of the running job, measured;
- :mod:`.timing`: one optimizer step's predicted time;
- :mod:`.budget`: memory budgets (``"40GB"``) and the default one of a device;
- :mod:`.choose`: :func:`plan`, every candidate's figures and the recommendation;
- :mod:`.result`: what it returns, :class:`Plan` and :class:`DegreePlan`, with the table and the reason.
"""

from lightning_smp.links import DEFAULT_PRESET, LINK_PRESETS, Links, links_for, load_links, save_links
from lightning_smp.planner.activations import measure_activations, transformer_activation_bytes
from lightning_smp.planner.budget import default_budget
from lightning_smp.planner.calibrate import calibrate
from lightning_smp.planner.choose import plan
from lightning_smp.planner.result import DegreePlan, Plan
from lightning_smp.planner.state import (
    OPTIMIZER_STATE,
    RankState,
    fsdp_units,
    model_state,
    optimizer_name,
    optimizer_state_layout,
)
from lightning_smp.planner.timing import StepTime, step_time
from lightning_smp.sizes import parse_bytes

__all__ = [
    "DEFAULT_PRESET",
    "LINK_PRESETS",
    "OPTIMIZER_STATE",
    "DegreePlan",
    "Links",
    "Plan",
    "RankState",
    "StepTime",
    "calibrate",
    "default_budget",
    "fsdp_units",
    "links_for",
    "load_links",
    "measure_activations",
    "model_state",
    "optimizer_name",
    "optimizer_state_layout",
    "parse_bytes",
    "plan",
    "save_links",
    "step_time",
    "transformer_activation_bytes",
]
