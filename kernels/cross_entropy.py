"""Cross-entropy over a large vocabulary straight from low-precision logits, forward and backward.

For the sparse MLM head: `F.cross_entropy(logits.float(), labels)` first writes an fp32 copy of the
(n, vocab) logits, then a softmax of the same size for the backward. Here each row is read in its own
dtype, block by block, with an online log-sum-exp in fp32 (Milakov & Gimelshein, "Online normalizer
calculation for softmax", arXiv 1805.02867); only the per-row log-sum-exp is saved, and the backward
writes the gradient directly in the logits' dtype. Nothing of size (n, vocab) is ever held in fp32.

For one row x with label t and L = sum over the rows that have a label (not ignore_index):

    loss_row = lse(x) - x_t,   lse(x) = log sum_j exp(x_j),   loss = sum(loss_row) / L
    d x_j    = (softmax(x)_j - [j == t]) * d loss / L;   rows with no label get 0

With no labelled row at all the loss is 0 with zero gradients (F.cross_entropy gives NaN).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _cross_entropy_fwd_kernel(
    LOGITS,  # (N, V) strides (sl_n, 1), any float dtype
    LABELS,  # (N,) int64; ignore_index = no label
    LOSS,  # (N,) fp32: lse - x_label, 0 for an unlabelled row
    LSE,  # (N,) fp32: log-sum-exp of the row
    sl_n,
    V,
    ignore_index,
    BLOCK_V: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    base = LOGITS + row * sl_n
    offs = tl.arange(0, BLOCK_V)
    # per-lane running max and sum, merged once at the end (no scalar loop-carried reductions)
    m = tl.full([BLOCK_V], -1.0e30, dtype=tl.float32)
    s = tl.zeros([BLOCK_V], dtype=tl.float32)
    for start in range(0, V, BLOCK_V):
        cols = start + offs
        x = tl.load(base + cols, mask=cols < V, other=float("-inf")).to(tl.float32)
        m_new = tl.maximum(m, x)
        s = s * tl.exp(m - m_new) + tl.exp(x - m_new)
        m = m_new
    row_max = tl.max(m, axis=0)
    lse = row_max + tl.log(tl.sum(s * tl.exp(m - row_max), axis=0))
    label = tl.load(LABELS + row)
    labelled = (label != ignore_index) & (label >= 0) & (label < V)
    target = tl.load(base + label, mask=labelled, other=0.0).to(tl.float32)
    tl.store(LOSS + row, tl.where(labelled, lse - target, 0.0))
    tl.store(LSE + row, lse)


@triton.jit
def _cross_entropy_bwd_kernel(
    LOGITS,  # (N, V) strides (sl_n, 1)
    LABELS,  # (N,) int64
    LSE,  # (N,) fp32, from the forward
    SCALE,  # (1,) fp32: d loss / L
    DLOGITS,  # (N, V) contiguous, the logits' dtype
    sl_n,
    V,
    ignore_index,
    BLOCK_V: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    label = tl.load(LABELS + row)
    labelled = (label != ignore_index) & (label >= 0) & (label < V)
    scale = tl.where(labelled, tl.load(SCALE), 0.0)
    lse = tl.load(LSE + row)
    offs = tl.arange(0, BLOCK_V)
    for start in range(0, V, BLOCK_V):
        cols = start + offs
        ok = cols < V
        x = tl.load(LOGITS + row * sl_n + cols, mask=ok, other=0.0).to(tl.float32)
        grad = (tl.exp(x - lse) - tl.where(cols == label, 1.0, 0.0)) * scale
        tl.store(DLOGITS + row * V + cols, grad.to(DLOGITS.dtype.element_ty), mask=ok)


# ----------------------------------------------------------------------------------------------------
# Launchers


def cross_entropy_tiles(vocab: int) -> tuple[int, int]:
    """(vocabulary columns per step, warps) of both kernels; `scripts/checks/aot_check.py` compiles these."""
    return min(4096, max(16, triton.next_power_of_2(vocab))), 8


# The launchers are torch.library custom ops: torch.compile sees each as one opaque call with the shapes
# of its `register_fake`, instead of tracing into Triton's launcher.
@torch.library.custom_op(
    "cramming::cross_entropy_forward",
    mutates_args=(),
    schema="(Tensor logits, Tensor labels, int ignore_index) -> (Tensor, Tensor)",
)
def _cross_entropy_forward(logits, labels, ignore_index):
    """Per-row (loss, log-sum-exp), fp32."""
    rows, vocab = logits.shape
    loss_rows = torch.empty(rows, device=logits.device, dtype=torch.float32)
    lse = torch.empty(rows, device=logits.device, dtype=torch.float32)
    block_v, warps = cross_entropy_tiles(vocab)
    _cross_entropy_fwd_kernel[(rows,)](
        logits,
        labels,
        loss_rows,
        lse,
        logits.stride(0),
        vocab,
        ignore_index,
        BLOCK_V=block_v,
        num_warps=warps,
    )
    return loss_rows, lse


@_cross_entropy_forward.register_fake
def _(logits, labels, ignore_index):
    rows = logits.shape[0]
    return logits.new_empty(rows, dtype=torch.float32), logits.new_empty(rows, dtype=torch.float32)


@torch.library.custom_op(
    "cramming::cross_entropy_backward",
    mutates_args=(),
    schema="(Tensor logits, Tensor labels, Tensor lse, Tensor scale, int ignore_index) -> Tensor",
)
def _cross_entropy_backward(logits, labels, lse, scale, ignore_index):
    rows, vocab = logits.shape
    dlogits = torch.empty(rows, vocab, device=logits.device, dtype=logits.dtype)
    block_v, warps = cross_entropy_tiles(vocab)
    _cross_entropy_bwd_kernel[(rows,)](
        logits, labels, lse, scale, dlogits, logits.stride(0), vocab, ignore_index,
        BLOCK_V=block_v, num_warps=warps,
    )  # fmt: skip
    return dlogits


@_cross_entropy_backward.register_fake
def _(logits, labels, lse, scale, ignore_index):
    return logits.new_empty(logits.shape)


class _CrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, labels, ignore_index):
        if logits.stride(-1) != 1:
            logits = logits.contiguous()
        labels = labels.contiguous()
        loss_rows, lse = _cross_entropy_forward(logits, labels, ignore_index)
        # a device tensor, so no host sync; clamped so that no labelled row at all gives 0, not 0/0
        vocab = logits.shape[1]
        labelled = ((labels != ignore_index) & (labels >= 0) & (labels < vocab)).sum().clamp_min(1).float()
        ctx.save_for_backward(logits, labels, lse, labelled)
        ctx.ignore_index = ignore_index
        return loss_rows.sum() / labelled

    @staticmethod
    def backward(ctx, dloss):
        logits, labels, lse, labelled = ctx.saved_tensors
        scale = (dloss.float() / labelled).reshape(1)
        return _cross_entropy_backward(logits, labels, lse, scale, ctx.ignore_index), None, None


def cross_entropy(logits: torch.Tensor, labels: torch.Tensor, ignore_index: int = -100) -> torch.Tensor:
    """Mean cross-entropy of (n, vocab) logits against (n,) int64 labels, over the rows with a label.

    Labels outside [0, vocab) count as ignored (F.cross_entropy would raise instead).
    """
    if logits.dim() != 2 or labels.shape != logits.shape[:1]:
        raise ValueError(
            f"logits must be (n, vocab) and labels (n,), got {tuple(logits.shape)}, {tuple(labels.shape)}"
        )
    return _CrossEntropy.apply(logits, labels.long(), int(ignore_index))


def cross_entropy_reference(
    logits: torch.Tensor, labels: torch.Tensor, ignore_index: int = -100
) -> torch.Tensor:
    """F.cross_entropy on an fp32 copy of the logits (what the model does without the kernel)."""
    return torch.nn.functional.cross_entropy(logits.float(), labels, ignore_index=ignore_index)
