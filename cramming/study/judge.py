"""What a study's runs say: each recipe at each budget over its seeds, against the control seed by seed, and
whether a difference is beyond the seeds' spread.

Runs are grouped into cells: one recipe at one budget on one machine. Under the wall clock a minute buys
another number of updates on another CPU (2.8-fold between two of ours), so runs of different machines are
never averaged or compared; on the reference clock every run is charged the same costs, and the machine drops
out. A difference is *beyond the seeds' spread* when it is larger than the wider of the two cells' spreads
(highest minus lowest seed); with one run in each cell there is no spread to judge it by, and it says so.
"""

from __future__ import annotations

import itertools
import statistics
from dataclasses import dataclass, field

from cramming.study.figures import METRICS, card_metrics, machine, value
from cramming.study.plan import Point


@dataclass
class Cell:
    """The runs of one recipe at one budget on one machine."""

    recipe: str
    minutes: float
    machine: str
    runs: list[tuple[Point, dict]] = field(default_factory=list)

    def values(self, metric: str) -> dict[int, float]:
        """seed -> the run's figure, for the runs that have it (a repeated seed: its first run)."""
        found: dict[int, float] = {}
        for point, record in self.runs:
            v = value(record, metric)
            if v is not None:
                found.setdefault(point.seed, v)
        return found

    def spread(self, metric: str) -> float | None:
        """Highest minus lowest over the seeds; None with fewer than two."""
        values = list(self.values(metric).values())
        return max(values) - min(values) if len(values) > 1 else None

    def pairs(self) -> set[int]:
        """How many BLiMP pairs its runs were scored on (a subset's mean is not the full set's)."""
        return {r["blimp"]["pairs_scored"] for _, r in self.runs if r.get("blimp")}

    def mean(self, metric: str) -> float | None:
        values = list(self.values(metric).values())
        return statistics.mean(values) if values else None


def cells(points: list[Point], runs: dict[str, dict]) -> list[Cell]:
    """The cells of the kept runs, in the order of their first run."""
    found: dict[tuple[str, float, str], Cell] = {}
    for point in points:
        record = runs.get(point.label)
        if record is None:
            continue
        key = (point.recipe, point.minutes, machine(record))
        found.setdefault(key, Cell(*key)).runs.append((point, record))
    return list(found.values())


def summary(cell: Cell, metric: str, digits: int = 1) -> str:
    """ "57.9 (57.7–58.2)": the mean over seeds and their range; one run alone: its figure."""
    values = list(cell.values(metric).values())
    if not values:
        return "–"
    if len(values) == 1:
        return f"{values[0]:.{digits}f}"
    return f"{statistics.mean(values):.{digits}f} ({min(values):.{digits}f}–{max(values):.{digits}f})"


def verdict(difference: float, spreads: list[float | None], digits: int = 1) -> str:
    """Whether `difference` is beyond the wider of the seeds' spreads, said as such."""
    known = [s for s in spreads if s is not None]
    if not known:
        return "one run each: no seed spread to judge it by"
    widest = max(known)
    beyond = abs(difference) > widest
    return f"{'beyond' if beyond else 'within'} the seeds' spread ({widest:.{digits}f})"


def compare(a: Cell, b: Cell, metric: str) -> str | None:
    """ "BLiMP 57.9 (57.7–58.2) against 56.5: +1.4, beyond the seeds' spread (0.5); seed by seed: s0 +1.7"
    for cell `a` against cell `b`, or None when either lacks the figure."""
    mean_a, mean_b = a.mean(metric), b.mean(metric)
    if mean_a is None or mean_b is None:
        return None
    if metric == "BLiMP" and a.pairs() != b.pairs():
        return f"BLiMP not compared: scored on {sorted(a.pairs())} and {sorted(b.pairs())} pairs"
    digits = 2 if metric == "MLM loss" else 1
    difference = mean_a - mean_b
    text = f"{metric} {summary(a, metric, digits)} against {summary(b, metric, digits)}: {difference:+.{digits}f}, "
    text += verdict(difference, [a.spread(metric), b.spread(metric)], digits)
    ours, theirs = a.values(metric), b.values(metric)
    paired = [f"s{seed} {ours[seed] - theirs[seed]:+.{digits}f}" for seed in ours if seed in theirs]
    return text + (f"; seed by seed: {', '.join(paired)}" if paired else "")


