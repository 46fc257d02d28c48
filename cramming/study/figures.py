"""What a study reads from a kept run: its GLUE averages (per fine-tuning seed, too), BLiMP, the pretraining
card's figures, and where it ran. One reader each; the report and the plot share them.

A kept run (cramming.study.kept) is a dictionary: `pretraining_card` (the pretraining run card), `blimp`
(eval.py's blimp_results.json), `glue1k` and `glue` (glue_results.json, with 1,000 and all training
examples per task), `load_average` and `beside` (what shared the machine).
"""

from __future__ import annotations

from pathlib import Path

from cramming.eval.scores import EntryScore, glue_average, summarize

# eval=glue-small's five tasks: the GLUE average of a study is theirs, never a partial one
TASKS = ("SST-2", "MRPC", "STS-B", "RTE", "CoLA")
METRICS = {  # name in tables -> (stage, higher is better)
    "BLiMP": ("blimp", True),
    "GLUE 1k": ("glue1k", True),
    "GLUE": ("glue", True),
    "MLM loss": ("pretrain", False),
}


def entry_scores(results: dict) -> dict[str, EntryScore]:
    """Each GLUE entry's scores over the fine-tuning seeds of a glue_results.json."""
    per_entry: dict[str, list[dict[str, float]]] = {}
    for run in results["runs"]:
        for entry, metrics in run["metrics"].items():
            per_entry.setdefault(entry, []).append(metrics)
    return summarize(per_entry)


def average(scores: dict[str, EntryScore]) -> float | None:
    """The GLUE average ×100 over the five tasks, or None when one is missing (no partial averages)."""
    if not all(t in scores for t in TASKS):
        return None
    return 100 * glue_average({t: scores[t] for t in TASKS})[0]


def seed_averages(results: dict) -> list[float]:
    """The five-task average ×100 of each fine-tuning seed on its own: the spread of the average over
    fine-tuning seeds. [] when a seed misses a task."""
    out = []
    for seed in sorted({run["seed"] for run in results["runs"]}):
        avg = average(entry_scores({"runs": [run for run in results["runs"] if run["seed"] == seed]}))
        if avg is None:
            return []
        out.append(avg)
    return out


def cell(score: EntryScore | None) -> str:
    """A task's median ×100 over fine-tuning seeds, [lowest, highest]."""
    if score is None:
        return "—"
    lo, hi = 100 * min(score.per_seed), 100 * max(score.per_seed)
    spread = f" [{lo:.1f}, {hi:.1f}]" if len(score.per_seed) > 1 else " (1 seed)"
    return f"{100 * score.median:.1f}{spread}"


def glue_of(record: dict, stage: str) -> float | None:
    """The five-task GLUE average of stage `stage` (glue or glue1k), None when it has not run."""
    return average(entry_scores(record[stage])) if record.get(stage) else None


def blimp_of(record: dict) -> float | None:
    return record["blimp"]["overall"] if record.get("blimp") else None


def card_metrics(record: dict) -> dict:
    return (record.get("pretraining_card") or {}).get("metrics") or {}


def card_config(record: dict, group: str) -> dict:
    """One group of the settings the run pretrained with (`train`, `data`, ...), from its card ({} where the card
    has none)."""
    return (((record.get("pretraining_card") or {}).get("config") or {}).get(group)) or {}


def card_train(record: dict) -> dict:
    return card_config(record, "train")


def card_data(record: dict) -> dict:
    return card_config(record, "data")


def value(record: dict, metric: str) -> float | None:
    """A run's figure for one of METRICS (BLiMP, GLUE 1k, GLUE: %, MLM loss: held-out nats)."""
    if metric == "BLiMP":
        return blimp_of(record)
    if metric == "MLM loss":
        return card_metrics(record).get("val_loss")
    return glue_of(record, METRICS[metric][0])


def machine(record: dict) -> str:
    """Where a run pretrained, which sets what a minute of the wall clock buys: the CPU (or GPU) and its
    precision, "AMD EPYC, float32". A run on the reference clock is charged what its calibration measured, so
    the machine it ran on does not matter, the one the calibration was measured on does: "reference clock of AMD
    EPYC (cpu-epyc-avx2)", named by the calibration file (a file rescaled later keeps its name and its runs)."""
    if card_train(record).get("clock", "wall") == "reference":
        clock = card_metrics(record).get("clock") or {}
        calibration = clock.get("calibration")
        if not calibration:
            return "reference clock"
        return f"reference clock of {clock.get('machine') or '?'} ({Path(calibration).stem})"
    device = (record.get("pretraining_card") or {}).get("device") or {}
    return (
        f"{device.get('gpu') or device.get('cpu', '?')}, {(device.get('precision') or {}).get('dtype', '?')}"
    )


# overrides that change how text becomes tokens, and so a random model's BLiMP: they name a floor with the arch's
TOKENIZING = ("data.tokenizer.", "data.normalizer.")


def shape(arch: str, overrides: list[str] | tuple[str, ...] = ()) -> str:
    """The model shape a floor belongs to: the arch with its `arch.*` overrides ("bert-tiny.num_layers=4"), and
    the tokenizer's where a recipe changes it ("bert-tiny.num_layers=6.tokenizer.vocab_size=4096")."""
    return ".".join(
        [
            arch,
            *(o.removeprefix("arch.") for o in overrides if o.startswith("arch.")),
            *(o.removeprefix("data.") for o in overrides if o.startswith(TOKENIZING)),
        ]
    )


def shape_of(record: dict) -> str:
    return shape(record["arch"], record.get("overrides", ()))
