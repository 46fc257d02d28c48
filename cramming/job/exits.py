"""How a job ends, in one place for pretrain.py, eval.py and scripts/export_hf.py: the exit status of each kind
of failure (the table in docs/exit-codes.md), and what a job stopped by a signal does.

A failure a user can fix exits with one message naming the input, the problem and the fix, never a
traceback; a traceback (exit 1) is kept for what no input explains: a bug.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import NoReturn

from cramming.errors import (
    ConfigError,
    DataSourceError,
    KernelUnavailableError,
    RunStopped,
    TrainingDiverged,
    WriteFailed,
    first_line,
    stop_in_chain,
)
from cramming.job.cluster import hand_back_to_launcher
from cramming.signals import STOP_SIGNALS

__all__ = [
    "FAILURES",
    "RunStopped",
    "end_stopped",
    "exit_code",
    "failure_message",
    "out_of_memory",
    "stop_at_once",
    "stop_in_chain",
]

log = logging.getLogger("cramming")

UNEXPECTED = 1  # a bug: the traceback is kept
USER_ERROR = 2  # a configuration, data, checkpoint or kernel error: the message names the fix
DIVERGED = 3  # the loss stayed non-finite (train.max_nonfinite_updates updates in a row)
WRITE_FAILED = 4  # a file could not be written (a full disk): the previous state and checkpoint are kept
SIGNAL_BASE = 128  # + the signal's number: stopped by SIGINT/SIGTERM/SIGUSR2 after keeping what it had

# the failures an input explains, by class; the first that matches gives the exit status
FAILURES: tuple[tuple[type[BaseException], int], ...] = (
    (TrainingDiverged, DIVERGED),
    (WriteFailed, WRITE_FAILED),
    (ConfigError, USER_ERROR),
    (DataSourceError, USER_ERROR),
    (KernelUnavailableError, USER_ERROR),
    (FileNotFoundError, USER_ERROR),  # a checkpoint or folder named that is not there
    (ModuleNotFoundError, USER_ERROR),  # an optional package a setting needs (transformers for hf:)
)


# what fits in less memory, per entry point: the line an out-of-memory failure ends with
MEMORY_ADVICE = {
    "pretrain": "the micro-batch does not fit: use impl.microbatch_size=auto (the fastest that fits, searched at"
    " start-up) or a smaller impl.microbatch_size; it changes no result beyond rounding, only speed",
    "eval": "a batch does not fit: use a smaller eval.batch_size (GLUE fine-tuning) or blimp.batch_rows (BLiMP,"
    " speed only)",
}
# how the CPU allocator of PyTorch says it (a RuntimeError, not torch.OutOfMemoryError)
CPU_ALLOCATOR_FAILED = "can't allocate memory"


def out_of_memory(err: BaseException | None) -> BaseException | None:
    """The out-of-memory error that `err` is or was caused by (a GPU's, or PyTorch's CPU allocator's), or None.
    Only PyTorch raises them, so this module does not import it: without torch loaded there is none."""
    torch = sys.modules.get("torch")
    gpu = (torch.cuda.OutOfMemoryError,) if torch is not None else ()
    seen: set[int] = set()
    while isinstance(err, BaseException) and id(err) not in seen:
        seen.add(id(err))
        if isinstance(err, gpu) or (isinstance(err, RuntimeError) and CPU_ALLOCATOR_FAILED in str(err)):
            return err
        err = err.__cause__ or err.__context__
    return None


def failure_message(err: BaseException, kind: str) -> str:
    """The one line a failure with an exit_code ends with: its message, or for running out of memory what
    fits (MEMORY_ADVICE) after the first line of PyTorch's own message."""
    memory = out_of_memory(err)
    if memory is None:
        return str(err)
    advice = MEMORY_ADVICE.get(kind, MEMORY_ADVICE["pretrain"])
    return f"out of memory ({first_line(memory)}): {advice}"


def exit_code(err: BaseException) -> int | None:
    """The exit status of a failure an input explains, or None for a bug. A stop that other code wrapped in
    its own error (a library's "error while generating the dataset") is still a stop: 128 + its signal. Out of
    memory is the input's too (a micro-batch too large for the device): USER_ERROR, with failure_message."""
    stopped = stop_in_chain(err)
    if stopped is not None:
        return SIGNAL_BASE + signal.Signals[stopped.signal_name]
    if out_of_memory(err) is not None:
        return USER_ERROR
    for kind, code in FAILURES:
        if isinstance(err, kind):
            return code
    return None


def end_stopped(stopped: RunStopped, resume: str) -> NoReturn:
    """Hand a cluster job back to its launcher to be requeued (SIGUSR2 under submitit: it continues from its
    folder), else exit 128 + the signal, saying how to continue."""
    hand_back_to_launcher(stopped.signal_name)
    log.info("%s. Interrupted; continue with: %s", stopped, resume)
    sys.exit(SIGNAL_BASE + signal.Signals[stopped.signal_name])


@contextmanager
def stop_at_once(what: str) -> Iterator[None]:
    """For work without a safe point to stop at (preprocessing): a stop signal raises RunStopped where it lands,
    so the work's own clean-up runs (a half-built data folder is removed) and the run card says interrupted.
    Without this, SIGTERM's default action ends the process before any of that.

    A worker process forked meanwhile (`datasets` with num_proc > 1) inherits the handler but not the work's
    clean-up: there the signal takes its default action and ends the worker (a pool's terminate() ends its
    workers with SIGTERM), while the process that set the handler, signalled too (Ctrl-C and a cluster's
    cancel reach every process of the job), stops the work and its pool."""
    owner = os.getpid()

    def handle(signum, frame) -> None:
        if os.getpid() != owner:
            signal.signal(signum, signal.SIG_DFL)
            signal.raise_signal(signum)
            return
        raise RunStopped(
            signal.Signals(signum).name, f"{what} stopped; nothing of it is kept", resumable=False
        )

    if threading.current_thread() is not threading.main_thread():  # handlers can only be set from there
        yield
        return
    previous = {name: signal.signal(signal.Signals[name], handle) for name in STOP_SIGNALS}
    try:
        yield
    finally:
        for name, handler in previous.items():
            signal.signal(signal.Signals[name], handler)
