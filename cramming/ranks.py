"""Where this process stands in a job of several (torchrun), or a single process: the process group, rank 0's
values for everyone, and local-rank-0-first blocks. The budget clock agrees across the ranks (cramming.budget);
how the model and the loop use them: cramming.train.parallel."""

from __future__ import annotations

import contextlib
import dataclasses
import datetime as dt
import logging
import os
from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch.distributed as dist

from cramming.errors import ConfigError
from cramming.utils import launched_by_torchrun

log = logging.getLogger("cramming")

# the CPU-side control group (stop agreement, waiting for preprocessing) waits this long for a slow rank:
# the other ranks wait for rank 0's preprocessing of a whole corpus in it
CONTROL_TIMEOUT = dt.timedelta(hours=24)


@dataclass(frozen=True)
class Ranks:
    """Where this process stands in the job. The default is a single process."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0  # rank on this machine: the GPU index
    mode: str = "ddp"  # impl.distributed: how the model is spread over the ranks
    device: torch.device = torch.device("cpu")
    # gloo group for the small CPU tensors of the per-micro-batch stop agreement: with nccl they would cost
    # a GPU synchronization each
    control: dist.ProcessGroup | None = None

    @property
    def active(self) -> bool:
        return self.world_size > 1

    @property
    def is_main(self) -> bool:
        """Rank 0: the one that logs, writes metrics and checkpoints, and whose clock is the budget's."""
        return self.rank == 0

    def barrier(self) -> None:
        """Wait for every rank (e.g. until rank 0 has written a checkpoint); nothing in a single process."""
        if self.active:
            dist.barrier(group=self.control)


_ranks: Ranks | None = None  # the process group is process-wide state already; this caches its description


def init_from_env(device: torch.device, mode: str = "ddp") -> Ranks:
    """The process group torchrun asks for (made once per process; later calls join it again), or a single
    process when not launched by torchrun. device: impl.torch_device(); mode: impl.distributed."""
    global _ranks
    if _ranks is not None:
        return dataclasses.replace(_ranks, mode=mode)  # one group, a run's own choice of mode
    if not launched_by_torchrun():
        return Ranks(device=device)
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if device.type == "cuda":
        if device.index is not None:
            raise ConfigError(
                f"impl.device={device} under torchrun: each process takes the GPU of its LOCAL_RANK; use"
                " impl.device=cuda (or auto) and choose GPUs with CUDA_VISIBLE_DEVICES"
            )
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
    if not dist.is_initialized():
        backend = "nccl" if device.type == "cuda" else "gloo"
        dist.init_process_group(backend, device_id=device if device.type == "cuda" else None)
    control = dist.new_group(backend="gloo", timeout=CONTROL_TIMEOUT)
    _ranks = Ranks(dist.get_rank(), dist.get_world_size(), local_rank, mode, device, control)
    if not _ranks.is_main:
        log.setLevel(logging.WARNING)  # one log for the job: rank 0's
    log.info(
        "torchrun: %d processes, %s over %s; micro-batches, the batch size and the budget are global",
        _ranks.world_size,
        _ranks.mode,
        dist.get_backend(),
    )
    return _ranks


def shutdown() -> None:
    """Destroy the process group, if this process made one."""
    global _ranks
    if _ranks is not None and dist.is_initialized():
        dist.destroy_process_group()
    _ranks = None


@contextlib.contextmanager
def local_main_first(ranks: Ranks) -> Iterator[None]:
    """Run the block on local rank 0 of every machine first, then on the others (preprocessing: the first
    builds the data cache, the others find it there)."""
    first = ranks.local_rank == 0
    if ranks.active and not first:
        dist.barrier(group=ranks.control)
    yield
    if ranks.active and first:
        dist.barrier(group=ranks.control)


def rank_zero_value(ranks: Ranks, value):
    """Rank 0's `value` (any picklable object) on every rank, e.g. its run folder."""
    if not ranks.active:
        return value
    box = [value]
    dist.broadcast_object_list(box, src=0, group=ranks.control)
    return box[0]
