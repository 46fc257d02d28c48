"""What every tracker is told when its run starts (RunInfo), and what it does (Tracker)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import ClassVar

from cramming.trackers.config import TrackingConfig
from cramming.utils import flatten


@dataclass
class RunInfo:
    """One run as the trackers see it: its names, its config and provenance, its sweep, what it continues."""

    kind: str  # pretrain | eval
    title: str  # the run's name: its folder below base_dir (<name>/<stamp>); a sweep's job: #<job> <sweep>
    run_dir: Path
    base_dir: Path
    config: dict  # the resolved config
    provenance: dict  # of the run card: git, python, packages, device, data, command
    group: str | None = None  # the sweep of a multirun job, <name>/multirun_<stamp>; None for a single run
    sweep_dir: Path | None = None
    overrides: list[str] = field(default_factory=list)  # the job's command-line (or sweeper's) overrides
    resumed: dict = field(default_factory=dict)  # what the run this one continues saved, per tracker


class Tracker:
    """A tracker's run: started by the constructor (which raises when it cannot start), then `log` at every
    metrics record and `finish` once. The session (cramming.job.trackers) catches whatever they raise."""

    name: ClassVar[str]
    # what to do when it fails: named in the one warning the run gets
    fix: ClassVar[str]
    # the distribution that provides it (pip install ...)
    package: ClassVar[str]

    def __init__(self, settings: TrackingConfig, info: RunInfo) -> None:
        self.settings, self.info = settings, info
        # True when it took up the tracker run of info.resumed (the same run, rather than a new one): records
        # that run already holds are then not logged again
        self.continued = False

    def saved(self) -> dict:
        """What a resumed run needs to continue this tracker run (its id), written beside the run."""
        return {}

    def delivered(self) -> bool:
        """Whether every record logged so far is with the tracker (False while some wait to be sent): what a
        killed run's tracker run holds for sure."""
        return True

    def log(self, values: dict[str, float], step: int) -> None:
        """One metrics record: numbers under their metrics.jsonl names (nested ones joined by '/')."""
        raise NotImplementedError

    def finish(self, status: str, summary: dict[str, float]) -> None:
        """The end of the run: its status (ok | failed | interrupted) and final numbers."""


def numbers(record: dict) -> dict[str, float]:
    """The numbers of a metrics record, nested dicts joined by '/' (anytime/SST-2), booleans and None left out:
    what every tracker logs. A non-finite number stays (a diverging loss is worth seeing)."""
    flat = flatten(record, "/")
    return {k: v for k, v in flat.items() if isinstance(v, int | float) and not isinstance(v, bool)}
