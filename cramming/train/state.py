"""The resumable training state: what a stopped run needs to continue as if it had not stopped.

    TrainingState      model, optimizer, train step (scaler, skip counters), progress, elapsed budget, RNG,
                       the architecture and the data's identity, behind STATE_VERSION
    capture / save     gathered from the ranks (sharded_state.full_state), written by rank 0
    find_resume_state  which state a run continues from (its own folder, or resume=true), read and checked
    restore            loaded into this job's model, optimizer and step, in its own layout

On disk: {run_dir}/state.pt, written atomically every train.checkpoint_every_min, on SIGINT/SIGTERM/SIGUSR2
and at the end. The state before it is kept as {run_dir}/state.prev.pt, so a newest state that does not load
(a truncated file, a full disk) falls back to the one before. The final model is written by
cramming.model.checkpoint.save_pretrained.
"""

from __future__ import annotations

import logging
import os
import re
import shutil
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from torch import nn

from cramming.errors import ConfigError, WriteFailed, first_line
from cramming.model.checkpoint import CHECKPOINT_DIR
from cramming.optim.step import TrainStep
from cramming.train import sharded_state
from cramming.train.ranks import Ranks
from cramming.utils import atomic_file, check_free_space, newest_run_dir, process_alive, tensor_bytes

log = logging.getLogger("cramming")

# 3: every state holds the data's identity and the skip counters in the step's state. Version 2 had two
# layouts under one number (before and after those moved); a version-2 state in today's layout is read as 3.
STATE_VERSION = 3


@dataclass
class Progress:
    """How far the run got; saved in the resumable state."""

    updates: int = 0
    microbatches: int = 0
    # training rows of completed updates: the data position a resumed run starts from
    rows: int = 0
    # (updates skipped for a non-finite loss are counted once, in TrainStep.stats, saved with the step)


@dataclass
class TrainingState:
    """One resumable state, as saved (plain containers of tensors and numbers)."""

    model: dict
    optimizer: dict
    step: dict
    progress: Progress
    elapsed: float  # seconds of budget spent by every part of the run so far
    rng: dict
    arch: dict
    data_path: str
    data: dict  # PretrainingData.identity(): the rows and token ids the run trains on

    def to_dict(self) -> dict:
        return {"version": STATE_VERSION, **{**vars(self), "progress": asdict(self.progress)}}

    @classmethod
    def from_dict(cls, state: dict, path: Path) -> TrainingState:
        state = _upgrade(state, path)
        fields = {key: state[key] for key in cls.__dataclass_fields__}
        return cls(**{**fields, "progress": Progress(**state["progress"])})


def _upgrade(state: dict, path: Path) -> dict:
    """The state in this version's layout, or a ConfigError naming the version and what to do."""
    version = state.get("version")
    if version == 2 and "data" in state and not {"skipped", "skipped_in_a_row"} & state["progress"].keys():
        version = 3  # written in today's layout before the number changed
    if version != STATE_VERSION:
        raise ConfigError(
            f"{path} has state version {version}; this code reads version {STATE_VERSION} (older states lack"
            " the data identity a resume is checked against). Start afresh with resume=false, or resume with"
            " the cramming release that wrote it"
        )
    return state


# ---------------------------------------------------------------------------------------------------- saving


def capture(
    ranks: Ranks,
    model: nn.Module,
    step: TrainStep,
    progress: Progress,
    elapsed: float,
    arch: dict,
    data_path: Path,
    data_identity: dict,
) -> TrainingState | None:
    """The state of the run now, on rank 0 (None on the others, which only join in gathering FSDP2 shards)."""
    model_state, optimizer_state = sharded_state.full_state(model, step.optimizer, ranks)
    if not ranks.is_main:
        return None
    return TrainingState(
        model=model_state,
        optimizer=optimizer_state,
        step=step.state_dict(),
        progress=Progress(**asdict(progress)),
        elapsed=elapsed,
        rng=rng_state(),
        arch=arch,
        data_path=str(data_path),
        data=data_identity,
    )


def save(run_dir: Path, state: TrainingState) -> Path:
    path = run_dir / STATE
    save_state(path, state.to_dict())
    log.info(
        "resumable state saved at update %d (%.2fh of budget) to %s",
        state.progress.updates,
        state.elapsed / 3600,
        path,
    )
    return path


