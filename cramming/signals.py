"""SIGINT/SIGTERM/SIGUSR2 during training: note them, so the loop saves a resumable state and stops cleanly.

SIGUSR2 is what SLURM sends ahead of a time limit or a preemption when asked to (`--signal=USR2@<seconds>`,
as the submitit launcher does, conf/hydra/launcher/slurm.yaml); the entry point then hands the stopped job
back to its launcher for a requeue (cramming.job.cluster)."""

from __future__ import annotations

import contextlib
import logging
import signal
import threading
from collections.abc import Iterator

log = logging.getLogger("cramming")

# the signals that stop training after the current micro-batch with a resumable state saved
STOP_SIGNALS = ("SIGINT", "SIGTERM", "SIGUSR2")


class StopSignals:
    """Records a stop signal so the loop can save a resumable state and stop after the current micro-batch
    (GLUE fine-tuning: after the current update, keeping the finished runs)."""

    received: str | None = None

    def __init__(self, stopping: str = "saving a resumable state after this micro-batch"):
        self.stopping = stopping  # what the loop does now, for the log

    def handle(self, signum, frame) -> None:
        name = signal.Signals(signum).name
        if self.received == "SIGINT" and name == "SIGINT":
            raise KeyboardInterrupt  # a second Ctrl-C: stop now, without saving
        log.warning("%s received: %s (Ctrl-C again to abort)", name, self.stopping)
        self.received = name


@contextlib.contextmanager
def catch_stop_signals(stopping: str | None = None) -> Iterator[StopSignals]:
    signals = StopSignals() if stopping is None else StopSignals(stopping)
    if threading.current_thread() is not threading.main_thread():  # handlers can only be set from there
        yield signals
        return
    previous = {
        signal.Signals[name]: signal.signal(signal.Signals[name], signals.handle) for name in STOP_SIGNALS
    }
    try:
        yield signals
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
