"""Layerwise updates with several processes: each gradient averaged over the ranks, then stepped at once.

DDP would reduce the gradients in buckets and write them back after the whole backward, into buffers as big
as the model's gradients: a layerwise optimizer could only step then, holding them all. So under DDP mode a
layerwise optimizer replaces DDP (the loop does not wrap the model, see cramming.train.parallel.Parallel.wrap):
`GradientReducer` all-reduces each parameter's gradient from inside its post-accumulate-grad hook
(asynchronously, at most `window` in flight) and hands it to the optimizer's step as soon as the reduction
has completed; the step frees the gradient. At most the gradients being reduced, plus those waiting for
their turn, are held at any time.

Every rank must launch the same all-reduces in the same order. The order is fixed up front: the reverse of
the model's parameter order (as DDP's buckets), which for a model whose parameters are registered in
forward order is the order in which backward produces them. A gradient that comes early waits until those
before it in that order are ready (more memory for a while, never a wrong pairing).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist

from cramming.errors import ConfigError


class GradientReducer:
    """Averages the gradients of `params` (in the model's order) over `group` (all-reduce, then / world
    size), one parameter at a time in the reverse of that order on every rank, and calls `step(param)` for each once its `param.grad` is the
    average. Drive it with `ready(param)` from each gradient hook, then `finish()` after backward."""

    def __init__(
        self,
        params: Sequence[torch.Tensor],
        step: Callable[[torch.Tensor], None],
        group: dist.ProcessGroup,
        window: int = 4,
    ) -> None:
        self.order = list(reversed(params))  # backward's, for parameters registered in forward order
        self.position = {id(p): i for i, p in enumerate(self.order)}
        self.step, self.group, self.window = step, group, window
        self.world_size = dist.get_world_size(group)
        self._next = 0  # position of the next parameter to launch
        self._waiting: dict[int, torch.Tensor] = {}  # ready, not yet launched: position -> parameter
        self._in_flight: deque[tuple[torch.Tensor, dist.Work]] = deque()

    def ready(self, param: torch.Tensor) -> None:
        """`param.grad` is complete on this rank: launch every all-reduce whose turn has come, and step the
        parameters whose reductions have completed (waiting for the oldest when `window` are in flight)."""
        self._waiting[self.position[id(param)]] = param
        while self._next in self._waiting:
            launch = self._waiting.pop(self._next)
            self._next += 1
            work = dist.all_reduce(launch.grad, group=self.group, async_op=True)
            self._in_flight.append((launch, work))
        self._drain(wait_for_all=False)

    def finish(self) -> None:
        """After backward: wait for the reductions in flight and step their parameters. Collective."""
        if self._waiting or 0 < self._next < len(self.order):
            missing = [i for i in range(self._next, len(self.order)) if i not in self._waiting]
            shapes = [tuple(self.order[i].shape) for i in missing[:4]]
            raise ConfigError(
                f"{len(missing)} parameter(s) (shapes {shapes}...) got no gradient in this backward: a layerwise "
                "optimizer with several processes reduces every parameter's gradient in a fixed order, so all "
                "must take part in the loss. Freeze unused parameters (requires_grad=False), or use the "
                "optimizer name without `_layerwise`"
            )
        self._drain(wait_for_all=True)
        self._next = 0

    def _drain(self, wait_for_all: bool) -> None:
        while self._in_flight and (
            wait_for_all or len(self._in_flight) > self.window or self._in_flight[0][1].is_completed()
        ):
            param, work = self._in_flight.popleft()
            work.wait()
            param.grad.div_(self.world_size)
            self.step(param)
