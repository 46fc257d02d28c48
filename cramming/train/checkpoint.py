"""Resumable pretraining state on disk: {run_dir}/state.pt (model, optimizer, scaler, progress, data
position, RNG, elapsed budget), written atomically every train.checkpoint_every_min, on SIGINT/SIGTERM and at
the end. The state before it is kept as {run_dir}/state.prev.pt, so a newest state that does not load (a
truncated file, a full disk) falls back to the one before. The final model itself is written by
cramming.model.checkpoint.save_pretrained.
"""

from __future__ import annotations

import logging
import os
import re
import shutil
from pathlib import Path

import torch

from cramming.errors import ConfigError, WriteFailed, first_line
from cramming.utils import atomic_file, check_free_space, newest_run_dir, process_alive, tensor_bytes

log = logging.getLogger("cramming")

STATE = "state.pt"
PREVIOUS = "state.prev.pt"


class StateUnreadable(ConfigError):
    """No resumable state of the run loads; the message names the files and what to do."""


def save_state(path: str | Path, state: dict) -> None:
    """Write a resumable state (plain containers of tensors and numbers only), keeping the previous one as
    state.prev.pt. Every step is a rename or a hard link, so at any moment both names hold complete files:
    the new state is written to a temporary file, the current one is linked to state.prev.pt, then the new
    one replaces it."""
    path = Path(path)
    kept = (
        f"the last saved state ({path.name}, {PREVIOUS}) is kept" if path.exists() else "no state was saved"
    )
    # the new state is written beside the last two (state.pt, state.prev.pt): its own size is what is needed
    check_free_space(path.parent, tensor_bytes(state), "the resumable state", kept)
    staged = path.with_name(f".{path.name}.{os.getpid()}.next")  # the complete new state, not yet in place
    try:
        try:
            with atomic_file(staged) as f:
                torch.save(state, f)  # its writer reports a full disk as a RuntimeError
        except (RuntimeError, WriteFailed) as err:
            reason = first_line(err)
            raise WriteFailed(f"could not write the resumable state {path} ({reason}); {kept}") from err
        if path.exists():
            _replace_with_copy(path, path.with_name(PREVIOUS))
        os.replace(staged, path)
    finally:
        staged.unlink(missing_ok=True)


def _replace_with_copy(source: Path, target: Path) -> None:
    """Atomically make `target` a copy of `source` (a hard link where the file system has them)."""
    temporary = target.with_name(f".{target.name}.{os.getpid()}.tmp")
    temporary.unlink(missing_ok=True)
    try:
        os.link(source, temporary)
    except OSError:  # no hard links here (some network file systems)
        shutil.copyfile(source, temporary)
    os.replace(temporary, target)


def load_state(path: str | Path) -> dict:
    """One state file. Raises StateUnreadable naming the file when it does not load (truncated, not a state,
    or a pickle payload that weights_only refuses: a state file cannot run code when loaded)."""
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as err:  # PytorchStreamReader errors, UnpicklingError, EOFError, ...: one clear message
        reason = first_line(err)
        raise StateUnreadable(f"{path} does not load as a resumable state ({reason})") from err
    if not isinstance(state, dict) or "version" not in state:
        raise StateUnreadable(f"{path} does not load as a resumable state (not a state dictionary)")
    return state


def find_resumable_state(base_dir: str | Path, name: str) -> Path | None:
    """state.pt (or only state.prev.pt) of the newest run folder of `name` that has one."""
    run_dir = newest_run_dir(base_dir, name, STATE) or newest_run_dir(base_dir, name, PREVIOUS)
    return None if run_dir is None else own_state(run_dir)


def continued_run_dir(run_dir: Path, resume: bool, base_dir: str | Path, name: str) -> Path | None:
    """The folder whose resumable state a run in `run_dir` takes up (as cramming.train.loop loads it): its own
    (a requeued job), else with resume=true the newest run of `name` that saved one; None for a fresh start."""
    path = own_state(run_dir) or (find_resumable_state(base_dir, name) if resume else None)
    return None if path is None else path.parent


def own_state(run_dir: Path) -> Path | None:
    """state.pt (or only state.prev.pt) in the run's own folder, or None.

    A first start never finds one: every run claims a new folder (cramming.utils.claim_run_dir), and a sweep's
    job N starts in an empty {sweep}/N. A job that its launcher starts again in the same folder (a SLURM job
    requeued after a preemption or a time limit) finds the state it saved there, and continues from it."""
    for name in (STATE, PREVIOUS):
        if (run_dir / name).exists():
            return run_dir / name
    return None


def remove_stale_temporaries(run_dir: Path) -> list[Path]:
    """Delete the temporary state files (`.state.pt.<pid>.next*`, `.state.prev.pt.<pid>.tmp`) that a process
    killed mid-write left in `run_dir`; files of a process still alive on this machine are kept."""
    removed = []
    # `.state.pt.<pid>.next` (staged), `..state.pt.<pid>.next.<random>.tmp` (its atomic write), and
    # `.state.prev.pt.<pid>.tmp` (the link to the previous state)
    pattern = re.compile(rf"\.{{1,2}}(?:{re.escape(STATE)}|{re.escape(PREVIOUS)})\.(\d+)\..*")
    for candidate in run_dir.glob(".*state*"):
        match = pattern.fullmatch(candidate.name)
        if match is None or process_alive(int(match.group(1))):
            continue
        candidate.unlink(missing_ok=True)
        removed.append(candidate)
    if removed:
        log.info("removed %d temporary file(s) of an interrupted save: %s", len(removed), removed)
    return removed


def load_newest_state(path: Path) -> tuple[Path, dict]:
    """The state at `path`, or when it does not load the state.prev.pt beside it, with a warning naming both.
    Raises StateUnreadable (a ConfigError: exit 2) when neither loads. A killed save's temporary files in
    the run folder are removed first."""
    remove_stale_temporaries(path.parent)
    candidates = [path] + ([path.with_name(PREVIOUS)] if path.name == STATE else [])
    failures = []
    for candidate in candidates:
        if not candidate.exists():
            continue
        try:
            state = load_state(candidate)
        except StateUnreadable as err:
            failures.append(str(err))
            continue
        if failures:
            log.warning("%s; resuming from the previous state %s instead", "; ".join(failures), candidate)
        return candidate, state
    raise StateUnreadable(
        f"{'; '.join(failures)}. No resumable state of this run loads: start afresh with resume=false (or a new"
        f" `name`), or remove {path.parent} to resume an older run of the same name"
    )
