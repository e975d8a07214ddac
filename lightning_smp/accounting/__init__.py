"""What a rank holds and sends: measurement (:mod:`.memory`), textbook figures (:mod:`.comm`), collective
counting (:mod:`.counter`), FSDP1's shard arithmetic (:mod:`.shards`) and the table renderer (:mod:`.render`). No
Lightning here: the memory callback (:mod:`lightning_smp.callbacks.memory`) and the benchmarks only call these."""

from lightning_smp.accounting.counter import CommCounter
from lightning_smp.accounting.memory import (
    MEMORY_FIELDS,
    PEAK_FIELDS,
    comm_groups,
    gradient_bytes,
    measure_memory,
    peak_memory,
    shard_layout,
    textbook,
)
from lightning_smp.accounting.render import format_report, print_report
from lightning_smp.accounting.report import count_communication, memory_report
from lightning_smp.engines.textbook import (
    OPS,
    CommFigure,
    FSDPUnitSpec,
    ddp_step_textbook,
    fsdp_step_textbook,
    ring_bytes,
)

__all__ = [
    "MEMORY_FIELDS",
    "OPS",
    "PEAK_FIELDS",
    "CommCounter",
    "CommFigure",
    "FSDPUnitSpec",
    "comm_groups",
    "count_communication",
    "ddp_step_textbook",
    "format_report",
    "fsdp_step_textbook",
    "gradient_bytes",
    "measure_memory",
    "memory_report",
    "peak_memory",
    "print_report",
    "ring_bytes",
    "shard_layout",
    "textbook",
]
