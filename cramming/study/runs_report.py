"""Reports of folders of runs (multiruns, or any trees of run folders) as tables and plots: what ran, beside the
study command's judgement of what it showed (cramming.study.report).

    python scripts/report.py outputs/cpu-tiny/multirun_2026-11-29_18-38-40 [more folders] [--out results/x]

writes into --out (default: the first folder)
    report.md      one table row per run (pretraining and GLUE runs apart), the plots below
    runs.csv       the same rows, all runs in one file
    loss.png       MLM loss against elapsed time, every pretraining run on one chart
    schedule.png   learning rate and batch size against the budget fraction
    throughput.png tokens per second over time
    glue.png       GLUE scores per task, one bar per run (e.g. per optimizer), grouped by task
    anytime.png    downstream scores at fractions of the pretraining budget (runs with anytime evaluation)
    blimp.png      BLiMP accuracy against minutes and training tokens (anytime.benchmarks with blimp)

An Optuna search (hydra/sweeper=optuna) adds its section: the sweeper's optimization_results.yaml (the best
trial) and one row per trial, with the values it tried and its objective.

A run is a folder with a run_card.json (see cramming.job.runcard); folders with only a metrics.jsonl (runs from
before run cards) are read too, as far as their files allow. Runs are labelled by the Hydra overrides that
differ between them, so a sweep's rows and lines are named by what the sweep changed.
"""

from __future__ import annotations

import argparse
import csv
import io
import logging
import os
import statistics
import textwrap
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from omegaconf import OmegaConf

from cramming.job.runcard import RUN_CARD, read_card, read_metrics

log = logging.getLogger("cramming")

PLOTS = {
    "loss": "MLM loss against elapsed time",
    "schedule": "Learning rate and batch size against the budget fraction",
    "throughput": "Tokens per second over time",
    "glue": "GLUE scores per task",
    "anytime": "Downstream scores during pretraining (anytime evaluation)",
    "blimp": "BLiMP during pretraining (anytime evaluation, zero-shot)",
}


@dataclass
class RunRecord:
    """One run folder: its card, its metrics records, and the label the report gives it."""

    path: Path
    name: str  # the folder relative to the report's folder
    card: dict
    metrics: list[dict] = field(default_factory=list)
    label: str = ""  # the overrides that differ between runs of its kind (tables)
    key: str = ""  # a short name for legends: the run's name, made unique

    @property
    def kind(self) -> str:
        return self.card.get("kind", "pretrain")

    @property
    def ok(self) -> bool:
        return self.card.get("status") == "ok"


# ------------------------------------------------------------------------------------------- collecting


def collect_runs(*folders: str | Path) -> list[RunRecord]:
    """Every run folder under `folders` (themselves included), sorted by name, labelled by their differences.

    Runs are named by their path relative to the folder that holds them all.
    """
    folders = [Path(f).resolve() for f in folders]
    found = {p.parent for f in folders for name in (RUN_CARD, "metrics.jsonl") for p in f.rglob(name)}
    root = Path(os.path.commonpath(folders)) if len(folders) > 1 else folders[0]
    runs = []
    for path in sorted(found, key=_natural):
        card = _read_card(path)
        name = str(path.relative_to(root)) if path != root else path.name
        runs.append(RunRecord(path, name, card, read_metrics(path)))
    label_runs(runs)
    return runs


def _natural(path: Path) -> list:
    """Sort multirun jobs 0, 1, ..., 10 in numeric order."""
    return [int(part) if part.isdigit() else part for part in path.parts]


def _read_card(path: Path) -> dict:
    card = read_card(path)  # a `running` card whose process is gone reads killed
    if card is not None:
        return card
    # a run from before run cards: what its folder tells
    hydra_dir = path / ".hydra"
    card = {"kind": "pretrain", "status": "unknown", "job": {}, "config": {}, "metrics": {}}
    if (hydra_dir / "overrides.yaml").exists():
        card["job"]["overrides"] = OmegaConf.to_container(OmegaConf.load(hydra_dir / "overrides.yaml"))
    if (hydra_dir / "config.yaml").exists():
        card["config"] = OmegaConf.to_container(OmegaConf.load(hydra_dir / "config.yaml"))
    return card


