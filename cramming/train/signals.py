"""SIGINT/SIGTERM during training: note them, so the loop saves a resumable state and stops cleanly."""

from __future__ import annotations

import contextlib
import logging
import signal
import threading
from collections.abc import Iterator

log = logging.getLogger("cramming")


class StopSignals:
    """Records SIGINT/SIGTERM so the loop can save a resumable state and stop after the current micro-batch."""

    received: str | None = None

    def handle(self, signum, frame) -> None:
        name = signal.Signals(signum).name
        if self.received == "SIGINT" and name == "SIGINT":
            raise KeyboardInterrupt  # a second Ctrl-C: stop now, without saving
        log.warning(
            "%s received: saving a resumable state after this micro-batch (Ctrl-C again to abort)", name
        )
        self.received = name


@contextlib.contextmanager
def catch_stop_signals() -> Iterator[StopSignals]:
    signals = StopSignals()
    if threading.current_thread() is not threading.main_thread():  # handlers can only be set from there
        yield signals
        return
    previous = {sig: signal.signal(sig, signals.handle) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield signals
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
