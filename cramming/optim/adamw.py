"""AdamW with 32-, 8- or 4-bit moments, optionally GaLore-projected, optionally layerwise.

One class behind `adamw_8bit`, `adamw_4bit`, `galore_adamw`, `galore_adamw_8bit`, `galore_adamw_4bit` and
their `_layerwise` forms (plain `adamw` is torch.optim.AdamW). The 8-bit update of an unprojected tensor runs
fused on CUDA (the Triton kernel in cramming.kernels.adamw8bit) and as PyTorch elsewhere (and whenever
Triton cannot launch); the 4-bit update is PyTorch only. A GaLore group's low-rank moments use the same
update, applied to a zero buffer, to get the normalized low-rank step that is then projected back.

Each quantized state records its second-moment format (`v_map`, a string, so `torch.load(weights_only=True)`
reads it), and a 4-bit one its first-moment format (`m_format`). A state saved before those entries existed
is 8-bit with the `dynamic` map, or 4-bit in the `block` format; `load_state_dict` re-encodes an 8-bit second
moment into this optimizer's map and a 4-bit first moment into its format, and refuses 8-bit state for a
4-bit optimizer (and the reverse) with a message naming the optimizer to resume with.
"""

from __future__ import annotations

import dataclasses
import logging
import math
from collections.abc import Iterable

import torch

from cramming.kernels import triton_status
from cramming.optim.base import LeanOptimizer, RowShard, StateSpec
from cramming.optim.lowbit import (
    RANK1_DYNAMIC4,
    AdamScalars,
    Maps4bit,
    QuantizedMoments,
    adamw4bit_update_torch,
    adamw8bit_update_torch,
    convert_first_moment_4bit,
    convert_second_moment,
    saved_first_moment_format,
    saved_format,
    specs_4bit,
    specs_8bit,
)
from cramming.optim.quant import (
    FIRST_MOMENT_CHOICES,
    ROUNDINGS,
    SECOND_MOMENT_MAPS,
    QuantMap,
    first_moment_map,
    second_moment_map,
)

log = logging.getLogger(__name__)

KERNELS = ("auto", "torch", "triton")
MIN_8BIT_SIZE = 4096  # smaller tensors keep 32-bit moments (their state is negligible, their steps noisy)
DEFAULT_SECOND_MOMENT_MAP = "sqrt"  # measured best on wide-ranged blocks: results/optimizers/quality.md
DEFAULT_FIRST_MOMENT_FORMAT = "block"


