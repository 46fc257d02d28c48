"""Fused cross-entropy against F.cross_entropy on fp32 logits: loss and the gradient of the logits."""

from __future__ import annotations

import pytest
import torch
from kernel_checks import assert_close

from cramming.kernels import triton_status

TRITON_OK, TRITON_WHY = triton_status()
pytestmark = pytest.mark.skipif(not TRITON_OK, reason=f"Triton cannot launch here: {TRITON_WHY}")

if TRITON_OK:
    from cramming.kernels.cross_entropy import cross_entropy, cross_entropy_reference

CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"
IGNORE = -100

# the loss is compared in fp32 either way; dlogits is rounded once to the logits' dtype
TOL = {torch.float32: (1e-6, 1e-5), torch.float16: (1e-6, 2e-3), torch.bfloat16: (1e-5, 1.6e-2)}


def _check(logits, labels):
    loss = cross_entropy(logits, labels, IGNORE)
    (grad,) = torch.autograd.grad(2.0 * loss, logits)  # a non-unit upstream gradient
    ref_loss = cross_entropy_reference(logits, labels, IGNORE)
    (ref_grad,) = torch.autograd.grad(2.0 * ref_loss, logits)
    assert_close("loss", loss, ref_loss, 1e-5, 1e-5)
    assert grad.dtype == logits.dtype
    assert_close("dlogits", grad, ref_grad, *TOL[logits.dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("rows,vocab", [(1, 10), (37, 1000), (5, 5000)], ids=["1x10", "37x1000", "5x5000"])
def test_matches_reference(rows, vocab, dtype):
    # 5000 = one full 4096 block and a ragged one; large logits test the online log-sum-exp
    logits = (4 * torch.randn(rows, vocab, device=DEVICE)).to(dtype).requires_grad_()
    labels = torch.randint(0, vocab, (rows,), device=DEVICE)
    if rows > 1:
        labels[::3] = IGNORE
    _check(logits, labels)


def test_torch_compile_sees_one_opaque_op():
    logits = torch.randn(6, 50, device=DEVICE, requires_grad=True)
    labels = torch.tensor([3, IGNORE, 0, 49, 7, IGNORE], device=DEVICE)
    compiled = torch.compile(cross_entropy, backend="aot_eager", fullgraph=True)
    loss = compiled(logits, labels)
    (grad,) = torch.autograd.grad(loss, logits)
    ref_loss = cross_entropy(logits, labels)
    assert torch.equal(loss, ref_loss) and torch.equal(grad, torch.autograd.grad(ref_loss, logits)[0])


def test_no_labelled_row_gives_zero_not_nan():
    logits = torch.randn(4, 50, device=DEVICE, requires_grad=True)
    loss = cross_entropy(logits, torch.full((4,), IGNORE, device=DEVICE), IGNORE)
    (grad,) = torch.autograd.grad(loss, logits)
    assert loss.item() == 0.0 and (grad == 0).all()


@pytest.mark.skipif(not CUDA, reason="needs a CUDA device (bf16 is GPU-only)")
@pytest.mark.gpu
def test_gpu_bf16_sparse_mlm_shape():
    # 128 sequences x 32 masked positions, vocabulary 32768
    logits = (3 * torch.randn(4096, 32768, device=DEVICE)).to(torch.bfloat16).requires_grad_()
    _check(logits, torch.randint(0, 32768, (4096,), device=DEVICE))
