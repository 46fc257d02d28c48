"""The masked-language-model objective: choose tokens to predict and corrupt them (80% [MASK] / 10% random /
10% unchanged). Special tokens ([CLS], [SEP], [PAD], ...) are never chosen.

Masking runs in the training process on whole micro-batches with its own torch.Generator, so a resumable
state can save and restore it exactly.
"""

from __future__ import annotations

import torch

from cramming.model import IGNORE_INDEX
from cramming.train.config import MLMConfig


class MLMMasker:
    def __init__(self, cfg: MLMConfig, vocab_size: int, special_ids: tuple[int, ...], mask_id: int):
        self.cfg = cfg
        self.vocab_size = vocab_size
        self.mask_id = mask_id
        self.special_ids = torch.tensor(sorted(set(special_ids)), dtype=torch.long)
        # random replacements are drawn from the ordinary tokens; tokenizers put the special ones first
        self.first_ordinary = max(special_ids) + 1

    def num_masked(self, seq_length: int) -> int:
        """Tokens chosen per row in `count` mode."""
        return max(1, round(self.cfg.mask_fraction * seq_length))

    def __call__(
        self, input_ids: torch.Tensor, generator: torch.Generator
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """input_ids (batch, seq) -> (corrupted input_ids, labels); labels hold the original id where a token
        was chosen and IGNORE_INDEX elsewhere."""
        maskable = ~torch.isin(input_ids, self.special_ids)  # (batch, seq)
        chosen = self._choose(maskable, generator)
        labels = torch.where(chosen, input_ids, IGNORE_INDEX)

        draw = torch.rand(input_ids.shape, generator=generator)
        to_mask = chosen & (draw < self.cfg.mask_token_fraction)
        to_random = chosen & ~to_mask & (draw < self.cfg.mask_token_fraction + self.cfg.random_fraction)
        random_ids = torch.randint(self.first_ordinary, self.vocab_size, input_ids.shape, generator=generator)
        corrupted = torch.where(to_mask, self.mask_id, input_ids)
        corrupted = torch.where(to_random, random_ids, corrupted)
        return corrupted, labels

    def _choose(self, maskable: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
        scores = torch.rand(maskable.shape, generator=generator)  # (batch, seq)
        if self.cfg.mode == "probability":
            return maskable & (scores < self.cfg.mask_fraction)
        # count: the k maskable positions with the highest random scores; special tokens get score -1 so they
        # are picked only when a row has fewer than k ordinary tokens, and dropped again by `& maskable`
        k = self.num_masked(maskable.shape[1])
        scores = scores.masked_fill(~maskable, -1.0)
        chosen = torch.zeros_like(maskable)
        chosen.scatter_(1, scores.topk(k, dim=1).indices, True)
        return chosen & maskable
