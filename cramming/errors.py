"""Errors a user can fix, each naming the problem and the fix."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any


class ConfigError(ValueError):
    """A configuration value is wrong; the message names the key and what to do instead."""


class DataSourceError(RuntimeError):
    """Raw data could not be read (no network, missing files, wrong field name)."""


class TrainingDiverged(RuntimeError):
    """The loss stayed non-finite for train.max_nonfinite_updates updates in a row."""


class WriteFailed(RuntimeError):
    """A file could not be written (a full disk, a folder without write permission); the message names the file,
    the space needed where it is known, and says what was kept: the previous state or checkpoint stays."""


class KernelUnavailableError(RuntimeError):
    """A Triton kernel was requested with impl.strict_kernels=true but cannot launch here."""


class RunStopped(Exception):
    """A job stopped by a signal after keeping what it had (pretraining: a resumable state; evaluation: the
    finished runs). The entry point ends with cramming.job.exits.end_stopped."""

    def __init__(self, signal_name: str, what: str = "stopped", resumable: bool = True):
        super().__init__(f"{signal_name} received: {what}")
        self.signal_name = signal_name
        self.resumable = resumable  # False: nothing was kept, the same command starts again


def first_line(err: BaseException) -> str:
    """The first line of an error's message (its type's name when it has none): what a one-line message quotes
    of a library's multi-line error."""
    text = str(err).strip()
    return text.splitlines()[0] if text else type(err).__name__


def config_error(key: str, value: Any, fix: str) -> ConfigError:
    return ConfigError(f"bad value for `{key}`: {value!r}. {fix}")


def check_choice(key: str, value: Any, choices: Iterable[str]) -> None:
    choices = tuple(choices)
    if value not in choices:
        raise config_error(key, value, f"choose one of: {', '.join(choices)}")
