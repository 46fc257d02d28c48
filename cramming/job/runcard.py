"""Run cards: one `run_card.json` per run, written by pretrain.py and eval.py however the run ends.

A card says what ran (the resolved config and the command line that replays it), from which code (git
commit and whether the tree was dirty, package versions), on what (CPU model, GPU name), on which data (the
processed-data cache key and the tokenizer's SHA-256), how long each part took and what came out. It is
written with status `running` when the job starts and rewritten with `ok`, `failed` (and the error) or
`interrupted` when it ends, so a job killed outright still leaves a card behind.

`run_job` is how an entry point runs its work inside a card. In a multirun a failed job is recorded and
the sweep goes on to the next job (`cramming.job.sweeps.SweepSummary` exits non-zero at the end); a single run
that fails still exits non-zero.
"""

from __future__ import annotations

import datetime as dt
import hashlib
import json
import logging
import os
import platform
import shlex
import socket
import statistics
import subprocess
import sys
import threading
import time
import traceback
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path

import torch
from hydra.core.hydra_config import HydraConfig
from hydra.errors import HydraException
from hydra.types import RunMode
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from cramming.errors import ConfigError, WriteFailed, stops_unwrapped
from cramming.impl import DEVICES, DTYPES, ImplConfig, cpu_bf16_support, dtype_name
from cramming.job import commandline, exits
from cramming.runs import newest_run_dir
from cramming.utils import atomic_write_text, process_alive, process_rank

log = logging.getLogger("cramming")

RUN_CARD = "run_card.json"
CARD_VERSION = 1
# A running job rewrites its card's `heartbeat` this often; a `running` card whose heartbeat is older than
# STALE_AFTER_SECONDS belongs to a process that is gone, wherever it ran (a cluster node, another machine).
HEARTBEAT_SECONDS = 60.0
STALE_AFTER_SECONDS = 600.0
REPO = Path(__file__).resolve().parent.parent
# the distributions whose versions decide what a run computes or how fast
PACKAGES = (
    "torch",
    "triton",
    "numpy",
    "hydra-core",
    "omegaconf",
    "datasets",
    "tokenizers",
    "safetensors",
    "evaluate",
    "transformers",
)


class JobFailed(Exception):
    """A run failed for a reason its message explains, with the exit status of a single run; in a multirun the
    card records the failure instead. (The failures of cramming.job.exits.FAILURES need no wrapping: run_job
    gives them their status.)"""

    def __init__(self, error: BaseException | str, exit_code: int = 1):
        super().__init__(str(error))
        self.exit_code = exit_code


