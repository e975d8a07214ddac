"""Activation memory of one micro-batch: measured by tracing it without real memory, or estimated analytically.

:func:`measure_activations` runs one forward and backward of a meta-device copy of the model on fake tensors
(``FakeTensorMode``), under torch's memory tracker (``torch.distributed._tools.mem_tracker.MemTracker``), and takes
the largest sum of what the tracker calls activations and temporaries (saved tensors, gradients of activations,
recomputation under activation checkpointing) at any moment. Nothing is allocated, so a 70B model's micro-batch is
traced on a laptop; the model itself is never copied with its data (the copy's tensors are meta). Activations do not
depend on the degree (every rank runs its own micro-batch on the whole model, unit by unit), so one trace serves
every candidate.

:func:`transformer_activation_bytes` is the analytic estimate for a transformer given only its shape, from
Korthikanti et al., "Reducing Activation Recomputation in Large Transformer Models" (MLSys 2023), section 4:
``s * b * h * (34 + 5 * a * s / h)`` bytes per layer with 16-bit activations (``34 s b h`` with fused attention,
which never stores the ``s x s`` scores), and ``2 * s * b * h`` per layer (the layer's input) under full activation
checkpointing, plus one layer's worth recomputed in backward.
"""

from __future__ import annotations

import contextlib
import copy
import gc
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch.distributed._tools.mem_tracker import MemTracker, _MemRefType
from torch.nn import Module

from lightning_smp.autocast import autocast_context
from lightning_smp.errors import HybridShardConfigError


class ActivationTracker(MemTracker):
    """The tracker, also keeping the timeline of activations + temporaries (its own peak is of the total) and
    the parameter gradients among the temporaries: a gradient is a temporary from its creation until autograd
    accumulates it (the tracker then relabels it a gradient). Under FSDP that moment is the unit's unsharded
    gradient, which the planner counts with the unit, so it is left out here."""

    def __init__(self, collect_before_allocation: bool = False) -> None:
        super().__init__()
        #: fake tensors are held by reference cycles that real ones do not have (activation checkpointing's discarded
        #: forward outputs among them), so they are freed whenever the collector happens to run, and the peak would
        #: depend on the process's garbage-collection history. Collected before each allocation, they are freed
        #: where refcounting frees real tensors (a real run measures the same peak); real tensors need none of it
        self.collect_before_allocation = collect_before_allocation
        self.timeline: list[int] = []
        self.added_at: dict[int, int] = {}
        self.gradient_windows: list[tuple[int, int, int]] = []

    def _update_snap(self, u_type: Any, winfo: Any, *args: Any, **kwargs: Any) -> None:  # every change passes here
        if self.collect_before_allocation and u_type.name == "ADD":
            gc.collect()
        super()._update_snap(u_type, winfo, *args, **kwargs)
        self.timeline.append(sum(sum(snap.get(c, 0) for c in (_MemRefType.ACT, _MemRefType.TEMP))
                                 for snap in self._curr_mem_snap.values()))
        now = len(self.timeline) - 1
        if u_type.name == "ADD":
            self.added_at[id(winfo)] = now
        elif u_type.name == "REF" and winfo.reftype == _MemRefType.GRAD and id(winfo) in self.added_at:
            self.gradient_windows.append((self.added_at.pop(id(winfo)), now, winfo.mem_consumed))

    def peak(self) -> int:
        """The largest activations + temporaries at any moment, parameter gradients in flight left out."""
        delta = [0] * (len(self.timeline) + 1)
        for start, end, size in self.gradient_windows:  # a temporary over [start, end)
            delta[start] += size
            delta[end] -= size
        peak, in_flight = 0, 0
        for value, change in zip(self.timeline, delta):
            in_flight += change
            peak = max(peak, value - in_flight)
        return peak


@contextlib.contextmanager
def _only_new_objects_collected() -> Iterator[None]:
    """The tracker collects garbage before every allocation: with everything older than the trace frozen
    (``gc.freeze``), each collection looks at the trace's own objects only, not at the whole process."""
    gc.collect()
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()


def _meta_copy(model: Module) -> Module:
    """A structural copy of ``model`` whose parameters and buffers are meta tensors (no data is copied)."""
    memo: dict[int, Any] = {}
    for p in model.parameters():
        memo[id(p)] = torch.nn.Parameter(torch.empty_like(p, device="meta"), requires_grad=p.requires_grad)
    for b in model.buffers():
        memo[id(b)] = torch.empty_like(b, device="meta")
    return copy.deepcopy(model, memo)


def _default_step(model: Module, batch: Any) -> torch.Tensor:
    """The model's output summed, for an input given as Lightning's ``example_input_array`` may be: a tensor, a tuple
    of positional inputs or a dict of keyword inputs."""
    if isinstance(batch, tuple):
        out = model(*batch)
    elif isinstance(batch, dict):
        out = model(**batch)
    else:
        out = model(batch)
    if isinstance(out, dict):
        out = out.get("loss", next(iter(out.values())))
    if isinstance(out, (tuple, list)):
        out = out[0]
    return out.float().sum()


