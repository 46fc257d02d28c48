"""AdamW steps on 8-bit and 4-bit moments (PyTorch), and what an optimizer state of either holds.

The 8-bit step is the reference of the fused Triton kernel in cramming.kernels.adamw8bit: the two are
tested against each other, so any change to the arithmetic here must be made there too. Both de-quantize
the moments, update them and the parameter in fp32, and only then re-quantize the moments.

Gradient elements that are NaN or inf are skipped: that element's parameter and moments keep their values
(a non-finite value would otherwise poison its whole block through the absmax). The training loop's own
non-finite check skips such steps anyway; this keeps the state sane when the optimizer is used without it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from cramming.optim.quant import (
    LEGACY_FIRST_MOMENT_FORMAT,
    LEGACY_SECOND_MOMENT_MAP,
    QBLOCK,
    QBLOCK_4BIT,
    SECOND_MOMENT_MAPS,
    QuantMap,
    as_blocks,
    dequantize_blocks,
    dequantize_blockwise,
    dequantize_rank1,
    dynamic_map,
    num_blocks,
    pack_nibbles,
    packed_size,
    quantize_blocks,
    quantize_blocks_stochastic,
    quantize_rank1,
    rank1_shape,
    second_moment_map,
    unpack_nibbles,
)

# the `v_map` entry of a 4-bit state (the 8-bit ones hold a SECOND_MOMENT_MAPS name)
RANK1_DYNAMIC4 = "rank1_dynamic4"


@dataclass(frozen=True)
class AdamScalars:
    """The step's scalars of AdamW, computed once on the host (in float64) and shared by every path.

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


def adamw_step(
    p: torch.Tensor, g: torch.Tensor, m: torch.Tensor, v: torch.Tensor, s: AdamScalars
) -> torch.Tensor:
    """AdamW on fp32 tensors of one shape, in place on p, m and v, rounding exactly as the kernel does (no
    fused multiply-adds); non-finite gradient elements are skipped. Returns sqrt(v)."""
    keep = None
    # g·g is finite exactly when every element is (squares cannot cancel); one BLAS pass, no temporaries.
    # A finite g so large that g·g overflows takes the exact (slower) masked path below as well.
    if not math.isfinite(torch.dot(g.reshape(-1), g.reshape(-1)).item()):
        keep = torch.isfinite(g)
        g = torch.where(keep, g, 0.0)
        old = (p.clone(), m.clone(), v.clone())
    m.mul_(s.beta1).add_(g * s.one_minus_beta1)
    work = g * g
    v.mul_(s.beta2).add_(work.mul_(s.one_minus_beta2))
    root = torch.sqrt(v)
    denom = torch.div(root, s.bias2_sqrt, out=work).add_(s.eps)
    p.mul_(s.decay).sub_(torch.div(m, denom, out=denom).mul_(s.step_size))
    if keep is not None:
        for new, before in zip((p, m, v), old, strict=True):
            torch.where(keep, new, before, out=new)
        root = torch.sqrt(v)
    return root


def fp32_work(param: torch.Tensor, block: int | None) -> tuple[torch.Tensor, bool]:
    """The parameter as fp32 (blocks, block) (or flat with block None), and whether that is `param` itself."""
    flat = param.detach().reshape(-1)
    aliased = param.dtype == torch.float32 and param.is_contiguous()
    if block is not None:
        aliased = aliased and param.numel() % block == 0
        return as_blocks(flat.float(), block), aliased
    return flat.float(), aliased


# --- 8 bits ---------------------------------------------------------------------------------------------


@dataclass
class QuantizedMoments:
    """The two AdamW moments of one tensor in 8 bits: codes (n,) uint8 and absmax (blocks,) fp32 each."""

    m_codes: torch.Tensor
    m_absmax: torch.Tensor
    v_codes: torch.Tensor
    v_absmax: torch.Tensor

    @classmethod
    def zeros(cls, numel: int, device: torch.device) -> QuantizedMoments:
        # absmax 0 makes every code decode to 0, whatever the map
        nb = num_blocks(numel)
        return cls(
            m_codes=torch.zeros(numel, dtype=torch.uint8, device=device),
            m_absmax=torch.zeros(nb, dtype=torch.float32, device=device),
            v_codes=torch.zeros(numel, dtype=torch.uint8, device=device),
            v_absmax=torch.zeros(nb, dtype=torch.float32, device=device),
        )


