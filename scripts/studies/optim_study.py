"""Tables and a plot of the optimizer study (results/optimizers/) from its run folders.

GLUE fine-tuning, one evaluation folder (eval.py's glue_results.json) per optimizer row, the reference row
first (AdamW on the same checkpoint, seeds and recipe). It reads evaluations with cpu_study's readers, so it
runs as a module from the repository root:

    python -m scripts.studies.optim_study glue adamw=outputs/gopt-tiny-adamw/<stamp> \
        adamw_8bit=outputs/gopt-tiny-adamw_8bit/<stamp> ... --title bert-tiny --plot results/optimizers/glue-optimizers-tiny.png

Pretraining at equal updates, one label per optimizer and a comma-separated list of its runs (one per seed),
the reference first:

    python -m scripts.studies.optim_study pretrain adamw=outputs/popt-tiny-adamw-seed0/<stamp>,outputs/... ...

Per GLUE row: each task's median over seeds [min, max], the five-task average of the medians and its
difference to the reference, the tasks that fall below the reference by more than the larger of the two seed
spreads (max - min), the optimizer state measured from its tensors after fine-tuning (and as % of AdamW's
fp32 moments) and the fine-tuning process's peak memory (update times: scripts/bench/bench_finetune_optim.py).
Per pretraining row: held-out MLM loss and perplexity (mean over seeds, each seed listed), the perplexity's
difference to the reference in %, the context-use gain, state, peak memory and milliseconds per update.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
from pathlib import Path

from matplotlib.text import Text

from cramming.eval.scores import EntryScore
from cramming.job.report import figure, layout_problems
from cramming.job.runcard import RUN_CARD, read_metrics
from scripts.studies.cpu_study import TASKS, average, cell, entry_scores, load

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
    hundred parameters) and the process's peak memory. Update times come from scripts/bench/bench_finetune_optim.py,
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


CAPSIZE_PT, MARKER_PT, LABEL_PT = 3.0, 4.0, 6  # error-bar caps (half-width), markers and labels, in points


# A box on the drawn figure: (x0, y0, x1, y1) in display pixels, y upwards
Box = tuple[float, float, float, float]
Segment = tuple[tuple[float, float], tuple[float, float]]


def _overlaps(a: Box, b: Box) -> bool:
    return a[0] < b[2] and b[0] < a[2] and a[1] < b[3] and b[1] < a[3]


def _inside(a: Box, area: Box) -> bool:
    return area[0] <= a[0] and area[1] <= a[1] and a[2] <= area[2] and a[3] <= area[3]


def _nearest_on(box: Box, point: tuple[float, float]) -> tuple[float, float]:
    """The point of `box` nearest to `point` (where a leader line from `point` meets the box)."""
    return min(max(point[0], box[0]), box[2]), min(max(point[1], box[1]), box[3])


def _crosses(segment: Segment, box: Box) -> bool:
    """Whether the segment passes through the inside of `box` (Liang-Barsky clipping)."""
    (x0, y0), (x1, y1) = segment
    low, high = 0.0, 1.0
    for delta, start, lo, hi in ((x1 - x0, x0, box[0], box[2]), (y1 - y0, y0, box[1], box[3])):
        if delta == 0:
            if not lo < start < hi:
                return False
            continue
        enter, leave = sorted(((lo - start) / delta, (hi - start) / delta))
        low, high = max(low, enter), min(high, leave)
    return low < high


def _candidates(
    point: tuple[float, float], size: tuple[float, float], clearance: float, rings: int
) -> list[Box]:
    """Boxes of `size` beside `point`, nearest first: right of it, then left, `clearance` pixels away, moved
    up and down in steps of half the box's height and outwards by one height per ring."""
    (x, y), (width, height) = point, size
    boxes = []
    for ring in range(rings):
        for side in (1, -1):
            x0 = x + clearance + ring * height if side > 0 else x - clearance - ring * height - width
            for step in sorted(range(-2 * rings, 2 * rings + 1), key=lambda s: (abs(s), -s)):
                y0 = y - height / 2 + step * height / 2
                boxes.append((x0, y0, x0 + width, y0 + height))
    return sorted(boxes, key=lambda box: math.dist(point, _nearest_on(box, point)))  # stable: ties keep order


def place_labels(
    points: list[tuple[float, float]],
    sizes: list[tuple[float, float]],
    bars: list[Box],
    area: Box,
    clearance: float,
    rings: int = 8,
) -> list[Box]:
    """A box for each point's label (same order), of the label's size, inside `area` and on no other label
    and no point's marker or error bar (`bars`, a box each); the leader line from the point to its label
    crosses no other label (it may cross an error bar: in a dense column there is no other way out). Greedy
    and deterministic: the points from the top down, each label takes the nearest free place beside its
    point. Raises ValueError when a label finds no free place within `rings`."""
    placed: list[Box] = []
    leaders: list[Segment] = []
    order = sorted(range(len(points)), key=lambda i: (-points[i][1], points[i][0], i))
    for i in order:
        for box in _candidates(points[i], sizes[i], clearance, rings):
            leader = (points[i], _nearest_on(box, points[i]))
            if (
                _inside(box, area)
                and not any(_overlaps(box, other) for other in placed + bars)
                and not any(_crosses(leader, other) for other in placed)
                and not any(_crosses(segment, box) for segment in leaders)
            ):
                placed.append(box)
                leaders.append(leader)
                break
        else:
            raise ValueError(f"no free place for label {i} at {points[i]} within {rings} rings")
    return [placed[order.index(i)] for i in range(len(points))]


