"""Chaos test of pretraining: a tiny CPU run interrupted at random points by SIGKILL and SIGTERM (often in the
middle of an update), resumed each time, then compared with an uninterrupted run of the same seed.

    python scripts/checks/chaos.py --interruptions 6 --out results/reliability/chaos.md

Checks: the final weights are identical (max |dw| = 0), every state.pt / state.prev.pt left behind loads, no
temporary file is left behind, and the budget a SIGTERM-stopped segment charged matches the wall time it spent
in train() within 1%, less the final save (it follows the clock's last reading, which the state holds). (A SIGKILL loses the work since the last saved state, which is not charged: at most
train.checkpoint_every_min. Each resume repeats the set-up, which is charged, so a chain of N segments spends
more budget than the uninterrupted run; the last row says how much.) Exits 1 when a check fails.
"""

from __future__ import annotations

import argparse
import datetime as dt
import random
import re
import signal
import sys
from dataclasses import dataclass
from pathlib import Path

import torch

from cramming.job.runcard import newest_card, read_card
from cramming.model.checkpoint import load_pretrained
from cramming.study import launch
from cramming.train import state as train_state

REPO = Path(__file__).resolve().parents[2]

MICROBATCH, BATCH = 8, 32  # 4 micro-batches per update: most signals land in the middle of one
TEMPORARY = re.compile(r"(\.tmp|\.next|\.partial)$")


def recipe(base_dir: Path, name: str, steps: int, seed: int) -> list[str]:
    return [
        "arch=tiny", "data=embedded", "data.seq_length=32", f"base_dir={base_dir}", f"name={name}",
        f"seed={seed}", "budget=1", f"train.steps={steps}", "train.lr_schedule=steps-linear",
        f"impl.microbatch_size={MICROBATCH}", f"train.batch_size={BATCH}", "train.batch_size_ramp=0",
        "train.dropout=0.1",  # the torch RNG stream must survive the interruptions too
        "train.checkpoint_every_min=0.005",  # a state every 0.3 s: something for a SIGKILL to fall back on
        "impl.cpu_threads=1", "impl.num_workers=0", "train.validation_rows=16", "train.log_every=10",
    ]  # fmt: skip


@dataclass
class Segment:
    """One process of a chain: how it ended and what it left in its run folder."""

    kind: str  # SIGTERM | SIGKILL | none (ran to the end)
    after_s: float  # seconds after training started when the signal was sent
    returncode: int
    run_dir: Path | None
    log: str


def run_segment(args: list[str], log_path: Path, kind: str, after_s: float) -> Segment:
    """pretrain.py with these overrides; `after_s` seconds into its training (SIGTERM or SIGKILL) unless `kind`
    is none. Its run folder is the newest of its name: every segment, a resumed one too, claims its own."""
    stop = signal.SIGTERM if kind == "SIGTERM" else signal.SIGKILL
    started = None if kind == "none" else (lambda text: "training on" in text)
    code, text, _ = launch.run_logged(
        [sys.executable, "pretrain.py", *args], log_path, started, stop=stop, delay=after_s, timeout=600
    )
    found = newest_card(args_value(args, "base_dir"), args_value(args, "name"))
    return Segment(kind, after_s, code, None if found is None else found[0], text)


def args_value(args: list[str], key: str) -> str:
    return next(a.split("=", 1)[1] for a in args if a.startswith(f"{key}="))


def state_progress(run_dir: Path | None) -> train_state.TrainingState | None:
    path = None if run_dir is None else run_dir / train_state.STATE
    return train_state.read_state(path) if path is not None and path.exists() else None


def train_wall_seconds(run_dir: Path) -> float | None:
    """Wall time of train() as the run card splits it (set-up, compile, train, eval)."""
    card = read_card(run_dir)
    if card is None:
        return None
    seconds = card.get("seconds", {})
    parts = [seconds.get(k) for k in ("setup", "compile", "train", "eval")]
    return sum(p for p in parts if p is not None) if any(p is not None for p in parts) else None


def max_abs_diff(a: Path, b: Path) -> float:
    ours, theirs = load_pretrained(a).model.state_dict(), load_pretrained(b).model.state_dict()
    return max((ours[k] - v).abs().max().item() for k, v in theirs.items())


