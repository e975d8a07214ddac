"""Parameters that take no part in some micro-batches of an accumulation window, or on some ranks: the result
equals DDP's.

FSDP2 keeps one pending sum per parameter group between the micro-batches of a window (``defer_all_reduce``); its
layout followed whichever parameters had gradients in each micro-batch, so a head used on even batches only never
moved (its sum was never all-reduced), or two heads of the same shape swapped gradients, silently. FSDP1 under
``no_sync`` reduces a unit only in its own post-backward hook, so a unit left out of the last micro-batch stopped on
an ``AssertionError`` (sharded) or was never all-reduced (degree 1).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
from lightning.pytorch.strategies import DDPStrategy

from lightning_smp import HybridShardFSDPStrategy, UnitOrderError, unit_order
from tests.helpers import FSDP_VERSIONS, GLOO_TIMEOUT, assert_matches_ddp, fit_and_record, make_loader
from tests.modules import BODY_ONLY, AuxiliaryHeads, DataDependentBranch, K

WORLD = 4


def _fit(strategy: Any, folder: Path, run_both: bool = False) -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    model = AuxiliaryHeads(run_both)
    start = {k: v.detach().clone() for k, v in model.state_dict().items()}
    _, model, _ = fit_and_record(strategy, folder, WORLD, model=model, max_steps=3, accumulate_grad_batches=K,
                                 train_loader=make_loader(samples=64, batch_size=2))
    end = {k: v.detach().cpu().clone() for k, v in model.state_dict().items()}
    return {"start": start, "end": end}  # type: ignore[dict-item]


@pytest.fixture(scope="module")
def ddp(tmp_path_factory) -> dict:
    return _fit(DDPStrategy(start_method="fork", find_unused_parameters=True), tmp_path_factory.mktemp("ddp"))


@pytest.mark.timeout(GLOO_TIMEOUT)
@pytest.mark.parametrize("degree", [1, 2, 4])
@pytest.mark.parametrize("units", ["each_linear_a_unit", "one_root_unit"])
@pytest.mark.parametrize(("version", "accumulation"), [(1, "no_sync"), (1, "every_micro_batch"), (2, "defer_all_reduce"),
                                                       (2, "no_sync"), (2, "every_micro_batch")])
def test_heads_used_in_some_micro_batches_train_as_under_ddp(tmp_path, ddp, degree, units, version, accumulation):
    policy = {torch.nn.Linear} if units == "each_linear_a_unit" else None
    ours = _fit(HybridShardFSDPStrategy(hybrid_shard_degree=degree, fsdp_version=version, auto_wrap_policy=policy,
                                        gradient_accumulation=accumulation,
                                        start_method="fork"), tmp_path)
    moved_by_ddp = {k for k in ddp["end"] if not torch.equal(ddp["end"][k], ddp["start"][k])}
    assert {"aux_even.weight", "aux_odd.weight"} <= moved_by_ddp
    assert_matches_ddp(ours["end"], ddp["end"], start=ddp["start"])  # and whatever DDP moved moved here


class AHeadForTheFirstStepOnly(AuxiliaryHeads):
    """``aux_even`` takes part in the first optimizer step only, ``aux_odd`` never: no rank gives them a gradient in
    any later window. ``set_to_none``: how ``zero_grad`` clears (``False`` keeps zero tensors, which AdamW steps)."""

    def __init__(self, set_to_none: bool) -> None:
        super().__init__()
        self.set_to_none = set_to_none

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = torch.nn.functional.mse_loss(self(x), y)
        if self.trainer.global_step == 0:
            loss = loss + torch.nn.functional.mse_loss(self.aux_even(x), y)
        return loss

    def optimizer_zero_grad(self, epoch: int, batch_idx: int, optimizer: Any) -> None:
        optimizer.zero_grad(set_to_none=self.set_to_none)


def _fit_first_step_head(strategy: Any, folder: Path, set_to_none: bool) -> dict[str, dict[str, torch.Tensor]]:
    torch.manual_seed(0)
    model = AHeadForTheFirstStepOnly(set_to_none)
    start = {k: v.detach().clone() for k, v in model.state_dict().items()}
    _, model, _ = fit_and_record(strategy, folder, WORLD, model=model, max_steps=3, accumulate_grad_batches=K,
                                 train_loader=make_loader(samples=64, batch_size=2))
    return {"start": start, "end": {k: v.detach().cpu().clone() for k, v in model.state_dict().items()}}


@pytest.mark.timeout(GLOO_TIMEOUT)
@pytest.mark.parametrize("set_to_none", [True, False])
@pytest.mark.parametrize(("version", "accumulation"), [(1, "no_sync"), (2, "defer_all_reduce"), (2, "no_sync"),
                                                       (2, "every_micro_batch")])
def test_a_head_no_rank_uses_in_a_window_keeps_its_grad_as_under_ddp(tmp_path, version, accumulation, set_to_none):
    """Under DDP such a head's ``.grad`` stays what ``zero_grad`` left: ``None`` (AdamW skips it), or zeros (AdamW
    moves it by momentum and weight decay). FSDP2 reduce-scatters zeros for every unused parameter; before, the head
    then moved under ``set_to_none=True`` too, silently."""
    ddp = _fit_first_step_head(DDPStrategy(start_method="fork", find_unused_parameters=True), tmp_path / "ddp",
                               set_to_none)
    ours = _fit_first_step_head(HybridShardFSDPStrategy(hybrid_shard_degree=2, fsdp_version=version,
                                                        auto_wrap_policy={torch.nn.Linear},
                                                        gradient_accumulation=accumulation, start_method="fork"),
                                tmp_path / "ours", set_to_none)
    assert_matches_ddp(ours["end"], ddp["end"])
    assert not torch.equal(ours["end"]["aux_even.weight"], ours["start"]["aux_even.weight"])
    assert torch.equal(ours["end"]["aux_odd.weight"], ours["start"]["aux_odd.weight"])


class ABranchNoRankTakesInOddSteps(DataDependentBranch):
    """As :class:`DataDependentBranch` in even optimizer steps; in odd ones no rank uses ``aux``."""

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = torch.nn.functional.mse_loss(self(x), y)
        if y[:, 0].mean() > 0 and self.trainer.global_step % 2 == 0:
            loss = loss + torch.nn.functional.mse_loss(self.aux(x), y)
        return loss


#: the body a unit of its own; ``aux`` stays in the root unit with ``head``, which every rank uses
def _fit_branch(strategy: Any, folder: Path, model_cls: type = DataDependentBranch) -> dict[str, dict[str, torch.Tensor]]:
    torch.manual_seed(0)
    model = model_cls()
    start = {k: v.detach().clone() for k, v in model.state_dict().items()}
    _, model, _ = fit_and_record(strategy, folder, WORLD, model=model, max_steps=4,
                                 train_loader=make_loader(samples=64, batch_size=2))
    return {"start": start, "end": {k: v.detach().cpu().clone() for k, v in model.state_dict().items()}}


@pytest.mark.timeout(GLOO_TIMEOUT)
@pytest.mark.parametrize(("version", "accumulation", "degree"), [
    (1, "no_sync", 1), (1, "no_sync", 2), (1, "no_sync", 4),
    (2, "defer_all_reduce", 1), (2, "defer_all_reduce", 2), (2, "no_sync", 2)])
def test_a_head_that_runs_but_is_left_out_of_the_last_loss_trains_as_under_ddp(tmp_path, degree, version,
                                                                                 accumulation):
    """Its forward runs in every micro-batch; only the loss of the last one leaves it out, so no hook of it fires."""
    ddp = _fit(DDPStrategy(start_method="fork", find_unused_parameters=True), tmp_path / "ddp", run_both=True)
    ours = _fit(HybridShardFSDPStrategy(hybrid_shard_degree=degree, fsdp_version=version,
                                        auto_wrap_policy={torch.nn.Linear}, gradient_accumulation=accumulation,
                                        start_method="fork"), tmp_path / "ours", run_both=True)
    assert_matches_ddp(ours["end"], ddp["end"])
    assert not torch.equal(ours["end"]["aux_even.weight"], ours["start"]["aux_even.weight"])


def _heads_window_dropped(fabric: L.Fabric, skip: bool = False) -> dict[str, list]:
    """Fabric: ``aux_even`` in the first micro-batch of each window, ``aux_odd`` in the second; in the second step,
    ``zero_grad`` right after the first micro-batch drops it (and with it all that ``aux_even`` accumulated).
    ``skip``: that micro-batch is not run at all (DDP's reducer cannot drop a window's gradients midway)."""
    torch.manual_seed(0)
    model = fabric.setup_module(AuxiliaryHeads())
    optimizer = fabric.setup_optimizers(torch.optim.AdamW(model.parameters(), lr=0.05))
    x_all, y_all = make_loader(samples=64, batch_size=2).dataset.tensors
    mine = slice(fabric.global_rank, None, fabric.world_size)
    xs, ys = x_all[mine], y_all[mine]
    for step in range(3):
        for micro in range(K):
            i = 2 * (step * K + micro)
            if skip and step == 1 and micro == 0:
                continue
            with fabric.no_backward_sync(model, enabled=micro < K - 1):
                out, aux = model(xs[i:i + 2], micro)  # through the sharded root
                y = ys[i:i + 2]
                fabric.backward((torch.nn.functional.mse_loss(out, y) + torch.nn.functional.mse_loss(aux, y)) / K)
            if step == 1 and micro == 0:
                optimizer.zero_grad()
        optimizer.step()
        optimizer.zero_grad()
    strategy = fabric.strategy
    state = strategy.full_state_dict(model) if hasattr(strategy, "full_state_dict") else model.state_dict()
    return {k: v.detach().cpu().tolist() for k, v in state.items()}


@pytest.mark.timeout(GLOO_TIMEOUT)
@pytest.mark.parametrize("version", FSDP_VERSIONS)
def test_zero_grad_mid_window_then_a_head_left_out_trains_as_under_ddp(version):
    """FSDP1 kept a flag that the dropped gradient was still to be handed out, and stopped on its AssertionError."""
    from lightning.fabric.strategies import DDPStrategy as FabricDDP

    from lightning_smp.fabric import HybridShardFSDPStrategy as FabricStrategy

    fabric = L.Fabric(strategy=FabricDDP(start_method="fork", find_unused_parameters=True), accelerator="cpu",
                      devices=WORLD)
    reference = fabric.launch(_heads_window_dropped, True)
    ours = L.Fabric(strategy=FabricStrategy(hybrid_shard_degree=2, fsdp_version=version,
                                            auto_wrap_policy={torch.nn.Linear}, start_method="fork"),
                    accelerator="cpu", devices=WORLD).launch(_heads_window_dropped)
    assert_matches_ddp(ours, reference)


@pytest.fixture(scope="module")
def ddp_branch(tmp_path_factory) -> dict:
    return _fit_branch(DDPStrategy(start_method="fork", find_unused_parameters=True), tmp_path_factory.mktemp("ddp"))


@pytest.mark.timeout(GLOO_TIMEOUT)
@pytest.mark.parametrize("degree", [2, 4])
@pytest.mark.parametrize("version", FSDP_VERSIONS)
def test_a_branch_taken_on_some_ranks_trains_as_under_ddp_inside_an_always_run_unit(tmp_path, ddp_branch, degree,
                                                                                   version):
    """DDP needs ``find_unused_parameters=True``; FSDP needs the branch's module inside a unit whose forward every
    rank runs and some of whose parameters every rank uses (here the root, with ``head``: ``auto_wrap_policy`` leaves
    ``aux`` out). That unit's reduction then gives ``aux`` zeros on the ranks that did not use it, as DDP does."""
    ours = _fit_branch(HybridShardFSDPStrategy(hybrid_shard_degree=degree, fsdp_version=version,
                                               auto_wrap_policy=BODY_ONLY, start_method="fork"), tmp_path)
    assert not torch.equal(ddp_branch["end"]["aux.weight"], ddp_branch["start"]["aux.weight"])
    assert_matches_ddp(ours["end"], ddp_branch["end"])


