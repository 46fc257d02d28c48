"""Tables and a plot of the optimizer study (results/glue-optimizers.md) from its run folders.

GLUE fine-tuning, one evaluation folder (eval.py's glue_results.json) per optimizer row, the reference row
first (AdamW on the same checkpoint, seeds and recipe):

    python scripts/optim_study.py glue adamw=outputs/gopt-tiny-adamw/<stamp> \
        adamw_8bit=outputs/gopt-tiny-adamw_8bit/<stamp> ... --title bert-tiny --plot results/glue-optimizers-tiny.png

Pretraining at equal updates, one label per optimizer and a comma-separated list of its runs (one per seed),
the reference first:

    python scripts/optim_study.py pretrain adamw=outputs/popt-tiny-adamw-seed0/<stamp>,outputs/... ...

Per GLUE row: each task's median over seeds [min, max], the five-task average of the medians and its
difference to the reference, the tasks that fall below the reference by more than the larger of the two seed
spreads (max - min), the optimizer state measured from its tensors after fine-tuning (and as % of AdamW's
fp32 moments) and the fine-tuning process's peak memory (update times: scripts/bench_finetune_optim.py).
Per pretraining row: held-out MLM loss and perplexity (mean over seeds, each seed listed), the perplexity's
difference to the reference in %, the context-use gain, state, peak memory and milliseconds per update.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # cpu_study's readers, when imported by the tests

from cpu_study import TASKS, average, cell, entry_scores, load  # noqa: E402

from cramming.eval.scores import EntryScore  # noqa: E402
from cramming.report import _figure, layout_problems  # noqa: E402
from cramming.runcard import RUN_CARD, read_metrics  # noqa: E402

MIB = 2.0**20


def labelled(pairs: list[str]) -> dict[str, str]:
    rows = {}
    for pair in pairs:
        label, sep, value = pair.partition("=")
        if not sep or not label or not value:
            raise SystemExit(f"{pair!r}: give each row as label=folder (label=folder1,folder2 for seeds)")
        if label in rows:
            raise SystemExit(f"label {label!r} given twice: each row needs a label of its own")
        rows[label] = value
    return rows


# ------------------------------------------------------------------------------------------------ GLUE


def seed_averages(scores: dict[str, EntryScore]) -> list[float]:
    """The five-task average of each seed (×100): the spread of the average over seeds."""
    seeds = min(len(scores[t].per_seed) for t in TASKS)
    return [100 * statistics.fmean(scores[t].per_seed[i] for t in TASKS) for i in range(seeds)]


def run_figures(results: dict) -> dict:
    """State bytes and their ratio to AdamW's (the largest over the runs: the task heads differ by a few
    hundred parameters) and the process's peak memory. Update times come from scripts/bench_finetune_optim.py,
    which measures the optimizers side by side: the runs' own times depend on what ran beside each."""
    runs = results["runs"]
    states = [run.get("optimizer_state_bytes") for run in runs]
    ratios = [run.get("optimizer_state_ratio_to_adamw") for run in runs]
    peaks = [run["peak_memory_bytes"] for run in runs if run.get("peak_memory_bytes")]
    return {
        "state_bytes": None if None in states else max(states),
        "state_ratio": None if None in ratios else max(ratios),
        "peak_bytes": max(peaks) if peaks else None,
    }


def glue_rows(rows: dict[str, str]) -> list[dict]:
    out = []
    for label, folder in rows.items():
        results = load(Path(folder))
        scores = entry_scores(results)
        missing = [t for t in TASKS if t not in scores]
        if missing:
            raise SystemExit(f"{folder}: no runs of {', '.join(missing)}; the study needs all five tasks")
        out.append({"label": label, "folder": folder, "scores": scores, "average": average(scores),
                    "seed_averages": seed_averages(scores), **run_figures(results)})  # fmt: skip
    return out


