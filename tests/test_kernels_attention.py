"""Fused attention kernel against its PyTorch reference: forward, every gradient, masks, dropout.

On CPU these run in the Triton interpreter (tests/conftest.py sets TRITON_INTERPRET=1), so the shapes are
small but awkward: seq 1, odd lengths, ragged last blocks, padded rows of different lengths, a sequence
with no real token at all. On a GPU the same tests run on CUDA, plus the `gpu`-marked ones.

ALiBi (the kernel's `alibi_slopes`) is compared with the model's SDPA path given the explicit (heads, seq,
seq) float bias (`cramming.model.ops.sdpa_attention`), and with dropout with the eager reference fed the
same bias and keep-mask.
"""

from __future__ import annotations

import math
import time

import pytest
import torch
from kernel_checks import assert_close, sum_rtol, unit_roundoff

from cramming.kernels import triton_status
from cramming.model.ops import alibi_bias, sdpa_attention

TRITON_OK, TRITON_WHY = triton_status()
pytestmark = pytest.mark.skipif(not TRITON_OK, reason=f"Triton cannot launch here: {TRITON_WHY}")

if TRITON_OK:
    from cramming.kernels.attention import (
        AttentionBlocks,
        _FlashAttention,
        attention_reference,
        draw_dropout_seed,
        dropout_keep_mask,
        flash_attention,
    )

CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"
needs_gpu = pytest.mark.skipif(not CUDA, reason="needs a CUDA device (bf16 and speed are GPU-only)")

# (atol, rtol) against an fp32 reference fed the same (rounded) inputs, to which the order of the sums adds
# summation_atol (computed from the inputs). The kernel rounds P and dS to the
# input dtype before each matmul, as FlashAttention does; emulating that rounding in PyTorch at the GPU
# tests' shapes (batch 4 x 12 heads x seq 128; seq 512, head_dim 128) uses at most 20% of these bounds.
TOL = {
    torch.float32: (2e-5, 2e-4),
    torch.float16: (2e-3, 5e-3),
    torch.bfloat16: (1e-2, 2e-2),
}

# (batch, heads, seq, head_dim, real lengths per sequence or None for no mask)
SHAPES = [
    (1, 1, 1, 32, None),
    (1, 2, 7, 64, None),
    (2, 2, 100, 32, [100, 37]),
    pytest.param((3, 1, 129, 64, [129, 65, 0]), marks=pytest.mark.slow),  # the last sequence: no real token
    (1, 1, 33, 48, [20]),  # head_dim not a power of two
    (1, 1, 65, 128, [50]),  # head_dim 128: narrower key blocks, so the separate dQ pass
]
SMALL_BLOCKS = (
    AttentionBlocks(fwd_m=16, fwd_n=16, bwd_m=16, bwd_n=32, dq_m=32, dq_n=16, stages=1) if TRITON_OK else None
)


def _inputs(batch, heads, seq, head_dim, lengths, dtype, scale_q=1.0):
    q, k, v = (torch.randn(batch, heads, seq, head_dim, device=DEVICE) for _ in range(3))
    q = q * scale_q
    q, k, v = (t.to(dtype).requires_grad_() for t in (q, k, v))
    mask = None
    if lengths is not None:
        mask = torch.arange(seq, device=DEVICE)[None, :] < torch.tensor(lengths, device=DEVICE)[:, None]
    return q, k, v, mask


