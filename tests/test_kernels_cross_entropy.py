"""Fused cross-entropy against F.cross_entropy on fp32 logits: loss and the gradient of the logits."""

from __future__ import annotations

import math

import pytest
import torch
from kernel_checks import assert_close, sum_rtol, unit_roundoff

from cramming.kernels import triton_status

TRITON_OK, TRITON_WHY = triton_status()
pytestmark = pytest.mark.skipif(not TRITON_OK, reason=f"Triton cannot launch here: {TRITON_WHY}")

if TRITON_OK:
    from cramming.kernels.cross_entropy import cross_entropy, cross_entropy_reference

CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"
IGNORE = -100

# the loss is compared in fp32 either way; dlogits is rounded once to the logits' dtype. To these the sums'
# order adds (summation_tol): the kernel sums exp() over the vocabulary in blocks, the reference in its own.
TOL = {torch.float32: (1e-6, 1e-5), torch.float16: (1e-6, 2e-3), torch.bfloat16: (1e-5, 1.6e-2)}


def summation_tol(logits: torch.Tensor, labelled: int) -> tuple[float, float]:
    """(relative error of a softmax probability, of the mean loss) from the order of the fp32 sums alone.
    log-sum-exp: the sum of V positive terms is off by sum_rtol(V) relatively, so the log by as much
    absolutely; exp(x - lse) turns that, and the rounding of x - lse (|x - lse|·u, on both sides), into a
    relative error of p. The loss is a mean of `labelled` terms of that accuracy."""
    x = logits.detach().float()
    spread = (x.amax(-1) - x.amin(-1)).max().item() + math.log(x.shape[-1])  # the largest |x - lse|
    p_rtol = sum_rtol(x.shape[-1]) + 2 * spread * unit_roundoff(torch.float32)
    return p_rtol, sum_rtol(labelled)


def _check(logits, labels):
    loss = cross_entropy(logits, labels, IGNORE)
    (grad,) = torch.autograd.grad(2.0 * loss, logits)  # a non-unit upstream gradient
    ref_loss = cross_entropy_reference(logits, labels, IGNORE)
    (ref_grad,) = torch.autograd.grad(2.0 * ref_loss, logits)
    labelled = max(int((labels != IGNORE).sum()), 1)
    p_rtol, mean_rtol = summation_tol(logits, labelled)
    assert_close("loss", loss, ref_loss, 1e-5 + sum_rtol(logits.shape[-1]), 1e-5 + mean_rtol)
    assert grad.dtype == logits.dtype
    # dlogits = 2 (p - onehot) / labelled: p's relative error, and for the label's p - 1 an absolute one
    atol, rtol = TOL[logits.dtype]
    assert_close("dlogits", grad, ref_grad, atol + 2 * p_rtol / labelled, rtol + p_rtol)


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