def against_control(all_cells: list[Cell], control: str) -> tuple[list[str], list[str]]:
    """(one line per recipe cell judged against the control's cell of its budget and machine, the cells that
    have no such control cell)."""
    by_key = {(c.recipe, c.minutes, c.machine): c for c in all_cells}
    lines, unmatched = [], []
    for c in all_cells:
        if c.recipe == control:
            continue
        base = by_key.get((control, c.minutes, c.machine))
        if base is None:
            unmatched.append(f"{c.recipe} at {c.minutes:g} min ({c.machine})")
            continue
        judged = [text for metric in METRICS if (text := compare(c, base, metric))]
        where = f"**{c.recipe}** against **{control}** at {c.minutes:g} min ({c.machine}, {len(c.runs)} and {len(base.runs)} runs)"
        lines.append(f"{where}: " + ("; ".join(judged) if judged else "no figure both have yet"))
    return lines, unmatched


def budget_steps(all_cells: list[Cell]) -> list[str]:
    """Per recipe and machine, each budget against the next smaller one that has runs: what more budget
    bought, beyond the seeds' spread or not."""
    lines = []
    series: dict[tuple[str, str], list[Cell]] = {}
    for c in all_cells:
        series.setdefault((c.recipe, c.machine), []).append(c)
    for (recipe, where), chain in series.items():
        chain = sorted(chain, key=lambda c: c.minutes)
        for low, high in itertools.pairwise(chain):
            judged = [text for metric in METRICS if (text := compare(high, low, metric))]
            if judged:
                lines.append(
                    f"**{recipe}** {low.minutes:g} → {high.minutes:g} min ({where}): " + "; ".join(judged)
                )
    return lines


def cells_table(all_cells: list[Cell]) -> str:
    """Each recipe at each budget: the mean over seeds and their range, per figure, and the mean updates."""
    head = ["recipe", "min", "machine", "seeds", *METRICS, "updates"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for c in all_cells:
        seeds = ", ".join(str(p.seed) for p, _ in c.runs)
        updates = [u for _, r in c.runs if (u := card_metrics(r).get("updates")) is not None]
        figures = [summary(c, m, 2 if m == "MLM loss" else 1) for m in METRICS]
        mean_updates = f"{statistics.mean(updates):,.0f}" if updates else "–"
        lines.append(
            f"| {c.recipe} | {c.minutes:g} | {c.machine} | {seeds} | {' | '.join(figures)} | {mean_updates} |"
        )
    return "\n".join(lines)


def paired_table(all_cells: list[Cell], control: str) -> str:
    """Each run against the control's run of the same seed, budget and machine: the difference per figure."""
    by_key = {(c.recipe, c.minutes, c.machine): c for c in all_cells}
    head = ["recipe", "min", "machine", "seed", *(f"{m} Δ" for m in METRICS)]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for c in all_cells:
        base = by_key.get((control, c.minutes, c.machine))
        if c.recipe == control or base is None:
            continue
        for seed in sorted({p.seed for p, _ in c.runs} & {p.seed for p, _ in base.runs}):
            deltas = []
            for metric in METRICS:
                ours, theirs = c.values(metric).get(seed), base.values(metric).get(seed)
                digits = 2 if metric == "MLM loss" else 1
                deltas.append("–" if ours is None or theirs is None else f"{ours - theirs:+.{digits}f}")
            lines.append(f"| {c.recipe} | {c.minutes:g} | {c.machine} | {seed} | {' | '.join(deltas)} |")
    return "\n".join(lines) if len(lines) > 2 else ""
