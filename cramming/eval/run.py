"""Evaluate one checkpoint on a list of GLUE tasks: every task and seed, then the tables."""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path

from cramming.budget import BudgetClock
from cramming.errors import DataSourceError
from cramming.eval.config import EvalRunConfig
from cramming.eval.finetune import finetune
from cramming.eval.glue_data import load_task
from cramming.eval.scores import glue_average, markdown_table, summarize
from cramming.eval.tasks import GLUE_TASKS
from cramming.model.checkpoint import MODEL_CONFIG
from cramming.utils import atomic_write_text

log = logging.getLogger("cramming")

RESULTS_JSON = "glue_results.json"
RESULTS_TABLE = "glue_results.md"


def run_glue(
    cfg: EvalRunConfig, checkpoint: Path, run_dir: Path, clock: Callable[[], float] = time.monotonic
) -> dict:
    """Fine-tune and evaluate every task of cfg.eval.tasks; writes the JSON and markdown table to run_dir."""
    run_dir.mkdir(parents=True, exist_ok=True)
    budget = BudgetClock(cfg.budget, clock) if cfg.budget is not None else None
    per_entry: dict[str, list[dict[str, float]]] = {}
    runs, skipped, not_run = [], [], []
    start = time.perf_counter()
    for name in cfg.eval.tasks:
        task = GLUE_TASKS[name]
        if budget is not None and budget.expired():
            not_run.append(name)
            continue
        try:
            splits = load_task(task, cfg.eval.glue_dir, cache_dir=Path(cfg.base_dir) / "data" / "hf")
        except DataSourceError as err:
            log.warning("skipping a task: %s", err)
            skipped.append(name)
            continue
        for seed in cfg.eval.seeds:
            result = finetune(task, splits, str(checkpoint), cfg.eval, cfg.impl, cfg.seed + seed, budget)
            for entry, metrics in result.metrics.items():
                per_entry.setdefault(entry, []).append(metrics)
                log.info(
                    "%s seed %d: %s", entry, seed, ", ".join(f"{k} {100 * v:.2f}" for k, v in metrics.items())
                )
            runs.append({"task": name, "seed": cfg.seed + seed} | asdict(result))
            if result.stopped_by_budget:
                break
    scores = summarize(per_entry)
    average, used = glue_average(scores)
    table = markdown_table(scores, skipped, not_run) if scores else "No task could be evaluated.\n"
    report = {
        "checkpoint": str(checkpoint),
        "pretraining": json.loads((checkpoint / MODEL_CONFIG).read_text()).get("training", {}),
        "optimizer": cfg.eval.optim,
        "config": asdict(cfg),
        "runs": runs,
        "scores": {e: {"metric": s.metric, "median": s.median, "spread": s.spread, "per_seed": s.per_seed,
                       "medians": s.medians} for e, s in scores.items()},
        "glue_average": average,
        "average_entries": used,
        "skipped_no_data": skipped,
        "not_run_budget": not_run,
        "seconds": time.perf_counter() - start,
    }  # fmt: skip
    atomic_write_text(run_dir / RESULTS_JSON, json.dumps(report, indent=2) + "\n")
    header = f"# GLUE: {checkpoint}\n\nOptimizer `{cfg.eval.optim}`, recipe `{cfg.eval.name}`.\n\n"
    atomic_write_text(run_dir / RESULTS_TABLE, header + table)
    log.info("GLUE results:\n%s", table)
    if not_run:
        log.warning("the eval budget ran out before: %s", ", ".join(not_run))
    return report