def below_reference(row: dict, reference: dict) -> list[str]:
    """Tasks whose median falls below the reference's by more than the larger of the two seed spreads."""
    worse = []
    for task in TASKS:
        ours, theirs = row["scores"][task], reference["scores"][task]
        if theirs.median - ours.median > max(ours.spread, theirs.spread):
            worse.append(f"{task} {100 * (ours.median - theirs.median):+.1f}")
    return worse


def _mib(nbytes: float | None) -> str:
    return "—" if nbytes is None else f"{nbytes / MIB:.2f}"


def glue_table(rows: list[dict]) -> str:
    reference = rows[0]
    head = ["optimizer", *TASKS, "average [seed min, max]", "Δ avg", "tasks below (beyond spread)",
            "state MiB (% AdamW)", "peak MiB"]  # fmt: skip
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for row in rows:
        lo, hi = min(row["seed_averages"]), max(row["seed_averages"])
        delta = "—" if row is reference else f"{row['average'] - reference['average']:+.2f}"
        below = "—" if row is reference else (", ".join(below_reference(row, reference)) or "none")
        ratio = "" if row["state_ratio"] is None else f" ({100 * row['state_ratio']:.1f}%)"
        cells = [row["label"], *(cell(row["scores"][t]) for t in TASKS), f"{row['average']:.2f} [{lo:.1f}, {hi:.1f}]",
                 delta, below, _mib(row["state_bytes"]) + ratio, _mib(row["peak_bytes"])]  # fmt: skip
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def glue_plot(panels: list[tuple[str, list[dict]]], path: Path) -> None:
    """GLUE average against measured optimizer-state bytes (% of AdamW's), one point per optimizer, the
    seeds' range of the average as error bars; one panel per checkpoint."""
    fig = _figure((5.2 * len(panels), 4.2))
    axes = fig.subplots(1, len(panels), squeeze=False)[0]
    for ax, (title, rows) in zip(axes, panels, strict=True):
        for row in rows:
            if row["state_ratio"] is None:
                continue
            x, y = 100 * row["state_ratio"], row["average"]
            lo, hi = min(row["seed_averages"]), max(row["seed_averages"])
            ax.errorbar(x, y, yerr=[[max(y - lo, 0)], [max(hi - y, 0)]], fmt="o", capsize=3, ms=4)
            ax.annotate(row["label"], (x, y), textcoords="offset points", xytext=(4, 3), fontsize=6)
        reference = rows[0]["average"]
        ax.axhspan(reference - 1, reference + 1, color="grey", alpha=0.15)
        ax.set_xscale("log")
        shown = [100 * row["state_ratio"] for row in rows if row["state_ratio"] is not None]
        ax.set_xlim(min(shown) / 1.3, max(shown) * 2.0)  # room for the labels right of the points
        ax.set_xlabel("optimizer state, % of AdamW's (measured)")
        ax.set_ylabel("GLUE average of 5 task medians\n(bars: range of the seeds' averages)")
        ax.set_title(f"{title} (grey: {rows[0]['label']} ± 1 point)", fontsize=9)
        ax.grid(alpha=0.3)
    problems = layout_problems(fig)
    if problems:
        raise SystemExit(f"{path}: the plot's layout is broken: {'; '.join(problems)}")
    fig.savefig(path, dpi=120)


# ----------------------------------------------------------------------------------------------- pretraining


def pretrain_run(folder: Path) -> dict:
    card_path = folder / RUN_CARD
    if not card_path.exists():
        raise SystemExit(f"{folder}: no {RUN_CARD}; give the folder of a finished pretraining run")
    card = json.loads(card_path.read_text())
    metrics = card.get("metrics", {})
    if card.get("status") != "ok" or metrics.get("val_loss") is None:
        raise SystemExit(
            f"{folder}: the run did not finish with a validation loss (status {card.get('status')})"
        )
    records = read_metrics(folder)
    context = next((r for r in reversed(records) if "val_context_gain" in r), {})
    return {
        "optimizer": card["config"]["train"]["optim"],
        "seed": card.get("seed"),
        "updates": metrics["updates"],
        "val_loss": metrics["val_loss"],
        "context_gain": context.get("val_context_gain"),
        "state_bytes": metrics.get("optimizer_state_bytes"),
        "state_ratio": metrics.get("optimizer_state_ratio_to_adamw"),
        "peak_bytes": metrics.get("peak_memory_bytes"),
        "ms_per_update": 1000 * card["seconds"]["train"] / metrics["updates"],
    }


