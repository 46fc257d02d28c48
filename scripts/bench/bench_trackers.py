"""What the experiment trackers cost a pretraining run: tokens/s with trackers=[tensorboard,wandb,mlflow]
(W&B offline, MLflow into an SQLite file) against none, in runs that alternate (ABBA order per round, so a
drift in the machine's load falls on both), several rounds. Prints every run and the ratio of the medians.

    python scripts/bench/bench_trackers.py --rounds 4

Throughput is measured between the first and the last metrics record of a run: the updates with their
logging (where the trackers work, on the main thread, at log steps) and nothing of the set-up, the trackers'
start-up (before the budget clock) or the final validation. Needs pip install -e '.[trackers]'.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
TRACKERS = "[tensorboard,wandb,mlflow]"
SEQ, BATCH = 64, 16  # tokens per row, rows per update
# a tiny pretraining on the embedded corpus: a fixed number of updates on one CPU thread
RUN = [
    "arch=tiny", "data=embedded", f"data.seq_length={SEQ}", "budget=1", "train.lr_schedule=steps-linear",
    f"impl.microbatch_size={BATCH}", f"train.batch_size={BATCH}", "train.batch_size_ramp=0", "impl.cpu_threads=1",
    "impl.num_workers=0", "train.validation_rows=16",
]  # fmt: skip


def pretrain(base_dir: Path, name: str, trackers: str, steps: int, log_every: int) -> float:
    """One run; returns its tokens/s from its first to its last metrics record."""
    command = [
        sys.executable, str(REPO / "pretrain.py"), *RUN, f"base_dir={base_dir}", f"name={name}",
        f"train.steps={steps}", f"train.log_every={log_every}", f"trackers={trackers}",
        f"tracking.mlflow_uri=sqlite:///{base_dir / 'mlflow.db'}",
    ]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1", "WANDB_MODE": "offline"}
    subprocess.run(command, cwd=REPO, env=env, check=True, capture_output=True)
    (run_dir,) = (base_dir / name).iterdir()
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    logged = [r for r in records if "tok_per_s" in r]
    first, last = logged[0], logged[-1]
    seconds = (last["elapsed_h"] - first["elapsed_h"]) * 3600
    return (last["update"] - first["update"]) * BATCH * SEQ / seconds


def seconds_per_log(base_dir: Path, interval: float, records: int = 40) -> float:
    """The trackers' own cost of one metrics record, in this process: all three started on a run card, then
    `records` records of a pretraining's shape logged `interval` seconds apart (the time between two log steps
    of a run, so that MLflow's requests bundle as many records as in a run), each call timed."""
    from cramming.job.runcard import RunCard
    from cramming.job.trackers import start_trackers
    from cramming.trackers.config import TrackingConfig

    os.environ["WANDB_MODE"] = "offline"
    run_dir = base_dir / "in-process"
    run_dir.mkdir()
    card = RunCard(run_dir, "pretrain", {"base_dir": str(base_dir), "name": "in-process"})
    settings = TrackingConfig(mlflow_uri=f"sqlite:///{base_dir / 'mlflow.db'}")
    trackers = start_trackers(["tensorboard", "wandb", "mlflow"], settings, card)
    record = {
        "update": 0, "microbatches": 0, "loss": 7.1, "mlm_acc": 0.05, "lr": 1e-3, "batch_size": BATCH,
        "seq_per_s": 200.0, "tok_per_s": 12800.0, "elapsed_h": 0.01, "budget_fraction": 0.01, "skipped": 0,
    }  # fmt: skip
    spent = 0.0
    for update in range(1, records + 1):
        time.sleep(interval)  # the updates between two log steps
        start = time.perf_counter()
        trackers.log(record | {"update": update, "microbatches": update, "loss": 7.1 - update * 1e-3})
        spent += time.perf_counter() - start
    card.end("ok")
    return spent / records


def report_per_log(base_dir: Path, interval: float) -> None:
    per_log = seconds_per_log(base_dir, interval)
    print(
        f"in-process: {1000 * per_log:.2f} ms per metrics record with all three trackers, logged every"
        f" {interval:.2f} s: {100 * per_log / interval:.2f}% of the time between two log steps"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=4, help="each round: one run without, one with (ABBA)")
    parser.add_argument("--steps", type=int, default=300, help="updates per run")
    parser.add_argument(
        "--log-every", type=int, default=10, help="train.log_every: how often the trackers log"
    )
    parser.add_argument("--interval", type=float, default=0.7, help="--rounds 0: seconds between log steps")
    args = parser.parse_args()
    base_dir = Path(tempfile.mkdtemp(prefix="bench-trackers-"))
    if args.rounds == 0:  # the in-process timing only
        report_per_log(base_dir, args.interval)
        return
    pretrain(
        base_dir, "warm-up", "[]", 5, args.log_every
    )  # the corpus into the cache, files into the page cache
    speeds: dict[str, list[float]] = {"none": [], "all": []}
    for round_ in range(args.rounds):
        order = ("none", "all") if round_ % 2 == 0 else ("all", "none")
        for mode in order:
            trackers = "[]" if mode == "none" else TRACKERS
            speeds[mode].append(pretrain(base_dir, f"{mode}-{round_}", trackers, args.steps, args.log_every))
            print(f"round {round_} {mode:4s} {speeds[mode][-1]:9.0f} tok/s", flush=True)
    none, tracked = statistics.median(speeds["none"]), statistics.median(speeds["all"])
    pairs = [a / n for a, n in zip(speeds["all"], speeds["none"], strict=True)]
    print(f"median tok/s: none {none:.0f}, all three trackers {tracked:.0f}; ratio {tracked / none:.3f}")
    print(f"per-round ratios (with / without): {', '.join(f'{r:.3f}' for r in pairs)}")
    print(f"median of the per-round ratios: {statistics.median(pairs):.3f}")
    report_per_log(base_dir, args.log_every * BATCH * SEQ / none)  # the time between two log steps
    print(f"runs in {base_dir}")


if __name__ == "__main__":
    main()