def summation_atol(q, k, v, do, mask, scale, bias=None) -> dict[str, float]:
    """Absolute errors that the order of the fp32 sums alone allows (the kernel sums over head_dim and over
    key/query blocks in another order than the reference's matmuls), propagated from the inputs in fp64:
    scores off by sum_rtol(head_dim) * scale * sum|q k| (plus a few roundings of the bias, which the kernel
    computes as slope * log2(e) * |i - j| and the reference as slope * |i - j|), so each probability
    relatively by twice that plus the log-sum-exp's own sum and the rounding of s - lse; out, dv, dP, D,
    dS, dq and dk add their sums. bias: the additive (heads, seq, seq) score bias, or None."""
    q, k, v, do = (t.detach().double() for t in (q, k, v, do))
    seq, dim = q.shape[-2], q.shape[-1]
    u = unit_roundoff(torch.float32)
    kt = k.transpose(-1, -2)
    s_abs = scale * (q.abs() @ kt.abs())  # (batch, heads, seq, seq)
    scores = scale * (q @ kt)
    s_err = sum_rtol(dim) * s_abs.amax(-1, keepdim=True)
    if bias is not None:
        bias = bias.detach().double().to(q.device)
        scores = scores + bias
        s_err = s_err + 4 * u * bias.abs().amax(-1, keepdim=True)
        s_abs = s_abs + bias.abs()
    if mask is not None:
        scores = scores.masked_fill(~mask[:, None, None, :].to(q.device), float("-inf"))
    p = torch.softmax(scores, dim=-1).nan_to_num(0.0)  # a row with no real key: 0, as in the kernel
    p_rel = 2 * s_err + sum_rtol(seq) + 2 * u * (s_abs.amax(-1, keepdim=True) + math.log(seq))
    out = p @ v
    e_out = (p_rel + sum_rtol(seq)) * (p @ v.abs())
    dp = do @ v.transpose(-1, -2)
    e_dp = sum_rtol(dim) * (do.abs() @ v.abs().transpose(-1, -2))
    e_rowsum = sum_rtol(dim) * (do.abs() * out.abs()).sum(-1, keepdim=True) + (do.abs() * e_out).sum(-1, True)
    ds = p * (dp - (do * out).sum(-1, keepdim=True))
    e_ds = p * (e_dp + e_rowsum) + p_rel * ds.abs()
    errors = {
        "out": e_out,
        "dq": scale * (e_ds @ k.abs() + sum_rtol(seq) * (ds.abs() @ k.abs())),
        "dk": scale
        * (e_ds.transpose(-1, -2) @ q.abs() + sum_rtol(seq) * (ds.abs().transpose(-1, -2) @ q.abs())),
        "dv": (p_rel * p).transpose(-1, -2) @ do.abs() + sum_rtol(seq) * (p.transpose(-1, -2) @ do.abs()),
    }
    return {name: e.max().item() for name, e in errors.items()}


def _compare(out, grads, ref_out, ref_grads, dtype, order: dict[str, float]):
    """order: summation_atol of the inputs."""
    atol, rtol = TOL[dtype]
    assert_close("out", out, ref_out, atol + order["out"], rtol)
    for name, got, want in zip(("dq", "dk", "dv"), grads, ref_grads, strict=True):
        assert_close(name, got, want, atol + order[name], rtol)


def _run(fn, q, k, v, do):
    out = fn(q, k, v)
    return out, torch.autograd.grad(out, (q, k, v), do)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s[:4])) + ("-pad" if s[4] else ""))
@pytest.mark.parametrize("blocks", ["auto", "small"])
def test_matches_reference(shape, dtype, blocks):
    batch, heads, seq, head_dim, lengths = shape
    q, k, v, mask = _inputs(batch, heads, seq, head_dim, lengths, dtype)
    do = torch.randn_like(q)
    scale = head_dim**-0.5
    if blocks == "auto":
        out, grads = _run(lambda q, k, v: flash_attention(q, k, v, mask), q, k, v, do)
    else:  # many blocks in every direction, and the separate dQ pass whenever seq > 32
        out, grads = _run(
            lambda q, k, v: _FlashAttention.apply(q, k, v, mask, 0.0, scale, SMALL_BLOCKS), q, k, v, do
        )
    ref_out, ref_grads = _run(lambda q, k, v: attention_reference(q, k, v, mask), q, k, v, do)
    _compare(out, grads, ref_out, ref_grads, dtype, summation_atol(q, k, v, do, mask, scale))
    if lengths is not None and 0 in lengths:
        empty = lengths.index(0)
        assert (out[empty] == 0).all(), "a sequence with no real token must give a zero output"
        for name, g in zip(("dq", "dk", "dv"), grads, strict=True):
            assert (g[empty] == 0).all(), f"{name} of a sequence with no real token must be zero"


def test_peaked_softmax_and_custom_scale():
    # Large logits make the running max jump between key blocks: the online rescaling must be exact.
    q, k, v, mask = _inputs(2, 1, 100, 32, [100, 51], torch.float32, scale_q=8.0)
    do = torch.randn_like(q)
    out, grads = _run(lambda q, k, v: flash_attention(q, k, v, mask, scale=0.3), q, k, v, do)
    ref_out, ref_grads = _run(lambda q, k, v: attention_reference(q, k, v, mask, scale=0.3), q, k, v, do)
    _compare(out, grads, ref_out, ref_grads, torch.float32, summation_atol(q, k, v, do, mask, 0.3))


