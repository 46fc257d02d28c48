"""`python -m cramming.study report <study>`: what the kept runs of a study say, conclusion first.

Writes <out>/report.md (out: results/<study>/ unless the study file says otherwise) and the budget curve
<out>/curve.png, from the kept figures alone (cramming.study.kept), in this order: each recipe against the
control at each budget (beyond the seeds' spread or not, said as such), what more budget bought per recipe,
each recipe at each budget (mean and range over seeds), each run against the control's run of its seed, the
floors, one row per run, GLUE by task, BLiMP by phenomenon per model shape, which phenomena each recipe learns
first, the plot, and how to replay it.
"""

from __future__ import annotations

import logging
from pathlib import Path

from cramming.study import judge, kept, tables
from cramming.study.config import StudyConfig
from cramming.study.figures import shape_of
from cramming.study.floor import VARIANT, floor_range
from cramming.study.plan import points
from cramming.study.plot import plot_curve

log = logging.getLogger("cramming")

PLOT = "curve.png"
REPORT = "report.md"


def out_dir(name: str, study: StudyConfig) -> Path:
    return Path(study.out or f"results/{name}")


def conclusion(cells: list[judge.Cell], control: str) -> list[str]:
    lines = ["## Conclusion", ""]
    judged, unmatched = judge.against_control(cells, control)
    lines += [f"- {line}" for line in judged] or [f"- No recipe has run beside the control ({control}) yet."]
    if unmatched:
        lines += [
            "",
            f"Not compared (no run of {control} at that budget on that machine): {'; '.join(unmatched)}.",
        ]
    steps = judge.budget_steps(cells)
    if steps:
        lines += ["", "## What more budget bought", "", *(f"- {line}" for line in steps)]
    return lines


def recipes_section(cells: list[judge.Cell], control: str, floors: dict[str, dict]) -> list[str]:
    lines = ["", "## Each recipe at each budget", "", judge.cells_table(cells, floors), ""]
    lines.append(
        "Mean over the seeds (lowest–highest). BLiMP and GLUE in %, the MLM loss in nats on held-out rows."
        " Machine: where the runs pretrained (under the wall clock a minute buys more updates on a faster one),"
        " or the reference clock and the machine its calibration was measured on (the same updates on any machine)."
    )
    paired = judge.paired_table(cells, control)
    if paired:
        lines += ["", f"## Against {control}, seed by seed", "", paired]
    by_phenomenon = judge.phenomena_against_control(cells, control)
    if by_phenomenon:
        lines += [
            "",
            f"## What each recipe changes on BLiMP, by phenomenon, against {control}",
            "",
            by_phenomenon,
            "",
        ]
        lines.append(
            f"The {control} columns: its mean over seeds. The others: the mean of the seed-by-seed differences to it"
            " (BLiMP points; where the seeds differ, not the difference of the means of the conclusion); * where"
            " that is beyond the seeds' spread of the phenomenon (the widest either recipe showed at any budget on"
            " that machine, the conclusion's rule)."
        )
    return lines


def floors_section(floors: dict[str, dict]) -> list[str]:
    if not floors:
        return []
    lines = ["", "## Floors", "", "| shape | BLiMP of random weights: mean (range) | draws | pairs per paradigm |",
             "|---|---|---|---|"]  # fmt: skip
    for shape, figures in floors.items():
        mean, low, high = floor_range(figures)
        pairs = figures.get("pairs_per_paradigm") or "all"
        lines.append(f"| {shape} | {mean:.1f} ({low:.1f}–{high:.1f}) | {len(figures['twins'])} | {pairs} |")
    return lines


