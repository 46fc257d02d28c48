"""Weights & Biases: the run's config and provenance as its config, every metrics record as a history row
(x axis: `update`), the final numbers and status in its summary. A sweep's jobs share a W&B group.

Honours WANDB_MODE (tracking.wandb_mode overrides it), WANDB_DIR (else the files go into the run folder),
WANDB_ENTITY and WANDB_API_KEY. Offline runs are synced later with `wandb sync <run folder>/wandb`.
"""

from __future__ import annotations

import logging
import os

from cramming.trackers.base import RunInfo, Tracker
from cramming.trackers.config import TrackingConfig

log = logging.getLogger("cramming")

# seconds between W&B's writes of a run's .wandb file (its default: 15). A run killed outright (SIGKILL) loses
# what W&B had not written; the run that resumes it skips every record it had handed over (docs/tracking.md)
FILE_FLUSH_SECONDS = 1.0


class WandbTracker(Tracker):
    name = "wandb"
    package = "wandb"
    fix = (
        "run `wandb login` (or set WANDB_API_KEY) on a machine that reaches the W&B server, or log offline with"
        " tracking.wandb_mode=offline (WANDB_MODE=offline) and `wandb sync` the run folder later"
    )

    def __init__(self, settings: TrackingConfig, info: RunInfo) -> None:
        super().__init__(settings, info)
        import wandb

        earlier = info.resumed.get("id") if info.resumed.get("project") == settings.project else None
        flush = "x_transaction_log_flush_interval"  # an internal setting: where this wandb has it
        flushing = {flush: FILE_FLUSH_SECONDS} if flush in wandb.Settings.model_fields else {}
        self.run = wandb.init(
            project=settings.project,
            entity=settings.entity,
            mode=settings.wandb_mode,  # None: WANDB_MODE, else online
            dir=None if "WANDB_DIR" in os.environ else str(info.run_dir),
            group=info.group,
            job_type=info.kind,
            name=info.title,
            id=earlier,
            resume="allow" if earlier else None,
            reinit="create_new",  # a run object of our own: jobs of a multirun in one process never share one
            settings=wandb.Settings(
                console="off",  # our log lines are in the run folder already; no wrapping of stdout
                silent=True,
                init_timeout=settings.timeout_s,
                **flushing,
            ),
        )
        self.continued = bool(earlier)
        # a resumed run's config said resume=false: values may change
        config = {**info.config, "run_card": info.provenance, "overrides": info.overrides}
        self.run.config.update(config, allow_val_change=True)
        self.run.define_metric("update")
        self.run.define_metric("*", step_metric="update")  # charts over optimizer updates, as metrics.jsonl
        log.info("wandb: run %s (%s) in %s", self.run.id, "continued" if earlier else "new", self.run.dir)

    def saved(self) -> dict:
        return {"id": self.run.id, "project": self.settings.project}

    def log(self, values: dict[str, float], step: int) -> None:
        self.run.log({"update": step, **values})

    def finish(self, status: str, summary: dict[str, float]) -> None:
        self.run.summary.update({**summary, "status": status})
        if status == "interrupted":  # stopped with a resumable state: the run goes on after a resume
            self.run.mark_preempting()
        self.run.finish(exit_code=0 if status == "ok" else 1)
