"""How optimizer moments are stored in 8 or 4 bits: code maps, the nearest-code lookup, block-wise and
rank-1 scales, and two 4-bit codes per byte. The AdamW steps on such moments are in cramming.optim.lowbit.

8 bits (Dettmers et al., "8-bit Optimizers via Block-wise Quantization", arXiv 2110.02861; block 256 as in
current bitsandbytes): a tensor is cut into blocks of 256 elements; each block stores its fp32 absmax, and
each element the uint8 index of the code nearest to `value / absmax` in a 256-entry "dynamic" map, which
spends its codes on decades (10^0, 10^-1, ... of absmax), finer near 1, so small values keep their relative
precision.

The zero point (Li, Chen & Zhu, "Memory Efficient Optimizers with 4-bit States", arXiv 2309.01507): a
second-moment map that contains 0 stores every v below half its smallest non-zero code (1.6e-7 of the
block absmax for bitsandbytes' map) as exactly 0, while the first moment of the same element is not 0;
the next step divides by sqrt((1 - beta2)·g²) only, up to 1/sqrt(1 - beta2) = 31x Adam's step at beta2
0.999. Wide-ranged blocks (gradients spanning decades, a few large columns) hit it every step. The cure is
a second-moment map without 0 (SECOND_MOMENT_MAPS); see tests/test_optim_drift.py and
results/optimizers/quality.md for what it changes.

4 bits (after Li et al.; the maps are built in cramming.optim.lowbit.Maps4bit): first moment on a signed
dynamic map of 16 codes in blocks of 128; second moment on the unsigned dynamic map without zero (16 codes,
5.5e-4 .. 1: Li et al.'s "DE-0", not their linear map (k + 1)/16, which on wide-ranged blocks rounds every v
below 1/32 of its scale up to 1/16), with rank-1 normalisation for tensors of two or more dims: v[i, j] is
scaled by min(max of row i, max of column j), which follows the row and column structure of a weight's
second moment better than a block max. A 1-D tensor's second moment is scaled in blocks of 128.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

QBLOCK = 256  # 8-bit: elements per quantization block (one fp32 absmax each)
QBLOCK_4BIT = 128  # 4-bit first moment (Li et al.: smaller blocks hold outliers better)


def dynamic_map(signed: bool, *, bits: int = 8, zero: bool = True) -> torch.Tensor:
    """The 2^bits codes, ascending, in [-1, 1] (signed) or [0, 1] (unsigned); 1 is an exact code.

    Decade e holds 2^(f - e) codes at the midpoints of an even split of (0.1, 1]·10^-e, with f = bits - 2
    fraction bits for the signed map (one bit is the sign) and bits - 1 for the unsigned one. The maps with
    `zero` (bitsandbytes' layout) hold 0 and cover bits - 1 decades; the unsigned map without zero spends
    the code of 0 on one more decade instead, so its smallest code is positive (0.55·10^-bits).
        8-bit signed:   +-127 magnitudes, 0, +1 (so -1 rounds to -0.993); smallest magnitude 5.5e-7
        8-bit unsigned: 254 magnitudes, 0, 1 / without zero: 255 magnitudes down to 5.5e-8, and 1
        4-bit signed:   +-7 magnitudes down to 5.5e-3, 0, +1
    """
    if signed and not zero:
        raise ValueError("the signed map keeps 0: a first moment of 0 is harmless (it moves nothing)")
    fraction_bits = bits - 2 if signed else bits - 1
    decades = bits - 1 if zero else bits
    magnitudes = []
    for e in range(decades):
        edges = torch.linspace(0.1, 1.0, 2 ** (fraction_bits - e) + 1, dtype=torch.float64)
        magnitudes.append((edges[:-1] + edges[1:]) / 2 * 10.0**-e)
    mags = torch.cat(magnitudes)
    one = torch.tensor([1.0], dtype=torch.float64)
    zeros = torch.tensor([0.0] if zero else [], dtype=torch.float64)
    codes = torch.cat([-mags, mags, zeros, one]) if signed else torch.cat([mags, zeros, one])
    codes = torch.sort(codes).values.to(torch.float32)
    assert codes.numel() == 2**bits and bool((codes[1:] > codes[:-1]).all())
    return codes


_BIN_SHIFT = 15  # an fp32 value's bin: its top 17 bits (sign, exponent, 8 mantissa bits)
_NUM_BINS = 1 << (32 - _BIN_SHIFT)


def _fp32_bins(y: torch.Tensor) -> torch.Tensor:
    """The bin of each fp32 value, int32 in [0, 2^17) (int32 indices gather several times faster than
    int64 on CPU)."""
    return torch.bitwise_and(y.contiguous().view(torch.int32) >> _BIN_SHIFT, _NUM_BINS - 1)


@dataclass(frozen=True)
class QuantMap:
    """A map of at most 256 codes and the lookup tables that find the nearest code in two gathers and a
    compare.

    The nearest code of y is the number of midpoints (code[k-1] + code[k])·0.5 (fp32) below y, so that a y
    exactly on a midpoint goes to the lower code; the Triton kernel counts the same midpoints by binary
    search. Here each fp32 bin (see _fp32_bins; a bin spans 0.4% of its values) holds at most one midpoint
    (the maps' codes are >= 0.7% apart), so the count is the count below the bin's smallest value
    (`bin_count`) plus one if y is above the next midpoint (`bin_midpoint`). `build` checks that property.
    """

    code: torch.Tensor  # (codes,) fp32, ascending
    bin_count: torch.Tensor  # (2^17,) uint8
    bin_midpoint: torch.Tensor  # (2^17,) fp32, +inf past the last midpoint

    @classmethod
    def build(cls, code: torch.Tensor) -> QuantMap:
        code = code.float().cpu()
        if code.numel() > 256:
            raise ValueError("a map holds at most 256 codes (uint8 indices)")
        midpoints = (code[:-1] + code[1:]) * 0.5  # ascending
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
        return cls(code=code, bin_count=count_low.to(torch.uint8), bin_midpoint=padded[count_low])

    def to(self, device: torch.device | str | None) -> QuantMap:
        return QuantMap(*(t.to(device) for t in (self.code, self.bin_count, self.bin_midpoint)))

    def nearest(self, y: torch.Tensor) -> torch.Tensor:
        """Index (uint8, same shape) of the code nearest to each fp32 y (finite)."""
        bins = _fp32_bins(y).view(-1)
        count = torch.index_select(self.bin_count, 0, bins)
        above = torch.index_select(self.bin_midpoint, 0, bins) < y.reshape(-1)
        return count.add_(above).view(y.shape)

    def stochastic(self, y: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
        """Index (uint8) of one of the two codes around each fp32 y, the upper one with probability
        (y - lower) / (upper - lower) for u uniform in [0, 1): unbiased, E[decode] = y inside the map's
        range (values past the end codes take the end code)."""
        index = self.nearest(y).long()
        lower = (index - (torch.index_select(self.code, 0, index.view(-1)).view(y.shape) > y).long()).clamp_(
            0, self.code.numel() - 2
        )
        low = torch.index_select(self.code, 0, lower.view(-1)).view(y.shape)
        high = torch.index_select(self.code, 0, (lower + 1).view(-1)).view(y.shape)
        up = ((y - low) / (high - low)).clamp_(0.0, 1.0)
        return (lower + (u < up).long()).to(torch.uint8)

    def decode(self, codes: torch.Tensor) -> torch.Tensor:
        """fp32 code values of uint8 indices (any shape)."""
        return torch.index_select(self.code, 0, codes.reshape(-1).int()).view(codes.shape)


def hashed_uniform(
    shape: tuple[int, ...], step: int, device: torch.device | str | None = None
) -> torch.Tensor:
    """Uniform [0, 1) numbers from an integer hash of (element index, step): the same for the same step, so
    a resumed run rounds exactly as the uninterrupted one, with no generator state to save. Tensors of one
    step share the sequence; each tensor's own elements and steps differ. 24 bits of each hash are used."""
    n = math.prod(shape)
    x = (torch.arange(n, dtype=torch.int64, device=device) + step * 0x9E3779B1) & 0xFFFFFFFF
    for _ in range(2):  # a 32-bit integer mixer (xor-shift-multiply); int64 holds the products
        x = (((x >> 16) ^ x) * 0x45D9F3B) & 0xFFFFFFFF
    x = (x >> 16) ^ x
    return ((x >> 8).to(torch.float32) * 2.0**-24).view(shape)


# how low-bit moments are re-quantized: to the nearest code, or stochastically (QuantMap.stochastic)
ROUNDINGS = ("nearest", "stochastic")

# what a 4-bit first moment is divided by before its blocks of 128 are scaled and coded:
#   block       nothing: m itself in blocks (Li et al.). A block shares one absmax with elements whose
#               gradients are 1,000x larger, so a small m becomes 0 or the smallest code (5.5e-3 of the
#               absmax), and its step m/sqrt(v) comes out several times fp32's (results/optimizers/quality.md)
#   normalized  sqrt(v) of the same element as stored (the decoded 4-bit second moment): the block holds
#               m/sqrt(v), the element's own step before bias correction, whose size does not follow the
#               gradient's scale (|m|/sqrt(v) <= (1-b1)/sqrt((1-b2)(1-b1^2/b2)), 7.3 at betas 0.9, 0.999),
#               so the block's shared scale fits every element; m is that times sqrt(v) again when read
FIRST_MOMENT_FORMATS = ("block", "normalized")
# the setting's choices: a format, or `auto`: normalized for full (unprojected) moments, block for GaLore's
# low-rank ones, whose projected gradients mix the scales already (there block is closer to fp32 GaLore:
# results/optimizers/quality.md)
FIRST_MOMENT_CHOICES = ("auto", *FIRST_MOMENT_FORMATS)
# what a 4-bit state saved before the format was selectable (no `m_format` entry) holds
LEGACY_FIRST_MOMENT_FORMAT = "block"


# --- second-moment maps of the 8-bit optimizers ------------------------------------------------------


@dataclass(frozen=True)
class SecondMomentFormat:
    """How the 8-bit second moment is stored: `sqrt` stores sqrt(v) (block absmax of sqrt(v)), else v."""

    zero: bool  # whether the unsigned dynamic map keeps the code 0
    sqrt: bool
    doc: str


SECOND_MOMENT_MAPS = {
    "dynamic": SecondMomentFormat(zero=True, sqrt=False, doc="bitsandbytes' map, with the zero point"),
    "nonzero": SecondMomentFormat(zero=False, sqrt=False, doc="v on the dynamic map without 0"),
    "sqrt": SecondMomentFormat(zero=False, sqrt=True, doc="sqrt(v) on the dynamic map without 0"),
}
# what a state saved before the map was selectable (no `v_map` entry) holds
LEGACY_SECOND_MOMENT_MAP = "dynamic"


def first_moment_map(bits: int, device: torch.device | str | None = None) -> QuantMap:
    return QuantMap.build(dynamic_map(True, bits=bits)).to(device)


def second_moment_map(name: str, device: torch.device | str | None = None) -> QuantMap:
    """The 8-bit map of SECOND_MOMENT_MAPS[name]."""
    return QuantMap.build(dynamic_map(False, zero=SECOND_MOMENT_MAPS[name].zero)).to(device)


# --- block-wise scales ---------------------------------------------------------------------------------


def num_blocks(numel: int, block: int = QBLOCK) -> int:
    return math.ceil(numel / block)


def as_blocks(flat: torch.Tensor, block: int = QBLOCK) -> torch.Tensor:
    """(n,) -> (blocks, block): a view when n is a multiple of block, else a zero-padded copy."""
    pad = num_blocks(flat.numel(), block) * block - flat.numel()
    return flat.view(-1, block) if pad == 0 else F.pad(flat, (0, pad)).view(-1, block)


def quantize_blocks(blocks: torch.Tensor, qmap: QuantMap) -> tuple[torch.Tensor, torch.Tensor]:
    """(blocks, block) fp32 -> (codes uint8 (blocks, block), absmax fp32 (blocks,))."""
    absmax = blocks.abs().amax(dim=1)  # (blocks,); not aminmax: its dim-wise CPU path is ~40x slower
    scale = torch.where(absmax > 0, absmax, torch.ones_like(absmax))
    return qmap.nearest(blocks / scale[:, None]), absmax


def quantize_blocks_stochastic(
    blocks: torch.Tensor, qmap: QuantMap, step: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """As quantize_blocks, each value rounded stochastically (QuantMap.stochastic, hashed_uniform of `step`)."""
    absmax = blocks.abs().amax(dim=1)
    scale = torch.where(absmax > 0, absmax, torch.ones_like(absmax))
    u = hashed_uniform(tuple(blocks.shape), step, blocks.device)
    return qmap.stochastic(blocks / scale[:, None], u), absmax


def quantize_blockwise(
    x: torch.Tensor, qmap: QuantMap, block: int = QBLOCK
) -> tuple[torch.Tensor, torch.Tensor]:
    """x (any shape) -> (codes: uint8 (x.numel(),), absmax: fp32 (blocks,))."""
    codes, absmax = quantize_blocks(as_blocks(x.detach().reshape(-1).float(), block), qmap)
    return codes.view(-1)[: x.numel()], absmax


def dequantize_blocks(codes: torch.Tensor, absmax: torch.Tensor, qmap: QuantMap, block: int) -> torch.Tensor:
    """codes uint8 (n,), absmax (blocks,) -> fp32 (blocks, block); the padding past n is 0."""
    return as_blocks(qmap.decode(codes), block).mul_(absmax[:, None])


def dequantize_blockwise(
    codes: torch.Tensor, absmax: torch.Tensor, qmap: QuantMap, block: int = QBLOCK
) -> torch.Tensor:
    """codes uint8 (n,), absmax (blocks,) -> fp32 (n,)."""
    return dequantize_blocks(codes, absmax, qmap, block).view(-1)[: codes.numel()]


# --- rank-1 scales (4-bit second moment) ----------------------------------------------------------------


def rank1_shape(shape: tuple[int, ...]) -> tuple[int, int] | None:
    """The matrix a tensor's rank-1 scales are taken over: (dim 0, the rest), or None below 2 dims."""
    if len(shape) < 2:
        return None
    return shape[0], math.prod(shape[1:])


def rank1_scale(row: torch.Tensor, col: torch.Tensor) -> torch.Tensor:
    """min(row max, column max) per element, (rows, cols); 1 where it is 0 (the whole row or column is 0)."""
    scale = torch.minimum(row[:, None], col[None, :])
    return torch.where(scale > 0, scale, torch.ones_like(scale))


def quantize_rank1(x: torch.Tensor, qmap: QuantMap) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x (rows, cols), >= 0 -> (codes uint8 (rows, cols), row max (rows,), column max (cols,))."""
    row, col = x.amax(dim=1), x.amax(dim=0)
    return qmap.nearest(x / rank1_scale(row, col)), row, col


def dequantize_rank1(
    codes: torch.Tensor, row: torch.Tensor, col: torch.Tensor, qmap: QuantMap
) -> torch.Tensor:
    """codes uint8 (rows, cols) -> fp32 (rows, cols); an element whose row or column max is 0 is 0."""
    return qmap.decode(codes) * torch.minimum(row[:, None], col[None, :])


# --- two 4-bit codes per byte ---------------------------------------------------------------------------


def packed_size(numel: int) -> int:
    return (numel + 1) // 2


def pack_nibbles(codes: torch.Tensor) -> torch.Tensor:
    """uint8 codes < 16, (n,) -> (ceil(n/2),): element 2i in the low nibble, 2i + 1 in the high one."""
    flat = codes.reshape(-1)
    if flat.numel() % 2:
        flat = F.pad(flat, (0, 1))
    pairs = flat.view(-1, 2)
    return pairs[:, 0] | (pairs[:, 1] << 4)


def unpack_nibbles(packed: torch.Tensor, numel: int) -> torch.Tensor:
    """The inverse of pack_nibbles: (ceil(n/2),) uint8 -> (n,) uint8 codes."""
    return torch.stack([packed & 15, packed >> 4], dim=1).view(-1)[:numel]
