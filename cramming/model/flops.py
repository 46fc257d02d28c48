"""Model FLOPs of the MLM model, counted analytically from its ArchConfig (for throughput and MFU reports).

The convention of the MFU literature (Chowdhery et al., PaLM, appendix B): only matrix multiplications
count, 2 FLOPs per multiply-add; norms, activations, softmax, biases, embedding look-ups and the optimizer
are left out. A training step costs 3x the forward pass (the backward pass computes two products, one for
the input gradient and one for the weight gradient, per forward product). Attention counts both S x S
products (q k^T and probs v) in full, whatever a fused kernel recomputes.

The prediction head (transform, if any, and decoder) is counted only for the positions it runs on: the
masked ones with sparse prediction (`predicted_fraction` of the tokens, 25% in the cramming recipe), all
of them with dense prediction (as Hugging Face's BertForMaskedLM does).
"""

from __future__ import annotations

from cramming.model.config import ArchConfig

TRAIN_MULTIPLIER = 3  # forward + backward (input and weight gradients)


def forward_flops_per_token(
    arch: ArchConfig, vocab_size: int, seq_length: int, predicted_fraction: float
) -> dict[str, float]:
    """Forward matmul FLOPs per input token, by part: {"attention": ..., "ffn": ..., "head": ..., "total": ...}.

    predicted_fraction: share of the tokens the head runs on with sparse prediction (ignored when dense).
    """
    h = arch.hidden_size
    projections = 2 * h * 3 * h + 2 * h * h  # qkv and output projections
    scores = 2 * 2 * seq_length * h  # q k^T and probs v: each token meets seq keys, over all heads
    ffn_inner = arch.intermediate_size // 2 if arch.ffn == "glu" else arch.intermediate_size
    ffn = 2 * h * arch.intermediate_size + 2 * ffn_inner * h  # up-projection and down-projection
    head_rows = predicted_fraction if arch.sparse_prediction else 1.0
    head = head_rows * ((2 * h * h if arch.head_transform else 0) + 2 * h * vocab_size)
    parts = {
        "attention": float(arch.num_layers * (projections + scores)),
        "ffn": float(arch.num_layers * ffn),
        "head": float(head),
    }
    parts["total"] = sum(parts.values())
    return parts


def train_flops_per_token(
    arch: ArchConfig, vocab_size: int, seq_length: int, predicted_fraction: float
) -> float:
    """FLOPs of one training step per input token: forward + backward."""
    return (
        TRAIN_MULTIPLIER * forward_flops_per_token(arch, vocab_size, seq_length, predicted_fraction)["total"]
    )
