"""Small shared helpers: seeding, atomic file writes, free space, processes, rates."""

from __future__ import annotations

import logging
import os
import random
import shutil
import sys
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import BinaryIO

import numpy as np
import torch

from cramming.errors import WriteFailed

log = logging.getLogger("cramming")


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def peak_memory_bytes(device: torch.device) -> int:
    """Peak memory: on CUDA the most GPU memory allocated since the last reset_peak_memory_stats; elsewhere the
    process's peak resident set (ru_maxrss: kilobytes on Linux, bytes on macOS)."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device)
    import resource  # Unix only: imported where it is needed, so the package imports everywhere

    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024


@contextmanager
def atomic_file(path: str | os.PathLike) -> Iterator[BinaryIO]:
    """Write a file through a temporary one in the same folder and a rename: readers see the old content or
    the complete new one, never a part, and a crash mid-write leaves the previous file intact. A write that
    fails (a full disk) raises WriteFailed naming the file."""
    path = Path(path)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    except OSError as err:
        raise WriteFailed(f"could not write {path}: {err}") from err
    try:
        with os.fdopen(fd, "wb") as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except OSError as err:  # a full disk, a folder gone: the file keeps its previous content
        Path(tmp).unlink(missing_ok=True)
        kept = "its previous content is kept" if path.exists() else "nothing was left"
        raise WriteFailed(f"could not write {path}: {err}; {kept}") from err
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def atomic_write_bytes(path: str | os.PathLike, data: bytes) -> None:
    with atomic_file(path) as f:
        f.write(data)


def atomic_write_text(path: str | os.PathLike, text: str) -> None:
    atomic_write_bytes(path, text.encode("utf-8"))


def tensor_bytes(obj: object) -> int:
    """The bytes of every tensor in nested dicts, lists and tuples: what torch.save or safetensors writes,
    headers aside."""
    if isinstance(obj, torch.Tensor):
        return obj.numel() * obj.element_size()
    if isinstance(obj, dict):
        return sum(tensor_bytes(value) for value in obj.values())
    if isinstance(obj, list | tuple):
        return sum(tensor_bytes(value) for value in obj)
    return 0


# room left beside a write whose size is known: headers, the tokenizer, and what other processes write meanwhile
SPACE_MARGIN_BYTES = 16 << 20


def check_free_space(folder: str | os.PathLike, needed: int, what: str, kept: str) -> None:
    """Refuse a write of about `needed` bytes into `folder` before it starts when the disk has less free (plus
    SPACE_MARGIN_BYTES), naming the space needed and what stays as it was (`kept`)."""
    folder = Path(folder)
    while not folder.exists() and folder != folder.parent:  # the nearest folder that exists is on that disk
        folder = folder.parent
    free = shutil.disk_usage(folder).free
    if free < needed + SPACE_MARGIN_BYTES:
        raise WriteFailed(
            f"not enough disk space for {what}: it needs about {(needed + SPACE_MARGIN_BYTES) / 2**20:.0f} MiB in"
            f" {folder}, which has {free / 2**20:.0f} MiB free. Nothing was written; {kept}. Free space on that"
            " disk, or set base_dir to a folder on another one"
        )


def process_alive(pid: int) -> bool:
    """Whether a process of this id runs on this machine (a file named by a pid may be a dead process's)."""
    try:
        os.kill(pid, 0)  # signal 0: only asks whether the process exists
    except ProcessLookupError:
        return False
    except PermissionError:  # alive, another user's
        return True
    return True


def per_second(value: float) -> str:
    """A rate as a log line shows it: whole numbers from 100 on, three significant digits below, so that the
    0.3 sequences/s of a 120M model on a CPU does not read as 0."""
    return f"{value:.0f}" if value >= 100 else f"{value:.3g}"


def flatten(tree: dict, sep: str = ".", prefix: str = "") -> dict[str, object]:
    """Nested dictionaries as one level, keys joined by `sep` ({"a": {"b": 1}} -> {"a.b": 1})."""
    flat: dict[str, object] = {}
    for key, value in tree.items():
        if isinstance(value, dict):
            flat |= flatten(value, sep, f"{prefix}{key}{sep}")
        else:
            flat[f"{prefix}{key}"] = value
    return flat


def launched_by_torchrun() -> bool:
    """The one answer to "several processes?" before a run's Ranks exist (afterwards: Ranks.active)."""
    return int(os.environ.get("WORLD_SIZE", "1")) > 1


def process_rank() -> int:
    """This process's rank in a torchrun launch (0 when not launched by torchrun)."""
    return int(os.environ.get("RANK", "0")) if launched_by_torchrun() else 0
