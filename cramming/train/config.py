"""Typed configuration of the `train` group: the recipe (objective, schedule, batch size, optimizer)."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Protocol

from cramming.budget import CLOCKS
from cramming.errors import check_choice, config_error
from cramming.impl import ImplConfig
from cramming.model.config import ArchConfig
from cramming.optim.average import AVERAGES
from cramming.optim.config import OptimConfig
from cramming.optim.schedules import LR_SCHEDULES

log = logging.getLogger("cramming")

MASKING_MODES = ("count", "probability")


@dataclass
class MLMConfig:
    """Which tokens the masked-language-model objective hides, and how."""

    # count: exactly round(mask_fraction * seq_length) tokens per row (static shapes, cramming);
    # probability: each token independently with probability mask_fraction (original BERT, 15%)
    mode: str = "count"
    # the share of each row's tokens chosen for prediction (cramming: 0.25)
    mask_fraction: float = 0.25
    # choose whole words: all the pieces of a word or none (WordPiece's `##` pieces); count mode then fills up
    # to round(mask_fraction * seq_length) with whole words only
    whole_words: bool = False
    # of the chosen tokens: this share becomes [MASK], `random_fraction` a random token, the rest stay as is
    mask_token_fraction: float = 0.8
    # of the chosen tokens: this share becomes a random token
    random_fraction: float = 0.1

    def __post_init__(self) -> None:
        check_choice("train.mlm.mode", self.mode, MASKING_MODES)
        if not 0.0 < self.mask_fraction < 1.0:
            raise config_error(
                "train.mlm.mask_fraction", self.mask_fraction, "use a fraction in (0, 1), e.g. 0.25"
            )
        if self.mask_token_fraction < 0 or self.random_fraction < 0:
            raise config_error(
                "train.mlm.mask_token_fraction/random_fraction",
                (self.mask_token_fraction, self.random_fraction),
                "use non-negative fractions",
            )
        if self.mask_token_fraction + self.random_fraction > 1.0:
            raise config_error(
                "train.mlm.mask_token_fraction + random_fraction",
                self.mask_token_fraction + self.random_fraction,
                "the two shares must sum to at most 1 (0.8 + 0.1 keeps 10% unchanged)",
            )


@dataclass
class AverageConfig:
    """Weight averaging (cramming.optim.average): the final model is an average of the latest weights."""

    # none | ema: an exponential moving average of the weights, updated after every applied update; the final
    # model, its validation and the evaluations at the end of the budget use it (those during training do not)
    kind: str = "none"
    # ema: the share of the average each update keeps (its memory: about 1 / (1 - decay) updates)
    decay: float = 0.999

    def __post_init__(self) -> None:
        check_choice("train.average.kind", self.kind, AVERAGES)
        if not 0.0 < self.decay < 1.0:
            raise config_error("train.average.decay", self.decay, "use a share in (0, 1), e.g. 0.999")


@dataclass
class TrainConfig:
    """The `train` group: the recipe (objective, schedule, batch size, optimizer, stops and checkpoints)."""

    # a short label of the recipe (conf/train/<name>.yaml)
    name: str = "bert-o4"
    optim: OptimConfig = field(default_factory=OptimConfig)
    mlm: MLMConfig = field(default_factory=MLMConfig)
    average: AverageConfig = field(default_factory=AverageConfig)
    # sequences per optimizer update, reached by accumulating micro-batches of impl.microbatch_size
    batch_size: int = 8192
    # fraction of the budget at which batch_size is reached, rising linearly from batch_size_start sequences;
    # 0: the whole batch from the start
    batch_size_ramp: float = 0.6
    # sequences per update when the ramp starts (capped at batch_size)
    batch_size_start: int = 128
    # what the budget counts. wall: seconds as they pass (your real run). reference: every micro-batch and
    # update charged what it cost on the machine of train.calibration, so a budget buys the same updates on
    # any machine and under any load (comparing recipes; docs/clocks.md)
    clock: str = "wall"
    # the reference clock's costs: a file in conf/calibration/ (without .json) or a path; measured with
    # `python -m cramming.calibrate <the run's overrides>`
    calibration: str = "cpu-epyc-avx2"
    # a name in cramming.optim.schedules.LR_SCHEDULES: budget-triangle2 | budget-cosine | budget-constant | steps-linear
    lr_schedule: str = "budget-triangle2"
    # fraction of the schedule's clock spent warming up; null: the schedule's own default
    warmup: float | None = None
    # optimizer updates to run, applied or skipped for a non-finite loss (one count, as fine-tuning counts);
    # stops training when reached, and is the clock of the steps-* schedules
    steps: int | None = None
    # maximum gradient norm; null: no clipping
    grad_clip: float | None = 0.5
    # dropout during pretraining (cramming: off); fine-tuning uses arch.dropout
    dropout: float = 0.0
    # log line and metrics record every this many optimizer updates (and after the first)
    log_every: int = 50
    # save a resumable state every this many minutes of training (and on SIGINT/SIGTERM and at the end)
    checkpoint_every_min: float = 60.0
    # stop after this many consecutive updates skipped for a non-finite loss
    max_nonfinite_updates: int = 10
    # rows of the validation split evaluated (MLM loss, accuracy) at the end of training (0: none)
    validation_rows: int = 2048
    # also measure on them whether the model uses context (cramming/train/validation.py): the masked loss on
    # real rows against the same rows shuffled, and the targets' unigram entropy; two more forward passes
    context_diagnostic: bool = True
    # deprecated: the top-level trackers=[tensorboard] (shared with eval.py, beside wandb and mlflow); true
    # still adds tensorboard to the run's trackers, with a warning
    tensorboard: bool = False

    def __post_init__(self) -> None:
        if self.tensorboard:
            log.warning("train.tensorboard=true is deprecated: use trackers=[tensorboard] (docs/tracking.md)")
        self.optim.check("train.optim")
        check_choice("train.lr_schedule", self.lr_schedule, LR_SCHEDULES)
        check_choice("train.clock", self.clock, CLOCKS)
        if not self.calibration:
            raise config_error(
                "train.calibration", self.calibration, "name a file in conf/calibration/ or a path"
            )
        if self.batch_size < 1:
            raise config_error(
                "train.batch_size", self.batch_size, "use a positive number of sequences per update"
            )
        if not 0.0 <= self.batch_size_ramp <= 1.0:
            raise config_error(
                "train.batch_size_ramp", self.batch_size_ramp, "use a fraction of the budget in [0, 1]"
            )
        if self.warmup is not None and not 0.0 <= self.warmup < 1.0:
            raise config_error(
                "train.warmup", self.warmup, "use a fraction in [0, 1) or null for the default"
            )
        if self.steps is not None and self.steps < 1:
            raise config_error("train.steps", self.steps, "use a positive number of updates or null")
        if self.lr_schedule.startswith("steps-") and self.steps is None:
            raise config_error("train.steps", None, f"train.lr_schedule={self.lr_schedule} needs train.steps")
        if self.grad_clip is not None and self.grad_clip <= 0:
            raise config_error(
                "train.grad_clip", self.grad_clip, "use a positive norm or null to disable clipping"
            )
        if not 0.0 <= self.dropout < 1.0:
            raise config_error("train.dropout", self.dropout, "use a probability in [0, 1)")
        if self.log_every < 1:
            raise config_error("train.log_every", self.log_every, "use a positive number of updates")
        if self.checkpoint_every_min <= 0:
            raise config_error(
                "train.checkpoint_every_min", self.checkpoint_every_min, "use a positive number"
            )
        if self.max_nonfinite_updates < 1:
            raise config_error(
                "train.max_nonfinite_updates", self.max_nonfinite_updates, "use a positive count"
            )
        if self.batch_size_start < 1:
            raise config_error(
                "train.batch_size_start", self.batch_size_start, "use a positive number of sequences"
            )
        if self.validation_rows < 0:
            raise config_error("train.validation_rows", self.validation_rows, "use 0 (none) or more rows")


class PretrainRecipe(Protocol):
    """What the pretraining loop reads of a run's configuration. cramming.config.PretrainConfig (the whole
    `python pretrain.py` schema, which also knows evaluation and the trackers) is one; train/ does not import it."""

    arch: ArchConfig
    train: TrainConfig
    impl: ImplConfig
    budget: float  # hours of wall clock
    name: str
    seed: int
    base_dir: str
    resume: bool