def label_runs(runs: list[RunRecord]) -> None:
    """Label each run by the overrides that not all runs of its kind share (`budget=0.1 train/optim=adamw`),
    and give it a short key for legends."""
    for kind in {run.kind for run in runs}:
        same_kind = [run for run in runs if run.kind == kind]
        shared = set.intersection(*(set(run.card.get("job", {}).get("overrides", [])) for run in same_kind))
        for run in same_kind:
            own = [o for o in run.card.get("job", {}).get("overrides", []) if o not in shared]
            run.label = " ".join(own) or run.name
            if run.card.get("status") not in ("ok", "unknown"):
                run.label += f" [{run.card.get('status')}]"
    key_runs(runs)


def key_runs(runs: list[RunRecord]) -> None:
    """Short legend keys: the run's `name` setting (with its job number in a multirun); runs that would share
    a key get their folder's name added. A label short enough to read in a legend is the key itself."""
    for run in runs:
        job = run.card.get("job", {})
        base = run.card.get("config", {}).get("name") or Path(run.name).parts[0]
        run.key = f"{base} #{job['num']}" if job.get("multirun") and job.get("num") is not None else base
    counts = Counter(run.key for run in runs)
    for run in runs:
        if counts[run.key] > 1:
            run.key = f"{run.key} {Path(run.name).name}"
        if len(run.label) <= LEGEND_CHARS and len(runs) > 1:
            run.key = run.label


# ----------------------------------------------------------------------------------------------- tables


def pretrain_row(run: RunRecord) -> dict:
    card, m = run.card, run.card.get("metrics", {})
    config, seconds = card.get("config", {}), card.get("seconds", {})
    losses = [r for r in run.metrics if "loss" in r]
    validation = next((r for r in reversed(run.metrics) if "val_loss" in r), {})
    anytime = m.get("anytime") or [r for r in run.metrics if "anytime_fraction" in r]
    git = card.get("git") or {}
    return {
        "run": run.name,
        "status": card.get("status"),
        "label": run.label,
        "arch": config.get("arch", {}).get("name"),
        "optimizer": config.get("train", {}).get("optim", {}).get("name"),
        "budget_h": config.get("budget"),
        "updates": m.get("updates", losses[-1]["update"] if losses else None),
        "tokens_M": _round(m["tokens"] / 1e6, 2) if m.get("tokens") else None,
        "loss": _round(m.get("loss", losses[-1]["loss"] if losses else None), 4),
        "val_loss": _round(m.get("val_loss", validation.get("val_loss")), 4),
        "val_mlm_acc": _round(m.get("val_mlm_acc", validation.get("val_mlm_acc")), 4),
        # the context-use diagnostic (cramming/train/validation.py): shuffled-row loss minus real-row loss
        "val_context_gain": _round(validation.get("val_context_gain"), 4),
        "tok_per_s": _round(m.get("tok_per_s", _median(r["tok_per_s"] for r in losses)), 0),
        "anytime_last": _round(anytime[-1].get("anytime_average"), 4) if anytime else None,
        "blimp_last": _round(
            next((r["anytime_blimp"] for r in reversed(anytime) if "anytime_blimp" in r), None), 2
        ),
        **{
            f"{part}_s": _round(seconds.get(part), 1)
            for part in ("data", "setup", "compile", "train", "eval")
        },
        "total_s": _round(seconds.get("total"), 1),
        "commit": (git.get("commit") or "")[:10] + ("+dirty" if git.get("dirty") else ""),
        "error": (card.get("error") or "").splitlines()[0] if card.get("error") else "",
    }


