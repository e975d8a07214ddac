"""A model from a parameter count and a transformer shape (``lightning-smp plan --params 7B --layers 32 ...``): the
meta-device modules the planner sizes when there is no model class, and the count parser."""

from __future__ import annotations

import math

import torch
from torch.nn import Module

from lightning_smp.errors import HybridShardConfigError


class _Block(Module):
    """One transformer layer's parameters: attention (4 h x h) and an MLP sized to reach the parameter count."""

    def __init__(self, hidden: int, ffn: int) -> None:
        super().__init__()
        self.norm1, self.norm2 = torch.nn.LayerNorm(hidden), torch.nn.LayerNorm(hidden)
        self.qkv = torch.nn.Linear(hidden, 3 * hidden, bias=False)
        self.proj = torch.nn.Linear(hidden, hidden, bias=False)
        self.up, self.down = torch.nn.Linear(hidden, ffn, bias=False), torch.nn.Linear(ffn, hidden, bias=False)


class ShapeModel(Module):
    """A transformer with ``params`` parameters in ``layers`` blocks, for planning from a count alone."""

    def __init__(self, params: int, layers: int, hidden: int, vocab: int) -> None:
        super().__init__()
        per_layer = (params - vocab * hidden) / layers
        ffn = math.floor((per_layer - 4 * hidden * hidden - 4 * hidden) / (2 * hidden))
        if ffn < 1:
            raise HybridShardConfigError(
                f"params={params} is too few for layers={layers} of hidden={hidden} with vocab={vocab}. Fix: raise"
                " --params or lower --layers/--hidden."
            )
        self.embed = torch.nn.Embedding(vocab, hidden)
        self.blocks = torch.nn.ModuleList(_Block(hidden, ffn) for _ in range(layers))
        self.norm = torch.nn.LayerNorm(hidden)


def parse_count(value: str) -> int:
    """``"7B"``, ``"125M"``, ``"1.5e9"`` or ``"7000000000"`` as a number of parameters."""
    scale = {"k": 10**3, "m": 10**6, "b": 10**9, "g": 10**9, "t": 10**12}
    text = str(value).strip().lower()
    try:
        if text and text[-1] in scale:
            return int(float(text[:-1]) * scale[text[-1]])
        return int(float(text))
    except ValueError:
        raise HybridShardConfigError(f"--params={value!r} is not a parameter count. Fix: e.g. --params 7B.") from None


__all__ = ["ShapeModel", "parse_count"]
