"""BLiMP's floor of a model shape, and BLiMP by phenomenon beside it and the published references.

A masked LM with random weights is not at chance on BLiMP: each token gets an arbitrary fixed log-probability,
and many paradigms differ in which words they use. So a shape's floor is BLiMP of several random-weight twins
of one of its checkpoints (its architecture and tokenizer, weights drawn with each seed; pretraining never
ran), and a run is judged against the floor's range, not against 50%.
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path

from cramming.eval import blimp
from cramming.model import build_model
from cramming.model.checkpoint import load_pretrained
from cramming.utils import seed_everything

VARIANT = "within_word_l2r"
REFERENCES = {"ngram": "5-gram", "lstm": "LSTM", "gpt2": "GPT-2"}


def score(model, tokenizer, mask_id: int, pairs: dict, variant: str = VARIANT) -> dict:
    """BLiMP's summary (overall, per paradigm, phenomenon and field) of one model on `pairs`."""
    lm = blimp.CrammedMaskedLM(model, tokenizer, mask_id)
    records = [r for rows in pairs.values() for r in blimp.score_paradigm(lm, rows, variant, batch_rows=512)]
    return blimp.summarize(records, pairs, variant)


def random_twin(checkpoint: str | Path, seed: int):
    """(model, tokenizer, mask id): the checkpoint's architecture and tokenizer with freshly drawn weights."""
    pretrained = load_pretrained(str(checkpoint), device="cpu")
    seed_everything(seed)
    model = build_model(pretrained.model.arch, pretrained.model.vocab_size)
    return model, pretrained.tokenizer, pretrained.config["special_tokens"]["mask"]


def floor(
    checkpoint: str | Path, shape: str, seeds: list[int], blimp_dir: str | None, pairs: int | None
) -> dict:
    """The floor of `shape` from one of its checkpoints: BLiMP of a random twin per seed, on the first `pairs`
    pairs of each paradigm (None: all), with the published references where `blimp_dir` has them."""
    chosen = blimp.load_pairs(blimp.BlimpConfig(dir=blimp_dir, pairs_per_paradigm=pairs))
    twins = [score(*random_twin(checkpoint, seed), chosen) for seed in seeds]
    terms = {uid: rows[0]["linguistics_term"] for uid, rows in chosen.items()}
    references = published(Path(blimp_dir), terms) if blimp_dir else {}
    return {
        "arch": shape,
        "seeds": list(seeds),
        "pairs_per_paradigm": pairs,
        "twins": twins,
        "published": references,
    }


def joined(parts: list[dict]) -> dict:
    """One floor from floors of the same shape drawn apart (one seed each, in parallel): their twins in order."""
    whole = {**parts[0], "seeds": [], "twins": []}
    for part in parts:
        whole["seeds"] += part["seeds"]
        whole["twins"] += part["twins"]
    return whole


def published(blimp_dir: Path, terms: dict[str, str]) -> dict[str, dict[str, float]]:
    """{reference: {"overall": .., <phenomenon>: ..}} in %, each the mean over its paradigms as BLiMP reports
    it, from <blimp_dir>/published/models_summary.jsonl ({} without it). `terms`: UID -> phenomenon as the
    data names it (the corrected release moved two argument-structure paradigms to s-selection; the published
    summary keeps the old names, so its per-UID rows are regrouped)."""
    path = blimp_dir / "published" / "models_summary.jsonl"
    if not path.exists():
        return {}
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    per_uid = {r["UID"]: r for r in rows if r.get("UID") in terms}
    out = {}
    for key, name in REFERENCES.items():
        by_term: dict[str, list[float]] = {}
        for uid, row in per_uid.items():
            by_term.setdefault(terms[uid], []).append(100 * row[key])
        overall = statistics.mean(100 * row[key] for row in per_uid.values())
        out[name] = {"overall": overall, **{t: statistics.mean(v) for t, v in by_term.items()}}
    return out


def floor_range(figures: dict, term: str = "overall") -> tuple[float, float, float]:
    """(mean, lowest, highest) of a floor's twins, overall or for one phenomenon."""
    values = [accuracy(t, term) for t in figures["twins"]]
    return statistics.mean(values), min(values), max(values)


def accuracy(result: dict, term: str) -> float:
    """A BLiMP result's accuracy overall (term "overall") or for one phenomenon (nan when it has none)."""
    if term == "overall":
        return result["overall"]
    return result["per_linguistics_term"].get(term, float("nan"))


def phenomena_table(twins: list[dict], scored: dict[str, dict], references: dict[str, dict]) -> str:
    """BLiMP by phenomenon: the floor's mean and range, each scored run, each published reference."""
    first = twins[0] if twins else next(iter(scored.values()))
    terms = sorted(first["per_linguistics_term"])
    header = ["", *(["floor (mean, range)"] if twins else []), *scored, *references]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for term in ["overall", *terms]:
        cells = [f"**{term}**" if term == "overall" else term]
        if twins:
            values = [accuracy(t, term) for t in twins]
            cells.append(f"{statistics.mean(values):.1f} ({min(values):.1f}–{max(values):.1f})")
        cells += [f"{accuracy(result, term):.1f}" for result in scored.values()]
        cells += [f"{ref.get(term, float('nan')):.1f}" for ref in references.values()]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)