@pytest.mark.timeout(GLOO_TIMEOUT)
@pytest.mark.parametrize("degree", [1, 2, 4])
@pytest.mark.parametrize("version", FSDP_VERSIONS)
def test_a_parameter_no_rank_used_beside_used_ones_in_its_unit_keeps_grad_none(tmp_path, degree, version):
    """``aux`` shares the root unit with ``head``: the unit's reduction hands it zeros in the steps where no rank took
    the branch. DDP leaves its ``.grad`` None there and AdamW skips it; before, AdamW moved it (6e-2) under both
    engines (FSDP2 since every parameter reduce-scatters, FSDP1 since a flat parameter reduces whole)."""
    ddp = _fit_branch(DDPStrategy(start_method="fork", find_unused_parameters=True), tmp_path / "ddp",
                      ABranchNoRankTakesInOddSteps)
    ours = _fit_branch(HybridShardFSDPStrategy(hybrid_shard_degree=degree, fsdp_version=version,
                                               auto_wrap_policy=BODY_ONLY, start_method="fork"), tmp_path / "ours",
                       ABranchNoRankTakesInOddSteps)
    assert not torch.equal(ddp["end"]["aux.weight"], ddp["start"]["aux.weight"])
    assert_matches_ddp(ours["end"], ddp["end"])