# -------------------------------------------------------------------------------------------------- resuming


def find_resume_state(
    run_dir: Path, resume: bool, base_dir: Path, name: str
) -> tuple[TrainingState, bool] | None:
    """The state this run continues from, and whether it is the run's own: the one in its own folder (a sweep
    job requeued by its launcher after a preemption or a time limit), else with resume=true the state of the
    newest run of this name that saved one. None for a fresh start."""
    path = own_state(run_dir)
    if path is None and not resume:
        return None
    for folder in (base_dir / name).glob("*/"):  # saves killed mid-write, in any run of it
        remove_stale_temporaries(folder)
    own = path is not None
    path = path or find_resumable_state(base_dir, name)
    if path is None:
        raise ConfigError(
            f"resume=true but no run named {name!r} under {base_dir} left a resumable state"
            f" ({STATE}); check `name` and `base_dir`, or start afresh with resume=false"
        )
    path, saved = load_newest_state(path)  # falls back to state.prev.pt, with a warning
    state = TrainingState.from_dict(saved, path)
    log.info(
        "resuming from %s: update %d, %.2fh of budget spent",
        path,
        state.progress.updates,
        state.elapsed / 3600,
    )
    return state, own


def check_unfinished(state: TrainingState, steps: int | None, budget_hours: float, run_dir: Path) -> None:
    """resume=true continues a run that stopped early; one that ended by its own rule (its train.steps done,
    its budget spent) has nothing left to train, and another update would run at the schedule's end (lr 0)."""
    updates = state.progress.updates
    if steps is not None and updates >= steps:
        done, fix = f"did all train.steps={steps} updates", "raise train.steps to train on"
    elif state.elapsed >= budget_hours * 3600:
        done = f"spent its budget ({state.elapsed / 3600:.4g} h of budget={budget_hours:g})"
        fix = "raise budget to train on"
    else:
        return
    raise ConfigError(
        f"resume=true: the run in {run_dir} already finished: it {done} in {updates} updates (its final model:"
        f" {run_dir / CHECKPOINT_DIR}). Nothing is left to resume; {fix}, or start afresh with resume=false"
    )


def check_same_run(state: TrainingState, data_identity: dict, arch: dict) -> None:
    """A resumed run continues on the rows and token ids it was trained on, with the model it trained, or not
    at all: other ids would train the embeddings of other words (and another vocabulary size or shape fails
    deep in load_state_dict)."""
    differ = [
        f"{key} {state.data.get(key)} there, {here} here"
        for key, here in data_identity.items()
        if state.data.get(key) != here
    ]
    if differ:
        raise ConfigError(
            f"resume=true: the saved run was trained on other data than this run's ({'; '.join(differ)})."
            f" Resume with the saved run's data config (its data_config.yaml is in {state.data_path}),"
            " or start afresh with resume=false or another name"
        )
    keys = sorted(state.arch.keys() | arch.keys(), key=lambda key: (key == "name", key))  # the name last
    differ = [
        f"arch.{k}: {state.arch.get(k)!r} there, {arch.get(k)!r} here"
        for k in keys
        if state.arch.get(k) != arch.get(k)
    ]
    if differ:
        raise ConfigError(
            f"resume=true: the saved run's model differs from this config's ({'; '.join(differ)}). Resume"
            " with the saved run's settings, or start afresh with resume=false or another name"
        )


def restore(state: TrainingState, ranks: Ranks, model: nn.Module, step: TrainStep) -> Progress:
    """Load the state into this job's model, optimizer and train step (each rank in its own layout) and the
    RNG; returns the progress to continue from."""
    sharded_state.load_full_state(model, step.optimizer, state.model, state.optimizer, ranks)
    step.load_state_dict(state.step)
    set_rng_state(state.rng)
    return Progress(**asdict(state.progress))


# ----------------------------------------------------------------------------------------------- the files


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
    """The folder whose resumable state a run in `run_dir` takes up (as find_resume_state loads it): its own
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


# ------------------------------------------------------------------------------------------------------- RNG


def rng_state() -> dict:
    """The torch RNG streams (dropout draws from them; masks do not: they are keyed by stream row)."""
    return {
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else [],
    }


def set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    if state["cuda"] and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
