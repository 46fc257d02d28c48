"""The trackers of one run: started by the entry point, fed every metrics record, finished with the run card.

    trackers = start_trackers(names, settings, card, continues=<run folder resumed from, or None>)
    train(..., on_record=trackers.log)      # the loop hands over each record it writes to metrics.jsonl
    card.end(status)                        # (run_job) -> each tracker's finish(status, final numbers)

A tracker that cannot start (package missing, no network, server unreachable, bad key) or that raises later is
dropped for the rest of the run with one warning naming it and the fix; the run goes on, and metrics.jsonl
stays the record. Only the main process (rank 0) tracks. Each tracker's run id is written to
{run_dir}/trackers.json: a resumed run (resume=true, a requeued cluster job) reads that of the run it continues
and appends to the same tracker run.

Beside each id, trackers.json keeps the last record that tracker run holds (its update, and which records at that
update), rewritten after every record. A run killed after its last saved state had logged the updates past that
state; the run that resumes from the state computes them again, and skips each record the tracker run it
continues already holds, so every record is in the tracker run once (W&B's history would hold them twice).
"""

from __future__ import annotations

import json
import logging
import zlib
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

from cramming.errors import WriteFailed
from cramming.job.runcard import RunCard
from cramming.trackers.base import RunInfo, Tracker, numbers
from cramming.trackers.config import TrackingConfig
from cramming.trackers.registry import TRACKERS
from cramming.trackers.sweep import sweep_group
from cramming.utils import atomic_write_text

log = logging.getLogger("cramming")

IDS_FILE = "trackers.json"
# the run card's parts that say where a result came from
PROVENANCE = ("git", "python", "packages", "device")


class Held:
    """The last record a tracker run holds: its update, and which of the records at that update it holds (each
    named by its metric names: the progress record, the final validation, an evaluation's scores)."""

    def __init__(self, update: int, records: list[int] | None = None) -> None:
        self.update, self.records = update, list(records or [])

    def holds(self, update: int, record: int) -> bool:
        return update < self.update or (update == self.update and record in self.records)

    def saved(self) -> dict:
        return {"update": self.update, "records": list(self.records)}

    @classmethod
    def read(cls, saved: object) -> Held | None:
        """From trackers.json; None for an entry that does not read as one (a file from before, or edited)."""
        try:
            update, records = saved["update"], saved["records"]  # type: ignore[index]
            if isinstance(update, int) and all(isinstance(r, int) for r in records):
                return cls(update, records)
        except (TypeError, KeyError):
            pass
        return None


def record_name(record: dict) -> int:
    """A record's name among those of its update: a checksum of its metric names."""
    return zlib.crc32(",".join(sorted(record)).encode())


class Trackers:
    """The running trackers of one run; every call reaches each of them, and one that raises is dropped.

    held: per tracker, the last record its tracker run holds; records up to it are not logged again (a tracker
    that continues the run of a killed one)."""

    def __init__(
        self,
        active: dict[str, Tracker] | None = None,
        run_dir: Path | None = None,
        held: dict[str, Held] | None = None,
    ) -> None:
        self.active = dict(active or {})
        self.run_dir = run_dir
        self.held = dict(held or {})
        self.ids = {name: tracker.saved() for name, tracker in self.active.items()}  # a dropped one's too
        self.at = Held(-1)  # the last record with an update handed over, and those before it at its update
        self.written: dict | None = None  # what trackers.json holds now
        self.write_failed = False

    def log(self, record: dict) -> None:
        """A metrics record (as written to metrics.jsonl), stepped by its `update` (0 without one). A record
        with an update that a tracker's run already holds is skipped for that tracker."""
        if not self.active:
            return
        values, step = numbers(record), int(record.get("update", 0))
        placed = "update" in record  # a pretraining record; an evaluation's scores have no update
        named = record_name(record)
        if placed:
            self.at = Held(step, (self.at.records if step == self.at.update else []) + [named])
        for name in list(self.active):
            held = self.held.get(name)
            if placed and held is not None and held.holds(step, named):
                continue  # logged by the run this one continues, after the state it resumed from
            self._call(name, "log", lambda tracker: tracker.log(values, step))
            if placed and name in self.active and self.active[name].delivered():
                self.held[name] = Held(self.at.update, self.at.records)
        if placed:
            self.save()

    def finish(self, status: str, summary: dict[str, float]) -> None:
        """The end of the run, for every tracker; none is called again afterwards."""
        for name in list(self.active):
            self._call(name, "finish", lambda tracker: tracker.finish(status, summary))
        self.active.clear()

    def saved(self) -> dict:
        """What trackers.json holds: each tracker's run id and the last record its run holds."""
        return {
            name: ids | ({"logged": self.held[name].saved()} if name in self.held else {})
            for name, ids in self.ids.items()
        }

    def save(self) -> None:
        """trackers.json, atomically; a disk that refuses costs one warning (a resume of this run would then
        start new tracker runs, or log some records twice), not the run."""
        saved = self.saved()
        if self.run_dir is None or self.write_failed or saved == self.written:
            return
        try:
            atomic_write_text(self.run_dir / IDS_FILE, json.dumps(saved, indent=1) + "\n")
            self.written = saved
        except (OSError, WriteFailed) as err:
            self.write_failed = True
            log.warning(
                "%s not written (%s): a resume of this run starts new tracker runs, or logs some records twice",
                self.run_dir / IDS_FILE,
                err,
            )

    def _call(self, name: str, what: str, action: Callable[[Tracker], None]) -> None:
        tracker = self.active[name]
        try:
            action(tracker)
        except Exception as err:
            del self.active[name]
            warn(
                name,
                f"failed to {what} ({type(err).__name__}: {err}); dropped for the rest of this run",
                tracker.fix,
            )