def eval_row(run: RunRecord) -> dict:
    card, m = run.card, run.card.get("metrics", {})
    git = card.get("git") or {}
    return {
        "run": run.name,
        "status": card.get("status"),
        "label": run.label,
        "checkpoint": _short(
            card.get("data", {}).get("checkpoint") or card.get("config", {}).get("checkpoint")
        ),
        "optimizer": m.get("optimizer")
        or card.get("config", {}).get("eval", {}).get("optim", {}).get("name"),
        **{task: _round(score, 4) for task, score in m.get("scores", {}).items()},
        "glue_average": _round(m.get("glue_average"), 4),
        "eval_s": _round(card.get("seconds", {}).get("eval"), 1),
        "commit": (git.get("commit") or "")[:10] + ("+dirty" if git.get("dirty") else ""),
        "error": (card.get("error") or "").splitlines()[0] if card.get("error") else "",
    }


def _short(path: str | None) -> str | None:
    """A path under the working directory, relative to it."""
    if path is None or not Path(path).is_absolute() or not Path(path).is_relative_to(Path.cwd()):
        return path
    return str(Path(path).relative_to(Path.cwd()))


def _median(values) -> float | None:
    values = list(values)
    return statistics.median(values) if values else None


def _round(value, digits: int):
    return None if value is None else round(float(value), digits)


def columns_of(rows: list[dict]) -> list[str]:
    """The union of the rows' keys, in first-seen order."""
    return list(dict.fromkeys(key for row in rows for key in row))


def markdown_table(rows: list[dict]) -> str:
    columns = columns_of(rows)

    def cell(value) -> str:
        return "" if value is None else str(value).replace("|", "\\|")

    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(cell(row.get(c)) for c in columns) + " |" for row in rows]
    return "\n".join(lines) + "\n"


def csv_text(rows: list[dict]) -> str:
    out = io.StringIO()
    writer = csv.DictWriter(out, fieldnames=columns_of(rows), lineterminator="\n")
    writer.writeheader()
    writer.writerows(rows)
    return out.getvalue()


# ------------------------------------------------------------------------------------------------ plots


def _series(run: RunRecord, x: str, y: str) -> tuple[list[float], list[float]]:
    records = [r for r in run.metrics if x in r and y in r]
    return [r[x] for r in records], [r[y] for r in records]


def _time_axis(runs: list[RunRecord]) -> tuple[float, str]:
    """Minutes for short runs, hours for long ones."""
    longest = max((r["elapsed_h"] for run in runs for r in run.metrics if "elapsed_h" in r), default=0.0)
    return (60.0, "elapsed time (minutes)") if longest < 2 else (1.0, "elapsed time (hours)")


def figure(size: tuple[float, float]) -> Figure:
    """A figure of matplotlib's object API: drawn straight to files, no pyplot state and no display
    backend to choose (nothing happens at import). Constrained layout keeps every label inside the figure and
    makes room for a legend placed outside the axes."""
    fig = Figure(figsize=size, layout="constrained")
    FigureCanvasAgg(fig)  # drawn with Agg, whose renderer layout_problems measures with
    return fig


# legend entries are wrapped at this many characters; labels up to this long are shown whole
LEGEND_CHARS = 28


def _legend_text(run: RunRecord) -> str:
    return textwrap.fill(run.key, LEGEND_CHARS, max_lines=2, placeholder=" ...")


def _plot_over_time(runs: list[RunRecord], key: str, ylabel: str, title: str):
    """One line per run of metrics[key] against elapsed time; returns (figure, axes) to finish."""
    scale, xlabel = _time_axis(runs)
    fig = figure((7, 4.5))
    ax = fig.subplots()
    for run in runs:
        x, y = _series(run, "elapsed_h", key)
        ax.plot([v * scale for v in x], y, label=_legend_text(run), linewidth=1.2)
    ax.set(xlabel=xlabel, ylabel=ylabel, title=title)
    return fig, ax


def plot_loss(runs: list[RunRecord], path: Path) -> Figure:
    fig, ax = _plot_over_time(runs, "loss", "MLM loss (training, per log window)", PLOTS["loss"])
    return _finish(fig, ax, path)


