"""One optimizer update, written once: pretraining, fine-tuning, the micro-batch search and the benchmarks
all train through `TrainStep`.

    step.begin(lr_factor)              the update's learning rate (before backward: a layerwise optimizer
                                       steps inside it)
    with step.microbatch(last):        with accumulation: whether this is the update's last micro-batch
        with step.autocast():          forward in the compute dtype
            loss = ...
        step.backward(loss, scale)     scaled backward (fp16: the loss scaler), once per micro-batch
    step.apply(loss)                   the non-finite check, unscale, clip, optimizer step, zero-grad

`apply` skips the update, leaving the weights and the optimizer state untouched, when the loss or the
gradient norm is not finite: `clip_grad_norm_` would turn an inf gradient into NaN weights. Both checks share
the one host-device synchronization per update. A layerwise optimizer has updated (and clipped each
gradient) during backward already: for it a non-finite loss is counted but cannot be undone.
"""

from __future__ import annotations

import contextlib
import logging
import math
from collections.abc import Iterator
from dataclasses import asdict, dataclass

import torch
from torch import nn

from cramming.errors import ConfigError

log = logging.getLogger("cramming")


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


@dataclass
class StepStats:
    """Updates applied and skipped; `skipped_in_a_row` resets at every applied update."""

    applied: int = 0
    skipped: int = 0
    skipped_in_a_row: int = 0

    @property
    def updates(self) -> int:
        """Updates finished, applied or skipped: the clock of a steps-* schedule."""
        return self.applied + self.skipped


class TrainStep:
    def __init__(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        *,
        device_type: str,
        dtype: torch.dtype,
        grad_clip: float | None,
    ):
        """model: the plain module whose parameters the optimizer updates; dtype: the autocast dtype (fp32:
        no autocast; fp16: with a loss scaler)."""
        self.model, self.optimizer = model, optimizer
        self.device_type, self.dtype, self.grad_clip = device_type, dtype, grad_clip
        self.scaler = torch.amp.GradScaler(device_type, enabled=dtype == torch.float16)
        self.layerwise = bool(getattr(optimizer, "layerwise", False))
        check_layerwise_loop(optimizer, grad_scaler=self.scaler.is_enabled())
        for group in optimizer.param_groups:
            group.setdefault("peak_lr", group["lr"])  # lr_factor multiplies this
        self.stats = StepStats()

    def begin(self, lr_factor: float = 1.0) -> None:
        """Start an update at `lr_factor` times each group's peak rate."""
        for group in self.optimizer.param_groups:
            group["lr"] = group["peak_lr"] * lr_factor

    @contextlib.contextmanager
    def microbatch(self, last: bool) -> Iterator[None]:
        """Around one micro-batch's forward and backward when an update accumulates several: a layerwise
        optimizer steps in the backward of the `last` one only (the others add to the gradients)."""
        if self.layerwise:
            self.optimizer.accumulating = not last
        try:
            yield
        finally:
            if self.layerwise:
                self.optimizer.accumulating = False

    def autocast(self) -> contextlib.AbstractContextManager:
        return autocast(self.device_type, self.dtype)

    def backward(self, loss: torch.Tensor, scale: float = 1.0) -> None:
        """Accumulate the gradient of `loss * scale` (1 / micro-batches per update when accumulating)."""
        self.scaler.scale(loss * scale).backward()

    def apply(self, loss: torch.Tensor) -> bool:
        """Finish the update whose mean micro-batch loss is `loss`: True when applied, False when skipped."""
        norm = self._unscale_and_clip()
        finite = torch.isfinite(loss) if norm is None else torch.isfinite(loss) & torch.isfinite(norm)
        if not finite.item():  # the one host-device synchronization per update
            self.skip(overflow=self.scaler.is_enabled() and bool(torch.isfinite(loss).item()))
            return False
        self.scaler.step(self.optimizer)
        self.scaler.update()
        self.optimizer.zero_grad(set_to_none=True)
        self.stats.applied += 1
        self.stats.skipped_in_a_row = 0
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

    def skip(self, overflow: bool = False) -> None:
        """Drop the accumulated gradients. An fp16 overflow (finite loss, inf gradient) is the loss scaler's
        normal calibration: the scale is lowered and it does not count towards divergence."""
        self.optimizer.zero_grad(set_to_none=True)
        if self.scaler.is_enabled():
            self.scaler.update(self.scaler.get_scale() * self.scaler.get_backoff_factor())
        self.stats.skipped += 1
        if not overflow:
            self.stats.skipped_in_a_row += 1

    def state_dict(self) -> dict:
        return {"scaler": self.scaler.state_dict(), "stats": asdict(self.stats)}

    def load_state_dict(self, state: dict) -> None:
        self.scaler.load_state_dict(state["scaler"])
        self.stats = StepStats(**state.get("stats", {}))
