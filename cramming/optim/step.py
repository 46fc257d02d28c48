"""One optimizer update, written once: pretraining, fine-tuning, the micro-batch search and the benchmarks all
train through `TrainStep`, which owns the update from its learning rate to its counter.

    step.begin(lr_factor, microbatches)   the update's learning rate (before backward: a layerwise optimizer
                                          steps inside it) and a snapshot of the random streams
    step.microbatch(forward, *args)       once per micro-batch: forward(*args) under autocast returns (loss,
                                          *counts); its loss / microbatches goes backward (fp16: through the
                                          loss scaler), gradients reduced over the ranks on the last one only
    step.apply()                          the non-finite check, unscale, clip, optimizer step, zero-grad, count
    step.discard()                        instead of apply: an update cut short (a stop signal, the budget) is
                                          dropped, its gradients zeroed and the random streams rewound

`apply` skips the update, leaving the weights and the optimizer state untouched, when the loss or the
gradient norm is not finite: `clip_grad_norm_` would turn an inf gradient into NaN weights. Both checks share
the one host-device synchronization per update. A layerwise optimizer has updated (and clipped each
gradient) during backward already: for it a non-finite loss is counted but cannot be undone.

The random streams (torch's, Python's, NumPy's) are the step's too: captured in one place (rng_state), saved
with its state, rewound by discard(), and kept as they were around work that must not shift them
(preserved_rng: an evaluation during pretraining).

Several processes meet here only through two callables handed in (cramming.train.parallel's): `grad_sync(last)`
around a micro-batch's forward and backward, and `reduce(loss_sum, *counts)` over the ranks before the
non-finite check, so that every rank skips together. cramming.optim imports nothing above it.
"""

from __future__ import annotations

import contextlib
import logging
import math
import random
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from cramming.errors import ConfigError, TrainingDiverged
from cramming.optim.average import WeightAverage

log = logging.getLogger("cramming")

Forward = Callable[
    ..., Sequence[torch.Tensor]
]  # (*args) -> (loss, *counts), counts summed over micro-batches


def autocast(device_type: str, dtype: torch.dtype) -> contextlib.AbstractContextManager:
    """Forward in the compute dtype `dtype` on `device_type`; fp32 runs without autocast."""
    return torch.autocast(device_type, dtype=dtype, enabled=dtype != torch.float32)


def check_layerwise_loop(optimizer: torch.optim.Optimizer, *, grad_scaler: bool) -> None:
    """Start-up check the training step makes once: raises ConfigError when a layerwise optimizer cannot do
    its job (gradient accumulation, DDP and FSDP2 all work: cramming.optim.base's docstring)."""
    if getattr(optimizer, "layerwise", False) and grad_scaler:
        raise ConfigError(
            "`*_layerwise` optimizers see the gradients before a GradScaler could unscale them: use bf16 or "
            "fp32 (impl.precision), not fp16, or the name without `_layerwise`"
        )


# ------------------------------------------------------------------------------------- the random streams


def rng_state() -> dict:
    """Every random stream a run may draw from: torch's (the CPU's and every GPU's: dropout), Python's and
    NumPy's global ones, in plain containers of tensors and numbers (a resumable state loads it back with
    torch.load(weights_only=True))."""
    _, keys, pos, has_gauss, gauss = np.random.get_state()
    return {
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else [],
        "python": random.getstate(),
        "numpy": {
            "keys": torch.from_numpy(keys.astype(np.int64)),
            "pos": int(pos),
            "has_gauss": int(has_gauss),
            "gauss": float(gauss),
        },
    }


def set_rng_state(state: dict) -> None:
    """Restore what rng_state captured (a state saved before Python's and NumPy's streams were kept restores
    torch's alone)."""
    torch.set_rng_state(state["torch"])
    if state["cuda"] and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
    if "python" in state:
        random.setstate(state["python"])
    if "numpy" in state:
        saved = state["numpy"]
        keys = saved["keys"].numpy().astype(np.uint32)
        np.random.set_state(("MT19937", keys, saved["pos"], saved["has_gauss"], saved["gauss"]))


@contextlib.contextmanager
def preserved_rng() -> Iterator[None]:
    """Whatever the block draws or seeds, the random streams continue afterwards as if it had not run (an
    evaluation during pretraining, the micro-batch search)."""
    state = rng_state()
    try:
        yield
    finally:
        set_rng_state(state)


# ----------------------------------------------------------------------------------------------- the update


@dataclass
class StepStats:
    """The one count of updates: every update that ran all its micro-batches, applied or skipped for a
    non-finite loss or gradient (so it is the clock of a steps-* schedule, in pretraining and fine-tuning
    alike); `skipped_in_a_row` resets at every applied update."""

    updates: int = 0
    skipped: int = 0
    skipped_in_a_row: int = 0

    @property
    def applied(self) -> int:
        return self.updates - self.skipped


