"""BLiMP of checkpoints beside their no-pretraining floor and the published references, by phenomenon.

    python scripts/studies/blimp_study.py --blimp-dir <BLiMP folder> --pairs 100 \
        --floor <checkpoint> --floor-seeds 0 1 2 --score <label>=<checkpoint> ... --out results/blimp/<name>.json

--floor: the random-weight twins of that checkpoint (its architecture and tokenizer, weights drawn with each
seed; pretraining never ran): a random masked LM is not at chance on BLiMP (each token gets an arbitrary fixed
log-probability, and many paradigms differ in which words they use), so the floor is the mean of several draws.
Each labelled checkpoint is scored the same way (`--variant`, default within_word_l2r). Prints one markdown table
(overall and per phenomenon: the floor's mean and range, each checkpoint, and the published 5-gram, LSTM and
GPT-2 when the BLiMP folder has published/models_summary.jsonl) and writes every figure to --out.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from cramming.eval import blimp
from cramming.model import build_model
from cramming.model.checkpoint import load_pretrained
from cramming.utils import seed_everything

REFERENCES = {"ngram": "5-gram", "lstm": "LSTM", "gpt2": "GPT-2"}


def score(model, tokenizer, mask_id: int, pairs: dict, variant: str) -> dict:
    lm = blimp.CrammedMaskedLM(model, tokenizer, mask_id)
    records = [r for rows in pairs.values() for r in blimp.score_paradigm(lm, rows, variant, batch_rows=512)]
    return blimp.summarize(records, pairs, variant)


def random_twin(checkpoint: str, seed: int):
    """The checkpoint's architecture and tokenizer with freshly initialized weights."""
    pretrained = load_pretrained(checkpoint, device="cpu")
    seed_everything(seed)
    model = build_model(pretrained.model.arch, pretrained.model.vocab_size)
    return model, pretrained.tokenizer, pretrained.config["special_tokens"]["mask"]


def published(blimp_dir: Path, terms: dict[str, str]) -> dict[str, dict[str, float]]:
    """{reference: {"overall": .., <phenomenon>: ..}} in %, each the mean over its paradigms as BLiMP reports
    it. `terms`: UID -> phenomenon as the data names it (the corrected release moved two argument-structure
    paradigms to s-selection; the published summary keeps the old names, so its per-UID rows are regrouped)."""
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


def _accuracy_of(term: str):
    """result -> its accuracy overall (term "overall") or for one phenomenon."""

    def get(result: dict) -> float:
        if term == "overall":
            return result["overall"]
        return result["per_linguistics_term"].get(term, float("nan"))

    return get


def table(floor: list[dict], scored: dict[str, dict], references: dict[str, dict]) -> str:
    terms = (
        sorted(floor[0]["per_linguistics_term"])
        if floor
        else sorted(next(iter(scored.values()))["per_linguistics_term"])
    )
    header = ["", *(["floor (mean, range)"] if floor else []), *scored, *references]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for term in ["overall", *terms]:
        get = _accuracy_of(term)
        cells = [f"**{term}**" if term == "overall" else term]
        if floor:
            values = [get(f) for f in floor]
            cells.append(f"{statistics.mean(values):.1f} ({min(values):.1f}–{max(values):.1f})")
        cells += [f"{get(result):.1f}" for result in scored.values()]
        cells += [f"{ref.get(term, float('nan')):.1f}" for ref in references.values()]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--score", action="append", default=[], help="<label>=<checkpoint folder> (repeat it)"
    )
    parser.add_argument("--blimp-dir", required=True)
    parser.add_argument("--pairs", type=int, default=100, help="the first N pairs of each paradigm; 0: all")
    parser.add_argument("--variant", default="within_word_l2r", choices=blimp.VARIANTS)
    parser.add_argument("--floor", help="a checkpoint whose random-weight twins give the floor")
    parser.add_argument("--floor-seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--out", type=Path, help="a JSON file for every figure")
    args = parser.parse_args()
    torch.set_num_threads(1)
    cfg = blimp.BlimpConfig(dir=args.blimp_dir, pairs_per_paradigm=args.pairs or None, variant=args.variant)
    pairs = blimp.load_pairs(cfg)
    start = time.perf_counter()
    floor = (
        [score(*random_twin(args.floor, seed), pairs, args.variant) for seed in args.floor_seeds]
        if args.floor
        else []
    )
    scored = {}
    for item in args.score:
        label, _, folder = item.partition("=")
        pretrained = load_pretrained(folder, device="cpu")
        scored[label] = score(
            pretrained.model,
            pretrained.tokenizer,
            pretrained.config["special_tokens"]["mask"],
            pairs,
            args.variant,
        )
    terms = {uid: rows[0]["linguistics_term"] for uid, rows in pairs.items()}
    references = published(Path(args.blimp_dir), terms)
    pairs_n = sum(len(rows) for rows in pairs.values())
    print(
        f"BLiMP, {pairs_n} pairs ({args.pairs or 'all'} per paradigm), {args.variant}, ties fail; {time.perf_counter() - start:.0f} s"
    )
    print(table(floor, scored, references))
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        figures = {
            "pairs": pairs_n,
            "variant": args.variant,
            "floor_seeds": args.floor_seeds,
            "floor": floor,
            "scored": scored,
            "published": references,
        }
        args.out.write_text(json.dumps(figures, indent=1) + "\n")


if __name__ == "__main__":
    main()
