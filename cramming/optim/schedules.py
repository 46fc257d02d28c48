"""Learning-rate schedules, as functions of training progress in [0, 1]: the one registry that pretraining
and GLUE fine-tuning both read; and pretraining's batch-size ramp, in micro-batches per update.

The `budget-*` schedules read progress as the fraction of the wall-clock budget elapsed (cramming): the run
ends on time whatever its speed, so the schedule must follow the clock, not a step count nobody knows in
advance. `steps-*` schedules read it as updates done / train.steps, for comparison with step-based recipes.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass


def triangle2(progress: float, warmup: float) -> float:
    """Linear rise from 25% of peak to peak at `warmup`, then linear fall to 0 at the end (cramming)."""
    if progress < warmup:
        return 0.25 + 0.75 * progress / warmup
    return max(0.0, (1.0 - progress) / (1.0 - warmup))


def cosine(progress: float, warmup: float) -> float:
    """Linear warm-up from 0 to peak, then half a cosine down to 0 at the end."""
    if progress < warmup:
        return progress / warmup
    decay = min(1.0, (progress - warmup) / (1.0 - warmup))
    return 0.5 * (1.0 + math.cos(math.pi * decay))


def constant(progress: float, warmup: float) -> float:
    """Peak throughout, after an optional linear warm-up."""
    return progress / warmup if progress < warmup else 1.0


def linear(progress: float, warmup: float) -> float:
    """Linear warm-up to peak, then linear decay to 0 at the end (the original BERT)."""
    if progress < warmup:
        return progress / warmup
    return max(0.0, (1.0 - progress) / (1.0 - warmup))


@dataclass(frozen=True)
class LRSchedule:
    shape: Callable[[float, float], float]
    # "budget": progress = elapsed / budget; "steps": progress = updates / train.steps
    clock: str
    default_warmup: float

    def factor(self, progress: float, warmup: float | None = None) -> float:
        """Multiplier of the peak learning rate at `progress` (clamped to [0, 1])."""
        return self.shape(min(max(progress, 0.0), 1.0), self.default_warmup if warmup is None else warmup)

    def factor_for_update(
        self, warmup: float | None, *, budget_fraction: float, updates: int, steps: int | None
    ) -> float:
        """The multiplier for the update about to be applied: at the budget's elapsed fraction (budget-*), or
        after `updates` of `steps` (steps-*)."""
        progress = budget_fraction if self.clock == "budget" else step_progress(updates, steps)
        return self.factor(progress, warmup)


LR_SCHEDULES: dict[str, LRSchedule] = {
    "budget-triangle2": LRSchedule(triangle2, clock="budget", default_warmup=0.75),
    "budget-cosine": LRSchedule(cosine, clock="budget", default_warmup=0.1),
    "budget-constant": LRSchedule(constant, clock="budget", default_warmup=0.0),
    "steps-linear": LRSchedule(linear, clock="steps", default_warmup=0.01),
    "steps-cosine": LRSchedule(cosine, clock="steps", default_warmup=0.1),
    "steps-constant": LRSchedule(constant, clock="steps", default_warmup=0.0),
}


def step_progress(update: int, total: int) -> float:
    """Progress of a steps-* schedule for the update about to be applied (counted from 1, so the first
    update of a warm-up already has a non-zero rate)."""
    return (update + 1) / max(1, total)


# ------------------------------------------------------------------------------------- the batch-size ramp


def ramped_batch_size(progress: float, batch_size: int, ramp: float, start: int) -> float:
    """Sequences per update at budget fraction `progress`: rising linearly from `start` (at most batch_size)
    to `batch_size` at `ramp`; the whole batch from the start when ramp is 0. Defined in sequences, so the
    micro-batch size does not move it."""
    start = min(start, batch_size)
    if ramp <= 0.0 or progress >= ramp:
        return float(batch_size)
    return start + (batch_size - start) * progress / ramp


def accumulation_steps(
    progress: float, batch_size: int, microbatch_size: int, ramp: float, start: int = 128
) -> int:
    """Micro-batches per update at budget fraction `progress`: ramped_batch_size in whole micro-batches,
    rounded down during the ramp (at least one), to the nearest at the end. This rounding is the one way
    impl.microbatch_size touches the recipe: pick a micro-batch that divides train.batch_size (and
    train.batch_size_start) and two micro-batch sizes train on exactly the same rows."""
    target = max(1, round(batch_size / microbatch_size))
    sequences = ramped_batch_size(progress, batch_size, ramp, start)
    return min(target, max(1, int(sequences // microbatch_size)))
