"""Evaluate one checkpoint on a list of GLUE tasks: every task and seed, then the tables."""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path

from cramming.budget import BudgetClock
from cramming.errors import ConfigError, DataSourceError
from cramming.eval.backbone import Backbone
from cramming.eval.config import EvalConfig, EvalRunConfig
from cramming.eval.finetune import EvaluationStopped, GlueRuns, finetune_tasks
from cramming.eval.glue_data import TaskDataMissing, load_task
from cramming.eval.scores import EntryScore, glue_average, markdown_table, summarize
from cramming.eval.tasks import GLUE_TASKS
from cramming.impl import ImplConfig, dtype_name
from cramming.model.checkpoint import load_pretrained
from cramming.runs import earlier_run, refuse_other_settings
from cramming.signals import catch_stop_signals
from cramming.utils import atomic_write_text, flatten

log = logging.getLogger("cramming")

RESULTS_JSON = "glue_results.json"
RESULTS_TABLE = "glue_results.md"
# every (task, seed) finished so far and the recipe they ran with, rewritten after each: what resume=true reads
RUNS_JSON = "glue_runs.json"
# the settings of impl that change what fine-tuning computes (the rest change only its speed)
IMPL_NUMERICS = ("device", "precision", "attention", "layernorm", "ffn_activation")
# recipe settings added after evaluations were saved without them, with the value those evaluations ran
# with: a saved recipe that lacks one reads as that value, so resume=true still takes it up. A setting added
# to EvalConfig (or its optim) with a default that keeps what fine-tuning did before belongs here.
ADDED_LATER = {"eval.optim.layer_decay": 1.0, "eval.dropout": None}


def checkpoint_backbone(
    checkpoint: str | Path, impl: ImplConfig, base_dir: str | Path = "outputs"
) -> Backbone:
    """The encoder of a cramming checkpoint (built with the arch's fine-tuning dropout), on impl's device."""
    pretrained = load_pretrained(
        checkpoint,
        base_dir,
        device=impl.torch_device(),
        **impl.kernel_choices(),
    )
    arch = pretrained.model.arch
    return Backbone(
        encoder=pretrained.model.encoder,
        hidden_size=arch.hidden_size,
        dropout=arch.dropout,
        tokenizer=pretrained.tokenizer,
        pad_id=pretrained.config["special_tokens"]["pad"],
        max_positions=arch.max_seq_length,
        info={"checkpoint": str(pretrained.path), "pretraining": pretrained.config.get("training", {})},
    )


def load_tasks(cfg: EvalRunConfig) -> tuple[list, list[str], dict[str, list[str]]]:
    """(task, splits) of every task that can be had, the tasks skipped for lack of data, and the bad rows
    skipped per task (eval.skip_bad_rows). A task whose files are absent is skipped only from the default
    task list; a task the user named, or a file that does not read, raises DataSourceError."""
    jobs, skipped, bad_rows = [], [], {}
    for name in cfg.eval.tasks:
        task = GLUE_TASKS[name]
        bad = [] if cfg.eval.skip_bad_rows else None
        try:
            splits = load_task(task, cfg.eval.glue_dir, Path(cfg.base_dir) / "data" / "hf", bad_rows=bad)
        except TaskDataMissing as err:
            if cfg.eval.tasks_named:
                raise DataSourceError(missing_task_message(err, name, cfg.eval)) from err
            log.warning("skipping a task of the default list: %s", err)
            skipped.append(name)
            continue
        if bad:
            log.warning("%s: %d bad rows skipped (eval.skip_bad_rows), e.g. %s", name, len(bad), bad[0])
            bad_rows[name] = bad
        jobs.append((task, splits))
    return jobs, skipped, bad_rows


def missing_task_message(err: TaskDataMissing, name: str, cfg: EvalConfig) -> str:
    """Why a task of the evaluation has no data, and the fix: a local copy when the hub could not be read (every
    task needs one then), else that task added to eval.glue_dir or left out of the list it is in."""
    if cfg.glue_dir is None:
        return f"{err} (`python scripts/get_data.py glue --out data/glue` makes one where there is network)"
    others = ",".join(task for task in cfg.tasks if task != name)
    return (
        f"{err}. {name} is one of the tasks of this evaluation (eval.tasks={','.join(cfg.tasks)}): add its files to"
        f" {cfg.glue_dir} (`python scripts/get_data.py glue --tasks {name}`), or leave it out: 'eval.tasks=[{others}]'"
    )


