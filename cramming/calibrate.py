"""Measure what the reference clock charges, on this machine: `python -m cramming.calibrate <a run's overrides>`.

    python -m cramming.calibrate +sweep=demo                      # one recipe, into its train.calibration file
    python -m cramming.calibrate +sweep=cpu-study --recipe "" --recipe "arch.num_layers=6 train.optim.lr=2e-3"
    python -m cramming.calibrate +sweep=demo --out my-machine.json --rounds 7

Each recipe is the pretraining run those overrides compose (`python pretrain.py <overrides>`): its data is
prepared as pretrain.py prepares it (or found in the cache), its model, masking and optimizer are built as the
loop builds them, and its set-up is timed up to the end of its first update. Then, after --warmup untimed
updates, --rounds rounds: in each, every recipe runs one update of --microbatches micro-batches of real rows,
each micro-batch and each optimizer step timed alone (CUDA synchronized). The recipes take turns within a
round, so a change in the machine's speed touches them alike. The medians are what the reference clock
charges; the spread (min, max) is written beside them. Set-up: what the first update took beyond a steady one,
plus building the model and optimizer (and compiling it, with impl.compile), measured as a first run's: after
the process's own one-time start, and with compilation cold (no graph reused from an earlier recipe or from
the compiler's cache on disk).

The file (train.calibration of the first recipe, or --out) gains one entry per new recipe shape. An entry already
there is kept, since runs were charged its costs and must stay comparable: its recipe is measured again beside
the new ones and the ratio printed (how this machine's speed now compares with when the entry was made), the new
entries are put on the file's scale by that ratio (so a study's recipes are charged at one speed however many days
apart they were measured: calibrate a kept recipe of the study beside new ones), and --remeasure replaces it. A file is one machine's: one measured on another machine is refused (name another).
Run it alone on the machine, as a wall-clock measurement should be.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import logging
import platform
import shlex
import statistics
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch._dynamo
import torch._inductor.config

from cramming import calibration
from cramming.config import PretrainConfig, register_configs, validate
from cramming.data import prepare_pretraining_data
from cramming.errors import ConfigError
from cramming.impl import dtype_name
from cramming.job.runcard import cpu_model, package_versions
from cramming.model import build_model
from cramming.optim.step import TrainStep
from cramming.ranks import Ranks
from cramming.train.batches import microbatches, numbered
from cramming.train.loop import make_train_step
from cramming.train.mlm import MLMMasker, MLMObjective
from cramming.train.parallel import Parallel
from cramming.utils import atomic_write_text, seed_everything

log = logging.getLogger("cramming")

# the CPU features that decide a training step's speed, recorded with the machine
CPU_FLAGS = ("avx2", "fma", "avx512f", "avx512_bf16", "amx_tile", "amx_bf16", "amx_fp16")


@dataclass
class Recipe:
    """One recipe being measured: its config, shape, and the pieces of its update."""

    overrides: list[str]
    config: PretrainConfig
    shape: dict
    step: TrainStep
    objective: MLMObjective
    step_model: torch.nn.Module
    batches: object
    device: torch.device
    setup_seconds: float
    microbatch: list[float] = field(default_factory=list)
    update: list[float] = field(default_factory=list)


def compose(overrides: Sequence[str]) -> PretrainConfig:
    """The pretraining config `python pretrain.py <overrides>` runs, validated."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir

    register_configs()
    with initialize_config_dir(str(calibration.CALIBRATION_DIR.parent), version_base="1.3"):
        cfg = hydra_compose("pretrain", overrides=list(overrides))
    return validate(cfg)


def synchronized(device: torch.device) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()


def warm_process() -> None:
    """What a process does once, whatever it trains (thread pools, the CPU's kernels picked): done before any
    recipe is timed, so that the first recipe's set-up is not charged for it. Compilation is made cold: no
    compiled graph is taken from the compiler's cache on disk, so every recipe's set-up is what a first run
    of it costs, whichever ran before."""
    torch._inductor.config.force_disable_caches = True
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.GELU(), torch.nn.LayerNorm(64))
    model(torch.randn(32, 64)).sum().backward()