@pytest.mark.parametrize("blocks", ["auto", "small"])
def test_mask_with_holes(blocks):
    # any pattern of real keys, not only right padding; one key block entirely masked under small tiles
    q, k, v, _ = _inputs(2, 2, 100, 32, None, torch.float32)
    mask = torch.rand(2, 100, device=DEVICE) < 0.6
    mask[1, 32:48] = False
    do = torch.randn_like(q)
    use = SMALL_BLOCKS if blocks == "small" else None
    out, grads = _run(lambda q, k, v: _FlashAttention.apply(q, k, v, mask, 0.0, 32**-0.5, use), q, k, v, do)
    ref_out, ref_grads = _run(lambda q, k, v: attention_reference(q, k, v, mask), q, k, v, do)
    _compare(out, grads, ref_out, ref_grads, torch.float32, summation_atol(q, k, v, do, mask, 32**-0.5))


def test_strided_views_of_fused_qkv():
    # The model's fused projection gives q, k, v as strided views of one (batch, seq, 3, heads, head_dim).
    batch, seq, heads, head_dim = 2, 37, 2, 32
    qkv = torch.randn(batch, seq, 3, heads, head_dim, device=DEVICE, requires_grad=True)
    mask = torch.arange(seq, device=DEVICE)[None, :] < torch.tensor([37, 20], device=DEVICE)[:, None]
    do = torch.randn(batch, heads, seq, head_dim, device=DEVICE)

    def run(fn):
        q, k, v = qkv.permute(2, 0, 3, 1, 4).unbind(0)  # each (batch, heads, seq, head_dim), not contiguous
        out = fn(q, k, v, mask)
        return out, torch.autograd.grad(out, qkv, do)[0]

    out, grad = run(flash_attention)
    ref_out, ref_grad = run(attention_reference)
    order = summation_atol(*qkv.permute(2, 0, 3, 1, 4).unbind(0), do, mask, head_dim**-0.5)
    atol, rtol = TOL[torch.float32]
    assert_close("out", out, ref_out, atol + order["out"], rtol)
    assert_close("dqkv", grad, ref_grad, atol + max(order["dq"], order["dk"], order["dv"]), rtol)
    # the output is laid out (batch, seq, heads, head_dim): merging the heads back is a free view
    assert out.transpose(1, 2).is_contiguous()


def test_torch_compile_sees_one_opaque_op():
    # fullgraph: no graph break around the kernels (the launchers are custom ops), dropout included
    q, k, v, mask = _inputs(2, 2, 16, 32, [16, 5], torch.float32)
    do = torch.randn_like(q)
    compiled = torch.compile(
        lambda q, k, v: flash_attention(q, k, v, mask, dropout_p=0.2), backend="aot_eager", fullgraph=True
    )
    torch.manual_seed(1)
    out, grads = _run(compiled, q, k, v, do)
    torch.manual_seed(1)
    ref_out, ref_grads = _run(lambda q, k, v: flash_attention(q, k, v, mask, dropout_p=0.2), q, k, v, do)
    same_kernel = dict.fromkeys(("out", "dq", "dk", "dv"), 0.0)  # both sides launch the one kernel
    _compare(out, grads, ref_out, ref_grads, torch.float32, same_kernel)


def test_rejects_bad_inputs():
    q = torch.randn(1, 1, 8, 16, device=DEVICE)
    with pytest.raises(ValueError, match="key_padding_mask"):
        flash_attention(q, q, q, torch.ones(1, 8, device=DEVICE))
    with pytest.raises(ValueError, match="shape"):
        flash_attention(q, q[:, :, :4], q)
    with pytest.raises(ValueError, match="dropout_p"):
        flash_attention(q, q, q, dropout_p=1.0)


# ---------------------------------------------------------------------------------------------------
# ALiBi: -slope_h * |i - j| computed inside the kernels from one fp32 slope per head


