"""Our optimizers as a library: built from a model and keyword arguments, no Hydra config, for a plain
PyTorch loop or a Hugging Face `transformers.Trainer`.

    optimizer = create_optimizer(model, "galore_adamw_8bit", lr=1e-3, rank=8)   # any loop
    Trainer(model, args, optimizers=(optimizer, None))                           # Trainer adds its scheduler
    Trainer(model, args, optimizer_cls_and_kwargs=(TrainerOptimizer, {"name": "adamw_4bit", "lr": 1e-3}))

GaLore must know which 2-D weights to project, and a list of parameters does not say: so both routes start
from the model. What Trainer does with `optimizer_cls_and_kwargs=(cls, kwargs)` (transformers 5, read in
5.24's `Trainer.create_optimizer`): a torch.optim.Optimizer subclass is called as `cls(groups, **kwargs)`
with Trainer's own two groups (decayed or not); anything else is a factory, called as
`cls()(model, **kwargs)`. TrainerOptimizer is such a factory, so it sees the model and groups it as
cramming's loop does (norms and biases not decayed; GaLore targets from `target_modules`).

`*_layerwise` optimizers update each parameter inside its gradient hook, which Trainer's step does not
allow for (it clips the gradients after backward, finding none, and may accumulate): TrainerOptimizer
refuses them, and an instance must not be passed through `optimizers=` either. They suit a loop that keeps
the contract in cramming.optim.base.

Trainer with FSDP (accelerate's FSDP plugin, FSDP2 or 1) is refused too. Under FSDP2 our optimizers keep
per-rank states of plain tensors (quantized blocks that end at shard boundaries, GaLore's low-rank moments and
projector pieces), which Trainer's FSDP checkpointing cannot save: it goes through
torch.distributed.checkpoint's optimizer state dicts, which expect DTensors shaped like the parameters.
FSDP1's flat parameters have no 2-D weights for GaLore. The supported routes: Trainer with DDP (a launch
without an FSDP config), or cramming's own loop, `pretrain.py impl.distributed=fsdp2`, which saves these
states per rank and resumes them with any number of ranks or mode (cramming.optim.reshard).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
from torch import nn

from cramming.errors import ConfigError
from cramming.optim.base import is_sharded
from cramming.optim.build import LAYERWISE, build_optimizer
from cramming.optim.config import OptimConfig

# the keyword arguments create_optimizer takes besides name, kernel and max_grad_norm
SETTINGS = tuple(f.name for f in dataclasses.fields(OptimConfig) if f.name != "name")
# where a bad setting is reported: `create_optimizer.<key>` names the argument to change
SCOPE = "create_optimizer"


def create_optimizer(
    model: nn.Module,
    name: str = "adamw",
    *,
    kernel: str = "auto",
    max_grad_norm: float | None = None,
    **settings: Any,
) -> torch.optim.Optimizer:
    """The optimizer `name` (one of cramming.optim.OPTIMIZERS) over `model`'s trainable parameters.

    settings: OptimConfig's fields as keywords; those left out keep OptimConfig's defaults, which are
        cramming's pretraining recipe (lr 1e-3, betas (0.9, 0.98), eps 1e-12, weight_decay 0.01; GaLore
        rank 128, scale 0.25, every Linear but the output layer) — for fine-tuning pass your own, e.g.
        rank=8, scale=2. `target_modules` may be one string. Low-bit state applies to tensors of at
        least `min_8bit_size` (4096) elements; smaller ones keep fp32 moments.
    kernel, max_grad_norm: as build_optimizer's (max_grad_norm only for `*_layerwise`, which clip in
        their hooks).
    """
    unknown = sorted(set(settings) - set(SETTINGS))
    if unknown:
        raise TypeError(f"create_optimizer got unknown settings {unknown}; it takes {', '.join(SETTINGS)}")
    if isinstance(settings.get("target_modules"), str):
        settings["target_modules"] = [settings["target_modules"]]
    for key in ("betas", "target_modules"):
        if key in settings:
            settings[key] = list(settings[key])
    cfg = OptimConfig(name=name, **settings)
    return build_optimizer(model, cfg, kernel=kernel, max_grad_norm=max_grad_norm, scope=SCOPE)


class TrainerOptimizer:
    """`transformers.Trainer(optimizer_cls_and_kwargs=(TrainerOptimizer, {"name": ..., "lr": ..., ...}))`.

    Trainer calls `TrainerOptimizer()(model, **kwargs)`, and the kwargs go to create_optimizer. In this
    route Trainer's `learning_rate`, `weight_decay` and `adam_*` arguments are not read (as for any
    `optimizer_cls_and_kwargs`): give lr and weight_decay in the kwargs. The scheduler is still Trainer's.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        if args or kwargs:
            # an older transformers, which calls every optimizer class with its parameter groups
            raise TypeError(
                "TrainerOptimizer is a factory that Trainer must call with the model (transformers >= 5); "
                "this caller passed parameter groups instead. Build the optimizer yourself and pass it: "
                "Trainer(..., optimizers=(create_optimizer(model, name, lr=...), None))"
            )

    def __call__(self, model: nn.Module, name: str = "adamw", **kwargs: Any) -> torch.optim.Optimizer:
        if name in LAYERWISE:
            raise ConfigError(
                f"`{name}` updates each parameter inside its gradient hook, but Trainer runs backward, then "
                "clips the gradients (gone by then) and calls optimizer.step(), and may accumulate: use "
                f"`{LAYERWISE[name]}` with Trainer, or the layerwise optimizer in your own "
                "loop (its contract: cramming.optim.base)"
            )
        why = fsdp_in_use(model)
        if why:
            raise ConfigError(
                f"transformers Trainer with FSDP and our optimizers is not supported ({why}): Trainer saves the "
                "optimizer through torch.distributed.checkpoint, and under FSDP our optimizers hold per-rank "
                "states it cannot save (cramming.optim.library). Use Trainer with DDP (launch without an FSDP "
                "config), or cramming's loop: pretrain.py impl.distributed=fsdp2"
            )
        return create_optimizer(model, name, **kwargs)


def fsdp_in_use(model: nn.Module) -> str | None:
    """What shows that `model` is, or is about to be, sharded by FSDP under Trainer; None when nothing does.
    Under FSDP2 Trainer builds the optimizer before accelerate shards the model, so accelerate's state,
    set up when Trainer was made, is what tells."""
    if any(is_sharded(p) for p in model.parameters()):
        return "the model's parameters are FSDP2 shards"
    if any(type(m).__name__ == "FullyShardedDataParallel" for m in model.modules()):
        return "the model is wrapped in FSDP"
    try:
        from accelerate.state import AcceleratorState, is_initialized
    except ImportError:
        return None
    if is_initialized() and getattr(AcceleratorState(), "fsdp_plugin", None) is not None:
        return "accelerate is set up for FSDP: Trainer's `fsdp` arguments or an FSDP accelerate config"
    return None
