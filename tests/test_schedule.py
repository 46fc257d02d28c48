"""Learning-rate schedules at 0, 25, 75 and 100% of their clock, and the batch-size ramp."""

from __future__ import annotations

import math

import pytest

from cramming.optim.schedules import LR_SCHEDULES, accumulation_steps

HALF_COS_AT_25 = 0.5 * (1 + math.cos(math.pi * (0.25 - 0.1) / 0.9))
HALF_COS_AT_75 = 0.5 * (1 + math.cos(math.pi * (0.75 - 0.1) / 0.9))


@pytest.mark.parametrize(
    ("name", "expected"),
    [
        # cramming: 25% of peak rising to peak at 75%, then down to 0 at the end
        ("budget-triangle2", {0.0: 0.25, 0.25: 0.5, 0.75: 1.0, 1.0: 0.0}),
        # linear warm-up over 10%, half cosine after
        ("budget-cosine", {0.0: 0.0, 0.25: HALF_COS_AT_25, 0.75: HALF_COS_AT_75, 1.0: 0.0}),
        ("budget-constant", {0.0: 1.0, 0.25: 1.0, 0.75: 1.0, 1.0: 1.0}),
        # BERT: warm-up over 1% of the steps, linear decay to 0
        ("steps-linear", {0.0: 0.0, 0.25: 0.75 / 0.99, 0.75: 0.25 / 0.99, 1.0: 0.0}),
    ],
)
def test_schedule_values(name, expected):
    schedule = LR_SCHEDULES[name]
    for progress, value in expected.items():
        assert schedule.factor(progress) == pytest.approx(value, abs=1e-9), f"{name} at {progress:.0%}"


def test_schedule_clocks():
    assert {name: s.clock for name, s in LR_SCHEDULES.items()} == {
        "budget-triangle2": "budget",
        "budget-cosine": "budget",
        "budget-constant": "budget",
        "steps-linear": "steps",
        "steps-cosine": "steps",  # fine-tuning (eval.schedule) takes its schedule from this registry too
        "steps-constant": "steps",
    }


def test_schedules_are_clamped_past_the_end_and_warmup_is_configurable():
    assert LR_SCHEDULES["budget-triangle2"].factor(1.3) == 0.0
    assert LR_SCHEDULES["budget-cosine"].factor(-0.1) == 0.0
    assert LR_SCHEDULES["budget-constant"].factor(0.25, warmup=0.5) == pytest.approx(0.5)
    assert LR_SCHEDULES["budget-triangle2"].factor(0.5, warmup=0.5) == pytest.approx(1.0)


def test_factor_for_update_reads_the_clock_its_schedule_names():
    """A budget-* schedule follows the budget's elapsed fraction whatever the update count; a steps-* one the
    update about to be applied (counted from 1) of train.steps, whatever the clock."""
    triangle, linear = LR_SCHEDULES["budget-triangle2"], LR_SCHEDULES["steps-linear"]
    assert triangle.factor_for_update(None, budget_fraction=0.75, updates=3, steps=None) == pytest.approx(1.0)
    assert triangle.factor_for_update(None, budget_fraction=0.25, updates=900, steps=1000) == pytest.approx(
        0.5
    )
    # update 250 of 1000 is applied at progress 251/1000, past the 1% warm-up: (1 - 0.251) / 0.99
    at_251 = linear.factor_for_update(None, budget_fraction=0.9, updates=250, steps=1000)
    assert at_251 == pytest.approx((1 - 0.251) / 0.99)
    assert linear.factor_for_update(0.5, budget_fraction=0.0, updates=249, steps=1000) == pytest.approx(0.5)


def test_batch_size_ramp():
    # 8192 sequences per update from micro-batches of 128: 64 micro-batches, reached at 60% of the budget
    steps = [accumulation_steps(p, 8192, 128, 0.6) for p in (0.0, 0.3, 0.6, 0.9)]
    assert steps == [1, 32, 64, 64]
    assert accumulation_steps(0.0, 8192, 128, 0.0) == 64  # no ramp
    assert accumulation_steps(0.5, 100, 128, 0.6) == 1  # a batch smaller than one micro-batch
    ramp = [accumulation_steps(p / 100, 4096, 64, 0.5) for p in range(101)]
    assert ramp == sorted(ramp)  # never shrinks
