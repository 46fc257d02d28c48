"""Errors a user can fix, each naming the problem and the fix."""

from __future__ import annotations

import os
import stat
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path
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


class RunStopped(KeyboardInterrupt):
    """A job stopped by a signal after keeping what it had (pretraining: a resumable state; evaluation: the
    finished runs). The entry point ends with cramming.job.exits.end_stopped.

    It derives from KeyboardInterrupt, not Exception. During preprocessing it is raised wherever the signal
    lands, often inside a library, and libraries handle an error (`except Exception`) otherwise than an
    interruption: they wrap an error in their own (`datasets`: "An error occurred while generating the
    dataset", which made a stop a data error) or log it and go on, while an interruption passes through them
    after their own clean-up (`datasets` deletes its partial cache files, the hub client aborts a download,
    DataLoader workers exit quietly). A stop is to this program what Ctrl-C is to any Python program,
    whichever signal it came by. Where one is wrapped all the same, stop_in_chain still finds it.
    """

    def __init__(self, signal_name: str, what: str = "stopped", resumable: bool = True):
        super().__init__(f"{signal_name} received: {what}")
        self.signal_name = signal_name
        self.resumable = resumable  # False: nothing was kept, the same command starts again


def stop_in_chain(err: BaseException | None) -> RunStopped | None:
    """The RunStopped that `err` is, or that caused it (through __cause__ and __context__, and the members of
    an exception group): a stop that other code wrapped in its own error is still a stop."""
    seen: set[int] = set()
    pending = [err]
    while pending:
        err = pending.pop()
        if not isinstance(err, BaseException) or id(err) in seen:
            continue
        seen.add(id(err))
        if isinstance(err, RunStopped):
            return err
        pending += [err.__context__, err.__cause__]
        if isinstance(getattr(err, "exceptions", None), tuple):  # an exception group's members
            pending += err.exceptions
    return None


@contextmanager
def stops_unwrapped() -> Iterator[None]:
    """Around code whose errors are caught broadly and explained (a library's failure to read a file): a stop
    that the code wrapped in its own error leaves the block as the RunStopped it is, not as that error."""
    try:
        yield
    except Exception as err:
        stopped = stop_in_chain(err)
        if stopped is None:
            raise
        raise stopped from err


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


def check_readable(path: str | os.PathLike, setting: str) -> None:
    """Raise DataSourceError when this process may not read `path` (a file, or a folder it must list) that the
    user named through `setting` (data.sources.<name>.files, eval.glue_dir, checkpoint, ...): one line naming
    the file, its permission, its owner and the user this runs as, where otherwise a PermissionError would end
    the job in a traceback somewhere inside a library. A path that is not there passes: its reader says so."""
    path = Path(path)
    try:
        if path.is_dir():
            with os.scandir(path):
                pass
        elif path.exists():
            with open(path, "rb"):
                pass
    except PermissionError as err:
        raise DataSourceError(permission_message(path, setting)) from err


def permission_message(path: Path, setting: str) -> str:
    """What check_readable says: the path, why it cannot be read, and the two fixes."""
    try:
        info = path.stat()
        folder = stat.S_ISDIR(info.st_mode)
        held = f"its permission is {stat.filemode(info.st_mode)}, owner {_user(info.st_uid)}"
    except PermissionError:  # a folder above it may not be entered
        folder, held = False, "a folder above it may not be entered"
    needed = "read and list (chmod a+rx)" if folder else "read (chmod a+r)"
    return (
        f"{'folder' if folder else 'file'} {path} cannot be read: permission denied ({held}; this runs as"
        f" {_user(os.geteuid())}). Give this user permission to {needed}, or point {setting} at a copy it can read"
    )


def _user(uid: int) -> str:
    try:
        import pwd

        return f"{pwd.getpwuid(uid).pw_name} (uid {uid})"
    except (ImportError, KeyError):  # no pwd module (Windows) or a uid without a name
        return f"uid {uid}"
