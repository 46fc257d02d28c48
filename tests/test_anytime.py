"""Anytime evaluation: due once per fraction, its time charged to the budget or not, pretraining's random
state untouched. Fine-tuning itself is replaced by a stand-in here (tests/test_sweeps.py runs the real one)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from cramming.budget import BudgetClock
from cramming.data.config import NormalizerConfig, TokenizerConfig
from cramming.data.tokenizer import SpecialTokens, train_tokenizer
from cramming.errors import ConfigError
from cramming.eval import finetune as finetune_module
from cramming.eval.anytime import AnytimeConfig, AnytimeEval
from cramming.eval.config import EvalConfig
from cramming.eval.finetune import TaskResult
from cramming.impl import ImplConfig
from cramming.model import ArchConfig, Encoder, build_model

TINY = ArchConfig(name="tiny", num_layers=1, hidden_size=32, num_heads=2, intermediate_size=64)


class ManualClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def anytime(tmp_path, glue_dir, monkeypatch):
    clock = ManualClock()
    seen = []
    models = []

    def fake_finetune(task, splits, backbone, cfg, impl, seed, budget=None, stop=None):
        # the current weights, in memory: a copy, with the arch's fine-tuning dropout
        assert isinstance(backbone.encoder, Encoder) and backbone.dropout == TINY.dropout
        assert not any(
            backbone.encoder.state_dict()[k].data_ptr() == v.data_ptr()
            for k, v in models[-1].encoder.state_dict().items()
        )
        seen.append(task.name)
        torch.rand(3)  # fine-tuning draws random numbers too
        clock.now += 50.0  # each task takes 50 s
        return TaskResult({task.name: {"accuracy": 0.75}}, 8, 1, 50.0, 0.5, False)

    monkeypatch.setattr(finetune_module, "finetune", fake_finetune)
    tokenizer = train_tokenizer(
        [["a few words of text", "and more words"] * 10], TokenizerConfig(vocab_size=64), NormalizerConfig()
    )

    def make(charged: bool, at=(0.25, 1.0), fraction_done=0.0):
        cfg = AnytimeConfig(
            at=list(at), charged=charged, recipe=EvalConfig(tasks=["RTE", "SST-2"], glue_dir=str(glue_dir))
        )
        data = SimpleNamespace(tokenizer=tokenizer, special=SpecialTokens())
        evaluator = AnytimeEval(cfg, data, ImplConfig(device="cpu"), tmp_path / "hf")
        evaluator.start(fraction_done)
        return evaluator, BudgetClock(1000 / 3600, clock), clock, seen, models

    return make


@pytest.mark.parametrize("charged", [False, True])
def test_evaluates_once_per_fraction_and_charges_the_budget_or_not(anytime, charged):
    evaluator, budget, clock, seen, models = anytime(charged)
    model = build_model(TINY, 64)
    models.append(model)
    clock.now = 200.0  # 20% of the budget
    assert not evaluator.due(budget.fraction())
    clock.now = 300.0
    assert evaluator.due(budget.fraction())
    rng_before = torch.get_rng_state()
    record = evaluator(model, budget, update=7, tokens=0)
    assert torch.equal(torch.get_rng_state(), rng_before)
    assert seen == ["RTE", "SST-2"]
    assert record["anytime_fraction"] == 0.25 and record["budget_fraction"] == pytest.approx(0.3)
    assert record["anytime"] == {"SST-2": 0.75, "RTE": 0.75} and record["anytime_average"] == 0.75
    assert record["anytime_charged"] is charged
    # two tasks of 50 s: on the budget's clock only when charged
    assert budget.elapsed() == pytest.approx(400.0 if charged else 300.0)
    assert not evaluator.due(budget.fraction())  # 0.25 is done; 1.0 is not reached
    clock.now += 1000.0
    assert evaluator.due(budget.fraction())


def test_a_resumed_run_skips_the_fractions_it_passed(anytime):
    evaluator, *_ = anytime(False, at=(0.25, 0.5, 1.0), fraction_done=0.4)
    assert evaluator.pending == [0.5, 1.0]


def test_fractions_are_checked():
    with pytest.raises(ConfigError, match="anytime.at"):
        AnytimeConfig(at=[0.5, 1.5])


def test_blimp_subset_is_scored_on_the_current_weights_without_touching_them(tmp_path, monkeypatch):
    """anytime.benchmarks=[blimp]: the subset is read once at start-up and scored zero-shot at each fraction;
    the weights, the train mode the loop set and the random state are as before."""
    from test_blimp import write_paradigm

    data_dir = tmp_path / "blimp"
    data_dir.mkdir()
    write_paradigm(data_dir, "agreement", "subject_verb_agreement", "morphology", 4)
    write_paradigm(data_dir, "island", "island_effects", "syntax", 4)
    tokenizer = train_tokenizer(
        [["the cat is .", "the cat are .", "a few words"] * 10],
        TokenizerConfig(vocab_size=64),
        NormalizerConfig(),
    )
    cfg = AnytimeConfig(at=[0.5], benchmarks=["blimp"])
    cfg.blimp.dir, cfg.blimp.pairs_per_paradigm = str(data_dir), 3
    data = SimpleNamespace(tokenizer=tokenizer, special=SpecialTokens())
    evaluator = AnytimeEval(cfg, data, ImplConfig(device="cpu"), tmp_path / "hf")
    assert evaluator.tasks == [] and sum(map(len, evaluator.blimp_pairs.values())) == 6
    model = build_model(TINY, tokenizer.get_vocab_size()).train()
    weights = {k: v.clone() for k, v in model.state_dict().items()}
    clock = ManualClock()
    budget = BudgetClock(1000 / 3600, clock)
    clock.now = 600.0
    rng_before = torch.get_rng_state()
    record = evaluator(model, budget, update=3, tokens=4096)
    assert torch.equal(torch.get_rng_state(), rng_before)
    assert all(torch.equal(weights[k], v) for k, v in model.state_dict().items())
    assert 0.0 <= record["anytime_blimp"] <= 100.0 and record["tokens"] == 4096
    assert set(record["anytime_blimp_terms"]) == {"subject_verb_agreement", "island_effects"}
    assert "anytime" not in record  # no GLUE asked for


def test_benchmarks_are_checked():
    with pytest.raises(ConfigError, match="anytime.benchmarks"):
        AnytimeConfig(at=[0.5], benchmarks=["squad"])
