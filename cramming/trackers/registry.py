"""The one registry of trackers: the names `trackers` accepts, each with its class."""

from __future__ import annotations

from cramming.errors import check_choice, config_error
from cramming.trackers.base import Tracker
from cramming.trackers.mlflow_tracker import MlflowTracker
from cramming.trackers.tensorboard_tracker import TensorBoardTracker
from cramming.trackers.wandb_tracker import WandbTracker

# each module imports its package only when its tracker starts: naming none costs nothing
TRACKERS: dict[str, type[Tracker]] = {
    "tensorboard": TensorBoardTracker,
    "wandb": WandbTracker,
    "mlflow": MlflowTracker,
}


def check_trackers(names: list[str]) -> None:
    """Every name known, none twice; raises ConfigError naming the valid ones."""
    for name in names:
        check_choice("trackers", name, TRACKERS)
    if len(set(names)) != len(names):
        raise config_error("trackers", list(names), "name each tracker once, e.g. trackers=[wandb,mlflow]")
