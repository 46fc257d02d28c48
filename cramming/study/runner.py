"""`python -m cramming.study run <study>`: every stage of every run of a study that is not done yet, through the
entry points' own Hydra multiruns.

A stage of a run is done when its figures are kept (cramming.study.kept), or when a run card of the same
command says ok; its figures are then kept. A run that a stop left `interrupted` (or `killed`) with something
to continue from is started again in its own folder, where pretrain.py finds its resumable state and eval.py
its finished runs, as a requeued cluster job does. Everything else runs afresh: the seeds of one recipe at one
budget as one multirun of pretrain.py, each evaluation stage of all runs as one multirun of eval.py.

Runs go N at once (the study's `parallel`) only where the clock allows it: pretraining on the reference clock
(train.clock=reference: each micro-batch is charged its calibrated cost, so neighbours do not change a result)
or as SLURM jobs; evaluations always (they have no budget). On the wall clock pretraining runs one at a time,
and the load average sampled while it ran is kept beside it.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import datetime as dt
import functools
import logging
import multiprocessing
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from cramming.config import CONF_DIR, register_configs, validate
from cramming.errors import ConfigError
from cramming.job.commandline import explain
from cramming.job.runcard import cards_under
from cramming.study import floor, kept, launch
from cramming.study.config import STAGES, StudyConfig
from cramming.study.figures import shape
from cramming.study.plan import (
    EVAL_STAGES,
    Point,
    eval_name,
    eval_overrides,
    normalized,
    points,
    pretrain_name,
)
from cramming.study.plan import pretrain_overrides as planned_pretraining

log = logging.getLogger("cramming")

CONTINUABLE = ("interrupted", "killed")
# what a stopped run leaves in its folder to continue from: a resumable state, or finished evaluation runs
LEFT_BEHIND = {"pretrain": ("state.pt", "state.prev.pt"), "blimp": ("blimp_scores.jsonl",),
               "glue1k": ("glue_runs.json",), "glue": ("glue_runs.json",)}  # fmt: skip


class StageFailed(RuntimeError):
    """A run of the study failed; the message names it and where its log is."""


@dataclass(frozen=True)
class Recipe:
    """What the study needs to know of a recipe's composed config."""

    clock: str  # wall | reference (train.clock; wall where the setting does not exist)
    arch: str


@dataclass
class Study:
    """A study being run: its settings, its runs, and what this process measured of them."""

    name: str
    config: StudyConfig
    plan: list[Point]
    keep: Path
    recipes: dict[str, Recipe]
    load_every: float = 30.0  # seconds between load-average samples
    loads: dict[str, dict] = field(default_factory=dict)  # label -> the load while it pretrained

    def overrides(self, point: Point) -> list[str]:
        """The recipe's overrides with those every recipe shares: what a kept run records of its recipe."""
        return [*self.config.pretrain, *self.config.recipes[point.recipe]]

    def shape(self, point: Point) -> str:
        return shape(self.recipes[point.recipe].arch, self.overrides(point))

    def pretrain_overrides(self, point: Point) -> list[str]:
        return planned_pretraining(self.config, self.name, point)

    def at_once(self, recipe: str | None) -> int:
        """How many runs may go at once: evaluations (recipe None) always `parallel`; pretraining only on the
        reference clock or as SLURM jobs."""
        if recipe is None or self.config.launcher == "slurm" or self.recipes[recipe].clock == "reference":
            return self.config.parallel
        return 1


# ------------------------------------------------------------------------------------------ the recipes


def compose_recipes(name: str, study: StudyConfig) -> dict[str, Recipe]:
    """Each recipe composed and checked as pretrain.py would (a misspelled override fails here, before any run
    starts, naming the recipe), with its clock and arch."""
    register_configs()
    found = {}
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        for recipe, overrides in study.recipes.items():
            try:
                cfg = compose("pretrain", overrides=[*study.pretrain, *overrides])
                validate(cfg)
            except Exception as err:  # Hydra's and OmegaConf's refusals, and ours: one line naming the recipe
                raise ConfigError(f"study {name}, recipe {recipe}: {explain(err)}") from err
            found[recipe] = Recipe(OmegaConf.select(cfg, "train.clock", default="wall"), cfg.arch.name)
    return found


