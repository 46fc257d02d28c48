"""Anytime evaluation: fine-tune the weights of a running pretraining on a small fixed GLUE subset, and/or
score a fixed BLiMP subset zero-shot, at given fractions of its budget, so the learning curve of downstream
quality is visible, not only its end point.

pretrain.py hands an `AnytimeEval` to the loop as a hook; each evaluation fine-tunes a copy of the current
encoder in memory (nothing is written to disk) with eval.py's fine-tuning for every task of the recipe: the
same fine-tuning as a full GLUE run, on fewer examples. Its time counts against the pretraining budget (`charged: true`) or pauses the
budget clock (`charged: false`, the default: the curve then shows what the run would reach without it).
The scores go into metrics.jsonl as records with `anytime_fraction` and `anytime` (GLUE entry -> score), and
with `anytime.benchmarks=[glue,blimp]` also `anytime_blimp` (BLiMP accuracy, %) and `anytime_blimp_terms` (per
phenomenon). BLiMP needs no fine-tuning: a subset of 100 pairs per paradigm takes about a minute for bert-tiny on
one CPU thread, the same whatever the run's length.
"""

from __future__ import annotations

import copy
import functools
import logging
import time
from contextlib import nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from torch import nn

from cramming.budget import BudgetClock
from cramming.errors import DataSourceError, check_choice, config_error
from cramming.eval.backbone import Backbone
from cramming.eval.blimp import BlimpConfig, CrammedMaskedLM, load_pairs, score_paradigm
from cramming.eval.blimp import summarize as blimp_summary
from cramming.eval.config import EvalConfig
from cramming.eval.scores import glue_average, summarize
from cramming.eval.tasks import GLUE_TASKS
from cramming.impl import ImplConfig
from cramming.model.checkpoint import unwrap
from cramming.optim.step import autocast, preserved_rng

if TYPE_CHECKING:
    from cramming.data import PretrainingData

log = logging.getLogger("cramming")


ANYTIME_BENCHMARKS = ("glue", "blimp")


def _blimp_subset() -> BlimpConfig:
    return BlimpConfig(pairs_per_paradigm=100)


def _small_recipe() -> EvalConfig:
    return EvalConfig(
        name="anytime", tasks=["RTE", "SST-2"], epochs=1, max_train_examples=512, max_eval_examples=256
    )


@dataclass
class AnytimeConfig:
    """`anytime` (a top-level key of the pretraining config, beside `train`): when to evaluate during
    pretraining, on what, and who pays for the time."""

    # fractions of the pretraining budget at which to evaluate, e.g. [0.25, 0.5, 1.0]; empty: never
    at: list[float] = field(default_factory=list)
    # what to evaluate: glue (fine-tuning, `recipe`) and/or blimp (zero-shot, `blimp`)
    benchmarks: list[str] = field(default_factory=lambda: ["glue"])
    # true: the evaluations' time counts against the pretraining budget; false: the budget clock pauses
    charged: bool = False
    # the fine-tuning recipe (any eval.* setting): two tasks, subsampled, one epoch unless changed.
    # Offline, point it at a local GLUE copy in the original TSV layout: anytime.recipe.glue_dir=<folder>
    recipe: EvalConfig = field(default_factory=_small_recipe)
    # fine-tuning seed (one per evaluation: the curve compares fractions, not seeds)
    seed: int = 0
    # the BLiMP subset (any blimp.* setting of eval.py): the first 100 pairs of each paradigm by default.
    # Offline, point it at BLiMP's files: anytime.blimp.dir=<folder>
    blimp: BlimpConfig = field(default_factory=_blimp_subset)

    def __post_init__(self) -> None:
        if any(not 0.0 < f <= 1.0 for f in self.at):
            raise config_error("anytime.at", self.at, "use fractions of the budget in (0, 1]")
        for name in self.benchmarks:
            check_choice("anytime.benchmarks", name, ANYTIME_BENCHMARKS)
        if self.at and not self.benchmarks:
            raise config_error("anytime.benchmarks", self.benchmarks, "name glue, blimp or both")


