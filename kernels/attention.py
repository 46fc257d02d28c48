"""Fused non-causal attention with a key-padding mask and dropout, forward and backward.

FlashAttention-2 (Dao, "FlashAttention-2: Faster Attention with Better Parallelism and Work Partitioning",
arXiv 2307.08691): the (seq, seq) score matrix is never stored. The forward walks the key blocks with an
online softmax and saves only the log-sum-exp of each query row; the backward recomputes the
probabilities block by block from it.

Notation for one (batch, head): S = scale * Q K^T + B, P = softmax(S) over keys (masked keys get P = 0),
Z = the dropout keep-mask, O = (P * Z / (1 - p)) V. B is 0, or with ALiBi (Press et al., "Train Short, Test
Long", arXiv 2108.12409) the head's distance bias B_ij = -slope_h * |i - j|, computed in registers from the
row and column indices of the tile and one fp32 slope per head, so no (heads, seq, seq) tensor exists (as
FlashAttention-2's `alibi_slopes`). B is a constant: it has no gradient and leaves the formulas below as
they are. Derivative implemented by the backward:

    dV = (P * Z / (1 - p))^T dO
    dP = (dO V^T) * Z / (1 - p)
    dS = P * (dP - D),   D_i = sum_j P_ij dP_ij = rowsum(dO * O)_i     (softmax Jacobian)
    dQ = scale * dS K,   dK = scale * dS^T Q

Scores are kept in base 2 inside the kernels (exp2 is cheaper than exp): s2 = S * log2(e) (the ALiBi bias
too: slope * log2(e) per program), and the saved
LSE is log2 sum_j exp2(s2_ij). A query row with no real key at all (a fully padded sequence) gets O = 0,
LSE = 0 and zero gradients instead of 0/0; `attention_reference` defines the same semantics.

Backward work split: a preprocess kernel computes D; one program per (key block, batch * head) holds K_j,
V_j and sums dK_j, dV_j over all query blocks (no atomics). dQ needs a sum over key blocks instead: when
one key block covers the sequence (seq <= 128 at head_dim 64, the pretraining case) that same program
owns every dQ row and writes it directly; otherwise a second kernel, one program per query block,
recomputes P and dP and sums dS K. That costs two extra matmuls per tile instead of fp32 atomic adds, but
is deterministic and needs no fp32 dQ buffer.

Layout: q, k, v are (batch, heads, seq, head_dim) with a contiguous last dimension, any other strides
(a view into a fused QKV projection works without a copy). The output is allocated (batch, seq, heads,
head_dim) in memory and returned as a (batch, heads, seq, head_dim) view, so the caller's
`out.transpose(1, 2).reshape(batch, seq, hidden)` is free.
"""

from __future__ import annotations

import math
from dataclasses import astuple, dataclass

import torch
import triton
import triton.language as tl

LOG2E = 1.4426950408889634
LOG2E_C: tl.constexpr = tl.constexpr(LOG2E)  # the same, readable inside @triton.jit functions


@triton.jit
def _dot(a, b, IEEE: tl.constexpr):
    # fp32 inputs: full fp32 products (the tests compare against an fp32 reference), not TF32. A statement,
    # not a conditional expression: only the taken branch is compiled.
    if IEEE:  # noqa: SIM108
        out = tl.dot(a, b, input_precision="ieee")
    else:
        out = tl.dot(a, b)
    return out


@triton.jit
def _keep_mask(seed, bh, rows, cols, S, dropout_p):
    # Dropout keep-mask of one tile; rows (query positions) and cols (key positions) are index tensors
    # that broadcast to the tile, either orientation. Philox counter = the element's flat index in the
    # (batch * heads, seq, seq) probability tensor, in int64, so the forward, the backward and
    # `dropout_keep_mask` draw the same number for the same element whatever their block sizes.
    offs = (bh.to(tl.int64) * S + rows) * S + cols
    return tl.rand(seed, offs) >= dropout_p


@triton.jit
def _alibi_bias2(slope2, rows, cols):
    # ALiBi bias of one tile in base 2, -slope * log2(e) * |i - j|, fp32; rows (query positions) and cols
    # (key positions) are int32 index tensors that broadcast to the tile, either orientation.
    return -slope2 * tl.abs(rows - cols).to(tl.float32)


