"""Optimizer-state memory, logged at start-up: bytes per parameter and in total, against fp32 AdamW.

Counted before the first step from what each optimizer will allocate (our optimizers predict it exactly,
torch's Adam/AdamW hold two moments in the parameter's dtype), and from the real state tensors once they
exist. The `step` counters are left out.
"""

from __future__ import annotations

import math

import torch

from cramming.optim.base import LeanOptimizer

ADAMW_FP32_BYTES = 8  # two fp32 moments per parameter


def _state_bytes(optimizer: torch.optim.Optimizer, param: torch.Tensor, group: dict) -> int | None:
    state = optimizer.state.get(param)
    if state:
        return sum(
            v.numel() * v.element_size() for k, v in state.items() if torch.is_tensor(v) and k != "step"
        )
    if isinstance(optimizer, LeanOptimizer):
        return sum(
            math.prod(shape) * dtype.itemsize for shape, dtype in optimizer.state_spec(param, group).values()
        )
    if isinstance(optimizer, (torch.optim.Adam, torch.optim.AdamW)):
        return 2 * param.numel() * param.element_size()
    return None  # unknown before the first step


def optimizer_state_report(optimizer: torch.optim.Optimizer) -> dict:
    """Totals over all parameters, and over the GaLore-projected ones (rank > 0) alone.

    Keys: params, state_bytes, bytes_per_param, adamw_fp32_bytes, ratio_to_adamw_fp32 (and the same with a
    `projected_` prefix). state_bytes is None when an optimizer of another kind has no state yet.
    """
    totals = {"params": 0, "state_bytes": 0, "projected_params": 0, "projected_state_bytes": 0}
    for group in optimizer.param_groups:
        projected = group.get("rank", 0) > 0
        for param in group["params"]:
            nbytes = _state_bytes(optimizer, param, group)
            totals["params"] += param.numel()
            totals["state_bytes"] = (
                None if nbytes is None or totals["state_bytes"] is None else totals["state_bytes"] + nbytes
            )
            if projected:
                totals["projected_params"] += param.numel()
                totals["projected_state_bytes"] += nbytes
    report = dict(totals)
    for prefix in ("", "projected_"):
        params, nbytes = totals[f"{prefix}params"], totals[f"{prefix}state_bytes"]
        report[f"{prefix}adamw_fp32_bytes"] = ADAMW_FP32_BYTES * params
        known = nbytes is not None and params > 0
        report[f"{prefix}bytes_per_param"] = nbytes / params if known else None
        report[f"{prefix}ratio_to_adamw_fp32"] = nbytes / (ADAMW_FP32_BYTES * params) if known else None
    return report


def format_state_report(report: dict) -> str:
    """One log line, e.g. 'optimizer state: 231.5 MiB for 119.6M parameters, 2.03 B/param (25.4% of fp32 AdamW's 912.4 MiB)'."""
    mib = 2.0**20
    if report["state_bytes"] is None:
        return f"optimizer state: unknown before the first step, for {report['params'] / 1e6:.1f}M parameters"
    line = (
        f"optimizer state: {report['state_bytes'] / mib:.1f} MiB for {report['params'] / 1e6:.1f}M parameters, "
        f"{report['bytes_per_param']:.2f} B/param ({100 * report['ratio_to_adamw_fp32']:.1f}% of fp32 AdamW's "
        f"{report['adamw_fp32_bytes'] / mib:.1f} MiB)"
    )
    if report["projected_params"]:
        line += (
            f"; GaLore-projected weights ({report['projected_params'] / 1e6:.1f}M): "
            f"{report['projected_bytes_per_param']:.2f} B/param ({100 * report['projected_ratio_to_adamw_fp32']:.1f}%)"
        )
    return line
