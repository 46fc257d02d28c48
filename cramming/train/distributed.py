"""Several processes, one per GPU, on one or more machines: `torchrun --nproc_per_node=N pretrain.py ...`.

PyTorch's own engine does the work: a process group from torchrun's environment (nccl on CUDA, gloo on CPU),
DistributedDataParallel by default (a `*_layerwise` optimizer takes its place: cramming.optim.layerwise),
FSDP2 (`fully_shard`) with `impl.distributed=fsdp2` (a `*_layerwise` optimizer steps each parameter's shard
in the hook that FSDP2 runs after its reduce-scatter). A process not started
by torchrun (WORLD_SIZE unset or 1) makes no process group, and every helper here is then the identity: a
single-process run computes exactly what it computed before.

What N processes compute is what one process computes with an N times larger micro-batch:
  * data: global micro-batch k is stream rows [k·N·b, (k+1)·N·b); rank r trains on its r-th slice of b rows
    (RowStream(rank=, world_size=)). The recipe's batch size stays global sequences per update; accumulation
    steps count global micro-batches.
  * masks: keyed by each row's stream position (cramming.train.mlm), so a row's mask does not depend on
    which rank trains it, and there is no masking state to keep in step.
  * gradients: averaged over ranks (DDP all-reduce / FSDP2 reduce-scatter), once per update: the
    accumulation micro-batches run without synchronization (`grad_sync`).
  * the budget is wall-clock for the whole job: after every micro-batch the ranks agree on rank 0's elapsed
    time and on any rank's stop signal (`AgreedClock.agree`), so they stop after the same micro-batch and the
    schedule reads the same budget fraction everywhere.
Only rank 0 logs (the others keep warnings), writes metrics, the resumable state and the final checkpoint;
under FSDP2 the full state is gathered for them (our optimizers' per-rank shard states, low-bit and GaLore, as
each rank holds them). A resumed run reads the state file on every rank (with several machines, base_dir must
be on a shared file system) and loads it in its own layout: the same number of FSDP2 ranks as saved, our
optimizers' shard states as they are; any other number of ranks, DDP or one process, converted
(cramming.optim.reshard: exact, but for quantized blocks that the new layout cuts elsewhere).
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime as dt
import itertools
import logging
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from cramming.budget import BudgetClock
from cramming.errors import ConfigError
from cramming.impl import ImplConfig
from cramming.model.checkpoint import unwrap
from cramming.optim import reshard
from cramming.optim.base import LeanOptimizer
from cramming.utils import launched_by_torchrun

log = logging.getLogger("cramming")

# stop signals as numbers, so the ranks can agree on one with a max-reduction; the larger one wins
SIGNAL_CODES = {"SIGTERM": 1, "SIGINT": 2}
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


_ranks: Ranks | None = None  # the process group is process-wide state already; this caches its description


def init_from_env(impl: ImplConfig) -> Ranks:
    """The process group torchrun asks for (made once per process; later calls join it again), or a single
    process when not launched by torchrun."""
    global _ranks
    if _ranks is not None:
        return dataclasses.replace(_ranks, mode=impl.distributed)  # one group, a run's own choice of mode
    device = impl.torch_device()
    if not launched_by_torchrun():
        return Ranks(device=device)
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if device.type == "cuda":
        if impl.device not in ("auto", "cuda"):
            raise ConfigError(
                f"impl.device={impl.device} under torchrun: each process takes the GPU of its LOCAL_RANK; use"
                " impl.device=cuda (or auto) and choose GPUs with CUDA_VISIBLE_DEVICES"
            )
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
    if not dist.is_initialized():
        backend = "nccl" if device.type == "cuda" else "gloo"
        dist.init_process_group(backend, device_id=device if device.type == "cuda" else None)
    control = dist.new_group(backend="gloo", timeout=CONTROL_TIMEOUT)
    _ranks = Ranks(dist.get_rank(), dist.get_world_size(), local_rank, impl.distributed, device, control)
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


# ---------------------------------------------------------------------------------------------------- budget


class AgreedClock(BudgetClock):
    """The budget clock of a multi-process run: every reading is rank 0's elapsed time as agreed at the last
    `agree()` (collective: after every micro-batch, in check_stop). So all ranks take the same stop decision,
    accumulation count and learning rate, whatever their own clocks say."""

    def __init__(
        self,
        ranks: Ranks,
        budget_hours: float,
        clock: Callable[[], float],
        elapsed_before: float = 0.0,
    ):
        super().__init__(budget_hours, clock, elapsed_before)
        self._ranks = ranks
        self._agreed = elapsed_before
        self.agree(None)  # start from one reading: the first periodic save comes at the same time everywhere

    def elapsed(self) -> float:
        return self._agreed

    def agree(self, received: str | None) -> str | None:
        """Take rank 0's elapsed time; returns the stop signal any rank received (SIGINT before SIGTERM)."""
        mine = super().elapsed() if self._ranks.is_main else 0.0
        values = torch.tensor([mine, SIGNAL_CODES.get(received, 0)], dtype=torch.float64)
        dist.all_reduce(values, op=dist.ReduceOp.MAX, group=self._ranks.control)
        self._agreed = values[0].item()
        code = int(values[1].item())
        return next((name for name, c in SIGNAL_CODES.items() if c == code), None)


