"""LayerNorm over the last dimension, forward and backward, with weight and optional bias.

Ba, Kiros & Hinton, "Layer Normalization", arXiv 1607.06450. For one row x of width N, in fp32:

    mean = sum(x) / N,   rstd = 1 / sqrt(sum((x - mean)^2) / N + eps),   xhat = (x - mean) * rstd
    y = xhat * w + b

Derivative implemented by the backward, with g = dy * w:

    dx = rstd * (g - mean(g) - xhat * mean(g * xhat))
    dw = sum over rows of dy * xhat,   db = sum over rows of dy

Both kernels work on tiles of whole rows (a row must fit in one block: width <= 65536). The forward saves
mean and rstd per row (8 bytes a row) so the backward does not recompute them. The weight and bias
gradients are summed by each backward program over its own contiguous chunk of rows into one fp32
partial row (4 programs per SM on a GPU), and those few hundred partial rows are summed afterwards: no
atomics at all.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _layer_norm_fwd_kernel(
    X,  # (M, N) strides (sx_m, 1)
    W,  # (N,)
    B,  # (N,); unused when not HAS_BIAS
    Y,  # (M, N) contiguous
    MEAN,  # (M,) fp32
    RSTD,  # (M,) fp32
    sx_m,
    M,
    N,
    eps,
    HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr,  # rows per program
    BLOCK_N: tl.constexpr,  # a whole row, padded to a power of two
):
    rows = tl.program_id(0).to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.arange(0, BLOCK_N)
    ok = (rows < M)[:, None] & (cols < N)[None, :]
    x = tl.load(X + rows[:, None] * sx_m + cols[None, :], mask=ok, other=0.0).to(tl.float32)
    mean = tl.sum(x, axis=1) / N  # (BLOCK_M,)
    xc = tl.where(ok, x - mean[:, None], 0.0)  # two passes over registers: no cancellation
    rstd = 1.0 / tl.sqrt(tl.sum(xc * xc, axis=1) / N + eps)
    y = xc * rstd[:, None] * tl.load(W + cols, mask=cols < N, other=0.0).to(tl.float32)[None, :]
    if HAS_BIAS:
        y += tl.load(B + cols, mask=cols < N, other=0.0).to(tl.float32)[None, :]
    tl.store(Y + rows[:, None] * N + cols[None, :], y.to(Y.dtype.element_ty), mask=ok)
    tl.store(MEAN + rows, mean, mask=rows < M)
    tl.store(RSTD + rows, rstd, mask=rows < M)


@triton.jit
def _layer_norm_bwd_kernel(
    X,  # (M, N) strides (sx_m, 1)
    DY,  # (M, N) strides (sdy_m, 1)
    W,  # (N,)
    MEAN,  # (M,) fp32
    RSTD,  # (M,) fp32
    DX,  # (M, N) contiguous
    DW_PART,  # (G, N) fp32: this program's sum of dy * xhat over its rows
    DB_PART,  # (G, N) fp32: this program's sum of dy; unused when not HAS_BIAS
    sx_m,
    sdy_m,
    M,
    N,
    rows_per_program,  # a multiple of BLOCK_M
    HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr,  # rows per step
    BLOCK_N: tl.constexpr,
):
    pid = tl.program_id(0)
    cols = tl.arange(0, BLOCK_N)
    col_ok = cols < N
    w = tl.load(W + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    dw = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    db = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    row_start = pid.to(tl.int64) * rows_per_program
    row_end = tl.minimum(row_start + rows_per_program, M)
    for start in range(row_start, row_end, BLOCK_M):
        rows = start + tl.arange(0, BLOCK_M)
        row_ok = rows < row_end
        ok = row_ok[:, None] & col_ok[None, :]
        x = tl.load(X + rows[:, None] * sx_m + cols[None, :], mask=ok, other=0.0).to(tl.float32)
        dy = tl.load(DY + rows[:, None] * sdy_m + cols[None, :], mask=ok, other=0.0).to(tl.float32)
        mean = tl.load(MEAN + rows, mask=row_ok, other=0.0)
        rstd = tl.load(RSTD + rows, mask=row_ok, other=0.0)
        xhat = tl.where(ok, (x - mean[:, None]) * rstd[:, None], 0.0)
        g = dy * w
        dx = rstd[:, None] * (
            g - (tl.sum(g, axis=1) / N)[:, None] - xhat * (tl.sum(g * xhat, axis=1) / N)[:, None]
        )
        tl.store(DX + rows[:, None] * N + cols[None, :], dx.to(DX.dtype.element_ty), mask=ok)
        dw += dy * xhat
        if HAS_BIAS:
            db += dy
    tl.store(DW_PART + pid * N + cols, tl.sum(dw, axis=0), mask=col_ok)
    if HAS_BIAS:
        tl.store(DB_PART + pid * N + cols, tl.sum(db, axis=0), mask=col_ok)


# ----------------------------------------------------------------------------------------------------
# Launchers


def layer_norm_tiles(width: int, on_gpu: bool) -> tuple[int, int, int]:
    """(rows per tile, padded row width, warps) of both kernels; `scripts/checks/aot_check.py` compiles these.

    On a GPU, tiles of about 4096 elements (16 fp32 registers a thread at 8 warps); in the interpreter,
    where every program costs milliseconds, as many rows as fit in 16384 elements."""
    block_n = triton.next_power_of_2(width)
    if not on_gpu:
        return max(1, 16384 // block_n), block_n, 4
    block_m = max(1, min(16, 4096 // block_n))
    return block_m, block_n, min(16, max(4, block_m * block_n // 512))


def _tiles(width: int, device: torch.device, rows_per_tile: int | None) -> tuple[int, int, int]:
    if rows_per_tile is not None:  # tests force small tiles to exercise the loops
        return rows_per_tile, triton.next_power_of_2(width), 4
    return layer_norm_tiles(width, device.type == "cuda")


# The launchers are torch.library custom ops: torch.compile sees each as one opaque call with the shapes
# of its `register_fake`, instead of tracing into Triton's launcher.
@torch.library.custom_op(
    "cramming::layer_norm_forward",
    mutates_args=(),
    schema="(Tensor x2d, Tensor weight, Tensor? bias, float eps, int? rows_per_tile) -> (Tensor, Tensor, Tensor)",
)
def _layer_norm_forward(x2d, weight, bias, eps, rows_per_tile):
    rows, width = x2d.shape
    y = torch.empty(rows, width, device=x2d.device, dtype=x2d.dtype)
    mean = torch.empty(rows, device=x2d.device, dtype=torch.float32)
    rstd = torch.empty(rows, device=x2d.device, dtype=torch.float32)
    block_m, block_n, warps = _tiles(width, x2d.device, rows_per_tile)
    _layer_norm_fwd_kernel[(triton.cdiv(rows, block_m),)](
        x2d, weight, bias if bias is not None else weight, y, mean, rstd, x2d.stride(0), rows, width, eps,
        HAS_BIAS=bias is not None, BLOCK_M=block_m, BLOCK_N=block_n, num_warps=warps,
    )  # fmt: skip
    return y, mean, rstd


@_layer_norm_forward.register_fake
def _(x2d, weight, bias, eps, rows_per_tile):
    rows = x2d.shape[0]
    return (
        torch.empty_like(x2d),
        x2d.new_empty(rows, dtype=torch.float32),
        x2d.new_empty(rows, dtype=torch.float32),
    )


def _num_partials(rows: int, device: torch.device) -> int:
    # Enough programs to fill the GPU a few times over; each writes one fp32 partial row of dw (and db).
    if device.type == "cuda":
        return 4 * torch.cuda.get_device_properties(device).multi_processor_count
    return 4  # the interpreter runs programs one after another


@torch.library.custom_op(
    "cramming::layer_norm_backward",
    mutates_args=(),
    schema="(Tensor dy2d, Tensor x2d, Tensor weight, Tensor? bias, Tensor mean, Tensor rstd, int? rows_per_tile) "
    "-> (Tensor, Tensor, Tensor)",
)
def _layer_norm_backward(dy2d, x2d, weight, bias, mean, rstd, rows_per_tile):
    """(dx, dweight, dbias); dbias is empty when there is no bias."""
    rows, width = x2d.shape
    dy2d = dy2d if dy2d.stride(-1) == 1 else dy2d.contiguous()
    block_m, block_n, warps = _tiles(width, x2d.device, rows_per_tile)
    rows_per_program = block_m * triton.cdiv(triton.cdiv(rows, _num_partials(rows, x2d.device)), block_m)
    programs = triton.cdiv(rows, rows_per_program)
    dx = torch.empty(rows, width, device=x2d.device, dtype=x2d.dtype)
    dw_part = torch.empty(programs, width, device=x2d.device, dtype=torch.float32)
    db_part = torch.empty_like(dw_part) if bias is not None else dw_part
    _layer_norm_bwd_kernel[(programs,)](
        x2d, dy2d, weight, mean, rstd, dx, dw_part, db_part,
        x2d.stride(0), dy2d.stride(0), rows, width, rows_per_program,
        HAS_BIAS=bias is not None, BLOCK_M=block_m, BLOCK_N=block_n, num_warps=warps,
    )  # fmt: skip
    dw = dw_part.sum(dim=0).to(weight.dtype)
    db = db_part.sum(dim=0).to(bias.dtype) if bias is not None else weight.new_empty(0)
    return dx, dw, db


@_layer_norm_backward.register_fake
def _(dy2d, x2d, weight, bias, mean, rstd, rows_per_tile):
    return (
        torch.empty_like(x2d),
        torch.empty_like(weight),
        torch.empty_like(bias if bias is not None else weight[:0]),
    )


class _LayerNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, eps, rows_per_tile=None):
        shape = x.shape
        x2d = x.reshape(-1, shape[-1])
        if x2d.stride(-1) != 1:
            x2d = x2d.contiguous()
        y, mean, rstd = _layer_norm_forward(x2d, weight, bias, eps, rows_per_tile)
        ctx.rows_per_tile = rows_per_tile
        ctx.save_for_backward(x2d, weight, bias, mean, rstd)
        return y.view(shape)

    @staticmethod
    def backward(ctx, dy):
        x2d, weight, bias, mean, rstd = ctx.saved_tensors
        dx, dw, db = _layer_norm_backward(
            dy.reshape(x2d.shape), x2d, weight, bias, mean, rstd, ctx.rows_per_tile
        )
        return dx.view(dy.shape), dw, db if bias is not None else None, None, None


def layer_norm(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, eps: float = 1e-12
) -> torch.Tensor:
    """LayerNorm of x over its last dimension, statistics in fp32; y has x's dtype.

    x: (..., N) fp32/fp16/bf16; weight, bias: (N,), any float dtype (fp32 master weights under autocast).
    """
    width = x.shape[-1]
    if weight.shape != (width,) or (bias is not None and bias.shape != (width,)):
        raise ValueError(f"weight and bias must be ({width},), got {tuple(weight.shape)} and "
                         f"{None if bias is None else tuple(bias.shape)}")  # fmt: skip
    if width > 65536:
        raise ValueError(f"rows of {width} elements do not fit one block; the limit is 65536")
    return _LayerNorm.apply(x, weight, bias, float(eps))


def layer_norm_reference(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, eps: float = 1e-12
) -> torch.Tensor:
    """LayerNorm computed in fp32 by PyTorch, returned in x's dtype."""
    b = None if bias is None else bias.float()
    return torch.nn.functional.layer_norm(x.float(), (x.shape[-1],), weight.float(), b, eps).to(x.dtype)
