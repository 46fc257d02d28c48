"""Starting the entry points for a study: a Hydra multirun of pretrain.py or eval.py (its launcher runs N jobs at
once where the study allows it), or one run again in its own folder; a stop signal passed on to them; the load
average sampled while they run."""

from __future__ import annotations

import contextlib
import importlib.util
import logging
import os
import shlex
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from cramming.errors import ConfigError

if TYPE_CHECKING:  # the launch helpers import nothing heavy: scripts/rehearsal.py sets HF_*_OFFLINE after
    from cramming.study.config import StudyConfig

log = logging.getLogger("cramming")

REPO = Path(__file__).resolve().parents[2]
STOPS = (signal.SIGINT, signal.SIGTERM)


class StudyStopped(BaseException):
    """The study command got a stop signal; its runs were told and keep what they had (resumable states,
    finished evaluation runs). The same command continues them."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


def launcher_args(study: StudyConfig, at_once: int) -> list[str]:
    """The Hydra launcher of a multirun: SLURM jobs (submitit), joblib processes for N at once here, or Hydra's
    own, one job after the other."""
    if study.launcher == "slurm":
        return [
            "hydra/launcher=slurm",
            f"hydra.launcher.array_parallelism={at_once}",
            *study.launcher_overrides,
        ]
    if at_once > 1:
        if importlib.util.find_spec("hydra_plugins.hydra_joblib_launcher") is None:
            raise ConfigError(
                f"parallel: {at_once} runs at once need Hydra's joblib launcher: pip install -e '.[cluster]'"
                " (or set parallel: 1)"
            )
        return ["hydra/launcher=joblib", f"hydra.launcher.n_jobs={at_once}", *study.launcher_overrides]
    return []


def entry_point(kind: str) -> str:
    path = REPO / f"{kind}.py"
    if not path.is_file():
        raise FileNotFoundError(
            f"{path}: the study command runs from a clone of the repository (pip install -e .)"
        )
    return str(path)


def multirun(kind: str, overrides: list[str], key: str, values: list[str], launcher: list[str]) -> list[str]:
    """`python <kind>.py -m <overrides> key=v1,v2,... <launcher>`: one job per value (a command for `call`)."""
    return [sys.executable, entry_point(kind), "-m", *overrides, f"{key}={','.join(values)}", *launcher]


def again_in(kind: str, overrides: list[str], folder: Path) -> list[str]:
    """The run of these overrides once more in its own folder, where it finds what it kept (a command)."""
    return [sys.executable, entry_point(kind), *overrides, f"hydra.run.dir={folder}"]


def call(*argvs: list[str]) -> int:
    """Run commands side by side, each in a process group of its own, passing a stop signal of this process on
    to all of them (the runs keep what they have; a launcher's workers are in the groups too). Returns the
    first non-zero exit status, else 0; raises StudyStopped after a stop signal."""
    for argv in argvs:
        log.info("$ %s", shlex.join(["python", *argv[1:]]))
    received: list[int] = []
    previous = {sig: signal.signal(sig, lambda signum, frame: received.append(signum)) for sig in STOPS}
    procs = [subprocess.Popen(argv, start_new_session=True) for argv in argvs]
    passed = 0
    try:
        while any(proc.poll() is None for proc in procs):
            for signum in received[passed:]:  # a second Ctrl-C too: the runs then stop without saving
                for proc in procs:
                    with contextlib.suppress(ProcessLookupError):
                        os.killpg(proc.pid, signum)
                passed += 1
            time.sleep(0.2)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    if received:
        raise StudyStopped(received[0])
    return next((proc.returncode for proc in procs if proc.returncode != 0), 0)


class LoadSampler:
    """The 1-minute load average every `every` seconds while runs go: another job on the machine raises it."""

    def __init__(self, every: float = 30.0) -> None:
        self.every = every
        self.samples: list[tuple[float, float]] = []  # (unix time, load)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)

    def _sample(self) -> None:
        while True:
            self.samples.append((time.time(), os.getloadavg()[0]))
            if self._stop.wait(self.every):
                return

    def __enter__(self) -> LoadSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()

    def summary(self, start: float, end: float) -> dict | None:
        """Mean and max of the samples within [start, end] (the nearest one when none falls inside); None for a
        window the sampling did not watch (a run made before it, as an evaluation stage sees its pretraining)."""
        if not self.samples or start < self.samples[0][0] - self.every:
            return None
        inside = [load for t, load in self.samples if start <= t <= end]
        if not inside and self.samples:
            inside = [min(self.samples, key=lambda s: min(abs(s[0] - start), abs(s[0] - end)))[1]]
        if not inside:
            return None
        return {"mean": sum(inside) / len(inside), "max": max(inside), "samples": len(inside)}


def run_logged(
    argv: list[str],
    log_path: Path,
    until: Callable[[str], bool] | None = None,
    stop: int = signal.SIGTERM,
    delay: float = 0.0,
    timeout: float = 1800.0,
    env: dict[str, str] | None = None,
) -> tuple[int, str, bool]:
    """Run a command from the repository root with its output in `log_path`; with `until`, send it `stop`
    `delay` seconds after its log first satisfies `until` (a stop in the middle of a run, the way a user's
    Ctrl-C or a scheduler's signal lands). Returns (exit status, the log, whether the signal was sent). Raises
    TimeoutError when it runs past `timeout` seconds (it is killed first)."""
    deadline, signal_at, sent = time.monotonic() + timeout, None, False
    with open(log_path, "w") as log:
        proc = subprocess.Popen(argv, cwd=REPO, stdout=log, stderr=subprocess.STDOUT, env=env)
        try:
            while proc.poll() is None:
                now = time.monotonic()
                if now > deadline:
                    raise TimeoutError(f"{shlex.join(argv[1:])}: still running after {timeout:.0f} s")
                if until is not None and signal_at is None and until(log_path.read_text(errors="replace")):
                    signal_at = now + delay
                if signal_at is not None and not sent and now >= signal_at:
                    proc.send_signal(stop)
                    sent = True
                time.sleep(0.02)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    return proc.returncode, log_path.read_text(errors="replace"), sent
