"""Fork/spawn launcher for hybrid sharding (notebooks, and fast in-process tests)."""

from __future__ import annotations

import os
import tempfile
from typing import TYPE_CHECKING, Any, Optional

from lightning.pytorch.strategies.launchers.multiprocessing import _MultiProcessingLauncher, _WorkerOutput
from lightning.pytorch.trainer.states import TrainerFn
from typing_extensions import override

if TYPE_CHECKING:
    import lightning.pytorch as pl


class HybridShardMultiProcessingLauncher(_MultiProcessingLauncher):
    """Lightning's multiprocessing launcher, sending back *full* weights from sharded workers.

    Lightning's launcher hands the parent ``lightning_module.state_dict()`` of rank 0, which under FSDP is
    rank 0's shard and cannot be loaded into the parent's unsharded model. Here every rank takes part in
    assembling the full state dict and rank 0 sends it.
    """

    @override
    def _collect_rank_zero_results(self, trainer: "pl.Trainer", results: Any) -> Optional[_WorkerOutput]:
        checkpoint_callback = trainer.checkpoint_callback
        best_model_path = getattr(checkpoint_callback, "best_model_path", None) if checkpoint_callback else None

        strategy = self._strategy
        fitting = trainer.state.fn == TrainerFn.FITTING
        # a collective: every rank must take part
        state_dict = strategy.full_state_dict() if fitting else None  # type: ignore[attr-defined]

        if strategy.local_rank != 0:
            return None
        weights_path = None
        if fitting:
            weights_path = os.path.join(tempfile.mkdtemp(), ".temp.ckpt")
            strategy.checkpoint_io.save_checkpoint(state_dict, weights_path)
        extra = self.get_extra_results(trainer)
        return _WorkerOutput(best_model_path, weights_path, trainer.state, results, extra)