@dataclass
class RunCard:
    """What one run records about itself; `write()` puts it into {run_dir}/run_card.json."""

    run_dir: Path
    kind: str  # pretrain | eval
    config: dict
    job: dict = field(default_factory=dict)
    status: str = "running"  # running | ok | failed | interrupted (readers add killed: card_status)
    error: str | None = None
    started: str = field(default_factory=lambda: _now())
    finished: str | None = None
    data: dict = field(default_factory=dict)
    seconds: dict[str, float | None] = field(default_factory=dict)
    metrics: dict = field(default_factory=dict)
    heartbeat: str | None = None  # the last write while running (see HEARTBEAT_SECONDS)
    _start: float = field(default_factory=time.perf_counter, repr=False)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)
    _beating: threading.Event | None = field(default=None, repr=False)
    _environment: dict | None = field(default=None, repr=False)
    objective: float | None = None  # what the job returned (to an Optuna sweeper): told to the trackers
    _on_end: list[Callable[[RunCard], None]] = field(default_factory=list, repr=False)

    @contextmanager
    def timed(self, part: str) -> Iterator[None]:
        """Add the wall time of the block to seconds[part]."""
        start = time.perf_counter()
        try:
            yield
        finally:
            self.seconds[part] = (self.seconds.get(part) or 0.0) + time.perf_counter() - start

    def environment(self) -> dict:
        """The code and machine the run started with (git, Python, packages, device), read once: the heartbeat
        rewrites the card every minute, and a `git status` or an edit mid-run must not change what it says."""
        if self._environment is None:
            self._environment = {
                "git": git_state(),
                "python": platform.python_version(),
                "packages": package_versions(),
                "device": device_description(
                    self.config.get("impl", {}).get("device", "auto"),
                    self.config.get("impl", {}).get("precision", "auto"),
                    self.config.get("impl", {}).get("cpu_threads"),
                ),
            }
        return self._environment

    def to_dict(self) -> dict:
        return {
            "card_version": CARD_VERSION,
            "kind": self.kind,
            "status": self.status,
            "error": self.error,
            "run_dir": str(self.run_dir),
            "job": self.job,
            "started": self.started,
            "finished": self.finished,
            "heartbeat": self.heartbeat,
            # which process writes the card: a `running` card whose process is gone was killed (card_status)
            "process": {"pid": os.getpid(), "host": socket.gethostname()},
            "seed": self.config.get("seed"),
            "config": self.config,
            **self.environment(),
            "data": self.data,
            "seconds": self.seconds,
            "metrics": self.metrics,
        }

    def write(self) -> None:
        if process_rank() != 0:  # one card per run, from the first process
            return
        with self._lock:  # the heartbeat thread writes too
            if self.finished is None:
                self.heartbeat = _now()
            try:
                atomic_write_text(
                    self.run_dir / RUN_CARD, json.dumps(self.to_dict(), indent=2, default=str) + "\n"
                )
            except WriteFailed as err:  # a full disk: the job's own outcome matters more than its card
                log.warning("run card not written: %s", err)

    def start_heartbeat(self, every: float = HEARTBEAT_SECONDS) -> None:
        """Rewrite the card every `every` seconds until end(): how a reader on another machine tells a job
        that is still running from one that was killed outright (card_status)."""
        if process_rank() != 0 or self._beating is not None:
            return
        self._beating = stop = threading.Event()

        def beat() -> None:
            while not stop.wait(every):
                self.write()  # a full or unreachable disk: a warning, the job goes on, the card ages

        threading.Thread(target=beat, name="run-card-heartbeat", daemon=True).start()

    def on_end(self, callback: Callable[[RunCard], None]) -> None:
        """Call `callback(card)` once the card is written at the end (the trackers finish their runs)."""
        self._on_end.append(callback)

    def end(self, status: str, error: str | None = None) -> None:
        if self._beating is not None:
            self._beating.set()
        if self.status == "running":  # a status set on the way (interrupted) stands
            self.status = status
        self.error = error if error is not None else self.error
        self.finished = _now()
        self.seconds["total"] = time.perf_counter() - self._start
        self.write()
        for callback in self._on_end:
            callback(self)

    # ------------------------------------------------------------------------------- what runs record

    def record_pretraining_data(self, path: Path, stats: dict, vocab_size: int) -> None:
        self.data |= {
            "path": str(path),
            "cache_key": stats.get("cache_key", path.name),
            "tokenizer_sha256": stats.get("tokenizer_sha256") or file_sha256(path / "tokenizer.json"),
            "vocab_size": vocab_size,
            "train_rows": stats.get("train_rows"),
            "seq_length": stats.get("seq_length"),
        }

    def record_pretraining(
        self,
        *,
        stop_reason: str,
        updates: int,
        rows: int,
        elapsed: float,
        elapsed_before: float,
        validation: dict | None,
        finished: bool,
        clock: dict | None = None,
        wall_seconds: float | None = None,
    ) -> None:
        """Final metrics and the time split of a pretraining run (cramming.train.loop.TrainResult's figures),
        read with the run's metrics.jsonl. elapsed: budget seconds of every part of the run, elapsed_before:
        of them, those spent before a resume; finished: a final model was written (else interrupted); clock:
        which clock counted the budget (the reference clock's calibration file, hash and machine);
        wall_seconds: what this process took in train()."""
        records = read_metrics(self.run_dir)
        losses = [r for r in records if "loss" in r]
        validation = validation or {}
        anytime = [r for r in records if "anytime_fraction" in r]
        memory = next((r for r in reversed(records) if "optimizer_state_bytes" in r), {})
        self.metrics |= {
            "stop_reason": stop_reason,
            "updates": updates,
            "budget_hours_spent": elapsed / 3600,  # on the clock `clock` names
            "clock": clock or {"clock": "wall"},
            "wall_hours_taken": None if wall_seconds is None else wall_seconds / 3600,  # by this process
            "tokens": rows * self.data.get("seq_length", 0),
            "loss": losses[-1]["loss"] if losses else None,
            "mlm_acc": losses[-1]["mlm_acc"] if losses else None,
            "val_loss": validation.get("loss"),
            "val_mlm_acc": validation.get("mlm_acc"),
            "tok_per_s": statistics.median(r["tok_per_s"] for r in losses) if losses else None,
            "anytime": [{k: v for k, v in r.items() if k != "update"} for r in anytime],
            **{
                k: memory.get(k)
                for k in ("optimizer_state_bytes", "optimizer_state_ratio_to_adamw", "peak_memory_bytes")
            },
        }
        self.seconds |= split_training_time(
            losses,
            anytime,
            wall=self.seconds.pop("train", 0.0),
            budget_spent=elapsed - elapsed_before,  # by this process: a resumed run's own
            elapsed_before=elapsed_before,
        )
        if not finished:
            self.status = "interrupted"
            self.error = f"stopped by {stop_reason}; resumable state in {self.run_dir}"

    def record_glue(self, checkpoint: Path, report: dict) -> None:
        """The checkpoint evaluated (and what made it) and the scores of run_glue's report."""
        pretraining_card = checkpoint.parent / RUN_CARD
        self.data |= {
            "checkpoint": str(checkpoint),
            "tokenizer_sha256": file_sha256(checkpoint / "tokenizer.json"),
            "pretraining_run_card": str(pretraining_card) if pretraining_card.exists() else None,
            "pretraining": report.get("pretraining", {}),
        }
        self.metrics |= {
            "optimizer": report["optimizer"],
            "glue_average": report["glue_average"],
            "scores": {entry: score["median"] for entry, score in report["scores"].items()},
            "skipped_no_data": report["skipped_no_data"],
            "bad_rows_skipped": report.get("bad_rows_skipped", {}),
            "not_run_budget": report["not_run_budget"],
        }
        self.seconds["eval"] = report["seconds"]

    def record_blimp(self, checkpoint: Path, results: dict) -> None:
        """The checkpoint scored and BLiMP's accuracies (overall, per phenomenon and field)."""
        tokenizer = checkpoint / "tokenizer.json"
        self.data |= {
            "checkpoint": str(checkpoint),
            "tokenizer_sha256": file_sha256(tokenizer) if tokenizer.exists() else None,
        }
        self.metrics |= {
            "blimp_overall": results["overall"],
            "blimp_per_linguistics_term": results["per_linguistics_term"],
            "blimp_per_field": results["per_field"],
            "blimp_pairs_scored": results["pairs_scored"],
            "blimp_variant": results["variant"],
        }


