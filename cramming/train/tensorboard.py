"""Optional TensorBoard logging (`train.tensorboard=true`): every metrics record also as TensorBoard scalars.

The records are the ones metrics.jsonl gets, with the same names (`loss`, `lr`, `tok_per_s`, `val_loss`,
`anytime/SST-2`, `anytime_average`, ...), stepped by optimizer update. Needs the `tensorboard` package (`pip install -e
.[tensorboard]`); asking for it without the package fails at start-up rather than after hours of training.
"""

from __future__ import annotations

from pathlib import Path

from cramming.errors import ConfigError
from cramming.utils import flatten

TENSORBOARD_DIR = "tensorboard"


class TensorBoardWriter:
    def __init__(self, run_dir: Path):
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError as err:  # torch's writer needs the tensorboard package
            raise ConfigError(
                "train.tensorboard=true needs the `tensorboard` package: pip install tensorboard"
                " (or pip install -e .[tensorboard]), or set train.tensorboard=false"
            ) from err
        self.writer = SummaryWriter(log_dir=str(Path(run_dir) / TENSORBOARD_DIR))

    def write(self, record: dict) -> None:
        """Every number of a metrics record as a scalar at its update; nested dicts (anytime scores) as a/b."""
        step = int(record.get("update", 0))
        for name, value in flatten(record, "/").items():
            if name != "update" and isinstance(value, int | float) and not isinstance(value, bool):
                self.writer.add_scalar(name, value, step)
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


def open_tensorboard(enabled: bool, run_dir: Path) -> TensorBoardWriter | None:
    return TensorBoardWriter(run_dir) if enabled else None