def budget_clock(
    ranks: Ranks, budget_hours: float, clock: Callable[[], float], elapsed_before: float = 0.0
) -> BudgetClock:
    if not ranks.active:
        return BudgetClock(budget_hours, clock, elapsed_before)
    return AgreedClock(ranks, budget_hours, clock, elapsed_before)


# ------------------------------------------------------------------------------------------------- the model


def _ddp(model: nn.Module, device: torch.device) -> nn.Module:
    from torch.nn.parallel import DistributedDataParallel

    return DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda" else None)


def _fsdp2(model: nn.Module, device: torch.device) -> nn.Module:
    from torch.distributed.fsdp import fully_shard

    _lift_scalars(model)
    for block in model.encoder.blocks:  # one all-gather per block, overlapped with the previous block
        fully_shard(block)
    fully_shard(model)  # the rest: embeddings (tied with the decoder), final norm, head
    return model


def _lift_scalars(model: nn.Module) -> None:
    """fully_shard refuses 0-dim parameters (the scaled-sinusoidal position scale): make them 1-element
    vectors, which broadcast the same. Their names are kept in `model.lifted_scalars`; full_state and
    load_full_state turn them back, so states and checkpoints have one format whatever the mode."""
    model.lifted_scalars = {name for name, param in model.named_parameters() if param.ndim == 0}
    for name in model.lifted_scalars:
        owner_name, _, attr = name.rpartition(".")
        owner = model.get_submodule(owner_name)
        param = getattr(owner, attr)
        setattr(owner, attr, nn.Parameter(param.detach().reshape(1), requires_grad=param.requires_grad))


def _reshape_lifted(model: nn.Module, model_state: dict, optimizer_state: dict | None, lift: bool) -> None:
    """In place: the lifted scalars' entries (and their optimizer moments, not the step count) to 1-element
    vectors (lift) or back to scalars."""
    shape = (1,) if lift else ()
    for name in getattr(model, "lifted_scalars", ()):
        if name in model_state:
            model_state[name] = model_state[name].reshape(shape)
        moments = optimizer_state["state"].get(name, {}) if optimizer_state else {}
        for key, value in moments.items():
            if torch.is_tensor(value) and key != "step" and value.numel() == 1:
                moments[key] = value.reshape(shape)


# impl.distributed -> wrapper; DDP returns a wrapper module, fully_shard shards the model in place
PARALLEL: dict[str, Callable[[nn.Module, torch.device], nn.Module]] = {"ddp": _ddp, "fsdp2": _fsdp2}
# FSDP2 hands optimizers DTensor shards (dim 0), and every optimizer updates them, each rank its own rows
# (LeanOptimizer._step_param): AdamW is elementwise, the 8-/4-bit forms quantize each rank's shard of a moment
# on its own, GaLore gathers a weight's whole gradient on projector refreshes only, and Adafactor sums its
# factored statistics over the ranks. The layerwise forms step inside backward: under FSDP2 in the
# post-accumulate-grad hooks of the sharded parameters, which FSDP2 runs after each module's reduce-scatter
# (torch >= 2.5; an older FSDP2 never runs them, and the first step says so); under DDP mode they run without
# the DDP wrapper and average each gradient over the ranks themselves (cramming.optim.layerwise).
LAYERWISE_SUFFIX = "_layerwise"