def set_up(overrides: list[str], config: PretrainConfig) -> Recipe:
    """Data, model, masking, optimizer and the first update of one recipe, the set-up timed as the loop's."""
    impl, train = config.impl, config.train
    if impl.microbatch_size == "auto":
        raise ConfigError(
            "impl.microbatch_size=auto: the reference clock prices one micro-batch size; give one"
        )
    data = prepare_pretraining_data(config.data, config.data_cache_root, num_proc=impl.preprocessing_procs)
    device = impl.torch_device()
    torch._dynamo.reset()  # no graph compiled for an earlier recipe of this process is reused
    start = synchronized(device)
    dtype, _ = impl.precision_choice(device)
    seed_everything(config.seed)
    impl.apply_to_process(device)
    model = build_model(
        config.arch, data.vocab_size, device=device, dropout=train.dropout, **impl.kernel_choices()
    )
    masker = MLMMasker.for_data(train.mlm, data, config.seed)
    objective = MLMObjective(masker, device, masker.predicted_per_row(data.seq_length))
    step = make_train_step(model, config, Parallel(Ranks(device=device)), dtype)  # the loop's, in one process
    step_model = torch.compile(model) if impl.compile_on(device) else model
    batches = numbered(
        microbatches(data.train, impl.microbatch_size, config.seed, 0, 0, False), 0, impl.microbatch_size
    )
    recipe = Recipe(
        overrides, config, calibration.recipe_shape(config, data.vocab_size, data.seq_length), step, objective,
        step_model, batches, device, 0.0,
    )  # fmt: skip
    one_update(recipe, 1, timed=False)
    recipe.setup_seconds = synchronized(device) - start
    return recipe


def one_update(recipe: Recipe, microbatches: int, timed: bool = True) -> None:
    """One update of `microbatches` micro-batches, each micro-batch and the optimizer step timed alone."""
    recipe.config.impl.apply_threads()  # recipes may differ in impl.cpu_threads
    recipe.step_model.train()
    recipe.step.begin(1e-3, microbatches)  # a small rate: the weights stay sane over many rounds
    while not recipe.step.complete:
        batch = next(recipe.batches)
        began = synchronized(recipe.device)
        recipe.step.microbatch(recipe.objective, recipe.step_model, batch)
        if timed:
            recipe.microbatch.append(synchronized(recipe.device) - began)
    began = synchronized(recipe.device)
    recipe.step.apply()
    if timed:
        recipe.update.append(synchronized(recipe.device) - began)


def entry(recipe: Recipe) -> dict:
    """The calibration entry of a measured recipe: the medians, their spread, and what was measured."""
    microbatch, update = statistics.median(recipe.microbatch), statistics.median(recipe.update)
    dtype, _ = recipe.config.impl.precision_choice(recipe.device)
    return {
        "shape": recipe.shape,
        "described": calibration.describe_shape(recipe.shape),
        "overrides": shlex.join(recipe.overrides),
        "microbatch_s": microbatch,
        "update_s": update,
        # the first update's excess over a steady one, and building everything before it
        "setup_s": max(0.0, recipe.setup_seconds - microbatch - update),
        "spread": {
            "microbatch_s": [min(recipe.microbatch), max(recipe.microbatch)],
            "update_s": [min(recipe.update), max(recipe.update)],
        },
        "samples": {"microbatch": len(recipe.microbatch), "update": len(recipe.update)},
        "resolved_here": {
            "device": str(recipe.device),
            "precision": dtype_name(dtype),
            "compile": recipe.config.impl.compile_on(recipe.device),
            "threads": torch.get_num_threads(),
        },
        "measured": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
    }


