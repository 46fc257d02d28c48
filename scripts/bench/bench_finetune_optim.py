"""Seconds per fine-tuning update of each optimizer on one checkpoint, measured side by side in one process.

    python scripts/bench/bench_finetune_optim.py --checkpoint <run> \
        adamw adamw_8bit adamw_4bit "galore_adamw rank=8 scale=4" "galore_adamw_8bit_layerwise rank=8"

Each row is an optimizer name with optional `key=value` settings of eval.optim (glue-small's are the
defaults). Every row gets its own copy of the checkpoint's encoder with GLUE's classification head, and all
rows train on the same batches of real MRPC sentence pairs (batch 32, as glue-small). One update is what
fine-tuning does: forward under the run's autocast, backward, the optimizer step (through the one training
step of cramming.optim.step). After a warm-up, the rows take turns in rounds of `--steps` updates, and each
row's time is the median of its rounds; the ratio to the first row is taken per round (its median is
reported), so load that comes and goes on a shared machine hits every row alike. GaLore's SVD runs once
every update_proj_gap updates: its time is measured on its own (the first update of a fresh projector) and
reported both alone (an update forced to take new projectors, after the rounds) and spread over the gap.
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, replace
from pathlib import Path

import numpy as np
import torch

from cramming.eval.config import EvalConfig
from cramming.eval.finetune import batch_loss, encode, padded_batch
from cramming.eval.glue_data import load_local
from cramming.eval.head import SequenceClassifier
from cramming.eval.run import checkpoint_backbone
from cramming.eval.tasks import GLUE_TASKS
from cramming.impl import ImplConfig
from cramming.optim import build_optimizer
from cramming.optim.config import OptimConfig
from cramming.optim.report import optimizer_state_report
from cramming.optim.step import TrainStep


def parse_row(text: str, base: OptimConfig) -> tuple[str, OptimConfig]:
    name, *pairs = text.split()
    settings = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or key not in asdict(base):
            raise SystemExit(f"{text!r}: settings are key=value of eval.optim ({', '.join(asdict(base))})")
        kind = type(asdict(base)[key])
        settings[key] = value if kind is str else kind(float(value)) if kind in (int, float) else value
    return text, replace(base, name=name, **settings)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "rows", nargs="+", help='an optimizer name, with settings: "galore_adamw rank=8 scale=4"'
    )
    parser.add_argument("--checkpoint", required=True, help="a pretraining run name or folder")
    parser.add_argument("--glue-dir", type=Path, default=Path("data/glue"), help="scripts/get_data.py glue")
    parser.add_argument("--eval", default="glue-small", help="lr and batch size of this recipe (glue-small)")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--steps", type=int, default=10, help="updates per row per round")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--precision", default="auto", help="impl.precision: auto, fp32, bf16")
    return parser.parse_args(argv)


def build_rows(texts: list[str], recipe: EvalConfig, backbone, task, device, dtype) -> dict[str, dict]:
    """Per row: its own copy of the encoder with the classification head, its optimizer and training step."""
    rows = {}
    for text in texts:
        label, cfg = parse_row(text, recipe.optim)
        torch.manual_seed(0)
        model = SequenceClassifier(
            copy.deepcopy(backbone.encoder),
            backbone.hidden_size,
            task.num_labels,
            backbone.dropout,
            recipe.head,
        )
        optimizer = build_optimizer(model, cfg, scope="row")
        step = TrainStep(model, optimizer, device_type=device.type, dtype=dtype, grad_clip=None)
        rows[label] = {"model": model, "step": step, "cfg": cfg, "times": []}
    return rows


def time_rounds(rows: dict[str, dict], batches: list, rounds: int, update: Callable) -> None:
    """Each row's seconds per update in each round, appended to its "times"; who goes first rotates."""
    for round_number in range(rounds):
        order = list(rows.values())
        order = (
            order[round_number % len(order) :] + order[: round_number % len(order)]
        )  # rotate who goes first
        for row in order:
            start = time.perf_counter()
            for index in batches:
                update(row, index)
            row["times"].append((time.perf_counter() - start) / len(batches))


def time_refreshes(rows: dict[str, dict], batches: list, update: Callable) -> None:
    """GaLore: updates that take new projectors (the SVDs), after the warm-up, into each row's "svd"."""
    for row in rows.values():
        gap = row["cfg"].update_proj_gap
        row["svd"] = []
        if not row["cfg"].name.startswith("galore"):
            continue
        for index in batches[:3]:
            for state in row["step"].optimizer.state.values():
                state["step"] = gap  # the next update is step gap + 1: a refresh (cramming.optim.galore)
            start = time.perf_counter()
            update(row, index)
            row["svd"].append(time.perf_counter() - start)


def print_table(rows: dict[str, dict], args: argparse.Namespace, batch_size: int, dtype, why: str) -> None:
    reference = next(iter(rows.values()))
    print(f"# Fine-tuning update time per optimizer: {args.checkpoint}\n")
    print(
        f"MRPC batches of {batch_size}, {args.threads} thread(s), precision {str(dtype).removeprefix('torch.')}"
        f" ({why}); {args.rounds} rounds of {args.steps} updates per row, rows interleaved.\n"
    )
    print("| optimizer | ms/update (median of rounds) | × first row (median of per-round ratios) | "
          "GaLore: update with new projectors, ms | their SVDs spread over the gap, ms/update | state MiB |")  # fmt: skip
    print("|---|---:|---:|---:|---:|---:|")
    for label, row in rows.items():
        ratios = [t / r for t, r in zip(row["times"], reference["times"], strict=True)]
        steady = statistics.median(row["times"])
        svd = (statistics.median(row["svd"]) - steady) / row["cfg"].update_proj_gap if row["svd"] else 0.0
        state = optimizer_state_report(row["step"].optimizer)["state_bytes"] / 2**20
        refresh = f"{1000 * statistics.median(row['svd']):.0f}" if row["svd"] else "—"
        print(f"| {label} | {1000 * steady:.1f} | {statistics.median(ratios):.2f} | {refresh} | "
              f"{1000 * svd:.2f} | {state:.2f} |")  # fmt: skip


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)

    recipe = EvalConfig(optim=replace(EvalConfig().optim, lr=1e-3), batch_size=32)  # glue-small's settings
    impl = ImplConfig(device="cpu", precision=args.precision)
    device = impl.torch_device()
    dtype, why = impl.precision_choice(device)
    backbone = checkpoint_backbone(args.checkpoint, impl)
    task = GLUE_TASKS["MRPC"]
    train = encode(load_local(task, args.glue_dir)["train"], backbone.tokenizer, 128, None, 0)
    rng = np.random.default_rng(0)
    batches = [rng.choice(len(train), recipe.batch_size, replace=False) for _ in range(args.steps)]
    rows = build_rows(args.rows, recipe, backbone, task, device, dtype)

    def update(row: dict, index: np.ndarray) -> None:
        batch = padded_batch(train, index, backbone.pad_id, device)
        row["step"].begin(1.0)
        row["step"].microbatch(batch_loss, row["model"], batch, task.is_regression)
        row["step"].apply()

    for row in rows.values():  # a warm-up (GaLore: its first SVDs)
        for index in batches[:3]:
            update(row, index)
    time_rounds(rows, batches, args.rounds, update)
    time_refreshes(rows, batches, update)
    print_table(rows, args, recipe.batch_size, dtype, why)


if __name__ == "__main__":
    main()
