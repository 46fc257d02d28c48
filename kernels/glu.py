"""Gated GELU (the crammed BERT's GLU feed-forward activation), forward and backward in one kernel each.

Shazeer, "GLU Variants Improve Transformer", arXiv 2002.05202. The up-projection gives h = [gate, value]
(two halves of the last dimension, as `h.chunk(2, dim=-1)` splits it) and the activation is

    y = gate * gelu(value),   gelu(v) = v * Phi(v) = 0.5 * v * (1 + erf(v / sqrt(2)))   (exact, F.gelu's default)

Derivative implemented by the backward:

    d gate  = dy * gelu(v)
    d value = dy * gate * gelu'(v),   gelu'(v) = Phi(v) + v * phi(v),   phi(v) = exp(-v^2 / 2) / sqrt(2 pi)

Fusing saves the intermediate gelu(value) PyTorch keeps for the product's backward (one (..., F) tensor
per layer) and turns three elementwise passes forward and four backward into one each.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _glu_fwd_kernel(
    H,  # (M, 2F) strides (sh_m, 1): [gate | value]
    Y,  # (M, F) contiguous
    sh_m,
    F,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = cols < F
    gate = tl.load(H + row * sh_m + cols, mask=ok, other=0.0).to(tl.float32)
    value = tl.load(H + row * sh_m + F + cols, mask=ok, other=0.0).to(tl.float32)
    gelu = 0.5 * value * (1.0 + tl.erf(value * 0.7071067811865476))
    tl.store(Y + row * F + cols, (gate * gelu).to(Y.dtype.element_ty), mask=ok)


@triton.jit
def _glu_bwd_kernel(
    H,  # (M, 2F) strides (sh_m, 1)
    DY,  # (M, F) strides (sdy_m, 1)
    DH,  # (M, 2F) contiguous: [d gate | d value]
    sh_m,
    sdy_m,
    F,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = cols < F
    gate = tl.load(H + row * sh_m + cols, mask=ok, other=0.0).to(tl.float32)
    value = tl.load(H + row * sh_m + F + cols, mask=ok, other=0.0).to(tl.float32)
    dy = tl.load(DY + row * sdy_m + cols, mask=ok, other=0.0).to(tl.float32)
    cdf = 0.5 * (1.0 + tl.erf(value * 0.7071067811865476))
    pdf = tl.exp(-0.5 * value * value) * 0.3989422804014327  # 1 / sqrt(2 pi)
    tl.store(DH + row * 2 * F + cols, (dy * value * cdf).to(DH.dtype.element_ty), mask=ok)
    tl.store(DH + row * 2 * F + F + cols, (dy * gate * (cdf + value * pdf)).to(DH.dtype.element_ty), mask=ok)


# ----------------------------------------------------------------------------------------------------
# Launchers


def glu_tiles(width: int) -> tuple[int, int]:
    """(columns per program, warps) of both kernels for an output of `width` columns; `scripts/checks/aot_check.py`
    compiles these."""
    return min(1024, max(16, triton.next_power_of_2(width))), 4


# The launchers are torch.library custom ops: torch.compile sees each as one opaque call with the shapes
# of its `register_fake`, instead of tracing into Triton's launcher.
@torch.library.custom_op("cramming::gated_gelu_forward", mutates_args=(), schema="(Tensor h2d) -> Tensor")
def _glu_forward(h2d):
    rows, width = h2d.shape[0], h2d.shape[1] // 2
    y = torch.empty(rows, width, device=h2d.device, dtype=h2d.dtype)
    block, warps = glu_tiles(width)
    _glu_fwd_kernel[(rows, triton.cdiv(width, block))](
        h2d, y, h2d.stride(0), width, BLOCK=block, num_warps=warps
    )
    return y


@_glu_forward.register_fake
def _(h2d):
    return h2d.new_empty(h2d.shape[0], h2d.shape[1] // 2)


@torch.library.custom_op(
    "cramming::gated_gelu_backward", mutates_args=(), schema="(Tensor dy2d, Tensor h2d) -> Tensor"
)
def _glu_backward(dy2d, h2d):
    rows, width = dy2d.shape
    dh = torch.empty(rows, 2 * width, device=h2d.device, dtype=h2d.dtype)
    block, warps = glu_tiles(width)
    _glu_bwd_kernel[(rows, triton.cdiv(width, block))](
        h2d, dy2d, dh, h2d.stride(0), dy2d.stride(0), width, BLOCK=block, num_warps=warps
    )
    return dh


@_glu_backward.register_fake
def _(dy2d, h2d):
    return h2d.new_empty(h2d.shape)


class _GatedGelu(torch.autograd.Function):
    @staticmethod
    def forward(ctx, h):
        shape = h.shape
        h2d = h.reshape(-1, shape[-1])
        if h2d.stride(-1) != 1:
            h2d = h2d.contiguous()
        ctx.save_for_backward(h2d)
        return _glu_forward(h2d).view(*shape[:-1], shape[-1] // 2)

    @staticmethod
    def backward(ctx, dy):
        (h2d,) = ctx.saved_tensors
        dy2d = dy.reshape(-1, dy.shape[-1])
        if dy2d.stride(-1) != 1:
            dy2d = dy2d.contiguous()
        return _glu_backward(dy2d, h2d).view(*dy.shape[:-1], 2 * dy.shape[-1])


def gated_gelu(h: torch.Tensor) -> torch.Tensor:
    """gate * gelu(value) for h = [gate | value] along the last dimension: (..., 2F) -> (..., F)."""
    if h.shape[-1] % 2:
        raise ValueError(f"the last dimension of h must be even ([gate | value]), got {h.shape[-1]}")
    return _GatedGelu.apply(h)


def gated_gelu_reference(h: torch.Tensor) -> torch.Tensor:
    """The same in PyTorch, computed in fp32 and returned in h's dtype."""
    gate, value = h.float().chunk(2, dim=-1)
    return (gate * torch.nn.functional.gelu(value)).to(h.dtype)
