"""Several processes, one per GPU, on one or more machines: `torchrun --nproc_per_node=N pretrain.py ...`.

PyTorch's own engine does the work: a process group from torchrun's environment (nccl on CUDA, gloo on CPU),
DistributedDataParallel by default (an optimizer that steps inside backward, `optimizer.layerwise`, takes its
place: cramming.optim.layerwise),
FSDP2 (`fully_shard`) with `impl.distributed=fsdp2` (a layerwise optimizer steps each parameter's shard in
the hook that FSDP2 runs after its reduce-scatter). A process not started
by torchrun (WORLD_SIZE unset or 1) makes no process group, and every method of `Parallel` is then the
identity: a single-process run computes exactly what it computed before.

What N processes compute is what one process computes with an N times larger micro-batch:
  * data: global micro-batch k is stream rows [k·N·b, (k+1)·N·b); rank r trains on its r-th slice of b rows
    (RowStream(rank=, world_size=)). The recipe's batch size stays global sequences per update; accumulation
    steps count global micro-batches.
  * masks: keyed by each row's stream position (cramming.train.mlm), so a row's mask does not depend on
    which rank trains it, and there is no masking state to keep in step.
  * gradients: averaged over ranks (DDP all-reduce / FSDP2 reduce-scatter), once per update: the
    accumulation micro-batches run without synchronization (`grad_sync`).
  * the budget is wall-clock for the whole job: after every micro-batch the ranks agree on rank 0's elapsed
    time and on any rank's stop signal (cramming.budget.AgreedClock), so they stop after the same micro-batch
    and the schedule reads the same budget fraction everywhere.
Only rank 0 logs (the others keep warnings), writes metrics, the resumable state and the final checkpoint.
How model and optimizer state are gathered from and loaded into the ranks' layout, and the final weights
gathered for the checkpoint: cramming.train.sharded_state.

What the training loop does across the ranks goes through one object, `Parallel`: it wraps the model, turns
gradient synchronization on for an update's last micro-batch, reduces the update's statistics and waits for
the other ranks. The budget clock (cramming.budget.budget_clock) and the resumable state (cramming.train.state)
meet the ranks in their own modules.
"""

from __future__ import annotations

import contextlib
import itertools
import logging

import torch
import torch.distributed as dist
from torch import nn

from cramming.errors import ConfigError
from cramming.model.checkpoint import unwrap
from cramming.train.ranks import Ranks

log = logging.getLogger("cramming")

# ------------------------------------------------------------------------------------------------- the model


def _fsdp2(model: nn.Module, device: torch.device) -> nn.Module:
    from torch.distributed.fsdp import fully_shard

    _lift_scalars(model)
    for block in model.encoder.blocks:  # one all-gather per block, overlapped with the previous block
        fully_shard(block)
    fully_shard(model)  # the rest: embeddings (tied with the decoder), final norm, head
    return model


def _lift_scalars(model: nn.Module) -> None:
    """fully_shard refuses 0-dim parameters (the scaled-sinusoidal position scale): make them 1-element
    vectors, which broadcast the same. Their names are kept in `model.lifted_scalars`; sharded_state's
    full_state and load_full_state turn them back, so states and checkpoints have one format whatever the
    mode."""
    model.lifted_scalars = {name for name, param in model.named_parameters() if param.ndim == 0}
    for name in model.lifted_scalars:
        owner_name, _, attr = name.rpartition(".")
        owner = model.get_submodule(owner_name)
        param = getattr(owner, attr)
        setattr(owner, attr, nn.Parameter(param.detach().reshape(1), requires_grad=param.requires_grad))


# FSDP2 hands optimizers DTensor shards (dim 0), and every optimizer updates them, each rank its own rows
# (LeanOptimizer._step_param): AdamW is elementwise, the 8-/4-bit forms quantize each rank's shard of a moment
# on its own, GaLore gathers a weight's whole gradient on projector refreshes only, and Adafactor sums its
# factored statistics over the ranks. The layerwise forms step inside backward: under FSDP2 in the
# post-accumulate-grad hooks of the sharded parameters, which FSDP2 runs after each module's reduce-scatter
# (torch >= 2.5; an older FSDP2 never runs them, and the first step says so); under DDP mode they run without
# the DDP wrapper and average each gradient over the ranks themselves (cramming.optim.layerwise).


