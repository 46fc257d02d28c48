"""The resumable training state and the final model: what a stopped run needs to continue as if it had not
stopped, and what a finished one leaves. One owner, the `Checkpointer`:

    Checkpointer.find   before anything is built: the state this run continues from (its own folder, or
                        resume=true), read and checked against this run's data and model
    resume              loaded into this job's model, optimizer and train step (each rank in its own layout;
                        the step's state holds the random streams)
    maybe_save / save   every train.checkpoint_every_min of budget, and when a stop signal ends the run
    save_final          the final model (cramming.model.checkpoint), whole weights gathered from the ranks

Across the ranks (the end of this module, the checkpointer's private business): model and optimizer state across the ranks: gathered into the layout of one process when a state is saved,
and loaded back into this job's layout, whatever layout saved it.

One process, DDP: the state dicts as they are. FSDP2: torch.distributed.checkpoint gathers the model (and
torch's optimizers) into whole tensors on rank 0; our optimizers' per-rank shard states (low-bit codes and
scales, GaLore projectors) cannot be gathered that way, so each rank's state is kept as it holds it and
converted on load where the layout differs (cramming.optim.reshard: exact, but for quantized blocks that the
new layout cuts elsewhere). A resumed run reads the state file on every rank (with several machines, base_dir
must be on a shared file system).

On disk: {run_dir}/state.pt, written atomically. The state before it is kept as {run_dir}/state.prev.pt, so a
newest state that does not load (a truncated file, a full disk) falls back to the one before.
"""

from __future__ import annotations

import logging
import os
import re
import shutil
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from cramming.data import PretrainingData
from cramming.errors import ConfigError, WriteFailed, first_line
from cramming.model import ArchConfig, build_model
from cramming.model import checkpoint as model_checkpoint
from cramming.optim import reshard
from cramming.optim.base import LeanOptimizer
from cramming.optim.step import TrainStep
from cramming.ranks import Ranks
from cramming.runs import earlier_run, newest_run_with, refuse_other_settings
from cramming.train.batches import Progress
from cramming.utils import atomic_file, check_free_space, flatten, process_alive, tensor_bytes

log = logging.getLogger("cramming")

# 4: one update counter (the train step's: applied and skipped), the data position alone in `progress`, the
# random streams (Python's and NumPy's beside torch's) in the train step's state, and the clock. Version 3 states are read and upgraded (_upgrade); version
# 2 had two layouts under one number, and one in version 3's layout is read as 3.
STATE_VERSION = 4


@dataclass
class TrainingState:
    """One resumable state, as saved (plain containers of tensors and numbers)."""

    model: dict
    optimizer: dict
    step: dict  # TrainStep.state_dict(): the loss scaler, the one update counter and the random streams
    progress: Progress
    elapsed: float  # seconds of budget spent by every part of the run so far
    arch: dict
    data_path: str
    data: dict  # PretrainingData.identity(): the rows and token ids the run trains on
    clock: dict  # train.clock and, on the reference clock, the costs it charges: `elapsed` is in its seconds

    @property
    def updates(self) -> int:
        return self.step["stats"]["updates"]

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
        version = 3  # written in version 3's layout before the number changed
    if version == 3:  # its progress counted the applied updates, its step the skipped ones; torch's RNG apart
        progress, rng = dict(state["progress"]), state["rng"]
        stats = {key: value for key, value in state["step"].get("stats", {}).items() if key != "applied"}
        stats["updates"] = progress.pop("updates") + stats.get("skipped", 0)
        state = {**state, "progress": progress, "step": {**state["step"], "stats": stats, "rng": rng}}
        state["clock"] = {"clock": "wall", "costs": None}  # the only clock there was
        version = STATE_VERSION
    if version != STATE_VERSION:
        raise ConfigError(
            f"{path} has state version {version}; this code reads versions 3 and {STATE_VERSION} (older states"
            " lack the data identity a resume is checked against). Start afresh with resume=false, or resume"
            " with the cramming release that wrote it"
        )
    return state


# ------------------------------------------------------------------------------------------- the checkpointer


