"""The final model on held-out rows: its MLM loss and accuracy, and whether it uses context.

The context diagnostic: an MLM that has only learned token frequencies (the "unigram plateau" small models
sit on for a long time) predicts a masked token no better from a real sentence than from the same words in
random order. The diagnostic measures exactly that:

    loss_real       MLM loss with every chosen token replaced by [MASK], on held-out rows as they are
    loss_shuffled   the same, after shuffling each row's ordinary tokens (same positions masked, so the same
                    number of targets per row, drawn from the same words)
    unigram_entropy entropy (nats) of the target tokens' frequencies: the loss of the best context-free guess

A model that uses context has loss_real clearly below loss_shuffled (`gain` = the difference), and
both below unigram_entropy. The masks are all [MASK] (no random or kept tokens), so no target is visible.
"""

from __future__ import annotations

import contextlib
import logging
import math
from collections.abc import Callable
from contextlib import AbstractContextManager

import datasets
import torch
import torch.nn.functional as F
from torch import nn

from cramming.model import IGNORE_INDEX
from cramming.train.mlm import MLMMasker, mlm_accuracy_counts, row_uniforms

log = logging.getLogger("cramming")

# the masks of the held-out rows, whatever the run's seed: every run is validated on the same masks
VALIDATION_SEED = 0


@torch.no_grad()
def validation_metrics(
    model: nn.Module,
    rows: datasets.Dataset | None,
    masker: MLMMasker,
    *,
    limit: int,
    microbatch_size: int,
    autocast: Callable[[], AbstractContextManager],
    predicted_per_row: int | None,
    context_diagnostic: bool,
) -> dict | None:
    """MLM loss and accuracy on the first `limit` rows (train.validation_rows) of the validation split, masked
    once by `masker` (train.mlm with VALIDATION_SEED): the same rows and masks whatever the run's seed and
    micro-batch size (which only sets how many rows go through the model at once), so runs compare. None when
    there are no rows."""
    n = 0 if rows is None else min(limit, len(rows))
    if n == 0:
        return None
    input_ids = torch.as_tensor(
        rows.with_format("numpy", columns=["input_ids"])[:n]["input_ids"], dtype=torch.long
    )
    corrupted, labels = masker(input_ids, torch.arange(n))
    model.eval()
    loss, correct, predicted = mlm_totals(
        model, corrupted, labels, microbatch_size, autocast, predicted_per_row
    )
    validation = {"loss": loss / max(predicted, 1), "mlm_acc": correct / max(predicted, 1)}
    if context_diagnostic:
        diagnosis = context_use(model, masker, input_ids, microbatch_size, autocast)
        log.info(describe(diagnosis))
        validation |= {f"context_{key}": value for key, value in diagnosis.items() if key != "rows"}
    return validation


@torch.no_grad()
def mlm_totals(
    model: nn.Module,
    inputs: torch.Tensor,
    labels: torch.Tensor,
    batch_size: int,
    autocast: Callable[[], contextlib.AbstractContextManager] | None = None,
    predicted_per_row: int | None = None,
) -> tuple[float, int, int]:
    """(summed cross-entropy, correct predictions, predictions) over the labelled positions of corrupted
    `inputs` (rows, seq), in chunks of `batch_size` rows: held-out evaluation, whatever the chunking."""
    device = next(model.parameters()).device
    loss, correct, count = 0.0, 0, 0
    for first in range(0, inputs.shape[0], batch_size):
        part = slice(first, first + batch_size)
        with autocast() if autocast is not None else contextlib.nullcontext():
            out = model(inputs[part].to(device), labels[part].to(device), predicted_per_row=predicted_per_row)
        right, predicted = mlm_accuracy_counts(out)
        loss += F.cross_entropy(out.logits.float(), out.labels, reduction="sum").item()
        correct += int(right)
        count += int(predicted)
    return loss, correct, count


# ------------------------------------------------------------------------------------ the context diagnostic

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
