"""What the loop reports while it trains: a log line and a metrics.jsonl record every train.log_every updates
(and whatever record the loop hands in, an evaluation's), each passed on to the trackers. It only reports.

Throughput is measured over a window of updates that excludes set-up and the evaluations' own time.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn

from cramming.budget import BudgetClock
from cramming.data import PretrainingData
from cramming.errors import WriteFailed
from cramming.impl import dtype_name
from cramming.model import ArchConfig, count_parameters
from cramming.optim.step import TrainStep, Update
from cramming.train.batches import Progress
from cramming.train.config import TrainConfig
from cramming.utils import per_second

log = logging.getLogger("cramming")


@dataclass
class Window:
    """Sums since the last log line; loss and accuracy counts stay on the device until it is written."""

    loss: torch.Tensor | float = 0.0
    correct: torch.Tensor | float = 0.0
    predicted: torch.Tensor | float = 0.0
    updates: int = 0
    rows: int = 0
    since: float = field(default_factory=time.monotonic)

    def add(self, update: Update, rows: int) -> None:
        """One applied update of `rows` sequences (its counts: correct predictions, predictions)."""
        correct, predicted = update.counts
        self.loss += update.loss
        self.correct += correct
        self.predicted += predicted
        self.updates += 1
        self.rows += rows


class Metrics:
    """metrics.jsonl (rank 0 only: `path` None elsewhere) and the trackers' callback."""

    def __init__(self, path: Path | None, seq_length: int, on_record: Callable[[dict], None] | None = None):
        self.path, self.seq_length, self.on_record = path, seq_length, on_record
        self.window = Window()

    def add(self, update: Update, rows: int) -> None:
        """An applied update of `rows` sequences, into the figures of the next log line."""
        self.window.add(update, rows)

    def restart_window(self) -> None:
        """Throughput from here: after set-up, or after an evaluation."""
        self.window = Window()

    def log_progress(self, step: TrainStep, progress: Progress, clock: BudgetClock) -> None:
        """A log line and a metrics record for the updates since the last one."""
        w = self.window
        if w.updates == 0:
            return
        seconds = max(time.monotonic() - w.since, 1e-9)
        update, skipped, lr = step.stats.updates, step.stats.skipped, step.optimizer.param_groups[0]["lr"]
        record = {
            "update": update,
            "microbatches": progress.microbatches,
            "loss": float(w.loss) / w.updates,
            "mlm_acc": float(w.correct) / max(float(w.predicted), 1.0),
            "lr": lr,
            "batch_size": w.rows // w.updates,
            "seq_per_s": w.rows / seconds,
            "tok_per_s": w.rows * self.seq_length / seconds,
            **clock.figures(),  # budget hours spent and the share spent (reference clock: and the wall hours)
            "skipped": skipped,
        }
        log.info(
            "update %d | loss %.4f | mlm acc %.3f | lr %.2e | batch %d | %s seq/s, %s tok/s | %s",
            update,
            record["loss"],
            record["mlm_acc"],
            lr,
            record["batch_size"],
            per_second(record["seq_per_s"]),
            per_second(record["tok_per_s"]),
            clock.describe(),
        )
        self.write(record)
        self.restart_window()

    def write(self, record: dict) -> None:
        if self.path is None:
            return
        try:
            with open(self.path, "a", encoding="utf-8") as f:
                f.write(json.dumps(record) + "\n")
        except OSError as err:  # a full disk: stop with the last saved state kept (exit 4), not a traceback
            raise WriteFailed(f"could not append to {self.path}: {err}") from err
        if self.on_record is not None:
            self.on_record(record)


# ------------------------------------------------------------------------------------------ set-up lines


def log_set_up(
    model: nn.Module,
    arch: ArchConfig,
    data: PretrainingData,
    device: torch.device,
    dtype: torch.dtype,
    microbatch_size: int,
    train: TrainConfig,
) -> None:
    """The lines a run starts with: the model's size, then what it trains on and how."""
    total = count_parameters(model)
    embedding = model.encoder.embeddings.word.weight
    log.info(
        "model %s: %.1fM parameters (%.1fM without the %d x %d word embedding)",
        arch.name,
        total / 1e6,
        (total - embedding.numel()) / 1e6,
        data.vocab_size,
        embedding.shape[-1],
    )
    log.info(
        "training on %s in %s: %d rows of %d tokens, micro-batch %d, %d sequences per update at %.0f%% of the"
        " budget (from %d)",
        device,
        dtype_name(dtype),
        len(data.train),
        data.seq_length,
        microbatch_size,
        train.batch_size,
        100 * train.batch_size_ramp,
        min(train.batch_size_start, train.batch_size),
    )
    if arch.sparse_prediction and train.mlm.mode != "count":
        log.info(
            "probability masking: the decoder runs on each micro-batch's masked positions, a data-dependent"
            " shape (a host synchronization per micro-batch; a graph break under torch.compile)"
        )
