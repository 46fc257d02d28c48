"""The per-run tables of a study's report: one row per run, GLUE by task, BLiMP by phenomenon per model shape,
and which phenomena each recipe learns first. Read from kept runs (cramming.study.kept) alone."""

from __future__ import annotations

import json
from pathlib import Path

from cramming.study import floor as floors_
from cramming.study.figures import (
    TASKS,
    average,
    card_metrics,
    cell,
    entry_scores,
    machine,
    seed_averages,
    shape_of,
)


def glue_figure(results: dict | None) -> str:
    """The five-task average (of the tasks' medians over fine-tuning seeds) and the range of the seeds' own
    averages."""
    if results is None:
        return "–"
    avg = average(entry_scores(results))
    if avg is None:
        return "–"
    seeds = seed_averages(results)
    return f"{avg:.1f} [{min(seeds):.1f}, {max(seeds):.1f}]" if seeds else f"{avg:.1f}"


def pretraining_figures(record: dict) -> tuple[str, str, str]:
    """(updates, tokens, held-out MLM loss) from the pretraining run card."""
    metrics = card_metrics(record)
    updates, tokens, loss = metrics.get("updates"), metrics.get("tokens"), metrics.get("val_loss")
    return (
        f"{updates:,}" if updates is not None else "–",
        ("–" if not tokens else f"{tokens / 1e6:.1f}M" if tokens >= 1e6 else f"{tokens / 1e3:.0f}k"),
        f"{loss:.2f}" if loss is not None else "–",
    )


def subset_of(results: dict) -> str | None:
    """ "200 pairs/paradigm" for BLiMP results on a subset of each paradigm, None for all pairs."""
    per_paradigm = results["pairs_scored"] // results["paradigms"]
    return None if per_paradigm >= 1000 else f"{per_paradigm} pairs/paradigm"


def blimp_cell(results: dict | None) -> str:
    """BLiMP overall; a subset says how many pairs of each paradigm it scored (not the full set's mean)."""
    if not results:
        return "–"
    subset = subset_of(results)
    return f"{results['overall']:.1f}" + (f" ({subset})" if subset else "")


def runs_table(runs: dict[str, dict], floors: dict[str, dict]) -> str:
    """One row per run: budget, updates, tokens, held-out loss, BLiMP beside its shape's floor, GLUE with all
    and with 1,000 training examples, the load average while it pretrained, where it ran."""
    unit = (
        "GPU"
        if any(((r.get("pretraining_card") or {}).get("device") or {}).get("gpu") for r in runs.values())
        else "CPU"
    )
    lines = [
        f"| point | {unit}-min | updates | tokens | MLM loss | BLiMP | floor (range) | GLUE avg | GLUE avg, 1k ex. "
        "| load avg | CPU, precision |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for label, record in runs.items():
        floor = floors.get(shape_of(record)) if "arch" in record else None
        floor_cell = "–" if floor is None else "{:.1f} ({:.1f}–{:.1f})".format(*floors_.floor_range(floor))
        load = (record.get("load_average") or {}).get("pretrain")
        load_cell = "–" if load is None else f"{load['mean']:.2f} (max {load['max']:.2f})"
        lines.append(
            f"| {label} | {record['minutes']} | {' | '.join(pretraining_figures(record))} | "
            f"{blimp_cell(record.get('blimp'))} | {floor_cell} | {glue_figure(record.get('glue'))} | "
            f"{glue_figure(record.get('glue1k'))} | {load_cell} | {machine(record)} |"
        )
    return "\n".join(lines)


def glue_tasks_table(runs: dict[str, dict], keep: Path, stage: str = "glue1k") -> str:
    """GLUE of `stage` by task: the median over fine-tuning seeds [lowest, highest], for each run and for the
    reference checkpoints kept beside them (reference-<name>-<stage>.json)."""
    rows = {label: r[stage] for label, r in runs.items() if r.get(stage)}
    for path in sorted(keep.glob(f"reference-*-{stage}.json")):
        rows[path.stem.removeprefix("reference-").removesuffix(f"-{stage}")] = json.loads(path.read_text())
    if not rows:
        return ""
    lines = [f"| model | {' | '.join(TASKS)} | Avg |", "|---|" + "---|" * (len(TASKS) + 1)]
    for label, results in rows.items():
        scores = entry_scores(results)
        avg = average(scores)
        lines.append(
            f"| {label} | {' | '.join(cell(scores.get(t)) for t in TASKS)} | {'–' if avg is None else f'{avg:.1f}'} |"
        )
    return "\n".join(lines)


def shapes(runs: dict[str, dict]) -> list[str]:
    """The model shapes of the runs, in the order of their first run."""
    return list(dict.fromkeys(shape_of(r) for r in runs.values() if "arch" in r))


def phenomena(runs: dict[str, dict], floors: dict[str, dict], key: str) -> str:
    """BLiMP by phenomenon for the runs of one shape, beside its floor and the published references."""
    scored = {
        label: r["blimp"]
        for label, r in runs.items()
        if "arch" in r and shape_of(r) == key and r.get("blimp")
    }
    if not scored:
        return ""
    floor = floors.get(key, {})
    return floors_.phenomena_table(floor.get("twins", []), scored, floor.get("published", {}))


def pairs_note(runs: dict[str, dict], floor: dict | None, key: str) -> str:
    """Which pairs a shape's BLiMP figures count, and a warning when its runs and its floor differ."""
    counts = {
        r["blimp"]["pairs_scored"]
        for r in runs.values()
        if "arch" in r and shape_of(r) == key and r.get("blimp")
    }
    floor_counts = {t["pairs_scored"] for t in (floor or {}).get("twins", [])}
    every = counts | floor_counts
    if every == {67_000}:
        return "all pairs"
    if len(every) == 1:
        return f"the first {every.pop() // 67:,} pairs of each paradigm"
    return f"NOT COMPARABLE: runs score {sorted(counts)} pairs, the floor {sorted(floor_counts)}"


def learned_first(series: dict[float, list[dict]], floor: dict) -> tuple[list[str], list[str]]:
    """(phenomena with the fewest minutes at which every run of that budget scores above the floor's highest
    draw, as "term (N min)" in that order; those no budget lifts there). `series`: minutes -> the BLiMP results
    of one recipe's runs on one machine."""
    scored = {m: results for m, results in sorted(series.items()) if m > 0 and results}
    when = {}
    for term in sorted(floor["twins"][0]["per_linguistics_term"]):
        top = floors_.floor_range(floor, term)[2]
        above = [
            m for m, results in scored.items() if all(r["per_linguistics_term"][term] > top for r in results)
        ]
        when[term] = above[0] if above else None
    first = [f"{t} ({m:g} min)" for t, m in sorted(when.items(), key=lambda kv: kv[1] or 1e9) if m]
    return first, [t for t, m in when.items() if m is None]
