"""Fused 8-bit AdamW update: de-quantize -> AdamW -> re-quantize, one pass over memory (Triton).

Dettmers et al., "8-bit Optimizers via Block-wise Quantization" (arXiv 2110.02861). Each program owns
BLOCKS_PER_PROGRAM quantization blocks of QBLOCK elements: it reads the parameter, the gradient and the two
moments' uint8 codes and fp32 block absmax, applies AdamW in fp32 registers, writes the parameter, then
re-quantizes each moment against its block's new absmax (nearest code of the 256-entry map, found by an
8-step binary search over the midpoints between codes). Moment traffic per element: 2 bytes read and
2 written, against 8 and 8 for fp32 AdamW. With SQRT_V the second moment is stored as sqrt(v) (Li et al.,
arXiv 2309.01507, on the zero point of second-moment maps); the map itself is an input, so a map with or
without the code 0 needs no change here. NaN / inf gradient elements are skipped (parameter and moments
keep their values).

The pure-PyTorch reference is `cramming.optim.lowbit.adamw8bit_update_torch` (same arithmetic, same order,
same tie rule); `tests/test_optim_kernels.py` compares the two. This module takes plain tensors and floats
and imports nothing from cramming.optim (the optimizer imports it, not the other way round). An optimizer
step is not differentiated, so there is no backward kernel and no autograd.Function:
`adamw8bit_update_triton` is what the optimizer calls.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from cramming.kernels import triton_status

BLOCKS_PER_PROGRAM = 4  # 1024 elements per program: enough bytes in flight for a memory-bound update
QBLOCK = 256  # elements per quantization block (one fp32 absmax each), cramming.optim.quant's 8-bit block
# launch options, shared with scripts/checks/aot_check.py: no mul+add -> fma contraction, so the kernel rounds exactly
# as the PyTorch reference does
LAUNCH = {"num_warps": 4, "enable_fp_fusion": False}


@triton.jit
def _nearest_code(y, map_ptr):
    """Index of the map's code nearest to y: the number of midpoints (map[k-1] + map[k])·0.5 below y,
    counted by binary search (ties go to the lower code). map_ptr: (256,) fp32, ascending."""
    idx = tl.zeros_like(y).to(tl.int32)
    for i in tl.static_range(8):
        cand = idx + (1 << (7 - i))  # <= 255
        midpoint = (tl.load(map_ptr + cand - 1) + tl.load(map_ptr + cand)) * 0.5
        idx = tl.where(midpoint < y, cand, idx)
    return idx


@triton.jit
def _adamw8bit_update_kernel(
    param_ptr,  # (n,) fp32 / bf16 / fp16, updated in place
    grad_ptr,  # (n,) same dtype as param
    m_codes_ptr,  # (n,) uint8 first-moment codes (signed map), updated in place
    m_absmax_ptr,  # (blocks,) fp32 first-moment block absmax, updated in place
    v_codes_ptr,  # (n,) uint8 second-moment codes (unsigned map), updated in place
    v_absmax_ptr,  # (blocks,) fp32
    m_map_ptr,  # (256,) fp32 signed dynamic map, ascending
    v_map_ptr,  # (256,) fp32 unsigned map (with or without 0), ascending
    n,
    beta1,
    one_minus_beta1,
    beta2,
    one_minus_beta2,
    eps,
    decay,  # 1 - lr * weight_decay
    step_size,  # lr / (1 - beta1^t)
    bias2_sqrt,  # sqrt(1 - beta2^t)
    QBLOCK: tl.constexpr,
    BLOCKS_PER_PROGRAM: tl.constexpr,
    SQRT_V: tl.constexpr,  # the second moment's codes and absmax are of sqrt(v)
):
    pid = tl.program_id(0)
    block_ids = (pid * BLOCKS_PER_PROGRAM + tl.arange(0, BLOCKS_PER_PROGRAM)).to(tl.int64)  # (B,)
    offs = block_ids[:, None] * QBLOCK + tl.arange(0, QBLOCK)[None, :]  # (B, QBLOCK)
    mask = offs < n
    block_mask = block_ids < tl.cdiv(n, QBLOCK)

    g = tl.load(grad_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    p = tl.load(param_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    m_code = tl.load(m_codes_ptr + offs, mask=mask, other=0).to(tl.int32)
    v_code = tl.load(v_codes_ptr + offs, mask=mask, other=0).to(tl.int32)
    m_absmax = tl.load(m_absmax_ptr + block_ids, mask=block_mask, other=0.0)  # (B,)
    v_absmax = tl.load(v_absmax_ptr + block_ids, mask=block_mask, other=0.0)
    # padding lanes hold 0, so that they neither overflow below nor count towards the new absmax
    m = tl.where(mask, tl.load(m_map_ptr + m_code) * m_absmax[:, None], 0.0)
    v = tl.where(mask, tl.load(v_map_ptr + v_code) * v_absmax[:, None], 0.0)
    if SQRT_V:
        v = v * v

    # AdamW, as torch.optim.AdamW orders it:
    #   m = b1 m + (1-b1) g;  v = b2 v + (1-b2) g²;  p = p (1 - lr wd) - lr/(1-b1^t) · m / (sqrt(v)/sqrt(1-b2^t) + eps)
    # a NaN / inf gradient element leaves its p, m and v as they were
    keep = (g == g) & (tl.abs(g) != float("inf"))
    g = tl.where(keep, g, 0.0)
    m = tl.where(keep, m * beta1 + g * one_minus_beta1, m)
    v = tl.where(keep, v * beta2 + (g * g) * one_minus_beta2, v)
    root = tl.sqrt_rn(v)
    denom = tl.div_rn(root, bias2_sqrt) + eps
    p = tl.where(keep, p * decay - step_size * tl.div_rn(m, denom), p)
    tl.store(param_ptr + offs, p.to(param_ptr.dtype.element_ty), mask=mask)

    # re-quantize against the new block absmax
    if SQRT_V:
        v = root
    new_m_absmax = tl.max(tl.abs(m), axis=1)  # (B,)
    new_v_absmax = tl.max(v, axis=1)
    m_scale = tl.where(new_m_absmax > 0, new_m_absmax, 1.0)
    v_scale = tl.where(new_v_absmax > 0, new_v_absmax, 1.0)
    m_code = _nearest_code(tl.div_rn(m, m_scale[:, None]), m_map_ptr)
    v_code = _nearest_code(tl.div_rn(v, v_scale[:, None]), v_map_ptr)
    tl.store(m_codes_ptr + offs, m_code.to(tl.uint8), mask=mask)
    tl.store(v_codes_ptr + offs, v_code.to(tl.uint8), mask=mask)
    tl.store(m_absmax_ptr + block_ids, new_m_absmax, mask=block_mask)
    tl.store(v_absmax_ptr + block_ids, new_v_absmax, mask=block_mask)


def _check_launchable(t: torch.Tensor) -> None:
    ok, why = triton_status(t.device.type)
    if not ok:
        raise RuntimeError(
            f"the fused 8-bit AdamW kernel cannot launch: {why}; build the optimizer with kernel='torch' or "
            "'auto' to use the PyTorch path"
        )


def adamw8bit_update_triton(
    param: torch.Tensor,
    grad: torch.Tensor,
    m_codes: torch.Tensor,
    m_absmax: torch.Tensor,
    v_codes: torch.Tensor,
    v_absmax: torch.Tensor,
    m_map: torch.Tensor,
    v_map: torch.Tensor,
    *,
    beta1: float,
    one_minus_beta1: float,
    beta2: float,
    one_minus_beta2: float,
    eps: float,
    decay: float,
    step_size: float,
    bias2_sqrt: float,
    sqrt_v: bool = False,
    qblock: int = QBLOCK,
) -> None:
    """In-place fused update of a contiguous `param` (n,) and its 8-bit moments: codes (n,) uint8, absmax
    (ceil(n / qblock),) fp32; m_map / v_map: the (256,) fp32 codes, ascending. The scalars are those of
    cramming.optim.lowbit.AdamScalars; same contract as the PyTorch reference."""
    _check_launchable(param)
    if not param.is_contiguous():
        raise ValueError("the fused 8-bit AdamW kernel updates contiguous parameters only")
    grad = grad.contiguous()
    n = param.numel()
    grid = (triton.cdiv(triton.cdiv(n, qblock), BLOCKS_PER_PROGRAM),)
    _adamw8bit_update_kernel[grid](
        param,
        grad,
        m_codes,
        m_absmax,
        v_codes,
        v_absmax,
        m_map,
        v_map,
        n,
        beta1,
        one_minus_beta1,
        beta2,
        one_minus_beta2,
        eps,
        decay,
        step_size,
        bias2_sqrt,
        QBLOCK=qblock,
        BLOCKS_PER_PROGRAM=BLOCKS_PER_PROGRAM,
        SQRT_V=sqrt_v,
        **LAUNCH,
    )