class Checkpointer:
    """The resumable state of one run and its final model (see the module docstring). Rank 0 writes; every
    rank joins in gathering a sharded (FSDP2) state and continues once it is on disk."""

    def __init__(
        self,
        run_dir: Path,
        ranks: Ranks,
        data: PretrainingData,
        arch: ArchConfig,
        every_seconds: float,
        saved: TrainingState | None = None,
        clock: dict | None = None,
    ):
        self.run_dir, self.ranks, self.data, self.arch = run_dir, ranks, data, arch
        self.every_seconds, self.saved = every_seconds, saved
        self.clock = clock or {"clock": "wall", "costs": None}
        self.last_save = self.elapsed_before

    @classmethod
    def find(
        cls,
        run_dir: Path,
        ranks: Ranks,
        data: PretrainingData,
        arch: ArchConfig,
        *,
        every_seconds: float,
        resume: bool,
        base_dir: Path,
        name: str,
        steps: int | None,
        budget_hours: float,
        clock: dict,
    ) -> Checkpointer:
        """Before anything is built: the state this run continues from (None for a fresh start), refused by
        name when it is of other data, another model or another clock (`clock`: train.clock and the costs it
        charges), or (resume=true) of a run that had finished."""
        found = find_resume_state(run_dir, resume, base_dir, name)
        saved = found[0] if found else None
        if found:
            if not found[1]:  # a requeued job that had finished only writes its final model again
                check_unfinished(saved, steps, budget_hours, run_dir)
            check_same_run(saved, data.identity(), asdict(arch), clock)
        return cls(run_dir, ranks, data, arch, every_seconds, saved, clock)

    @property
    def elapsed_before(self) -> float:
        """Seconds of budget the resumed state had spent (0 for a fresh run)."""
        return self.saved.elapsed if self.saved else 0.0

    def resume(self, model: nn.Module, step: TrainStep, now: float) -> Progress:
        """Load the found state into this job's model, optimizer and train step (each rank in its own layout)
        and the random streams; returns the data position to continue from (the start for a fresh run). The
        next periodic save comes train.checkpoint_every_min of budget after `now` (the end of set-up)."""
        self.last_save = now
        if self.saved is None:
            return Progress()
        saved = self.saved
        _load_full_state(model, step.optimizer, saved.model, saved.optimizer, self.ranks)
        step.load_state_dict(saved.step)  # its random streams too
        return Progress(**asdict(saved.progress))

    def maybe_save(self, elapsed: float, model: nn.Module, step: TrainStep, progress: Progress) -> None:
        """save() when train.checkpoint_every_min of budget has passed since the last one."""
        if elapsed - self.last_save >= self.every_seconds:
            self.save(elapsed, model, step, progress)

    def save(self, elapsed: float, model: nn.Module, step: TrainStep, progress: Progress) -> None:
        """The resumable state now, written by rank 0; every rank continues once it is on disk."""
        model_state, optimizer_state = _full_state(model, step.optimizer, self.ranks)
        if self.ranks.is_main:
            state = TrainingState(
                model_state, optimizer_state, step.state_dict(), Progress(**asdict(progress)), elapsed,
                asdict(self.arch), str(self.data.path), self.data.identity(), self.clock,
            )  # fmt: skip
            path = self.run_dir / STATE
            save_state(path, state.to_dict())
            log.info(
                "resumable state saved at update %d (%.2fh of budget) to %s",
                state.updates,
                elapsed / 3600,
                path,
            )
        self.last_save = elapsed
        self.ranks.barrier()

    def save_final(self, model: nn.Module, info: dict) -> Path:
        """The final model as a checkpoint folder (whole weights, plain key names: gathered from the ranks
        under FSDP2), with `info` in its model_config.json; every rank returns once it is on disk."""
        whole = _exportable_model(model, self.ranks, lambda: build_model(self.arch, self.data.vocab_size))
        path = self.run_dir / model_checkpoint.CHECKPOINT_DIR
        if whole is not None:
            data = self.data
            model_checkpoint.save_pretrained(
                whole, path, data.tokenizer, seq_length=data.seq_length, special=data.special, info=info
            )
            log.info("final model saved to %s", path)
        self.ranks.barrier()
        return path


# -------------------------------------------------------------------------------------------------- resuming