def run_chaos(workdir: Path, interruptions: int, steps: int, seed: int, rng: random.Random) -> list[dict]:
    """The uninterrupted reference, then the chain; one row per interruption and a final row."""
    workdir.mkdir(parents=True, exist_ok=True)
    reference = run_segment(recipe(workdir, "reference", steps, seed), workdir / "reference.log", "none", 0.0)
    if reference.returncode != 0 or reference.run_dir is None:
        raise RuntimeError(f"the reference run failed:\n{reference.log[-3000:]}")
    ref_state = state_progress(reference.run_dir)
    train_s = train_wall_seconds(reference.run_dir) or 5.0
    kinds = ["SIGTERM", "SIGKILL"] * interruptions
    kinds = kinds[:interruptions]
    rng.shuffle(kinds)
    rows, resume = [], False
    for i, kind in enumerate(kinds):
        before = latest_state(workdir / "chain")
        after_s = rng.uniform(0.1, 0.7) * train_s / max(1, interruptions)  # spread the chain over the run
        args = recipe(workdir, "chain", steps, seed) + (["resume=true"] if resume else [])
        segment = run_segment(args, workdir / f"chain_{i}.log", kind, after_s)
        if rows:
            rows[-1]["resumed_ok"] = resumed(segment)
        rows.append(describe(segment, before))
        resume = resume or latest_state(workdir / "chain") is not None
        if segment.returncode == 0:  # finished before the signal: the chain has nothing left to resume
            break
    final = run_segment(
        recipe(workdir, "chain", steps, seed) + (["resume=true"] if resume else []),
        workdir / "chain_final.log", "none", 0.0,
    )  # fmt: skip
    if final.returncode != 0:
        raise RuntimeError(f"the last resume failed:\n{final.log[-3000:]}")
    if rows and rows[-1]["when"] != "finished before the signal":
        rows[-1]["resumed_ok"] = resumed(final)
    chain_state = state_progress(final.run_dir)
    rows.append({
        "kind": "final", "when": f"after update {chain_state.updates}",
        "resumed_ok": final.returncode == 0,
        "max_dw": max_abs_diff(final.run_dir / "checkpoint", reference.run_dir / "checkpoint"),
        "budget_delta": (chain_state.elapsed - ref_state.elapsed) / ref_state.elapsed,
        "budget_note": f"chain {chain_state.elapsed:.2f} s vs uninterrupted {ref_state.elapsed:.2f} s",
    })  # fmt: skip
    return rows


def latest_state(root: Path) -> Path | None:
    return train_state.newest_state(root.parent, root.name) if root.is_dir() else None


def resumed(segment: Segment) -> bool:
    """The segment found a resumable state and continued from it (a fallback to state.prev.pt counts)."""
    return "resuming from" in segment.log and segment.returncode in (0, 128 + signal.SIGTERM, -signal.SIGKILL)


def describe(segment: Segment, before: Path | None) -> dict:
    """Where the interruption hit, whether the run left a state the next one can load, and its budget."""
    loaded = train_state.read_state(before) if before else None
    start = loaded.progress if loaded else train_state.Progress()
    state = state_progress(segment.run_dir)
    row = {"kind": segment.kind, "resumed_ok": False, "max_dw": None, "budget_delta": None, "budget_note": ""}
    if segment.returncode == 0:
        row |= {"when": "finished before the signal", "resumed_ok": True}
        return row
    if segment.kind == "SIGTERM" and state is not None:
        p = state.progress
        dropped = (p.microbatches - start.microbatches) - (p.rows - start.rows) // MICROBATCH
        where = f"update {state.updates + 1}, {dropped} of {BATCH // MICROBATCH} micro-batches done"
        where = where if dropped else f"after update {state.updates}"
        row["when"] = f"{segment.after_s:.2f} s in: {where}"
        charged = state.elapsed - (loaded.elapsed if loaded else 0.0)
        wall = train_wall_seconds(segment.run_dir)
        if wall:
            final_save = final_save_seconds(segment.log)
            trained = wall - final_save
            row |= {"budget_delta": (charged - trained) / trained, "charged": charged, "wall": wall,
                    "final_save": final_save}  # fmt: skip
            row["budget_note"] = (
                f"charged {charged:.3f} s, in train() {wall:.3f} s less the final save {final_save:.3f} s"
            )
    else:
        last = f"last state: update {state.updates}" if state else "no state saved"
        row["when"] = f"{segment.after_s:.2f} s in ({last})"
        row["budget_note"] = "work since the last state is lost, not charged"
    return row  # resumed_ok: set when the next segment has run


