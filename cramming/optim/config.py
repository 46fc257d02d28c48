"""Typed configuration of the optimizer (`train/optim` group).

Names and settings follow Hugging Face's `optim`, `optim_args` and `optim_target_modules`: `name` is one of
cramming.optim.OPTIMIZERS (adamw, adamw_8bit, adamw_4bit, galore_adamw, galore_adamw_8bit, galore_adamw_4bit,
galore_adafactor, each also with `_layerwise`); the GaLore and low-bit settings below are read only by the
names that use them.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from cramming.errors import check_choice, config_error
from cramming.optim.quant import FIRST_MOMENT_CHOICES, ROUNDINGS, SECOND_MOMENT_MAPS

PROJ_TYPES = ("std", "reverse_std", "left", "right", "full")
ALL_LINEAR = "all-linear"
# cramming: our implementation (every name); bitsandbytes: bnb.optim.AdamW8bit (adamw_8bit only)
BACKENDS = ("cramming", "bitsandbytes")


@dataclass
class OptimConfig:
    """The optimizer (`train.optim`, and `eval.optim` for fine-tuning): its name and every setting it reads."""

    # one of the names in cramming.optim.OPTIMIZERS (Hugging Face `optim` names)
    name: str = "adamw"
    # the peak learning rate (the schedule scales it)
    lr: float = 1e-3
    # AdamW's (beta1, beta2); Adafactor uses neither (no first moment, beta2 follows 1 - t^-0.8)
    betas: list[float] = field(default_factory=lambda: [0.9, 0.98])
    # added to the denominator of Adam's update
    eps: float = 1e-12
    # decoupled weight decay; never applied to norms, biases or the embeddings' norm
    weight_decay: float = 0.01
    # layer-wise learning-rate decay, a fine-tuning setting (ELECTRA, BEiT): what comes after the blocks (final
    # norm, classifier head) trains at lr, the last block at lr * layer_decay, each block below at one more
    # factor, the embeddings at lr * layer_decay^(blocks + 1). 1.0: one rate for all (cramming.optim.layer_scales)
    layer_decay: float = 1.0

    # --- GaLore (galore_*), Hugging Face's `optim_args` -----------------------------------------------
    # rank of the projection; the optimizer state of a projected m×n weight is rank×max(m, n)
    rank: int = 128
    # steps between SVDs of the gradient (the projector is also computed at the first step)
    update_proj_gap: int = 200
    # multiplies the projected-back update (the paper: 0.25 pretraining, 2-4 GLUE fine-tuning)
    scale: float = 0.25
    # std: project the smaller side; reverse_std: the larger; left / right: that side; full: both
    proj_type: str = "std"
    # `optim_target_modules`: regexes searched in module names (e.g. ["attn", "ffn"]), or ["all-linear"]
    # for every nn.Linear except the output layer / tied embedding; only 2-D weights are projected
    target_modules: list[str] = field(default_factory=lambda: [ALL_LINEAR])

    # --- low-bit state (*_8bit, *_4bit) --------------------------------------------------------------
    # tensors with fewer elements keep 32-bit moments (bitsandbytes' rule; applies to 4-bit state too)
    min_8bit_size: int = 4096
    # keep the embeddings' moments in 32 bits (bitsandbytes' advice for stability; costs 6 B/param there)
    embedding_32bit: bool = False
    # how 8-bit second moments are stored: sqrt (sqrt(v) on a dynamic map whose smallest code is positive;
    # closest to fp32 AdamW in results/optimizers/quality.md), nonzero (v on that map), or dynamic
    # (bitsandbytes' map: a v below 1.6e-7 of its block's absmax becomes 0, and that element's next step is
    # up to 31x Adam's; see cramming/optim/quant.py). 4-bit state has its own zero-free format; the
    # bitsandbytes backend always uses its own map (dynamic)
    second_moment_map: str = "sqrt"
    # how 4-bit first moments are re-quantized after each step: nearest (round to the nearest of 16 codes)
    # or stochastic (unbiased: with nearest a moment can stick at a code, as 0.9·c rounds back to c;
    # results/optimizers/ measures both). 8-bit state always rounds to nearest
    first_moment_rounding: str = "nearest"
    # what a 4-bit first moment is divided by before it is coded: block (nothing; Li et al.), normalized
    # (sqrt of the element's own stored second moment, so one small-gradient element no longer shares a
    # scale with elements 1,000x larger; cramming/optim/quant.py, results/optimizers/quality.md), or auto
    # (normalized for unprojected tensors, block for GaLore's low-rank moments)
    first_moment_format: str = "block"
    # cramming (ours, every name) or bitsandbytes (bnb.optim.AdamW8bit, for adamw_8bit; needs bitsandbytes)
    backend: str = "cramming"

    def check(self, scope: str = "train.optim") -> None:
        """Ranges and choices, each error naming `{scope}.<key>`: the owner calls this with where the config
        sits (train.optim when pretraining, eval.optim when fine-tuning)."""
        if self.lr <= 0:
            raise config_error(f"{scope}.lr", self.lr, "use a positive learning rate")
        if len(self.betas) != 2 or not all(0.0 <= b < 1.0 for b in self.betas):
            raise config_error(f"{scope}.betas", self.betas, "give two values in [0, 1), e.g. [0.9, 0.98]")
        if self.eps <= 0:
            raise config_error(f"{scope}.eps", self.eps, "use a small positive number")
        if self.weight_decay < 0:
            raise config_error(f"{scope}.weight_decay", self.weight_decay, "use 0 or a positive value")
        if not 0.0 < self.layer_decay <= 1.0:
            raise config_error(
                f"{scope}.layer_decay", self.layer_decay, "use a factor in (0, 1], e.g. 0.8; 1.0 turns it off"
            )
        if self.rank < 1:
            raise config_error(f"{scope}.rank", self.rank, "use a positive rank, e.g. 128 (pretraining) or 8")
        if self.update_proj_gap < 1:
            raise config_error(f"{scope}.update_proj_gap", self.update_proj_gap, "use a positive step count")
        if self.scale <= 0:
            raise config_error(f"{scope}.scale", self.scale, "use a positive scale, e.g. 0.25")
        check_choice(f"{scope}.proj_type", self.proj_type, PROJ_TYPES)
        self._check_targets(scope)
        check_choice(f"{scope}.second_moment_map", self.second_moment_map, SECOND_MOMENT_MAPS)
        check_choice(f"{scope}.backend", self.backend, BACKENDS)
        check_choice(f"{scope}.first_moment_rounding", self.first_moment_rounding, ROUNDINGS)
        check_choice(f"{scope}.first_moment_format", self.first_moment_format, FIRST_MOMENT_CHOICES)
        if self.min_8bit_size < 0:
            raise config_error(
                f"{scope}.min_8bit_size", self.min_8bit_size, "use 0 or a positive element count"
            )

    def _check_targets(self, scope: str) -> None:
        key = f"{scope}.target_modules"
        if not self.target_modules:
            raise config_error(key, self.target_modules, 'name the modules to project, or use ["all-linear"]')
        if ALL_LINEAR in self.target_modules and len(self.target_modules) > 1:
            raise config_error(key, self.target_modules, '"all-linear" stands alone: drop the other entries')
        for target in self.target_modules:
            try:
                re.compile(target)
            except re.error as err:
                raise config_error(key, target, f"not a valid regular expression ({err})") from err