class AnytimeEval:
    """The loop's evaluation hook: evaluates at each configured fraction once; a resumed run skips the
    fractions already passed."""

    def __init__(self, cfg: AnytimeConfig, data: PretrainingData, impl: ImplConfig, cache_dir: Path):
        self.cfg, self.impl = cfg, impl
        self.tokenizer, self.pad_id, self.mask_id = data.tokenizer, data.special.pad, data.special.mask
        self.pending = sorted(cfg.at)
        # loaded once, before training: data that cannot be had fails now, not in the middle of the run
        self.tasks = [GLUE_TASKS[name] for name in cfg.recipe.tasks] if "glue" in cfg.benchmarks else []
        self.splits = self._glue_splits(cache_dir)
        self.blimp_pairs = self._blimp_pairs(cache_dir) if "blimp" in cfg.benchmarks else {}

    def _glue_splits(self, cache_dir: Path) -> dict:
        # imported here: `datasets` stays out of the import chain of the training config (the GPU check
        # machine has no `datasets`)
        from cramming.eval.glue_data import load_task

        try:
            return {
                task.name: load_task(task, self.cfg.recipe.glue_dir, cache_dir=cache_dir)
                for task in self.tasks
            }
        except DataSourceError as err:
            raise DataSourceError(
                f"anytime: {err} (for anytime evaluation: anytime.recipe.glue_dir)"
            ) from err

    def _blimp_pairs(self, cache_dir: Path) -> dict[str, list[dict]]:
        try:
            return load_pairs(self.cfg.blimp, cache_dir)
        except DataSourceError as err:
            raise DataSourceError(f"anytime: {err} (for anytime evaluation: anytime.blimp.dir)") from err

    def start(self, fraction_done: float) -> None:
        self.pending = [f for f in self.pending if f > fraction_done]

    def due(self, fraction: float) -> bool:
        return bool(self.pending) and fraction >= self.pending[0]

    def __call__(self, model: nn.Module, clock: BudgetClock, update: int, tokens: int = 0) -> dict:
        """Fine-tune copies of the current encoder on every task, score the BLiMP subset; returns the metrics
        record. tokens: the training tokens seen so far."""
        fraction = clock.fraction()
        target = max(f for f in self.pending if f <= fraction)  # the fraction this evaluation stands for
        self.pending = [f for f in self.pending if f > fraction]
        start = time.perf_counter()
        record = {"update": update, "anytime_fraction": target, "budget_fraction": fraction, "tokens": tokens}
        with nullcontext() if self.cfg.charged else clock.paused(), preserved_rng():
            if self.tasks:
                record |= self.glue(model)
            if self.blimp_pairs:
                record |= self.blimp(model)
        record |= {
            "elapsed_h": clock.elapsed() / 3600,
            "anytime_seconds": time.perf_counter() - start,
            "anytime_charged": self.cfg.charged,
        }
        scores = [f"{entry} {100 * s:.1f}" for entry, s in record.get("anytime", {}).items()]
        if "anytime_blimp" in record:
            scores.append(f"BLiMP {record['anytime_blimp']:.1f}")
        log.info(
            "anytime evaluation at %.0f%% of the budget (update %d, %.0f s%s): %s",
            100 * fraction,
            update,
            record["anytime_seconds"],
            ", charged to the budget" if self.cfg.charged else ", budget clock paused",
            ", ".join(scores),
        )
        return record

    def glue(self, model: nn.Module) -> dict:
        """Fine-tune copies of the current encoder on every task of the recipe."""
        # imported here: the fine-tuning stack loads `evaluate` (and with it transformers), seconds that a
        # pretraining run without anytime evaluation should not spend at start-up
        from cramming.eval.finetune import finetune_tasks

        jobs = [(task, self.splits[task.name]) for task in self.tasks]
        glue = finetune_tasks(jobs, self.backbone(model), self.cfg.recipe, self.impl, [self.cfg.seed])
        scores = summarize(glue.per_entry)
        average, _ = glue_average(scores)
        # main metric of each entry, in [0, 1]
        return {
            "anytime": {entry: score.median for entry, score in scores.items()},
            "anytime_average": average,
        }

    def blimp(self, model: nn.Module) -> dict:
        """The BLiMP subset, scored zero-shot on the current weights (in eval mode; the loop sets train mode
        again before its next update)."""
        plain = unwrap(model)
        dtype, _ = self.impl.precision_choice(next(plain.parameters()).device)
        device_type = next(plain.parameters()).device.type
        lm = CrammedMaskedLM(
            plain, self.tokenizer, self.mask_id, functools.partial(autocast, device_type, dtype)
        )
        cfg = self.cfg.blimp
        records = [
            r
            for pairs in self.blimp_pairs.values()
            for r in score_paradigm(lm, pairs, cfg.variant, cfg.batch_rows)
        ]
        results = blimp_summary(records, self.blimp_pairs, cfg.variant)
        return {"anytime_blimp": results["overall"], "anytime_blimp_terms": results["per_linguistics_term"]}

    def backbone(self, model: nn.Module) -> Backbone:
        """The pretraining model's encoder with the arch's fine-tuning dropout (pretraining runs without);
        fine-tuning copies it again for each task, so the pretraining weights are never touched."""
        plain = unwrap(model)
        encoder = copy.deepcopy(plain.encoder)
        encoder.set_dropout(plain.arch.dropout)
        return Backbone(encoder, plain.arch.hidden_size, plain.arch.dropout, self.tokenizer, self.pad_id)