def prepare_model(model: nn.Module, ranks: Ranks, optim_name: str, dtype: torch.dtype) -> nn.Module:
    """The module that runs forward/backward: `model` itself alone, its DDP wrapper, or (FSDP2) `model`
    sharded in place. Call before building the optimizer: FSDP2 replaces the parameters."""
    if not ranks.active:
        return model
    if ranks.mode == "ddp" and optim_name.endswith(LAYERWISE_SUFFIX):  # the optimizer reduces each gradient
        _same_start(model)
        return model
    if ranks.mode == "fsdp2" and dtype == torch.float16:
        # each rank would check only its own gradient shard for overflow, and the ranks could disagree
        raise ConfigError(
            "impl.distributed=fsdp2 with fp16 and its loss scaler is not supported: use impl.precision=bf16"
            " (or fp32), or impl.distributed=ddp"
        )
    return PARALLEL[ranks.mode](model, ranks.device)


def _same_start(model: nn.Module) -> None:
    """Rank 0's parameters and buffers on every rank, as DDP's constructor makes them."""
    with torch.no_grad():
        for tensor in itertools.chain(model.parameters(), model.buffers()):
            dist.broadcast(tensor, src=0)


def layerwise_reduce_group(ranks: Ranks) -> dist.ProcessGroup | None:
    """The group over which a layerwise optimizer averages each gradient in its hook, in place of DDP (which
    prepare_model leaves out for it): all ranks under DDP mode; None for one process and for FSDP2, which
    reduce-scatters each gradient itself before it runs the optimizer's hooks."""
    return dist.group.WORLD if ranks.active and ranks.mode == "ddp" else None


def grad_sync(step_model: nn.Module, ranks: Ranks, sync: bool) -> contextlib.AbstractContextManager:
    """Around one micro-batch's forward/backward: gradients are reduced over the ranks only when `sync` (the
    last micro-batch of an update); the others accumulate locally."""
    if not ranks.active:
        return contextlib.nullcontext()
    module = unwrap(step_model)  # under torch.compile's wrapper
    if ranks.mode == "fsdp2":
        module.set_requires_gradient_sync(sync)
        return contextlib.nullcontext()
    if not hasattr(module, "no_sync"):  # no DDP wrapper: a layerwise optimizer reduces (TrainStep.microbatch)
        return contextlib.nullcontext()
    return contextlib.nullcontext() if sync else module.no_sync()


def reduce_update_stats(ranks: Ranks, loss_sum: torch.Tensor, *counts: torch.Tensor) -> list[torch.Tensor]:
    """The update's loss averaged over ranks and its counts summed, in one all-reduce that stays on the
    device. Every rank then sees the same loss, so all skip a non-finite update together."""
    if not ranks.active:
        return [loss_sum, *counts]
    stats = torch.stack([loss_sum / ranks.world_size, *(c.to(loss_sum.dtype) for c in counts)])
    dist.all_reduce(stats)
    return list(stats.unbind())


# ---------------------------------------------------------------------------------------------------- state


def _fsdp2_options(**kwargs):
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    return StateDictOptions(full_state_dict=True, **kwargs)


def _param_names(model: nn.Module, optimizer: torch.optim.Optimizer) -> list[str]:
    """Names of the optimizer's parameters in its own numbering (a tied matrix has its first name)."""
    names = {id(p): name for name, p in model.named_parameters()}
    return [names[id(p)] for group in optimizer.param_groups for p in group["params"]]


