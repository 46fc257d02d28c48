"""Typed configuration of GLUE evaluation: the `eval` group and the top level of `python eval.py`."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from omegaconf import MISSING

from cramming.errors import check_choice, config_error
from cramming.eval.blimp import BlimpConfig
from cramming.eval.head import HeadConfig  # defined beside the poolers it names; importable from here
from cramming.eval.tasks import GLUE_SANE, GLUE_TASKS
from cramming.impl import ImplConfig
from cramming.optim import OPTIMIZERS
from cramming.optim.config import OptimConfig
from cramming.optim.schedules import LR_SCHEDULES
from cramming.trackers.config import TrackingConfig
from cramming.trackers.registry import check_trackers

# fine-tuning runs a known number of steps: the schedules of LR_SCHEDULES that count steps
SCHEDULES = tuple(name for name, schedule in LR_SCHEDULES.items() if schedule.clock == "steps")


def _glue_sane_optim() -> OptimConfig:
    """GLUE-sane's AdamW (lr 4e-5, betas (0.9, 0.98), eps 1e-6, no weight decay) and GaLore's GLUE settings
    (rank 8, scale 4, a new projection every 500 steps), read only by galore_* optimizers."""
    return OptimConfig(
        name="adamw",
        lr=4e-5,
        betas=[0.9, 0.98],
        eps=1e-6,
        weight_decay=0.0,
        rank=8,
        update_proj_gap=500,
        scale=4.0,
    )


@dataclass
class TaskOverride:
    """Per-task changes to the recipe (e.g. more epochs for the small tasks); null keeps the recipe's."""

    # passes over this task's training examples
    epochs: int | None = None
    # peak learning rate for this task (eval.optim.lr for the others)
    lr: float | None = None
    # examples per update for this task
    batch_size: int | None = None


@dataclass
class EvalConfig:
    """The `eval` group: which tasks, and the fine-tuning recipe (GLUE-sane by default)."""

    # a short label of the recipe, recorded in glue_results.json
    name: str = "glue-sane"
    # GLUE-sane's eight tasks by default, of which those whose files are absent are skipped (and named in the
    # summary); any other list names its tasks, and a named task that cannot be evaluated fails the run
    tasks: list[str] = field(default_factory=lambda: list(GLUE_SANE))
    # a local copy of GLUE in the original TSV layout (one folder per task); null reads nyu-mll/glue from the hub
    glue_dir: str | None = None
    # a bad row of a task file (missing field, unknown label, a score that is not a number) fails the run;
    # true: such rows are skipped, counted per task in glue_results.json (bad_rows_skipped) and logged
    skip_bad_rows: bool = False
    # passes over each task's training examples
    epochs: int = 5
    # examples per update
    batch_size: int = 16
    # inputs are truncated to this many tokens; batches are padded to their longest input only
    max_length: int = 128
    # the optimizer: eval.optim.name is any train/optim name; its settings as in train.optim
    optim: OptimConfig = field(default_factory=_glue_sane_optim)
    # the classifier head (cramming's by default; eval.head.dim=0: a bare linear layer)
    head: HeadConfig = field(default_factory=HeadConfig)
    # dropout of the encoder (hidden and attention) and of the head while fine-tuning; null: the checkpoint's
    # arch.dropout (pretraining runs without dropout, fine-tuning with it); 0: fine-tune without dropout
    dropout: float | None = None
    # batches of similar length (sorted within windows of 50 batches, batch order shuffled): less padding, the
    # same examples per epoch; false: plain random batches (GLUE-sane)
    group_by_length: bool = False
    # a steps-* schedule of cramming.optim.schedules.LR_SCHEDULES
    schedule: str = "steps-cosine"
    # fraction of the steps spent warming up linearly
    warmup: float = 0.1
    # global gradient-norm clipping; null: none (GLUE-sane does not clip)
    grad_clip: float | None = None
    # fine-tuning seeds per task; with several, tables show the median and the spread
    seeds: list[int] = field(default_factory=lambda: [0])
    # subsample the training / evaluation examples (for CPU-scale runs); null: all
    max_train_examples: int | None = None
    # the first this many evaluation examples of each task; null: all
    max_eval_examples: int | None = None
    # per task name (e.g. eval.per_task.RTE.epochs=10): epochs, lr or batch size of that task only
    per_task: dict[str, TaskOverride] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not self.tasks:
            raise config_error(
                "eval.tasks", self.tasks, "name at least one task, e.g. eval.tasks=[RTE,SST-2]"
            )
        for task in self.tasks:
            check_choice("eval.tasks", task, GLUE_TASKS)
        for key in ("tasks", "seeds"):
            repeated = sorted({str(x) for x in getattr(self, key) if getattr(self, key).count(x) > 1})
            if repeated:
                raise config_error(
                    f"eval.{key}",
                    getattr(self, key),
                    f"{', '.join(repeated)} appear(s) more than once: each run would be the same run again."
                    + (" For more runs per task, add seeds to eval.seeds" if key == "tasks" else ""),
                )
        for key in ("max_train_examples", "max_eval_examples"):
            if getattr(self, key) is not None and getattr(self, key) < 1:
                raise config_error(
                    f"eval.{key}", getattr(self, key), "use a positive number of examples, or null for all"
                )
        if self.glue_dir is not None and not Path(self.glue_dir).is_dir():
            raise config_error(
                "eval.glue_dir", self.glue_dir, "no such folder: point it at a local copy of GLUE in the"
                " original TSV layout (one folder per task), or null to read nyu-mll/glue from the hub"
            )  # fmt: skip
        for task in self.per_task:
            check_choice("eval.per_task", task, GLUE_TASKS)
        check_choice("eval.schedule", self.schedule, SCHEDULES)
        check_choice("eval.optim.name", self.optim.name, OPTIMIZERS)
        self.optim.check("eval.optim")
        self.head.check()
        for key in ("epochs", "batch_size", "max_length"):
            if getattr(self, key) < 1:
                raise config_error(f"eval.{key}", getattr(self, key), "use a positive integer")
        if self.dropout is not None and not 0.0 <= self.dropout < 1.0:
            raise config_error(
                "eval.dropout",
                self.dropout,
                "use a probability in [0, 1), or null for the checkpoint's arch.dropout",
            )
        if not 0.0 <= self.warmup < 1.0:
            raise config_error("eval.warmup", self.warmup, "use a fraction in [0, 1)")
        if not self.seeds:
            raise config_error("eval.seeds", self.seeds, "give at least one seed, e.g. [0] or [0,1,2,3,4]")

    @property
    def tasks_named(self) -> bool:
        """True when eval.tasks is not the recipe's default list: the user named these tasks, so each must be
        evaluated. (Told from the value, so a sweep or a YAML file naming tasks counts like the command line;
        naming exactly the default eight behaves like the default.)"""
        return tuple(self.tasks) != GLUE_SANE

    def for_task(self, task: str) -> tuple[int, float, int]:
        """(epochs, lr, batch_size) for `task`, after its overrides."""
        over = self.per_task.get(task, TaskOverride())
        return (
            over.epochs or self.epochs,
            over.lr or self.optim.lr,
            over.batch_size or self.batch_size,
        )


