"""What the loop reports while it trains: a log line and a metrics.jsonl record every train.log_every updates,
the evaluations handed in as hooks, and each record passed on to the trackers.

Throughput is measured over a window of updates that excludes set-up and the evaluations' own time.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

import torch
from torch import nn

from cramming.budget import BudgetClock
from cramming.errors import ConfigError, WriteFailed
from cramming.model import count_parameters
from cramming.train.config import TrainConfig
from cramming.train.state import Progress
from cramming.utils import per_second

log = logging.getLogger("cramming")


class EvalHook(Protocol):
    """A callback the loop runs between updates (pretrain.py passes anytime GLUE evaluation this way)."""

    def start(self, fraction_done: float) -> None: ...

    def due(self, fraction: float) -> bool: ...

    def __call__(self, model: nn.Module, clock: BudgetClock, update: int, tokens: int) -> dict: ...


@dataclass
class Window:
    """Sums since the last log line; loss and accuracy counts stay on the device until it is written."""

    loss: torch.Tensor | float = 0.0
    correct: torch.Tensor | float = 0.0
    predicted: torch.Tensor | float = 0.0
    updates: int = 0
    rows: int = 0
    since: float = field(default_factory=time.monotonic)

    def add(self, loss: torch.Tensor, correct: torch.Tensor, predicted: torch.Tensor, rows: int) -> None:
        """One applied update."""
        self.loss += loss
        self.correct += correct
        self.predicted += predicted
        self.updates += 1
        self.rows += rows


class Metrics:
    """metrics.jsonl (rank 0 only: `path` None elsewhere), the hooks, and the trackers' callback."""

    def __init__(
        self,
        path: Path | None,
        seq_length: int,
        hooks: Sequence[EvalHook] = (),
        on_record: Callable[[dict], None] | None = None,
    ):
        self.path, self.seq_length, self.hooks, self.on_record = path, seq_length, tuple(hooks), on_record
        self.window = Window()

    def restart_window(self) -> None:
        """Throughput from here: after set-up, or after an evaluation."""
        self.window = Window()

    def log_progress(self, progress: Progress, lr: float, skipped: int, clock: BudgetClock) -> None:
        """A log line and a metrics record for the updates since the last one."""
        w = self.window
        if w.updates == 0:
            return
        seconds = max(time.monotonic() - w.since, 1e-9)
        update = progress.updates
        record = {
            "update": update,
            "microbatches": progress.microbatches,
            "loss": float(w.loss) / w.updates,
            "mlm_acc": float(w.correct) / max(float(w.predicted), 1.0),
            "lr": lr,
            "batch_size": w.rows // w.updates,
            "seq_per_s": w.rows / seconds,
            "tok_per_s": w.rows * self.seq_length / seconds,
            "elapsed_h": clock.elapsed() / 3600,
            "budget_fraction": clock.fraction(),
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

    # --- evaluation hooks ------------------------------------------------------------------------------

    def start_hooks(self, fraction_done: float, several_ranks: bool) -> None:
        """Tell the hooks how much of the budget a resumed run has spent (they do not repeat what it passed)."""
        if self.hooks and several_ranks:
            raise ConfigError(
                "evaluation during pretraining (anytime) runs in a single process only; run without torchrun"
            )
        for hook in self.hooks:
            hook.start(fraction_done)

    def run_due_hooks(
        self, model: nn.Module, clock: BudgetClock, progress: Progress, lr: float, skipped: int, tokens: int
    ) -> None:
        """Each evaluation that is due, on the current weights; the throughput figures leave its time out (the
        window is logged and closed before it). tokens: the training tokens seen so far."""
        for hook in [hook for hook in self.hooks if hook.due(clock.fraction())]:
            self.log_progress(progress, lr, skipped, clock)
            self.write(hook(model, clock, progress.updates, tokens))
            self.restart_window()


# ------------------------------------------------------------------------------------------ set-up lines


def log_set_up(
    device: torch.device,
    dtype: torch.dtype,
    rows: int,
    seq_length: int,
    microbatch_size: int,
    train: TrainConfig,
    probability_masking: bool,
) -> None:
    log.info(
        "training on %s in %s: %d rows of %d tokens, micro-batch %d, %d sequences per update at %.0f%% of the"
        " budget (from %d)",
        device,
        str(dtype).removeprefix("torch."),
        rows,
        seq_length,
        microbatch_size,
        train.batch_size,
        100 * train.batch_size_ramp,
        min(train.batch_size_start, train.batch_size),
    )
    if probability_masking:
        log.info(
            "probability masking: the decoder runs on each micro-batch's masked positions, a data-dependent"
            " shape (a host synchronization per micro-batch; a graph break under torch.compile)"
        )


def log_model_size(model: nn.Module, name: str, vocab_size: int) -> None:
    total = count_parameters(model)
    embedding = model.encoder.embeddings.word.weight
    log.info(
        "model %s: %.1fM parameters (%.1fM without the %d x %d word embedding)",
        name,
        total / 1e6,
        (total - embedding.numel()) / 1e6,
        vocab_size,
        embedding.shape[-1],
    )
