"""What a study's runs say: each recipe at each budget over its seeds, against the control seed by seed, and
whether a difference is beyond the seeds' spread.

Runs are grouped into cells: one recipe at one budget on one machine. Under the wall clock a minute buys
another number of updates on another CPU (2.8-fold between two of ours), so runs of different machines are
never averaged or compared; on the reference clock every run is charged the same costs, and the machine drops
out. A difference is *beyond the seeds' spread* when it is larger than the widest spread (highest minus lowest
seed) that either recipe showed at any budget on that machine: two seeds of one budget may land close by
chance, and a recipe's seed noise does not change much with the budget. Where neither recipe has two seeds of
one budget there is no spread to judge by, and the line says so.
"""

from __future__ import annotations

import itertools
import statistics
from dataclasses import MISSING, asdict, dataclass, field

from cramming.data.config import DataConfig
from cramming.study.figures import METRICS, card_data, card_metrics, card_train, machine, shape_of, value
from cramming.study.floor import floor_range
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


# the data settings that decide what the held-out rows are (their length, what they begin with, where [SEP]
# goes, the vocabulary). A card kept before a setting existed ran DataConfig's default, which stands in for it
HELD_OUT_DATA = ("seq_length", "row_start", "segments", "tokenizer", "normalizer")


def _data_default(key: str):
    """DataConfig's default of `key` as a run card writes it (a nested group, such as the tokenizer, as a dict)."""
    setting = DataConfig.__dataclass_fields__[key]
    if setting.default_factory is not MISSING:
        return asdict(setting.default_factory())
    return None if setting.default is MISSING else setting.default


def held_out_task(cell: Cell) -> list[str]:
    """What a cell's held-out loss measures: its runs' train.mlm settings (how the rows are masked) and the data
    settings of HELD_OUT_DATA (how they are cut and tokenized). Losses of different tasks are not compared."""
    found = set()
    for _, record in cell.runs:
        data = card_data(record)
        cut = {key: data.get(key, _data_default(key)) for key in HELD_OUT_DATA}
        found.add(repr((sorted((card_train(record).get("mlm") or {}).items()), sorted(cut.items()))))
    return sorted(found)


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
    """Whether `difference` is beyond the widest of the seeds' spreads, said as such."""
    known = [s for s in spreads if s is not None]
    if not known:
        return "one seed per budget: no seed spread to judge it by"
    widest = max(known)
    beyond = abs(difference) > widest
    return f"{'beyond' if beyond else 'within'} the seeds' spread ({widest:.{digits}f})"


def widest(all_cells: list[Cell], recipes: set[str], where: str, metric: str) -> float | None:
    """The widest spread over seeds of any cell of `recipes` on machine `where`, at any budget."""
    spreads = [
        s
        for c in all_cells
        if c.recipe in recipes and c.machine == where and (s := c.spread(metric)) is not None
    ]
    return max(spreads, default=None)


def compare(a: Cell, b: Cell, metric: str, all_cells: list[Cell]) -> str | None:
    """ "BLiMP 57.9 (57.7–58.2) against 56.5: +1.4, beyond the seeds' spread (0.5); seed by seed: s0 +1.7"
    for cell `a` against cell `b` (of one machine), or None when either lacks the figure."""
    mean_a, mean_b = a.mean(metric), b.mean(metric)
    if mean_a is None or mean_b is None:
        return None
    if metric == "BLiMP" and a.pairs() != b.pairs():
        return f"BLiMP not compared: scored on {sorted(a.pairs())} and {sorted(b.pairs())} pairs"
    if metric == "MLM loss" and held_out_task(a) != held_out_task(b):
        return (
            "MLM loss not compared: the held-out rows are masked, cut or tokenized as each recipe does (another"
            " task)"
        )
    digits = 2 if metric == "MLM loss" else 1
    difference = mean_a - mean_b
    text = f"{metric} {summary(a, metric, digits)} against {summary(b, metric, digits)}: {difference:+.{digits}f}, "
    text += verdict(difference, [widest(all_cells, {a.recipe, b.recipe}, a.machine, metric)], digits)
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
        judged = [text for metric in METRICS if (text := compare(c, base, metric, all_cells))]
        runs = f"{len(c.runs)} run{'s' if len(c.runs) > 1 else ''} against {len(base.runs)}"
        where = f"**{c.recipe}** against **{control}** at {c.minutes:g} min ({c.machine}; {runs})"
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
            judged = [text for metric in METRICS if (text := compare(high, low, metric, all_cells))]
            if judged:
                lines.append(
                    f"**{recipe}** {low.minutes:g} → {high.minutes:g} min ({where}): " + "; ".join(judged)
                )
    return lines


def measured(all_cells: list[Cell]) -> list[str]:
    """The figures of METRICS that some run has."""
    return [m for m in METRICS if any(c.values(m) for c in all_cells)]


def above_floor(cell: Cell, floors: dict[str, dict]) -> str:
    """The cell's lowest BLiMP run against the highest random draw of its shape's floor: "+2.2" above it."""
    values = list(cell.values("BLiMP").values())
    record = cell.runs[0][1]
    floor = floors.get(shape_of(record)) if "arch" in record else None
    if not values or floor is None:
        return "–"
    return f"{min(values) - floor_range(floor)[2]:+.1f}"