BENCHMARKS = ("glue", "blimp")


@dataclass
class EvalRunConfig:
    """`python eval.py`: evaluate one pretrained checkpoint, by fine-tuning on GLUE or zero-shot on BLiMP."""

    # glue: fine-tune and evaluate on GLUE (the `eval` settings); blimp: score BLiMP's minimal pairs zero-shot
    # (the `blimp` settings; `eval=blimp` selects it)
    benchmark: str = "glue"
    eval: EvalConfig = field(default_factory=EvalConfig)
    blimp: BlimpConfig = field(default_factory=BlimpConfig)
    # how fast, as in pretraining (device, precision, kernels, threads); the micro-batch is not used here
    impl: ImplConfig = field(default_factory=ImplConfig)
    # a run folder, its checkpoint/ folder, or a pretraining run name (its newest finished run)
    checkpoint: str = MISSING
    # outputs go to {base_dir}/{name}/{timestamp}/
    name: str = "glue"
    # added to every fine-tuning seed of eval.seeds
    seed: int = 0
    # where runs are looked up by name, and where this one writes
    base_dir: str = "outputs"
    # optional wall-clock budget for the whole evaluation, in hours; tasks not started in time are skipped
    budget: float | None = None
    # take the finished (task, seed) runs of the newest earlier evaluation of this `name` (its glue_runs.json,
    # written after every run) instead of fine-tuning them again; it must have used the same checkpoint and
    # recipe. The new folder gets the whole result
    resume: bool = False
    # experiment trackers the evaluation also goes to: tensorboard | wandb | mlflow (docs/tracking.md)
    trackers: list[str] = field(default_factory=list)
    # where they send it (W&B project and mode, MLflow URI)
    tracking: TrackingConfig = field(default_factory=TrackingConfig)

    def __post_init__(self) -> None:
        check_trackers(self.trackers)
        check_choice("benchmark", self.benchmark, BENCHMARKS)
        if self.budget is not None and self.budget <= 0:
            raise config_error("budget", self.budget, "give hours, e.g. budget=2, or null for no limit")
        if not self.name or "/" in self.name:
            raise config_error("name", self.name, "use a plain folder name without '/'")