def warn(name: str, what: str, fix: str) -> None:
    """The one warning a tracker's failure costs a run."""
    log.warning("tracker %s %s. metrics.jsonl has every record. Fix: %s", name, what, fix)


def start_trackers(
    names: list[str],
    settings: TrackingConfig,
    card: RunCard,
    continues: Path | None = None,
    main: bool = True,
) -> Trackers:
    """Start each named tracker for the run of `card`, continuing the tracker runs of the run folder
    `continues` (the run a resumed one takes up); finish them when the card ends. `main`: False on the other
    ranks of a torchrun launch, which track nothing."""
    if not names or not main:
        return Trackers()
    info, saved = run_info(card), read_saved(continues)
    active = {}
    for name in names:
        cls = TRACKERS[name]
        try:
            active[name] = cls(settings, replace(info, resumed=saved.get(name) or {}))
        except ImportError as err:
            warn(
                name,
                f"is not installed ({err})",
                f"pip install {cls.package} (or pip install -e '.[trackers]')",
            )
        except Exception as err:
            warn(name, f"did not start ({type(err).__name__}: {err})", cls.fix)
    # the records the tracker runs this one continues already hold: a tracker that started a new run holds none
    held = {
        name: found
        for name, tracker in active.items()
        if tracker.continued and (found := Held.read((saved.get(name) or {}).get("logged"))) is not None
    }
    trackers = Trackers(active, info.run_dir, held)
    if active:
        trackers.save()
        card.on_end(lambda ended: trackers.finish(ended.status, summary_of(ended)))
    return trackers


def run_info(card: RunCard) -> RunInfo:
    """What the trackers are told about the run of `card`."""
    base_dir = Path(card.config.get("base_dir", "outputs"))
    try:
        title = str(card.run_dir.resolve().relative_to(base_dir.resolve()))
    except ValueError:
        title = card.run_dir.name
    environment = card.environment()
    provenance = {key: environment[key] for key in PROVENANCE} | {
        "data": dict(card.data),
        "command": card.job.get("command", ""),
    }
    sweep_dir = (
        Path(card.job["sweep_dir"]) if card.job.get("multirun") and card.job.get("sweep_dir") else None
    )
    if sweep_dir is not None:  # the job number first: what tells a sweep's runs apart in a narrow column
        title = f"#{card.job.get('num')} {sweep_group(sweep_dir)}"
    return RunInfo(
        kind=card.kind,
        title=title,
        run_dir=card.run_dir,
        base_dir=base_dir,
        config=card.config,
        provenance=provenance,
        group=sweep_group(sweep_dir) if sweep_dir else None,
        sweep_dir=sweep_dir,
        overrides=list(card.job.get("overrides", [])),
    )


def read_saved(run_dir: Path | None) -> dict:
    """The tracker run ids a run folder saved ({} for none, or for a file that does not read: a new run)."""
    if run_dir is None or not (Path(run_dir) / IDS_FILE).exists():
        return {}
    try:
        saved = json.loads((Path(run_dir) / IDS_FILE).read_text())
    except (OSError, ValueError) as err:
        log.warning("%s does not read (%s): the trackers start new runs", Path(run_dir) / IDS_FILE, err)
        return {}
    return saved if isinstance(saved, dict) else {}


def summary_of(card: RunCard) -> dict[str, float]:
    """The final numbers of a run card: its metrics under final/, and the objective the job returned."""
    summary = {f"final/{key}": value for key, value in numbers(card.metrics).items()}
    if card.objective is not None:
        summary["objective"] = card.objective
    return summary