def _by_index(state: dict, names: list[str]) -> dict:
    index = {name: i for i, name in enumerate(names)}
    return {
        "state": {index[name]: value for name, value in state["state"].items()},
        "param_groups": [{**g, "params": [index[n] for n in g["params"]]} for g in state["param_groups"]],
    }


def _by_name(state: dict, names: list[str]) -> dict:
    return {
        "state": {names[i]: dict(value) for i, value in state["state"].items()},
        "param_groups": [{**g, "params": [names[i] for i in g["params"]]} for g in state["param_groups"]],
    }


def _holds_shard_state(optimizer: torch.optim.Optimizer, ranks: Ranks) -> bool:
    """Whether each rank's optimizer state is its own plain tensors (our optimizers under FSDP2), which
    torch.distributed.checkpoint's full state dict cannot gather: it gathers DTensors, and per-shard
    quantization blocks, packed codes and GaLore's projector pieces need our own conversion
    (cramming.optim.reshard) to become the whole tensor's."""
    return ranks.active and ranks.mode == "fsdp2" and isinstance(optimizer, LeanOptimizer)


def _gathered_shard_states(optimizer: torch.optim.Optimizer, ranks: Ranks) -> dict:
    """Every rank's optimizer state dict (on the CPU), gathered to rank 0 as {"param_groups": ...,
    "rank_states": [rank 0's "state", rank 1's, ...]}; {} on the other ranks. Collective. The codes and
    scales are kept as each rank holds them, so the same number of ranks resumes them exactly (and any other
    layout converts them when it loads them: _optimizer_state_here)."""
    own = optimizer.state_dict()
    state = {
        i: {k: v.cpu() if torch.is_tensor(v) else v for k, v in s.items()} for i, s in own["state"].items()
    }
    gathered = [None] * ranks.world_size if ranks.is_main else None
    dist.gather_object(state, gathered, dst=0, group=ranks.control)
    if not ranks.is_main:
        return {}
    return {"param_groups": own["param_groups"], "rank_states": gathered}


def _check_shard_states(optimizer_state: dict, lean: bool) -> None:
    """Refuse a saved optimizer state that cannot become this optimizer's: FSDP2 ranks' shard states (ours)
    for an optimizer that is not ours."""
    saved = optimizer_state.get("rank_states")
    if saved is not None and not lean:
        raise ConfigError(
            f"the saved optimizer state is {len(saved)} FSDP2 ranks' shards of cramming's own optimizer"
            " (8-/4-bit or GaLore), and this run's optimizer is another one: resume with the train.optim that"
            " saved it, or start the optimizer state afresh"
        )


def _optimizer_state_here(
    model: nn.Module, optimizer: torch.optim.Optimizer, optimizer_state: dict, ranks: Ranks
) -> dict:
    """The saved optimizer state in this job's layout. Our optimizers hold whole tensors in one process or
    under DDP, and per-rank shard states under FSDP2: a state saved in the other layout, or by another number
    of FSDP2 ranks, is converted (cramming.optim.reshard: exact, but for quantized moments whose blocks the
    new layout cuts elsewhere, re-quantized and logged). The same number of FSDP2 ranks loads as saved."""
    lean = isinstance(optimizer, LeanOptimizer)
    _check_shard_states(optimizer_state, lean)
    rank_states = optimizer_state.get("rank_states")
    shard_state = _holds_shard_state(optimizer, ranks)
    groups = optimizer_state["param_groups"]
    if rank_states is None and not (shard_state and optimizer_state.get("state")):
        return optimizer_state  # whole tensors for whole tensors (or nothing to cut)
    if rank_states is not None and shard_state and len(rank_states) == ranks.world_size:
        return {"state": rank_states[ranks.rank], "param_groups": groups}
    names = _param_names(model, optimizer)
    requantized = {}
    state = optimizer_state.get("state", {})
    if rank_states is not None:
        state, requantized = reshard.merge_rank_states(optimizer, rank_states, names)
    if shard_state:
        state, cut = reshard.cut_whole_state(optimizer, state, ranks.rank, ranks.world_size, names)
        requantized = {
            name: sorted({*requantized.get(name, ()), *cut.get(name, ())}) for name in {*requantized, *cut}
        }
    source = "whole tensors" if rank_states is None else f"{len(rank_states)} FSDP2 ranks' shards"
    here = f"{ranks.world_size} FSDP2 ranks" if shard_state else "whole tensors"
    moved = ", ".join(f"{name} ({'+'.join(moments)})" for name, moments in sorted(requantized.items()))
    log.info(
        "optimizer state: %s -> %s; %d of %d parameters' states moved exactly, the others' moments"
        " re-quantized in the new blocks (each value to its nearest code: at most half a code step)%s",
        source,
        here,
        len(state) - len(requantized),
        len(state),
        f": {moved}" if moved else "",
    )
    return {"state": state, "param_groups": groups}


