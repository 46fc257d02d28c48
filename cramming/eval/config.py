"""Typed configuration of GLUE evaluation: the `eval` group and the top level of `python eval.py`."""

from __future__ import annotations

from dataclasses import dataclass, field

from omegaconf import MISSING

from cramming.errors import ConfigError, check_choice, config_error
from cramming.eval.tasks import GLUE_SANE, GLUE_TASKS
from cramming.impl import ImplConfig
from cramming.optim import OPTIMIZERS
from cramming.optim.config import OptimConfig

SCHEDULES = ("cosine", "linear", "constant")


@dataclass
class TaskOverride:
    """Per-task changes to the recipe (e.g. more epochs for the small tasks); null keeps the recipe's."""

    epochs: int | None = None
    lr: float | None = None
    batch_size: int | None = None


@dataclass
class EvalConfig:
    """The `eval` group: which tasks, and the fine-tuning recipe (GLUE-sane by default)."""

    name: str = "glue-sane"
    tasks: list[str] = field(default_factory=lambda: list(GLUE_SANE))
    # a local copy of GLUE in the original TSV layout (one folder per task); null reads nyu-mll/glue from the hub
    glue_dir: str | None = None
    epochs: int = 5
    batch_size: int = 16
    # inputs are truncated to this many tokens; batches are padded to their longest input only
    max_length: int = 128
    # the optimizer, by its Hugging Face `optim` name (any of train/optim), and its settings
    optim: str = "adamw"
    lr: float = 4e-5
    betas: list[float] = field(default_factory=lambda: [0.9, 0.98])
    eps: float = 1e-6
    weight_decay: float = 0.0
    # GaLore's `optim_args` for fine-tuning (the paper's GLUE settings); read only by galore_* optimizers
    rank: int = 8
    update_proj_gap: int = 500
    scale: float = 4.0
    proj_type: str = "std"
    target_modules: list[str] = field(default_factory=lambda: ["all-linear"])
    schedule: str = "cosine"
    # fraction of the steps spent warming up linearly
    warmup: float = 0.1
    # global gradient-norm clipping; null: none (GLUE-sane does not clip)
    grad_clip: float | None = None
    # fine-tuning seeds per task; with several, tables show the median and the spread
    seeds: list[int] = field(default_factory=lambda: [0])
    # subsample the training / evaluation examples (for CPU-scale runs); null: all
    max_train_examples: int | None = None
    max_eval_examples: int | None = None
    per_task: dict[str, TaskOverride] = field(default_factory=dict)

    def __post_init__(self) -> None:
        for task in self.tasks:
            check_choice("eval.tasks", task, GLUE_TASKS)
        for task in self.per_task:
            check_choice("eval.per_task", task, GLUE_TASKS)
        check_choice("eval.schedule", self.schedule, SCHEDULES)
        check_choice("eval.optim", self.optim, OPTIMIZERS)
        for key in ("epochs", "batch_size", "max_length"):
            if getattr(self, key) < 1:
                raise config_error(f"eval.{key}", getattr(self, key), "use a positive integer")
        if not 0.0 <= self.warmup < 1.0:
            raise config_error("eval.warmup", self.warmup, "use a fraction in [0, 1)")
        if not self.seeds:
            raise config_error("eval.seeds", self.seeds, "give at least one seed, e.g. [0] or [0,1,2,3,4]")
        self.optim_config()  # validates the optimizer settings now, not after the first task

    def optim_config(self, lr: float | None = None) -> OptimConfig:
        """The OptimConfig these settings describe (errors name the eval.* key)."""
        try:
            return OptimConfig(
                name=self.optim,
                lr=self.lr if lr is None else lr,
                betas=list(self.betas),
                eps=self.eps,
                weight_decay=self.weight_decay,
                rank=self.rank,
                update_proj_gap=self.update_proj_gap,
                scale=self.scale,
                proj_type=self.proj_type,
                target_modules=list(self.target_modules),
            )
        except ConfigError as err:
            raise ConfigError(
                str(err).replace("`train.optim.name`", "`eval.optim`").replace("train.optim.", "eval.")
            ) from err

    def for_task(self, task: str) -> tuple[int, float, int]:
        """(epochs, lr, batch_size) for `task`, after its overrides."""
        over = self.per_task.get(task, TaskOverride())
        return (
            over.epochs or self.epochs,
            over.lr or self.lr,
            over.batch_size or self.batch_size,
        )


@dataclass
class EvalRunConfig:
    """`python eval.py`: fine-tune and evaluate one pretrained checkpoint on GLUE."""

    eval: EvalConfig = MISSING
    impl: ImplConfig = field(default_factory=ImplConfig)
    # a run folder, its checkpoint/ folder, or a pretraining run name (its newest finished run)
    checkpoint: str = MISSING
    # outputs go to {base_dir}/{name}/{timestamp}/
    name: str = "glue"
    seed: int = 0
    # where runs are looked up by name, and where this one writes
    base_dir: str = "outputs"
    # optional wall-clock budget for the whole evaluation, in hours; tasks not started in time are skipped
    budget: float | None = None

    def __post_init__(self) -> None:
        if self.budget is not None and self.budget <= 0:
            raise config_error("budget", self.budget, "give hours, e.g. budget=2, or null for no limit")
        if not self.name or "/" in self.name:
            raise config_error("name", self.name, "use a plain folder name without '/'")