def recipe_of(cfg: EvalRunConfig, source: str) -> dict:
    """What a fine-tuning run's result depends on besides its task and seed, as JSON reads it back."""
    tuning = asdict(cfg.eval)
    del tuning["tasks"], tuning["seeds"]  # which runs there are, not how each runs
    if tuning["glue_dir"] is not None:
        tuning["glue_dir"] = str(Path(tuning["glue_dir"]).resolve())
    impl = asdict(cfg.impl)
    numerics = {key: impl[key] for key in IMPL_NUMERICS}
    # what `auto` resolves to on this machine (bf16 on one CPU, fp32 on another): a resumed evaluation must
    # not mix runs of the two
    dtype, _ = cfg.impl.precision_choice(cfg.impl.torch_device())
    numerics["precision"] = dtype_name(dtype)
    recipe = {"checkpoint": source, "eval": tuning, "impl": numerics}
    return json.loads(json.dumps(recipe))


def earlier_evaluation(cfg: EvalRunConfig, run_dir: Path, sweep_job: int | None) -> Path | None:
    """The folder whose finished runs this evaluation takes up (cramming.runs.earlier_run): its own when it
    holds runs (a requeued sweep job), else with resume=true the newest earlier evaluation of cfg.name (job N
    of the newest multirun for job N: the recipe check below refuses a job N that ran something else)."""
    return earlier_run(
        run_dir, (RUNS_JSON,), resume=cfg.resume, base_dir=cfg.base_dir, name=cfg.name, what="evaluation",
        sweep_job=sweep_job,
    )  # fmt: skip


def earlier_runs(
    cfg: EvalRunConfig, recipe: dict, run_dir: Path, sweep_job: int | None = None
) -> dict[tuple[str, int], dict]:
    """The finished runs of the earlier evaluation this one continues (earlier_evaluation), keyed by
    (task, seed); none for a fresh evaluation.

    Runs the eval budget stopped are left out (they run again). Raises ConfigError when resume=true finds no
    earlier evaluation, or when it used another checkpoint or recipe (naming the settings that differ)."""
    folder = earlier_evaluation(cfg, run_dir, sweep_job)
    if folder is None:
        return {}
    path = folder / RUNS_JSON
    try:
        saved = json.loads(path.read_text())
        theirs, kept = ADDED_LATER | flatten(saved["recipe"]), list(saved["runs"])
    except (ValueError, KeyError, TypeError, AttributeError) as err:
        raise ConfigError(
            f"resume=true: {path} does not read as an evaluation's runs ({err!r}); move it away to resume the"
            " evaluation before it, or drop resume=true"
        ) from err
    refuse_other_settings(
        theirs, flatten(recipe), what=f"{path.parent} ran with another checkpoint or recipe",
        fix="Resume with the same settings, or evaluate afresh under a new `name`", shown=4,
    )  # fmt: skip
    runs = {
        (run["task"], run["seed"]): {"reused_from": str(path.parent)} | run
        for run in kept
        if not run["stopped_by_budget"]
    }
    log.info("resume: %d finished runs of %s are reused", len(runs), path.parent)
    return runs


def checkpoint_source(backbone: Backbone) -> str:
    """What the backbone was loaded from: its checkpoint, or its transformers folder."""
    return backbone.info.get("checkpoint") or backbone.info.get("path", "")


def tasks_with_data(cfg: EvalRunConfig) -> tuple[list, list[str], dict[str, list[str]]]:
    """load_tasks, refusing an evaluation that is left without a task (DataSourceError)."""
    jobs, skipped, bad_rows = load_tasks(cfg)
    if not jobs:
        raise DataSourceError(
            f"no task could be evaluated: none of {', '.join(skipped)} has data in"
            f" {cfg.eval.glue_dir or 'the hub'}; point eval.glue_dir at a copy of GLUE in the original TSV layout"
        )
    return jobs, skipped, bad_rows


def finetune_keeping_runs(
    cfg: EvalRunConfig,
    jobs: list,
    backbone: Backbone,
    budget: BudgetClock | None,
    done: dict[tuple[str, int], dict],
    recipe: dict,
    run_dir: Path,
) -> GlueRuns:
    """finetune_tasks on every seed of cfg.eval.seeds, rewriting RUNS_JSON after each finished (task, seed).

    A stop signal is only noted while the runs go (cramming.signals) and acted on after an update, never
    inside whatever code it lands in: EvaluationStopped, raised once submitit's handler is back in place, so
    that the entry point can hand a cluster job back for a requeue or exit 128 + the signal (cramming.job.exits)."""
    seeds = [cfg.seed + seed for seed in cfg.eval.seeds]
    finished: list[dict] = []

    def keep(record: dict) -> None:
        finished.append(record)
        atomic_write_text(
            run_dir / RUNS_JSON, json.dumps({"recipe": recipe, "runs": finished}, indent=1) + "\n"
        )

    with catch_stop_signals("stopping after this update; the finished runs are kept") as signals:
        try:
            return finetune_tasks(
                jobs, backbone, cfg.eval, cfg.impl, seeds, budget, done=done, on_run=keep, stop=signals
            )
        except EvaluationStopped as stopped:
            interrupted = stopped
    log.warning(
        "%s: %d finished (task, seed) runs are kept in %s", interrupted, len(finished), run_dir / RUNS_JSON
    )
    raise interrupted  # a cluster job is requeued and takes up its finished runs (cramming.job.exits.end_stopped)


