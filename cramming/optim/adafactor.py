"""Adafactor with an explicit learning rate, optionally GaLore-projected (`galore_adafactor`).

Shazeer & Stern, "Adafactor: Adaptive Learning Rates with Sublinear Memory Cost" (arXiv 1804.04235), in the
form Hugging Face uses for `galore_adafactor` (relative_step=False, scale_parameter=False, no first moment):
    beta2_t = 1 - t^-0.8
    2-D g (m×n):  R = beta2_t R + (1 - beta2_t) mean_n(g² + 1e-30)            (m,)
                  C = beta2_t C + (1 - beta2_t) mean_m(g² + 1e-30)            (n,)
                  u = g / sqrt(R Cᵀ / mean(R))
    other g:      V = beta2_t V + (1 - beta2_t)(g² + 1e-30);   u = g / sqrt(V)
    u = u / max(1, rms(u) / clip_threshold);   p = p (1 - lr wd) - lr u
For a GaLore group g is the low-rank gradient, so R and C are the sizes of its two sides.
Under FSDP2 a rank holding rows of g keeps R for its rows and the whole C: C, mean(R) and rms(u) sum over
every rank's rows (all-reduce), so the update is one process's up to summation order.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch

from cramming.optim.base import LeanOptimizer, RowShard, StateSpec

EPS_SQUARED = 1e-30  # added to g² so that a zero gradient does not divide by zero


class Adafactor(LeanOptimizer):
    def __init__(
        self,
        params: Iterable,
        lr: float = 1e-3,
        weight_decay: float = 0.0,
        *,
        decay_rate: float = -0.8,
        clip_threshold: float = 1.0,
        layerwise: bool = False,
        max_grad_norm: float | None = None,
        reduce_group: torch.distributed.ProcessGroup | None = None,
        reduce_order: Iterable[torch.Tensor] = (),
    ) -> None:
        defaults = {
            "lr": lr,
            "weight_decay": weight_decay,
            "decay_rate": decay_rate,
            "clip_threshold": clip_threshold,
        }
        super().__init__(
            params,
            defaults,
            layerwise=layerwise,
            max_grad_norm=max_grad_norm,
            reduce_group=reduce_group,
            reduce_order=reduce_order,
        )

    def _moment_specs(self, shape: tuple[int, ...], group: dict, whole_numel: int | None = None) -> StateSpec:
        if len(shape) == 2:
            return {
                "exp_avg_sq_row": ((shape[0],), torch.float32),
                "exp_avg_sq_col": ((shape[1],), torch.float32),
            }
        return {"exp_avg_sq": (shape, torch.float32)}

    # a row shard's column statistics, row-statistic mean and update RMS are sums over every rank's rows
    reduces_over_rows = True

    def _direction(
        self, grad: torch.Tensor, state: dict, group: dict, step: int, rows: RowShard | None = None
    ) -> torch.Tensor:
        grad = grad.float()
        beta2 = 1.0 - step ** group["decay_rate"]
        g2 = grad.square().add_(EPS_SQUARED)
        if "exp_avg_sq_row" in state:
            row, col = state["exp_avg_sq_row"], state["exp_avg_sq_col"]
            row.mul_(beta2).add_(g2.mean(dim=1), alpha=1.0 - beta2)  # (m,)
            col.mul_(beta2).add_(_mean(g2, rows, dim=0), alpha=1.0 - beta2)  # (n,)
            update = grad * (row / _mean(row, rows)).rsqrt()[:, None] * col.rsqrt()[None, :]
        else:
            sq = state["exp_avg_sq"]
            sq.mul_(beta2).add_(g2, alpha=1.0 - beta2)
            update = grad * sq.rsqrt()
        rms = _mean(update.square(), rows).sqrt()
        return update.div_((rms / group["clip_threshold"]).clamp(min=1.0))


def _mean(tensor: torch.Tensor, rows: RowShard | None, dim: int | None = None) -> torch.Tensor:
    """The mean over dim 0 (`dim=0`) or over all elements of the whole tensor of which `tensor` holds `rows`
    (a sum over the ranks); torch's own mean when `tensor` is whole."""
    if rows is None:
        return tensor.mean() if dim is None else tensor.mean(dim=dim)
    total = rows.sum_(tensor.sum() if dim is None else tensor.sum(dim=dim))
    per_row = math.prod(tensor.shape[1:]) if dim is None else 1  # elements a row adds to the mean
    return total / (rows.whole_rows * per_row)