@pytest.mark.timeout(GLOO_TIMEOUT)
@pytest.mark.parametrize("version", FSDP_VERSIONS)
def test_a_branch_that_is_its_own_unit_fails_on_every_rank_under_the_unit_order_check(tmp_path, monkeypatch, version):
    """Without the setting above, ``aux`` as a unit of its own: some ranks gather it, others do not (a hang, or two
    units of one size exchanging parameters). ``LIGHTNING_SMP_CHECK_UNIT_ORDER=1`` finds it before that collective."""
    monkeypatch.setenv(unit_order.ENV, "1")
    strategy = HybridShardFSDPStrategy(hybrid_shard_degree=2, fsdp_version=version, auto_wrap_policy={torch.nn.Linear},
                                       start_method="fork")
    with pytest.raises(UnitOrderError, match=r"(?s)FSDP unit 'aux'.*auto_wrap_policy"):
        _fit_branch(strategy, tmp_path)


@pytest.mark.timeout(GLOO_TIMEOUT)
@pytest.mark.parametrize("version", FSDP_VERSIONS)
def test_the_unit_order_check_passes_runs_whose_ranks_agree(tmp_path, monkeypatch, ddp_branch, version):
    monkeypatch.setenv(unit_order.ENV, "1")
    ours = _fit_branch(HybridShardFSDPStrategy(hybrid_shard_degree=2, fsdp_version=version,
                                               auto_wrap_policy=BODY_ONLY, start_method="fork"), tmp_path)
    assert_matches_ddp(ours["end"], ddp_branch["end"])


