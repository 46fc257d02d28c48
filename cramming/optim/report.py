"""Optimizer-state memory, logged at start-up: bytes per parameter and in total, against fp32 AdamW.

Counted before the first step from what each optimizer will allocate (our optimizers predict it exactly,
torch's Adam/AdamW hold two moments in the parameter's dtype), and from the real state tensors once they
exist. The `step` counters are left out.

Under FSDP2 the parameters are DTensor shards and everything is counted per rank: the rank's share of the
parameters and the state it holds (its local tensors), so bytes/param and the ratio to fp32 AdamW are the
rank's own. Under DDP every rank holds the whole state; format_state_report says so.
"""

from __future__ import annotations

import math

import torch

from cramming.optim.base import LeanOptimizer, is_sharded, local_part

ADAMW_FP32_BYTES = 8  # two fp32 moments per parameter


def _tensor_bytes(tensor: torch.Tensor) -> int:
    """Bytes this process holds of `tensor` (a DTensor's local shard: torch's AdamW under FSDP2)."""
    local = local_part(tensor)
    return local.numel() * local.element_size()


def _state_bytes(optimizer: torch.optim.Optimizer, param: torch.Tensor, group: dict) -> int | None:
    """This process's state bytes of `param`: measured when the state exists, else predicted."""
    state = optimizer.state.get(param)
    if state:
        return sum(_tensor_bytes(v) for k, v in state.items() if torch.is_tensor(v) and k != "step")
    if isinstance(optimizer, LeanOptimizer):
        return sum(
            math.prod(shape) * dtype.itemsize for shape, dtype in optimizer.state_spec(param, group).values()
        )
    if isinstance(optimizer, (torch.optim.Adam, torch.optim.AdamW)):
        return 2 * _tensor_bytes(param)
    return None  # unknown before the first step


def optimizer_state_report(optimizer: torch.optim.Optimizer) -> dict:
    """Totals over all parameters, and over the GaLore-projected ones (rank > 0) alone.

    Keys: params, state_bytes, bytes_per_param, adamw_fp32_bytes, ratio_to_adamw_fp32 (and the same with a
    `projected_` prefix). state_bytes is None when an optimizer of another kind has no state yet.
    sharded: whether the parameters are FSDP2 shards; then params and state_bytes are this rank's, and
    whole_params counts the whole model's parameters.
    """
    totals = {"params": 0, "state_bytes": 0, "projected_params": 0, "projected_state_bytes": 0}
    whole_params, sharded = 0, False
    for group in optimizer.param_groups:
        projected = group.get("rank", 0) > 0
        for param in group["params"]:
            nbytes = _state_bytes(optimizer, param, group)
            sharded = sharded or is_sharded(param)
            whole_params += param.numel()
            totals["params"] += local_part(param).numel()
            totals["state_bytes"] = (
                None if nbytes is None or totals["state_bytes"] is None else totals["state_bytes"] + nbytes
            )
            if projected:
                totals["projected_params"] += param.numel()
                totals["projected_state_bytes"] += nbytes
    report = {**totals, "sharded": sharded, "whole_params": whole_params}
    for prefix in ("", "projected_"):
        params, nbytes = totals[f"{prefix}params"], totals[f"{prefix}state_bytes"]
        report[f"{prefix}adamw_fp32_bytes"] = ADAMW_FP32_BYTES * params
        known = nbytes is not None and params > 0
        report[f"{prefix}bytes_per_param"] = nbytes / params if known else None
        report[f"{prefix}ratio_to_adamw_fp32"] = nbytes / (ADAMW_FP32_BYTES * params) if known else None
    return report


def format_state_report(report: dict, world_size: int = 1) -> str:
    """One log line, e.g. 'optimizer state: 231.5 MiB for 119.6M parameters, 2.03 B/param (25.4% of fp32
    AdamW's 912.4 MiB)'. Sharded (FSDP2): 'optimizer state per rank: ... for this rank's 59.8M of 119.6M
    parameters, ...'; with world_size > 1 and no sharding (DDP) it adds that every rank holds all of it."""
    mib = 2.0**20
    if report["sharded"]:
        what = f"optimizer state per rank: {{}} for this rank's {report['params'] / 1e6:.1f}M of {report['whole_params'] / 1e6:.1f}M parameters"
    else:
        what = f"optimizer state: {{}} for {report['params'] / 1e6:.1f}M parameters"
    if report["state_bytes"] is None:
        return what.format("unknown before the first step")
    line = what.format(f"{report['state_bytes'] / mib:.1f} MiB") + (
        f", {report['bytes_per_param']:.2f} B/param ({100 * report['ratio_to_adamw_fp32']:.1f}% of fp32 AdamW's "
        f"{report['adamw_fp32_bytes'] / mib:.1f} MiB)"
    )
    if world_size > 1 and not report["sharded"]:
        line += f"; replicated: each of the {world_size} ranks holds all of it (DDP)"
    if report["projected_params"]:
        line += (
            f"; GaLore-projected weights ({report['projected_params'] / 1e6:.1f}M): "
            f"{report['projected_bytes_per_param']:.2f} B/param ({100 * report['projected_ratio_to_adamw_fp32']:.1f}%)"
        )
    return line