def find_resume_state(
    run_dir: Path, resume: bool, base_dir: Path, name: str
) -> tuple[TrainingState, bool] | None:
    """The state this run continues from, and whether it is the run's own: the one in its own folder (a sweep
    job requeued by its launcher after a preemption or a time limit), else with resume=true the state of the
    newest run of this name that saved one. None for a fresh start."""
    if resume or own_state(run_dir) is not None:
        for folder in (base_dir / name).glob("*/"):  # saves killed mid-write, in any run of it
            remove_stale_temporaries(folder)
    folder = continued_run_dir(run_dir, resume, base_dir, name)
    if folder is None:
        return None
    path, saved = load_newest_state(own_state(folder))  # falls back to state.prev.pt, with a warning
    state = TrainingState.from_dict(saved, path)
    log.info("resuming from %s: update %d, %.2fh of budget spent", path, state.updates, state.elapsed / 3600)
    return state, folder == run_dir


def continued_run_dir(run_dir: Path, resume: bool, base_dir: str | Path, name: str) -> Path | None:
    """The folder whose resumable state a run in `run_dir` takes up: its own (a requeued job), else with
    resume=true the newest run of `name` that saved one (ConfigError when there is none); None for a fresh
    start."""
    return earlier_run(run_dir, (STATE, PREVIOUS), resume=resume, base_dir=base_dir, name=name, what="run")


def newest_state(base_dir: str | Path, name: str) -> Path | None:
    """state.pt (or only state.prev.pt) of the newest run of `name` that saved one, or None."""
    folder = newest_run_with(base_dir, name, (STATE, PREVIOUS))
    return None if folder is None else own_state(folder)


def read_state(path: str | Path) -> TrainingState:
    """One state file, in this version's layout (StateUnreadable, or a ConfigError naming the version)."""
    return TrainingState.from_dict(load_state(path), Path(path))


def check_unfinished(state: TrainingState, steps: int | None, budget_hours: float, run_dir: Path) -> None:
    """resume=true continues a run that stopped early; one that ended by its own rule (its train.steps done,
    its budget spent) has nothing left to train, and another update would run at the schedule's end (lr 0)."""
    updates = state.updates
    if steps is not None and updates >= steps:
        done, fix = f"did all train.steps={steps} updates", "raise train.steps to train on"
    elif state.elapsed >= budget_hours * 3600:
        done = f"spent its budget ({state.elapsed / 3600:.4g} h of budget={budget_hours:g})"
        fix = "raise budget to train on"
    else:
        return
    raise ConfigError(
        f"resume=true: the run in {run_dir} already finished: it {done} in {updates} updates (its final model:"
        f" {run_dir / model_checkpoint.CHECKPOINT_DIR}). Nothing is left to resume; {fix}, or start afresh with"
        " resume=false"
    )


def check_same_run(state: TrainingState, data_identity: dict, arch: dict, clock: dict) -> None:
    """A resumed run continues on the rows and token ids it was trained on, with the model it trained, on the
    clock it counted its budget by, or not at all: other ids would train the embeddings of other words
    (another vocabulary size or shape fails deep in load_state_dict), and budget seconds of another clock
    are another budget."""
    refuse_other_settings(
        {f"data.{k}": v for k, v in state.data.items() if k in data_identity},
        {f"data.{k}": v for k, v in data_identity.items()},
        what="the saved run was trained on other data than this run's",
        fix=f"Resume with the saved run's data config (its data_config.yaml is in {state.data_path}), or start"
        " afresh with resume=false or another name",
    )
    refuse_other_settings(
        {f"arch.{k}": v for k, v in state.arch.items()},
        {f"arch.{k}": v for k, v in arch.items()},
        what="the saved run's model differs from this config's",
        fix="Resume with the saved run's settings, or start afresh with resume=false or another name",
    )
    refuse_other_settings(
        flatten(state.clock),
        flatten(clock),
        what="the saved run counted its budget on another clock",
        fix="Resume with its train.clock and train.calibration, or start afresh with resume=false",
    )


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


def own_state(run_dir: Path) -> Path | None:
    """state.pt (or only state.prev.pt) in the run's own folder, or None.

    A first start never finds one: every run claims a new folder (cramming.runs.claim_run_dir), and a sweep's
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


# ------------------------------------------------------------------------------------------- the ranks' layout


def _reshape_lifted(model: nn.Module, model_state: dict, optimizer_state: dict | None, lift: bool) -> None:
    """In place: the lifted scalars' entries (and their optimizer moments, not the step count) to 1-element
    vectors (lift) or back to scalars."""
    shape = (1,) if lift else ()
    for name in getattr(model, "lifted_scalars", ()):
        if name in model_state:
            model_state[name] = model_state[name].reshape(shape)
        moments = optimizer_state["state"].get(name, {}) if optimizer_state else {}
        for key, value in moments.items():
            if torch.is_tensor(value) and key != "step" and value.numel() == 1:
                moments[key] = value.reshape(shape)


def _fsdp2_options(**kwargs):
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    return StateDictOptions(full_state_dict=True, **kwargs)


def _param_names(model: nn.Module, optimizer: torch.optim.Optimizer) -> list[str]:
    """Names of the optimizer's parameters in its own numbering (a tied matrix has its first name)."""
    names = {id(p): name for name, p in model.named_parameters()}
    return [names[id(p)] for group in optimizer.param_groups for p in group["params"]]