def test_a_gradient_that_is_not_zero_is_never_dropped_whatever_the_notes_say():
    """The engines' notes of which parameters autograd reached could miss a path (a hook FSDP did not call); the
    bitmap also counts every parameter whose gradient is not exactly zero as used, so only exact zeros are reset."""
    from lightning_smp.engines.unused import Presence, restore_unused

    a, b, c = (torch.nn.Parameter(torch.ones(n)) for n in (3, 2, 2))
    c.grad = torch.zeros(2)  # a zero .grad before the window (zero_grad(set_to_none=False)): kept, as DDP keeps it
    presence = Presence(lambda: [a, b, c])
    presence.note_start()
    a.grad, b.grad = torch.tensor([0.0, 1e-30, 0.0]), torch.zeros(2)
    assert restore_unused([presence], torch.device("cpu"), []) == 1
    assert a.grad is not None and b.grad is None and c.grad is not None
    assert presence.used == [False] * 3 and presence.was_none == [None] * 3  # a new window


def _record_step_error(fabric: L.Fabric, folder: Path, steps: Callable[[L.Fabric], None]) -> None:
    """Run ``steps``; each rank writes the ``GradientSyncError`` it raised (or nothing) to ``folder/rank<N>.txt``."""
    from lightning_smp import GradientSyncError

    try:
        steps(fabric)
        message = ""
    except GradientSyncError as error:
        message = str(error)
    (folder / f"rank{fabric.global_rank}.txt").write_text(message)


