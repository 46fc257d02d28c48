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
gathered for the checkpoint: cramming.train.state (the checkpointer).

What the model and the update do across the ranks goes through one object, `Parallel`: it shards or wraps the
model at set-up, and hands the train step (cramming.optim.step) two callables, `grad_sync` (gradients reduced
on an update's last micro-batch only) and `reduce_update_stats`. How each optimizer updates its shards: the
docstring of cramming.optim.base. The budget clock (cramming.budget.budget_clock) and the resumable state
(cramming.train.state) meet the ranks in their own modules.
"""

from __future__ import annotations

import contextlib
import itertools
import logging

import torch
import torch.distributed as dist
from torch import nn

from cramming.errors import ConfigError
from cramming.ranks import Ranks

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
    vectors, which broadcast the same. Their names are kept in `model.lifted_scalars`; the checkpointer
    (cramming.train.state) turns them back when it gathers and loads states, so states and checkpoints have
    one format whatever the mode."""
    model.lifted_scalars = {name for name, param in model.named_parameters() if param.ndim == 0}
    for name in model.lifted_scalars:
        owner_name, _, attr = name.rpartition(".")
        owner = model.get_submodule(owner_name)
        param = getattr(owner, attr)
        setattr(owner, attr, nn.Parameter(param.detach().reshape(1), requires_grad=param.requires_grad))


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
        self.wrapped: nn.Module | None = None  # what wrap() returned: the DDP wrapper, or the model itself

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

    def wrap(self, model: nn.Module, layerwise: bool = False) -> nn.Module:
        """The module that runs forward/backward: `model` itself (one process, FSDP2, or a layerwise optimizer,
        which reduces each gradient itself: `layerwise`), else its DDP wrapper. Before or after the optimizer is
        built, as one likes: DDP only hooks the parameters' gradients."""
        self.wrapped = model
        if not self.active or self.fsdp2 or layerwise:
            return model
        from torch.nn.parallel import DistributedDataParallel

        device = self.ranks.device
        self.wrapped = DistributedDataParallel(
            model, device_ids=[device.index] if device.type == "cuda" else None
        )
        return self.wrapped

    # --- every update ----------------------------------------------------------------------------------

    def grad_sync(self, sync: bool) -> contextlib.AbstractContextManager:
        """Around one micro-batch's forward/backward of the wrapped model: gradients are reduced over the ranks
        only when `sync` (the last micro-batch of an update); the others accumulate locally."""
        if not self.active:
            return contextlib.nullcontext()
        module = self.wrapped  # (torch.compile, when on, wraps this one: set-up compiles after wrapping)
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