def _by_index(state: dict, names: list[str]) -> dict:
    index = {name: i for i, name in enumerate(names)}
    return {
        "state": {index[name]: value for name, value in state["state"].items()},
        "param_groups": [{**g, "params": [index[n] for n in g["params"]]} for g in state["param_groups"]],
    }


def _by_name(state: dict, names: list[str]) -> dict:
    return {
        "state": {names[i]: dict(value) for i, value in state["state"].items()},
        "param_groups": [{**g, "params": [names[i] for i in g["params"]]} for g in state["param_groups"]],
    }


def _holds_shard_state(optimizer: torch.optim.Optimizer, ranks: Ranks) -> bool:
    """Whether each rank's optimizer state is its own plain tensors (our optimizers under FSDP2), which
    torch.distributed.checkpoint's full state dict cannot gather: it gathers DTensors, and per-shard
    quantization blocks, packed codes and GaLore's projector pieces need our own conversion
    (cramming.optim.reshard) to become the whole tensor's."""
    return ranks.active and ranks.mode == "fsdp2" and isinstance(optimizer, LeanOptimizer)


def _gathered_shard_states(optimizer: torch.optim.Optimizer, ranks: Ranks) -> dict:
    """Every rank's optimizer state dict (on the CPU), gathered to rank 0 as {"param_groups": ...,
    "rank_states": [rank 0's "state", rank 1's, ...]}; {} on the other ranks. Collective. The codes and
    scales are kept as each rank holds them, so the same number of ranks resumes them exactly (and any other
    layout converts them when it loads them: _optimizer_state_here)."""
    own = optimizer.state_dict()
    state = {
        i: {k: v.cpu() if torch.is_tensor(v) else v for k, v in s.items()} for i, s in own["state"].items()
    }
    gathered = [None] * ranks.world_size if ranks.is_main else None
    dist.gather_object(state, gathered, dst=0, group=ranks.control)
    if not ranks.is_main:
        return {}
    return {"param_groups": own["param_groups"], "rank_states": gathered}


def _check_shard_states(optimizer_state: dict, lean: bool) -> None:
    """Refuse a saved optimizer state that cannot become this optimizer's: FSDP2 ranks' shard states (ours)
    for an optimizer that is not ours."""
    saved = optimizer_state.get("rank_states")
    if saved is not None and not lean:
        raise ConfigError(
            f"the saved optimizer state is {len(saved)} FSDP2 ranks' shards of cramming's own optimizer"
            " (8-/4-bit or GaLore), and this run's optimizer is another one: resume with the train.optim that"
            " saved it, or start the optimizer state afresh"
        )