# the log's timestamps are to the millisecond: two of them bound the final save
LOG_RESOLUTION_S = 0.002


def budget_ok(row: dict) -> bool:
    """A SIGTERM segment charged the time it trained (train() less the final save, which comes after the
    clock's last reading that the saved state holds): within 1%, or the log's resolution."""
    trained = row["wall"] - row["final_save"]
    return abs(row["charged"] - trained) <= max(0.01 * trained, LOG_RESOLUTION_S)


def final_save_seconds(log: str) -> float:
    """From the log line `stopping (...)` to the last `resumable state saved`: the save after the clock's last
    reading."""
    stamp = r"\[(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3})\]"
    stop = re.findall(stamp + r".*stopping \(", log)
    saved = re.findall(stamp + r".*resumable state saved", log)
    if not stop or not saved:
        return 0.0
    parse = lambda text: dt.datetime.strptime(text, "%Y-%m-%d %H:%M:%S,%f")  # noqa: E731
    return max(0.0, (parse(saved[-1]) - parse(stop[-1])).total_seconds())


def stray_files(workdir: Path) -> list[Path]:
    return [p for p in workdir.rglob("*") if TEMPORARY.search(p.name)]


def unloadable_states(workdir: Path) -> list[str]:
    bad = []
    for path in [*workdir.rglob(train_state.STATE), *workdir.rglob(train_state.PREVIOUS)]:
        try:
            train_state.load_state(path)
        except train_state.StateUnreadable as err:
            bad.append(str(err))
    return bad


def report(rows: list[dict], strays: list[Path], bad_states: list[str], command: str) -> tuple[str, bool]:
    lines = [
        "# Reliability: interrupted and resumed pretraining",
        "",
        f"`{command}` (tiny model, embedded data, steps schedule, dropout 0.1, 4 micro-batches per update,",
        "one CPU thread). Each interruption is resumed with `resume=true`; the last row compares the chain's",
        "final model with an uninterrupted run of the same seed. Budget delta: for SIGTERM, charged budget vs",
        "wall time in train() less the final save (checked: within 1%); for the final row, the chain's charged",
        "budget vs the uninterrupted run's (not checked: every resume repeats the charged set-up).",
        "",
        "| # | interruption | when | resumed ok | max abs dw | budget delta |",
        "|---|---|---|---|---|---|",
    ]
    ok = not strays and not bad_states
    for i, row in enumerate(rows, start=1):
        dw = "—" if row["max_dw"] is None else f"{row['max_dw']:.1e}" if row["max_dw"] else "0"
        delta = "—" if row["budget_delta"] is None else f"{100 * row['budget_delta']:+.2f}%"
        note = f" ({row['budget_note']})" if row["budget_note"] else ""
        lines.append(
            f"| {i} | {row['kind']} | {row['when']} | {'yes' if row['resumed_ok'] else 'NO'} | {dw} | {delta}{note} |"
        )
        ok &= row["resumed_ok"]
        if row["kind"] == "final":
            ok &= row["max_dw"] == 0.0
        elif row["budget_delta"] is not None:
            ok &= budget_ok(row)
    lines += [
        "",
        f"Temporary files left behind: {len(strays)}"
        + (f" ({', '.join(map(str, strays))})" if strays else "."),
        f"States that do not load: {len(bad_states)}"
        + (f" ({'; '.join(bad_states)})" if bad_states else "."),
        f"All checks passed: {'yes' if ok else 'NO'}.",
        "",
    ]
    return "\n".join(lines), ok


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--interruptions", type=int, default=6)
    parser.add_argument("--steps", type=int, default=60, help="updates of the run (train.steps)")
    parser.add_argument("--seed", type=int, default=0, help="the runs' seed and the chaos's")
    parser.add_argument("--workdir", type=Path, default=REPO / "outputs" / "chaos")
    parser.add_argument("--out", type=Path, default=REPO / "results" / "reliability" / "chaos.md")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    rows = run_chaos(args.workdir, args.interruptions, args.steps, args.seed, random.Random(args.seed))
    command = f"python scripts/checks/chaos.py --interruptions {args.interruptions} --steps {args.steps} --seed {args.seed}"
    text, ok = report(rows, stray_files(args.workdir), unloadable_states(args.workdir), command)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(text)
    print(text)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
