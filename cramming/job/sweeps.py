"""The start and end of a Hydra multirun: the sweep as one group in the trackers (its MLflow parent run), and at
the end a summary of its jobs from their run cards, and a non-zero exit when any failed.

Registered in conf/pretrain.yaml and conf/eval.yaml under `hydra.callbacks`. Failed jobs do not stop a
sweep (see cramming.job.runcard.run_job); this callback makes sure the failure is still seen at the end.
"""

from __future__ import annotations

import logging
import sys
from pathlib import Path
from typing import Any

from hydra.experimental.callback import Callback
from omegaconf import DictConfig

from cramming.job.runcard import cards_under
from cramming.trackers.sweep import close_sweep, open_sweep

log = logging.getLogger("cramming")


def sweep_cards(sweep_dir: str | Path) -> list[dict]:
    """The run cards of a sweep's jobs, in job order."""
    cards = [card for _, card in cards_under(sweep_dir)]
    return sorted(cards, key=lambda card: card["job"].get("num") or 0)


class SweepSummary(Callback):
    def on_multirun_start(self, config: DictConfig, **kwargs: Any) -> None:
        open_sweep(config)  # before the first job: every job, wherever it runs, nests under one parent run

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        sweep_dir = config.hydra.sweep.dir
        cards = sweep_cards(sweep_dir)
        failed = [card for card in cards if card["status"] != "ok"]
        close_sweep(config, jobs=len(cards), failed=len(failed))
        for card in cards:
            log.info(
                "job %s %s: %s", card["job"].get("num"), card["status"], " ".join(card["job"]["overrides"])
            )
        log.info("report: python scripts/report.py %s", sweep_dir)
        if failed:
            for card in failed:
                first_line = (card.get("error") or "no error recorded").splitlines()[0]
                log.error("job %s %s: %s", card["job"].get("num"), card["status"], first_line)
            log.error("%d of %d jobs of the sweep in %s did not finish", len(failed), len(cards), sweep_dir)
            sys.exit(1)