def _optimizer_state_here(
    model: nn.Module, optimizer: torch.optim.Optimizer, optimizer_state: dict, ranks: Ranks
) -> dict:
    """The saved optimizer state in this job's layout. Our optimizers hold whole tensors in one process or
    under DDP, and per-rank shard states under FSDP2: a state saved in the other layout, or by another number
    of FSDP2 ranks, is converted (cramming.optim.reshard: exact, but for quantized moments whose blocks the
    new layout cuts elsewhere, re-quantized and logged). The same number of FSDP2 ranks loads as saved."""
    lean = isinstance(optimizer, LeanOptimizer)
    _check_shard_states(optimizer_state, lean)
    rank_states = optimizer_state.get("rank_states")
    shard_state = _holds_shard_state(optimizer, ranks)
    groups = optimizer_state["param_groups"]
    if rank_states is None and not (shard_state and optimizer_state.get("state")):
        return optimizer_state  # whole tensors for whole tensors (or nothing to cut)
    if rank_states is not None and shard_state and len(rank_states) == ranks.world_size:
        return {"state": rank_states[ranks.rank], "param_groups": groups}
    names = _param_names(model, optimizer)
    requantized = {}
    state = optimizer_state.get("state", {})
    if rank_states is not None:
        state, requantized = reshard.merge_rank_states(optimizer, rank_states, names)
    if shard_state:
        state, cut = reshard.cut_whole_state(optimizer, state, ranks.rank, ranks.world_size, names)
        requantized = {
            name: sorted({*requantized.get(name, ()), *cut.get(name, ())}) for name in {*requantized, *cut}
        }
    source = "whole tensors" if rank_states is None else f"{len(rank_states)} FSDP2 ranks' shards"
    here = f"{ranks.world_size} FSDP2 ranks" if shard_state else "whole tensors"
    moved = ", ".join(f"{name} ({'+'.join(moments)})" for name, moments in sorted(requantized.items()))
    log.info(
        "optimizer state: %s -> %s; %d of %d parameters' states moved exactly, the others' moments"
        " re-quantized in the new blocks (each value to its nearest code: at most half a code step)%s",
        source,
        here,
        len(state) - len(requantized),
        len(state),
        f": {moved}" if moved else "",
    )
    return {"state": state, "param_groups": groups}


def _full_state(model: nn.Module, optimizer: torch.optim.Optimizer, ranks: Ranks) -> tuple[dict, dict]:
    """Model and optimizer state dicts as one process has them (plain keys, whole tensors, optimizer state by
    parameter index), so a state saved by any number of ranks resumes on any other. Collective under FSDP2,
    where the ranks other than 0 get empty dicts. Our optimizers under FSDP2 save their per-rank shard states
    as the ranks hold them (see _gathered_shard_states); _load_full_state converts them where needed."""
    if not (ranks.active and ranks.mode == "fsdp2"):
        return model.state_dict(), optimizer.state_dict()
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

    options = _fsdp2_options(cpu_offload=True)
    model_state = get_model_state_dict(model, options=options)
    if _holds_shard_state(optimizer, ranks):
        optimizer_state = _gathered_shard_states(optimizer, ranks)
    else:
        optimizer_state = get_optimizer_state_dict(model, optimizer, options=options)
    if not ranks.is_main:
        return {}, {}
    if _holds_shard_state(optimizer, ranks):
        _reshape_lifted(model, model_state, None, lift=False)
        return model_state, optimizer_state
    _reshape_lifted(model, model_state, optimizer_state, lift=False)
    return model_state, _by_index(optimizer_state, _param_names(model, optimizer))


def _load_full_state(
    model: nn.Module, optimizer: torch.optim.Optimizer, model_state: dict, optimizer_state: dict, ranks: Ranks
) -> None:
    """The inverse of _full_state; every rank passes the whole saved state."""
    shard_state = _holds_shard_state(optimizer, ranks)
    optimizer_state = _optimizer_state_here(model, optimizer, optimizer_state, ranks)
    if not (ranks.active and ranks.mode == "fsdp2"):
        model.load_state_dict(model_state)
        optimizer.load_state_dict(optimizer_state)
        return
    from torch.distributed.checkpoint.state_dict import set_model_state_dict, set_optimizer_state_dict

    model_state = dict(model_state)
    if shard_state:
        _reshape_lifted(model, model_state, None, lift=True)
        set_model_state_dict(model, model_state, options=_fsdp2_options())
        optimizer.load_state_dict(optimizer_state)
        return
    named = _by_name(optimizer_state, _param_names(model, optimizer))
    _reshape_lifted(model, model_state, named, lift=True)
    set_model_state_dict(model, model_state, options=_fsdp2_options())
    set_optimizer_state_dict(model, optimizer, named, options=_fsdp2_options())


def _exportable_model(model: nn.Module, ranks: Ranks, build: Callable[[], nn.Module]) -> nn.Module | None:
    """A module with whole weights and plain key names for the final checkpoint, on rank 0 (None on the
    others): `model` itself, unless FSDP2 sharded it; then its full state, gathered (collectively) into a
    fresh CPU copy made by `build`."""
    if not (ranks.active and ranks.mode == "fsdp2"):
        return model if ranks.is_main else None
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    weights = get_model_state_dict(model, options=_fsdp2_options(cpu_offload=True))
    if not ranks.is_main:
        return None
    _reshape_lifted(model, weights, None, lift=False)
    copy = build()
    copy.load_state_dict(weights)
    return copy
