"""AdamW with 32-bit or block-wise 8-bit moments, optionally GaLore-projected, optionally layerwise.

One class behind `adamw_8bit`, `galore_adamw`, `galore_adamw_8bit` and their `_layerwise` forms (plain
`adamw` is torch.optim.AdamW). The 8-bit update of an unprojected tensor runs fused on CUDA (the Triton
kernel in cramming.kernels.adamw8bit) and as PyTorch elsewhere; a GaLore group's low-rank moments use the
same update, applied to a zero buffer, to get the normalized low-rank step that is then projected back.
"""

from __future__ import annotations

import importlib.util
import math
from collections.abc import Iterable

import torch

from cramming.optim.base import LeanOptimizer, StateSpec
from cramming.optim.quant import AdamScalars, QuantizedMoments, QuantMap, adamw8bit_update_torch, num_blocks

KERNELS = ("auto", "torch", "triton")
MIN_8BIT_SIZE = 4096  # smaller tensors keep 32-bit moments (their state is negligible, their steps noisy)


class AdamW(LeanOptimizer):
    """AdamW (torch.optim.AdamW's update order) with per-group `optim_bits` 32 or 8 and GaLore groups.

    kernel: "auto" fuses 8-bit updates of CUDA tensors in Triton and uses PyTorch otherwise; "torch" always
    PyTorch; "triton" always the kernel (on CPU only in the Triton interpreter, for tests).
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
        kernel: str = "auto",
        layerwise: bool = False,
        max_grad_norm: float | None = None,
    ) -> None:
        if optim_bits not in (8, 32):
            raise ValueError(f"optim_bits must be 8 or 32, got {optim_bits}")
        if kernel not in KERNELS:
            raise ValueError(f"kernel must be one of {KERNELS}, got {kernel!r}")
        defaults = {
            "lr": lr,
            "betas": tuple(betas),
            "eps": eps,
            "weight_decay": weight_decay,
            "optim_bits": optim_bits,
            "min_8bit_size": min_8bit_size,
        }
        super().__init__(params, defaults, layerwise=layerwise, max_grad_norm=max_grad_norm)
        self.kernel = kernel
        self._triton_installed = importlib.util.find_spec("triton") is not None
        self._maps: dict[torch.device, tuple[QuantMap, QuantMap]] = {}

    def _moment_specs(self, shape: tuple[int, ...], group: dict) -> StateSpec:
        numel = math.prod(shape)
        if group["optim_bits"] == 8 and numel >= group["min_8bit_size"]:
            nb = num_blocks(numel)
            return {
                "m_codes": ((numel,), torch.uint8),
                "m_absmax": ((nb,), torch.float32),
                "v_codes": ((numel,), torch.uint8),
                "v_absmax": ((nb,), torch.float32),
            }
        return {"exp_avg": (shape, torch.float32), "exp_avg_sq": (shape, torch.float32)}

    # --- 8-bit ----------------------------------------------------------------------------------------

    def _quant_maps(self, device: torch.device) -> tuple[QuantMap, QuantMap]:
        """(signed map for the first moment, unsigned for the second), built once per device."""
        if device not in self._maps:
            self._maps[device] = (QuantMap.dynamic(True, device), QuantMap.dynamic(False, device))
        return self._maps[device]

    def _use_triton(self, param: torch.Tensor) -> bool:
        if self.kernel == "auto":
            return param.is_cuda and param.is_contiguous() and self._triton_installed
        return self.kernel == "triton"

    def _update_8bit(self, param: torch.Tensor, grad: torch.Tensor, state: dict, s: AdamScalars) -> None:
        moments = QuantizedMoments(state["m_codes"], state["m_absmax"], state["v_codes"], state["v_absmax"])
        m_map, v_map = self._quant_maps(param.device)
        if self._use_triton(param):
            from cramming.kernels.adamw8bit import adamw8bit_update_triton

            adamw8bit_update_triton(param, grad, moments, m_map, v_map, s)
        else:
            adamw8bit_update_torch(param, grad, moments, m_map, v_map, s)

    # --- the update -----------------------------------------------------------------------------------

    def _direction(self, grad: torch.Tensor, state: dict, group: dict, step: int) -> torch.Tensor:
        """m̂ / (sqrt(v̂) + eps) in the moments' space (GaLore's low-rank gradient)."""
        if "m_codes" in state:
            # the fused update on a zero "parameter" with lr 1 and no decay leaves -m̂/(sqrt(v̂)+eps) in it
            out = torch.zeros_like(grad, dtype=torch.float32)
            self._update_8bit(
                out, grad, state, AdamScalars.at_step(step, 1.0, group["betas"], group["eps"], 0.0)
            )
            return out.neg_()
        exp_avg, denom, step_size = self._adam_moments(grad, state, group, step, lr=1.0)
        return (exp_avg / denom).mul_(step_size)

    def _update_full(
        self, param: torch.Tensor, grad: torch.Tensor, state: dict, group: dict, step: int
    ) -> None:
        lr, wd = group["lr"], group["weight_decay"]
        if "m_codes" in state:
            self._update_8bit(
                param, grad, state, AdamScalars.at_step(step, lr, group["betas"], group["eps"], wd)
            )
            return
        work = param if param.dtype == torch.float32 else param.float()
        work.mul_(1.0 - lr * wd)
        exp_avg, denom, step_size = self._adam_moments(grad.float(), state, group, step, lr=lr)
        work.addcdiv_(exp_avg, denom, value=-step_size)
        if work is not param:
            param.copy_(work)

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
