"""The study file, `conf/study/<name>.yaml`: recipes compared at budgets over seeds, and the stages that score them.

A study is data: which pretraining recipes (sets of `pretrain.py` overrides, one of them the control), at
which budgets, with which seeds, scored by which stages. `python -m cramming.study run <study>` runs what is
not done yet and `report` judges what the kept figures say (docs/studies.md). Every key has a default except
`recipes`, and `minutes` unless `points` names the runs; `load_study` checks the file once, and a wrong key
or value is refused in one line naming it and the fix.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from pathlib import Path

import yaml
from omegaconf import MISSING, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from cramming.config import CONF_DIR
from cramming.errors import ConfigError, config_error
from cramming.job.commandline import explain

STUDY_DIR = CONF_DIR / "study"
# what each stage runs; `floor` is computed in the study's own process (cramming.study.floor)
STAGES = ("pretrain", "floor", "blimp", "glue1k", "glue")
LAUNCHERS = ("joblib", "slurm")
# keys the study sets itself on every run it starts: a recipe that set them would fight it
OWN_KEYS = ("seed", "budget", "name", "base_dir", "resume", "checkpoint")
LABEL = re.compile(r"[A-Za-z0-9][A-Za-z0-9._+=-]*")


@dataclass
class PointConfig:
    """One pretraining run of the study: a recipe at a budget with a seed."""

    recipe: str = MISSING
    minutes: float = MISSING
    seed: int = 0
    # the run's name in tables and kept files; null: <recipe>-<minutes>-s<seed>
    label: str | None = None


@dataclass
class StudyConfig:
    """A study file. Budgets are minutes of the pretraining budget (`budget=` of pretrain.py is hours)."""

    # the report's heading; empty: the study's name
    title: str = ""
    # pretrain.py overrides that every recipe shares, e.g. [+sweep=cpu-study]
    pretrain: list[str] = field(default_factory=list)
    # recipe name -> its pretrain.py overrides on top of `pretrain` ([] is `pretrain` alone)
    recipes: dict[str, list[str]] = MISSING
    # the recipe the others are compared with; null: the first
    control: str | None = None
    # only these recipes' runs, e.g. `only=[6layers,8layers]` on the command line to score one change beside
    # the control before the study's other recipes are pretrained; empty: every recipe
    only: list[str] = field(default_factory=list)
    seeds: list[int] = field(default_factory=lambda: [0])
    # budgets in minutes; 0 is no pretraining: one update at the warm-up rate (train.steps=1)
    minutes: list[float] = field(default_factory=list)
    # the runs, when not every recipe at every budget with every seed: each names its recipe, minutes, seed
    points: list[PointConfig] = field(default_factory=list)
    # what scores each run: pretrain, floor (BLiMP of random weights of each model shape), blimp, glue1k
    # (GLUE with 1,000 training examples per task), glue (all training examples)
    stages: list[str] = field(default_factory=lambda: ["pretrain", "floor", "blimp"])
    # eval.py overrides that every evaluation shares, e.g. [impl.cpu_threads=1]
    evaluate: list[str] = field(default_factory=list)
    # the eval= recipe of the GLUE stages
    glue: str = "glue-small"
    # GLUE's TSV folders (scripts/get_data.py glue --out data/glue); null: the Hugging Face hub
    glue_dir: str | None = None
    # BLiMP's <UID>.jsonl[.gz] files; null: the hub (then the report has no published references)
    blimp_dir: str | None = None
    # the first N pairs of each BLiMP paradigm, for the runs and the floor alike; null: all 1,000
    blimp_pairs: int | None = None
    # the random-weight draws of each shape's floor
    floor_seeds: list[int] = field(default_factory=lambda: [0, 1, 2])
    # runs at once where the clock allows it: pretraining on the reference clock (train.clock=reference) or
    # as SLURM jobs; evaluations, which have no budget, always
    parallel: int = 1
    # how runs start when parallel > 1: joblib (processes on this machine) or slurm (submitit, one job each)
    launcher: str = "joblib"
    # Hydra overrides of the launcher, e.g. [hydra.launcher.partition=gpu]
    launcher_overrides: list[str] = field(default_factory=list)
    # the runs' folders: <base_dir>/<study>-<recipe>-<minutes>/..., <base_dir>/<study>-<stage>/...
    base_dir: str = "outputs"
    # the kept figures, one small JSON a run, that outlive the run folders; null: results/<study>/runs
    keep: str | None = None
    # where `report` writes report.md and curve.png; null: results/<study>
    out: str | None = None

    def __post_init__(self) -> None:
        if not self.recipes:
            raise config_error("recipes", {}, "name at least one recipe, e.g. recipes: {baseline: []}")
        for name, overrides in self.recipes.items():
            check_label(f"recipes.{name}", name)
            check_overrides(f"recipes.{name}", overrides)
        check_overrides("pretrain", self.pretrain)
        check_overrides("evaluate", self.evaluate)
        if self.control is not None and self.control not in self.recipes:
            raise config_error("control", self.control, f"name one of the recipes: {', '.join(self.recipes)}")
        for name in self.only:
            if name not in self.recipes:
                raise config_error(
                    "only", list(self.only), f"name recipes of the study: {', '.join(self.recipes)}"
                )
        for key in ("seeds", "floor_seeds"):
            values = getattr(self, key)
            if not values or len(set(values)) != len(values) or min(values) < 0:
                raise config_error(key, list(values), "give distinct seeds of 0 or more, e.g. [0, 1, 2]")
        if (not self.minutes and not self.points) or any(not math.isfinite(m) or m < 0 for m in self.minutes):
            raise config_error(
                "minutes", list(self.minutes), "give budgets of 0 minutes or more, e.g. [15, 60]"
            )
        for i, point in enumerate(self.points):
            check_point(f"points[{i}]", point, self.recipes)
        labels = [label for label, *_ in self.runs()]
        twice = sorted({label for label in labels if labels.count(label) > 1})
        if twice:
            raise config_error("points", twice, "give each run a label of its own (`label:`)")
        for stage in self.stages:
            if stage not in STAGES:
                raise config_error("stages", list(self.stages), f"choose from: {', '.join(STAGES)}")
        if self.blimp_pairs is not None and self.blimp_pairs < 1:
            raise config_error("blimp_pairs", self.blimp_pairs, "give at least 1, or null for all pairs")
        if self.parallel < 1:
            raise config_error("parallel", self.parallel, "give how many runs may go at once: 1 or more")
        if self.launcher not in LAUNCHERS:
            raise config_error("launcher", self.launcher, f"choose one of: {', '.join(LAUNCHERS)}")

    @property
    def control_recipe(self) -> str:
        return self.control or next(iter(self.recipes))

    def runs(self) -> list[tuple[str, str, float, int]]:
        """(label, recipe, minutes, seed) of each run: its `points`, or every recipe at every budget with every
        seed; a label left out is <recipe>-<minutes>-s<seed>."""
        if self.points:
            chosen = [(p.label, p.recipe, p.minutes, p.seed) for p in self.points]
        else:
            chosen = [(None, r, m, s) for r in self.recipes for m in self.minutes for s in self.seeds]
        if self.only:
            chosen = [c for c in chosen if c[1] in self.only]
        return [(label or f"{r}-{m:g}-s{s}", r, m, s) for label, r, m, s in chosen]


def check_label(key: str, value: str) -> None:
    """Recipe names and labels name run folders and files: letters, digits and . _ + = - only."""
    if not LABEL.fullmatch(value):
        raise config_error(key, value, "use letters, digits and . _ + = - only (it names run folders)")


def check_overrides(key: str, overrides: list[str]) -> None:
    """Each override is key=value, and none sets what the study sets on every run itself."""
    for override in overrides:
        name, sep, _ = override.partition("=")
        if not sep or not name.strip("+~"):
            raise config_error(key, override, "write each override as key=value, e.g. train.optim.lr=2e-3")
        if name.lstrip("+~") in OWN_KEYS or name.startswith("hydra"):
            raise config_error(
                key,
                override,
                f"the study sets {name} itself: give seeds under `seeds`, budgets under `minutes`",
            )


def check_point(key: str, point: PointConfig, recipes: dict[str, list[str]]) -> None:
    if point.recipe not in recipes:
        raise config_error(f"{key}.recipe", point.recipe, f"name one of the recipes: {', '.join(recipes)}")
    if not math.isfinite(point.minutes) or point.minutes < 0:
        raise config_error(f"{key}.minutes", point.minutes, "give a budget of 0 minutes or more")
    if point.seed < 0:
        raise config_error(f"{key}.seed", point.seed, "give a seed of 0 or more")
    if point.label is not None:
        check_label(f"{key}.label", point.label)


def study_path(study: str) -> Path:
    """conf/study/<study>.yaml, or `study` itself when it is a YAML file."""
    given = Path(study)
    if given.suffix in (".yaml", ".yml"):
        if not given.is_file():
            raise ConfigError(
                f"study file {given} does not exist: give conf/study/<name>.yaml or a study's name"
            )
        return given
    path = STUDY_DIR / f"{study}.yaml"
    if not path.is_file():
        known = ", ".join(sorted(p.stem for p in STUDY_DIR.glob("*.yaml"))) or "none"
        raise ConfigError(
            f"no study named {study!r}: the studies of conf/study/ are {known}, or give a YAML file"
        )
    return path


def load_study(study: str, overrides: list[str] = ()) -> tuple[str, StudyConfig]:
    """(the study's name, its checked settings) from its file with `key=value` overrides of the study's keys."""
    path = study_path(study)
    try:
        merged = OmegaConf.merge(
            OmegaConf.structured(StudyConfig), OmegaConf.load(path), OmegaConf.from_dotlist(list(overrides))
        )
        if OmegaConf.is_missing(merged, "recipes"):
            raise ConfigError(
                "no `recipes`: name the recipes the study compares, e.g. recipes: {baseline: []}"
            )
        config = OmegaConf.to_object(merged)
    except ConfigError as err:
        raise ConfigError(f"{path}: {err}") from err
    except (OmegaConfBaseException, ValueError, yaml.YAMLError) as err:
        raise ConfigError(f"{path}: {explain(err)}") from err
    return path.stem, config
