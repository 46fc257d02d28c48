"""Tables and a plot of the CPU study (results/cpu-study/) from its GLUE evaluation folders.

Each evaluation folder holds glue_results.json (eval.py writes it), which also carries the pretraining run's
updates, time and held-out MLM / context-use figures. Give each folder a label:

    python scripts/studies/cpu_study.py tiny-60=outputs/cpu-study-glue-tiny-60min/<timestamp> \
        tiny-scratch=outputs/cpu-study-glue-tiny-scratch/<timestamp> ... --out results/cpu-study

Prints markdown tables (GLUE dev scores per task: median over seeds, [min, max]; pretraining figures; time
of every phase; pretrained-vs-scratch margins; the curve of each series: every point against the one before,
beyond the range of the per-seed averages or not) and writes glue_vs_minutes.png under --out. Labels
`<arch>-scratch` are the no-pretraining baselines of `<arch>-*`.

Evaluation folders and checkpoints do not outlive a machine. `--keep DIR` writes each run's results, with its
pretraining run card inside, to DIR/<label>.json; such a file is accepted in place of a folder, so the tables
and the plot can be redrawn, and new points added to them, later.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np

from cramming.eval.scores import EntryScore, glue_average, summarize

TASKS = ("SST-2", "MRPC", "STS-B", "RTE", "CoLA")
# Turc et al. (2019), "Well-Read Students Learn Better", GLUE test set as published: SST-2 acc, MRPC F1,
# STS-B Pearson, RTE acc, CoLA Matthews
TURC = {
    "BERT-Tiny": {"SST-2": 83.2, "MRPC": 81.1, "STS-B": 74.3, "RTE": 57.2, "CoLA": 0.0},
    "BERT-Mini": {"SST-2": 85.9, "MRPC": 81.1, "STS-B": 75.4, "RTE": 57.9, "CoLA": 0.0},
}


def load(folder: Path) -> dict:
    path = folder / "glue_results.json" if folder.is_dir() else folder
    if not path.exists():
        raise SystemExit(f"{path}: no glue_results.json; give the folder an `eval.py` run wrote")
    return json.loads(path.read_text())


def entry_scores(results: dict) -> dict[str, EntryScore]:
    per_entry: dict[str, list[dict[str, float]]] = {}
    for run in results["runs"]:
        for entry, metrics in run["metrics"].items():
            per_entry.setdefault(entry, []).append(metrics)
    return summarize(per_entry)


def pretraining_card(results: dict) -> dict | None:
    """The run card of the pretraining run an evaluation used (its checkpoint folder's parent, or the copy
    --keep stored with the results)."""
    if "pretraining_card" in results:
        return results["pretraining_card"]
    checkpoint = Path(results.get("checkpoint", ""))
    for folder in (checkpoint, checkpoint.parent):
        if (folder / "run_card.json").exists():
            return json.loads((folder / "run_card.json").read_text())
    return None


def average(scores: dict[str, EntryScore]) -> float | None:
    """The GLUE average ×100 over the five tasks, or None when one is missing (no partial averages here)."""
    if not all(t in scores for t in TASKS):
        return None
    return 100 * glue_average({t: scores[t] for t in TASKS})[0]


def seed_averages(results: dict) -> list[float]:
    """The five-task average ×100 of each fine-tuning seed on its own; [] when a seed misses a task."""
    seeds = sorted({run["seed"] for run in results["runs"]})
    out = []
    for seed in seeds:
        scores = entry_scores({"runs": [run for run in results["runs"] if run["seed"] == seed]})
        avg = average(scores)
        if avg is None:
            return []
        out.append(avg)
    return out


def curve_rows(runs: dict) -> list[str]:
    """Each series (label prefix) in order of pretraining updates: its average, the range of its per-seed
    averages, and whether it is above the point before by more than both ranges (this point's lowest seed
    above the previous point's highest)."""
    series: dict[str, list[tuple[int, str, float, list[float], float]]] = {}
    for label, (results, scores) in runs.items():
        avg, per_seed = average(scores), seed_averages(results)
        if avg is None or not per_seed:
            continue
        pre = results.get("pretraining") or {}
        point = (pre.get("updates", 0), label, avg, per_seed, 60 * pre.get("elapsed_h", 0.0))
        series.setdefault(label.split("-")[0], []).append(point)
    rows = []
    for points in series.values():
        points.sort(key=lambda point: point[0])
        for i, (updates, label, avg, per_seed, minutes) in enumerate(points):
            if i == 0:
                verdict = "— (first point)"
            elif len(per_seed) < 2 or len(points[i - 1][3]) < 2:
                verdict = "— (one seed: no spread to compare with)"
            else:
                verdict = "yes" if min(per_seed) > max(points[i - 1][3]) else "no"
            rows.append(
                f"| {label} | {minutes:.1f} | {updates} | {avg:.1f} | [{min(per_seed):.1f}, {max(per_seed):.1f}]"
                f" | {verdict} |"
            )
    return rows


def last_epoch_losses(results: dict) -> dict[str, float]:
    """Task -> median over seeds of the last epoch's mean training loss, for runs that recorded it (eval.py
    since the seventh session of issue 33; older results have no epoch_losses)."""
    found: dict[str, list[float]] = {}
    for run in results["runs"]:
        if run.get("epoch_losses"):
            found.setdefault(run["task"], []).append(run["epoch_losses"][-1])
    return {task: float(np.median(values)) for task, values in found.items()}


def cell(score: EntryScore | None) -> str:
    if score is None:
        return "—"
    lo, hi = 100 * min(score.per_seed), 100 * max(score.per_seed)
    spread = f" [{lo:.1f}, {hi:.1f}]" if len(score.per_seed) > 1 else " (1 seed)"
    return f"{100 * score.median:.1f}{spread}"


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("runs", nargs="+", help="label=evaluation folder")
    parser.add_argument("--out", type=Path, default=None, help="folder for glue_vs_minutes.png")
    parser.add_argument(
        "--keep",
        type=Path,
        default=None,
        help="folder to store each run's results (and run card) as <label>.json",
    )
    parser.add_argument(
        "--glue-dir", help="with a local GLUE copy: the pair probe of each run's checkpoint (STS-B dev pairs)"
    )
    return parser.parse_args(argv)


def load_runs(specs: list[str]) -> dict:
    """label -> (results, entry scores) of each label=folder."""
    runs = {}
    for spec in specs:
        label, sep, folder = spec.partition("=")
        if not sep:
            raise SystemExit(
                f"{spec!r}: give label=folder, e.g. tiny-60=outputs/cpu-study-glue-tiny-60min/<ts>"
            )
        results = load(Path(folder))
        runs[label] = (results, entry_scores(results))
    return runs


def print_scores(runs: dict) -> None:
    """GLUE dev scores per task and their average, with Turc et al.'s test figures below."""
    print("| model | " + " | ".join(TASKS) + " | Avg |")
    print("|---" * (len(TASKS) + 2) + "|")
    for label, (_, scores) in runs.items():
        avg = average(scores)
        cells = [cell(scores.get(t)) for t in TASKS]
        print(f"| {label} | " + " | ".join(cells) + f" | {'—' if avg is None else f'{avg:.1f}'} |")
    for name, figures in TURC.items():
        values = [figures[t] for t in TASKS]
        print(
            f"| {name} (Turc et al., test) | "
            + " | ".join(f"{v:.1f}" for v in values)
            + f" | {np.mean(values):.1f} |"
        )


def print_pretraining(runs: dict) -> None:
    """Each run's pretraining figures (updates, time, held-out MLM and context use) and fine-tuning time."""
    print("\n| model | updates | pretraining min | val MLM loss | val MLM acc | masked loss real | shuffled | gain |"
          " unigram entropy | fine-tuning min (all tasks x seeds) | seeds |")  # fmt: skip
    print("|---" * 11 + "|")
    for label, (results, _) in runs.items():
        pre = results.get("pretraining") or {}
        val = pre.get("validation") or {}
        seconds = sum(run["seconds"] for run in results["runs"])
        seeds = sorted({run["seed"] for run in results["runs"]})

        def fmt(key: str, digits: int = 3, val: dict = val) -> str:
            value = val.get(key)
            return "—" if value is None else f"{value:.{digits}f}"

        print(
            f"| {label} | {pre.get('updates', '—')} | {60 * pre.get('elapsed_h', 0.0):.1f} | {fmt('loss')} |"
            f" {fmt('mlm_acc')} | {fmt('context_loss_real')} | {fmt('context_loss_shuffled')} |"
            f" {fmt('context_gain')} | {fmt('context_unigram_entropy')} | {seconds / 60:.1f} | {len(seeds)} |"
        )


def print_phase_times(runs: dict) -> None:
    print(
        "\n| model | data s (preprocessed earlier: load only) | pretraining s | final validation s | fine-tuning s | evaluation run s |"
    )
    print("|---|---|---|---|---|---|")
    for label, (results, _) in runs.items():
        card = pretraining_card(results)
        seconds = (card or {}).get("seconds", {})
        tuning = sum(run["seconds"] for run in results["runs"])
        total = results.get("seconds")  # the whole evaluation run
        print(
            f"| {label} | {seconds.get('data', float('nan')):.1f} | {seconds.get('train', float('nan')):.0f} |"
            f" {seconds.get('eval', float('nan')):.1f} | {tuning:.0f} | {'—' if total is None else f'{total:.0f}'} |"
        )


def margin_rows(runs: dict) -> list[str]:
    """Per pretrained run and task: its median over the `<arch>-scratch` median, against the seed spreads."""
    margins = []
    for label, (_, scores) in runs.items():
        arch = label.split("-")[0]
        base = runs.get(f"{arch}-scratch")
        if base is None or label == f"{arch}-scratch":
            continue
        for task in TASKS:
            ours, theirs = scores.get(task), base[1].get(task)
            if ours is None or theirs is None:
                continue
            margin = 100 * (ours.median - theirs.median)
            spread = 100 * max(ours.spread, theirs.spread)
            if min(len(ours.per_seed), len(theirs.per_seed)) < 2:
                verdict = "— (one seed: no spread to compare with)"
            else:
                verdict = "yes" if margin > spread else "no"
            margins.append(f"| {label} | {task} | {margin:+.1f} | {spread:.1f} | {verdict} |")
    return margins


def print_curve(runs: dict) -> None:
    curve = curve_rows(runs)
    if curve:
        print(
            "\n| model | pretraining min | updates | average | per-seed averages [min, max] |"
            " above the point before, beyond both ranges |"
        )
        print("|---|---|---|---|---|---|")
        print("\n".join(curve))


def print_margins(runs: dict) -> None:
    margins = margin_rows(runs)
    if margins:
        print(
            "\n| model | task | median - scratch median | larger seed spread (max - min) | beats scratch by more |"
        )
        print("|---|---|---|---|---|")
        print("\n".join(margins))


def print_last_epoch_losses(runs: dict) -> None:
    fits = {label: last_epoch_losses(results) for label, (results, _) in runs.items()}
    if any(fits.values()):
        print("\n| model | " + " | ".join(f"{t} last-epoch train loss" for t in TASKS) + " |")
        print("|---" * (len(TASKS) + 1) + "|")
        for label, losses in fits.items():
            cells = ["—" if t not in losses else f"{losses[t]:.3f}" for t in TASKS]
            print(f"| {label} | " + " | ".join(cells) + " |")


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    runs = load_runs(args.runs)
    print_scores(runs)
    print_pretraining(runs)
    print_phase_times(runs)
    print_curve(runs)
    print_margins(runs)
    print_last_epoch_losses(runs)
    if args.glue_dir is not None:
        print_pair_probes(runs, args.glue_dir)
    if args.out is not None:
        plot(runs, args.out)
    if args.keep is not None:
        keep(runs, args.keep)


def keep(runs: dict, folder: Path) -> None:
    """Each run's results with its pretraining run card inside, as folder/<label>.json."""
    folder.mkdir(parents=True, exist_ok=True)
    for label, (results, _) in runs.items():
        stored = dict(results)
        card = pretraining_card(results)
        if card is not None:
            stored["pretraining_card"] = card
        (folder / f"{label}.json").write_text(json.dumps(stored, indent=1) + "\n")
    print(f"\nkept: {', '.join(f'{folder / label}.json' for label in runs)}")


def print_pair_probes(runs: dict, glue_dir: str) -> None:
    """The training-free pair probe (cramming/eval/pair_probe.py) of each run's checkpoint, once per checkpoint."""
    from cramming.eval.glue_data import load_task
    from cramming.eval.pair_probe import pair_probe
    from cramming.eval.run import checkpoint_backbone
    from cramming.eval.tasks import GLUE_TASKS
    from cramming.impl import ImplConfig

    dev = load_task(GLUE_TASKS["STS-B"], glue_dir)["dev"]
    probes: dict[str, dict] = {}
    print("\n| model | pair probe: alone | pair probe: joint |")
    print("|---|---|---|")
    for label, (results, _) in runs.items():
        checkpoint = results.get("checkpoint", "")
        if checkpoint not in probes:
            backbone = checkpoint_backbone(checkpoint, ImplConfig(device="cpu"))
            probes[checkpoint] = pair_probe(backbone, dev["text_a"], dev["text_b"], np.asarray(dev["label"]))
        found = probes[checkpoint]
        print(f"| {label} | {found['alone']:.1f} | {found['joint']:.1f} |")


def plot(runs: dict, out: Path) -> None:
    from matplotlib.figure import Figure

    by_arch: dict[str, list[tuple[float, float, float, float, float]]] = {}
    for label, (results, scores) in runs.items():
        avg = average(scores)
        if avg is None:
            continue
        pre = results.get("pretraining") or {}
        minutes, updates = 60 * pre.get("elapsed_h", 0.0), pre.get("updates", 0)
        per_seed = seed_averages(results) or [avg]
        by_arch.setdefault(label.split("-")[0], []).append(
            (minutes, updates, avg, min(per_seed), max(per_seed))
        )
    if not by_arch:
        return
    fig = Figure(figsize=(9, 3.5))
    axes = fig.subplots(1, 2, sharey=True)
    for column, (ax, xlabel) in enumerate(
        zip(axes, ("pretraining minutes (1 CPU thread)", "pretraining updates (batch 64)"), strict=True)
    ):
        for arch, points in sorted(by_arch.items()):
            points.sort(key=lambda point: point[column])
            xs, ys = [point[column] for point in points], [point[2] for point in points]
            (line,) = ax.plot(xs, ys, marker="o", label=f"{arch} (ours, dev)")
            # bars: the range of the per-seed averages, drawn from its ends. The point is the average of the
            # per-task medians, which can lie outside that range (each task's median may come from another
            # seed), so the bar is not an error bar around the point.
            lows, highs = [point[3] for point in points], [point[4] for point in points]
            ax.vlines(xs, lows, highs, color=line.get_color())
            ax.plot(xs * 2, lows + highs, linestyle="none", marker="_", markersize=6, color=line.get_color())
        for color, (name, figures) in zip(("C6", "C7"), TURC.items(), strict=True):
            mean = np.mean([figures[t] for t in TASKS])
            ax.axhline(mean, color=color, linestyle="--", linewidth=1, label=f"{name} (test)")
        ax.set_xlabel(xlabel)
    axes[0].set_ylabel("GLUE average of 5 tasks")
    fig.suptitle(", ".join(TASKS), fontsize=8)
    # below the axes: inside them, "best" still lands on an error bar when the points span the panel. At most
    # five entries a row, so that many series wrap onto more rows instead of running off the figure's sides.
    handles, labels = axes[1].get_legend_handles_labels()
    columns = min(len(labels), 5)
    rows = -(-len(labels) // columns)
    fig.legend(handles, labels, loc="lower center", ncol=columns, fontsize=7)
    fig.tight_layout(rect=(0, 0.01 + 0.06 * rows, 1, 1))
    out.mkdir(parents=True, exist_ok=True)
    fig.savefig(out / "glue_vs_minutes.png", dpi=120)
    print(f"\nplot: {out / 'glue_vs_minutes.png'}")


if __name__ == "__main__":
    main()