def full_state(model: nn.Module, optimizer: torch.optim.Optimizer, ranks: Ranks) -> tuple[dict, dict]:
    """Model and optimizer state dicts as one process has them (plain keys, whole tensors, optimizer state by
    parameter index), so a state saved by any number of ranks resumes on any other. Collective under FSDP2,
    where the ranks other than 0 get empty dicts. Our optimizers under FSDP2 save their per-rank shard states
    as the ranks hold them (see _gathered_shard_states); load_full_state converts them where needed."""
    if not (ranks.active and ranks.mode == "fsdp2"):
        return model.state_dict(), optimizer.state_dict()
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

    options = _fsdp2_options(cpu_offload=True)
    model_state = get_model_state_dict(model, options=options)
    if _holds_shard_state(optimizer, ranks):
        optimizer_state = _gathered_shard_states(optimizer, ranks)
    else:
        optimizer_state = get_optimizer_state_dict(model, optimizer, options=options)
    if not ranks.is_main:
        return {}, {}
    if _holds_shard_state(optimizer, ranks):
        _reshape_lifted(model, model_state, None, lift=False)
        return model_state, optimizer_state
    _reshape_lifted(model, model_state, optimizer_state, lift=False)
    return model_state, _by_index(optimizer_state, _param_names(model, optimizer))


def load_full_state(
    model: nn.Module, optimizer: torch.optim.Optimizer, model_state: dict, optimizer_state: dict, ranks: Ranks
) -> None:
    """The inverse of full_state; every rank passes the whole saved state."""
    shard_state = _holds_shard_state(optimizer, ranks)
    optimizer_state = _optimizer_state_here(model, optimizer, optimizer_state, ranks)
    if not (ranks.active and ranks.mode == "fsdp2"):
        model.load_state_dict(model_state)
        optimizer.load_state_dict(optimizer_state)
        return
    from torch.distributed.checkpoint.state_dict import set_model_state_dict, set_optimizer_state_dict

    model_state = dict(model_state)
    if shard_state:
        _reshape_lifted(model, model_state, None, lift=True)
        set_model_state_dict(model, model_state, options=_fsdp2_options())
        optimizer.load_state_dict(optimizer_state)
        return
    named = _by_name(optimizer_state, _param_names(model, optimizer))
    _reshape_lifted(model, model_state, named, lift=True)
    set_model_state_dict(model, model_state, options=_fsdp2_options())
    set_optimizer_state_dict(model, optimizer, named, options=_fsdp2_options())


def exportable_model(model: nn.Module, ranks: Ranks, build: Callable[[], nn.Module]) -> nn.Module | None:
    """A module with whole weights and plain key names for the final checkpoint, on rank 0 (None on the
    others): `model` itself, unless FSDP2 sharded it; then its full state, gathered (collectively) into a
    fresh CPU copy made by `build`."""
    if not (ranks.active and ranks.mode == "fsdp2"):
        return model if ranks.is_main else None
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    weights = get_model_state_dict(model, options=_fsdp2_options(cpu_offload=True))
    if not ranks.is_main:
        return None
    _reshape_lifted(model, weights, None, lift=False)
    copy = build()
    copy.load_state_dict(weights)
    return copy


def barrier(ranks: Ranks) -> None:
    """Wait for every rank (e.g. until rank 0 has written the final checkpoint)."""
    if ranks.active:
        dist.barrier(group=ranks.control)
