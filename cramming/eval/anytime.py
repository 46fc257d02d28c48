"""Anytime evaluation: fine-tune the weights of a running pretraining on a small fixed GLUE subset at given
fractions of its budget, so the learning curve of downstream quality is visible, not only its end point.

pretrain.py hands an `AnytimeEval` to the loop as a hook; each evaluation fine-tunes a copy of the current
encoder in memory (nothing is written to disk) with eval.py's fine-tuning for every task of the recipe: the
same fine-tuning as a full GLUE run, on fewer examples. Its time counts against the pretraining budget (`charged: true`) or pauses the
budget clock (`charged: false`, the default: the curve then shows what the run would reach without it).
The scores go into metrics.jsonl as records with `anytime_fraction` and `anytime` (entry -> score).
"""

from __future__ import annotations

import copy
import logging
import random
import time
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch
from torch import nn

from cramming.budget import BudgetClock
from cramming.errors import DataSourceError, config_error
from cramming.eval.backbone import Backbone
from cramming.eval.config import EvalConfig
from cramming.eval.scores import glue_average, summarize
from cramming.eval.tasks import GLUE_TASKS
from cramming.impl import ImplConfig
from cramming.model.checkpoint import unwrap

if TYPE_CHECKING:
    from cramming.data import PretrainingData

log = logging.getLogger("cramming")


def _small_recipe() -> EvalConfig:
    return EvalConfig(
        name="anytime", tasks=["RTE", "SST-2"], epochs=1, max_train_examples=512, max_eval_examples=256
    )


@dataclass
class AnytimeConfig:
    """`anytime` (a top-level key of the pretraining config, beside `train`): when to evaluate during
    pretraining, on what, and who pays for the time."""

    # fractions of the pretraining budget at which to evaluate, e.g. [0.25, 0.5, 1.0]; empty: never
    at: list[float] = field(default_factory=list)
    # true: the evaluations' time counts against the pretraining budget; false: the budget clock pauses
    charged: bool = False
    # the fine-tuning recipe (any eval.* setting): two tasks, subsampled, one epoch unless changed.
    # Offline, point it at a local GLUE copy in the original TSV layout: anytime.recipe.glue_dir=<folder>
    recipe: EvalConfig = field(default_factory=_small_recipe)
    # fine-tuning seed (one per evaluation: the curve compares fractions, not seeds)
    seed: int = 0

    def __post_init__(self) -> None:
        if any(not 0.0 < f <= 1.0 for f in self.at):
            raise config_error("anytime.at", self.at, "use fractions of the budget in (0, 1]")


@contextmanager
def preserved_rng() -> Iterator[None]:
    """Fine-tuning seeds every generator; pretraining continues with the random state it had."""
    states = (random.getstate(), np.random.get_state(), torch.get_rng_state())
    cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None
    try:
        yield
    finally:
        random.setstate(states[0])
        np.random.set_state(states[1])
        torch.set_rng_state(states[2])
        if cuda is not None:
            torch.cuda.set_rng_state_all(cuda)


class AnytimeEval:
    """The loop's evaluation hook: evaluates at each configured fraction once; a resumed run skips the
    fractions already passed."""

    def __init__(self, cfg: AnytimeConfig, data: PretrainingData, impl: ImplConfig, cache_dir: Path):
        self.cfg, self.impl = cfg, impl
        self.tokenizer, self.pad_id = data.tokenizer, data.special.pad
        self.pending = sorted(cfg.at)
        # loaded once, before training: a task that cannot be had fails now, not in the middle of the run
        self.tasks = [GLUE_TASKS[name] for name in cfg.recipe.tasks]
        # imported here: `datasets` stays out of the import chain of the training config (the GPU check
        # machine has no `datasets`)
        from cramming.eval.glue_data import load_task

        try:
            self.splits = {
                task.name: load_task(task, cfg.recipe.glue_dir, cache_dir=cache_dir) for task in self.tasks
            }
        except DataSourceError as err:
            raise DataSourceError(
                f"anytime: {err} (for anytime evaluation: anytime.recipe.glue_dir)"
            ) from err

    def start(self, fraction_done: float) -> None:
        self.pending = [f for f in self.pending if f > fraction_done]

    def due(self, fraction: float) -> bool:
        return bool(self.pending) and fraction >= self.pending[0]

    def __call__(self, model: nn.Module, clock: BudgetClock, update: int) -> dict:
        """Fine-tune copies of the current encoder on every task; returns the metrics record."""
        fraction = clock.fraction()
        target = max(f for f in self.pending if f <= fraction)  # the fraction this evaluation stands for
        self.pending = [f for f in self.pending if f > fraction]
        start = time.perf_counter()
        with nullcontext() if self.cfg.charged else clock.paused(), preserved_rng():
            # imported here: the fine-tuning stack loads `evaluate` (and with it transformers), seconds that
            # a pretraining run without anytime evaluation should not spend at start-up
            from cramming.eval.finetune import finetune_tasks

            glue = finetune_tasks(
                [(task, self.splits[task.name]) for task in self.tasks],
                self.backbone(model),
                self.cfg.recipe,
                self.impl,
                [self.cfg.seed],
            )
        scores = summarize(glue.per_entry)
        average, _ = glue_average(scores)
        record = {
            "update": update,
            "elapsed_h": clock.elapsed() / 3600,
            "anytime_fraction": target,
            "budget_fraction": fraction,
            "anytime": {entry: score.median for entry, score in scores.items()},  # main metric, in [0, 1]
            "anytime_average": average,
            "anytime_seconds": time.perf_counter() - start,
            "anytime_charged": self.cfg.charged,
        }
        log.info(
            "anytime evaluation at %.0f%% of the budget (update %d, %.0f s%s): %s",
            100 * fraction,
            update,
            record["anytime_seconds"],
            ", charged to the budget" if self.cfg.charged else ", budget clock paused",
            ", ".join(f"{entry} {100 * s:.1f}" for entry, s in record["anytime"].items()),
        )
        return record

    def backbone(self, model: nn.Module) -> Backbone:
        """The pretraining model's encoder with the arch's fine-tuning dropout (pretraining runs without);
        fine-tuning copies it again for each task, so the pretraining weights are never touched."""
        plain = unwrap(model)
        encoder = copy.deepcopy(plain.encoder)
        encoder.set_dropout(plain.arch.dropout)
        return Backbone(encoder, plain.arch.hidden_size, plain.arch.dropout, self.tokenizer, self.pad_id)
