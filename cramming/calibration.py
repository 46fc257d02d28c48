"""The reference clock's calibration files: what one micro-batch, one update and a run's set-up cost on one
machine, for each recipe shape measured there (`python -m cramming.calibrate <the run's overrides>` measures and
writes them; cramming.budget.ReferenceClock charges them).

A file is one machine's: conf/calibration/<name>.json (train.calibration=<name>) or any path. It records the
machine (CPU model and flags, GPU), the versions, what the budget charges and what it does not, and one entry
per shape: everything that decides what a micro-batch costs (the model, vocabulary, sequence length, masking,
dropout, the optimizer's kind, micro-batch size, precision, compile, kernels, threads, processes), keyed by
its hash. A number like the learning rate or the seed is not in the shape: the same shape costs the same. The
settings are the recipe's own (`impl.precision=auto`, not what auto chose there), so a recipe is charged the
same on every machine that replays it; a precision named outright is charged the `auto` entry where auto chose
that precision on the calibrated machine (fp32 on a CPU without native bf16: the same computation there).
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict
from pathlib import Path
from typing import Any

from cramming.budget import Costs
from cramming.errors import ConfigError, check_readable
from cramming.impl import DTYPES, dtype_name

CALIBRATION_DIR = Path(__file__).resolve().parent.parent / "conf" / "calibration"
FORMAT = 1
COMMAND = "python -m cramming.calibrate"

# what the reference clock charges, and what it does not: written into every file
CHARGES = {
    "setup": "once, at a run's first start (not on a resume): the model and optimizer built, compilation (cold:"
    " no graph from a cache), and what the first update takes beyond a steady one",
    "microbatch": "every micro-batch: masking, the copy to the device, forward and backward",
    "update": "every completed update: unscaling, clipping, the optimizer step",
}
NOT_CHARGED = (
    "preprocessing (on the wall clock neither)",
    "loading batches beyond the micro-batch (DataLoader workers overlap it)",
    "evaluations during pretraining (anytime.charged=true is refused on this clock)",
    "saving resumable states and the final model, the held-out validation, logging",
    "a resumed run's set-up and the downtime before it",
)
# optimizer settings that change the work of an update (the others, lr, betas, eps, weight decay, scale, are
# numbers in the same arithmetic)
OPTIM_WORK = ("name", "backend", "rank", "update_proj_gap", "proj_type", "target_modules",
              "second_moment_map", "first_moment_format", "first_moment_rounding")  # fmt: skip


def recipe_shape(cfg: Any, vocab_size: int, seq_length: int, world_size: int = 1) -> dict:
    """What decides a micro-batch's and an update's cost for a run of `cfg` (a pretraining config: arch,
    train, impl), as plain JSON values."""
    arch = {key: value for key, value in asdict(cfg.arch).items() if key != "name"}
    optim = asdict(cfg.train.optim)
    impl = cfg.impl
    return json.loads(json.dumps({
        "arch": arch,
        "vocab_size": vocab_size,
        "seq_length": seq_length,
        "mlm": {"mode": cfg.train.mlm.mode, "mask_fraction": cfg.train.mlm.mask_fraction,
                **({"whole_words": True} if cfg.train.mlm.whole_words else {})},
        "dropout": cfg.train.dropout,
        "grad_clip": cfg.train.grad_clip is not None,
        **({"average": cfg.train.average.kind} if cfg.train.average.kind != "none" else {}),
        "optim": {key: optim[key] for key in OPTIM_WORK},
        "microbatch_size": impl.microbatch_size,
        "device": impl.device,
        "precision": impl.precision,
        "compile": impl.compile,
        "kernels": {k: v for k, v in impl.kernel_choices().items() if k != "strict_kernels"},
        "cpu_threads": impl.cpu_threads,
        "world_size": world_size,
    }))  # fmt: skip


def shape_key(shape: dict) -> str:
    """A shape's key in a calibration file: the start of the SHA-256 of its canonical JSON."""
    return hashlib.sha256(json.dumps(shape, sort_keys=True).encode()).hexdigest()[:16]


def describe_shape(shape: dict) -> str:
    """One line a person reads: e.g. '6x128 (2 heads), vocab 8192, seq 128, micro-batch 64, precision auto'."""
    arch = shape["arch"]
    return (
        f"{arch.get('num_layers')}x{arch.get('hidden_size')} ({arch.get('num_heads')} heads), vocab"
        f" {shape['vocab_size']}, seq {shape['seq_length']}, micro-batch {shape['microbatch_size']},"
        f" {shape['optim']['name']}, precision {shape['precision']}, compile {shape['compile']},"
        f" threads {shape['cpu_threads']}, {shape['world_size']} process(es)"
    )