def glue_report(
    cfg: EvalRunConfig,
    backbone: Backbone,
    glue: GlueRuns,
    scores: dict[str, EntryScore],
    skipped: list[str],
    bad_rows: dict[str, list[str]],
    start: float,
) -> dict:
    """What RESULTS_JSON holds: the checkpoint and config, every run, the scores and the GLUE average, what was
    left out and why, and the seconds since `start` (time.perf_counter)."""
    average, used = glue_average(scores)
    return {
        "checkpoint": checkpoint_source(backbone),
        "pretraining": backbone.info.get("pretraining", {}),
        "optimizer": cfg.eval.optim.name,
        "config": asdict(cfg),
        "runs": glue.runs,
        "scores": {e: {"metric": s.metric, "median": s.median, "spread": s.spread, "per_seed": s.per_seed,
                       "medians": s.medians} for e, s in scores.items()},
        "glue_average": average,
        "average_entries": used,
        "skipped_no_data": skipped,
        "bad_rows_skipped": {task: len(rows) for task, rows in bad_rows.items()},
        "not_run_budget": glue.not_run,
        "reused_runs": sum("reused_from" in run for run in glue.runs),
        "seconds": time.perf_counter() - start,
    }  # fmt: skip


def results_table(scores: dict[str, EntryScore], report: dict) -> str:
    """RESULTS_TABLE below its header: the scores of glue_report's `report`, then a line each for the runs
    reused and the bad rows skipped, if any."""
    if scores:
        table = markdown_table(scores, report["skipped_no_data"], report["not_run_budget"])
    else:
        table = "No task could be evaluated.\n"
    reused = report["reused_runs"]
    if reused:
        table += f"Reused (resume=true): {reused} of {len(report['runs'])} runs, fine-tuned earlier with this recipe.\n"
    if report["bad_rows_skipped"]:
        counts = ", ".join(f"{task} {n}" for task, n in report["bad_rows_skipped"].items())
        table += f"Bad rows skipped (eval.skip_bad_rows): {counts}.\n"
    return table


def glue_record(report: dict) -> dict:
    """run_glue's scores as one metrics record for the trackers: every (task, seed)'s metrics under
    glue/<entry>/seed_<seed>/<metric>, each entry's medians over the seeds under glue/<entry>/<metric>, and
    the GLUE average."""
    glue: dict[str, dict] = {}
    for run in report["runs"]:
        for entry, metrics in run["metrics"].items():
            glue.setdefault(entry, {})[f"seed_{run['seed']}"] = dict(metrics)
    for entry, score in report["scores"].items():
        glue.setdefault(entry, {}).update(score["medians"])
    return {"glue": glue, "glue_average": report["glue_average"]}


def run_glue(
    cfg: EvalRunConfig,
    backbone: Backbone,
    run_dir: Path,
    clock: Callable[[], float] = time.monotonic,
    sweep_job: int | None = None,
) -> dict:
    """Fine-tune and evaluate every task of cfg.eval.tasks; writes the JSON and markdown table to run_dir,
    and after every finished (task, seed) the runs so far (RUNS_JSON), which a requeued job and resume=true
    take up. sweep_job: the job's number in a multirun (resume=true continues the same job of the last one)."""
    run_dir.mkdir(parents=True, exist_ok=True)
    dtype, why = cfg.impl.precision_choice(cfg.impl.torch_device())
    log.info("fine-tuning precision %s (%s)", dtype_name(dtype), why)
    budget = BudgetClock(cfg.budget, clock) if cfg.budget is not None else None
    start = time.perf_counter()
    recipe = recipe_of(cfg, checkpoint_source(backbone))
    done = earlier_runs(cfg, recipe, run_dir, sweep_job)
    jobs, skipped, bad_rows = tasks_with_data(cfg)
    glue = finetune_keeping_runs(cfg, jobs, backbone, budget, done, recipe, run_dir)
    scores = summarize(glue.per_entry)
    report = glue_report(cfg, backbone, glue, scores, skipped, bad_rows, start)
    atomic_write_text(run_dir / RESULTS_JSON, json.dumps(report, indent=2) + "\n")
    table = results_table(scores, report)
    header = (
        f"# GLUE: {report['checkpoint']}\n\nOptimizer `{cfg.eval.optim.name}`, recipe `{cfg.eval.name}`.\n\n"
    )
    atomic_write_text(run_dir / RESULTS_TABLE, header + table)
    log.info("GLUE results:\n%s", table)
    if skipped:
        log.warning("skipped for lack of data (not named in eval.tasks): %s", ", ".join(skipped))
    if glue.not_run:
        log.warning("the eval budget ran out before: %s", ", ".join(glue.not_run))
    return report