def _default_slopes(heads: int) -> list[float]:
    return [4.0**-h for h in range(heads)]  # arch.head_slopes() without arch.alibi_slopes


# (batch, heads, seq, head_dim, real lengths or None, slopes): the configs' shapes at seq 128 (bert-tiny,
# bert-mini, crammed-bert) and odd ones: seq 1, one head, a sequence that is no multiple of any tile, a
# sequence with no real token, a slope of 0 beside a slope of 1, head_dim 48 and 128 (the separate dQ pass)
ALIBI_SHAPES = [
    (1, 1, 1, 32, None, [1.0]),
    (2, 2, 100, 32, [100, 37], [1.0, 0.0]),
    pytest.param((3, 1, 129, 64, [129, 65, 0], [0.5]), marks=pytest.mark.slow),
    (1, 2, 33, 48, [20], [0.0, 1.0]),
    (1, 2, 65, 128, [50], [1.0, 0.0]),
    pytest.param((2, 2, 128, 64, [128, 77], _default_slopes(2)), marks=pytest.mark.slow),  # bert-tiny
    pytest.param((2, 4, 128, 64, [128, 90], _default_slopes(4)), marks=pytest.mark.slow),  # bert-mini
    pytest.param((1, 12, 128, 64, None, _default_slopes(12)), marks=pytest.mark.slow),  # crammed-bert
]


def sdpa_alibi_reference(q, k, v, mask, slopes):
    """The model's SDPA path (`ops.sdpa_attention`: one float mask, the explicit (heads, seq, seq) ALiBi bias
    and the most negative float on padded keys) in fp32 on the same rounded inputs, with the kernel's
    semantics for a sequence with no real key (output 0, so no gradient)."""
    out = sdpa_attention(q.float(), k.float(), v.float(), mask, 0.0, slopes)
    if mask is not None:
        out = torch.where(mask.any(-1)[:, None, None, None], out, 0.0)
    return out.to(q.dtype)


def _alibi_id(shape) -> str:
    batch, heads, seq, head_dim, lengths, slopes = shape
    return "x".join(map(str, (batch, heads, seq, head_dim))) + ("-pad" if lengths else "")


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("shape", ALIBI_SHAPES, ids=_alibi_id)
@pytest.mark.parametrize("blocks", ["auto", "small"])
def test_alibi_matches_sdpa_with_the_float_bias(shape, dtype, blocks):
    batch, heads, seq, head_dim, lengths, slope_list = shape
    q, k, v, mask = _inputs(batch, heads, seq, head_dim, lengths, dtype)
    slopes = torch.tensor(slope_list, device=DEVICE)
    do = torch.randn_like(q)
    scale = head_dim**-0.5
    use = SMALL_BLOCKS if blocks == "small" else None
    out, grads = _run(
        lambda q, k, v: _FlashAttention.apply(q, k, v, mask, 0.0, scale, use, slopes), q, k, v, do
    )
    ref_out, ref_grads = _run(lambda q, k, v: sdpa_alibi_reference(q, k, v, mask, slopes), q, k, v, do)
    order = summation_atol(q, k, v, do, mask, scale, alibi_bias(slopes, seq))
    _compare(out, grads, ref_out, ref_grads, dtype, order)
    if seq > 1:  # the bias changes the result: the comparison is not vacuous
        plain = flash_attention(q, k, v, mask)
        assert (plain.float() - out.float()).abs().max() > 100 * TOL[dtype][0], "the ALiBi bias did nothing"


def test_alibi_slope_zero_is_no_bias():
    # slopes [1, 0]: head 1 must equal the kernel without a bias (same code path, bias exactly 0)
    q, k, v, mask = _inputs(2, 2, 70, 32, [70, 31], torch.float32)
    with_zero = flash_attention(q, k, v, mask, alibi_slopes=torch.tensor([1.0, 0.0], device=DEVICE))
    plain = flash_attention(q, k, v, mask)
    assert torch.equal(with_zero[:, 1], plain[:, 1])
    assert not torch.allclose(with_zero[:, 0], plain[:, 0])


