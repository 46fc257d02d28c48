"""The budget curve of a study: BLiMP and GLUE against the minutes of pretraining, one line per recipe (and per
machine, under the wall clock), each run a marker, each model shape's floor a band. The legend sits beside the
axes, never over the curves (checked: cramming.study.runs_report.layout_problems)."""

from __future__ import annotations

import statistics
import textwrap
from pathlib import Path

from cramming.study.floor import floor_range
from cramming.study.judge import Cell
from cramming.study.runs_report import figure, layout_problems

PANELS = {"BLiMP": "BLiMP accuracy (%, mean of 67 paradigms)", "GLUE 1k": "GLUE average, 1,000 examples per task",
          "GLUE": "GLUE average, all training examples"}  # fmt: skip
BAND_COLORS = ("grey", "tan", "lightsteelblue", "thistle", "palegreen")
# a recipe's marker: the first ten recipes circles in matplotlib's ten colours, the next ten squares, and so on,
# so that no two lines of a study share a colour and a marker
MARKERS = ("o", "s", "^", "D", "v", "P", "X")


def series(cells: list[Cell]) -> dict[str, list[Cell]]:
    """Legend label -> the cells of one recipe on one machine, by budget. The machine is named only when the
    study's runs ran on more than one."""
    machines = {c.machine for c in cells}
    out: dict[str, list[Cell]] = {}
    for c in cells:
        label = c.recipe if len(machines) == 1 else f"{c.recipe} ({c.machine})"
        out.setdefault(textwrap.fill(label, 34), []).append(c)
    return {label: sorted(chain, key=lambda c: c.minutes) for label, chain in out.items()}


def draw_panel(axis, metric: str, lines: dict[str, list[Cell]], floors: dict[str, dict]) -> None:
    """One figure's curves: the mean of each budget joined by a line, each run a marker of the line's colour and
    shape (the same for a recipe in every panel)."""
    for k, (label, chain) in enumerate(lines.items()):
        points = [(c.minutes, list(c.values(metric).values())) for c in chain]
        points = [(m, v) for m, v in points if v]
        if not points:
            continue
        style = {"color": f"C{k % 10}", "marker": MARKERS[k // 10 % len(MARKERS)], "ms": 4}
        means = [statistics.mean(v) for _, v in points]
        axis.plot([m for m, _ in points], means, "-", label=label, markevery=[], **style)
        runs = [(m, x) for m, values in points for x in values]
        axis.plot([m for m, _ in runs], [x for _, x in runs], ls="none", **style)
    if metric == "BLiMP":
        for color, (shape, floor) in zip(BAND_COLORS, floors.items(), strict=False):
            _, low, high = floor_range(floor)
            axis.axhspan(low, high, alpha=0.2, color=color, label=f"floor of {shape}")
    axis.set(xlabel="minutes of pretraining budget", ylabel=PANELS[metric], title=metric)
    axis.grid(alpha=0.3)


def plot_curve(cells: list[Cell], floors: dict[str, dict], path: Path) -> Path | None:
    """curve.png: a panel per figure the runs have (BLiMP, GLUE 1k, GLUE); None when they have none."""
    shown = [m for m in PANELS if any(c.values(m) for c in cells)]
    if not shown:
        return None
    lines = series(cells)
    fig = figure((5.0 * len(shown) + 3.0, 4.4))
    axes = fig.subplots(1, len(shown), squeeze=False)[0]
    for axis, metric in zip(axes, shown, strict=True):
        draw_panel(axis, metric, lines, floors)
    handles, labels = {}, []
    for axis in axes:
        for handle, label in zip(*axis.get_legend_handles_labels(), strict=True):
            if label not in handles:
                handles[label] = handle
                labels.append(label)
    fig.legend([handles[label] for label in labels], labels, loc="outside right upper", fontsize=7)
    problems = layout_problems(fig)
    if problems:
        raise RuntimeError(f"{path}: the plot's layout is broken: {'; '.join(problems)}")
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    return path