def plot_schedule(runs: list[RunRecord], path: Path) -> Figure:
    fig = figure((11, 4.2))
    lr_ax, bs_ax = fig.subplots(1, 2)
    for run in runs:
        lr_ax.plot(*_series(run, "budget_fraction", "lr"), label=_legend_text(run), linewidth=1.2)
        bs_ax.plot(*_series(run, "budget_fraction", "batch_size"), linewidth=1.2)
    lr_ax.set(xlabel="budget fraction", ylabel="learning rate", title="Learning rate")
    bs_ax.set(xlabel="budget fraction", ylabel="sequences per update", title="Batch size")
    bs_ax.grid(alpha=0.3)
    return _finish(fig, lr_ax, path)


def plot_throughput(runs: list[RunRecord], path: Path) -> Figure:
    fig, ax = _plot_over_time(runs, "tok_per_s", "tokens per second", PLOTS["throughput"])
    ax.set_ylim(bottom=0)
    return _finish(fig, ax, path)


def plot_glue(runs: list[RunRecord], path: Path) -> Figure:
    """Grouped bars: one group per task, one bar per run (labelled by what differs, e.g. the optimizer)."""
    tasks = list(dict.fromkeys(t for run in runs for t in run.card["metrics"].get("scores", {})))
    fig = figure((max(6, 1.6 * len(tasks) * max(1, len(runs)) / 2), 4.5))
    ax = fig.subplots()
    width = 0.8 / len(runs)
    for i, run in enumerate(runs):
        scores = run.card["metrics"].get("scores", {})
        xs = [t + (i - (len(runs) - 1) / 2) * width for t in range(len(tasks))]
        values = [100 * scores.get(task, float("nan")) for task in tasks]
        bars = ax.bar(xs, values, width, label=_legend_text(run))
        ax.bar_label(bars, fmt="%.1f", fontsize=7, padding=1)
    ax.set_xticks(range(len(tasks)), tasks)
    ax.set(ylabel="score (median over seeds, %)", title=PLOTS["glue"])
    return _finish(fig, ax, path)


def plot_anytime(runs: list[RunRecord], path: Path) -> Figure:
    """One panel per task: its score against the budget fraction, one line per run."""
    records = {_legend_text(run): [r for r in run.metrics if "anytime" in r] for run in runs}
    tasks = list(dict.fromkeys(task for rs in records.values() for r in rs for task in r["anytime"]))
    fig = figure((5.5 * len(tasks), 4.5))
    axes = fig.subplots(1, len(tasks), squeeze=False)
    for ax, task in zip(axes[0], tasks, strict=True):
        for label, rs in records.items():
            done = [r for r in rs if task in r["anytime"]]
            x, y = [r["anytime_fraction"] for r in done], [100 * r["anytime"][task] for r in done]
            ax.plot(x, y, marker="o", label=label, linewidth=1.2)
        ax.set(xlabel="budget fraction", ylabel="score (%)", title=task)
        ax.grid(alpha=0.3)
    fig.suptitle(PLOTS["anytime"])
    return _finish(fig, axes[0][-1], path)


def plot_blimp(runs: list[RunRecord], path: Path) -> Figure:
    """BLiMP accuracy against the minutes of budget spent and against the training tokens, one line per run."""
    records = {_legend_text(run): [r for r in run.metrics if "anytime_blimp" in r] for run in runs}
    fig = figure((11.0, 4.5))
    axes = fig.subplots(1, 2, squeeze=False)[0]
    for label, rs in records.items():
        y = [r["anytime_blimp"] for r in rs]
        axes[0].plot([60 * r["elapsed_h"] for r in rs], y, marker="o", label=label, linewidth=1.2)
        axes[1].plot([r.get("tokens", 0) / 1e6 for r in rs], y, marker="o", label=label, linewidth=1.2)
    axes[0].set(xlabel="minutes of budget", ylabel="BLiMP accuracy (%)")
    axes[1].set(xlabel="training tokens (millions)", ylabel="BLiMP accuracy (%)")
    axes[0].grid(alpha=0.3)
    fig.suptitle(PLOTS["blimp"])
    return _finish(fig, axes[1], path)