def card_status(card: dict, now: dt.datetime | None = None) -> str:
    """A card's status as a reader should show it: `killed` for a card left `running`, without a finish
    time, whose process is gone (SIGKILL, out of memory, a lost machine or cluster node). On the host that
    ran it, the process is looked up; on any other, a heartbeat older than STALE_AFTER_SECONDS says it. A
    card from before cards recorded their process or heartbeat keeps what it says."""
    status = card.get("status", "unknown")
    process = card.get("process") or {}
    if status != "running" or card.get("finished"):
        return status
    if process.get("host") != socket.gethostname():
        beat = card.get("heartbeat")
        if not beat:
            return status
        age = (now or dt.datetime.now(dt.timezone.utc)) - dt.datetime.fromisoformat(beat)
        return "killed" if age.total_seconds() > STALE_AFTER_SECONDS else status
    try:
        pid = int(process["pid"])
    except (KeyError, TypeError, ValueError):  # a card without a pid: what it says stands
        return status
    return status if process_alive(pid) else "killed"


# ---------------------------------------------------------------------------------------------- reading cards


def read_card(run_dir: str | Path) -> dict | None:
    """The run card of a run folder as a reader should see it (its status by card_status: a `running` card
    whose process is gone reads `killed`), or None when the folder has none. A card cut short by a full disk
    reads as None too: the run it describes cannot be told apart from one that never wrote it."""
    path = Path(run_dir) / RUN_CARD
    try:
        card = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):
        return None
    return card | {"status": card_status(card)}


def cards_under(folder: str | Path) -> list[tuple[Path, dict]]:
    """(run folder, card) of every run under `folder`: single runs (<name>/<stamp>) and the jobs of multiruns
    (<name>/multirun_<stamp>/<n>), oldest first."""
    found = []
    for path in sorted(Path(folder).rglob(RUN_CARD)):
        card = read_card(path.parent)
        if card is not None:
            found.append((path.parent, card))
    return sorted(found, key=lambda item: (item[1].get("started") or "", str(item[0])))


def newest_card(base_dir: str | Path, name: str) -> tuple[Path, dict] | None:
    """(folder, card) of the newest single run named `name` under `base_dir` that wrote a card, or None."""
    folder = newest_run_dir(base_dir, name, RUN_CARD)
    card = None if folder is None else read_card(folder)
    return None if card is None else (folder, card)