def cells_table(all_cells: list[Cell], floors: dict[str, dict]) -> str:
    """Each recipe at each budget: the mean over seeds and their range, per figure, how far its lowest BLiMP run
    is above its floor's highest draw, and the mean updates."""
    shown = measured(all_cells)
    head = ["recipe", "min", "machine", "seeds", *shown, "BLiMP, lowest run − floor's highest", "updates"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for c in all_cells:
        seeds = ", ".join(str(p.seed) for p, _ in c.runs)
        updates = [u for _, r in c.runs if (u := card_metrics(r).get("updates")) is not None]
        figures = [summary(c, m, 2 if m == "MLM loss" else 1) for m in shown]
        mean_updates = f"{statistics.mean(updates):,.0f}" if updates else "–"
        lines.append(
            f"| {c.recipe} | {c.minutes:g} | {c.machine} | {seeds} | {' | '.join(figures)} |"
            f" {above_floor(c, floors)} | {mean_updates} |"
        )
    return "\n".join(lines)


def paired_table(all_cells: list[Cell], control: str) -> str:
    """Each run against the control's run of the same seed, budget and machine: the difference per figure."""
    by_key = {(c.recipe, c.minutes, c.machine): c for c in all_cells}
    shown = measured(all_cells)
    head = ["recipe", "min", "machine", "seed", *(f"{m} Δ" for m in shown)]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for c in all_cells:
        base = by_key.get((control, c.minutes, c.machine))
        if c.recipe == control or base is None:
            continue
        for seed in sorted({p.seed for p, _ in c.runs} & {p.seed for p, _ in base.runs}):
            deltas = []
            for metric in shown:
                ours, theirs = c.values(metric).get(seed), base.values(metric).get(seed)
                digits = 2 if metric == "MLM loss" else 1
                if metric == "MLM loss" and held_out_task(c) != held_out_task(base):
                    deltas.append("other task")
                else:
                    deltas.append("–" if ours is None or theirs is None else f"{ours - theirs:+.{digits}f}")
            lines.append(f"| {c.recipe} | {c.minutes:g} | {c.machine} | {seed} | {' | '.join(deltas)} |")
    return "\n".join(lines) if len(lines) > 2 else ""


def _term_values(cell: Cell, term: str) -> dict[int, float]:
    """seed -> the run's BLiMP for one phenomenon ("overall": all of them), for the runs scored."""
    found: dict[int, float] = {}
    for point, record in cell.runs:
        results = record.get("blimp")
        if results:
            found.setdefault(
                point.seed, results[term] if term == "overall" else results["per_linguistics_term"][term]
            )
    return found


def _term_spread(all_cells: list[Cell], recipes: set[str], where: str, term: str) -> float | None:
    """The widest spread over seeds of one phenomenon in any cell of `recipes` on machine `where` (the rule of
    `widest`, phenomenon by phenomenon)."""
    spreads = [
        max(v.values()) - min(v.values())
        for c in all_cells
        if c.recipe in recipes and c.machine == where and len(v := _term_values(c, term)) > 1
    ]
    return max(spreads, default=None)


def phenomena_against_control(all_cells: list[Cell], control: str) -> str:
    """BLiMP by phenomenon, each recipe against the control of its budget and machine: the mean of the
    seed-by-seed differences, starred where it is beyond the seeds' spread of that phenomenon (the rule of the
    conclusion: the widest spread either recipe showed at any budget on that machine); empty when no recipe has
    BLiMP beside its control."""
    by_key = {(c.recipe, c.minutes, c.machine): c for c in all_cells}
    columns: list[tuple[Cell, Cell]] = []
    for c in all_cells:
        base = by_key.get((control, c.minutes, c.machine))
        if c.recipe == control or base is None or not c.values("BLiMP") or not base.values("BLiMP"):
            continue
        if c.pairs() == base.pairs() and set(c.values("BLiMP")) & set(base.values("BLiMP")):
            columns.append((c, base))
    if not columns:
        return ""
    first = next(r["blimp"] for _, r in columns[0][1].runs if r.get("blimp"))
    terms = ["overall", *sorted(first["per_linguistics_term"])]
    bases = list({id(base): base for _, base in columns}.values())
    several = len({base.machine for base in bases}) > 1

    def name(c: Cell) -> str:
        return f"{c.recipe} ({c.minutes:g} min{', ' + c.machine if several else ''})"

    head = ["phenomenon", *(name(b) for b in bases), *(name(c) for c, _ in columns)]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for term in terms:
        row = [f"**{term}**" if term == "overall" else term]
        row += [f"{statistics.mean(_term_values(b, term).values()):.1f}" for b in bases]
        for c, base in columns:
            ours, theirs = _term_values(c, term), _term_values(base, term)
            difference = statistics.mean(ours[s] - theirs[s] for s in ours if s in theirs)
            spread = _term_spread(all_cells, {c.recipe, control}, c.machine, term)
            row.append(f"{difference:+.1f}{'*' if spread is not None and abs(difference) > spread else ''}")
        lines.append("| " + " | ".join(row) + " |")
    return "\n".join(lines)
