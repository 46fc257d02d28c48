"""Attention, LayerNorm, gated-activation and loss kernels, chosen by name (`impl.attention`,
`impl.layernorm`, `impl.ffn_activation`, `impl.loss`).

Every kernel computes the same function; they differ only in speed and rounding. The plain PyTorch ones the
model runs with by default live in cramming/model/bert.py (an exported model carries that file alone); here
are the others: the eager reference, the CPU-blocked cross-entropy, and the `triton` entries, which import
their kernels from `cramming.kernels` on first call, so this module imports without Triton.
`resolve_kernels` decides once, at model construction, whether a Triton kernel can launch here.
"""

from __future__ import annotations

import importlib
import logging
import math

import torch
import torch.nn.functional as F

from cramming.errors import KernelUnavailableError
from cramming.model.bert import (
    AttentionFn,
    GatedActivationFn,
    LayerNormFn,
    LossFn,
    alibi_bias,
    cross_entropy,
    sdpa_attention,
    torch_gated_gelu,
    torch_layer_norm,
)

log = logging.getLogger("cramming")


def eager_attention(q, k, v, key_padding_mask=None, dropout_p: float = 0.0, alibi_slopes=None):
    """The reference: softmax(q k^T / sqrt(d) + alibi) v, written out."""
    scores = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(q.shape[-1]))  # (batch, heads, seq, seq)
    if alibi_slopes is not None:
        scores = scores + alibi_bias(alibi_slopes, q.shape[-2])
    if key_padding_mask is not None:
        # a large negative number rather than -inf keeps a fully padded row finite
        scores = scores.masked_fill(~key_padding_mask[:, None, None, :], torch.finfo(scores.dtype).min)
    probs = torch.softmax(scores.float(), dim=-1).to(q.dtype)
    probs = F.dropout(probs, p=dropout_p, training=dropout_p > 0)
    return probs @ v


def triton_attention(q, k, v, key_padding_mask=None, dropout_p: float = 0.0, alibi_slopes=None):
    """The fused FlashAttention-2 kernel; ALiBi from the slopes inside it, no (heads, seq, seq) tensor."""
    from cramming.kernels.attention import flash_attention

    return flash_attention(
        q, k, v, key_padding_mask=key_padding_mask, dropout_p=dropout_p, alibi_slopes=alibi_slopes
    )


def triton_layer_norm(x, weight, bias=None, eps: float = 1e-12):
    from cramming.kernels.layernorm import layer_norm

    return layer_norm(x, weight, bias, eps)


def triton_gated_gelu(h):
    from cramming.kernels.glu import gated_gelu

    return gated_gelu(h)


def torch_cross_entropy(logits, labels, ignore_index: int = -100):
    """The mean cross-entropy over the labelled rows, the log-sum-exp in fp32 (bf16 logits lose too much in
    it). Training on CPU it runs in row blocks that stay in cache (`ChunkedCrossEntropy`); elsewhere on an fp32
    copy of the logits, which is also what torch.compile traces (the blocks are a Python loop with a host sync)."""
    if (
        logits.device.type == "cpu"
        and logits.requires_grad
        and logits.dim() == 2
        and not torch.compiler.is_compiling()
    ):
        return ChunkedCrossEntropy.apply(logits, labels, ignore_index)
    return cross_entropy(logits, labels, ignore_index)