class AdamW(LeanOptimizer):
    """AdamW (torch.optim.AdamW's update order) with per-group `optim_bits` 32, 8 or 4 and GaLore groups.

    second_moment_map: how 8-bit second moments are stored, a SECOND_MOMENT_MAPS name ("dynamic" is
        bitsandbytes' map, whose zero point blows steps up on wide-ranged blocks; see cramming.optim.quant).
        4-bit state has its own format (cramming.optim.lowbit.specs_4bit).
    first_moment_rounding: how 4-bit first moments are re-quantized, "nearest" or "stochastic" (unbiased;
        round-to-nearest lets a 16-code moment stick, see cramming.optim.lowbit.adamw4bit_update_torch).
    first_moment_format: what a 4-bit first moment is divided by before it is coded: "block" (nothing, Li et
        al.), "normalized" (sqrt of its own stored second moment; see cramming.optim.quant), or "auto"
        (normalized for unprojected tensors, block for GaLore's low-rank moments). A state saved in the
        other format is converted when loaded.
    kernel: "auto" fuses 8-bit updates of CUDA tensors in Triton when `triton_status` says a kernel can
        launch there, and uses PyTorch otherwise; "torch" always PyTorch; "triton" always the kernel (on CPU
        only in the Triton interpreter, for tests).
    """

    def __init__(
        self,
        params: Iterable,
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.01,
        *,
        optim_bits: int = 32,
        min_8bit_size: int = MIN_8BIT_SIZE,
        second_moment_map: str = DEFAULT_SECOND_MOMENT_MAP,
        first_moment_rounding: str = "nearest",
        first_moment_format: str = DEFAULT_FIRST_MOMENT_FORMAT,
        kernel: str = "auto",
        layerwise: bool = False,
        max_grad_norm: float | None = None,
        reduce_group: torch.distributed.ProcessGroup | None = None,
        reduce_order: Iterable[torch.Tensor] = (),
    ) -> None:
        if optim_bits not in (4, 8, 32):
            raise ValueError(f"optim_bits must be 4, 8 or 32, got {optim_bits}")
        if first_moment_rounding not in ROUNDINGS:
            raise ValueError(
                f"first_moment_rounding must be one of {ROUNDINGS}, got {first_moment_rounding!r}"
            )
        if first_moment_format not in FIRST_MOMENT_CHOICES:
            raise ValueError(
                f"first_moment_format must be one of {FIRST_MOMENT_CHOICES}, got {first_moment_format!r}"
            )
        if kernel not in KERNELS:
            raise ValueError(f"kernel must be one of {KERNELS}, got {kernel!r}")
        if second_moment_map not in SECOND_MOMENT_MAPS:
            raise ValueError(
                f"second_moment_map must be one of {tuple(SECOND_MOMENT_MAPS)}, got {second_moment_map!r}"
            )
        defaults = {
            "lr": lr,
            "betas": tuple(betas),
            "eps": eps,
            "weight_decay": weight_decay,
            "optim_bits": optim_bits,
            "min_8bit_size": min_8bit_size,
        }
        super().__init__(
            params,
            defaults,
            layerwise=layerwise,
            max_grad_norm=max_grad_norm,
            reduce_group=reduce_group,
            reduce_order=reduce_order,
        )
        self.kernel = kernel
        self.second_moment_map = second_moment_map
        self.first_moment_rounding = first_moment_rounding
        self.first_moment_format = first_moment_format
        self._maps: dict[torch.device, tuple[QuantMap, QuantMap, Maps4bit]] = {}
        self._triton_ok: dict[str, bool] = {}

    @staticmethod
    def _bits(numel: int, group: dict) -> int:
        """The state precision of a tensor of `numel` elements in `group`."""
        return group["optim_bits"] if numel >= group["min_8bit_size"] else 32

    def _moment_specs(self, shape: tuple[int, ...], group: dict, whole_numel: int | None = None) -> StateSpec:
        bits = self._bits(math.prod(shape) if whole_numel is None else whole_numel, group)
        if bits == 8:
            return specs_8bit(math.prod(shape))
        if bits == 4:
            return specs_4bit(shape)
        return {"exp_avg": (shape, torch.float32), "exp_avg_sq": (shape, torch.float32)}

    def _state_tags(self, shape: tuple[int, ...], group: dict, whole_numel: int | None = None) -> dict:
        bits = self._bits(math.prod(shape) if whole_numel is None else whole_numel, group)
        if bits == 4:
            return {"v_map": RANK1_DYNAMIC4, "m_format": self._first_moment_format(group)}
        return {"v_map": self.second_moment_map} if bits == 8 else {}

    def _first_moment_format(self, group: dict) -> str:
        """The 4-bit first-moment format of `group`'s tensors (`auto` resolved by whether GaLore projects them)."""
        if self.first_moment_format != "auto":
            return self.first_moment_format
        return "block" if group["rank"] > 0 else "normalized"

    # --- quantized ------------------------------------------------------------------------------------

    def _quant_maps(self, device: torch.device) -> tuple[QuantMap, QuantMap, Maps4bit]:
        """(8-bit first-moment map, 8-bit second-moment map, 4-bit maps), built once per device."""
        if device not in self._maps:
            self._maps[device] = (
                first_moment_map(8, device),
                second_moment_map(self.second_moment_map, device),
                Maps4bit.build(device),
            )
        return self._maps[device]

    def _use_triton(self, param: torch.Tensor) -> bool:
        if self.kernel != "auto":
            return self.kernel == "triton"
        return param.is_contiguous() and self._can_launch(param.device.type)

    def _can_launch(self, device_type: str) -> bool:
        """kernel="auto": whether the fused update runs on `device_type` (CUDA only: the interpreter is for
        tests, never chosen by itself); asked once per device type, a fallback is logged once."""
        if device_type != "cuda":
            return False
        if device_type not in self._triton_ok:
            ok, why = triton_status(device_type)
            self._triton_ok[device_type] = ok
            if not ok:
                log.warning("8-bit AdamW: the fused Triton update cannot launch (%s); using PyTorch", why)
        return self._triton_ok[device_type]

    def _update_quantized(self, param: torch.Tensor, grad: torch.Tensor, state: dict, s: AdamScalars) -> None:
        m_map, v_map, maps4 = self._quant_maps(param.device)
        if state["v_map"] == RANK1_DYNAMIC4:
            stochastic = state["step"] if self.first_moment_rounding == "stochastic" else None
            normalized = saved_first_moment_format(state) == "normalized"
            adamw4bit_update_torch(param, grad, state, maps4, s, stochastic, normalized)
            return
        sqrt_v = SECOND_MOMENT_MAPS[self.second_moment_map].sqrt
        if self._use_triton(param):
            from cramming.kernels.adamw8bit import adamw8bit_update_triton

            adamw8bit_update_triton(
                param,
                grad,
                *(state[k] for k in ("m_codes", "m_absmax", "v_codes", "v_absmax")),
                m_map.code,
                v_map.code,
                **dataclasses.asdict(s),
                sqrt_v=sqrt_v,
            )
        else:
            moments = QuantizedMoments(
                state["m_codes"], state["m_absmax"], state["v_codes"], state["v_absmax"]
            )
            adamw8bit_update_torch(param, grad, moments, m_map, v_map, s, sqrt_v=sqrt_v)

    # --- the update -----------------------------------------------------------------------------------

    def _direction(
        self, grad: torch.Tensor, state: dict, group: dict, step: int, rows: RowShard | None = None
    ) -> torch.Tensor:
        """m̂ / (sqrt(v̂) + eps) in the moments' space (GaLore's low-rank gradient). Elementwise, and quantized
        blocks end at a shard's boundary: a rank's rows need no communication."""
        if "m_codes" in state:
            # the fused update on a zero "parameter" with lr 1 and no decay leaves -m̂/(sqrt(v̂)+eps) in it
            out = torch.zeros_like(grad, dtype=torch.float32)
            self._update_quantized(
                out, grad, state, AdamScalars.at_step(step, 1.0, group["betas"], group["eps"], 0.0)
            )
            return out.neg_()
        exp_avg, denom, step_size = self._adam_moments(grad, state, group, step, lr=1.0)
        return (exp_avg / denom).mul_(step_size)

    def _update_full(
        self,
        param: torch.Tensor,
        grad: torch.Tensor,
        state: dict,
        group: dict,
        step: int,
        rows: RowShard | None = None,
    ) -> None:
        lr, wd = group["lr"], group["weight_decay"]
        if "m_codes" in state:
            self._update_quantized(
                param, grad, state, AdamScalars.at_step(step, lr, group["betas"], group["eps"], wd)
            )
            return
        work = param if param.dtype == torch.float32 else param.float()
        work.mul_(1.0 - lr * wd)
        exp_avg, denom, step_size = self._adam_moments(grad.float(), state, group, step, lr=lr)
        work.addcdiv_(exp_avg, denom, value=-step_size)
        if work is not param:
            param.copy_(work)

    # --- state dict -------------------------------------------------------------------------------------

    def load_state_dict(self, state_dict: dict) -> None:
        """As LeanOptimizer's, then bring each quantized state to this optimizer's format: an 8-bit second
        moment saved with another map (or before maps were recorded: `dynamic`) is re-encoded, and so is a
        4-bit first moment saved in another format (or before formats were recorded: `block`); a 4-bit
        state for an 8-bit optimizer, or the reverse, is refused."""
        # the precision is this optimizer's (the saved groups would bring theirs back with them)
        precision = [{k: g[k] for k in ("optim_bits", "min_8bit_size")} for g in self.param_groups]
        super().load_state_dict(state_dict)
        for group, own in zip(self.param_groups, precision, strict=True):
            group.update(own)
        for group in self.param_groups:
            for param in group["params"]:
                state = self.state.get(param)
                if not state or "m_codes" not in state:
                    continue
                saved = saved_format(state)
                whole_numel = self._whole_moment_numel(param, group)
                wanted = self._state_tags(self.moment_shape(param, group), group, whole_numel).get("v_map")
                saved_bits = 4 if saved == RANK1_DYNAMIC4 else 8
                if wanted is None or (wanted == RANK1_DYNAMIC4) != (saved_bits == 4):
                    wanted_bits = 32 if wanted is None else 4 if wanted == RANK1_DYNAMIC4 else 8
                    raise ValueError(
                        f"optimizer state of a {tuple(param.shape)} parameter is {saved_bits}-bit, this optimizer "
                        f"keeps it in {wanted_bits} bits: resume with the optimizer that saved it (e.g. "
                        f"`train.optim.name=adamw_{saved_bits}bit` or the galore_ form) or start the optimizer "
                        "state afresh"
                    )
                if saved_bits == 8:
                    moments = QuantizedMoments(
                        state["m_codes"], state["m_absmax"], state["v_codes"], state["v_absmax"]
                    )
                    convert_second_moment(moments, saved, wanted)
                else:
                    shape = self.moment_shape(param, group)
                    maps4 = self._quant_maps(state["m_codes"].device)[2]
                    wanted_m = self._first_moment_format(group)
                    convert_first_moment_4bit(state, shape, maps4, saved_first_moment_format(state), wanted_m)
                    state["m_format"] = wanted_m
                state["v_map"] = wanted

    @staticmethod
    def _adam_moments(
        grad: torch.Tensor, state: dict, group: dict, step: int, lr: float
    ) -> tuple[torch.Tensor, torch.Tensor, float]:
        """Update the fp32 moments as torch.optim.AdamW does; return (m, sqrt(v)/sqrt(1-b2^t) + eps, lr/(1-b1^t))."""
        beta1, beta2 = group["betas"]
        exp_avg, exp_avg_sq = state["exp_avg"], state["exp_avg_sq"]
        exp_avg.lerp_(grad, 1.0 - beta1)
        exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1.0 - beta2)
        denom = (exp_avg_sq.sqrt() / math.sqrt(1.0 - beta2**step)).add_(group["eps"])
        return exp_avg, denom, lr / (1.0 - beta1**step)