def _same_start(model: nn.Module) -> None:
    """Rank 0's parameters and buffers on every rank, as DDP's constructor makes them."""
    with torch.no_grad():
        for tensor in itertools.chain(model.parameters(), model.buffers()):
            dist.broadcast(tensor, src=0)


class Parallel:
    """How the model is spread over this job's processes (impl.distributed), and everything the loop does
    across them. With one process every method is the identity (or a no-op)."""

    def __init__(self, ranks: Ranks):
        self.ranks = ranks
        self.active = ranks.active
        self.fsdp2 = ranks.active and ranks.mode == "fsdp2"

    # --- building --------------------------------------------------------------------------------------

    def shard(self, model: nn.Module, dtype: torch.dtype) -> nn.Module:
        """Before the optimizer is built: FSDP2 shards `model` in place (its parameters are replaced);
        DDP mode gives every rank rank 0's weights. Returns `model`."""
        if not self.active:
            return model
        if self.fsdp2:
            if dtype == torch.float16:
                # each rank would check only its own gradient shard for overflow, and the ranks could disagree
                raise ConfigError(
                    "impl.distributed=fsdp2 with fp16 and its loss scaler is not supported: use"
                    " impl.precision=bf16 (or fp32), or impl.distributed=ddp"
                )
            return _fsdp2(model, self.ranks.device)
        _same_start(model)
        return model

    @property
    def reduce_group(self) -> dist.ProcessGroup | None:
        """The group over which a layerwise optimizer averages each gradient in its hook, in place of DDP:
        all ranks under DDP mode; None for one process and for FSDP2, which reduce-scatters each gradient
        itself before it runs the optimizer's hooks."""
        return dist.group.WORLD if self.active and not self.fsdp2 else None

    def wrap(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> nn.Module:
        """The module that runs forward/backward: `model` itself (one process, FSDP2, or an optimizer that
        reduces each gradient itself: `optimizer.layerwise`), else its DDP wrapper."""
        if not self.active or self.fsdp2 or getattr(optimizer, "layerwise", False):
            return model
        from torch.nn.parallel import DistributedDataParallel

        device = self.ranks.device
        return DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda" else None)

    # --- every update ----------------------------------------------------------------------------------

    def grad_sync(self, step_model: nn.Module, sync: bool) -> contextlib.AbstractContextManager:
        """Around one micro-batch's forward/backward: gradients are reduced over the ranks only when `sync`
        (the last micro-batch of an update); the others accumulate locally."""
        if not self.active:
            return contextlib.nullcontext()
        module = unwrap(step_model)  # under torch.compile's wrapper
        if self.fsdp2:
            module.set_requires_gradient_sync(sync)
            return contextlib.nullcontext()
        if sync or not hasattr(module, "no_sync"):  # no DDP wrapper: a layerwise optimizer reduces
            return contextlib.nullcontext()
        return module.no_sync()

    def reduce_update_stats(self, loss_sum: torch.Tensor, *counts: torch.Tensor) -> list[torch.Tensor]:
        """The update's loss averaged over ranks and its counts summed, in one all-reduce that stays on the
        device. Every rank then sees the same loss, so all skip a non-finite update together."""
        if not self.active:
            return [loss_sum, *counts]
        stats = torch.stack([loss_sum / self.ranks.world_size, *(c.to(loss_sum.dtype) for c in counts)])
        dist.all_reduce(stats)
        return list(stats.unbind())

    # --- the end -----------------------------------------------------------------------------------

    def barrier(self) -> None:
        """Wait for every rank (e.g. until rank 0 has written the final checkpoint)."""
        if self.active:
            dist.barrier(group=self.ranks.control)
