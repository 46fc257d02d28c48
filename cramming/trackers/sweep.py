"""A Hydra multirun (local, SLURM through submitit, an Optuna search) as one group in the trackers.

W&B: every job's run is in the group `<name>/multirun_<stamp>` (the sweep folder), set by each job itself.
MLflow: a parent run named so, which the process launching the sweep starts before the first job and ends
after the last (cramming.job.sweeps.SweepSummary calls open_sweep and close_sweep); the jobs, in this process or
in processes of their own on other machines, find its id in the sweep folder and nest under it. A parent
that cannot start costs nothing but the nesting: each job is then a run of its own, tagged with its sweep.
"""

from __future__ import annotations

import logging
import sys
from pathlib import Path

from omegaconf import DictConfig, OmegaConf

from cramming.trackers import mlflow_tracker
from cramming.trackers.config import TrackingConfig

log = logging.getLogger("cramming")


def sweep_group(sweep_dir: str | Path) -> str:
    """The name a sweep goes by in the trackers: `<name>/multirun_<stamp>`."""
    path = Path(sweep_dir)
    return f"{path.parent.name}/{path.name}"


def wants_mlflow(config: DictConfig) -> bool:
    return "mlflow" in list(config.get("trackers") or [])


def open_sweep(config: DictConfig) -> None:
    """At the start of a multirun with mlflow among its trackers: the parent run of its jobs."""
    if not wants_mlflow(config):
        return
    sweep_dir = Path(config.hydra.sweep.dir)
    try:
        settings = OmegaConf.to_object(config.tracking)
        if not isinstance(
            settings, TrackingConfig
        ):  # a config without the schema (never from our entry points)
            settings = TrackingConfig(**settings)
        command = " ".join(["python", Path(sys.argv[0]).name, *sys.argv[1:]])
        run_id = mlflow_tracker.start_parent_run(
            settings, Path(config.base_dir), sweep_dir, sweep_group(sweep_dir), command
        )
    except Exception as err:
        log.warning(
            "tracker mlflow: the sweep's parent run did not start (%s); its jobs are tracked as runs of their own,"
            " tagged cramming.sweep. Fix: %s",
            err,
            mlflow_tracker.MlflowTracker.fix,
        )
        return
    log.info("mlflow: sweep %s under parent run %s", sweep_group(sweep_dir), run_id)


def close_sweep(config: DictConfig, jobs: int, failed: int) -> None:
    """At the end of a multirun: its parent run ends, FAILED when any job did not finish."""
    sweep_dir = Path(config.hydra.sweep.dir)
    if not wants_mlflow(config) or not (sweep_dir / mlflow_tracker.SWEEP_FILE).exists():
        return
    try:
        mlflow_tracker.end_parent_run(sweep_dir, jobs, failed)
    except Exception as err:
        log.warning(
            "tracker mlflow: the sweep's parent run did not end (%s). Fix: %s",
            err,
            mlflow_tracker.MlflowTracker.fix,
        )