def _point_obstacles(ax, rows: list[dict]) -> list[Box]:
    """Each row's marker and error bar with its caps, as a box on the drawn axes."""
    reach = max(CAPSIZE_PT, MARKER_PT / 2) * ax.figure.dpi / 72
    boxes = []
    for row in rows:
        x, lo, hi = 100 * row["state_ratio"], min(row["seed_averages"]), max(row["seed_averages"])
        (px, py), (_, low), (_, high) = ax.transData.transform([(x, row["average"]), (x, lo), (x, hi)])
        boxes.append((px - reach, min(low, py) - reach, px + reach, max(high, py) + reach))
    return boxes


def _label_points(ax, rows: list[dict], colors: list, renderer) -> list:
    """Each row's label in its point's colour at place_labels' box, with a thin leader line from the point
    where the box does not touch it; returns the annotations."""
    px_per_pt = ax.figure.dpi / 72
    clearance = (max(CAPSIZE_PT, MARKER_PT / 2) + 2) * px_per_pt
    points = [tuple(ax.transData.transform((100 * row["state_ratio"], row["average"]))) for row in rows]
    sizes = []
    for row in rows:  # measured on the frozen layout, then removed
        probe = ax.text(0, 0, row["label"], fontsize=LABEL_PT)
        extent = probe.get_window_extent(renderer)
        sizes.append((extent.width, extent.height))
        probe.remove()
    area = tuple(ax.get_window_extent(renderer).padded(-2).extents)
    boxes = place_labels(points, sizes, _point_obstacles(ax, rows), area, clearance)
    labels = []
    for row, color, point, box in zip(rows, colors, points, boxes, strict=True):
        near = _nearest_on(box, point)
        leader = None
        if math.dist(point, near) > clearance + 1:
            relpos = ((near[0] - box[0]) / (box[2] - box[0]), (near[1] - box[1]) / (box[3] - box[1]))
            leader = {
                "arrowstyle": "-",
                "lw": 0.4,
                "color": color,
                "shrinkA": 0,
                "shrinkB": 0,
                "relpos": relpos,
            }
        offset = ((box[0] - point[0]) / px_per_pt, (box[1] - point[1]) / px_per_pt)
        labels.append(ax.annotate(row["label"], (100 * row["state_ratio"], row["average"]), xytext=offset,
                                  textcoords="offset points", fontsize=LABEL_PT, color=color, ha="left",
                                  va="bottom", arrowprops=leader))  # fmt: skip
    return labels


def label_problems(fig, panels: list[tuple[object, list[dict], list]]) -> list[str]:
    """Labels, as drawn, that overlap another label or a point's marker or error bar, or leave the figure."""
    fig.draw_without_rendering()
    renderer = fig.canvas.get_renderer()
    problems = []
    for ax, rows, labels in panels:
        # the text alone (an annotation's own extent takes in its leader line)
        boxes = [tuple(Text.get_window_extent(label, renderer).extents) for label in labels]
        obstacles = _point_obstacles(ax, rows)
        for i, (label, box) in enumerate(zip(labels, boxes, strict=True)):
            if any(_overlaps(box, other) for other in boxes[i + 1 :] + obstacles):
                problems.append(f"label {label.get_text()!r} overlaps another label or a point's error bar")
            if not _inside(box, tuple(fig.bbox.extents)):
                problems.append(f"label {label.get_text()!r} leaves the figure")
    return problems


def glue_plot(panels: list[tuple[str, list[dict]]], path: Path) -> None:
    """GLUE average against measured optimizer-state bytes (% of AdamW's), one point per optimizer, the
    seeds' range of the average as error bars; one panel per checkpoint. Each point is labelled with its row
    in its colour, clear of the other labels and error bars (place_labels), with a leader line where needed."""
    fig = figure((6.4 * len(panels), 4.8))
    axes = fig.subplots(1, len(panels), squeeze=False)[0]
    drawn = []
    for ax, (title, rows) in zip(axes, panels, strict=True):
        shown = [row for row in rows if row["state_ratio"] is not None]
        colors = []
        for row in shown:
            x, y = 100 * row["state_ratio"], row["average"]
            lo, hi = min(row["seed_averages"]), max(row["seed_averages"])
            bar = ax.errorbar(x, y, yerr=[[max(y - lo, 0)], [max(hi - y, 0)]], fmt="o", capsize=CAPSIZE_PT,
                              ms=MARKER_PT)  # fmt: skip
            colors.append(bar.lines[0].get_color())
        reference = rows[0]["average"]
        ax.axhspan(reference - 1, reference + 1, color="grey", alpha=0.15)
        ax.set_xscale("log")
        xs = [100 * row["state_ratio"] for row in shown]
        ax.set_xlim(min(xs) / 1.5, max(xs) * 3.0)  # room for the labels either side of the points
        ys = [reference - 1, reference + 1, *(v for row in shown for v in row["seed_averages"])]
        ax.set_ylim(min(ys) - 0.2, max(ys) + 0.2)
        ax.set_xlabel("optimizer state, % of AdamW's (measured)")
        ax.set_ylabel("GLUE average of 5 task medians\n(bars: range of the seeds' averages)")
        ax.set_title(f"{title} (grey: {rows[0]['label']} ± 1 point)", fontsize=9)
        ax.grid(alpha=0.3)
        drawn.append((ax, shown, colors))
    fig.draw_without_rendering()  # the constrained layout settles the axes, then stays as it is for the labels
    fig.set_layout_engine("none")
    renderer = fig.canvas.get_renderer()
    try:
        labelled = [(ax, shown, _label_points(ax, shown, colors, renderer)) for ax, shown, colors in drawn]
    except ValueError as err:
        raise SystemExit(f"{path}: the labels do not fit: {err}") from err
    problems = layout_problems(fig) + label_problems(fig, labelled)
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
