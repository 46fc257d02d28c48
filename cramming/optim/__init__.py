"""Optimizers selected by name (Hugging Face `optim` names), built from an OptimConfig.

    adamw                 torch.optim.AdamW
    adamw_8bit            AdamW, block-wise 8-bit moments (fused Triton update on CUDA); with
                          `backend=bitsandbytes`, bitsandbytes' AdamW8bit instead
    adamw_4bit            AdamW, 4-bit moments after Li et al. (PyTorch only)
    galore_adamw          AdamW, GaLore-projected moments for the targeted 2-D weights
    galore_adamw_8bit     both: the low-rank moments in 8 bits (galore_adamw_4bit: in 4 bits)
    galore_adafactor      Adafactor, GaLore-projected
    <name>_layerwise      the same, each parameter updated in its gradient hook (see cramming.optim.base
                          for what the training loop must then do; `optimizer.layerwise` is True)

The loop logs `format_state_report(optimizer_state_report(optimizer))` at start-up. Outside cramming's loop
(a plain PyTorch loop, transformers' Trainer): `create_optimizer(model, name, lr=...)` and
`TrainerOptimizer` (cramming.optim.library; docs/optimizers.md).
"""

from cramming.optim.adafactor import Adafactor
from cramming.optim.adamw import AdamW
from cramming.optim.base import LeanOptimizer
from cramming.optim.build import LAYERWISE, OPTIMIZERS, build_optimizer, layer_scales, param_groups
from cramming.optim.config import OptimConfig
from cramming.optim.galore import galore_parameters
from cramming.optim.library import TrainerOptimizer, create_optimizer
from cramming.optim.report import format_state_report, optimizer_state_report
from cramming.optim.step import check_layerwise_loop

__all__ = [
    "LAYERWISE",
    "OPTIMIZERS",
    "Adafactor",
    "AdamW",
    "LeanOptimizer",
    "OptimConfig",
    "TrainerOptimizer",
    "build_optimizer",
    "check_layerwise_loop",
    "create_optimizer",
    "format_state_report",
    "galore_parameters",
    "layer_scales",
    "optimizer_state_report",
    "param_groups",
]
