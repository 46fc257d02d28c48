"""Fused gated GELU against its PyTorch reference: output and the gradient of [gate | value]."""

from __future__ import annotations

import pytest
import torch
from kernel_checks import assert_close

from cramming.kernels import triton_status

TRITON_OK, TRITON_WHY = triton_status()
pytestmark = pytest.mark.skipif(not TRITON_OK, reason=f"Triton cannot launch here: {TRITON_WHY}")

if TRITON_OK:
    from cramming.kernels.glu import gated_gelu, gated_gelu_reference

CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"

# fp32: outputs reach ~50 here, so a few 1e-6 of absolute rounding (the tanh GELU would be 5e-4 off)
TOL = {torch.float32: (1e-5, 1e-5), torch.float16: (1e-3, 2e-3), torch.bfloat16: (8e-3, 1.6e-2)}


def _check(h, dy):
    y = gated_gelu(h)
    (dh,) = torch.autograd.grad(y, h, dy)
    ref_y = gated_gelu_reference(h)
    (ref_dh,) = torch.autograd.grad(ref_y, h, dy)
    assert_close("y", y, ref_y, *TOL[h.dtype])
    assert_close("dgate", dh[..., : h.shape[-1] // 2], ref_dh[..., : h.shape[-1] // 2], *TOL[h.dtype])
    assert_close("dvalue", dh[..., h.shape[-1] // 2 :], ref_dh[..., h.shape[-1] // 2 :], *TOL[h.dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("shape", [(1, 2), (3, 7, 100), (2, 5, 3072)], ids=lambda s: "x".join(map(str, s)))
def test_matches_reference(shape, dtype):
    # (2, 5, 3072): the crammed BERT's 2 x 1536, two column blocks of which the second is ragged
    h = (2 * torch.randn(shape, device=DEVICE)).to(dtype).requires_grad_()
    _check(h, torch.randn(*shape[:-1], shape[-1] // 2, device=DEVICE, dtype=dtype))


def test_strided_input():
    h = torch.randn(40, 6, device=DEVICE).t().requires_grad_()  # (6, 40), columns contiguous
    _check(h, torch.randn(6, 20, device=DEVICE))


def test_torch_compile_sees_one_opaque_op():
    h = torch.randn(6, 64, device=DEVICE, requires_grad=True)
    compiled = torch.compile(gated_gelu, backend="aot_eager", fullgraph=True)
    y = compiled(h)
    (dh,) = torch.autograd.grad(y.sum(), h)
    assert torch.equal(y, gated_gelu(h)) and torch.equal(dh, torch.autograd.grad(gated_gelu(h).sum(), h)[0])


def test_rejects_odd_width():
    with pytest.raises(ValueError, match="even"):
        gated_gelu(torch.randn(2, 5, device=DEVICE))


@pytest.mark.skipif(not CUDA, reason="needs a CUDA device (bf16 is GPU-only)")
@pytest.mark.gpu
def test_gpu_bf16_bert_shape():
    h = torch.randn(128, 128, 3072, device=DEVICE, dtype=torch.bfloat16, requires_grad=True)
    _check(h, torch.randn(128, 128, 1536, device=DEVICE, dtype=torch.bfloat16))
