"""The MLM loss and accuracy of the final model on held-out rows, and the context diagnostic beside them."""

from __future__ import annotations

import logging
from collections.abc import Callable
from contextlib import AbstractContextManager

import datasets
import torch
from torch import nn

from cramming.train.config import MLMConfig
from cramming.train.context import context_use
from cramming.train.context import describe as describe_context_use
from cramming.train.mlm import MLMMasker, mlm_totals

log = logging.getLogger("cramming")


@torch.no_grad()
def validation_metrics(
    model: nn.Module,
    rows: datasets.Dataset | None,
    *,
    limit: int,
    mlm: MLMConfig,
    vocab_size: int,
    special_ids: tuple[int, ...],
    mask_id: int,
    microbatch_size: int,
    autocast: Callable[[], AbstractContextManager],
    predicted_per_row: int | None,
    context_diagnostic: bool,
) -> dict | None:
    """MLM loss and accuracy on the first `limit` rows (train.validation_rows) of the validation split, masked
    once with a fixed seed: the same rows and masks whatever the micro-batch size (which only sets how many
    rows go through the model at once), so runs compare. None when there are no rows."""
    n = 0 if rows is None else min(limit, len(rows))
    if n == 0:
        return None
    input_ids = torch.as_tensor(
        rows.with_format("numpy", columns=["input_ids"])[:n]["input_ids"], dtype=torch.long
    )
    masker = MLMMasker(mlm, vocab_size, special_ids, mask_id, seed=0)
    corrupted, labels = masker(input_ids, torch.arange(n))
    model.eval()
    loss, correct, predicted = mlm_totals(
        model, corrupted, labels, microbatch_size, autocast, predicted_per_row
    )
    validation = {"loss": loss / max(predicted, 1), "mlm_acc": correct / max(predicted, 1)}
    if context_diagnostic:
        diagnosis = context_use(model, masker, input_ids, microbatch_size, autocast)
        log.info(describe_context_use(diagnosis))
        validation |= {f"context_{key}": value for key, value in diagnosis.items() if key != "rows"}
    return validation
