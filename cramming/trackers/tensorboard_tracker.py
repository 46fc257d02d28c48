"""TensorBoard: every metrics record as scalars in {run_dir}/tensorboard, stepped by optimizer update.

A resumed run writes into its own folder; its steps count on from the run it continues, so pointing
TensorBoard at both folders (`tensorboard --logdir outputs/<name>`) shows one curve per run part.
"""

from __future__ import annotations

from cramming.trackers.base import RunInfo, Tracker
from cramming.trackers.config import TrackingConfig

TENSORBOARD_DIR = "tensorboard"


class TensorBoardTracker(Tracker):
    name = "tensorboard"
    package = "tensorboard"
    fix = "pip install tensorboard (or pip install -e '.[trackers]'), or leave tensorboard out of `trackers`"

    def __init__(self, settings: TrackingConfig, info: RunInfo) -> None:
        super().__init__(settings, info)
        from torch.utils.tensorboard import SummaryWriter  # needs the tensorboard package

        self.writer = SummaryWriter(log_dir=str(info.run_dir / TENSORBOARD_DIR))

    def log(self, values: dict[str, float], step: int) -> None:
        for name, value in values.items():
            if name != "update":
                self.writer.add_scalar(name, value, step)
        self.writer.flush()

    def finish(self, status: str, summary: dict[str, float]) -> None:
        self.writer.close()
