"""Resumable pretraining state on disk: {run_dir}/state.pt (model, optimizer, scaler, progress, data
position, RNG, elapsed budget), written atomically every train.checkpoint_every_min, on SIGINT/SIGTERM and at
the end. The final model itself is written by cramming.model.checkpoint.save_pretrained.
"""

from __future__ import annotations

from pathlib import Path

import torch

from cramming.utils import atomic_torch_save, newest_run_dir

STATE = "state.pt"


def save_state(path: str | Path, state: dict) -> None:
    """Atomically write a resumable state (plain containers of tensors and numbers only)."""
    atomic_torch_save(state, path)


def load_state(path: str | Path) -> dict:
    # weights_only: a state file cannot run code when loaded; optimizers must keep their state to tensors
    return torch.load(path, map_location="cpu", weights_only=True)


def find_resumable_state(base_dir: str | Path, name: str) -> Path | None:
    """state.pt of the newest run folder of `name` that has one."""
    run_dir = newest_run_dir(base_dir, name, STATE)
    return None if run_dir is None else run_dir / STATE
