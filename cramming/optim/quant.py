"""Block-wise 8-bit quantization of optimizer state, and the PyTorch reference of the fused 8-bit AdamW update.

Scheme (Dettmers et al., "8-bit Optimizers via Block-wise Quantization", arXiv 2110.02861; block 256 as in
current bitsandbytes): a tensor is cut into blocks of 256 elements; each block stores its fp32 absmax, and
each element the uint8 index of the code nearest to `value / absmax` in a 256-entry "dynamic" map. The map
spends its codes on decades (10^0 ... 10^-6 of absmax), finer near 1, so small moments keep their relative
precision. The first moment uses a signed map, the second moment an unsigned one (it is never negative).

The Triton kernel in `cramming.kernels.adamw8bit` does `adamw8bit_update_torch` in one pass; the two are
tested against each other, so any change to the arithmetic here must be made there too.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

QBLOCK = 256  # elements per quantization block (one fp32 absmax each)
NUM_CODES = 256
_DECADES = 7  # the map covers 10^0 ... 10^-6 of a block's absmax


def dynamic_map(signed: bool) -> torch.Tensor:
    """The 256 codes, ascending, in [-1, 1] (signed) or [0, 1] (unsigned); 0 and 1 are exact codes.

    Decade e (e = 0..6) holds 2^(f - e) codes at the midpoints of an even split of (0.1, 1]·10^-e, with
    f = 6 fraction bits for the signed map (its 8th bit is the sign) and 7 for the unsigned one. Signed:
    127 magnitudes, both signs, plus 0 and +1 (so -1 rounds to -0.993). Unsigned: 254 magnitudes plus 0, 1.
    """
    fraction_bits = 6 if signed else 7
    magnitudes = []
    for e in range(_DECADES):
        edges = torch.linspace(0.1, 1.0, 2 ** (fraction_bits - e) + 1, dtype=torch.float64)
        magnitudes.append((edges[:-1] + edges[1:]) / 2 * 10.0**-e)
    mags = torch.cat(magnitudes)
    ends = torch.tensor([0.0, 1.0], dtype=torch.float64)
    codes = torch.cat([-mags, mags, ends]) if signed else torch.cat([mags, ends])
    codes = torch.sort(codes).values.to(torch.float32)
    assert codes.numel() == NUM_CODES and bool((codes[1:] > codes[:-1]).all())
    return codes


def num_blocks(numel: int) -> int:
    return math.ceil(numel / QBLOCK)


def _blocks(flat: torch.Tensor) -> torch.Tensor:
    """(n,) -> (blocks, QBLOCK), zero-padded at the end."""
    pad = num_blocks(flat.numel()) * QBLOCK - flat.numel()
    return F.pad(flat, (0, pad)).view(-1, QBLOCK)


_BIN_SHIFT = 15  # an fp32 value's bin: its top 17 bits (sign, exponent, 8 mantissa bits)
_NUM_BINS = 1 << (32 - _BIN_SHIFT)


def _fp32_bins(y: torch.Tensor) -> torch.Tensor:
    """The bin of each fp32 value, int64 in [0, 2^17)."""
    return ((y.contiguous().view(torch.int32) >> _BIN_SHIFT) & (_NUM_BINS - 1)).long()


@dataclass(frozen=True)
class QuantMap:
    """A 256-code map and the lookup tables that find the nearest code in two gathers and a compare.

    The nearest code of y is the number of midpoints (code[k-1] + code[k])·0.5 (fp32) below y, so that a y
    exactly on a midpoint goes to the lower code; the kernel counts the same midpoints by binary search.
    Here each fp32 bin (see _fp32_bins; a bin spans 0.4% of its values) holds at most one midpoint of the
    dynamic maps (their codes are >= 0.7% apart), so the count is the count below the bin's smallest value
    (`bin_count`) plus one if y is above the next midpoint (`bin_midpoint`). `build` checks that property.
    """

    code: torch.Tensor  # (256,) fp32, ascending
    bin_count: torch.Tensor  # (2^17,) int64
    bin_midpoint: torch.Tensor  # (2^17,) fp32, +inf past the last midpoint

    @classmethod
    def build(cls, code: torch.Tensor) -> QuantMap:
        code = code.float().cpu()
        midpoints = (code[:-1] + code[1:]) * 0.5  # (255,) ascending
        # the smallest and largest fp32 value of every bin, from their bit patterns
        first = torch.arange(_NUM_BINS, dtype=torch.int64) << _BIN_SHIFT
        last = first | ((1 << _BIN_SHIFT) - 1)
        ends = [(b - (b >= 2**31).long() * 2**32).to(torch.int32).view(torch.float32) for b in (first, last)]
        low, high = torch.minimum(*ends), torch.maximum(*ends)  # negative floats order the other way
        count_low = torch.searchsorted(midpoints, low)
        count_high = torch.searchsorted(midpoints, high, right=True)
        finite = torch.isfinite(low) & torch.isfinite(high)
        if int((count_high - count_low)[finite].max()) > 1:
            raise ValueError("codes too close for the fp32 bins: some bin holds two midpoints")
        padded = torch.cat([midpoints, torch.tensor([float("inf")])])
        return cls(code=code, bin_count=count_low, bin_midpoint=padded[count_low])

    @classmethod
    def dynamic(cls, signed: bool, device: torch.device | str | None = None) -> QuantMap:
        return cls.build(dynamic_map(signed)).to(device)

    def to(self, device: torch.device | str | None) -> QuantMap:
        return QuantMap(*(t.to(device) for t in (self.code, self.bin_count, self.bin_midpoint)))

    def nearest(self, y: torch.Tensor) -> torch.Tensor:
        """Index (int64) of the code nearest to each fp32 y."""
        bins = _fp32_bins(y)
        return self.bin_count[bins] + (self.bin_midpoint[bins] < y).long()


def quantize_blockwise(x: torch.Tensor, qmap: QuantMap) -> tuple[torch.Tensor, torch.Tensor]:
    """x (any shape) -> (codes: uint8 (x.numel(),), absmax: fp32 (blocks,))."""
    blocks = _blocks(x.detach().reshape(-1).float())  # (blocks, QBLOCK)
    absmax = blocks.abs().amax(dim=1)  # (blocks,)
    scale = torch.where(absmax > 0, absmax, torch.ones_like(absmax))
    idx = qmap.nearest(blocks / scale[:, None])
    return idx.view(-1)[: x.numel()].to(torch.uint8), absmax


def dequantize_blockwise(codes: torch.Tensor, absmax: torch.Tensor, qmap: QuantMap) -> torch.Tensor:
    """codes uint8 (n,), absmax (blocks,) -> fp32 (n,)."""
    values = _blocks(qmap.code[codes.long()])  # (blocks, QBLOCK)
    return (values * absmax[:, None]).view(-1)[: codes.numel()]


@dataclass(frozen=True)
class AdamScalars:
    """The step's scalars of AdamW, computed once on the host (in float64) and shared by both paths.

    Update (Loshchilov & Hutter, decoupled weight decay; the same order as torch.optim.AdamW):
        m = beta1·m + (1 - beta1)·g
        v = beta2·v + (1 - beta2)·g²
        p = p·decay - step_size · m / (sqrt(v) / bias2_sqrt + eps)
    with decay = 1 - lr·weight_decay, step_size = lr / (1 - beta1^t), bias2_sqrt = sqrt(1 - beta2^t).
    """

    beta1: float
    one_minus_beta1: float
    beta2: float
    one_minus_beta2: float
    eps: float
    decay: float
    step_size: float
    bias2_sqrt: float

    @classmethod
    def at_step(
        cls, step: int, lr: float, betas: tuple[float, float], eps: float, weight_decay: float
    ) -> AdamScalars:
        beta1, beta2 = betas
        return cls(
            beta1=beta1,
            one_minus_beta1=1.0 - beta1,
            beta2=beta2,
            one_minus_beta2=1.0 - beta2,
            eps=eps,
            decay=1.0 - lr * weight_decay,
            step_size=lr / (1.0 - beta1**step),
            bias2_sqrt=math.sqrt(1.0 - beta2**step),
        )


@dataclass
class QuantizedMoments:
    """The two AdamW moments of one tensor in 8 bits: codes (n,) uint8 and absmax (blocks,) fp32 each."""

    m_codes: torch.Tensor
    m_absmax: torch.Tensor
    v_codes: torch.Tensor
    v_absmax: torch.Tensor

    @classmethod
    def zeros(cls, numel: int, device: torch.device) -> QuantizedMoments:
        # code index of 0.0 differs between the maps; absmax 0 makes every code decode to 0 anyway
        nb = num_blocks(numel)
        return cls(
            m_codes=torch.zeros(numel, dtype=torch.uint8, device=device),
            m_absmax=torch.zeros(nb, dtype=torch.float32, device=device),
            v_codes=torch.zeros(numel, dtype=torch.uint8, device=device),
            v_absmax=torch.zeros(nb, dtype=torch.float32, device=device),
        )


def adamw8bit_update_torch(
    param: torch.Tensor,
    grad: torch.Tensor,
    moments: QuantizedMoments,
    m_map: QuantMap,
    v_map: QuantMap,
    s: AdamScalars,
) -> None:
    """One AdamW step with 8-bit moments, in place on `param` and `moments` (fp32 arithmetic).

    The moments are de-quantized, updated, used for the parameter update at full precision, and only then
    re-quantized, as in the fused kernel.
    """
    g = grad.reshape(-1).float()
    p = param.detach().reshape(-1).float()
    m = dequantize_blockwise(moments.m_codes, moments.m_absmax, m_map)
    v = dequantize_blockwise(moments.v_codes, moments.v_absmax, v_map)
    m = m * s.beta1 + g * s.one_minus_beta1
    v = v * s.beta2 + (g * g) * s.one_minus_beta2
    denom = torch.sqrt(v) / s.bias2_sqrt + s.eps
    p = p * s.decay - s.step_size * (m / denom)
    for codes, absmax, new in (
        (moments.m_codes, moments.m_absmax, quantize_blockwise(m, m_map)),
        (moments.v_codes, moments.v_absmax, quantize_blockwise(v, v_map)),
    ):
        codes.copy_(new[0])
        absmax.copy_(new[1])
    param.detach().copy_(p.view_as(param))
