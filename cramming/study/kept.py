"""Kept figures: one small JSON per run of a study (`<keep>/<label>.json`) and one per model shape's floor
(`<keep>/floor-<shape>.json`). Run folders do not outlive the machine they ran on; these files do, and `report`
reads them alone.

A run's file holds what its finished stages measured: the pretraining run card, BLiMP's and GLUE's result
files, the load average while it pretrained and the study's runs that shared the machine with it. A stage's
figures, once kept, stay kept: a later `run` on a machine without the run folders adds to the file. Kept files are
committed, so they name no folder of the machine that wrote them: paths under the working folder are written
relative to it, and paths under $CRAMMING_DATA (where our machines keep their data) as `$CRAMMING_DATA/...`.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from cramming.errors import ConfigError
from cramming.job.runcard import read_card
from cramming.study.config import StudyConfig
from cramming.study.plan import Point
from cramming.utils import atomic_write_text

STAGE_FILES = {"blimp": "blimp_results.json", "glue1k": "glue_results.json", "glue": "glue_results.json"}
FLOOR = "floor-{}.json"


def keep_folder(name: str, study: StudyConfig) -> Path:
    """Where a study keeps its figures: its `keep` setting, else results/<name>/runs."""
    return Path(study.keep or f"results/{name}/runs")


def run_path(keep: Path, label: str) -> Path:
    return keep / f"{label}.json"


def read_run(keep: Path, label: str) -> dict:
    path = run_path(keep, label)
    return json.loads(path.read_text()) if path.exists() else {}


def has_stage(record: dict, stage: str) -> bool:
    """Whether a kept run holds the figures of `stage` (pretrain: its run card said ok)."""
    if stage == "pretrain":
        return (record.get("pretraining_card") or {}).get("status") == "ok"
    return bool(record.get(stage))


def keep_run(keep: Path, point: Point, overrides: list[str], finished: dict[str, Path], extra: dict) -> dict:
    """Write <keep>/<label>.json from the point's finished stage folders (`finished`: stage -> run folder),
    keeping what the file held of the others; `extra` (load_average, beside) is merged per stage."""
    record = read_run(keep, point.label)
    record |= {"label": point.label, "recipe": point.recipe, "minutes": _number(point.minutes)}
    record |= {"seed": point.seed, "overrides": list(overrides)}
    for key, per_stage in extra.items():
        record[key] = record.get(key, {}) | per_stage
    if "pretrain" in finished:
        card = read_card(finished["pretrain"])  # finished: its card said ok when the runner found it
        record["pretraining_card"] = card
        record["arch"] = card["config"]["arch"]["name"]
    for stage, file in STAGE_FILES.items():
        if stage in finished:
            record[stage] = json.loads((finished[stage] / file).read_text())
    record = portable(record)
    keep.mkdir(parents=True, exist_ok=True)
    atomic_write_text(run_path(keep, point.label), json.dumps(record, indent=1) + "\n")
    return record


def portable(value, cwd: Path | None = None, data: str | None = None):
    """`value` (a kept record, or any part of one) with this machine's folders out of its strings: the working
    folder's prefix dropped (a relative path), the data folder of $CRAMMING_DATA named as that variable."""
    data = os.environ.get("CRAMMING_DATA") if data is None else data
    prefixes = (
        [(str(Path(data).resolve()) + "/", "$CRAMMING_DATA/"), (data.rstrip("/") + "/", "$CRAMMING_DATA/")]
        if data
        else []
    )
    prefixes.append((str(cwd or Path.cwd()) + "/", ""))

    def clean(v):
        if isinstance(v, str):
            for prefix, replacement in prefixes:
                v = v.replace(prefix, replacement)
            return v
        if isinstance(v, dict):
            return {k: clean(x) for k, x in v.items()}
        if isinstance(v, list):
            return [clean(x) for x in v]
        return v

    return clean(value)


def _number(minutes: float) -> int | float:
    return int(minutes) if float(minutes).is_integer() else minutes


def read_floors(keep: Path) -> dict[str, dict]:
    """{shape: its floor's figures} of every floor file in `keep`."""
    return {
        path.stem.removeprefix("floor-"): json.loads(path.read_text())
        for path in sorted(keep.glob("floor-*.json"))
    }


def write_floor(keep: Path, shape: str, figures: dict) -> Path:
    keep.mkdir(parents=True, exist_ok=True)
    path = keep / FLOOR.format(shape)
    atomic_write_text(path, json.dumps(portable(figures), indent=1) + "\n")
    return path


def read_kept(keep: Path, points: list[Point]) -> dict[str, dict]:
    """{label: kept run} of the study's runs that have a file, in the study's order. Refuses a folder with
    none, naming it."""
    if not keep.is_dir():
        raise ConfigError(f"{keep}: no such folder of kept figures; `run` writes it (or set keep=<folder>)")
    kept = {p.label: read_run(keep, p.label) for p in points if run_path(keep, p.label).exists()}
    if not kept:
        raise ConfigError(f"{keep}: none of the study's runs has kept figures yet; `run` writes them")
    return kept