def specs_8bit(numel: int) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    nb = num_blocks(numel)
    return {
        "m_codes": ((numel,), torch.uint8),
        "m_absmax": ((nb,), torch.float32),
        "v_codes": ((numel,), torch.uint8),
        "v_absmax": ((nb,), torch.float32),
    }


# elements per piece of the PyTorch 8-bit step (1024 blocks, 1 MiB per fp32 temporary); measured flat from
# 2^17 to 2^20 on the bench model, slower at 2^14 (per-piece overhead) and 2^22 (temporaries out of cache)
CHUNK = 1 << 18


def adamw8bit_update_torch(
    param: torch.Tensor,
    grad: torch.Tensor,
    moments: QuantizedMoments,
    m_map: QuantMap,
    v_map: QuantMap,
    s: AdamScalars,
    *,
    sqrt_v: bool = False,
) -> None:
    """One AdamW step with 8-bit moments, in place on `param` and `moments` (fp32 arithmetic).

    sqrt_v: the second moment is stored as sqrt(v) (codes and absmax of sqrt(v)), else as v.
    The tensor is stepped in pieces of CHUNK elements (whole blocks): the fp32 temporaries (m, v, the
    update, the lookup indices) are then about a MiB each that the allocator reuses and the caches hold,
    instead of 4 B/param each, freshly page-faulted every step (that made the step 2.5x slower).
    """
    n = param.numel()
    contiguous = param.is_contiguous()
    flat_p = param.detach().reshape(-1) if contiguous else param.detach().contiguous().view(-1)
    flat_g = grad.detach().reshape(-1)
    for start in range(0, n, CHUNK):
        end = min(n, start + CHUNK)
        blocks = slice(start // QBLOCK, num_blocks(end))
        piece = flat_p[start:end]
        work = piece if piece.dtype == torch.float32 else piece.float()
        _step_8bit_chunk(
            work,
            flat_g[start:end].float(),
            QuantizedMoments(
                moments.m_codes[start:end],
                moments.m_absmax[blocks],
                moments.v_codes[start:end],
                moments.v_absmax[blocks],
            ),
            m_map,
            v_map,
            s,
            sqrt_v,
        )
        if work is not piece:
            piece.copy_(work)
    if not contiguous:
        param.detach().copy_(flat_p.view(param.shape))


def _step_8bit_chunk(
    p: torch.Tensor,
    g: torch.Tensor,
    moments: QuantizedMoments,
    m_map: QuantMap,
    v_map: QuantMap,
    s: AdamScalars,
    sqrt_v: bool,
) -> None:
    """adamw8bit_update_torch on whole blocks: p, g fp32 (k,), in place on p and the moments' views.

    The work runs on (blocks, 256) views, zero-padded only when k is not a multiple of 256 (the last
    piece); the padding holds g = m = v = 0, so it stays 0 and never raises a block's absmax."""
    k = p.numel()
    p_blocks = as_blocks(p)
    m = dequantize_blocks(moments.m_codes, moments.m_absmax, m_map, QBLOCK)
    v = dequantize_blocks(moments.v_codes, moments.v_absmax, v_map, QBLOCK)
    if sqrt_v:
        v.mul_(v)
    root = adamw_step(p_blocks, as_blocks(g), m, v, s)
    if k % QBLOCK:
        p.copy_(p_blocks.view(-1)[:k])
    for codes, absmax, (new_codes, new_absmax) in (
        (moments.m_codes, moments.m_absmax, quantize_blocks(m, m_map)),
        (moments.v_codes, moments.v_absmax, quantize_blocks(root if sqrt_v else v, v_map)),
    ):
        codes.copy_(new_codes.view(-1)[:k])
        absmax.copy_(new_absmax)


def convert_second_moment(moments: QuantizedMoments, saved: str, wanted: str) -> None:
    """Re-encode an 8-bit second moment stored with the map `saved` in the map `wanted`, in place (both
    SECOND_MOMENT_MAPS names). Costs one more rounding of v; a v stored as 0 by the `dynamic` map becomes
    the smallest code of the new map."""
    if saved == wanted:
        return
    device = moments.v_codes.device
    v = dequantize_blockwise(moments.v_codes, moments.v_absmax, second_moment_map(saved, device))
    if SECOND_MOMENT_MAPS[saved].sqrt:
        v = v * v
    if SECOND_MOMENT_MAPS[wanted].sqrt:
        v = torch.sqrt(v)
    codes, absmax = quantize_blocks(as_blocks(v), second_moment_map(wanted, device))
    moments.v_codes.copy_(codes.view(-1)[: v.numel()])
    moments.v_absmax.copy_(absmax)


# --- 4 bits ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Maps4bit:
    """The 4-bit maps. Second moment: the unsigned dynamic map without zero (Li et al.'s "DE-0"), not
    their linear map (k + 1)/16: on wide-ranged blocks the linear map rounds every v below 1/32 of its
    scale up to 1/16, and those elements barely move (0.43x fp32 AdamW's displacement against 0.69x in
    tests/test_optim_drift.py's trajectory; results/optimizers/quality.md)."""

    m: QuantMap  # signed dynamic, 16 codes
    v: QuantMap  # unsigned dynamic without zero, 16 codes, 5.5e-4 .. 1

    @classmethod
    def build(cls, device: torch.device | str | None = None) -> Maps4bit:
        return cls(
            m=QuantMap.build(dynamic_map(True, bits=4)).to(device),
            v=QuantMap.build(dynamic_map(False, bits=4, zero=False)).to(device),
        )


def specs_4bit(shape: tuple[int, ...]) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """First moment: packed codes and an absmax per 128; second: packed codes and row / column maxima
    (rank-1), or an absmax per 128 for 1-D tensors."""
    numel = math.prod(shape)
    specs = {
        "m_codes": ((packed_size(numel),), torch.uint8),
        "m_absmax": ((num_blocks(numel, QBLOCK_4BIT),), torch.float32),
        "v_codes": ((packed_size(numel),), torch.uint8),
    }
    matrix = rank1_shape(shape)
    if matrix is None:
        specs["v_absmax"] = ((num_blocks(numel, QBLOCK_4BIT),), torch.float32)
    else:
        specs["v_row"] = ((matrix[0],), torch.float32)
        specs["v_col"] = ((matrix[1],), torch.float32)
    return specs


def decode_v4(state: dict, n: int, matrix: tuple[int, int] | None, maps: Maps4bit) -> torch.Tensor:
    """The 4-bit second moment of `state` as fp32 (n,): rank-1 scales for a matrix, blocks of 128 else."""
    codes = unpack_nibbles(state["v_codes"], n)
    if matrix is None:
        return dequantize_blocks(codes, state["v_absmax"], maps.v, QBLOCK_4BIT).view(-1)[:n].clone()
    return dequantize_rank1(codes.view(matrix), state["v_row"], state["v_col"], maps.v).view(-1)


def encode_v4(v: torch.Tensor, state: dict, matrix: tuple[int, int] | None, maps: Maps4bit) -> None:
    """Store fp32 v (n,) into `state` in the format decode_v4 reads."""
    if matrix is None:
        codes, absmax = quantize_blocks(as_blocks(v, QBLOCK_4BIT), maps.v)
        state["v_absmax"].copy_(absmax)
    else:
        codes, row, col = quantize_rank1(v.view(matrix), maps.v)
        state["v_row"].copy_(row)
        state["v_col"].copy_(col)
    state["v_codes"].copy_(pack_nibbles(codes.reshape(-1)[: v.numel()]))


def _divisor(v: torch.Tensor) -> torch.Tensor:
    """sqrt(v) where v > 0, else 1: the `normalized` first moment's divisor (v is 0 only where every
    gradient so far was 0, and m with it)."""
    root = v.sqrt()
    return torch.where(root > 0, root, torch.ones_like(root))


def decode_m4(state: dict, n: int, maps: Maps4bit, v: torch.Tensor, normalized: bool) -> torch.Tensor:
    """The 4-bit first moment as fp32 (n,); `normalized` codes hold m / sqrt(v) for the stored v given."""
    m = dequantize_blocks(unpack_nibbles(state["m_codes"], n), state["m_absmax"], maps.m, QBLOCK_4BIT)
    m = m.view(-1)[:n].clone()
    return m.mul_(_divisor(v)) if normalized else m


def encode_m4(
    m: torch.Tensor,
    state: dict,
    maps: Maps4bit,
    v: torch.Tensor,
    normalized: bool,
    stochastic_step: int | None,
) -> None:
    """Store fp32 m (n,) into `state`, divided by sqrt(v) first when `normalized` (v: the stored v, decoded)."""
    if normalized:
        m = m / _divisor(v)
    blocks = as_blocks(m, QBLOCK_4BIT)
    if stochastic_step is None:
        codes, absmax = quantize_blocks(blocks, maps.m)
    else:
        codes, absmax = quantize_blocks_stochastic(blocks, maps.m, stochastic_step)
    state["m_codes"].copy_(pack_nibbles(codes.view(-1)[: m.numel()]))
    state["m_absmax"].copy_(absmax)


def adamw4bit_update_torch(
    param: torch.Tensor,
    grad: torch.Tensor,
    state: dict,
    maps: Maps4bit,
    s: AdamScalars,
    stochastic_step: int | None = None,
    normalized: bool = False,
) -> None:
    """One AdamW step with 4-bit moments (the tensors of specs_4bit in `state`), in place.

    stochastic_step: None rounds the first moment to the nearest code; a step number rounds it stochastically
    (hashed_uniform of that step). With 16 codes, round-to-nearest sticks: 0.9·c rounds back to c, so a
    moment whose gradients average out keeps its value and its weight keeps moving one way
    (results/optimizers/quality.md); stochastic rounding is unbiased and lets it decay on average. It does not stop
    single weights from moving several times fp32's largest move: both 4-bit moments cause that (the ablation
    in results/optimizers/quality.md), and on GLUE it scored no better (results/optimizers/).

    normalized: the first moment is stored as m / sqrt(v), v as stored after this step (the `normalized`
    format of FIRST_MOMENT_FORMATS), and read back as codes times sqrt of the stored v of the step before.
    The v codes are therefore written first and decoded again for the division."""
    n = param.numel()
    matrix = rank1_shape(tuple(param.shape))
    g = grad.detach().reshape(-1).float()
    p, aliased = fp32_work(param, None)
    v = decode_v4(state, n, matrix, maps)
    m = decode_m4(state, n, maps, v, normalized)
    adamw_step(p, g, m, v, s)
    if not aliased:
        param.detach().copy_(p.view(param.shape))
    encode_v4(v, state, matrix, maps)
    stored_v = decode_v4(state, n, matrix, maps) if normalized else v
    encode_m4(m, state, maps, stored_v, normalized, stochastic_step)


def convert_first_moment_4bit(
    state: dict, shape: tuple[int, ...], maps: Maps4bit, saved: str, wanted: str
) -> None:
    """Re-encode a 4-bit state's first moment from the format `saved` to `wanted` (FIRST_MOMENT_FORMATS),
    in place; the second moment is unchanged. Rounds to nearest (a conversion is no step)."""
    if saved == wanted:
        return
    n = math.prod(shape)
    v = decode_v4(state, n, rank1_shape(shape), maps)
    m = decode_m4(state, n, maps, v, saved == "normalized")
    encode_m4(m, state, maps, v, wanted == "normalized", None)


def decode_4bit(state: dict, shape: tuple[int, ...], maps: Maps4bit) -> tuple[torch.Tensor, torch.Tensor]:
    """The fp32 first and second moments (n,) that a 4-bit state of moments of `shape` holds."""
    n = math.prod(shape)
    v = decode_v4(state, n, rank1_shape(shape), maps)
    return decode_m4(state, n, maps, v, saved_first_moment_format(state) == "normalized"), v


def encode_second_moment_4bit(v: torch.Tensor, shape: tuple[int, ...], maps: Maps4bit) -> dict:
    """Fresh 4-bit second-moment entries (codes and scales) of fp32 v (n,) of moments of `shape`."""
    entries = {k: torch.zeros(s, dtype=d) for k, (s, d) in specs_4bit(shape).items() if k.startswith("v_")}
    encode_v4(v, entries, rank1_shape(shape), maps)
    return entries


def encode_first_moment_4bit(
    m: torch.Tensor, stored: dict, shape: tuple[int, ...], maps: Maps4bit, m_format: str
) -> dict:
    """Fresh 4-bit first-moment entries of fp32 m (n,), rounded to nearest; a `normalized` one is divided
    by the second moment that `stored` (4-bit second-moment entries) holds, as a step stores it."""
    entries = {k: torch.zeros(s, dtype=d) for k, (s, d) in specs_4bit(shape).items() if k.startswith("m_")}
    normalized = m_format == "normalized"
    v = decode_v4(stored, math.prod(shape), rank1_shape(shape), maps) if normalized else None
    encode_m4(m, entries, maps, v, normalized, None)
    return entries


def saved_format(state: dict) -> str:
    """The `v_map` of a quantized state; a state saved before it was recorded is 8-bit `dynamic`."""
    return state.get("v_map", LEGACY_SECOND_MOMENT_MAP)


def saved_first_moment_format(state: dict) -> str:
    """The `m_format` of a 4-bit state; a state saved before it was recorded is `block`."""
    return state.get("m_format", LEGACY_FIRST_MOMENT_FORMAT)
