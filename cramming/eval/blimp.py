"""BLiMP, scored zero-shot: does the model prefer the grammatical sentence of each minimal pair?

BLiMP (Warstadt et al., TACL 2020): 67 paradigms (`UID`) of 1,000 pairs, a grammatical and an ungrammatical
sentence that differ minimally, grouped by phenomenon (`linguistics_term`) and `field`. A masked LM scores a
sentence by its pseudo-log-likelihood (Salazar et al., ACL 2020): mask each token in turn and sum the
log-probabilities of the true tokens,

    PLL(s) = sum_i log P(s_i | s with position i masked)

A pair passes when PLL(good) > PLL(bad); a tie fails (a model that cannot tell the two apart gets no credit).
`within_word_l2r` (Kauf & Ivanova, 2023) also masks the later pieces of the word that position i belongs to:
plain PLL overrates words split into several tokens, whose later pieces are easy to guess from the earlier.

Fast: every masked copy of a sentence is one row, and sentences of one token length share batches, so no row is
padded; the decoder runs on the one scored position of each row only.
"""

from __future__ import annotations

import gzip
import json
import logging
import math
from collections import defaultdict
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field
from pathlib import Path

import torch
from tokenizers import Tokenizer
from torch import nn

from cramming.errors import DataSourceError, RunStopped, check_choice, check_readable, config_error
from cramming.runs import earlier_run, refuse_other_settings
from cramming.signals import catch_stop_signals
from cramming.utils import atomic_write_text

log = logging.getLogger("cramming")

VARIANTS = ("pll", "within_word_l2r")
FIELDS = ("UID", "pairID", "sentence_good", "sentence_bad", "field", "linguistics_term")
HUB_DATASET = "nyu-mll/blimp"
SCORES_FILE = "blimp_scores.jsonl"
RESULTS_FILE = "blimp_results.json"
RECIPE_FILE = "blimp_recipe.json"  # what the scores were computed with: a resume must match it


@dataclass
class BlimpConfig:
    """The `blimp` settings of eval.py (benchmark=blimp)."""

    # a folder of <UID>.jsonl[.gz] files (the layout of BLiMP's data/ folder), or null for the hub (nyu-mll/blimp)
    dir: str | None = None
    # the first N pairs of each paradigm by pairID (a fixed subset for quick looks); null: all 1,000
    pairs_per_paradigm: int | None = None
    # pll (Salazar et al.) or within_word_l2r (Kauf & Ivanova: later pieces of the word masked too)
    variant: str = "within_word_l2r"
    # paradigms to score (UIDs); empty: all that the source holds
    paradigms: list[str] = field(default_factory=list)
    # masked copies per forward pass (speed only: every row is scored on its own)
    batch_rows: int = 512

    def __post_init__(self) -> None:
        check_choice("blimp.variant", self.variant, VARIANTS)
        if self.pairs_per_paradigm is not None and self.pairs_per_paradigm < 1:
            raise config_error(
                "blimp.pairs_per_paradigm", self.pairs_per_paradigm, "give at least 1, or null"
            )
        if self.batch_rows < 1:
            raise config_error("blimp.batch_rows", self.batch_rows, "give at least 1, e.g. 512")


# ------------------------------------------------------------------------------------------------------ data


