"""The wall-clock budget: how much of it is spent, and the stop rule.

The clock starts when training set-up begins, after the data is prepared: model construction, compilation
and data loading count against the budget, preprocessing does not. A resumed run starts from the elapsed
time saved in its state, so the budget keeps counting across interruptions (the downtime itself is free).
"""

from __future__ import annotations

import datetime as dt
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager


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

    def expired(self) -> bool:
        """The stop rule, checked after every micro-batch: stop once elapsed time exceeds the budget."""
        return self.elapsed() > self.budget_seconds

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
