"""The fork launcher used in notebooks: what comes back to the notebook process, and clear messages on misuse."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.multiprocessing as mp
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.strategies.launchers.subprocess_script import _SubprocessScriptLauncher

from lightning_smp import CheckpointError, HybridShardConfigError, HybridShardFSDPStrategy
from lightning_smp.config.options import check_start_method_name
from lightning_smp.forking import check_fork_safety
from lightning_smp.launcher import HybridShardMultiProcessingLauncher, _callback_reports, _set_callback_reports
from lightning_smp.names import SHARDED, START_METHODS
from tests.helpers import FRONT_ENDS, PROCESS_TIMEOUT, RankRecorder, TinyModel, cpu_trainer, make_loader, state_digest


@pytest.fixture
def private_tempdir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """The launcher's hand-back files go here, so that a test can check none is left behind."""
    folder = tmp_path / "tmp"
    folder.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(folder))
    return folder


def _fork_hybrid(**kwargs: Any) -> HybridShardFSDPStrategy:
    return HybridShardFSDPStrategy(hybrid_shard_degree=2, start_method="fork", **kwargs)


def _set_interactive(monkeypatch: pytest.MonkeyPatch, value: bool) -> None:
    import lightning.pytorch.trainer.connectors.accelerator_connector as connector

    import lightning_smp.frontend.shared as frontend

    monkeypatch.setattr(frontend, "_IS_INTERACTIVE", value)
    monkeypatch.setattr(connector, "_IS_INTERACTIVE", value)


@pytest.fixture
def interactive(monkeypatch: pytest.MonkeyPatch) -> None:
    """Make this process look like Jupyter to the strategy and to Lightning's interactive-compatibility check."""
    _set_interactive(monkeypatch, True)


def test_interactive_session_forks_and_scripts_rerun_the_script(monkeypatch: pytest.MonkeyPatch) -> None:
    _set_interactive(monkeypatch, True)
    trainer = cpu_trainer("smp_hybrid", devices=4)
    launcher = trainer.strategy.launcher
    assert type(launcher) is HybridShardMultiProcessingLauncher
    assert launcher._start_method == "fork" and launcher.is_interactive_compatible
    assert trainer.strategy.start_method == "fork"

    _set_interactive(monkeypatch, False)
    script = cpu_trainer("smp_hybrid", devices=4)
    assert type(script.strategy.launcher) is _SubprocessScriptLauncher
    explicit = cpu_trainer("smp_hybrid_notebook", devices=4)
    assert type(explicit.strategy.launcher) is HybridShardMultiProcessingLauncher


@pytest.mark.timeout(PROCESS_TIMEOUT)
def test_results_come_back_to_the_notebook_process(tmp_path: Path, interactive: None, private_tempdir: Path) -> None:
    torch.manual_seed(0)
    model = TinyModel()
    initial = state_digest(model.state_dict())
    reporter = RankRecorder(tmp_path / "records", report=True)
    trainer = cpu_trainer("smp_hybrid", tmp_path, 4, max_steps=5, callbacks=[reporter])
    trainer.fit(model, make_loader())

    # the ranks really were other processes, and their report reached this process's callback
    report = reporter.report
    assert report is not None and [r["rank"] for r in report] == [0, 1, 2, 3]
    assert len({r["pid"] for r in report} | {os.getpid()}) == 5
    # trained weights: exactly what the ranks assembled, loaded into this process's module
    assert report[0]["weights_sha256"] == state_digest(model.state_dict()) != initial
    # loop counters and metrics
    assert (trainer.global_step, trainer.current_epoch) == report[0]["counters"]
    assert trainer.global_step == 5
    assert trainer.state.finished
    last_loss = report[0]["local_losses"][-1]  # rank 0's own loss, as logged without sync_dist
    assert float(trainer.callback_metrics["train_loss"]) == pytest.approx(last_loss, abs=0, rel=1e-6)
    assert float(trainer.logged_metrics["train_loss"]) == float(trainer.callback_metrics["train_loss"])
    # the next cell can use the model directly
    x, _ = next(iter(make_loader()))
    assert model(x).shape == (4, 4)
    assert list(private_tempdir.iterdir()) == []