def _fake_like(value: Any, device: torch.device) -> Any:
    if isinstance(value, torch.Tensor):
        return torch.zeros(value.shape, dtype=value.dtype, device=device)  # inside FakeTensorMode: fake
    if isinstance(value, (tuple, list)):
        return type(value)(_fake_like(v, device) for v in value)
    if isinstance(value, dict):
        return {k: _fake_like(v, device) for k, v in value.items()}
    return value


@dataclass(frozen=True)
class MicroBatchTrace:
    """One micro-batch traced on fake tensors: its activation peak (bytes) and FLOPs (forward, and backward with any
    recomputation of activation checkpointing), counted by ``torch.utils.flop_counter.FlopCounterMode``."""

    activation_bytes: int
    forward_flops: int
    backward_flops: int


def measure_activations(model: Module, example_input: Any, *, step: Callable[[Module, Any], torch.Tensor] | None = None,
                        device: torch.device | str = "cpu", precision: str = "32-true",
                        checkpoint: Callable[[Module], None] | None = None) -> int:
    """Peak bytes of activations and temporaries of one forward and backward of ``example_input``
    (:func:`trace_micro_batch`'s ``activation_bytes``)."""
    return trace_micro_batch(model, example_input, step=step, device=device, precision=precision,
                             checkpoint=checkpoint).activation_bytes


def trace_micro_batch(model: Module, example_input: Any, *, step: Callable[[Module, Any], torch.Tensor] | None = None,
                      device: torch.device | str = "cpu", precision: str = "32-true",
                      checkpoint: Callable[[Module], None] | None = None) -> MicroBatchTrace:
    """One forward and backward of ``example_input`` (one rank's micro-batch: a tensor, a tuple of positional inputs,
    or whatever ``step`` takes) on fake tensors: the peak bytes of activations and temporaries, and the FLOPs.

    Args:
        model: the model, on any device (the meta device included); it is neither copied with data nor changed.
        step: ``step(model, batch) -> loss``; default: the model called on the batch (a tuple: positional inputs, a
            dict: keyword inputs), its output summed (the first element of a tuple, the ``"loss"`` of a dict).
        device: the device the activations will live on (its type matters for autocast).
        precision: a Lightning precision string; ``*-mixed`` traces under autocast of ``device``'s type.
        checkpoint: applied to the copy before tracing, e.g. the strategy's activation checkpointing.
    """
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.utils.flop_counter import FlopCounterMode

    device = torch.device(device)
    copy_ = _meta_copy(model)
    if checkpoint is not None:
        checkpoint(copy_)

    with _only_new_objects_collected(), FakeTensorMode():
        # factory calls take shapes only, so the meta tensors never meet the fake mode
        copy_._apply(lambda t: torch.empty(t.shape, dtype=t.dtype, device=device))
        batch = _fake_like(example_input, device)
        tracker = ActivationTracker(collect_before_allocation=True)
        tracker.track_external(copy_)
        flops = FlopCounterMode(display=False)
        try:
            with tracker, flops, autocast_context(precision, device.type) or contextlib.nullcontext():
                loss = (step or _default_step)(copy_, batch)
                forward = flops.get_total_flops()
                loss.backward()
        except (RuntimeError, TypeError, ValueError) as err:
            raise HybridShardConfigError(
                f"example_input could not be traced through {type(model).__name__} on fake tensors: {err}. Fix: pass"
                " an example input (or a step function) the model accepts, or activation_bytes= instead."
            ) from err
    return MicroBatchTrace(int(tracker.peak()), int(forward), int(flops.get_total_flops() - forward))


def transformer_activation_bytes(*, layers: int, hidden: int, heads: int, seq_len: int, micro_batch: int,
                                 checkpointing: bool = False, bytes_per_value: int = 2,
                                 attention_scores: bool = False) -> int:
    """Korthikanti et al.'s activation memory of a transformer for one micro-batch (see the module docstring),
    scaled from 16-bit to ``bytes_per_value``.

    ``attention_scores``: the ``5 a s / h`` term, the softmax inputs and outputs and their dropout mask, which only
    an attention that materialises the ``s x s`` scores keeps; fused attention (``scaled_dot_product_attention``'s
    flash and memory-efficient kernels, the default of current training stacks) recomputes them in backward, the
    paper's "selective recomputation", leaving ``34 s b h`` per layer.
    """
    s, b, h, a = seq_len, micro_batch, hidden, heads
    per_layer = s * b * h * (34 + (5 * a * s / h if attention_scores else 0))
    scale = bytes_per_value / 2
    if checkpointing:
        return int((layers * 2 * s * b * h + per_layer) * scale)  # the layer inputs, and one layer recomputed
    return int(layers * per_layer * scale)


__all__ = ["ActivationTracker", "MicroBatchTrace", "measure_activations", "trace_micro_batch",
           "transformer_activation_bytes"]