def eval_threads(study: StudyConfig) -> int | None:
    """impl.cpu_threads of the study's evaluations (the floor is scored in this process with as many)."""
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        cfg = compose("eval", overrides=[*study.evaluate, "eval=blimp", "checkpoint=none"])
    return OmegaConf.select(cfg, "impl.cpu_threads")


# ------------------------------------------------------------------------------------------ the run cards


def runs_of(root: Path, overrides: list[str]) -> list[tuple[Path, dict]]:
    """(folder, card) of the runs under `root` whose command had exactly these overrides, oldest first."""
    wanted = normalized(overrides)
    return [
        (folder, card)
        for folder, card in cards_under(root)
        if normalized(card["job"].get("overrides", [])) == wanted
    ]


def finished_run(root: Path, overrides: list[str]) -> tuple[Path, dict] | None:
    """(folder, card) of the newest run of these overrides whose card says ok."""
    done = [(folder, card) for folder, card in runs_of(root, overrides) if card["status"] == "ok"]
    return done[-1] if done else None


def finished(root: Path, overrides: list[str]) -> Path | None:
    found = finished_run(root, overrides)
    return None if found is None else found[0]


def stopped(root: Path, overrides: list[str], stage: str) -> Path | None:
    """The newest run of these overrides, when a stop left it interrupted (or killed) with something to
    continue from in its folder."""
    found = runs_of(root, overrides)
    if not found:
        return None
    folder, card = found[-1]
    if card["status"] in CONTINUABLE and any((folder / name).exists() for name in LEFT_BEHIND[stage]):
        return folder
    return None


def stage_run(study: Study, point: Point, stage: str) -> tuple[Path, list[str]] | None:
    """(the folder its runs go under, the overrides) of one stage of a point; None for an evaluation whose
    pretraining has not finished here."""
    base = Path(study.config.base_dir)
    pretraining = base / pretrain_name(study.name, point), study.pretrain_overrides(point)
    if stage == "pretrain":
        return pretraining
    checkpoint = finished(*pretraining)
    if checkpoint is None:
        return None
    return base / eval_name(study.name, stage), eval_overrides(
        study.config, study.name, stage, str(checkpoint)
    )


def finished_stages(study: Study, point: Point) -> dict[str, Path]:
    """stage -> the folder of its newest finished run, for the stages of `point` that have one here."""
    found = {}
    for stage in ("pretrain", *EVAL_STAGES):
        where = stage_run(study, point, stage)
        folder = None if where is None else finished(*where)
        if folder is not None:
            found[stage] = folder
    return found


def keep(study: Study, points_: list[Point]) -> None:
    """Keep what the points' finished runs measured, with the load and the study's runs beside each."""
    windows = pretraining_windows(study)
    for point in points_:
        folders = finished_stages(study, point)
        extra = {}
        if "pretrain" in folders:
            beside = [
                label
                for label, w in windows.items()
                if label != point.label and overlaps(w, windows[point.label])
            ]
            extra["beside"] = {"pretrain": beside}
            if point.label in study.loads:
                extra["load_average"] = {"pretrain": study.loads[point.label]}
        if folders:
            kept.keep_run(study.keep, point, study.overrides(point), folders, extra)


def pretraining_windows(study: Study) -> dict[str, tuple[str, str]]:
    """label -> (started, finished) of each point's finished pretraining here, from its card."""
    found = {}
    for point in study.plan:
        run = finished_run(*stage_run(study, point, "pretrain"))
        if run is not None:
            found[point.label] = (run[1]["started"], run[1]["finished"])
    return found


def overlaps(a: tuple[str, str], b: tuple[str, str]) -> bool:
    return a[0] < b[1] and b[0] < a[1]  # ISO timestamps of one zone sort as times


# --------------------------------------------------------------------------------------------- the stages


def todo(study: Study, stage: str) -> list[Point]:
    """The points whose `stage` is neither kept nor finished here."""
    waiting = []
    for point in study.plan:
        if kept.has_stage(kept.read_run(study.keep, point.label), stage):
            continue
        where = stage_run(study, point, stage)
        if where is None or finished(*where) is None:
            waiting.append(point)
    return waiting


