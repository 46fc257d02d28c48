"""Does the model use context? An MLM that has only learned token frequencies (the "unigram plateau" small
models sit on for a long time) predicts a masked token no better from a real sentence than from the same
words in random order. This diagnostic measures exactly that:

    loss_real       MLM loss with every chosen token replaced by [MASK], on held-out rows as they are
    loss_shuffled   the same, after shuffling each row's ordinary tokens (same positions masked, so the same
                    number of targets per row, drawn from the same words)
    unigram_entropy entropy (nats) of the target tokens' frequencies: the loss of the best context-free guess

A model that uses context has loss_real clearly below loss_shuffled (`gain` = the difference), and
both below unigram_entropy. The masks are all [MASK] (no random or kept tokens), so no target is visible.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from cramming.model import IGNORE_INDEX
from cramming.train.mlm import MLMMasker, mlm_totals, row_uniforms

_SHUFFLE = 7  # the hash stream of the shuffle draws (the masker's own streams are 1-3)


def shuffle_within_rows(input_ids: torch.Tensor, special_ids: torch.Tensor, seed: int) -> torch.Tensor:
    """Each row's ordinary tokens permuted among the ordinary positions; special tokens stay in place."""
    keys = row_uniforms(seed, torch.arange(input_ids.shape[0]), input_ids.shape[1], _SHUFFLE)
    special = torch.isin(input_ids, special_ids)
    keys = keys.masked_fill(special, 2.0)  # specials sort last, so ordinary tokens fill ordinary positions
    order = keys.argsort(dim=1)  # (batch, seq): a random order of the ordinary tokens, then the specials
    shuffled = input_ids.gather(1, order)
    out = input_ids.clone()
    for row in range(input_ids.shape[0]):  # ordinary positions, in order, take the shuffled ordinary tokens
        positions = (~special[row]).nonzero().squeeze(1)
        out[row, positions] = shuffled[row, : positions.numel()]
    return out


def masked_for_diagnosis(masker: MLMMasker, input_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(inputs, labels): the masker's choice of positions (fixed seed, rows 0..n-1), every one a [MASK]."""
    _, labels = masker(input_ids, torch.arange(input_ids.shape[0]))
    chosen = labels != IGNORE_INDEX
    return torch.where(chosen, masker.mask_id, input_ids), labels


def mlm_loss(
    model: nn.Module, inputs: torch.Tensor, labels: torch.Tensor, batch_size: int, autocast=None
) -> float:
    """Mean cross-entropy over the labelled positions, in chunks of `batch_size` rows."""
    loss, _, count = mlm_totals(model, inputs, labels, batch_size, autocast)
    return loss / max(count, 1)


def unigram_entropy(labels: torch.Tensor) -> float:
    """Entropy (nats) of the empirical distribution of the labelled tokens."""
    targets = labels[labels != IGNORE_INDEX]
    if targets.numel() == 0:
        return float("nan")
    counts = torch.bincount(targets).double()
    p = counts[counts > 0] / counts.sum()
    return float(-(p * p.log()).sum())


def context_use(
    model: nn.Module, masker: MLMMasker, input_ids: torch.Tensor, batch_size: int, autocast=None
) -> dict[str, float]:
    """The diagnostic on `input_ids` (rows, seq): loss_real, loss_shuffled, gain, unigram_entropy."""
    was_training = model.training
    model.eval()
    inputs, labels = masked_for_diagnosis(masker, input_ids)
    shuffled_ids = shuffle_within_rows(input_ids, masker.special_ids, seed=masker.seed)
    shuffled_inputs, shuffled_labels = masked_for_diagnosis(masker, shuffled_ids)
    real = mlm_loss(model, inputs, labels, batch_size, autocast)
    shuffled = mlm_loss(model, shuffled_inputs, shuffled_labels, batch_size, autocast)
    model.train(was_training)
    entropy = unigram_entropy(labels)
    return {
        "loss_real": real,
        "loss_shuffled": shuffled,
        "gain": shuffled - real,
        "unigram_entropy": entropy,
        "rows": int(input_ids.shape[0]),
    }


# the gain (nats) from which a model is said to use context: above a unigram predictor's 0 +- 0.03 (the real and
# shuffled rows have different targets), with a margin
USES_CONTEXT_GAIN = 0.1


def describe(result: dict[str, float]) -> str:
    """One log line, e.g. 'context use: masked loss 5.91 real vs 6.49 shuffled (gain 0.58), unigram 6.53'."""
    verdict = (
        "uses context" if result["gain"] >= USES_CONTEXT_GAIN else "no context use yet (unigram plateau)"
    )
    if not math.isfinite(result["gain"]):
        verdict = "not measurable"
    return (
        f"context use: masked loss {result['loss_real']:.3f} on real rows vs {result['loss_shuffled']:.3f} on"
        f" shuffled rows (gain {result['gain']:.3f}), unigram entropy {result['unigram_entropy']:.3f}:"
        f" {verdict}"
    )
