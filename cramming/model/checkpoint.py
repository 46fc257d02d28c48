"""What a run leaves on disk, and how to read it back.

{run_dir}/checkpoint/        the final model, for eval.py and export
    model.safetensors        weights, key names of the plain (uncompiled) module, tied matrix stored once
    model_config.json        arch fields + vocab_size, seq_length, special-token ids, training summary
    tokenizer.json           the tokenizer the data was made with
{run_dir}/state.pt           resumable state: cramming/train/state.py

A checkpoint is found by path (a run folder or its checkpoint/ folder) or by run name, `latest` meaning the
newest run folder of that name under {base_dir}/{name}/.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from safetensors import SafetensorError
from safetensors.torch import load_model, save_model
from tokenizers import Tokenizer
from torch import nn

from cramming.errors import ConfigError, WriteFailed, check_readable, first_line
from cramming.model.bert import BertForMLM
from cramming.model.build import build_model
from cramming.model.config import ArchConfig
from cramming.runs import newest_run_dir
from cramming.utils import check_free_space, tensor_bytes

CHECKPOINT_DIR = "checkpoint"
WEIGHTS = "model.safetensors"
MODEL_CONFIG = "model_config.json"
TOKENIZER = "tokenizer.json"
FORMAT_VERSION = 1


def unwrap(model: nn.Module) -> nn.Module:
    """The plain module under torch.compile's wrapper, whose state-dict keys carry no `_orig_mod.` prefix."""
    return getattr(model, "_orig_mod", model)


def save_pretrained(
    model: nn.Module,
    directory: str | Path,
    tokenizer: Tokenizer,
    *,
    seq_length: int,
    special: Any,
    info: dict,
) -> Path:
    """Write weights, model config and tokenizer into `directory` (replacing it); returns it.

    Written into a sibling temporary folder first and renamed, so a reader never finds half a checkpoint.
    """
    directory = Path(directory)
    kept = (
        f"the checkpoint already in {directory} is kept"
        if directory.exists()
        else "no checkpoint was written"
    )
    check_free_space(directory.parent, tensor_bytes(unwrap(model).state_dict()), "the checkpoint", kept)
    try:
        directory.parent.mkdir(parents=True, exist_ok=True)
        # a temporary folder of this call's own: two saves into the same place never write into each other
        partial = Path(
            tempfile.mkdtemp(dir=directory.parent, prefix=f".{directory.name}.", suffix=".partial")
        )
    except OSError as err:
        raise WriteFailed(f"could not write the checkpoint {directory}: {err}") from err
    partial.chmod(0o755)  # mkdtemp's folder is private (0700); a checkpoint is read by others too
    try:
        _write_checkpoint(model, partial, tokenizer, seq_length=seq_length, special=special, info=info)
        shutil.rmtree(directory, ignore_errors=True)
        os.replace(partial, directory)
    except (OSError, SafetensorError) as err:  # a full disk mid-write: the old folder is only replaced after
        raise WriteFailed(f"could not write the checkpoint {directory} ({err}); {kept}") from err
    finally:
        shutil.rmtree(partial, ignore_errors=True)
    return directory


def _write_checkpoint(
    model: nn.Module, partial: Path, tokenizer: Tokenizer, *, seq_length: int, special: Any, info: dict
) -> None:
    plain = unwrap(model)
    save_model(plain, str(partial / WEIGHTS))  # drops the tied duplicate, keeps one name for it
    config = {
        "format_version": FORMAT_VERSION,
        "arch": asdict(plain.arch),
        "vocab_size": plain.vocab_size,
        "seq_length": seq_length,
        "special_tokens": asdict(special),
        "training": info,
    }
    (partial / MODEL_CONFIG).write_text(json.dumps(config, indent=2) + "\n")
    tokenizer.save(str(partial / TOKENIZER))


class CheckpointUnreadable(ConfigError):
    """A checkpoint's files are there but do not load (truncated, or not what they claim to be)."""


@dataclass
class Pretrained:
    model: BertForMLM
    tokenizer: Tokenizer
    config: dict  # the content of model_config.json
    path: Path


def resolve_checkpoint(
    path_or_name: str | Path, base_dir: str | Path = "outputs", run: str = "latest"
) -> Path:
    """The checkpoint folder for a path (a run folder or its checkpoint/) or a run name (its `run` folder,
    `latest` = newest). Raises FileNotFoundError naming where it looked, DataSourceError for a folder this
    process may not read."""
    path = Path(path_or_name)
    check_readable(path, "checkpoint")
    for candidate in (path, path / CHECKPOINT_DIR):
        if (candidate / WEIGHTS).is_file():
            return candidate
    root = Path(base_dir) / str(path_or_name)
    if run == "latest":
        found = newest_run_dir(base_dir, str(path_or_name), f"{CHECKPOINT_DIR}/{WEIGHTS}")
    else:
        found = root / run if (root / run / CHECKPOINT_DIR / WEIGHTS).is_file() else None
    if found is None:
        raise FileNotFoundError(
            f"no checkpoint at {path} nor a finished run named {path_or_name!r} under {root}"
            f" (looked for {CHECKPOINT_DIR}/{WEIGHTS}); pass a run folder or set base_dir/name to the run's"
        )
    return found / CHECKPOINT_DIR


def load_pretrained(path_or_name: str | Path, base_dir: str | Path = "outputs", **build_kwargs) -> Pretrained:
    """Rebuild the model of a checkpoint with its weights. build_kwargs go to build_model (device,
    attention, layernorm, strict_kernels, dropout: None means the arch's fine-tuning dropout)."""
    directory = resolve_checkpoint(path_or_name, base_dir)
    with _naming(directory / MODEL_CONFIG):
        config = json.loads((directory / MODEL_CONFIG).read_text())
        arch = ArchConfig(**config["arch"])
    model = build_model(arch, config["vocab_size"], **build_kwargs)
    with _naming(directory / WEIGHTS):
        load_model(model, str(directory / WEIGHTS), device=str(next(model.parameters()).device))
    with _naming(directory / TOKENIZER):
        tokenizer = Tokenizer.from_file(str(directory / TOKENIZER))
    return Pretrained(model, tokenizer, config, directory)


@contextmanager
def _naming(path: Path) -> Iterator[None]:
    """Turn a failure to read `path` (SafetensorError, JSONDecodeError, a missing key, ...) into a
    CheckpointUnreadable that names the file and the fix; a file this process may not read is a DataSourceError
    that says so (not a damaged file)."""
    check_readable(path, "checkpoint")
    try:
        yield
    except Exception as err:
        reason = first_line(err)
        raise CheckpointUnreadable(
            f"{path} does not load ({type(err).__name__}: {reason}): the checkpoint is damaged or incomplete"
            f" (a copy cut short?). Copy the run folder again, or evaluate another run"
        ) from err
