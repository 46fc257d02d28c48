"""Comparison helpers for the kernel tests: on a mismatch, say where it is and by how much; tolerances for
results that differ only by the order of their sums."""

from __future__ import annotations

import math

import torch

# λ of the probabilistic rounding-error bound (Higham & Mary, SIAM J. Sci. Comput. 2019): a sum of n terms
# accumulated in a dtype of unit roundoff u is off by at most λ·sqrt(n)·u·Σ|terms| with probability at least
# 1 - 2·exp(-λ²/2) (≈ 3e-14 for λ = 8), whatever the order, the SIMD width or the FMA choices. The worst-case
# bound, n·u·Σ|terms|, is far looser than any order a machine actually takes.
LAMBDA = 8.0


def unit_roundoff(dtype: torch.dtype) -> float:
    return torch.finfo(dtype).eps / 2


def sum_rtol(length: int, dtype: torch.dtype = torch.float32) -> float:
    """How far apart two sums of the same `length` terms in `dtype`, taken in any two orders (kernel and
    reference), may be, relative to the sum of the terms' magnitudes."""
    return 2 * LAMBDA * math.sqrt(max(length, 1)) * unit_roundoff(dtype)


def assert_close(name: str, got: torch.Tensor, want: torch.Tensor, atol: float, rtol: float) -> None:
    """Elementwise |got - want| <= atol + rtol * |want|, compared in fp32; NaN/inf in `got` fails."""
    assert got.shape == want.shape, f"{name}: shape {tuple(got.shape)} != reference {tuple(want.shape)}"
    got32, want32 = got.detach().float(), want.detach().float()
    assert torch.isfinite(got32).all(), f"{name}: non-finite values at {_where(~torch.isfinite(got32))}"
    err = (got32 - want32).abs()
    excess = err - (atol + rtol * want32.abs())
    if (excess > 0).any():
        flat = int(excess.argmax())
        idx = tuple(int(i) for i in torch.unravel_index(torch.tensor(flat), err.shape))
        raise AssertionError(
            f"{name}: {int((excess > 0).sum())} of {err.numel()} elements off (atol {atol}, rtol {rtol}); "
            f"max abs error {err.max().item():.3g} at {_where(err == err.max())}; worst relative to the "
            f"tolerance at {idx}: got {got32[idx].item():.6g}, want {want32[idx].item():.6g}"
        )


def _where(mask: torch.Tensor) -> tuple[int, ...]:
    return tuple(int(i) for i in mask.nonzero()[0])