class ChunkedCrossEntropy(torch.autograd.Function):
    """F.cross_entropy(logits.float(), labels) on CPU, a block of rows at a time, with the gradient computed in
    the forward pass (the loss is the graph's last step, so its gradient is known up to the output's scale).

    The plain form makes five passes over an (n, vocab) tensor, none of which fits in cache: the fp32 copy, the
    log-softmax, the zeros and the log-softmax backward of the gradient, its copy back to bf16. Here each block
    of ROWS rows is read once into cache as fp32: log-sum-exp, loss, softmax minus one-hot, written once as the
    gradient in the logits' dtype (what autocast's cast back gives the plain form). bert-tiny's whole training
    step on one thread, where head and loss are half the work: 1.37x faster in bf16, 1.13x in fp32
    (results/step-speed/cpu-tiny.md); bert-mini's: no change. The same numbers up to float rounding: a row's
    log-sum-exp is the same reduction, only the order of the final mean differs."""

    ROWS = 32  # 32 x 8192 fp32 logits: 1 MiB, inside a core's L2

    @staticmethod
    def forward(ctx, logits: torch.Tensor, labels: torch.Tensor, ignore_index: int) -> torch.Tensor:
        with torch.autocast("cpu", enabled=False):
            valid = labels != ignore_index
            count = int(valid.sum())
            targets = torch.where(valid, labels, 0)[:, None]
            # a weight per row: 1/count for labelled rows (the mean), 0 for ignored ones
            weights = (valid.float() / max(count, 1))[:, None]
            losses = torch.empty(labels.numel(), dtype=torch.float32)
            grad = torch.empty_like(logits)
            minus_one = torch.full((ChunkedCrossEntropy.ROWS, 1), -1.0)
            for start in range(0, labels.numel(), ChunkedCrossEntropy.ROWS):
                rows = slice(start, start + ChunkedCrossEntropy.ROWS)
                x = logits[rows].float()
                lse = torch.logsumexp(x, dim=-1, keepdim=True)
                target = targets[rows]
                losses[rows] = (lse - x.gather(1, target)).squeeze(1)
                p = torch.sub(x, lse).exp_()  # softmax (x may be a view of fp32 logits: not in place)
                p.scatter_add_(1, target, minus_one[: len(target)])
                grad[rows] = p.mul_(weights[rows])
            ctx.save_for_backward(grad)
            if count == 0:  # what F.cross_entropy gives with no labelled row
                return torch.tensor(float("nan"))
            return (losses * weights.squeeze(1)).sum()

    @staticmethod
    def backward(ctx, grad_output: torch.Tensor):
        (grad,) = ctx.saved_tensors
        if bool(grad_output == 1):  # the usual case (an unscaled loss): no pass over the (n, vocab) gradient
            return grad, None, None
        return grad * grad_output.to(grad.dtype), None, None


def triton_cross_entropy(logits, labels, ignore_index: int = -100):
    """Reads the logits in their own dtype, log-sum-exp in fp32: no (n, vocab) fp32 copy. The one difference
    beyond rounding: with no labelled row at all it returns 0 where PyTorch returns NaN."""
    from cramming.kernels.cross_entropy import cross_entropy

    return cross_entropy(logits, labels, ignore_index)


ATTENTION: dict[str, AttentionFn] = {
    "eager": eager_attention,
    "sdpa": sdpa_attention,
    "triton": triton_attention,
}
LAYERNORM: dict[str, LayerNormFn] = {"torch": torch_layer_norm, "triton": triton_layer_norm}
FFN_ACTIVATION: dict[str, GatedActivationFn] = {"torch": torch_gated_gelu, "triton": triton_gated_gelu}
LOSS: dict[str, LossFn] = {"torch": torch_cross_entropy, "triton": triton_cross_entropy}

# where each Triton backend lives, and the PyTorch backend that replaces it when it cannot launch
_TRITON_MODULES = {
    "attention": "cramming.kernels.attention",
    "layernorm": "cramming.kernels.layernorm",
    "ffn_activation": "cramming.kernels.glu",
    "loss": "cramming.kernels.cross_entropy",
}
_FALLBACKS = {"attention": "sdpa", "layernorm": "torch", "ffn_activation": "torch", "loss": "torch"}


def triton_unavailable(module: str, device: torch.device) -> str | None:
    """Why a Triton kernel from `module` cannot launch on `device`, or None when it can.

    Triton launches on CUDA tensors, or anywhere under its interpreter (TRITON_INTERPRET=1, slow but exact).
    """
    from cramming.kernels import triton_status

    ok, why = triton_status(device.type)
    if not ok:
        return why
    try:
        importlib.import_module(module)
    except Exception as err:  # ImportError, or Triton failing to initialize
        return f"cannot import {module}: {err}"
    return None


def resolve_kernels(requested: dict[str, str], device: torch.device, strict: bool) -> dict[str, str]:
    """The backend to use for each kind in `requested` (e.g. {"attention": "triton", "loss": "torch"}):
    the requested one, or PyTorch for a Triton kernel that cannot launch here (one warning for all), or
    KernelUnavailableError when `strict`."""
    chosen = dict(requested)
    problems = []
    for kind, name in chosen.items():
        if name != "triton":
            continue
        reason = triton_unavailable(_TRITON_MODULES[kind], device)
        if reason is not None:
            problems.append(f"impl.{kind}=triton ({reason})")
            chosen[kind] = _FALLBACKS[kind]
    if problems:
        message = "Triton kernels cannot launch: " + "; ".join(problems)
        if strict:
            raise KernelUnavailableError(message + ". Set impl.strict_kernels=false to fall back to PyTorch.")
        log.warning(
            "%s. Falling back to PyTorch: %s.", message, ", ".join(f"{k}={v}" for k, v in chosen.items())
        )
    return chosen