def machine() -> dict:
    """The machine a file's costs belong to: CPU model, its speed-deciding flags and cores, the GPU, versions."""
    try:
        flags = next(
            (line.split(":", 1)[1].split() for line in Path("/proc/cpuinfo").read_text().splitlines()
             if line.startswith(("flags", "Features"))),
            [],
        )  # fmt: skip
    except OSError:
        flags = []
    versions = package_versions()
    return {
        "cpu": cpu_model(),
        "cpu_flags": sorted(flag for flag in flags if flag in CPU_FLAGS),
        "cpu_count": torch.multiprocessing.cpu_count(),
        "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
        "platform": platform.platform(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "triton": versions.get("triton"),
    }


def same_machine(saved: dict, here: dict) -> bool:
    return all(saved.get(key) == here.get(key) for key in ("cpu", "cpu_flags", "cpu_count", "gpu"))


def write(path: Path, entries: dict[str, dict], remeasure: bool = False) -> dict[str, dict]:
    """Merge `entries` into the calibration file at `path` (made if absent), refusing another machine's; the
    entries already there are kept unless `remeasure`. Returns the entries kept as they were."""
    here = machine()
    saved = calibration.read_calibration(path) if path.exists() else None
    if saved is not None and not same_machine(saved.get("machine", {}), here):
        raise ConfigError(
            f"{path} holds costs measured on {saved.get('machine', {}).get('cpu')!r}"
            f" ({saved.get('machine', {}).get('gpu') or 'no GPU'}); this is {here['cpu']!r}"
            f" ({here['gpu'] or 'no GPU'}): a file is one machine's. Write another with --out, and run with"
            " train.calibration=<that file>"
        )
    kept = saved["entries"] if saved else {}
    unchanged = {} if remeasure else {key: kept[key] for key in entries if key in kept}
    entries = on_the_files_scale(entries, unchanged)
    document = {
        "format": calibration.FORMAT,
        "machine": saved["machine"] if saved and not remeasure else here,
        "charges": calibration.CHARGES,
        "not_charged": list(calibration.NOT_CHARGED),
        "entries": {**kept, **entries, **unchanged},
    }
    atomic_write_text(path, json.dumps(document, indent=1, sort_keys=True) + "\n")
    return unchanged


def on_the_files_scale(entries: dict[str, dict], unchanged: dict[str, dict]) -> dict[str, dict]:
    """The new entries put on the scale of the ones kept: the machine runs a little faster or slower from one day
    to the next, and entries measured on different days would charge two recipes of one study at two speeds. The
    kept recipes measured again in the same rounds say by how much (the median of kept / now); the new entries'
    costs are multiplied by it, and say so. Without a kept recipe among those measured, nothing is scaled."""
    ratios = [unchanged[key]["microbatch_s"] / entries[key]["microbatch_s"] for key in unchanged]
    if not ratios:
        return entries
    by = statistics.median(ratios)
    scaled = {}
    for key, value in entries.items():
        if key in unchanged:
            continue
        value = {**value, "scaled": {"by": by, "to_the_kept": sorted(unchanged)}}
        for cost in ("microbatch_s", "update_s", "setup_s"):
            value[cost] *= by
        value["spread"] = {k: [v * by for v in pair] for k, pair in value["spread"].items()}
        scaled[key] = value
    return {**entries, **scaled}


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m cramming.calibrate", description=__doc__.splitlines()[0],
        formatter_class=argparse.RawDescriptionHelpFormatter, epilog="\n".join(__doc__.splitlines()[1:]),
    )  # fmt: skip
    parser.add_argument("overrides", nargs="*", help="the run's overrides, as pretrain.py takes them")
    parser.add_argument("--recipe", action="append", default=None,
                        help="one more recipe: its own overrides (quoted) after the common ones; repeatable")  # fmt: skip
    parser.add_argument("--out", type=Path, help="the calibration file (default: train.calibration's)")
    parser.add_argument("--rounds", type=int, default=5, help="timed updates per recipe (default 5)")
    parser.add_argument(
        "--microbatches", type=int, default=4, help="micro-batches per timed update (default 4)"
    )
    parser.add_argument("--warmup", type=int, default=2, help="untimed updates after set-up (default 2)")
    parser.add_argument("--remeasure", action="store_true", help="replace the entries the file has already")
    args = parser.parse_args(argv)
    if min(args.rounds, args.microbatches) < 1 or args.warmup < 0:
        parser.error("--rounds and --microbatches take a positive count, --warmup zero or more")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stderr)
    args = parse_args(argv)
    try:
        recipes_overrides = [args.overrides + shlex.split(extra) for extra in (args.recipe or [""])]
        warm_process()
        recipes = [set_up(overrides, compose(overrides)) for overrides in recipes_overrides]
        for _ in range(args.warmup):
            for recipe in recipes:
                one_update(recipe, args.microbatches, timed=False)
        for _ in range(args.rounds):  # interleaved: each round, every recipe once
            for recipe in recipes:
                one_update(recipe, args.microbatches)
        entries = {calibration.shape_key(r.shape): entry(r) for r in recipes}
        path = args.out or calibration.calibration_path(recipes[0].config.train.calibration)
        unchanged = write(path, entries, args.remeasure)
    except ConfigError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    for key, value in entries.items():
        print(
            f"{path}: {key} {value['described']}: micro-batch {value['microbatch_s']:.4g} s"
            f" ({value['spread']['microbatch_s'][0]:.4g}-{value['spread']['microbatch_s'][1]:.4g}), update"
            f" {value['update_s']:.4g} s, set-up {value['setup_s']:.3g} s"
            + (
                f"; kept its entry (micro-batch {unchanged[key]['microbatch_s']:.4g} s): now"
                f" {value['microbatch_s'] / unchanged[key]['microbatch_s']:.3f}x of it"
                if key in unchanged
                else ""
            )
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