@pytest.mark.timeout(PROCESS_TIMEOUT)
def test_checkpoint_saved_in_notebook_process_resumes_exactly(tmp_path: Path, private_tempdir: Path) -> None:
    torch.manual_seed(0)
    uninterrupted = TinyModel()
    cpu_trainer(_fork_hybrid(), tmp_path, 4, max_epochs=2).fit(uninterrupted, make_loader())

    torch.manual_seed(0)
    model = TinyModel()
    first = cpu_trainer(_fork_hybrid(), tmp_path, 4, max_epochs=1)
    first.fit(model, make_loader())
    path = tmp_path / "last.ckpt"
    first.save_checkpoint(path)
    checkpoint = torch.load(path, weights_only=False)
    assert (checkpoint["global_step"], checkpoint["epoch"]) == (4, 1)  # one epoch completed
    (adam,) = checkpoint["optimizer_states"]
    # full (unsharded) Adam state for all four parameters, keyed as the strategy saves it inside the ranks
    assert sorted(tuple(s["exp_avg"].shape) for s in adam["state"].values()) == [(4,), (4, 33), (33,), (33, 16)]
    assert all(int(s["step"]) == 4 for s in adam["state"].values())

    with pytest.raises(HybridShardConfigError, match=r"create a new Trainer.*ckpt_path='last.ckpt'"):
        first.fit(model, make_loader())

    second = cpu_trainer(_fork_hybrid(), tmp_path, 4, max_epochs=2)
    second.fit(model, make_loader(), ckpt_path=path)
    assert (second.global_step, second.current_epoch) == (8, 2)
    for (name, expected), actual in zip(uninterrupted.state_dict().items(), model.state_dict().values()):
        assert torch.equal(expected, actual), name
    assert list(private_tempdir.iterdir()) == []


@pytest.mark.timeout(PROCESS_TIMEOUT)
def test_notebook_process_writes_one_full_file_under_sharded_state_dict_type(tmp_path: Path) -> None:
    def sharded() -> HybridShardFSDPStrategy:
        return _fork_hybrid(state_dict_type=SHARDED)

    torch.manual_seed(0)
    model = TinyModel()
    first = cpu_trainer(sharded(), tmp_path, 4, max_steps=2)
    first.fit(model, make_loader())
    (tmp_path / "a_folder").mkdir()
    # the message is lightning_smp.checkpoint's (asserted in tests/test_checkpoint.py); here: refused, naming the path
    with pytest.raises(CheckpointError, match=re.escape(repr(str(tmp_path / "a_folder")))):
        first.save_checkpoint(tmp_path / "a_folder")
    path = tmp_path / "from_notebook.ckpt"
    first.save_checkpoint(path)
    assert path.is_file()
    checkpoint = torch.load(path, weights_only=False)
    assert state_digest(checkpoint["state_dict"]) == state_digest(model.state_dict())
    # full Adam state (not rank 0's shard): one entry per parameter with the parameter's shape
    (adam,) = checkpoint["optimizer_states"]
    assert sorted(tuple(s["exp_avg_sq"].shape) for s in adam["state"].values()) == [(4,), (4, 33), (33,), (33, 16)]

    # a sharded-strategy Trainer loads it: max_steps is reached already, so the weights are exactly the loaded ones
    fresh = TinyModel()
    resumed = cpu_trainer(sharded(), tmp_path, 4, max_steps=2)
    resumed.fit(fresh, make_loader(), ckpt_path=path)
    assert resumed.global_step == 2
    assert state_digest(fresh.state_dict()) == state_digest(checkpoint["state_dict"])


def test_checkpoint_before_fit_in_notebook_process(tmp_path: Path) -> None:
    model = TinyModel()
    trainer = cpu_trainer(_fork_hybrid(), tmp_path, 4)
    trainer.strategy.connect(model)
    with pytest.raises(HybridShardConfigError, match="not finished a fit.*weights_only=True"):
        trainer.save_checkpoint(tmp_path / "x.ckpt")
    trainer.save_checkpoint(tmp_path / "w.ckpt", weights_only=True)
    saved = torch.load(tmp_path / "w.ckpt", weights_only=True)["state_dict"]
    assert state_digest(saved) == state_digest(model.state_dict())


def test_start_method_names() -> None:
    assert check_start_method_name(None) is None  # automatic
    assert [check_start_method_name(method) for method in START_METHODS] == list(START_METHODS)
    with pytest.raises(HybridShardConfigError) as err:
        check_start_method_name("thread")
    assert str(err.value) == ("start_method='thread' is not supported. Valid values: None (automatic), "
                              + ", ".join(repr(method) for method in START_METHODS) + ".")