# ------------------------------------------------------------------------------------------- running a job


def run_job(task: Callable[[DictConfig, RunCard], float | None], cfg: DictConfig, kind: str) -> float | None:
    """Run one Hydra job's `task(cfg, card)` inside its run card, written however the job ends. Returns what
    the task returns (the objective an Optuna sweeper reads), None when the job failed.

    How the job ends is decided in cramming.job.exits: a failure an input explains (exits.exit_code, or a
    JobFailed) is logged as one message; a single run exits with its status, a multirun job is recorded as
    failed and the sweep goes on. Any other exception is a bug: a single run raises it (traceback, exit 1), a
    multirun job logs it and is recorded as failed. A job stopped by a signal (RunStopped) is recorded as
    interrupted and ends the process (exits.end_stopped), as SystemExit and KeyboardInterrupt do: a stopped
    sweep stops.
    """
    card = card_for_hydra_job(kind, cfg)
    card.write()
    card.start_heartbeat()  # stopped by card.end(), however the job ends
    multirun = card.job.get("multirun", False)
    try:
        with stops_unwrapped():  # a stop that a library wrapped in its own error is still a stop
            objective = task(cfg, card)
    except exits.RunStopped as stopped:
        card.end("interrupted", card.error or str(stopped))
        resume = f"python {kind}.py name={cfg.get('name')} resume=true ..." if stopped.resumable else None
        exits.end_stopped(stopped, resume or card.job["command"])
    except Exception as err:
        code = err.exit_code if isinstance(err, JobFailed) else exits.exit_code(err)
        if code is None:
            card.end("failed", f"{type(err).__name__}: {err}\n{traceback.format_exc(limit=-8)}")
            if not multirun:
                raise
            log.exception("job %s failed; the sweep goes on", card.job.get("num"))
            return None
        message = exits.failure_message(err, kind)
        log.error("%s", message)
        card.end("failed", message)
        if not multirun:
            sys.exit(code)
        log.error("job %s failed; the sweep goes on", card.job.get("num"))
    except BaseException:
        card.end("interrupted")
        raise
    else:
        card.objective = objective
        card.end("ok")
        log.info("run card: %s", card.run_dir / RUN_CARD)
        return objective
    return None


def run_entry_point(hydra_main: Callable[[], None]) -> None:
    """Call an entry point's @hydra.main function so that a configuration Hydra rejects before the job starts
    (a misspelled key, an unknown group option, a value of the wrong type, a bad `name` or `base_dir` met
    while claiming the run folder) exits with exits.USER_ERROR and its message, like the configuration errors
    the job itself finds. Errors of the job keep their exit status (run_job); a crash keeps its traceback.

    Hydra is told (HYDRA_FULL_ERROR, unless the user set it) to pass its errors on rather than exit 1."""
    os.environ.setdefault("HYDRA_FULL_ERROR", "1")
    try:
        sys.argv[1:] = commandline.rewrite_shorthands(sys.argv[1:])
        hydra_main()
    except (HydraException, OmegaConfBaseException, ConfigError) as err:
        log.error("configuration error: %s", commandline.explain(err))
        sys.exit(exits.USER_ERROR)


def card_for_hydra_job(kind: str, cfg: DictConfig) -> RunCard:
    """A card for the current Hydra job: its folder, its resolved config and how to replay it."""
    hydra = HydraConfig.get()
    overrides = list(hydra.overrides.task)
    script = Path(sys.argv[0]).name if sys.argv and sys.argv[0] else f"{kind}.py"
    multirun = hydra.mode == RunMode.MULTIRUN
    job = {
        "multirun": multirun,
        "num": hydra.job.num if multirun else None,
        "sweep_dir": hydra.sweep.dir if multirun else None,
        "overrides": overrides,
        "command": " ".join(["python", script, *map(shlex.quote, overrides)]),
    }
    try:
        config = OmegaConf.to_container(cfg, resolve=True, throw_on_missing=False)
    except Exception:  # an interpolation that does not resolve: validation reports it, the card keeps it raw
        config = OmegaConf.to_container(cfg, resolve=False)
    return RunCard(Path(hydra.runtime.output_dir), kind, config, job)


# ------------------------------------------------------------------------------ code, packages, device