def sampled(study: Study, batch: list[Point], start) -> None:
    """Run `start()` (a launch returning its exit status) with the load average sampled, then keep what the
    batch's runs measured. Raises StageFailed when a run failed."""
    with launch.LoadSampler(study.load_every) as load:
        code = start()
    for point in batch:
        run = finished_run(*stage_run(study, point, "pretrain"))
        if run is not None:
            window = [dt.datetime.fromisoformat(run[1][key]).timestamp() for key in ("started", "finished")]
            summary = load.summary(*window)
            if summary is not None:
                study.loads[point.label] = summary
    keep(study, batch)
    if code != 0:
        raise StageFailed(
            f"{', '.join(p.label for p in batch)}: a run failed (exit {code}); its log says why"
        )


def continue_stopped(study: Study, stage: str, kind: str) -> None:
    """Each run of `stage` that a stop left with something to continue from, started again in its own folder."""
    for point in todo(study, stage):
        where = stage_run(study, point, stage)
        folder = None if where is None else stopped(*where, stage)
        if folder is not None:
            log.info("%s: continuing its %s in %s", point.label, stage, folder)
            sampled(study, [point], functools.partial(launch.call, launch.again_in(kind, where[1], folder)))


def seeds_multirun(study: Study, batch: list[Point], at_once: int) -> list[str]:
    """The command of one multirun over the seeds of points that share a recipe and budget."""
    overrides = stage_run(study, batch[0], "pretrain")[1]
    common = [o for o in overrides if not o.startswith("seed=")]
    seeds = list(dict.fromkeys(str(p.seed) for p in batch))
    return launch.multirun("pretrain", common, "seed", seeds, launch.launcher_args(study.config, at_once))


def run_pretraining(study: Study) -> None:
    """The pretraining runs not done yet: on the wall clock one at a time (stopped ones continued first, then
    one multirun per recipe and budget over its seeds); runs that may share the machine side by side."""
    waiting = todo(study, "pretrain")
    if study.config.parallel > 1 and waiting and all(study.at_once(p.recipe) > 1 for p in waiting):
        run_side_by_side(study, waiting)
        return
    if any(study.at_once(p.recipe) < study.config.parallel for p in waiting):
        log.info(
            "the wall clock, so one pretraining at a time (train.clock=reference lets runs share a machine)"
        )
    continue_stopped(study, "pretrain", "pretrain")
    groups: dict[str, list[Point]] = {}
    for point in todo(study, "pretrain"):
        groups.setdefault(point.group, []).append(point)
    for batch in groups.values():
        sampled(study, batch, functools.partial(launch.call, seeds_multirun(study, batch, 1)))


def run_side_by_side(study: Study, waiting: list[Point]) -> None:
    """`parallel` pretraining runs at a time, seed by seed (each wave compares recipes on the same seeds, so a
    study stopped early holds paired runs): a stopped run continues in its folder beside the wave's new runs,
    which go as one multirun per recipe and budget."""
    order = sorted(waiting, key=lambda p: p.seed)  # stable: the study's order within a seed
    size = study.config.parallel
    for wave in (order[i : i + size] for i in range(0, len(order), size)):
        commands, fresh = [], {}
        for point in wave:
            where = stage_run(study, point, "pretrain")
            folder = stopped(*where, "pretrain")
            if folder is not None:
                log.info("%s: continuing its pretraining in %s", point.label, folder)
                commands.append(launch.again_in("pretrain", where[1], folder))
            else:
                fresh.setdefault(point.group, []).append(point)
        commands += [seeds_multirun(study, batch, len(batch)) for batch in fresh.values()]
        log.info("side by side: %s", ", ".join(p.label for p in wave))
        sampled(study, wave, functools.partial(launch.call, *commands))


def run_evaluation(study: Study, stage: str) -> None:
    """One evaluation stage of every run that has not had it: stopped ones continued, the others one multirun
    over their checkpoints, `parallel` at once."""
    waiting = todo(study, stage)
    missing = [p for p in waiting if stage_run(study, p, stage) is None]
    if missing:
        elsewhere = [
            p.label for p in missing if kept.has_stage(kept.read_run(study.keep, p.label), "pretrain")
        ]
        raise ConfigError(
            f"{stage} of {', '.join(p.label for p in missing)}: no finished pretraining under"
            f" base_dir={study.config.base_dir}; run the pretrain stage first"
            + (f" (kept in {study.keep} but made elsewhere: {', '.join(elsewhere)}; remove their files there to"
               " pretrain them again here)" if elsewhere else "")
        )  # fmt: skip
    continue_stopped(study, stage, "eval")
    waiting = todo(study, stage)
    if not waiting:
        return
    runs = [stage_run(study, point, stage)[1] for point in waiting]
    common = [o for o in runs[0] if not o.startswith("checkpoint=")]
    checkpoints = list(
        dict.fromkeys(o.removeprefix("checkpoint=") for r in runs for o in r if o.startswith("checkpoint="))
    )
    launcher = launch.launcher_args(study.config, study.at_once(None))
    sampled(
        study,
        waiting,
        functools.partial(launch.call, launch.multirun("eval", common, "checkpoint", checkpoints, launcher)),
    )


