"""How the packed training rows are ordered, and what each row begins with.

The keys of ORDERINGS and ROW_STARTS are the values `data.ordering` and `data.row_start` accept: the data
config checks its choices against them, so adding an entry here is all a new choice needs.
"""

from __future__ import annotations

from collections.abc import Callable

import datasets
import numpy as np

# Rows per batch when the rows are read back for the curriculum scores (any size gives the same order).
ROWS_PER_BATCH = 10_000


def _curriculum_order(rows: datasets.Dataset, vocab_size: int) -> np.ndarray:
    """Easy to hard: rows sorted by the mean surprisal of their tokens under the corpus unigram counts."""
    counts = np.zeros(vocab_size, dtype=np.int64)
    for batch in rows.with_format("numpy").iter(batch_size=ROWS_PER_BATCH):
        counts += np.bincount(batch["input_ids"].ravel(), minlength=vocab_size)
    surprisal = -np.log((counts + 1) / (counts.sum() + vocab_size))
    scores = np.concatenate(
        [
            surprisal[batch["input_ids"]].mean(axis=1)
            for batch in rows.with_format("numpy").iter(batch_size=ROWS_PER_BATCH)
        ]
    )
    return np.argsort(scores, kind="stable")


def _keep_order(rows: datasets.Dataset, seed: int, vocab_size: int) -> datasets.Dataset:
    return rows


def _shuffle(rows: datasets.Dataset, seed: int, vocab_size: int) -> datasets.Dataset:
    return rows.shuffle(seed=seed)


def _curriculum(rows: datasets.Dataset, seed: int, vocab_size: int) -> datasets.Dataset:
    return rows.select(_curriculum_order(rows, vocab_size))


# data.row_start: what each packed row begins with (the [CLS] id is SpecialTokens.cls)
ROW_STARTS = ("none", "cls")
# data.ordering -> (rows, seed, vocab size) -> the rows reordered
ORDERINGS: dict[str, Callable[[datasets.Dataset, int, int], datasets.Dataset]] = {
    "none": _keep_order,
    "random": _shuffle,
    "curriculum": _curriculum,
}