def _finish(fig: Figure, ax, path: Path) -> Figure:
    """Grid, one legend for the figure outside the axes on the right (never over the data, never off the
    figure: constrained layout makes room for it), and the PNG."""
    ax.grid(alpha=0.3)
    handles, labels = ax.get_legend_handles_labels()
    if handles:
        fig.legend(handles, labels, loc="outside right upper", fontsize=7, title="run", title_fontsize=7)
    fig.savefig(path, dpi=120)
    return fig


def layout_problems(fig: Figure) -> list[str]:
    """Where a drawn figure's legend or texts leave the figure or cover an axes' plotting area."""
    if not isinstance(fig.canvas, FigureCanvasAgg):
        FigureCanvasAgg(fig)
    fig.draw_without_rendering()
    renderer = fig.canvas.get_renderer()
    box = fig.bbox
    problems = []
    areas = [ax.get_window_extent(renderer) for ax in fig.axes]
    for legend in fig.legends + [ax.get_legend() for ax in fig.axes if ax.get_legend()]:
        extent = legend.get_window_extent(renderer)
        if not (
            extent.x0 >= box.x0 - 1
            and extent.y0 >= box.y0 - 1
            and extent.x1 <= box.x1 + 1
            and extent.y1 <= box.y1 + 1
        ):
            problems.append(f"legend {extent.bounds} leaves the figure {box.bounds}")
        problems += [f"legend {extent.bounds} covers axes {a.bounds}" for a in areas if extent.overlaps(a)]
    for ax in fig.axes:
        for text in (ax.title, ax.xaxis.label, ax.yaxis.label):
            extent = text.get_window_extent(renderer)
            if text.get_text() and (extent.x0 < box.x0 - 1 or extent.x1 > box.x1 + 1):
                problems.append(f"{text.get_text()!r} leaves the figure")
    return problems


# ----------------------------------------------------------------------------------------------- report


def draw_plots(
    pretraining: list[RunRecord], evaluation: list[RunRecord], out: Path
) -> tuple[list[str], list[str]]:
    """Each plot that these runs have data for, as {out}/{name}.png; returns (drawn, the others' titles)."""
    with_curves = [r for r in pretraining if any("loss" in m for m in r.metrics)]
    plots = {
        "loss": (plot_loss, with_curves),
        "schedule": (plot_schedule, with_curves),
        "throughput": (plot_throughput, with_curves),
        "glue": (plot_glue, [r for r in evaluation if r.ok and r.card["metrics"].get("scores")]),
        "anytime": (plot_anytime, [r for r in pretraining if any("anytime" in m for m in r.metrics)]),
        "blimp": (plot_blimp, [r for r in pretraining if any("anytime_blimp" in m for m in r.metrics)]),
    }
    drawn = []
    for name, (draw, selected) in plots.items():
        if selected:
            draw(selected, out / f"{name}.png")
            drawn.append(name)
    return drawn, [PLOTS[name].lower() for name in plots if name not in drawn]


# ----------------------------------------------------------------------------------------- Optuna searches

# written into the sweep folder by hydra-optuna-sweeper at the end of a search
SEARCH_RESULT = "optimization_results.yaml"
# what eval.py and pretrain.py return to the sweeper, as their cards record it
OBJECTIVES = {"eval": "glue_average", "pretrain": "val_loss"}


def search_sections(folders: list[Path], runs: list[RunRecord]) -> list[str]:
    """For each folder holding an Optuna search's result file: the best trial as the sweeper wrote it, and the
    trial table (a trial is a job of the sweep; its objective is what the entry point returned)."""
    lines = []
    for result in sorted({p for folder in folders for p in Path(folder).resolve().rglob(SEARCH_RESULT)}):
        sweep = result.parent
        trials = [run for run in runs if run.path.parent == sweep]
        # what was searched, from the sweeper's settings that Hydra saved with every trial
        saved = [
            run.path / ".hydra" / "hydra.yaml"
            for run in trials
            if (run.path / ".hydra" / "hydra.yaml").exists()
        ]
        searched = (OmegaConf.load(saved[0]).hydra.sweeper.params or {}) if saved else {}
        rows = []
        for run in trials:
            tried = dict(o.split("=", 1) for o in run.card.get("job", {}).get("overrides", []) if "=" in o)
            objective = OBJECTIVES.get(run.kind)
            rows.append(
                {"trial": run.card.get("job", {}).get("num"), "status": run.card.get("status")}
                | {key: tried.get(key) for key in searched}
                | {objective: _round(run.card.get("metrics", {}).get(objective), 4)}
            )
        best = OmegaConf.to_container(OmegaConf.load(result))
        lines += ["", f"## Optuna search: {sweep.name}", ""]
        lines.append(f"Searched {', '.join(f'`{k}`: `{v}`' for k, v in searched.items())}.")
        lines.append(
            f"Best ({SEARCH_RESULT}): {best.get('best_params')}, value {_round(best.get('best_value'), 4)}."
        )
        lines += ["", markdown_table(rows) if rows else "No trial has a run card."]
    return lines