@pytest.mark.parametrize("blocks", ["auto", pytest.param("small", marks=pytest.mark.slow)])
def test_alibi_with_dropout_matches_reference_with_the_same_mask(blocks):
    p, seq = 0.3, 129
    q, k, v, mask = _inputs(2, 2, seq, 32, [70, 0], torch.float32)  # a padded and an empty sequence
    slopes = torch.tensor([1.0, 0.0], device=DEVICE)
    bias = alibi_bias(slopes, seq)  # (heads, seq, seq), explicit for the reference only
    do = torch.randn_like(q)
    torch.manual_seed(5)
    keep = dropout_keep_mask(draw_dropout_seed(), 2, 2, seq, p, DEVICE)
    torch.manual_seed(5)  # the kernel draws the same seed
    use = SMALL_BLOCKS if blocks == "small" else None
    out, grads = _run(
        lambda q, k, v: _FlashAttention.apply(q, k, v, mask, p, 32**-0.5, use, slopes), q, k, v, do
    )
    ref_out, ref_grads = _run(
        lambda q, k, v: attention_reference(q, k, v, mask, p, keep_mask=keep, bias=bias), q, k, v, do
    )
    order = {name: e / (1 - p) for name, e in summation_atol(q, k, v, do, mask, 32**-0.5, bias).items()}
    _compare(out, grads, ref_out, ref_grads, torch.float32, order)


def test_alibi_under_torch_compile_and_bad_slopes():
    q, k, v, mask = _inputs(2, 2, 16, 32, [16, 5], torch.float32)
    slopes = torch.tensor([0.5, 0.25], device=DEVICE)
    do = torch.randn_like(q)

    def fn(q, k, v):
        return flash_attention(q, k, v, mask, alibi_slopes=slopes)

    compiled = torch.compile(fn, backend="aot_eager", fullgraph=True)
    out, grads = _run(compiled, q, k, v, do)
    ref_out, ref_grads = _run(fn, q, k, v, do)
    _compare(out, grads, ref_out, ref_grads, torch.float32, dict.fromkeys(("out", "dq", "dk", "dv"), 0.0))
    with pytest.raises(ValueError, match="alibi_slopes"):
        flash_attention(q, k, v, alibi_slopes=torch.ones(3, device=DEVICE))  # 2 heads, 3 slopes


# ---------------------------------------------------------------------------------------------------
# Dropout


@pytest.mark.parametrize("blocks", ["auto", pytest.param("small", marks=pytest.mark.slow)])
def test_dropout_matches_reference_with_the_same_mask(blocks):
    p = 0.3
    q, k, v, mask = _inputs(2, 1, 129, 32, [70, 0], torch.float32)  # a padded and an empty sequence
    do = torch.randn_like(q)
    torch.manual_seed(123)
    seed = draw_dropout_seed()
    keep = dropout_keep_mask(seed, 2, 1, 129, p, DEVICE)
    torch.manual_seed(123)  # the kernel draws the same seed
    use = SMALL_BLOCKS if blocks == "small" else None
    out, grads = _run(lambda q, k, v: _FlashAttention.apply(q, k, v, mask, p, 32**-0.5, use), q, k, v, do)
    ref_out, ref_grads = _run(
        lambda q, k, v: attention_reference(q, k, v, mask, p, keep_mask=keep), q, k, v, do
    )
    # dropout scales the kept probabilities by 1 / (1 - p), and their errors with them
    order = {name: e / (1 - p) for name, e in summation_atol(q, k, v, do, mask, 32**-0.5).items()}
    _compare(out, grads, ref_out, ref_grads, torch.float32, order)


def test_dropout_is_reproducible_from_torch_seed():
    q, k, v, mask = _inputs(1, 2, 40, 32, [33], torch.float16)
    outs = []
    for seed in (7, 7, 8):
        torch.manual_seed(seed)
        outs.append(flash_attention(q, k, v, mask, dropout_p=0.2))
    assert torch.equal(outs[0], outs[1]), "same torch seed, different dropout"
    assert not torch.equal(outs[0], outs[2]), "different torch seeds gave the same dropout"


