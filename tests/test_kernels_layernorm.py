"""LayerNorm kernel against its PyTorch reference: output and the gradients of input, weight and bias."""

from __future__ import annotations

import time

import pytest
import torch
from kernel_checks import assert_close, sum_rtol

from cramming.kernels import triton_status

TRITON_OK, TRITON_WHY = triton_status()
pytestmark = pytest.mark.skipif(not TRITON_OK, reason=f"Triton cannot launch here: {TRITON_WHY}")

if TRITON_OK:
    from cramming.kernels.layernorm import _LayerNorm, layer_norm, layer_norm_reference

CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"
needs_gpu = pytest.mark.skipif(not CUDA, reason="needs a CUDA device (bf16 and speed are GPU-only)")

# (atol, rtol) of y and dx against an fp32 reference fed the same inputs: one rounding to x's dtype; the
# order of the sums adds summation_atol (computed from the inputs).
TOL = {torch.float32: (1e-5, 1e-4), torch.float16: (2e-3, 2e-3), torch.bfloat16: (1.6e-2, 1.6e-2)}
# dw and db stay fp32 (the weights are fp32 masters) but sum dtype-rounded products over many rows
PARAM_TOL = {torch.float32: (1e-4, 1e-4), torch.float16: (1e-3, 1e-3), torch.bfloat16: (1e-2, 1e-2)}

SHAPES = [(1, 8), (3, 7, 100), (2, 5, 768), (37, 1000)]  # 37 rows: partial sums over uneven chunks


def _run(fn, x, weight, bias, dy):
    y = fn(x, weight, bias)
    params = (x, weight) if bias is None else (x, weight, bias)
    return y, torch.autograd.grad(y, params, dy)


def summation_atol(x, weight, dy) -> dict[str, float]:
    """Absolute errors that the order of the fp32 sums alone allows (kernel and reference sum in different
    orders): mean and variance sum N = width terms per row, dweight and dbias sum M = rows terms per column.
    x_hat = (x - mean) * rstd is off by sum_rtol(N) * (mean|x| * rstd + |x_hat|); y, dx and the parameter
    gradients carry that and their own sums."""
    x32, w, g = x.detach().float().flatten(0, -2), weight.detach().float(), dy.detach().float().flatten(0, -2)
    rows, width = x32.shape
    rstd = 1 / x32.std(-1, unbiased=False).clamp_min(1e-6)
    x_hat = (x32 - x32.mean(-1, keepdim=True)) * rstd[:, None]
    e_hat = sum_rtol(width) * ((x32.abs().mean(-1) * rstd).max() + x_hat.abs().max()).item()
    wg = (w * g).abs()
    dx = rstd.max().item() * (
        sum_rtol(width) * (wg.mean(-1).max() + x_hat.abs().max() * (wg * x_hat.abs()).mean(-1).max()).item()
        + 2 * e_hat * wg.max().item()
    )
    return {
        "y": w.abs().max().item() * e_hat,
        "dx": dx,
        "dweight": sum_rtol(rows) * (g * x_hat).abs().sum(0).max().item()
        + e_hat * g.abs().sum(0).max().item(),
        "dbias": sum_rtol(rows) * g.abs().sum(0).max().item(),
    }


def _check(x, weight, bias, dy, eps=1e-12, rows_per_tile=None):
    dtype = x.dtype
    y, grads = _run(lambda x, w, b: _LayerNorm.apply(x, w, b, eps, rows_per_tile), x, weight, bias, dy)
    ref_y, ref_grads = _run(lambda x, w, b: layer_norm_reference(x, w, b, eps), x, weight, bias, dy)
    assert y.dtype == dtype and grads[0].dtype == dtype and grads[1].dtype == weight.dtype
    order = summation_atol(x, weight, dy)
    atol, rtol = TOL[dtype]
    assert_close("y", y, ref_y, atol + order["y"], rtol)
    assert_close("dx", grads[0], ref_grads[0], atol + order["dx"], rtol)
    atol, rtol = PARAM_TOL[dtype]
    for name, got, want in zip(("dweight", "dbias")[: len(grads) - 1], grads[1:], ref_grads[1:], strict=True):
        assert_close(name, got, want, atol + order[name], rtol)