def build_report(folders: str | Path | list[str | Path], out: str | Path | None = None) -> Path:
    """Write report.md, runs.csv and the plots for the runs under `folders` into `out` (default: the first
    folder); returns report.md."""
    folders = [Path(f) for f in (folders if isinstance(folders, list) else [folders])]
    out = Path(out) if out is not None else folders[0]
    out.mkdir(parents=True, exist_ok=True)
    runs = collect_runs(*folders)
    if not runs:
        raise FileNotFoundError(f"no run folders (with {RUN_CARD} or metrics.jsonl) under {folders}")
    pretraining = [r for r in runs if r.kind == "pretrain"]
    evaluation = [r for r in runs if r.kind == "eval"]
    pretrain_rows = [pretrain_row(r) for r in pretraining]
    eval_rows = [eval_row(r) for r in evaluation]
    (out / "runs.csv").write_text(
        csv_text(
            [{"kind": "pretrain"} | r for r in pretrain_rows] + [{"kind": "eval"} | r for r in eval_rows]
        )
    )

    drawn, skipped = draw_plots(pretraining, evaluation, out)

    failed = [r for r in runs if r.card.get("status") not in ("ok", "unknown")]
    lines = [f"# Report: {', '.join(map(str, folders))}", ""]
    lines.append(f"{len(runs)} runs: {len(pretraining)} pretraining, {len(evaluation)} GLUE evaluation")
    lines.append(f"({len(failed)} not ok: {', '.join(r.name for r in failed)})." if failed else "(all ok).")
    if pretrain_rows:
        lines += ["", "## Pretraining", "", markdown_table(pretrain_rows)]
        lines.append(
            "`loss`: training MLM loss of the last log window; `val_*`: the held-out split at the end"
            " (`val_context_gain`: masked loss on shuffled rows minus on real rows, >0 when context is used);"
            " `tok_per_s`: median over log windows. Seconds: `data` preprocessing or cache lookup (not"
            " on the budget), `setup` model and optimizer, `compile` the first update's time beyond a"
            " steady one, `train` the updates, `eval` anytime evaluations, final validation and saving."
        )
    if eval_rows:
        lines += ["", "## GLUE", "", markdown_table(eval_rows)]
        lines.append("Scores are medians over fine-tuning seeds, in [0, 1].")
    lines += search_sections(folders, runs)
    lines += ["", "## Plots", ""]
    keyed = [r for r in runs if r.key != r.label]
    if drawn and keyed:
        lines += ["The plots name runs by a short key; what each run changed:", ""]
        lines += [markdown_table([{"key": r.key, "run": r.name, "overrides": r.label} for r in keyed]), ""]
    for name in drawn:
        lines += [f"### {PLOTS[name]}", "", f"![{PLOTS[name]}]({name}.png)", ""]
    if skipped:
        lines.append(f"No data in these runs for: {'; '.join(skipped)}.")
    report = out / "report.md"
    report.write_text("\n".join(lines).rstrip() + "\n")
    log.info("report of %d runs written to %s", len(runs), report)
    return report


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("folders", nargs="+", help="multirun folders, run folders, or any folders of runs")
    parser.add_argument("--out", help="where to write the report (default: the first folder)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    print(build_report(args.folders, args.out))
