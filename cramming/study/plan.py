"""A study's runs and the command line of each stage of each: what `run` starts and how it recognizes a finished
stage (a run card of the same overrides that says ok)."""

from __future__ import annotations

from dataclasses import dataclass

from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.errors import HydraException

from cramming.study.config import StudyConfig

EVAL_STAGES = ("blimp", "glue1k", "glue")


@dataclass(frozen=True)
class Point:
    """One pretraining run of a study and the stages that score it."""

    label: str
    recipe: str
    minutes: float
    seed: int

    @property
    def group(self) -> str:
        """The runs that differ only in their seed share one multirun: <recipe>-<minutes>."""
        return f"{self.recipe}-{minutes_text(self.minutes)}"


def minutes_text(minutes: float) -> str:
    return f"{minutes:g}"


def points(study: StudyConfig) -> list[Point]:
    """The study's runs in its order: its `points`, or every recipe at every budget with every seed."""
    return [Point(label, recipe, minutes, seed) for label, recipe, minutes, seed in study.runs()]


def normalized(overrides: list[str]) -> list[str]:
    """Overrides as Hydra writes them back for the jobs of a multirun (`train.optim.lr=2e-3` reads 0.002; a key
    given twice, as a recipe's rate over the study's, once with its last value), in sorted order: how two commands
    are told to be the same. Unparsable ones are kept as they are."""
    try:
        parsed = OverridesParser.create().parse_overrides(list(overrides))
    except HydraException:
        return sorted(overrides)
    last = {o.get_key_element(): o.get_value_element_as_str() for o in parsed}
    return sorted(f"{key}={value}" for key, value in last.items())


def budget_overrides(minutes: float) -> list[str]:
    """pretrain.py's budget (hours) for `minutes`; 0 minutes is one update at the warm-up rate."""
    return ["budget=1", "train.steps=1"] if minutes == 0 else [f"budget={minutes / 60:g}"]


def pretrain_name(name: str, point: Point) -> str:
    return f"{name}-{point.group}"


def pretrain_overrides(study: StudyConfig, name: str, point: Point) -> list[str]:
    """The overrides of the point's pretraining, as its run card records them (the seed as one value)."""
    return [
        *study.pretrain,
        *study.recipes[point.recipe],
        *budget_overrides(point.minutes),
        f"base_dir={study.base_dir}",
        f"name={pretrain_name(name, point)}",
        f"seed={point.seed}",
    ]


def eval_name(name: str, stage: str) -> str:
    return f"{name}-{stage}"


def eval_overrides(study: StudyConfig, name: str, stage: str, checkpoint: str) -> list[str]:
    """The overrides of one evaluation stage of the run whose pretraining folder is `checkpoint`."""
    if stage == "blimp":
        scoring = ["eval=blimp"]
        scoring += [f"blimp.dir={study.blimp_dir}"] if study.blimp_dir else []
        scoring += [f"blimp.pairs_per_paradigm={study.blimp_pairs}"] if study.blimp_pairs else []
    else:
        scoring = [f"eval={study.glue}"]
        scoring += [f"eval.glue_dir={study.glue_dir}"] if study.glue_dir else []
        scoring += ["eval.max_train_examples=1000"] if stage == "glue1k" else []
    return [
        *study.evaluate,
        *scoring,
        f"base_dir={study.base_dir}",
        f"name={eval_name(name, stage)}",
        f"checkpoint={checkpoint}",
    ]
