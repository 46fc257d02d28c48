"""How the packed training rows are ordered, what each row begins with, and where [SEP] goes in the stream.

The keys of ORDERINGS, ROW_STARTS and SEGMENTS are the values `data.ordering`, `data.row_start` and
`data.segments` accept: the data config checks its choices against them, so adding an entry here is all a new
choice needs.
"""

from __future__ import annotations

import re
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

# A sentence ends at . ! or ? (and a closing quote or bracket right after it) followed by spaces and a capital
# letter, a digit or an opening quote or bracket; not after a lone capital letter ("J. R. R. Tolkien", "U.S.
# Army", though "World War I." then ends no sentence). Read on the raw text, before lowercasing. It splits after
# abbreviations such as "Dr." or "St.": a stray [SEP] now and then, where a splitter with a list of
# abbreviations would do a little better.
SENTENCE_END = re.compile(r"(?<!\b[A-Z])([.!?][\"')\]]?)[ \t]+(?=[\"'(\[]?[A-Z0-9])")


def _no_segments(text: str) -> str:
    return text


def _sentences(text: str) -> str:
    return SENTENCE_END.sub("\\1\n", text)


# data.segments -> (raw text) -> the text with each segment on a line of its own. The tokenizer then puts
# [SEP] after every line, where with `none` [SEP] comes only after each document (a line break is a space).
SEGMENTS: dict[str, Callable[[str], str] | None] = {
    "none": None,
    "line": _no_segments,  # the source's own lines: Wikipedia's paragraphs
    "sentence": _sentences,  # each sentence, as a BLiMP sentence is scored: [CLS] sentence [SEP]
}
# data.ordering -> (rows, seed, vocab size) -> the rows reordered
ORDERINGS: dict[str, Callable[[datasets.Dataset, int, int], datasets.Dataset]] = {
    "none": _keep_order,
    "random": _shuffle,
    "curriculum": _curriculum,
}