def test_dropout_keeps_the_expected_fraction_and_mean():
    p, batch, heads, seq = 0.25, 2, 2, 128
    keep = dropout_keep_mask(draw_dropout_seed(), batch, heads, seq, p, DEVICE)
    # 65,536 Bernoulli(0.75) draws: the standard error of the mean is 0.0017
    assert abs(keep.float().mean().item() - (1 - p)) < 0.01
    # rows and columns are not correlated copies of each other (a broken counter would repeat them)
    assert not torch.equal(keep[0, 0, 0], keep[0, 0, 1]) and not torch.equal(keep[0, 0], keep[0, 1])
    # E[dropout(P) V] = P V: with V = 1 every output is a mean-one random variable
    q, k, _, _ = _inputs(batch, heads, seq, 32, None, torch.float32)
    out = flash_attention(q, k, torch.ones_like(q), dropout_p=p)
    assert abs(out.mean().item() - 1.0) < 0.03, f"mean of the dropped output {out.mean().item():.4f}, want 1"


# ---------------------------------------------------------------------------------------------------
# GPU only


@needs_gpu
@pytest.mark.gpu
@pytest.mark.parametrize("alibi", [False, True], ids=["no-bias", "alibi"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize(
    "shape", [(4, 12, 128, 64, None), (2, 4, 512, 64, [512, 300]), (2, 4, 512, 128, [511, 1])]
)
def test_gpu_half_precision(shape, dtype, alibi):
    """bf16/fp16 at BERT shapes against the fp32 reference: attention_reference, or with ALiBi the model's
    SDPA path given the explicit float bias."""
    q, k, v, mask = _inputs(*shape, dtype)
    do = torch.randn_like(q)
    if alibi:
        slopes = torch.tensor(_default_slopes(shape[1]), device=DEVICE)
        kernel = lambda q, k, v: flash_attention(q, k, v, mask, alibi_slopes=slopes)  # noqa: E731
        reference = lambda q, k, v: sdpa_alibi_reference(q, k, v, mask, slopes)  # noqa: E731
        bias = alibi_bias(slopes, shape[2])
    else:
        kernel = lambda q, k, v: flash_attention(q, k, v, mask)  # noqa: E731
        reference = lambda q, k, v: attention_reference(q, k, v, mask)  # noqa: E731
        bias = None
    out, grads = _run(kernel, q, k, v, do)
    ref_out, ref_grads = _run(reference, q, k, v, do)
    order = summation_atol(q, k, v, do, mask, shape[3] ** -0.5, bias)
    _compare(out, grads, ref_out, ref_grads, dtype, order)


@needs_gpu
@pytest.mark.gpu
def test_gpu_alibi_allocates_no_bias_tensor():
    # the (heads, seq, seq) fp32 bias would be 12 MiB here; the kernel's peak must not grow by any of it
    batch, heads, seq = 2, 12, 512
    q, k, v, mask = _inputs(batch, heads, seq, 64, [512, 300], torch.bfloat16)
    slopes = torch.tensor(_default_slopes(heads), device=DEVICE)
    do = torch.randn_like(q)

    def peak(fn):
        _run(fn, q, k, v, do)  # compile outside the measurement
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
        _run(fn, q, k, v, do)
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated() - before

    plain = peak(lambda q, k, v: flash_attention(q, k, v, mask))
    alibi = peak(lambda q, k, v: flash_attention(q, k, v, mask, alibi_slopes=slopes))
    assert alibi - plain < 64 * 1024, f"ALiBi added {(alibi - plain) / 2**20:.2f} MiB to the peak"


@needs_gpu
@pytest.mark.gpu
def test_gpu_faster_than_eager_at_seq_512_head_dim_128():
    q, k, v, mask = _inputs(8, 8, 512, 128, [512] * 4 + [300] * 4, torch.bfloat16)
    do = torch.randn_like(q)

    def eager(q, k, v):  # as a model writes it: bf16 matmuls, fp32 softmax
        scores = (q @ k.transpose(-1, -2)) * 128**-0.5
        scores = scores.masked_fill(~mask[:, None, None, :], torch.finfo(scores.dtype).min)
        return torch.softmax(scores.float(), dim=-1).to(q.dtype) @ v

    def timed(fn):
        for _ in range(3):
            _run(fn, q, k, v, do)
        torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(10):
            _run(fn, q, k, v, do)
        torch.cuda.synchronize()
        return (time.perf_counter() - start) / 10

    flash = timed(lambda q, k, v: flash_attention(q, k, v, mask))
    reference = timed(eager)
    assert flash < reference, f"flash forward+backward {flash * 1e3:.2f} ms, eager {reference * 1e3:.2f} ms"
