"""Sweeps as cluster jobs: `hydra/launcher=slurm` (or its local twin `hydra/launcher=local`, conf/hydra/launcher/)
runs each job of a multirun through Hydra's submitit launcher; docs/cluster.md says how.

Two things the launcher cannot know are here: the time limit a job asks for (its budget and a margin,
`job_minutes`, a resolver of the launcher configs), and when a job stopped on the scheduler's warning signal
has saved its state, so that submitit may requeue it (`hand_back_to_launcher`). The requeued job starts in the
same run folder and continues from the state it finds there (cramming.train.state.own_state; evaluations:
the finished runs of glue_runs.json). submitit itself is needed only inside such a job: `pip install '.[cluster]'`.
"""

from __future__ import annotations

import logging
import math
import os
import signal

log = logging.getLogger("cramming")

# set by submitit in every job it starts (local or slurm)
SUBMITIT_ENV = "SUBMITIT_EXECUTOR"


def job_minutes(budget_hours: float | None, margin_min: float = 30, without_budget_min: float = 240) -> int:
    """The time limit of one job in whole minutes: its wall-clock budget and a margin for what is not on the
    budget (Python and CUDA start-up, loading the processed data, the final validation and save).

    A job that runs into the limit anyway is requeued and goes on (docs/cluster.md), so a tight margin costs a
    requeue, not the run. An evaluation without a budget (budget=null) asks for `without_budget_min`."""
    if budget_hours is None:
        return int(without_budget_min)
    return math.ceil(60 * float(budget_hours) + float(margin_min))


def requeue_signal() -> str | None:
    """The name of the signal submitit requeues its job on (SIGUSR2 unless SUBMITIT_PREEMPT_SIGNAL names
    another), when this process is a submitit job; None otherwise."""
    if SUBMITIT_ENV not in os.environ:
        return None
    from submitit import JobEnvironment  # only inside a submitit job, which has it

    return f"SIG{JobEnvironment.USR_SIG}"


def hand_back_to_launcher(stop_reason: str) -> None:
    """After training stopped on submitit's requeue signal and saved its resumable state: raise the signal
    again, now that submitit's own handler is back in place (training's catch_stop_signals has restored it).
    That handler asks the launcher for the job to run again (the same job: BaseSubmititLauncher.checkpoint),
    requeues it (SLURM: scontrol requeue; local: the controller restarts it) and exits the process.

    Returns, doing nothing, when this process is no submitit job or stopped on another signal: SIGINT, and
    SIGTERM, which is what a cancel sends (and SLURM's own requeue of a preempted job: it starts the job again
    by itself, which then resumes from its folder like any requeue)."""
    if stop_reason != requeue_signal():
        return
    log.info("%s: the resumable state is saved; handing the job back to submitit to be requeued", stop_reason)
    signal.raise_signal(signal.Signals[stop_reason])
