"""Model and optimizer state across the ranks: gathered into the layout of one process when a state is saved,
and loaded back into this job's layout, whatever layout saved it.

One process, DDP: the state dicts as they are. FSDP2: torch.distributed.checkpoint gathers the model (and
torch's optimizers) into whole tensors on rank 0; our optimizers' per-rank shard states (low-bit codes and
scales, GaLore projectors) cannot be gathered that way, so each rank's state is kept as it holds it and
converted on load where the layout differs (cramming.optim.reshard: exact, but for quantized blocks that the
new layout cuts elsewhere). A resumed run reads the state file on every rank (with several machines, base_dir
must be on a shared file system).
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import nn

from cramming.errors import ConfigError
from cramming.optim import reshard
from cramming.optim.base import LeanOptimizer
from cramming.train.ranks import Ranks

log = logging.getLogger("cramming")


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
