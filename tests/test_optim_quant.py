"""Block-wise 8-bit quantization (cramming.optim.quant): the maps and the per-block error bounds."""

from __future__ import annotations

import pytest
import torch

from cramming.optim.lowbit import AdamScalars, QuantizedMoments, adamw8bit_update_torch
from cramming.optim.quant import (
    QBLOCK,
    QuantMap,
    dequantize_blockwise,
    dynamic_map,
    hashed_uniform,
    quantize_blockwise,
)


def _dynamic(signed: bool) -> QuantMap:
    """bitsandbytes' maps (the unsigned one with its zero point)."""
    return QuantMap.build(dynamic_map(signed))


@pytest.mark.parametrize("signed", [True, False])
def test_dynamic_map_shape(signed):
    code = dynamic_map(signed)
    assert code.shape == (256,) and code.dtype == torch.float32
    assert bool((code[1:] > code[:-1]).all()), "codes must be strictly ascending for the binary search"
    assert 0.0 in code.tolist() and code.max().item() == 1.0
    assert code.min().item() == (pytest.approx(-0.993, abs=1e-3) if signed else 0.0)
    # the smallest non-zero magnitude is ~1e-7 of absmax: small moments keep relative precision
    assert code.abs()[code != 0].min().item() < 1e-6


@pytest.mark.parametrize("signed", [True, False])
def test_nearest_code_lookup_equals_brute_force(signed):
    """The two-gather lookup gives exactly the number of fp32 midpoints below y (the kernel's rule), on
    random values over every decade and on the awkward ones: codes, midpoints and their fp32 neighbours."""
    qmap = _dynamic(signed)
    code = qmap.code
    midpoints = (code[:-1] + code[1:]) * 0.5
    awkward = torch.cat([code, midpoints, torch.tensor([0.0, -0.0, 1.0, -1.0, 1e-30, -1e-30])])
    neighbours = [torch.nextafter(awkward, torch.full_like(awkward, d)) for d in (-2.0, 2.0)]
    magnitudes = 10.0 ** torch.empty(200_000).uniform_(-9, 0)
    signs = torch.sign(torch.randn(200_000)) if signed else torch.ones(200_000)
    y = torch.cat([awkward, *neighbours, magnitudes * signs])
    y = y if signed else y.abs()
    expected = (midpoints[None, :] < y[:, None]).sum(dim=1)
    got = qmap.nearest(y).long()
    bad = (got != expected).nonzero().flatten()
    assert bad.numel() == 0, (
        f"{bad.numel()} mismatches, e.g. y={y[bad[0]].item()!r}: {got[bad[0]]} != {expected[bad[0]]}"
    )
    # and it is the nearest code, up to the rounding of the midpoints (a y on a rounded midpoint may sit an
    # ulp nearer the upper code)
    dist = (code[None, :] - y[:, None]).abs()
    slack = 2 * torch.finfo(torch.float32).eps * y.abs()
    assert bool((dist.gather(1, got[:, None]).squeeze(1) <= dist.min(dim=1).values + slack).all())


def _per_element_bound(x_blocks: torch.Tensor, code: torch.Tensor) -> torch.Tensor:
    """Half the gap between the two codes around each normalized value, times its block's absmax (below the
    signed map's lowest code, -0.993, the distance to that code)."""
    absmax = x_blocks.abs().amax(dim=1, keepdim=True)
    y = x_blocks / torch.where(absmax > 0, absmax, torch.ones_like(absmax))
    hi = torch.searchsorted(code, y.contiguous()).clamp(1, 255)
    gap = code[hi] - code[hi - 1]
    return torch.maximum(gap / 2, code[0] - y) * absmax