def calibration_path(name: str) -> Path:
    """train.calibration: a file name in conf/calibration/ (without .json), or a path to a file."""
    if name.endswith(".json") or "/" in name:
        return Path(name)
    return CALIBRATION_DIR / f"{name}.json"


def shown_path(path: Path) -> str:
    """How logs, run cards and states name a calibration file: a committed one by its place in the repository
    (the same in every clone, so a state resumes in another checkout and kept results name no machine's folder),
    any other by its path."""
    if path.resolve().parent == CALIBRATION_DIR:
        return f"conf/calibration/{path.name}"
    return str(path)


def read_calibration(path: Path) -> dict:
    """A calibration file, checked. ConfigError naming the file and the fix when it is absent, unreadable
    or not a calibration."""
    fix = f"measure this machine with `{COMMAND} <the run's overrides>`, or set train.calibration to a file"
    check_readable(path, "train.calibration")  # one line naming the permission, exit 2
    try:
        text = path.read_bytes()
    except FileNotFoundError as err:
        raise ConfigError(f"train.calibration: no calibration file {path}; {fix}") from err
    except OSError as err:  # a folder, a file the user may not read
        raise ConfigError(f"train.calibration: cannot read {path} ({err.strerror}); {fix}") from err
    try:
        saved = json.loads(text)
        if saved.get("format") != FORMAT or not isinstance(saved.get("entries"), dict):
            raise ValueError(f"format {saved.get('format')!r}, this code reads {FORMAT}")
    except (ValueError, AttributeError) as err:
        raise ConfigError(f"train.calibration: {path} is not a calibration file ({err}); {fix}") from err
    saved["sha256"] = hashlib.sha256(text).hexdigest()
    return saved


def reference_costs(name: str, shape: dict, overrides: str = "<the run's overrides>") -> tuple[Costs, dict]:
    """The calibrated costs of `shape` in calibration `name`, and their source (file, hash, machine) for the
    logs and the run card. A shape the file lacks is refused in one line naming the command that measures it."""
    path, key, described = calibration_path(name), shape_key(shape), describe_shape(shape)
    saved = read_calibration(path)
    entry = saved["entries"].get(key)
    if entry is None:
        key, entry = auto_twin(saved["entries"], shape) or (key, None)
    if entry is None:
        raise ConfigError(
            f"train.clock=reference: {path} has no entry for this recipe's shape ({described}); measure it on"
            f" the reference machine with `{COMMAND} {overrides}`, or use train.clock=wall"
        )
    costs = Costs(setup=entry["setup_s"], microbatch=entry["microbatch_s"], update=entry["update_s"])
    source = {
        "calibration": shown_path(path),
        "sha256": saved["sha256"],
        "machine": saved.get("machine", {}).get("cpu"),
        "gpu": saved.get("machine", {}).get("gpu"),
        "shape_key": key,
    }
    return costs, source


def auto_twin(entries: dict, shape: dict) -> tuple[str, dict] | None:
    """(key, entry) of `shape` measured with impl.precision=auto, where auto chose `shape`'s own precision on the
    calibrated machine: e.g. impl.precision=fp32 on a bf16 CPU, to replay a fp32 reference in its own rounding,
    is the same computation there and costs what auto cost. None where there is no such entry."""
    precision = shape["precision"]
    if precision == "auto":
        return None
    key = shape_key({**shape, "precision": "auto"})
    entry = entries.get(key)
    chose = (entry or {}).get("resolved_here", {}).get("precision")
    if chose is None or precision not in DTYPES or chose != dtype_name(DTYPES[precision]):
        return None
    return key, entry


def run_costs(
    cfg: Any, vocab_size: int, seq_length: int, world_size: int = 1, overrides: str = "<the run's overrides>"
) -> tuple[Costs, dict] | None:
    """What a run of `cfg` is charged: None on the wall clock; on the reference clock (train.clock) the
    calibrated costs of its shape in train.calibration and their source, or the refusal naming the command
    (with `overrides`, the run's own)."""
    if cfg.train.clock != "reference":
        return None
    return reference_costs(
        cfg.train.calibration, recipe_shape(cfg, vocab_size, seq_length, world_size), overrides
    )