def test_platform_without_fork(monkeypatch: pytest.MonkeyPatch, interactive: None) -> None:
    monkeypatch.setattr(mp, "get_all_start_methods", lambda: ["spawn"])
    for strategy in ("smp_hybrid", "smp_hybrid_notebook"):
        with pytest.raises(HybridShardConfigError, match=r"start_method='fork' is not available .*available: spawn"):
            cpu_trainer(strategy, devices=4)


def test_cuda_initialised_before_fork(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    with pytest.raises(HybridShardConfigError, match=r"start_method='fork'.*CUDA is in use.*restart the kernel"):
        check_fork_safety("cuda", "fork")
    check_fork_safety("cuda", "spawn")  # a fresh interpreter per rank is unaffected
    check_fork_safety("cpu", "fork")  # CPU ranks never touch the CUDA context


@pytest.mark.timeout(PROCESS_TIMEOUT)
def test_bad_fork_is_refused_before_any_process_starts(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # what torch reports in a process that inherited an initialised CUDA context through fork
    monkeypatch.setattr(torch.cuda, "_is_in_bad_fork", lambda: True)
    trainer = cpu_trainer(_fork_hybrid(), tmp_path, 4, max_steps=1)
    with pytest.raises(HybridShardConfigError, match=r"HybridShardFSDPStrategy\(start_method='fork'\) cannot fork"):
        trainer.fit(TinyModel(), make_loader())
    assert trainer.strategy.launcher.procs == []


def test_degree_that_does_not_divide_devices_in_notebook(interactive: None) -> None:
    # the message is lightning_smp.degree's (asserted in tests/test_degree.py)
    with pytest.raises(HybridShardConfigError, match=r"hybrid_shard_degree=3\b.*\bworld_size=4\b"):
        cpu_trainer(HybridShardFSDPStrategy(hybrid_shard_degree=3), devices=4)


class _Reporter(Callback):
    def __init__(self, report: Any = None) -> None:
        self.report = report


class _OtherReporter(_Reporter):
    pass


def test_reports_match_callbacks_by_class_not_position() -> None:
    # the ranks add the model's configure_callbacks() and reorder the list; positions do not match the notebook's
    worker = [_OtherReporter("added in the ranks"), _Reporter("a"), Callback(), _Reporter("b")]
    main = [_Reporter(), _Reporter(), Callback()]
    _set_callback_reports(main, _callback_reports(worker))
    assert [c.report for c in main[:2]] == ["a", "b"]
    assert not hasattr(main[2], "report")


_EXIT_SCRIPT = """
import atexit, os, sys
import torch.distributed as dist
import lightning as L
import lightning_smp
from lightning_smp.fabric import HybridShardFSDPStrategy as FabricStrategy

# registered first, so it runs last (atexit is LIFO): the groups must be gone by then
# one write per line: the ranks share stdout, and print() writes the text and the newline separately
atexit.register(lambda: os.write(1, f"rank exit: initialized={dist.is_initialized()}\\n".encode()))
if sys.argv[1] == "fabric":
    fabric = L.Fabric(strategy=FabricStrategy(hybrid_shard_degree=2), accelerator="cpu", devices=2)
    fabric.launch()
    fabric.barrier()
else:
    import torch
    from lightning.pytorch.demos.boring_classes import BoringModel
    trainer = L.Trainer(strategy=lightning_smp.HybridShardFSDPStrategy(hybrid_shard_degree=2), accelerator="cpu",
                        devices=2, max_steps=1, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False)
    trainer.fit(BoringModel())
"""


@pytest.mark.parametrize("front_end", FRONT_ENDS)
def test_process_groups_are_destroyed_before_interpreter_exit(tmp_path, front_end):
    """A gloo group left to interpreter finalization can abort a finished run (exit code -6); both front ends
    destroy every group at exit, on every rank of Lightning's subprocess launcher."""
    script = tmp_path / "exit_script.py"
    script.write_text(_EXIT_SCRIPT)
    done = subprocess.run([sys.executable, str(script), front_end], cwd=tmp_path, capture_output=True, text=True,
                          timeout=PROCESS_TIMEOUT, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert done.returncode == 0, done.stderr[-3000:]
    assert re.findall(r"rank exit: initialized=(True|False)", done.stdout) == ["False", "False"], done.stdout[-2000:]