@pytest.mark.parametrize("numel", [1, 7, QBLOCK, QBLOCK + 1, 3 * QBLOCK - 5, 4099])
@pytest.mark.parametrize("signed", [True, False])
def test_quantize_error_bound_per_block(numel, signed):
    qmap = _dynamic(signed)
    code = qmap.code
    # blocks of very different scales, as moments have
    x = torch.randn(numel) * torch.logspace(-6, 2, numel)[torch.randperm(numel)]
    x = x if signed else x.abs()
    codes, absmax = quantize_blockwise(x, qmap)
    assert codes.dtype == torch.uint8 and codes.shape == (numel,)
    assert absmax.shape == (-(-numel // QBLOCK),)
    back = dequantize_blockwise(codes, absmax, qmap)
    pad = absmax.numel() * QBLOCK - numel
    blocks = torch.nn.functional.pad(x, (0, pad)).view(-1, QBLOCK)
    bound = _per_element_bound(blocks, code).view(-1)[:numel]
    err = (back - x).abs()
    worst = int((err - bound).argmax())
    assert bool((err <= bound * (1 + 1e-5) + 1e-30).all()), (
        f"element {worst} (block {worst // QBLOCK}): x={x[worst].item():.6g}, got {back[worst].item():.6g}, "
        f"error {err[worst].item():.3g} > bound {bound[worst].item():.3g}"
    )
    # each block's absmax element is exact: its normalized value is +-1 (or the nearest code to -1)
    for b in range(absmax.numel()):
        blk = x[b * QBLOCK : (b + 1) * QBLOCK]
        assert absmax[b].item() == blk.abs().max().item()
    # coarse bound that holds for every element: half the widest gap of the map, relative to absmax
    rel = err / absmax.repeat_interleave(QBLOCK)[:numel]
    assert rel.max().item() <= (code[1:] - code[:-1]).max().item() / 2 + 1e-6


def test_zero_block_round_trips_to_zero():
    qmap = _dynamic(True)
    x = torch.zeros(2 * QBLOCK)
    x[QBLOCK:] = torch.randn(QBLOCK)
    codes, absmax = quantize_blockwise(x, qmap)
    assert absmax[0].item() == 0.0
    assert dequantize_blockwise(codes, absmax, qmap)[:QBLOCK].abs().max().item() == 0.0


def test_first_update_from_zero_state_matches_adam_closely():
    """From zero moments, step 1 of 8-bit AdamW is sign(g)·lr up to the quantization of m and v."""
    n = 3 * QBLOCK + 11
    p = torch.zeros(n)
    g = torch.randn(n)
    moments = QuantizedMoments.zeros(n, p.device)
    s = AdamScalars.at_step(1, lr=0.1, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0)
    adamw8bit_update_torch(p, g, moments, _dynamic(True), _dynamic(False), s)
    # the update uses the unquantized new moments, so the step is exact: -lr·g/|g|
    torch.testing.assert_close(p, -0.1 * torch.sign(g), rtol=1e-5, atol=1e-6)
    m = dequantize_blockwise(moments.m_codes, moments.m_absmax, _dynamic(True))
    torch.testing.assert_close(m, 0.1 * g, rtol=0.02, atol=0.1 * g.abs().max().item() * 0.01)


@pytest.mark.parametrize("sqrt_v", [False, True])
def test_chunked_step_equals_one_piece(monkeypatch, sqrt_v):
    """The PyTorch 8-bit step works in pieces of whole blocks; the pieces cannot change a bit of the result
    (every block's arithmetic is its own), including a ragged last piece and a non-contiguous parameter."""
    import cramming.optim.lowbit as lowbit

    n = 5 * QBLOCK + 37
    m_map, v_map = _dynamic(True), QuantMap.build(dynamic_map(False, zero=False))
    results = []
    for chunk in (2 * QBLOCK, 1 << 20):
        monkeypatch.setattr(lowbit, "CHUNK", chunk)
        torch.manual_seed(0)
        p = torch.randn(n, 2).t()  # (2, n), non-contiguous
        moments = QuantizedMoments.zeros(p.numel(), p.device)
        for t in range(1, 4):
            s = AdamScalars.at_step(t, lr=1e-2, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.1)
            adamw8bit_update_torch(p, torch.randn(2, n), moments, m_map, v_map, s, sqrt_v=sqrt_v)
        results.append((p.clone(), moments))
    (p1, a), (p2, b) = results
    assert torch.equal(p1, p2)
    for key in ("m_codes", "m_absmax", "v_codes", "v_absmax"):
        assert torch.equal(getattr(a, key), getattr(b, key)), key


# --- stochastic rounding (4-bit first moments, first_moment_rounding=stochastic) --------------------------


def test_hashed_uniform_is_uniform_repeatable_and_changes_with_the_step():
    u = hashed_uniform((64, 1024), step=7)
    assert u.min() >= 0 and u.max() < 1
    assert torch.equal(u, hashed_uniform((64, 1024), step=7))  # a resumed run draws the same numbers
    assert not torch.equal(u, hashed_uniform((64, 1024), step=8))
    # 65,536 draws: the mean's standard error is 0.0011, each decile's count's is 0.12% of the draws
    assert abs(u.mean().item() - 0.5) < 0.006
    counts = torch.histc(u, bins=10, min=0, max=1) / u.numel()
    assert (counts - 0.1).abs().max() < 0.006


def test_stochastic_rounding_picks_a_neighbour_and_is_unbiased():
    qmap = QuantMap.build(dynamic_map(True, bits=4))
    y = torch.linspace(float(qmap.code[0]), float(qmap.code[-1]), 501)  # the 4-bit map spans -0.8875 .. 1
    steps = 400
    decoded = torch.stack([qmap.decode(qmap.stochastic(y, hashed_uniform(y.shape, t))) for t in range(steps)])
    code = qmap.code
    lower = code[(torch.searchsorted(code, y, right=True) - 1).clamp(0, code.numel() - 2)]
    upper = code[(torch.searchsorted(code, y, right=True)).clamp(1, code.numel() - 1)]
    assert ((decoded == lower) | (decoded == upper)).all()  # never a code further away
    # each draw is lower or upper: its standard deviation is at most half the gap; 6 standard errors of 400
    gap = (upper - lower).clamp_min(1e-12)
    assert ((decoded.mean(0) - y).abs() <= 6 * gap / 2 / steps**0.5).all()


def test_a_decaying_moment_sticks_with_nearest_and_decays_with_stochastic_rounding():
    """m ← 0.9·m with no new gradient, re-quantized each step: round-to-nearest keeps a 16-code moment at its
    code (0.9·c rounds back to c), stochastic rounding lets it fall as 0.9^t on average."""
    qmap = QuantMap.build(dynamic_map(True, bits=4))
    start = qmap.code[-3]  # a code near the top, where the codes are 10-30% apart
    nearest = stochastic = torch.full((4096,), float(start))
    for t in range(30):
        nearest = qmap.decode(qmap.nearest(0.9 * nearest))
        stochastic = qmap.decode(qmap.stochastic(0.9 * stochastic, hashed_uniform(stochastic.shape, t)))
    assert torch.equal(nearest, torch.full_like(nearest, float(start)))
    assert stochastic.mean() < 0.2 * start  # 0.9^30 = 0.042 on average
