"""The CPU speed paths of the training step: bf16 where the CPU has it, the block-wise loss, and SDPA's flash
kernel with the ALiBi bias. Each must compute what the plain path computes, up to rounding."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from cramming import impl as impl_module
from cramming.impl import ImplConfig, cpu_bf16_support
from cramming.model.ops import ChunkedCrossEntropy, alibi_bias, sdpa_attention, torch_cross_entropy

CPU = torch.device("cpu")


@pytest.mark.parametrize(("native", "expected"), [(True, torch.bfloat16), (False, torch.float32)])
def test_auto_precision_follows_the_cpus_bf16_support(monkeypatch, native, expected):
    monkeypatch.setattr(impl_module, "cpu_bf16_support", lambda: (native, "probe"))
    dtype, why = ImplConfig(precision="auto").precision_choice(CPU)
    assert dtype == expected and "auto" in why and "probe" in why
    # an explicit setting wins on any CPU
    assert ImplConfig(precision="fp32").precision_choice(CPU) == (torch.float32, "impl.precision=fp32")
    assert ImplConfig(precision="bf16").compute_dtype(CPU) == torch.bfloat16


def test_cpu_bf16_probe_reads_torch(monkeypatch):
    """The probe reports what torch's CPU dispatch reports, by instruction name."""
    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: False, raising=False)
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: True, raising=False)
    assert cpu_bf16_support() == (True, "amx")
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: False, raising=False)
    monkeypatch.setattr(impl_module.platform, "machine", lambda: "x86_64")
    native, how = cpu_bf16_support()
    assert not native and "avx512_bf16" in how


def reference_loss(logits, labels, grad_output):
    x = logits.detach().clone().requires_grad_()
    loss = F.cross_entropy(x.float(), labels, ignore_index=-100)
    loss.backward(grad_output)
    return loss, x.grad


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, ChunkedCrossEntropy.ROWS - 1, ChunkedCrossEntropy.ROWS + 1, 100])
@pytest.mark.parametrize("grad_output", [1.0, 0.25])
def test_blockwise_loss_matches_cross_entropy(dtype, rows, grad_output):
    """Loss and gradient as F.cross_entropy on an fp32 copy, the gradient cast back to the logits' dtype: the
    same per-row reductions, so they differ by the order of the final mean (fp32) and, in bf16, by at most
    one rounding of the gradient."""
    gen = torch.Generator().manual_seed(rows)
    logits = (4 * torch.randn(rows, 300, generator=gen)).to(dtype).requires_grad_()
    labels = torch.randint(0, 300, (rows,), generator=gen)
    labels[1::3] = -100  # ignored rows: no loss, zero gradient
    expected, expected_grad = reference_loss(logits, labels, torch.tensor(grad_output))
    loss = torch_cross_entropy(logits, labels, -100)
    loss.backward(torch.tensor(grad_output))
    assert loss.dtype == torch.float32
    assert loss.item() == pytest.approx(expected.item(), rel=1e-6, abs=1e-6)
    assert logits.grad.dtype == dtype
    # fp32: the softmax is exp(x - lse) here and exp(log_softmax(x)) there; the exponents (|x - lse| < 40 for
    # these logits) differ by a few fp32 roundings, ~40 * 2^-24 * 4 < 1e-5 relative after exp. bf16: both
    # sides round nearly the same fp32 value, at most one bf16 ulp (2^-7 relative) apart
    tolerance = 1e-5 if dtype == torch.float32 else 2**-7
    assert torch.allclose(logits.grad.float(), expected_grad.float(), rtol=tolerance, atol=1e-7)
    assert (logits.grad[1::3] == 0).all()


def test_blockwise_loss_with_no_labelled_row_is_nan_like_cross_entropy():
    logits = torch.randn(5, 10, requires_grad=True)
    labels = torch.full((5,), -100)
    assert torch.isnan(torch_cross_entropy(logits, labels)) and torch.isnan(F.cross_entropy(logits, labels))


def test_evaluation_and_compiled_paths_use_plain_cross_entropy():
    """Without gradients (validation) the plain form: no gradient to precompute."""
    logits = torch.randn(8, 10)
    labels = torch.randint(0, 10, (8,))
    assert torch_cross_entropy(logits, labels) == F.cross_entropy(logits, labels)


@pytest.mark.parametrize("with_padding", [False, True])
def test_sdpa_with_alibi_takes_the_flash_kernel_on_cpu(with_padding):
    """A 3-D bias mask sent PyTorch's CPU SDPA to its unfused math path (bmm; bert-tiny's step 1.15x slower in
    fp32, 1.46x in bf16): the bias is passed as a 4-D mask. The result is the reference attention's."""
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 2, 16, 8, generator=gen) for _ in range(3))
    slopes = torch.tensor([1.0, 0.25])
    padding = None
    if with_padding:
        padding = torch.ones(2, 16, dtype=torch.bool)
        padding[1, 10:] = False
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        out = sdpa_attention(q, k, v, key_padding_mask=padding, alibi_slopes=slopes)
    ops = {event.key for event in prof.key_averages()}
    assert "aten::_scaled_dot_product_attention_math" not in ops, sorted(ops)
    scores = q @ k.transpose(-2, -1) / 8**0.5 + alibi_bias(slopes, 16)
    if padding is not None:
        scores = scores.masked_fill(~padding[:, None, None, :], float("-inf"))
    reference = torch.softmax(scores, dim=-1) @ v
    # fp32 softmax and two products of length 16: relative error a few ulp of fp32
    assert torch.allclose(out, reference, rtol=1e-5, atol=1e-6)
