"""Run folders: each run claims a new one, a resumed run finds the earlier one it takes up, and refuses it when
it ran with other settings. Pretraining (its resumable state), GLUE (its finished runs) and BLiMP (its scored
paradigms) all find and check their earlier runs here.

Run folders are `{base_dir}/{name}/<timestamp>[_<n>]/`, a sweep's jobs `{base_dir}/{name}/multirun_<stamp>/<N>/`.
"""

from __future__ import annotations

import itertools
import os
from collections.abc import Mapping, Sequence
from pathlib import Path

from cramming.errors import ConfigError, config_error

# claim_run_dir answers the same for the same arguments within a process: Hydra may resolve the folder's
# interpolation more than once, and each must name the folder claimed the first time
_CLAIMED: dict[tuple[str, str, str], str] = {}


def claim_run_dir(base_dir: str, name: str, stamp: str) -> str:
    """Create and return a run folder `{base_dir}/{name}/{stamp}` that no other process has: when another run
    started in the same second took it, `{stamp}_2`, `{stamp}_3`, ... (os.mkdir either creates a folder or
    fails, so two processes never both get one). Hydra resolves `hydra.run.dir` through this (the
    `run_dir` resolver) before it makes the folder, so a bad `name` or `base_dir` fails before anything is
    made.

    Raises ConfigError for a name that is not a plain folder name or a base_dir that cannot be written."""
    key = (str(base_dir), str(name), str(stamp))
    if key in _CLAIMED:
        return _CLAIMED[key]
    name = str(name)
    if not name or name in (".", "..") or "/" in name or "\\" in name:
        raise config_error("name", name, "use a plain folder name without '/' (outputs go to base_dir/name/)")
    root = Path(base_dir) / name
    try:
        root.mkdir(parents=True, exist_ok=True)
        for number in itertools.count(1):
            folder = root / (stamp if number == 1 else f"{stamp}_{number}")
            try:
                folder.mkdir()
                break
            except FileExistsError:
                continue
    except OSError as err:
        raise ConfigError(
            f"cannot create the run folder under base_dir={base_dir!r}: {err}. Set base_dir to a folder"
            " you can write to, e.g. base_dir=outputs"
        ) from err
    _CLAIMED[key] = str(folder)
    return str(folder)


def newest_run_dir(base_dir: str | os.PathLike, name: str, containing: str) -> Path | None:
    """The newest run folder `{base_dir}/{name}/<timestamp>[_<n>]/` that holds `containing` (a relative path),
    or None.

    Run folders are named by start time (%Y-%m-%d_%H-%M-%S), so the newest sorts last; runs started in the
    same second are numbered in the order they claimed their folder (claim_run_dir).
    """
    root = Path(base_dir) / name
    if not root.is_dir():
        return None
    runs = sorted((p for p in root.iterdir() if p.is_dir() and (p / containing).exists()), key=_run_order)
    return runs[-1] if runs else None


def _run_order(folder: Path) -> tuple[str, int]:
    stamp, _, number = folder.name.rpartition("_")
    return (stamp, int(number)) if stamp and number.isdigit() else (folder.name, 1)


def earlier_run(
    run_dir: Path,
    markers: Sequence[str],
    *,
    resume: bool,
    base_dir: str | os.PathLike,
    name: str,
    what: str,
    sweep_job: int | None = None,
) -> Path | None:
    """The folder whose saved work a run in `run_dir` takes up, found by the file it left (the first of
    `markers` there counts), or None for a fresh start.

    Its own folder when that holds a marker: a job that its launcher started again in the same folder after a
    preemption or a time limit (a first start's folder is new and empty). Else, with resume=true, the newest
    earlier run of `name`; for job N of a multirun, job N of the newest earlier multirun (the same command
    numbers its jobs the same way). With resume=true and nothing found, a ConfigError naming where it looked
    and `what` was looked for (e.g. "evaluation", "run")."""
    if any((run_dir / marker).exists() for marker in markers):
        return run_dir
    if not resume:
        return None
    found = newest_run_with(base_dir, name, markers, sweep_job)
    if found is not None:
        return found
    where = Path(base_dir) / name / (f"multirun_*/{sweep_job}" if sweep_job is not None else "*")
    raise ConfigError(
        f"resume=true, but no earlier {what} named {name!r} left {' or '.join(markers)} (looked in {where}):"
        " check `name` and `base_dir`, or drop resume=true to start afresh"
    )


def newest_run_with(
    base_dir: str | os.PathLike, name: str, markers: Sequence[str], sweep_job: int | None = None
) -> Path | None:
    """The newest run folder of `name` that holds the first of `markers` found (for job N of a multirun, job N
    of the newest multirun that holds it), or None."""
    for marker in markers:
        if sweep_job is None:
            found = newest_run_dir(base_dir, name, marker)
        else:
            sweep = newest_run_dir(base_dir, name, f"{sweep_job}/{marker}")
            found = None if sweep is None else sweep / str(sweep_job)
        if found is not None:
            return found
    return None


def settings_differ(theirs: Mapping[str, object], ours: Mapping[str, object]) -> list[str]:
    """`key: X there, Y here` for every key whose value differs between an earlier run's settings (`theirs`)
    and this run's, in sorted order; a key one side lacks reads as None there."""
    keys = sorted(theirs.keys() | ours.keys())
    return [
        f"{k}: {theirs.get(k)!r} there, {ours.get(k)!r} here" for k in keys if theirs.get(k) != ours.get(k)
    ]


def refuse_other_settings(
    theirs: Mapping[str, object], ours: Mapping[str, object], *, what: str, fix: str, shown: int = 6
) -> None:
    """A ConfigError when a resumed run's settings differ from the earlier run's: `resume=true: <what>
    (key: X there, Y here; ...). <fix>`, the first `shown` differences named."""
    differ = settings_differ(theirs, ours)
    if not differ:
        return
    more = f"; and {len(differ) - shown} more" if len(differ) > shown else ""
    raise ConfigError(f"resume=true: {what} ({'; '.join(differ[:shown])}{more}). {fix}")
