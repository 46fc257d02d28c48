"""Comparison helper for the kernel tests: on a mismatch, say where it is and by how much."""

from __future__ import annotations

import torch


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