def git_state(repo: Path = REPO) -> dict:
    """Commit and dirty flag of the checkout the code runs from (untracked files count as dirty)."""

    def git(*args: str) -> str | None:
        try:
            done = subprocess.run(
                ["git", "--no-optional-locks", "-C", str(repo), *args],
                capture_output=True,
                text=True,
                timeout=10,
            )
        except (OSError, subprocess.TimeoutExpired):
            return None
        return done.stdout.strip() if done.returncode == 0 else None

    commit = git("rev-parse", "HEAD")
    if commit is None:
        return {"commit": None, "dirty": None}
    changes = git("status", "--porcelain")
    return {
        "commit": commit,
        "dirty": bool(changes),
        "changed_files": len(changes.splitlines()) if changes else 0,
    }


def package_versions() -> dict[str, str | None]:
    versions = {}
    for name in PACKAGES:
        try:
            versions[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            versions[name] = None
    return versions


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def device_description(device: str = "auto", precision: str = "auto", cpu_threads: int | None = None) -> dict:
    """The CPU always (data loading and preprocessing run there), whether it has native bf16, the GPU when the
    run uses one, and the training precision impl.precision resolves to there (and why). The card is written
    before the job applies impl.cpu_threads (ImplConfig.apply_threads), so the threads it will use are told
    by that setting when there is one."""
    native, how = cpu_bf16_support()
    described = {
        "cpu": cpu_model(),
        "cpu_count": os.cpu_count(),
        "cpu_native_bf16": how if native else None,
        "torch_threads": cpu_threads if isinstance(cpu_threads, int) else torch.get_num_threads(),
        "gpu": None,
    }
    if precision in ("auto", *DTYPES):
        try:
            impl = ImplConfig(
                device=device if device.split(":")[0] in DEVICES else "auto", precision=precision
            )
        except ConfigError:  # a device this machine lacks: the job's validation reports it
            impl = ImplConfig(device="auto", precision=precision)
        dtype, why = impl.precision_choice(impl.torch_device())
        described["precision"] = {"dtype": dtype_name(dtype), "why": why}
    if device != "cpu" and torch.cuda.is_available():
        index = device.partition(":")[2]
        index = int(index) if index.isdigit() else 0
        if index < torch.cuda.device_count():  # else the job's validation names the device it lacks
            described |= {
                "gpu": torch.cuda.get_device_name(index),
                "gpu_count": torch.cuda.device_count(),
                "cuda": torch.version.cuda,
            }
    return described


def file_sha256(path: Path) -> str | None:
    return hashlib.sha256(path.read_bytes()).hexdigest() if path.is_file() else None


# ------------------------------------------------------------------------------------------ time split


def read_metrics(run_dir: Path) -> list[dict]:
    path = Path(run_dir) / "metrics.jsonl"
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def split_training_time(
    losses: list[dict], anytime: list[dict], wall: float, budget_spent: float, elapsed_before: float = 0.0
) -> dict[str, float | None]:
    """Split the wall time of train() into set-up, compile, train and eval, from the metrics records.

    The first record covers the set-up (on the budget's clock, before its window) and the first update;
    `compile` is what that first update took beyond a steady one (torch.compile, lazy initialization).
    `eval` is everything in train() that is not set-up or updates: anytime evaluations, the final
    validation and saving the model. A resumed run: budget_spent is what this process spent, and the records'
    elapsed_h count on from elapsed_before (the budget the resumed state had spent). On the reference clock the
    records' wall_h (this process's own wall hours) stand in for the budget's.
    """
    if not losses:
        return {"setup": None, "compile": None, "train": budget_spent, "eval": wall - budget_spent}
    first = losses[0]
    first_update = first["batch_size"] / first["seq_per_s"]
    if "wall_h" in first:  # the reference clock: budget time is not wall time; the records carry both
        setup = max(0.0, first["wall_h"] * 3600 - first_update)
        spent = losses[-1]["wall_h"] * 3600
        evaluations = sum(r["anytime_seconds"] for r in anytime)
    else:
        setup = max(0.0, first["elapsed_h"] * 3600 - elapsed_before - first_update)
        spent = budget_spent
        evaluations = sum(r["anytime_seconds"] for r in anytime if r["anytime_charged"])
    steady = [r["seq_per_s"] for r in losses[1:]]
    compile_s = max(0.0, first_update - first["batch_size"] / statistics.median(steady)) if steady else 0.0
    train = max(0.0, spent - setup - compile_s - evaluations)
    return {
        "setup": setup,
        "compile": compile_s,
        "train": train,
        "eval": max(0.0, wall - setup - compile_s - train),
    }


def _now() -> str:
    return dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds")
