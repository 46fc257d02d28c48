"""GLUE scores: per-entry medians over fine-tuning seeds and the average the way cramming computes it.

An *entry* is one evaluation split of a task (MNLI has two: MNLI-m and MNLI-mm). An entry's score is its
task's first metric (CoLA: Matthews correlation, MRPC and QQP: F1, STS-B: Pearson, the rest: accuracy),
as the median over seeds. The GLUE average is the mean of the entries' scores, WNLI excluded; the set of
entries it covers is always stated next to it, since a partial average is not comparable to a full one.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from cramming.eval.tasks import GLUE_SANE, GLUE_TASKS

# Column order of the cramming paper's table.
ENTRY_ORDER = ("MNLI-m", "MNLI-mm", "QQP", "QNLI", "SST-2", "CoLA", "STS-B", "MRPC", "RTE", "WNLI")
EXCLUDED_FROM_AVERAGE = ("WNLI",)


def all_entries(tasks: tuple[str, ...] = GLUE_SANE) -> list[str]:
    return [GLUE_TASKS[t].entry_name(split) for t in tasks for split, _, _ in GLUE_TASKS[t].eval_splits]


@dataclass
class EntryScore:
    entry: str
    task: str
    metric: str
    # the main metric of every seed, in [0, 1]
    per_seed: list[float]
    # every metric's median over seeds
    medians: dict[str, float] = field(default_factory=dict)

    @property
    def median(self) -> float:
        return float(np.median(self.per_seed))

    @property
    def spread(self) -> float:
        """Max minus min over seeds (0 for one seed)."""
        return float(np.max(self.per_seed) - np.min(self.per_seed))


def summarize(results: dict[str, list[dict[str, float]]]) -> dict[str, EntryScore]:
    """`results`: entry name -> one metrics dict per seed. Returns the entries in table order."""
    scores = {}
    for entry in sorted(
        results, key=lambda e: ENTRY_ORDER.index(e) if e in ENTRY_ORDER else len(ENTRY_ORDER)
    ):
        runs = results[entry]
        task = entry.split("-m")[0] if entry.startswith("MNLI") else entry
        metric = GLUE_TASKS[task].metrics[0]
        medians = {name: float(np.median([run[name] for run in runs])) for name in runs[0]}
        scores[entry] = EntryScore(entry, task, metric, [run[metric] for run in runs], medians)
    return scores


def glue_average(scores: dict[str, EntryScore]) -> tuple[float | None, list[str]]:
    """Mean of the entries' median scores, WNLI excluded, and the entries it covers."""
    used = [e for e in scores if e not in EXCLUDED_FROM_AVERAGE]
    if not used:
        return None, []
    return float(np.mean([scores[e].median for e in used])), used


def markdown_table(
    scores: dict[str, EntryScore], skipped: list[str] | None = None, not_run: list[str] | None = None
) -> str:
    """One row of median scores ×100 (with the spread over seeds when there are several)."""
    avg, used = glue_average(scores)
    entries = list(scores)
    header = "| " + " | ".join(entries + ["Avg"]) + " |"
    rule = "|" + "---|" * (len(entries) + 1)

    def cell(s: EntryScore) -> str:
        return f"{100 * s.median:.1f}" + (f" ±{100 * s.spread / 2:.1f}" if len(s.per_seed) > 1 else "")

    row = (
        "| "
        + " | ".join([cell(scores[e]) for e in entries] + ["—" if avg is None else f"{100 * avg:.1f}"])
        + " |"
    )
    lines = [header, rule, row, ""]
    full = all_entries()
    coverage = "all" if set(used) >= set(full) else f"{len(used)} of the {len(full)}"
    lines.append(
        f"Average over {coverage} GLUE-sane entries: {', '.join(used) or 'none'} (WNLI never counts)."
    )
    seeds = sorted({len(s.per_seed) for s in scores.values()})
    lines.append(
        f"Scores: {', '.join(f'{s.entry} {s.metric}' for s in scores.values())}; median over {'/'.join(map(str, seeds))} "
        "seed(s)" + (", ± half the range" if max(seeds, default=1) > 1 else "") + "."
    )
    if skipped:
        lines.append(f"Skipped (no data): {', '.join(skipped)}.")
    if not_run:
        lines.append(f"Not run (the eval budget ran out first): {', '.join(not_run)}.")
    return "\n".join(lines) + "\n"
