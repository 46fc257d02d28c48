"""Train a BERT-style tokenizer from scratch with the `tokenizers` library (WordPiece, BPE or Unigram)."""

from __future__ import annotations

from dataclasses import dataclass

# Trainers place special tokens first, in this order, so their ids are fixed for every tokenizer kind.
SPECIAL_TOKENS = ("[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]")


@dataclass(frozen=True)
class SpecialTokens:
    pad: int = 0
    unk: int = 1
    cls: int = 2
    sep: int = 3
    mask: int = 4

    @property
    def all(self) -> tuple[int, ...]:
        return (self.pad, self.unk, self.cls, self.sep, self.mask)