def _aux_in_the_first_step_only(fabric: L.Fabric) -> None:
    """``aux`` (in the root's flat parameter with ``head``) takes part in the first step on every rank, then never."""
    torch.manual_seed(0)
    model = fabric.setup_module(DataDependentBranch())
    optimizer = fabric.setup_optimizers(torch.optim.AdamW(model.parameters(), lr=0.05))
    x, y = make_loader(samples=64, batch_size=2).dataset.tensors
    for step in range(3):
        out = model(x[step:step + 2])
        loss = torch.nn.functional.mse_loss(out, y[step:step + 2])
        if step == 0:
            loss = loss + torch.nn.functional.mse_loss(model.aux(x[step:step + 2]), y[step:step + 2])
        fabric.backward(loss)
        optimizer.step()
        optimizer.zero_grad()


@pytest.mark.timeout(GLOO_TIMEOUT)
def test_a_part_of_a_flat_parameter_stepped_whole_that_no_rank_used_fails_on_every_rank(tmp_path):
    """FSDP1 with ``use_orig_params=False``: the optimizer steps the root's flat parameter, ``aux`` included, with
    zeros where DDP leaves ``aux.grad`` None, so AdamW would move it silently. Refused before that step instead."""
    from lightning_smp.fabric import HybridShardFSDPStrategy as FabricStrategy

    strategy = FabricStrategy(hybrid_shard_degree=2, fsdp_version=1, auto_wrap_policy=BODY_ONLY,
                              use_orig_params=False, start_method="fork")
    L.Fabric(strategy=strategy, accelerator="cpu", devices=WORLD).launch(_record_step_error, tmp_path,
                                                                        _aux_in_the_first_step_only)
    messages = {(tmp_path / f"rank{rank}.txt").read_text() for rank in range(WORLD)}
    assert len(messages) == 1, messages  # every rank alike
    (message,) = messages
    assert "aux.weight, aux.bias" in message and "use_orig_params=True" in message, message


def _a_used_gradient_dropped_on_rank_1(fabric: L.Fabric) -> None:
    """After a backward, rank 1 sets one used parameter's ``.grad`` (with a local shard) to ``None``: what a
    reduction that never wrote it would leave. Its name goes to ``dropped.txt``."""
    torch.manual_seed(0)
    model = fabric.setup_module(DataDependentBranch())
    optimizer = fabric.setup_optimizers(torch.optim.AdamW(model.parameters(), lr=0.05))
    x, y = make_loader(samples=64, batch_size=2).dataset.tensors
    fabric.backward(torch.nn.functional.mse_loss(model(x[:2]), y[:2]))
    if fabric.global_rank == 1:
        name, param = next((n, p) for n, p in model.named_parameters() if n.endswith("head.weight"))
        assert param.grad is not None and (param.grad.to_local() if hasattr(param.grad, "to_local") else param.grad).numel()
        param.grad = None
        (Path(os.environ["DROPPED"])).write_text(name)
    optimizer.step()


@pytest.mark.timeout(GLOO_TIMEOUT)
@pytest.mark.parametrize("version", FSDP_VERSIONS)
def test_a_used_parameter_left_without_gradient_fails_on_every_rank(tmp_path, monkeypatch, version):
    """The step guard checks the gradients against the notes: one rank's missing ``.grad`` of a parameter that took
    part would make that rank's optimizer skip it, and its replicas drift apart, silently."""
    from lightning_smp.fabric import HybridShardFSDPStrategy as FabricStrategy

    monkeypatch.setenv("DROPPED", str(tmp_path / "dropped.txt"))
    strategy = FabricStrategy(hybrid_shard_degree=2, fsdp_version=version, auto_wrap_policy=BODY_ONLY,
                              start_method="fork")
    L.Fabric(strategy=strategy, accelerator="cpu", devices=WORLD).launch(_record_step_error, tmp_path,
                                                                        _a_used_gradient_dropped_on_rank_1)
    messages = {(tmp_path / f"rank{rank}.txt").read_text() for rank in range(WORLD)}
    assert len(messages) == 1, messages
    (message,) = messages
    assert "took part" in message and "head.weight" in message, message
