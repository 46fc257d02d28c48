"""Typed configuration of the optimizer (`train/optim` group)."""

from __future__ import annotations

from dataclasses import dataclass, field

from cramming.errors import config_error


@dataclass
class OptimConfig:
    # one of the names in cramming.optim.OPTIMIZERS (Hugging Face `optim` names)
    name: str = "adamw"
    lr: float = 1e-3
    betas: list[float] = field(default_factory=lambda: [0.9, 0.98])
    eps: float = 1e-12
    # decoupled weight decay; never applied to norms, biases or the embeddings' norm
    weight_decay: float = 0.01

    def __post_init__(self) -> None:
        if self.lr <= 0:
            raise config_error("train.optim.lr", self.lr, "use a positive learning rate")
        if len(self.betas) != 2 or not all(0.0 <= b < 1.0 for b in self.betas):
            raise config_error("train.optim.betas", self.betas, "give two values in [0, 1), e.g. [0.9, 0.98]")
        if self.eps <= 0:
            raise config_error("train.optim.eps", self.eps, "use a small positive number")
        if self.weight_decay < 0:
            raise config_error("train.optim.weight_decay", self.weight_decay, "use 0 or a positive value")