def run_floors(study: Study) -> None:
    """The floor of each model shape of the study not kept yet, from a finished pretraining run of that shape
    (its 0-minute run where there is one: any run of the shape has its architecture and tokenizer). The random
    twins of all the floors to draw are scored `parallel` at a time, each in a process of its own."""
    have = kept.read_floors(study.keep) if study.keep.is_dir() else {}
    by_shape: dict[str, list[Point]] = {}
    for point in sorted(study.plan, key=lambda p: p.minutes != 0):
        by_shape.setdefault(study.shape(point), []).append(point)
    missing = [name for name in by_shape if name not in have]
    log.info("stage floor: %s", f"the floors of {', '.join(missing)} to draw" if missing else "nothing to do")
    if not missing:
        return
    sources = {}
    for name in missing:
        folders = [f for p in by_shape[name] if (f := finished(*stage_run(study, p, "pretrain"))) is not None]
        if not folders:
            raise ConfigError(f"the floor of {name} needs a finished pretraining run of that shape here; run the"
                              " pretrain stage first")  # fmt: skip
        sources[name] = folders[0]
        log.info("floor of %s: random twins of %s, seeds %s", name, folders[0], study.config.floor_seeds)
    cfg = study.config
    draws = [(name, seed) for name in missing for seed in cfg.floor_seeds]
    threads = eval_threads(cfg)
    with floor_pool(min(cfg.parallel, len(draws)), threads) as pool:
        futures = {
            draw: pool.submit(
                floor.floor, sources[draw[0]], draw[0], [draw[1]], cfg.blimp_dir, cfg.blimp_pairs
            )
            for draw in draws
        }
        for name in missing:  # each floor kept once its own twins are scored
            parts = [futures[(name, seed)].result() for seed in cfg.floor_seeds]
            log.info("floor of %s kept in %s", name, kept.write_floor(study.keep, name, floor.joined(parts)))


@contextlib.contextmanager
def floor_pool(workers: int, threads: int | None):
    """Where the floors' twins are scored: in this process when one at a time, else `workers` fresh processes
    (spawned: no copy of this process's threads or compiled state), each with `threads` threads."""
    _set_threads(threads)
    if workers <= 1:
        with concurrent.futures.ThreadPoolExecutor(max_workers=1) as pool:
            yield pool
        return
    context = multiprocessing.get_context("spawn")
    with concurrent.futures.ProcessPoolExecutor(
        max_workers=workers, mp_context=context, initializer=_set_threads, initargs=(threads,)
    ) as pool:
        try:
            yield pool
        except BaseException:  # a stop or a failed twin: the draws not started yet are not started
            pool.shutdown(wait=False, cancel_futures=True)
            raise


def _set_threads(threads: int | None) -> None:
    if threads:
        torch.set_num_threads(threads)


def run_study(
    name: str, config: StudyConfig, stages: list[str] | None = None, load_every: float = 30.0
) -> None:
    """Every stage of every run of the study that is not done yet, in the order pretrain, floor, blimp, glue1k,
    glue (or those of `stages`). Raises StageFailed when a run fails, launch.StudyStopped on a stop signal."""
    start = time.monotonic()
    recipes = compose_recipes(name, config)
    study = Study(name, config, points(config), kept.keep_folder(name, config), recipes, load_every)
    keep(
        study, study.plan
    )  # what finished here but was not kept yet (a stop between a run's end and its keeping)
    for stage in (s for s in STAGES if s in config.stages and (stages is None or s in stages)):
        if stage == "floor":
            run_floors(study)
            continue
        waiting = todo(study, stage)
        log.info("stage %s: %s", stage, f"{len(waiting)} run(s) to do" if waiting else "nothing to do")
        if stage == "pretrain":
            run_pretraining(study)
        elif waiting:
            run_evaluation(study, stage)
    log.info("study %s: done in %.1f min; kept in %s", name, (time.monotonic() - start) / 60, study.keep)
