"""The wall-clock budget: how much of it is spent, and the stop rule.

The clock starts when training set-up begins, after the data is prepared: model construction, compilation
and data loading count against the budget, preprocessing does not. A resumed run starts from the elapsed
time saved in its state, so the budget keeps counting across interruptions (the downtime itself is free).

Several processes (torchrun) keep one budget: their clocks agree on rank 0's elapsed time after every
micro-batch (`AgreedClock`), so they stop after the same micro-batch and read the same budget fraction.
"""

from __future__ import annotations

import datetime as dt
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch
import torch.distributed as dist

from cramming.ranks import Ranks


class BudgetClock:
    def __init__(
        self, budget_hours: float, clock: Callable[[], float] = time.monotonic, elapsed_before: float = 0.0
    ):
        """clock: seconds from an arbitrary origin (injectable for tests); elapsed_before: seconds already
        spent by earlier, interrupted parts of this run."""
        self.budget_seconds = budget_hours * 3600.0
        self._clock = clock
        self._start = clock()
        self._elapsed_before = elapsed_before

    def elapsed(self) -> float:
        """Seconds of budget spent."""
        return self._elapsed_before + self._clock() - self._start

    def fraction(self) -> float:
        """Share of the budget spent; above 1 once it is over."""
        return self.elapsed() / self.budget_seconds

    @contextmanager
    def paused(self) -> Iterator[None]:
        """Time spent inside does not count against the budget (an evaluation not charged to it)."""
        start = self._clock()
        try:
            yield
        finally:
            self._start += self._clock() - start

    def agree(self, received: str | None) -> str | None:
        """After every micro-batch: the stop signal to act on (`received`, this process's own). Several
        processes agree on one instead: AgreedClock."""
        return received

    def expired(self) -> bool:
        """The stop rule: stop once elapsed time exceeds the budget."""
        return self.elapsed() > self.budget_seconds

    def stop_reason(self, received: str | None) -> str | None:
        """Checked after every micro-batch: the stop signal received (by any rank: `agree`), else "budget" once
        it is spent, else None."""
        return self.agree(received) or ("budget" if self.expired() else None)

    def projected_finish(self) -> str:
        """Wall-clock time (UTC) at which the budget runs out."""
        remaining = max(0.0, self.budget_seconds - self.elapsed())
        return (dt.datetime.now(dt.timezone.utc) + dt.timedelta(seconds=remaining)).strftime("%H:%M:%S UTC")

    def describe(self) -> str:
        """e.g. '0.42h / 24.00h (1.8%), ends 13:05:12 UTC'"""
        return (
            f"{self.elapsed() / 3600:.2f}h / {self.budget_seconds / 3600:.2f}h ({100 * self.fraction():.1f}%),"
            f" ends {self.projected_finish()}"
        )


# stop signals as numbers, so the ranks can agree on one with a max-reduction; the larger one wins
SIGNAL_CODES = {"SIGTERM": 1, "SIGINT": 2}


class AgreedClock(BudgetClock):
    """The budget clock of a multi-process run: every reading is rank 0's elapsed time as agreed at the last
    `agree()` (collective: after every micro-batch). So all ranks take the same stop decision, accumulation
    count and learning rate, whatever their own clocks say."""

    def __init__(
        self,
        budget_hours: float,
        clock: Callable[[], float],
        elapsed_before: float = 0.0,
        *,
        is_main: bool,
        group: dist.ProcessGroup | None,
    ):
        super().__init__(budget_hours, clock, elapsed_before)
        self._is_main, self._group = is_main, group
        self._agreed = elapsed_before
        self.agree(None)  # start from one reading: the first periodic save comes at the same time everywhere

    def elapsed(self) -> float:
        return self._agreed

    def agree(self, received: str | None) -> str | None:
        """Take rank 0's elapsed time; returns the stop signal any rank received (SIGINT before SIGTERM)."""
        mine = super().elapsed() if self._is_main else 0.0
        values = torch.tensor([mine, SIGNAL_CODES.get(received, 0)], dtype=torch.float64)
        dist.all_reduce(values, op=dist.ReduceOp.MAX, group=self._group)
        self._agreed = values[0].item()
        code = int(values[1].item())
        return next((name for name, c in SIGNAL_CODES.items() if c == code), None)


def budget_clock(
    budget_hours: float, clock: Callable[[], float], elapsed_before: float = 0.0, ranks: Ranks | None = None
) -> BudgetClock:
    """The run's budget clock: this process's own, or, with several ranks (`ranks` active), rank 0's as they
    agree on it."""
    if ranks is None or not ranks.active:
        return BudgetClock(budget_hours, clock, elapsed_before)
    return AgreedClock(budget_hours, clock, elapsed_before, is_main=ranks.is_main, group=ranks.control)
