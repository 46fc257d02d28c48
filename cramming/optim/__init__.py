"""Optimizers selected by name (Hugging Face `optim` names), built from an OptimConfig."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from cramming.errors import check_choice
from cramming.optim.config import OptimConfig


def param_groups(model: nn.Module, weight_decay: float) -> list[dict]:
    """Split parameters into decayed (matrices) and not decayed (norms, biases: every tensor of < 2 dims)."""
    decay, no_decay = [], []
    for _, param in model.named_parameters():
        if not param.requires_grad:
            continue
        (decay if param.ndim >= 2 else no_decay).append(param)
    return [
        {"params": decay, "weight_decay": weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]


def _adamw(model: nn.Module, cfg: OptimConfig) -> torch.optim.Optimizer:
    return torch.optim.AdamW(param_groups(model, cfg.weight_decay), lr=cfg.lr, betas=tuple(cfg.betas), eps=cfg.eps)


OPTIMIZERS: dict[str, Callable[[nn.Module, OptimConfig], torch.optim.Optimizer]] = {
    "adamw": _adamw,
}


def build_optimizer(model: nn.Module, cfg: OptimConfig) -> torch.optim.Optimizer:
    check_choice("train.optim.name", cfg.name, OPTIMIZERS)
    return OPTIMIZERS[cfg.name](model, cfg)
