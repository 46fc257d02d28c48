"""Typed configuration of the `train` group: the recipe (objective, schedule, batch size, optimizer)."""

from __future__ import annotations

from dataclasses import dataclass, field

from cramming.optim.config import OptimConfig


@dataclass
class TrainConfig:
    name: str = "bert-o4"
    optim: OptimConfig = field(default_factory=OptimConfig)