def _mean(values: list) -> float | None:
    known = [v for v in values if v is not None]
    return statistics.fmean(known) if known else None


def pretrain_rows(rows: dict[str, str]) -> list[dict]:
    out = []
    for label, folders in rows.items():
        runs = [pretrain_run(Path(folder)) for folder in folders.split(",")]
        if len({run["updates"] for run in runs}) != 1:
            raise SystemExit(
                f"{label}: its runs made different numbers of updates; compare equal updates only"
            )
        out.append({"label": label, "runs": runs, "val_loss": _mean([r["val_loss"] for r in runs]),
                    **{k: _mean([r[k] for r in runs]) for k in
                       ("context_gain", "state_bytes", "state_ratio", "peak_bytes", "ms_per_update")}})  # fmt: skip
    updates = {run["updates"] for row in out for run in row["runs"]}
    if len(updates) != 1:
        raise SystemExit(
            f"the rows made different numbers of updates ({sorted(updates)}): equal updates only"
        )
    return out


def pretrain_table(rows: list[dict]) -> str:
    reference = rows[0]
    ref_ppl = math.exp(reference["val_loss"])
    head = ["optimizer", "seeds: held-out loss", "loss (mean)", "perplexity", "Δ ppl vs ref", "context gain",
            "state MiB (% AdamW)", "peak MiB", "ms/update (× ref)"]  # fmt: skip
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for row in rows:
        ppl = math.exp(row["val_loss"])
        seeds = ", ".join(f"{r['val_loss']:.4f}" for r in row["runs"])
        delta = "—" if row is reference else f"{100 * (ppl / ref_ppl - 1):+.2f}%"
        ratio = "" if row["state_ratio"] is None else f" ({100 * row['state_ratio']:.1f}%)"
        ms, ref_ms = row["ms_per_update"], reference["ms_per_update"]
        gain = "—" if row["context_gain"] is None else f"{row['context_gain']:.3f}"
        cells = [row["label"], seeds, f"{row['val_loss']:.4f}", f"{ppl:.1f}", delta, gain,
                 _mib(row["state_bytes"]) + ratio, _mib(row["peak_bytes"]), f"{ms:.0f} ({ms / ref_ms:.2f})"]  # fmt: skip
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("kind", choices=["glue", "pretrain"])
    parser.add_argument(
        "rows", nargs="+", help="label=folder (glue) or label=folder,folder (pretrain), reference first"
    )
    parser.add_argument("--title", default="", help="the plot panel's title (glue)")
    parser.add_argument("--plot", type=Path, default=None, help="write the GLUE-vs-state plot here (glue)")
    parser.add_argument(
        "--panel",
        action="append",
        default=[],
        metavar="TITLE:label=folder;...",
        help="another panel for the plot (e.g. a second checkpoint), rows separated by ';'",
    )
    args = parser.parse_args(argv)
    if args.kind == "pretrain":
        print(pretrain_table(pretrain_rows(labelled(args.rows))))
        return
    rows = glue_rows(labelled(args.rows))
    print(glue_table(rows))
    if args.plot:
        panels = [(args.title, rows)]
        for panel in args.panel:
            title, _, spec = panel.partition(":")
            panels.append((title, glue_rows(labelled(spec.split(";")))))
        glue_plot(panels, args.plot)
        print(f"plot: {args.plot}")


if __name__ == "__main__":
    main()