@triton.jit(do_not_specialize=["seed"])
def _attention_fwd_kernel(
    Q,  # (B, H, S, D) strides (sq_b, sq_h, sq_s, 1)
    K,  # (B, H, S, D) strides (sk_b, sk_h, sk_s, 1)
    V,  # (B, H, S, D) strides (sv_b, sv_h, sv_s, 1)
    KPM,  # (B, S) uint8, 1 = real key; unused when not HAS_KPM
    SLOPES,  # (H,) fp32: each head's ALiBi slope; unused when not HAS_ALIBI
    OUT,  # (B, H, S, D) strides (so_b, so_h, so_s, 1)
    LSE,  # (B, H, S) fp32 contiguous: base-2 log-sum-exp of each query row
    sq_b,
    sq_h,
    sq_s,
    sk_b,
    sk_h,
    sk_s,
    sv_b,
    sv_h,
    sv_s,
    so_b,
    so_h,
    so_s,
    skpm_b,
    H,
    S,
    D,
    qk_scale,  # softmax scale * log2(e)
    dropout_p,
    seed,
    HAS_KPM: tl.constexpr,
    HAS_ALIBI: tl.constexpr,
    DROPOUT: tl.constexpr,
    IEEE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    pid_m = tl.program_id(0)
    bh = tl.program_id(1)
    b = (bh // H).to(tl.int64)  # int64 pointer offsets past 2**31 elements
    h = bh % H
    if HAS_ALIBI:
        slope2 = tl.load(SLOPES + h) * LOG2E_C  # fp32, base 2 like the scores
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n0 = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < D
    m_ok = offs_m < S

    q = tl.load(
        Q + b * sq_b + h * sq_h + offs_m[:, None] * sq_s + offs_d[None, :],
        mask=m_ok[:, None] & d_ok[None, :],
        other=0.0,
    )  # (BLOCK_M, BLOCK_D)
    k_base = K + b * sk_b + h * sk_h
    v_base = V + b * sv_b + h * sv_h

    # Running max starts finite: a row whose keys are all masked so far keeps exp2(-inf - m) = 0
    # instead of exp2(-inf + inf) = NaN.
    m_i = tl.full([BLOCK_M], -1.0e30, dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    inv_keep = 1.0 / (1.0 - dropout_p)

    for start_n in range(0, S, BLOCK_N):
        offs_n = start_n + offs_n0
        n_ok = offs_n < S
        kv_mask = n_ok[:, None] & d_ok[None, :]
        k = tl.load(k_base + offs_n[:, None] * sk_s + offs_d[None, :], mask=kv_mask, other=0.0)
        v = tl.load(v_base + offs_n[:, None] * sv_s + offs_d[None, :], mask=kv_mask, other=0.0)
        key_ok = n_ok
        if HAS_KPM:
            key_ok = key_ok & (tl.load(KPM + b * skpm_b + offs_n, mask=n_ok, other=0) != 0)

        s2 = _dot(q, tl.trans(k), IEEE) * qk_scale  # (BLOCK_M, BLOCK_N), base 2
        if HAS_ALIBI:
            s2 += _alibi_bias2(slope2, offs_m[:, None], offs_n[None, :])
        s2 = tl.where(key_ok[None, :], s2, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s2, axis=1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s2 - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)  # the normalizer counts every key, dropped or not
        if DROPOUT:
            keep = _keep_mask(seed, bh, offs_m[:, None], offs_n[None, :], S, dropout_p)
            p = tl.where(keep, p * inv_keep, 0.0)
        acc = acc * alpha[:, None] + _dot(p.to(v.dtype), v, IEEE)
        m_i = m_new

    has_key = l_i > 0.0
    out = acc / tl.where(has_key, l_i, 1.0)[:, None]
    lse = tl.where(has_key, m_i + tl.log2(tl.where(has_key, l_i, 1.0)), 0.0)
    tl.store(
        OUT + b * so_b + h * so_h + offs_m[:, None] * so_s + offs_d[None, :],
        out.to(OUT.dtype.element_ty),
        mask=m_ok[:, None] & d_ok[None, :],
    )
    tl.store(LSE + bh * S + offs_m, lse, mask=m_ok)


@triton.jit
def _attention_bwd_preprocess_kernel(
    OUT,  # (B, H, S, D) strides (so_b, so_h, so_s, 1)
    DO,  # (B, H, S, D) strides (sdo_b, sdo_h, sdo_s, 1)
    DELTA,  # (B, H, S) fp32 contiguous: D_i = rowsum(dO * O)
    so_b,
    so_h,
    so_s,
    sdo_b,
    sdo_h,
    sdo_s,
    H,
    S,
    D,
    BLOCK_M: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    pid_m = tl.program_id(0)
    bh = tl.program_id(1)
    b = (bh // H).to(tl.int64)  # int64 pointer offsets past 2**31 elements
    h = bh % H
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    m_ok = offs_m < S
    mask = m_ok[:, None] & (offs_d[None, :] < D)
    o = tl.load(OUT + b * so_b + h * so_h + offs_m[:, None] * so_s + offs_d[None, :], mask=mask, other=0.0)
    do = tl.load(DO + b * sdo_b + h * sdo_h + offs_m[:, None] * sdo_s + offs_d[None, :], mask=mask, other=0.0)
    delta = tl.sum(o.to(tl.float32) * do.to(tl.float32), axis=1)
    tl.store(DELTA + bh * S + offs_m, delta, mask=m_ok)


@triton.jit(do_not_specialize=["seed"])
def _attention_bwd_dkdv_kernel(
    Q,  # (B, H, S, D) strides (sq_b, sq_h, sq_s, 1)
    K,  # (B, H, S, D) strides (sk_b, sk_h, sk_s, 1)
    V,  # (B, H, S, D) strides (sv_b, sv_h, sv_s, 1)
    KPM,  # (B, S) uint8, 1 = real key; unused when not HAS_KPM
    SLOPES,  # (H,) fp32: each head's ALiBi slope; unused when not HAS_ALIBI
    DO,  # (B, H, S, D) strides (sdo_b, sdo_h, sdo_s, 1)
    LSE,  # (B, H, S) fp32 contiguous, from the forward
    DELTA,  # (B, H, S) fp32 contiguous, from the preprocess kernel
    DQ,  # (B, H, S, D) strides (sdq_b, sdq_h, sdq_s, 1); written only when FUSED_DQ
    DK,  # (B, H, S, D) strides (sdk_b, sdk_h, sdk_s, 1)
    DV,  # (B, H, S, D) strides (sdv_b, sdv_h, sdv_s, 1)
    sq_b,
    sq_h,
    sq_s,
    sk_b,
    sk_h,
    sk_s,
    sv_b,
    sv_h,
    sv_s,
    sdo_b,
    sdo_h,
    sdo_s,
    sdq_b,
    sdq_h,
    sdq_s,
    sdk_b,
    sdk_h,
    sdk_s,
    sdv_b,
    sdv_h,
    sdv_s,
    skpm_b,
    H,
    S,
    D,
    sm_scale,
    qk_scale,  # sm_scale * log2(e)
    dropout_p,
    seed,
    HAS_KPM: tl.constexpr,
    HAS_ALIBI: tl.constexpr,
    DROPOUT: tl.constexpr,
    FUSED_DQ: tl.constexpr,  # one key block covers the whole sequence: this program owns dQ too
    IEEE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    # One program per (key block, batch * head): hold K_j, V_j and accumulate dK_j, dV_j over every query
    # block, in the transposed orientation (keys as rows) so no accumulator needs a transpose.
    pid_n = tl.program_id(0)
    bh = tl.program_id(1)
    b = (bh // H).to(tl.int64)  # int64 pointer offsets past 2**31 elements
    h = bh % H
    if HAS_ALIBI:
        slope2 = tl.load(SLOPES + h) * LOG2E_C  # fp32, base 2 like the scores
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m0 = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < D
    n_ok = offs_n < S
    kv_mask = n_ok[:, None] & d_ok[None, :]
    k = tl.load(K + b * sk_b + h * sk_h + offs_n[:, None] * sk_s + offs_d[None, :], mask=kv_mask, other=0.0)
    v = tl.load(V + b * sv_b + h * sv_h + offs_n[:, None] * sv_s + offs_d[None, :], mask=kv_mask, other=0.0)
    key_ok = n_ok
    if HAS_KPM:
        key_ok = key_ok & (tl.load(KPM + b * skpm_b + offs_n, mask=n_ok, other=0) != 0)

    q_base = Q + b * sq_b + h * sq_h
    do_base = DO + b * sdo_b + h * sdo_h
    dq_base = DQ + b * sdq_b + h * sdq_h
    dk = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
    inv_keep = 1.0 / (1.0 - dropout_p)

    for start_m in range(0, S, BLOCK_M):
        offs_m = start_m + offs_m0
        m_ok = offs_m < S
        row_mask = m_ok[:, None] & d_ok[None, :]
        q = tl.load(q_base + offs_m[:, None] * sq_s + offs_d[None, :], mask=row_mask, other=0.0)
        do = tl.load(do_base + offs_m[:, None] * sdo_s + offs_d[None, :], mask=row_mask, other=0.0)
        lse = tl.load(LSE + bh * S + offs_m, mask=m_ok, other=0.0)
        delta = tl.load(DELTA + bh * S + offs_m, mask=m_ok, other=0.0)

        s2_t = _dot(k, tl.trans(q), IEEE) * qk_scale  # (BLOCK_N, BLOCK_M): S^T in base 2
        if HAS_ALIBI:
            s2_t += _alibi_bias2(slope2, offs_m[None, :], offs_n[:, None])
        # Masked keys and the rows past the end of the sequence contribute nothing.
        p_t = tl.where(key_ok[:, None] & m_ok[None, :], tl.exp2(s2_t - lse[None, :]), 0.0)
        dp_t = _dot(v, tl.trans(do), IEEE)  # (BLOCK_N, BLOCK_M): (dO V^T)^T
        if DROPOUT:
            keep_t = _keep_mask(seed, bh, offs_m[None, :], offs_n[:, None], S, dropout_p)
            pd_t = tl.where(keep_t, p_t * inv_keep, 0.0)
            dp_t = tl.where(keep_t, dp_t * inv_keep, 0.0)
        else:
            pd_t = p_t
        dv += _dot(pd_t.to(do.dtype), do, IEEE)
        ds_t = p_t * (dp_t - delta[None, :])  # (BLOCK_N, BLOCK_M), fp32
        dk += _dot(ds_t.to(q.dtype), q, IEEE)
        if FUSED_DQ:
            dq = _dot(tl.trans(ds_t).to(k.dtype), k, IEEE) * sm_scale  # (BLOCK_M, BLOCK_D)
            tl.store(
                dq_base + offs_m[:, None] * sdq_s + offs_d[None, :], dq.to(DQ.dtype.element_ty), mask=row_mask
            )

    dk = dk * sm_scale
    tl.store(
        DK + b * sdk_b + h * sdk_h + offs_n[:, None] * sdk_s + offs_d[None, :],
        dk.to(DK.dtype.element_ty),
        mask=kv_mask,
    )
    tl.store(
        DV + b * sdv_b + h * sdv_h + offs_n[:, None] * sdv_s + offs_d[None, :],
        dv.to(DV.dtype.element_ty),
        mask=kv_mask,
    )


@triton.jit(do_not_specialize=["seed"])
def _attention_bwd_dq_kernel(
    Q,  # (B, H, S, D) strides (sq_b, sq_h, sq_s, 1)
    K,  # (B, H, S, D) strides (sk_b, sk_h, sk_s, 1)
    V,  # (B, H, S, D) strides (sv_b, sv_h, sv_s, 1)
    KPM,  # (B, S) uint8, 1 = real key; unused when not HAS_KPM
    SLOPES,  # (H,) fp32: each head's ALiBi slope; unused when not HAS_ALIBI
    DO,  # (B, H, S, D) strides (sdo_b, sdo_h, sdo_s, 1)
    LSE,  # (B, H, S) fp32 contiguous
    DELTA,  # (B, H, S) fp32 contiguous
    DQ,  # (B, H, S, D) strides (sdq_b, sdq_h, sdq_s, 1)
    sq_b,
    sq_h,
    sq_s,
    sk_b,
    sk_h,
    sk_s,
    sv_b,
    sv_h,
    sv_s,
    sdo_b,
    sdo_h,
    sdo_s,
    sdq_b,
    sdq_h,
    sdq_s,
    skpm_b,
    H,
    S,
    D,
    sm_scale,
    qk_scale,
    dropout_p,
    seed,
    HAS_KPM: tl.constexpr,
    HAS_ALIBI: tl.constexpr,
    DROPOUT: tl.constexpr,
    IEEE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    # One program per (query block, batch * head): recompute P and dP for every key block, sum dS K.
    pid_m = tl.program_id(0)
    bh = tl.program_id(1)
    b = (bh // H).to(tl.int64)  # int64 pointer offsets past 2**31 elements
    h = bh % H
    if HAS_ALIBI:
        slope2 = tl.load(SLOPES + h) * LOG2E_C  # fp32, base 2 like the scores
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n0 = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < D
    m_ok = offs_m < S
    row_mask = m_ok[:, None] & d_ok[None, :]
    q = tl.load(Q + b * sq_b + h * sq_h + offs_m[:, None] * sq_s + offs_d[None, :], mask=row_mask, other=0.0)
    do = tl.load(
        DO + b * sdo_b + h * sdo_h + offs_m[:, None] * sdo_s + offs_d[None, :], mask=row_mask, other=0.0
    )
    lse = tl.load(LSE + bh * S + offs_m, mask=m_ok, other=0.0)
    delta = tl.load(DELTA + bh * S + offs_m, mask=m_ok, other=0.0)
    k_base = K + b * sk_b + h * sk_h
    v_base = V + b * sv_b + h * sv_h
    dq = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    inv_keep = 1.0 / (1.0 - dropout_p)

    for start_n in range(0, S, BLOCK_N):
        offs_n = start_n + offs_n0
        n_ok = offs_n < S
        kv_mask = n_ok[:, None] & d_ok[None, :]
        k = tl.load(k_base + offs_n[:, None] * sk_s + offs_d[None, :], mask=kv_mask, other=0.0)
        v = tl.load(v_base + offs_n[:, None] * sv_s + offs_d[None, :], mask=kv_mask, other=0.0)
        key_ok = n_ok
        if HAS_KPM:
            key_ok = key_ok & (tl.load(KPM + b * skpm_b + offs_n, mask=n_ok, other=0) != 0)

        s2 = _dot(q, tl.trans(k), IEEE) * qk_scale  # (BLOCK_M, BLOCK_N), base 2
        if HAS_ALIBI:
            s2 += _alibi_bias2(slope2, offs_m[:, None], offs_n[None, :])
        p = tl.where(key_ok[None, :], tl.exp2(s2 - lse[:, None]), 0.0)
        dp = _dot(do, tl.trans(v), IEEE)  # (BLOCK_M, BLOCK_N)
        if DROPOUT:
            keep = _keep_mask(seed, bh, offs_m[:, None], offs_n[None, :], S, dropout_p)
            dp = tl.where(keep, dp * inv_keep, 0.0)
        ds = p * (dp - delta[:, None])
        dq += _dot(ds.to(k.dtype), k, IEEE)

    dq = dq * sm_scale
    tl.store(
        DQ + b * sdq_b + h * sdq_h + offs_m[:, None] * sdq_s + offs_d[None, :],
        dq.to(DQ.dtype.element_ty),
        mask=row_mask,
    )


@triton.jit(do_not_specialize=["seed"])
def _dropout_keep_mask_kernel(
    KEEP,  # (B * H, S, S) bool-as-uint8 contiguous
    S,
    dropout_p,
    seed,
    BLOCK: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    bh = tl.program_id(2)
    offs_m = pid_m * BLOCK + tl.arange(0, BLOCK)
    offs_n = pid_n * BLOCK + tl.arange(0, BLOCK)
    keep = _keep_mask(seed, bh, offs_m[:, None], offs_n[None, :], S, dropout_p)
    ptrs = KEEP + (bh.to(tl.int64) * S + offs_m[:, None]) * S + offs_n[None, :]
    tl.store(ptrs, keep.to(tl.uint8), mask=(offs_m[:, None] < S) & (offs_n[None, :] < S))


# ----------------------------------------------------------------------------------------------------
# Launchers


@dataclass(frozen=True)
class AttentionBlocks:
    """Tile sizes, warps and pipeline stages of the kernels; `attention_tiles` chooses them."""

    fwd_m: int = 128
    fwd_n: int = 64
    fwd_warps: int = 4
    bwd_m: int = 64  # query rows per step of the dK/dV loop
    bwd_n: int = 128  # keys held by one dK/dV program
    bwd_warps: int = 4
    dq_m: int = 64
    dq_n: int = 64
    dq_warps: int = 4
    stages: int = 2


def attention_tiles(
    seq: int,
    head_dim: int,
    dtype: torch.dtype,
    cc: tuple[int, int] | None,
    dropout: bool,
    alibi: bool = False,
) -> AttentionBlocks:
    """The tiles the launcher uses for one call; `scripts/checks/aot_check.py` compiles exactly these.

    cc: the CUDA compute capability, e.g. (8, 6); None in the interpreter, which has no registers to run
    out of and pays per program: the sm_90 choice, whatever the dtype. No block is wider than the sequence
    rounded up to a power of two (at least 16, the tl.dot minimum), so seq 128 at head_dim 64 is a single
    key block and the backward takes the fused dQ path (except with dropout on Ampere/Ada).
    """
    cap = max(16, triton.next_power_of_2(seq))
    if dtype == torch.float32 and cc is not None:
        # fp32 is for tests: IEEE dots on fp32 operands take twice the registers and shared memory of bf16
        small, warps = min(32, cap), 8 if head_dim > 64 else 4
        # with ALiBi at head_dim 128, ptxas spills the 32-row forward tile (255 registers, ~300 B of spill
        # stores on sm_86/89/90, triton 3.9); 16 query rows take 66
        fwd_m = min(16, cap) if alibi and head_dim > 64 else small
        return AttentionBlocks(fwd_m, small, warps, 16, small, 4, 16, small, warps, stages=2)
    big = head_dim > 64
    # Measured with scripts/checks/aot_check.py (results/kernels/aot.md), the widest tiles that do not spill:
    # Ampere/Ada (operands of mma in registers, not shared memory as Hopper's wgmma) needs 8 warps for a
    # 128-row forward tile (4 spill with triton 3.6 on sm_86/89), 16 query rows per dK/dV step (Hopper 32),
    # and with dropout the fused-dQ path holds too much there, so it goes to the dQ kernel.
    hopper = cc is None or cc >= (9, 0)
    return AttentionBlocks(
        fwd_m=min(64 if big and dropout else 128, cap),
        fwd_n=min(64, cap),
        fwd_warps=8 if big or dropout or not hopper else 4,
        bwd_m=min(32 if hopper else 16, cap),
        bwd_n=min(64 if big or (dropout and not hopper) else 128, cap),
        bwd_warps=8,
        dq_m=min(64, cap),
        dq_n=min(32 if big or dropout else 64, cap),
        dq_warps=4,
        stages=2,
    )


def block_d(head_dim: int) -> int:
    """The head dimension padded to a power of two, at least 16 (the tl.dot minimum)."""
    return max(16, triton.next_power_of_2(head_dim))


PREPROCESS_BLOCK_M = 64  # query rows per program of the backward's preprocess kernel


def _strides(t: torch.Tensor) -> tuple[int, int, int]:
    return t.stride(0), t.stride(1), t.stride(2)


def _last_dim_contiguous(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()


def _new_bhsd(q: torch.Tensor) -> torch.Tensor:
    # (batch, seq, heads, head_dim) memory seen as (batch, heads, seq, head_dim), like q's shape
    batch, heads, seq, head_dim = q.shape
    return q.new_empty(batch, seq, heads, head_dim).transpose(1, 2)


# The launchers are torch.library custom ops: torch.compile sees each as one opaque call with the shapes
# of its `register_fake`, instead of tracing into Triton's launcher. The dropout seed travels as a CPU
# int64 tensor so that drawing it needs no `.item()` in traced code.
@torch.library.custom_op(
    "cramming::flash_attention_forward",
    mutates_args=(),
    schema="(Tensor q, Tensor k, Tensor v, Tensor? kpm, Tensor? slopes, float dropout_p, Tensor seed, "
    "float sm_scale, int[] blocks) -> (Tensor, Tensor)",
)
def _attention_forward(q, k, v, kpm, slopes, dropout_p, seed, sm_scale, blocks):
    batch, heads, seq, head_dim = q.shape
    tiles = AttentionBlocks(*blocks)
    out = _new_bhsd(q)
    lse = torch.empty(batch, heads, seq, device=q.device, dtype=torch.float32)
    grid = (triton.cdiv(seq, tiles.fwd_m), batch * heads)
    _attention_fwd_kernel[grid](
        q, k, v, kpm if kpm is not None else q, slopes if slopes is not None else q, out, lse,
        *_strides(q), *_strides(k), *_strides(v), *_strides(out),
        kpm.stride(0) if kpm is not None else 0,
        heads, seq, head_dim, sm_scale * LOG2E, dropout_p, int(seed.item()),
        HAS_KPM=kpm is not None, HAS_ALIBI=slopes is not None, DROPOUT=dropout_p > 0.0,
        IEEE=q.dtype == torch.float32,
        BLOCK_M=tiles.fwd_m, BLOCK_N=tiles.fwd_n, BLOCK_D=block_d(head_dim),
        num_warps=tiles.fwd_warps, num_stages=tiles.stages,
    )  # fmt: skip
    return out, lse


@_attention_forward.register_fake
def _(q, k, v, kpm, slopes, dropout_p, seed, sm_scale, blocks):
    batch, heads, seq, _ = q.shape
    return _new_bhsd(q), q.new_empty(batch, heads, seq, dtype=torch.float32)


@torch.library.custom_op(
    "cramming::flash_attention_backward",
    mutates_args=(),
    schema="(Tensor do, Tensor q, Tensor k, Tensor v, Tensor out, Tensor lse, Tensor? kpm, Tensor? slopes, "
    "float dropout_p, Tensor seed, float sm_scale, int[] blocks) -> (Tensor, Tensor, Tensor)",
)
def _attention_backward(do, q, k, v, out, lse, kpm, slopes, dropout_p, seed, sm_scale, blocks):
    batch, heads, seq, head_dim = q.shape
    tiles = AttentionBlocks(*blocks)
    seed = int(seed.item())
    do = _last_dim_contiguous(do)
    delta = torch.empty_like(lse)
    _attention_bwd_preprocess_kernel[(triton.cdiv(seq, PREPROCESS_BLOCK_M), batch * heads)](
        out, do, delta, *_strides(out), *_strides(do), heads, seq, head_dim,
        BLOCK_M=PREPROCESS_BLOCK_M, BLOCK_D=block_d(head_dim),
    )  # fmt: skip
    dq, dk, dv = _new_bhsd(q), _new_bhsd(q), _new_bhsd(q)
    fused_dq = seq <= tiles.bwd_n
    common = dict(
        HAS_KPM=kpm is not None,
        HAS_ALIBI=slopes is not None,
        DROPOUT=dropout_p > 0.0,
        IEEE=q.dtype == torch.float32,
        BLOCK_D=block_d(head_dim),
    )
    kpm_arg = kpm if kpm is not None else q
    kpm_stride = kpm.stride(0) if kpm is not None else 0
    slopes_arg = slopes if slopes is not None else q
    _attention_bwd_dkdv_kernel[(triton.cdiv(seq, tiles.bwd_n), batch * heads)](
        q, k, v, kpm_arg, slopes_arg, do, lse, delta, dq, dk, dv,
        *_strides(q), *_strides(k), *_strides(v), *_strides(do), *_strides(dq), *_strides(dk), *_strides(dv),
        kpm_stride, heads, seq, head_dim, sm_scale, sm_scale * LOG2E, dropout_p, seed,
        FUSED_DQ=fused_dq, BLOCK_M=tiles.bwd_m, BLOCK_N=tiles.bwd_n,
        num_warps=tiles.bwd_warps, num_stages=tiles.stages, **common,
    )  # fmt: skip
    if not fused_dq:
        # A second pass by query blocks, recomputing P and dP: two more matmuls per tile than atomically
        # adding dQ from the dK/dV pass, but deterministic, and no fp32 dQ buffer to convert afterwards.
        _attention_bwd_dq_kernel[(triton.cdiv(seq, tiles.dq_m), batch * heads)](
            q, k, v, kpm_arg, slopes_arg, do, lse, delta, dq,
            *_strides(q), *_strides(k), *_strides(v), *_strides(do), *_strides(dq),
            kpm_stride, heads, seq, head_dim, sm_scale, sm_scale * LOG2E, dropout_p, seed,
            BLOCK_M=tiles.dq_m, BLOCK_N=tiles.dq_n,
            num_warps=tiles.dq_warps, num_stages=tiles.stages, **common,
        )  # fmt: skip
    return dq, dk, dv


@_attention_backward.register_fake
def _(do, q, k, v, out, lse, kpm, slopes, dropout_p, seed, sm_scale, blocks):
    return _new_bhsd(q), _new_bhsd(q), _new_bhsd(q)


class _FlashAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, key_padding_mask, dropout_p, sm_scale, blocks, alibi_slopes=None):
        q, k, v = (_last_dim_contiguous(t) for t in (q, k, v))
        kpm = None if key_padding_mask is None else key_padding_mask.to(torch.uint8).contiguous()
        slopes = None if alibi_slopes is None else alibi_slopes.to(torch.float32).contiguous()  # (heads,)
        seed = draw_dropout_seed() if dropout_p > 0.0 else torch.zeros(1, dtype=torch.int64)
        if blocks is None:
            cc = torch.cuda.get_device_capability(q.device) if q.is_cuda else None
            blocks = attention_tiles(q.shape[2], q.shape[3], q.dtype, cc, dropout_p > 0.0, slopes is not None)
        blocks = list(astuple(blocks))
        out, lse = _attention_forward(q, k, v, kpm, slopes, dropout_p, seed, sm_scale, blocks)
        ctx.save_for_backward(q, k, v, out, lse, kpm, slopes, seed)
        ctx.args = (dropout_p, sm_scale, blocks)
        return out

    @staticmethod
    def backward(ctx, do):
        q, k, v, out, lse, kpm, slopes, seed = ctx.saved_tensors
        dropout_p, sm_scale, blocks = ctx.args
        dq, dk, dv = _attention_backward(
            do, q, k, v, out, lse, kpm, slopes, dropout_p, seed, sm_scale, blocks
        )
        return dq, dk, dv, None, None, None, None, None  # the slopes are constants: no gradient


def _check_inputs(q, k, v, key_padding_mask, dropout_p, alibi_slopes=None):
    if q.dim() != 4 or q.shape != k.shape or q.shape != v.shape:
        raise ValueError(
            f"q, k, v must share one (batch, heads, seq, head_dim) shape, got {tuple(q.shape)}, "
            f"{tuple(k.shape)}, {tuple(v.shape)}"
        )
    if not (q.dtype == k.dtype == v.dtype) or q.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise ValueError(f"q, k, v must share one of fp16/bf16/fp32, got {q.dtype}, {k.dtype}, {v.dtype}")
    if q.shape[-1] > 256:
        raise ValueError(f"head_dim {q.shape[-1]} is above the supported 256")
    batch, heads, seq, _ = q.shape
    if batch * heads > 65535:
        raise ValueError(
            f"batch * heads = {batch * heads} exceeds the 65535 programs of a CUDA grid's y axis"
        )
    if key_padding_mask is not None and (
        key_padding_mask.dtype != torch.bool or tuple(key_padding_mask.shape) != (batch, seq)
    ):
        raise ValueError(
            f"key_padding_mask must be bool (batch, seq) = {(batch, seq)}, True = real token; got "
            f"{key_padding_mask.dtype} {tuple(key_padding_mask.shape)}"
        )
    if not 0.0 <= dropout_p < 1.0:
        raise ValueError(f"dropout_p must be in [0, 1), got {dropout_p}")
    if alibi_slopes is not None and (
        tuple(alibi_slopes.shape) != (heads,) or not alibi_slopes.is_floating_point()
        or alibi_slopes.device != q.device
    ):  # fmt: skip
        raise ValueError(
            f"alibi_slopes must be a float ({heads},) tensor (one slope per head) on {q.device}; got "
            f"{alibi_slopes.dtype} {tuple(alibi_slopes.shape)} on {alibi_slopes.device}"
        )


def flash_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    key_padding_mask: torch.Tensor | None = None,
    dropout_p: float = 0.0,
    scale: float | None = None,
    alibi_slopes: torch.Tensor | None = None,
) -> torch.Tensor:
    """softmax(scale * q k^T + alibi, masked keys excluded) v with dropout on the probabilities; non-causal.

    q, k, v: (batch, heads, seq, head_dim), fp16/bf16 (fp32 for tests). key_padding_mask: (batch, seq)
    bool, True = real token. alibi_slopes: (heads,) float, the ALiBi bias -slope_h * |i - j| on head h's
    scores (read as fp32; a slope of 0 is no bias), or None. Returns (batch, heads, seq, head_dim); a query
    row with no real key returns 0. The dropout seed is drawn from torch's CPU generator, so
    torch.manual_seed makes a run reproducible.
    """
    _check_inputs(q, k, v, key_padding_mask, dropout_p, alibi_slopes)
    sm_scale = scale if scale is not None else 1.0 / math.sqrt(q.shape[-1])
    return _FlashAttention.apply(
        q, k, v, key_padding_mask, float(dropout_p), float(sm_scale), None, alibi_slopes
    )


def draw_dropout_seed() -> torch.Tensor:
    """The Philox seed of one dropout call: a (1,) int64 CPU tensor from torch's generator, so
    torch.manual_seed reproduces the dropout (and no device sync is needed to read it)."""
    return torch.randint(0, 2**31 - 1, (1,))


def dropout_keep_mask(seed, batch: int, heads: int, seq: int, dropout_p: float, device) -> torch.Tensor:
    """The (batch, heads, seq, seq) bool keep-mask the kernels draw for `seed`, for tests and debugging."""
    keep = torch.empty(batch * heads, seq, seq, device=device, dtype=torch.uint8)
    block = 32
    grid = (triton.cdiv(seq, block), triton.cdiv(seq, block), batch * heads)
    _dropout_keep_mask_kernel[grid](keep, seq, dropout_p, int(seed), BLOCK=block)
    return keep.view(batch, heads, seq, seq).bool()


# ----------------------------------------------------------------------------------------------------
# Reference


def attention_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    key_padding_mask: torch.Tensor | None = None,
    dropout_p: float = 0.0,
    scale: float | None = None,
    keep_mask: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """Eager attention in fp32 with the kernel's semantics (a row with no real key returns 0).

    keep_mask: (batch, heads, seq, seq) bool dropout keep-mask (e.g. from `dropout_keep_mask`); without
    it, dropout_p > 0 draws one with torch's generator. bias: an explicit additive float bias on the scaled
    scores, broadcastable to (batch, heads, seq, seq), e.g. the dense ALiBi tensor that the kernel's
    `alibi_slopes` stand for (`cramming.model.ops.alibi_bias`).
    """
    sm_scale = scale if scale is not None else 1.0 / math.sqrt(q.shape[-1])
    scores = sm_scale * (q.float() @ k.float().transpose(-1, -2))  # (batch, heads, seq, seq)
    if bias is not None:
        scores = scores + bias.float()
    if key_padding_mask is not None:
        real = key_padding_mask[:, None, None, :]  # (batch, 1, 1, seq)
        # A row with no real key keeps all its scores (a finite softmax, no NaN in its gradient) and is
        # zeroed by the multiplication below.
        any_real = key_padding_mask.any(dim=-1)[:, None, None, None]
        scores = scores.masked_fill(~(real | ~any_real), float("-inf"))
        probs = torch.softmax(scores, dim=-1) * real
    else:
        probs = torch.softmax(scores, dim=-1)
    if dropout_p > 0.0:
        if keep_mask is None:
            keep_mask = torch.rand_like(probs) >= dropout_p
        probs = probs * keep_mask / (1.0 - dropout_p)
    return (probs @ v.float()).to(q.dtype)
