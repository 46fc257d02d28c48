"""Building an optimizer by name: the registry of names (Hugging Face `optim` names, plus our `_layerwise`
forms), the parameter groups (no weight decay on norms and biases; layer-wise learning-rate decay), and
build_optimizer, which the training loop, GLUE fine-tuning and the library entry points all call."""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
from torch import nn

from cramming.errors import ConfigError, check_choice
from cramming.optim.adafactor import Adafactor
from cramming.optim.adamw import KERNELS, AdamW
from cramming.optim.config import OptimConfig
from cramming.optim.galore import galore_parameters

# normalization layers: their gains (and biases) are never decayed. A model's own norm class counts when its name
# ends in "Norm" (ours: cramming.model.bert.LayerNorm; elsewhere RMSNorm, T5LayerNorm, ...), so this library
# needs no import of any model
NORM_LAYERS = (nn.LayerNorm, nn.RMSNorm, nn.GroupNorm, nn.modules.batchnorm._BatchNorm)


def is_norm_layer(module: nn.Module) -> bool:
    return isinstance(module, NORM_LAYERS) or type(module).__name__.endswith("Norm")


def param_groups(model: nn.Module, weight_decay: float) -> list[dict]:
    """Split parameters into decayed and not decayed: normalization layers' parameters and biases are not
    decayed; everything else is, the scaled-sinusoid position scale included (cramming's grouping: it is
    not a norm or a bias, though a scalar)."""
    norms = {id(p) for m in model.modules() if is_norm_layer(m) for p in m.parameters(recurse=False)}
    decay, no_decay = [], []
    for name, param in model.named_parameters():
        if not param.requires_grad:
            continue
        (no_decay if id(param) in norms or name.endswith("bias") else decay).append(param)
    return [
        {"params": decay, "weight_decay": weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]


def _block_list(model: nn.Module, layer_decay: float, key: str = "layer_decay") -> nn.ModuleList:
    """The model's stack of blocks: its nn.ModuleList with the most entries (encoder.blocks here,
    bert.encoder.layer in transformers' BERT). Raises ConfigError, naming `key`, when it has none."""
    lists = [m for m in model.modules() if isinstance(m, nn.ModuleList) and len(m) > 0]
    if not lists:
        raise ConfigError(
            f"`{key}={layer_decay}` decays the rate block by block, and {type(model).__name__} holds no list "
            f"of blocks (nn.ModuleList): use `{key}=1.0`"
        )
    return max(lists, key=len)


def layer_scales(model: nn.Module, layer_decay: float) -> dict[int, float]:
    """id(parameter) -> the factor on its learning rate under layer-wise decay, for every trainable parameter.

    With L blocks (the model's longest nn.ModuleList): what comes after the blocks (final norm, classifier
    head) 1, block i (from 0) layer_decay^(L - i), what comes before them (the embeddings)
    layer_decay^(L + 1). Before and after are told by the order of model.named_parameters(), which follows
    the order the modules were defined in; a weight tied to the embeddings counts once, as an embedding."""
    blocks = _block_list(model, layer_decay)
    depth_of = {id(p): i + 1 for i, block in enumerate(blocks) for p in block.parameters()}
    count = len(blocks)
    scales, seen_block = {}, False
    for _, param in model.named_parameters():
        depth = depth_of.get(id(param))
        if depth is not None:
            seen_block = True
        else:
            depth = count + 1 if seen_block else 0
        if param.requires_grad:
            scales[id(param)] = layer_decay ** (count + 1 - depth)
    return scales


def _scaled_by_layer(groups: list[dict], model: nn.Module, cfg: OptimConfig) -> list[dict]:
    """Each group split by its parameters' layer_scales, each part at lr * scale (its `lr_scale` recorded);
    the groups unchanged with cfg.layer_decay = 1. Parts keep their parameters' order, largest scale first."""
    if cfg.layer_decay == 1.0:
        return groups
    scales = layer_scales(model, cfg.layer_decay)
    parts = []
    for group in groups:
        by_scale: dict[float, list] = {}
        for param in group["params"]:
            by_scale.setdefault(scales[id(param)], []).append(param)
        for scale in sorted(by_scale, reverse=True):
            parts.append({**group, "params": by_scale[scale], "lr": cfg.lr * scale, "lr_scale": scale})
    return parts


def lean_param_groups(model: nn.Module, cfg: OptimConfig, *, galore: bool, bits: int) -> list[dict]:
    """param_groups, with the GaLore-projected weights in a group of their own (rank > 0) and, with
    `embedding_32bit`, the embeddings in a 32-bit group. Empty groups are left out."""
    projected = galore_parameters(model, cfg.target_modules) if galore else []
    if galore and not projected:
        names = [name for name, mod in model.named_modules() if isinstance(mod, nn.Linear)][:8]
        raise ConfigError(
            f"`train.optim.target_modules` {cfg.target_modules} matched no 2-D weight; this model's Linear "
            f"modules are named like {names}"
        )
    projected_ids = {id(p) for p in projected}
    embedding_ids = set()
    if bits < 32 and cfg.embedding_32bit:
        embedding_ids = {id(mod.weight) for mod in model.modules() if isinstance(mod, nn.Embedding)}
    groups = []
    if projected:
        groups.append(
            {
                "params": projected,
                "weight_decay": cfg.weight_decay,
                "rank": cfg.rank,
                "update_proj_gap": cfg.update_proj_gap,
                "scale": cfg.scale,
                "proj_type": cfg.proj_type,
            }
        )
    for group in param_groups(model, cfg.weight_decay):
        rest = [p for p in group["params"] if id(p) not in projected_ids]
        plain = [p for p in rest if id(p) not in embedding_ids]
        embeddings = [p for p in rest if id(p) in embedding_ids]
        if plain:
            groups.append({"params": plain, "weight_decay": group["weight_decay"]})
        if embeddings:
            groups.append({"params": embeddings, "weight_decay": group["weight_decay"], "optim_bits": 32})
    return groups


def _adamw(
    model: nn.Module,
    cfg: OptimConfig,
    *,
    kernel: str,
    max_grad_norm: float | None,
    reduce_group: torch.distributed.ProcessGroup | None = None,
) -> torch.optim.Optimizer:
    """torch's AdamW; the loop clips (max_grad_norm) and DDP/FSDP2 reduce (reduce_group) for it."""
    # fused (one kernel for every tensor) when all parameters are plain CUDA tensors: the same update up to
    # rounding; sharded (DTensor) parameters and the CPU keep torch's default
    fused = all(p.is_cuda and type(p.data) is torch.Tensor for p in model.parameters()) or None
    return torch.optim.AdamW(
        _scaled_by_layer(param_groups(model, cfg.weight_decay), model, cfg),
        lr=cfg.lr,
        betas=tuple(cfg.betas),
        eps=cfg.eps,
        fused=fused,
    )


def _lean_adamw(
    model: nn.Module,
    cfg: OptimConfig,
    *,
    kernel: str,
    max_grad_norm: float | None,
    bits: int,
    galore: bool,
    layerwise: bool,
    reduce_group: torch.distributed.ProcessGroup | None = None,
) -> AdamW:
    return AdamW(
        _scaled_by_layer(lean_param_groups(model, cfg, galore=galore, bits=bits), model, cfg),
        lr=cfg.lr,
        betas=tuple(cfg.betas),
        eps=cfg.eps,
        weight_decay=cfg.weight_decay,
        optim_bits=bits,
        min_8bit_size=cfg.min_8bit_size,
        second_moment_map=cfg.second_moment_map,
        first_moment_rounding=cfg.first_moment_rounding,
        first_moment_format=cfg.first_moment_format,
        kernel=kernel,
        layerwise=layerwise,
        max_grad_norm=max_grad_norm if layerwise else None,
        reduce_group=reduce_group,
        reduce_order=list(model.parameters()),
    )


def _galore_adafactor(
    model: nn.Module,
    cfg: OptimConfig,
    *,
    kernel: str,
    max_grad_norm: float | None,
    layerwise: bool,
    reduce_group: torch.distributed.ProcessGroup | None = None,
) -> Adafactor:
    return Adafactor(
        _scaled_by_layer(lean_param_groups(model, cfg, galore=True, bits=32), model, cfg),
        lr=cfg.lr,
        weight_decay=cfg.weight_decay,
        layerwise=layerwise,
        max_grad_norm=max_grad_norm if layerwise else None,
        reduce_group=reduce_group,
        reduce_order=list(model.parameters()),
    )


def _bitsandbytes_adamw8bit(model: nn.Module, cfg: OptimConfig) -> torch.optim.Optimizer:
    """bitsandbytes' AdamW8bit with our settings (keyword arguments: bitsandbytes >= 0.50 reordered its
    positional ones). Its second-moment map is its own (`dynamic`, with the zero point)."""
    try:
        import bitsandbytes as bnb
    except ImportError as err:
        raise ConfigError(
            "`train.optim.backend=bitsandbytes` needs bitsandbytes (pip install 'bitsandbytes>=0.50', which "
            f"steps on CPU too), or use `train.optim.backend=cramming` ({err})"
        ) from err
    if cfg.embedding_32bit:
        raise ConfigError(
            "`train.optim.embedding_32bit` is not passed to bitsandbytes (it sets that through a global "
            "manager): use `train.optim.backend=cramming` for it, or embedding_32bit=false"
        )
    return bnb.optim.AdamW8bit(
        _scaled_by_layer(param_groups(model, cfg.weight_decay), model, cfg),
        lr=cfg.lr,
        betas=tuple(cfg.betas),
        eps=cfg.eps,
        weight_decay=cfg.weight_decay,
        min_8bit_size=cfg.min_8bit_size,
    )


# names each non-default backend implements
BACKEND_NAMES = {"bitsandbytes": {"adamw_8bit": _bitsandbytes_adamw8bit}}


# layerwise name -> the same optimizer stepping after backward (the one place the `_layerwise` suffix is composed;
# a built optimizer says which it is by its `layerwise` attribute)
LAYERWISE: dict[str, str] = {}


def _registry() -> dict[str, Callable[..., torch.optim.Optimizer]]:
    adamw_kinds = {
        "adamw": {"bits": 32, "galore": False},  # only the layerwise form: plain `adamw` is torch's
        "adamw_8bit": {"bits": 8, "galore": False},
        "galore_adamw": {"bits": 32, "galore": True},
        "galore_adamw_8bit": {"bits": 8, "galore": True},
        "adamw_4bit": {"bits": 4, "galore": False},
        "galore_adamw_4bit": {"bits": 4, "galore": True},
    }
    registry: dict[str, Callable[..., torch.optim.Optimizer]] = {"adamw": _adamw}
    for name, kind in adamw_kinds.items():
        if name != "adamw":
            registry[name] = functools.partial(_lean_adamw, layerwise=False, **kind)
        registry[f"{name}_layerwise"] = functools.partial(_lean_adamw, layerwise=True, **kind)
    registry["galore_adafactor"] = functools.partial(_galore_adafactor, layerwise=False)
    registry["galore_adafactor_layerwise"] = functools.partial(_galore_adafactor, layerwise=True)
    LAYERWISE.update({f"{name}_layerwise": name for name in (*adamw_kinds, "galore_adafactor")})
    return registry


OPTIMIZERS: dict[str, Callable[..., torch.optim.Optimizer]] = _registry()


def build_optimizer(
    model: nn.Module,
    cfg: OptimConfig,
    *,
    kernel: str = "auto",
    max_grad_norm: float | None = None,
    reduce_group: torch.distributed.ProcessGroup | None = None,
    scope: str = "train.optim",
) -> torch.optim.Optimizer:
    """The optimizer `cfg.name` over `model`'s trainable parameters.

    kernel: how 8-bit updates run ("auto": fused Triton on CUDA, PyTorch elsewhere; "torch"; "triton") —
        a speed setting, the loop may derive it from `impl`.
    max_grad_norm: the loop's clipping threshold. Layerwise optimizers clip each parameter's gradient to it
        in their hooks (the loop must not clip); the others ignore it (the loop clips as usual).
    reduce_group: with several processes, the group over which a layerwise optimizer averages each gradient
        in its hook (the model must then not be wrapped in DDP; see cramming.optim.layerwise). Ignored by the
        others.
    scope: where the settings sit in the config (train.optim or eval.optim), for the error messages.
    """
    check_choice(f"{scope}.name", cfg.name, OPTIMIZERS)
    cfg.check(scope)
    check_choice("kernel", kernel, KERNELS)
    if cfg.layer_decay != 1.0:
        _block_list(model, cfg.layer_decay, f"{scope}.layer_decay")  # refused here, naming the key
    if cfg.backend != "cramming":
        names = BACKEND_NAMES[cfg.backend]
        if cfg.name not in names:
            raise ConfigError(
                f"`{scope}.backend={cfg.backend}` implements {', '.join(names)} only, not "
                f"`{scope}.name={cfg.name}`: use `{scope}.backend=cramming`"
            )
        return names[cfg.name](model, cfg)
    return OPTIMIZERS[cfg.name](
        model, cfg, kernel=kernel, max_grad_norm=max_grad_norm, reduce_group=reduce_group
    )