def _params(width, bias, dtype=torch.float32):
    weight = (1 + 0.2 * torch.randn(width, device=DEVICE)).to(dtype).requires_grad_()
    b = (0.2 * torch.randn(width, device=DEVICE)).to(dtype).requires_grad_() if bias else None
    return weight, b


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("bias", [False, True], ids=["nobias", "bias"])
def test_matches_reference(shape, dtype, bias):
    # an offset mean and a non-unit spread: a one-pass variance would lose digits here
    x = (3 * torch.randn(shape, device=DEVICE) + 5).to(dtype).requires_grad_()
    weight, b = _params(shape[-1], bias)
    _check(x, weight, b, torch.randn(shape, device=DEVICE, dtype=dtype))


@pytest.mark.parametrize("rows_per_tile", [1, 2])
def test_small_tiles(rows_per_tile):
    # 37 rows in 4 partial sums: several row tiles per program, and a last tile and program cut short
    x = torch.randn(37, 100, device=DEVICE).requires_grad_()
    weight, b = _params(100, bias=True)
    _check(x, weight, b, torch.randn(37, 100, device=DEVICE), rows_per_tile=rows_per_tile)


def test_strided_input_and_output_grad():
    base = torch.randn(64, 6, device=DEVICE)
    x = base.t().requires_grad_()  # (6, 64) with a row stride of 1: the kernel copies it
    weight, b = _params(64, bias=True)
    dy = torch.randn(64, 12, device=DEVICE)[:, ::2].t()  # (6, 64), not contiguous either
    _check(x, weight, b, dy, eps=1e-5)


def test_torch_compile_sees_one_opaque_op():
    x = torch.randn(6, 64, device=DEVICE, requires_grad=True)
    weight, b = _params(64, bias=True)
    dy = torch.randn_like(x)
    compiled = torch.compile(lambda x, w, b: layer_norm(x, w, b), backend="aot_eager", fullgraph=True)
    y, grads = _run(compiled, x, weight, b, dy)
    ref_y, ref_grads = _run(layer_norm, x, weight, b, dy)
    for name, got, want in zip(
        ("y", "dx", "dweight", "dbias"), (y, *grads), (ref_y, *ref_grads), strict=True
    ):
        assert torch.equal(got, want), f"{name}: compiled and eager differ"


def test_constant_rows_stay_finite():
    # zero variance: rstd = 1/sqrt(eps) is large but finite, and x - mean is exactly 0
    x = torch.full((4, 96), 2.5, device=DEVICE, requires_grad=True)
    weight, _ = _params(96, bias=False)
    y = layer_norm(x, weight, None, eps=1e-5)
    (dx,) = torch.autograd.grad(y, x, torch.randn_like(y))
    assert torch.isfinite(y).all() and torch.isfinite(dx).all()
    assert (y == 0).all()


@needs_gpu
@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_gpu_bert_shape(dtype):
    shape = (128, 128, 768)  # 16,384 rows: the weight gradient sums over all of them
    x = torch.randn(shape, device=DEVICE).to(dtype).requires_grad_()
    weight, b = _params(768, bias=True)
    _check(x, weight, b, torch.randn(shape, device=DEVICE, dtype=dtype))


@needs_gpu
@pytest.mark.gpu
def test_gpu_forward_backward_faster_than_torch():
    x = torch.randn(128 * 128, 768, device=DEVICE, dtype=torch.bfloat16, requires_grad=True)
    weight, _ = _params(768, bias=False, dtype=torch.bfloat16)  # one dtype: torch's fastest case
    dy = torch.randn_like(x)

    def timed(fn):
        for _ in range(3):
            _run(fn, x, weight, None, dy)
        torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(20):
            _run(fn, x, weight, None, dy)
        torch.cuda.synchronize()
        return (time.perf_counter() - start) / 20

    ours = timed(lambda x, w, b: layer_norm(x, w, b))
    torch_ln = timed(lambda x, w, b: torch.nn.functional.layer_norm(x, (768,), w, b, 1e-12))
    assert ours < torch_ln, f"layer_norm forward+backward {ours * 1e3:.3f} ms, torch {torch_ln * 1e3:.3f} ms"
