"""The budget: how much of it is spent, and the stop rule, on one of two clocks (train.clock).

wall (BudgetClock, the default and the real run's): seconds as they pass. The clock starts when training set-up
begins, after the data is prepared: model construction, compilation and data loading count against the budget,
preprocessing does not. Several processes (torchrun) keep one budget: their clocks agree on rank 0's elapsed
time after every micro-batch (`AgreedClock`), so they stop after the same micro-batch and read the same budget
fraction.

reference (ReferenceClock, for comparing recipes): every micro-batch and every update is charged what it cost
on one reference machine (cramming.calibration), and the set-up once, whatever this machine's speed or load.
A budget then buys the same updates on any machine and beside any other job, and the run is replayable.

Either way a resumed run starts from the elapsed time saved in its state, so the budget keeps counting across
interruptions (the downtime itself is free).
"""

from __future__ import annotations

import datetime as dt
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.distributed as dist

from cramming.ranks import Ranks

CLOCKS = ("wall", "reference")


@dataclass(frozen=True)
class Costs:
    """What the reference clock charges, in seconds of the reference machine (cramming.calibration)."""

    setup: float  # once, at a run's first start: building the model and optimizer, compilation
    microbatch: float  # each micro-batch: masking, forward, backward
    update: float  # each completed update: unscale, clip, optimizer step


class BudgetClock:
    kind = "wall"

    def __init__(
        self, budget_hours: float, clock: Callable[[], float] = time.monotonic, elapsed_before: float = 0.0
    ):
        """clock: seconds from an arbitrary origin (injectable for tests); elapsed_before: seconds already
        spent by earlier, interrupted parts of this run."""
        self.budget_seconds = budget_hours * 3600.0
        self._clock = clock
        self._start = self._wall_start = clock()
        self._elapsed_before = elapsed_before

    def elapsed(self) -> float:
        """Seconds of budget spent."""
        return self._elapsed_before + self._clock() - self._start

    def wall_elapsed(self) -> float:
        """Wall seconds this process has taken since its clock started (evaluations included)."""
        return self._clock() - self._wall_start

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

    def after_microbatch(self, received: str | None, completes_update: bool) -> str | None:
        """After every micro-batch (`completes_update`: the last of its update): the stop reason. The wall clock
        has measured the micro-batch already; the reference clock charges it here."""
        return self.stop_reason(received)

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

    def about(self) -> str:
        """Which clock counts the budget, for the log."""
        return "budget on the wall clock"

    def record(self) -> dict:
        """Which clock counts the budget, for the run card."""
        return {"clock": self.kind}

    def figures(self) -> dict[str, float]:
        """What a metrics record says of the clock: budget hours spent and the share of the budget."""
        return {"elapsed_h": self.elapsed() / 3600, "budget_fraction": self.fraction()}


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


class ReferenceClock(BudgetClock):
    """Budget time as the reference machine would have spent it: the set-up once (at a run's first start, not
    on a resume), then every micro-batch and every completed update at its calibrated cost (`costs`). Nothing
    that this machine's clock measures is charged, so the same recipe stops after the same update here, on any
    other machine and beside any other job. The wall time taken is kept beside it for the logs; `source`
    names the calibration (file, hash, reference machine). Several ranks charge alike and agree on stop
    signals only."""

    kind = "reference"

    def __init__(
        self,
        budget_hours: float,
        costs: Costs,
        clock: Callable[[], float] = time.monotonic,
        elapsed_before: float = 0.0,
        *,
        fresh: bool,
        source: dict,
        group: dist.ProcessGroup | None = None,
    ):
        super().__init__(budget_hours, clock, elapsed_before)
        self.costs, self.source, self._group = costs, source, group
        self._spent = elapsed_before + (costs.setup if fresh else 0.0)

    def elapsed(self) -> float:
        return self._spent

    def after_microbatch(self, received: str | None, completes_update: bool) -> str | None:
        self._spent += self.costs.microbatch + (self.costs.update if completes_update else 0.0)
        return self.stop_reason(received)

    @contextmanager
    def paused(self) -> Iterator[None]:
        """Nothing measured is charged on this clock: an evaluation costs no budget either way."""
        yield

    def agree(self, received: str | None) -> str | None:
        """The stop signal any rank received (SIGINT before SIGTERM); the charges need no agreement."""
        if self._group is None:
            return received
        code = torch.tensor([SIGNAL_CODES.get(received, 0)], dtype=torch.float64)
        dist.all_reduce(code, op=dist.ReduceOp.MAX, group=self._group)
        return next((name for name, c in SIGNAL_CODES.items() if c == int(code.item())), None)

    def projected_finish(self) -> str:
        """When the budget runs out at the pace of reference seconds per wall second seen so far."""
        charged_here = self._spent - self._elapsed_before
        pace = self.wall_elapsed() / charged_here if charged_here > 0 else 1.0
        remaining = max(0.0, self.budget_seconds - self._spent) * pace
        return (dt.datetime.now(dt.timezone.utc) + dt.timedelta(seconds=remaining)).strftime("%H:%M:%S UTC")

    def describe(self) -> str:
        """e.g. '0.42h / 1.00h reference (42.0%), 0.51h wall, ends 13:05:12 UTC'"""
        return (
            f"{self._spent / 3600:.2f}h / {self.budget_seconds / 3600:.2f}h reference"
            f" ({100 * self.fraction():.1f}%), {self.wall_elapsed() / 3600:.2f}h wall, ends"
            f" {self.projected_finish()}"
        )

    def about(self) -> str:
        s = self.source
        return (
            f"budget on the reference clock: {s['calibration']} (sha256 {s['sha256'][:12]}, measured on"
            f" {s['machine']}{' with ' + s['gpu'] if s.get('gpu') else ''}) charges {self.costs.microbatch:.4g} s"
            f" a micro-batch, {self.costs.update:.4g} s an update and {self.costs.setup:.3g} s of set-up"
        )

    def record(self) -> dict:
        return {"clock": self.kind, **self.source, "costs": vars(self.costs).copy()}

    def figures(self) -> dict[str, float]:
        return super().figures() | {"wall_h": self.wall_elapsed() / 3600}


def budget_clock(
    budget_hours: float,
    clock: Callable[[], float],
    elapsed_before: float = 0.0,
    ranks: Ranks | None = None,
    reference: tuple[Costs, dict] | None = None,
    fresh: bool = True,
) -> BudgetClock:
    """The run's budget clock: with `reference` (its calibrated costs and their source), the reference clock;
    else the wall clock, this process's own, or with several ranks (`ranks` active) rank 0's as they agree on
    it. fresh: a first start (the reference clock charges the set-up then only)."""
    group = ranks.control if ranks is not None and ranks.active else None
    if reference is not None:
        costs, source = reference
        return ReferenceClock(
            budget_hours, costs, clock, elapsed_before, fresh=fresh, source=source, group=group
        )
    if group is None:
        return BudgetClock(budget_hours, clock, elapsed_before)
    return AgreedClock(budget_hours, clock, elapsed_before, is_main=ranks.is_main, group=group)