@dataclass
class Update:
    """What `apply` did: applied or skipped, the mean loss over the update's micro-batches (and ranks) and its
    summed counts, still on the device."""

    applied: bool
    loss: torch.Tensor
    counts: list[torch.Tensor]


class TrainStep:
    def __init__(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer | None,
        *,
        device_type: str,
        dtype: torch.dtype,
        grad_clip: float | None,
        grad_sync: Callable[[bool], contextlib.AbstractContextManager] | None = None,
        reduce: Callable[..., list[torch.Tensor]] | None = None,
        max_skipped_in_a_row: int | None = None,
        average: WeightAverage | None = None,
    ):
        """model: the plain module whose parameters the optimizer updates; optimizer None: forward and
        backward only (the micro-batch search measures them, and never applies). dtype: the autocast dtype
        (fp32: no autocast; fp16: with a loss scaler). grad_sync, reduce: across ranks (identity when None).
        max_skipped_in_a_row: non-finite updates in a row that end training (TrainingDiverged); None: no limit.
        average: a weight average moved after every applied update (cramming.optim.average)."""
        self.model, self.optimizer = model, optimizer
        self.device_type, self.dtype, self.grad_clip = device_type, dtype, grad_clip
        self.grad_sync = grad_sync or (lambda last: contextlib.nullcontext())
        self.reduce = reduce or (lambda *sums: list(sums))
        self.max_skipped_in_a_row, self.average = max_skipped_in_a_row, average
        self.scaler = torch.amp.GradScaler(device_type, enabled=dtype == torch.float16)
        self.layerwise = bool(getattr(optimizer, "layerwise", False))
        if optimizer is not None:
            check_layerwise_loop(optimizer, grad_scaler=self.scaler.is_enabled())
            for group in optimizer.param_groups:
                group.setdefault("peak_lr", group["lr"])  # lr_factor multiplies this
        self.stats = StepStats()
        self._microbatches, self._done, self._sums, self._rng = 1, 0, None, None

    # --- one update --------------------------------------------------------------------------------------

    def begin(self, lr_factor: float = 1.0, microbatches: int = 1) -> None:
        """Start an update of `microbatches` micro-batches at `lr_factor` times each group's peak rate."""
        if self.optimizer is not None:
            for group in self.optimizer.param_groups:
                group["lr"] = group["peak_lr"] * lr_factor
        self._microbatches, self._done, self._sums = microbatches, 0, None
        self._rng = rng_state()  # dropout draws from it: discard() rewinds a dropped update's draws

    @property
    def complete(self) -> bool:
        """Whether every micro-batch of the update has run."""
        return self._done >= self._microbatches

    def microbatch(self, forward: Forward, *args) -> None:
        """One micro-batch: forward(*args) under autocast, then backward of its loss / microbatches. Gradients
        add up; across ranks they are reduced on the update's last micro-batch only, and a layerwise optimizer
        steps in that one's backward."""
        if self.complete:
            raise RuntimeError("every micro-batch of this update ran: apply() or discard() it first")
        last = self._done + 1 == self._microbatches
        with self.grad_sync(last), self._layerwise_accumulating(not last):  # around forward and backward
            with self.autocast():
                outputs = forward(*args)
            self.backward(outputs[0], 1.0 / self._microbatches)
        detached = [value.detach() for value in outputs]
        self._sums = (
            detached if self._sums is None else [a + b for a, b in zip(self._sums, detached, strict=True)]
        )
        self._done += 1

    def apply(self) -> Update:
        """Finish the update: applied when its mean loss and its gradient are finite, else skipped (the weights
        and optimizer state untouched; TrainingDiverged after max_skipped_in_a_row in a row)."""
        if self.optimizer is None or not self.complete:
            raise RuntimeError("apply() needs an optimizer and every micro-batch of the update")
        loss_sum, *counts = self.reduce(*self._sums)
        loss = loss_sum / self._microbatches
        self._sums = None
        self.stats.updates += 1
        if self._step(loss):
            self.stats.skipped_in_a_row = 0
            return Update(True, loss, counts)
        self._check_divergence()
        return Update(False, loss, counts)

    def discard(self) -> None:
        """Drop an update cut short: its gradients zeroed, the random streams back where begin() found them,
        nothing counted. A resumed run then trains its rows again with the same dropout draws."""
        self._zero_grad()
        if self._rng is not None:
            set_rng_state(self._rng)
        self._done, self._sums = self._microbatches, None

    # --- its parts ---------------------------------------------------------------------------------------

    def autocast(self) -> contextlib.AbstractContextManager:
        return autocast(self.device_type, self.dtype)

    def backward(self, loss: torch.Tensor, scale: float = 1.0) -> None:
        """Accumulate the gradient of `loss * scale`."""
        self.scaler.scale(loss * scale).backward()

    @contextlib.contextmanager
    def _layerwise_accumulating(self, accumulating: bool) -> Iterator[None]:
        """A layerwise optimizer steps in backward: not while the update's gradients still add up."""
        if self.layerwise:
            self.optimizer.accumulating = accumulating
        try:
            yield
        finally:
            if self.layerwise:
                self.optimizer.accumulating = False

    def _step(self, loss: torch.Tensor) -> bool:
        """The optimizer step when loss and gradient norm are finite (True); else the gradients are dropped."""
        norm = self._unscale_and_clip()
        finite = torch.isfinite(loss) if norm is None else torch.isfinite(loss) & torch.isfinite(norm)
        if not finite.item():  # the one host-device synchronization per update
            self._skip(overflow=self.scaler.is_enabled() and bool(torch.isfinite(loss).item()))
            return False
        self.scaler.step(self.optimizer)
        self.scaler.update()
        self._zero_grad()
        if self.average is not None:
            self.average.update()
        return True

    def _unscale_and_clip(self) -> torch.Tensor | None:
        """The global gradient norm (after clipping to grad_clip, when set); None for layerwise optimizers."""
        if self.layerwise:
            return None
        self.scaler.unscale_(self.optimizer)
        if self.grad_clip is not None:
            return nn.utils.clip_grad_norm_(self.model.parameters(), self.grad_clip)
        # no clipping: only the norm (for the non-finite check). clip_grad_norm_ with an infinite limit would
        # still multiply every gradient by its clamped coefficient of 1.
        if hasattr(nn.utils, "get_total_norm"):  # torch >= 2.6
            return nn.utils.get_total_norm([p.grad for p in self.model.parameters() if p.grad is not None])
        return nn.utils.clip_grad_norm_(self.model.parameters(), math.inf)

    def _skip(self, overflow: bool) -> None:
        """Drop the accumulated gradients. An fp16 overflow (finite loss, inf gradient) is the loss scaler's
        normal calibration: the scale is lowered and it does not count towards divergence."""
        self._zero_grad()
        if self.scaler.is_enabled():
            self.scaler.update(self.scaler.get_scale() * self.scaler.get_backoff_factor())
        self.stats.skipped += 1
        if not overflow:
            self.stats.skipped_in_a_row += 1
            log.warning(
                "non-finite loss or gradient at update %d: update skipped (%d in a row)",
                self.stats.updates,
                self.stats.skipped_in_a_row,
            )

    def _check_divergence(self) -> None:
        limit, in_a_row = self.max_skipped_in_a_row, self.stats.skipped_in_a_row
        if limit is not None and in_a_row >= limit:
            raise TrainingDiverged(
                f"the loss was non-finite for {in_a_row} updates in a row at update {self.stats.updates}:"
                " training diverged. Lower train.optim.lr, keep train.grad_clip on, or use"
                " impl.precision=bf16/fp32; resume=true restarts from the last saved state."
            )

    def _zero_grad(self) -> None:
        if self.optimizer is not None:
            self.optimizer.zero_grad(set_to_none=True)
        else:
            self.model.zero_grad(set_to_none=True)

    def use_average(self) -> None:
        """The weights a run ends with: the average, when the step keeps one (the model's own otherwise)."""
        if self.average is not None:
            self.average.copy_to_model()

    # --- saved with a resumable state --------------------------------------------------------------------

    def state_dict(self) -> dict:
        """The loss scaler, the counter and the random streams as they are now: between updates, where a
        resumed run continues (a discarded update has rewound them)."""
        state = {"scaler": self.scaler.state_dict(), "stats": vars(self.stats).copy(), "rng": rng_state()}
        return state | ({"average": self.average.state_dict()} if self.average is not None else {})

    def load_state_dict(self, state: dict) -> None:
        """A state saved by this version, or one of before the one counter (which counted the applied and the
        skipped updates apart) and before the random streams were the step's."""
        self.scaler.load_state_dict(state["scaler"])
        if "rng" in state:
            set_rng_state(state["rng"])
        if (self.average is None) != ("average" not in state):
            raise ConfigError(
                "resume: the saved run " + ("averaged" if "average" in state else "did not average")
                + " its weights and this one " + ("does not" if self.average is None else "does")
                + ": resume with the saved run's train.average, or start afresh with resume=false"
            )  # fmt: skip
        if self.average is not None:
            self.average.load_state_dict(state["average"])
        stats = dict(state.get("stats", {}))
        if "updates" not in stats:
            stats["updates"] = stats.pop("applied", 0) + stats.get("skipped", 0)
        self.stats = StepStats(**stats)