def read_paradigm(path: Path, limit: int | None = None) -> list[dict]:
    """The pairs of one <UID>.jsonl[.gz] file, in pairID order, the first `limit` of them."""
    opener = gzip.open if path.suffix == ".gz" else open
    check_readable(path, "blimp.dir")
    try:
        with opener(path, "rt", encoding="utf-8") as f:
            rows = [json.loads(line) for line in f if line.strip()]
    except (OSError, EOFError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise DataSourceError(f"{path} does not read as BLiMP JSON lines ({err}); replace the file") from err
    missing = [key for key in FIELDS if rows and key not in rows[0]]
    if not rows or missing:
        raise DataSourceError(
            f"{path}: {'no pairs' if not rows else f'no field {missing[0]!r}'}; is it BLiMP?"
        )
    rows.sort(key=lambda row: int(row["pairID"]))
    return rows[:limit]


def local_paradigms(folder: Path) -> dict[str, Path]:
    """UID -> file of a folder of <UID>.jsonl or <UID>.jsonl.gz files."""
    check_readable(folder, "blimp.dir")
    files = {p.name.removesuffix(".gz").removesuffix(".jsonl"): p for p in sorted(folder.glob("*.jsonl*"))}
    if not files:
        raise DataSourceError(f"blimp.dir={folder} holds no <UID>.jsonl(.gz) files; point it at BLiMP's data")
    return files


def load_pairs(cfg: BlimpConfig, hf_cache: Path | None = None) -> dict[str, list[dict]]:
    """UID -> its pairs, from blimp.dir or the hub, the paradigms of blimp.paradigms (all when empty)."""
    if cfg.dir is not None:
        files = local_paradigms(Path(cfg.dir))
        uids = cfg.paradigms or list(files)
        unknown = [uid for uid in uids if uid not in files]
        if unknown:
            raise DataSourceError(f"blimp.paradigms: {unknown} not in blimp.dir={cfg.dir}")
        return {uid: read_paradigm(files[uid], cfg.pairs_per_paradigm) for uid in uids}
    return _hub_pairs(cfg, hf_cache)


def _hub_pairs(cfg: BlimpConfig, hf_cache: Path | None) -> dict[str, list[dict]]:
    import datasets

    try:
        uids = cfg.paradigms or datasets.get_dataset_config_names(HUB_DATASET)
        out = {}
        for uid in uids:
            rows = datasets.load_dataset(HUB_DATASET, uid, split="train", cache_dir=hf_cache)
            pairs = sorted((dict(row) for row in rows), key=lambda row: int(row["pairID"]))
            out[uid] = pairs[: cfg.pairs_per_paradigm]
        return out
    except Exception as err:  # no network (ConnectionError, hub errors): one line, and the alternative
        raise DataSourceError(
            f"could not load {HUB_DATASET} from the Hugging Face hub ({type(err).__name__}: {err}); without a"
            " network, point blimp.dir at a folder of BLiMP's <UID>.jsonl(.gz) files"
        ) from err


# --------------------------------------------------------------------------------------------------- scoring


class MaskedLM:
    """What scoring needs of a model: its tokenizer, its [MASK] id, and the log-probability of one target
    token at one position of each row. Subclasses wrap a cramming model or a transformers one."""

    def __init__(self, tokenizer: Tokenizer, mask_id: int, device: torch.device):
        self.tokenizer, self.mask_id, self.device = tokenizer, mask_id, device

    def log_probs(
        self, input_ids: torch.Tensor, positions: torch.Tensor, targets: torch.Tensor
    ) -> torch.Tensor:
        """input_ids (rows, seq), positions and targets (rows,) -> log P(target at position) (rows,), fp32."""
        raise NotImplementedError


class CrammedMaskedLM(MaskedLM):
    """cramming's BertForMLM: the encoder over the rows, the decoder on the scored positions only."""

    def __init__(
        self,
        model: nn.Module,
        tokenizer: Tokenizer,
        mask_id: int,
        autocast: Callable[[], AbstractContextManager] = nullcontext,
    ):
        super().__init__(tokenizer, mask_id, next(model.parameters()).device)
        self.model, self.autocast = model.eval(), autocast

    @torch.no_grad()
    def log_probs(
        self, input_ids: torch.Tensor, positions: torch.Tensor, targets: torch.Tensor
    ) -> torch.Tensor:
        rows = torch.arange(len(input_ids), device=input_ids.device)
        with self.autocast():
            hidden = self.model.encoder(input_ids)  # (rows, seq, hidden)
            logits = self.model.head(hidden[rows, positions])  # (rows, vocab)
        return torch.log_softmax(logits.float(), dim=-1)[rows, targets]


class TransformersMaskedLM(MaskedLM):
    """A transformers masked LM (AutoModelForMaskedLM): its logits at the scored positions."""

    def __init__(self, model: nn.Module, tokenizer: Tokenizer, mask_id: int):
        super().__init__(tokenizer, mask_id, next(model.parameters()).device)
        self.model = model.eval()

    @torch.no_grad()
    def log_probs(
        self, input_ids: torch.Tensor, positions: torch.Tensor, targets: torch.Tensor
    ) -> torch.Tensor:
        rows = torch.arange(len(input_ids), device=input_ids.device)
        logits = self.model(input_ids=input_ids).logits[rows, positions]  # (rows, vocab)
        return torch.log_softmax(logits.float(), dim=-1)[rows, targets]


def token_ids(tokenizer: Tokenizer, sentence: str) -> tuple[list[int], list[int | None]]:
    """The sentence's ids as the model reads one sentence ([CLS] ... [SEP]: the tokenizer's post-processor),
    and each token's word index (None for the special tokens)."""
    encoding = tokenizer.encode(sentence)
    return encoding.ids, [
        None if special else word
        for special, word in zip(encoding.special_tokens_mask, encoding.word_ids, strict=True)
    ]


def masked_rows(
    ids: list[int], words: list[int | None], mask_id: int, variant: str
) -> list[tuple[list[int], int, int]]:
    """(masked ids, scored position, true id) of each masked copy: one per non-special token. within_word_l2r
    also masks the positions after i that belong to the same word."""
    rows = []
    for i, word in enumerate(words):
        if word is None:
            continue
        copy = list(ids)
        copy[i] = mask_id
        if variant == "within_word_l2r":
            for j in range(i + 1, len(ids)):
                if words[j] != word:
                    break
                copy[j] = mask_id
        rows.append((copy, i, ids[i]))
    return rows


def pseudo_log_likelihoods(lm: MaskedLM, sentences: list[str], variant: str, batch_rows: int) -> list[float]:
    """The PLL of each sentence, summed in float64. Sentences of one token length share batches."""
    encoded = [token_ids(lm.tokenizer, s) for s in sentences]
    by_length: dict[int, list[int]] = defaultdict(list)
    for index, (ids, _) in enumerate(encoded):
        by_length[len(ids)].append(index)
    totals = [0.0] * len(sentences)
    for indices in by_length.values():
        rows = [
            (index, *row) for index in indices for row in masked_rows(*encoded[index], lm.mask_id, variant)
        ]
        for start in range(0, len(rows), batch_rows):
            chunk = rows[start : start + batch_rows]
            ids = torch.tensor([row[1] for row in chunk], device=lm.device)
            positions = torch.tensor([row[2] for row in chunk], device=lm.device)
            targets = torch.tensor([row[3] for row in chunk], device=lm.device)
            for (index, *_), value in zip(
                chunk, lm.log_probs(ids, positions, targets).double().tolist(), strict=True
            ):
                totals[index] += value
    return totals


def score_paradigm(lm: MaskedLM, pairs: list[dict], variant: str, batch_rows: int) -> list[dict]:
    """One record per pair: UID, pairID and the two sentences' pseudo-log-likelihoods."""
    good_and_bad = [p["sentence_good"] for p in pairs] + [p["sentence_bad"] for p in pairs]
    plls = pseudo_log_likelihoods(lm, good_and_bad, variant, batch_rows)
    n = len(pairs)
    return [
        {"UID": p["UID"], "pairID": p["pairID"], "pll_good": plls[i], "pll_bad": plls[n + i]}
        for i, p in enumerate(pairs)
    ]


# ------------------------------------------------------------------------------------------------- results


def passed(record: dict) -> bool:
    """Strictly higher for the grammatical sentence: a tie fails."""
    return record["pll_good"] > record["pll_bad"]


def summarize(records: list[dict], pairs: dict[str, list[dict]], variant: str) -> dict:
    """Accuracy (%) overall (the mean over paradigms, as BLiMP reports it), per UID, per linguistics_term
    and per field (each the mean of its paradigms' accuracies), and what was scored."""
    hits: dict[str, list[bool]] = defaultdict(list)
    for record in records:
        hits[record["UID"]].append(passed(record))
    per_uid = {uid: 100.0 * sum(h) / len(h) for uid, h in hits.items()}
    groups: dict[str, dict[str, list[float]]] = {
        "linguistics_term": defaultdict(list),
        "field": defaultdict(list),
    }
    for uid, accuracy in per_uid.items():
        for key, by in groups.items():
            by[pairs[uid][0][key]].append(accuracy)
    mean = lambda values: sum(values) / len(values) if values else math.nan  # noqa: E731
    return {
        "overall": mean(list(per_uid.values())),
        "per_uid": dict(sorted(per_uid.items())),
        "per_linguistics_term": {k: mean(v) for k, v in sorted(groups["linguistics_term"].items())},
        "per_field": {k: mean(v) for k, v in sorted(groups["field"].items())},
        "pairs_scored": sum(len(h) for h in hits.values()),
        "paradigms": len(per_uid),
        "ties": sum(1 for r in records if r["pll_good"] == r["pll_bad"]),
        "variant": variant,
        "tie_rule": "a tie fails",
    }


def read_scores(path: Path) -> list[dict]:
    """The records already written (a resumed evaluation skips their paradigms); a torn last line is dropped."""
    if not path.exists():
        return []
    records = []
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            break  # a line cut by a kill: that paradigm is scored again
    return records


def run_blimp(
    lm: MaskedLM,
    cfg: BlimpConfig,
    run_dir: Path,
    hf_cache: Path | None = None,
    stop: Callable[[], bool] = lambda: False,
) -> dict:
    """Score every paradigm not yet in {run_dir}/blimp_scores.jsonl (one paradigm at a time, appended whole),
    then write blimp_results.json. `stop` is asked between paradigms (a stop signal: the finished ones stay)."""
    pairs = load_pairs(cfg, hf_cache)
    scores_path = run_dir / SCORES_FILE
    records = read_scores(scores_path)
    done = {uid for uid in pairs if sum(r["UID"] == uid for r in records) == len(pairs[uid])}
    records = [r for r in records if r["UID"] in done]  # a paradigm cut short is scored again
    scores_path.write_text("".join(json.dumps(r) + "\n" for r in records), encoding="utf-8")
    for uid in pairs:
        if uid in done:
            continue
        if stop():
            break
        scored = score_paradigm(lm, pairs[uid], cfg.variant, cfg.batch_rows)
        with open(scores_path, "a", encoding="utf-8") as f:
            f.write("".join(json.dumps(r) + "\n" for r in scored))
        records += scored
        log.info(
            "blimp %s: %.1f%% of %d pairs", uid, 100.0 * sum(map(passed, scored)) / len(scored), len(scored)
        )
    results = summarize(records, pairs, cfg.variant)
    results["complete"] = results["paradigms"] == len(pairs)
    atomic_write_text(run_dir / RESULTS_FILE, json.dumps(results, indent=1) + "\n")
    return results


# ----------------------------------------------------------------------------------- one evaluation's life


def recipe_of(cfg: BlimpConfig, checkpoint: str) -> dict:
    """Everything that decides the scores (not batch_rows: speed only)."""
    return {
        "checkpoint": checkpoint,
        "source": cfg.dir or HUB_DATASET,
        "pairs_per_paradigm": cfg.pairs_per_paradigm,
        "variant": cfg.variant,
        "paradigms": sorted(cfg.paradigms),
    }


def earlier_evaluation(
    run_dir: Path, resume: bool, base_dir: str, name: str, sweep_job: int | None
) -> Path | None:
    """The folder whose scored paradigms this evaluation takes up (cramming.runs.earlier_run): its own (a
    requeued cluster job), else with resume=true the newest earlier BLiMP evaluation of `name` (job N of the
    newest multirun for job N)."""
    return earlier_run(
        run_dir, (SCORES_FILE,), resume=resume, base_dir=base_dir, name=name, what="BLiMP evaluation",
        sweep_job=sweep_job,
    )  # fmt: skip


def take_up(earlier: Path | None, run_dir: Path, recipe: dict) -> None:
    """Copy the earlier evaluation's scores into run_dir (the new folder gets the whole result), after checking
    it scored the same checkpoint the same way; write this evaluation's recipe."""
    if earlier is not None and earlier != run_dir:
        saved = json.loads((earlier / RECIPE_FILE).read_text(encoding="utf-8"))
        refuse_other_settings(
            saved, recipe, what=f"the BLiMP evaluation in {earlier} scored otherwise",
            fix="Resume with its settings, or start afresh with resume=false",
        )  # fmt: skip
        (run_dir / SCORES_FILE).write_bytes((earlier / SCORES_FILE).read_bytes())
        log.info("taking up the scored paradigms of %s", earlier)
    atomic_write_text(run_dir / RECIPE_FILE, json.dumps(recipe, indent=1) + "\n")


def evaluate(lm: MaskedLM, cfg: BlimpConfig, run_dir: Path, hf_cache: Path | None = None) -> dict:
    """run_blimp, stopping between paradigms on SIGINT/SIGTERM/SIGUSR2 with the finished ones kept: then
    RunStopped, so the entry point exits 128 + the signal (or a cluster job is requeued and takes them up)."""
    with catch_stop_signals("stopping after this paradigm; the scored ones are kept") as signals:
        results = run_blimp(lm, cfg, run_dir, hf_cache, stop=lambda: signals.received is not None)
    if signals.received is not None:
        raise RunStopped(
            signals.received, f"BLiMP scoring stopped; {results['paradigms']} paradigms are kept"
        )
    log.info(
        "BLiMP (%s): %.2f over %d paradigms, %d pairs; by phenomenon: %s",
        cfg.variant,
        results["overall"],
        results["paradigms"],
        results["pairs_scored"],
        ", ".join(f"{k} {v:.1f}" for k, v in results["per_linguistics_term"].items()),
    )
    return results


def tracker_record(results: dict) -> dict:
    """The results as one metrics record: blimp/overall, blimp/<phenomenon>, blimp/field/<field>."""
    return {
        "blimp": {
            "overall": results["overall"],
            **results["per_linguistics_term"],
            "field": results["per_field"],
            "pairs_scored": results["pairs_scored"],
        }
    }