def runs_section(runs: dict[str, dict], floors: dict[str, dict], keep: Path) -> list[str]:
    lines = ["", "## The runs", "", tables.runs_table(runs, floors), ""]
    lines.append(
        "GLUE: the five-task average of the medians over fine-tuning seeds, [the range of the seeds' own"
        " averages]. Load avg: the 1-minute load average while it pretrained, mean (max); CPU: where it ran."
    )
    beside = [f"{label}: {', '.join(r['beside']['pretrain'])}" for label, r in runs.items()
              if (r.get("beside") or {}).get("pretrain")]  # fmt: skip
    if beside:
        lines += ["", "Pretrained beside other runs of the study: " + "; ".join(beside) + "."]
    # a kept file copied from another study's run of the same overrides, seed and budget says where it came from
    copied = [f"{label} from {r['copied_from']}" for label, r in runs.items() if r.get("copied_from")]
    if copied:
        lines += [
            "",
            "Kept from another study's run (the same recipe, seed and budget): " + "; ".join(copied) + ".",
        ]
    for stage, what in (("glue1k", "1,000 training examples"), ("glue", "all training examples")):
        table = tables.glue_tasks_table(runs, keep, stage)
        if table:
            lines += [
                "",
                f"## GLUE with {what} per task",
                "",
                "Median over fine-tuning seeds [lowest, highest]:",
            ]
            lines += ["", table]
    return lines


def blimp_section(runs: dict[str, dict], floors: dict[str, dict], cells: list[judge.Cell]) -> list[str]:
    lines = []
    for shape in tables.shapes(runs):
        table = tables.phenomena(runs, floors, shape)
        if table:
            pairs = tables.pairs_note(runs, floors.get(shape), shape)
            lines += ["", f"## BLiMP by phenomenon, {shape} ({VARIANT}, {pairs}, ties fail)", "", table]
    learned = []
    for c_series in _series(cells).values():
        first = c_series[0]
        floor = floors.get(shape_of(first.runs[0][1])) if "arch" in first.runs[0][1] else None
        by_minutes = {c.minutes: [r["blimp"] for _, r in c.runs if r.get("blimp")] for c in c_series}
        if floor is None or not any(results for m, results in by_minutes.items() if m > 0):
            continue
        above, never = tables.learned_first(by_minutes, floor)
        learned.append(
            f"- {first.recipe} ({first.machine}): {', '.join(above) or 'none'}; never: {', '.join(never) or 'none'}"
        )
    if learned:
        lines += ["", "## What each recipe learns first", ""]
        lines += [
            "Above the floor's highest draw in every run of a budget, at the fewest minutes:",
            "",
            *learned,
        ]
    return lines


def _series(cells: list[judge.Cell]) -> dict[tuple[str, str], list[judge.Cell]]:
    found: dict[tuple[str, str], list[judge.Cell]] = {}
    for c in cells:
        found.setdefault((c.recipe, c.machine), []).append(c)
    return {key: sorted(chain, key=lambda c: c.minutes) for key, chain in found.items()}


def build_report(name: str, study: StudyConfig) -> Path:
    """Write report.md and curve.png of the study from its kept figures; returns report.md."""
    keep, out = kept.keep_folder(name, study), out_dir(name, study)
    plan = points(study)
    runs = kept.read_kept(keep, plan)
    floors = kept.read_floors(keep)
    cells = judge.cells(plan, runs)
    control = study.control_recipe
    lines = [
        f"# {study.title or name}",
        "",
        f"{len(runs)} of the study's {len(plan)} runs are kept in {keep}.",
    ]
    lines += [
        "",
        *conclusion(cells, control),
        *recipes_section(cells, control, floors),
        *floors_section(floors),
    ]
    lines += runs_section(runs, floors, keep) + blimp_section(runs, floors, cells)
    used = {shape_of(r) for r in runs.values() if "arch" in r}
    plot = plot_curve(cells, {s: f for s, f in floors.items() if s in used}, out / PLOT)
    if plot is not None:
        lines += ["", "## The budget curve", "", f"![BLiMP and GLUE against minutes of pretraining]({PLOT})"]
    lines += ["", "## Replay", "", "```bash", f"python -m cramming.study run {name}     # what is not done yet",
              f"python -m cramming.study report {name}", "```", "",
              f"The study file is conf/study/{name}.yaml; docs/studies.md says what each key does."]  # fmt: skip
    out.mkdir(parents=True, exist_ok=True)
    report = out / REPORT
    report.write_text("\n".join(lines).rstrip() + "\n")
    log.info("report of %d runs written to %s", len(runs), report)
    return report
