"""The masked-language-model objective: choose tokens to predict and corrupt them (80% [MASK] / 10% random /
10% unchanged). Special tokens ([CLS], [SEP], [PAD], ...) are never chosen.

Every random draw of a row is a pure function of (seed, the row's position in the training stream, token
position): a counter-based hash, not a generator's running state. So a row gets the same mask whatever
micro-batch it falls in (impl.microbatch_size changes no result), on whichever rank trains it, and after any
resume: there is no masking state to save.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from cramming.data import PretrainingData
from cramming.data.tokenizer import word_continuations
from cramming.errors import ConfigError
from cramming.model import IGNORE_INDEX
from cramming.train.config import MLMConfig

_U32 = 0xFFFFFFFF
# independent draws per token: which tokens are chosen, how each is corrupted, the random replacement
_CHOOSE, _CORRUPT, _REPLACE = 1, 2, 3


def _mix32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer hash (two multiply-xorshift rounds) on int64 tensors holding values < 2**32. Every
    product stays below 2**59, so int64 never overflows on any platform."""
    x = ((x >> 16) ^ x) * 0x45D9F3B & _U32
    x = ((x >> 16) ^ x) * 0x45D9F3B & _U32
    return (x >> 16) ^ x


def row_hashes(seed: int, rows: torch.Tensor, seq_length: int, stream: int) -> torch.Tensor:
    """(batch, seq) int64 hashes in [0, 2**32) of (seed, stream row, token position, draw number)."""
    rows = rows.to(torch.int64)
    key = _mix32((rows & _U32) ^ _mix32((rows >> 32) ^ _mix32(torch.tensor(seed & _U32) + stream)))
    positions = torch.arange(seq_length, dtype=torch.int64)
    return _mix32((key[:, None] + positions * 0x9E3779B1) & _U32)  # (batch, seq)


def row_uniforms(seed: int, rows: torch.Tensor, seq_length: int, stream: int) -> torch.Tensor:
    """(batch, seq) float32 uniforms in [0, 1) on a 2**-24 grid (exact in float32)."""
    return (row_hashes(seed, rows, seq_length, stream) >> 8).to(torch.float32) * 2.0**-24


class MLMMasker:
    def __init__(
        self,
        cfg: MLMConfig,
        vocab_size: int,
        special_ids: tuple[int, ...],
        mask_id: int,
        seed: int = 0,
        continuations: Sequence[int] = (),
    ):
        """continuations: the ids of tokens that continue the word before them (WordPiece's `##` pieces),
        which train.mlm.whole_words needs."""
        if cfg.whole_words and not continuations:
            raise ConfigError(
                "train.mlm.whole_words needs to know which tokens continue a word: a WordPiece tokenizer"
                " (data.tokenizer.kind=wordpiece), or train.mlm.whole_words=false"
            )
        self.cfg = cfg
        self.vocab_size = vocab_size
        self.mask_id = mask_id
        self.seed = seed
        self.special_ids = torch.tensor(sorted(set(special_ids)), dtype=torch.long)
        # random replacements are drawn from the ordinary tokens; tokenizers put the special ones first
        self.first_ordinary = max(special_ids) + 1
        self.continues = torch.zeros(vocab_size, dtype=torch.bool)  # (vocab,): continues the word before it
        self.continues[list(continuations)] = True

    @classmethod
    def for_data(cls, cfg: MLMConfig, data: PretrainingData, seed: int) -> MLMMasker:
        """The masker of `cfg` for the vocabulary, special tokens and word pieces of `data`."""
        pieces = word_continuations(data.tokenizer) if cfg.whole_words else ()
        return cls(cfg, data.vocab_size, data.special.all, data.special.mask, seed, pieces)

    def num_masked(self, seq_length: int) -> int:
        """Tokens chosen per row in `count` mode."""
        return max(1, round(self.cfg.mask_fraction * seq_length))

    def predicted_per_row(self, seq_length: int) -> int | None:
        """The most labelled positions a row can have: known in `count` mode (the model then predicts with a
        static shape), None in `probability` mode (the model selects the labelled positions, a
        data-dependent shape: one graph break under torch.compile and a host synchronization per step)."""
        return self.num_masked(seq_length) if self.cfg.mode == "count" else None

    def __call__(self, input_ids: torch.Tensor, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """input_ids (batch, seq) of the stream rows `rows` (batch,) -> (corrupted input_ids, labels); labels
        hold the original id where a token was chosen and IGNORE_INDEX elsewhere."""
        seq = input_ids.shape[1]
        maskable = ~torch.isin(input_ids, self.special_ids)  # (batch, seq)
        scores = row_uniforms(self.seed, rows, seq, _CHOOSE)  # (batch, seq)
        if self.cfg.whole_words:  # every piece of a word takes its first piece's draw
            return self._corrupt(input_ids, rows, self._choose_words(input_ids, maskable, scores))
        return self._corrupt(input_ids, rows, self._choose(maskable, scores))

    def _corrupt(
        self, input_ids: torch.Tensor, rows: torch.Tensor, chosen: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The chosen positions corrupted (80% [MASK] / 10% random / 10% kept) and labelled."""
        seq = input_ids.shape[1]
        labels = torch.where(chosen, input_ids, IGNORE_INDEX)

        draw = row_uniforms(self.seed, rows, seq, _CORRUPT)
        to_mask = chosen & (draw < self.cfg.mask_token_fraction)
        to_random = chosen & ~to_mask & (draw < self.cfg.mask_token_fraction + self.cfg.random_fraction)
        ordinary = self.vocab_size - self.first_ordinary
        random_ids = self.first_ordinary + row_hashes(self.seed, rows, seq, _REPLACE) % ordinary
        corrupted = torch.where(to_mask, self.mask_id, input_ids)
        corrupted = torch.where(to_random, random_ids, corrupted)
        return corrupted, labels

    def _choose(self, maskable: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        if self.cfg.mode == "probability":
            return maskable & (scores < self.cfg.mask_fraction)
        # count: the k maskable positions with the highest random scores; special tokens get score -1 so they
        # are picked only when a row has fewer than k ordinary tokens, and dropped again by `& maskable`
        k = self.num_masked(maskable.shape[1])
        scores = scores.masked_fill(~maskable, -1.0)
        chosen = torch.zeros_like(maskable)
        chosen.scatter_(1, scores.topk(k, dim=1).indices, True)
        return chosen & maskable

    def _choose_words(
        self, input_ids: torch.Tensor, maskable: torch.Tensor, scores: torch.Tensor
    ) -> torch.Tensor:
        """Whole words: each word takes the draw of its first piece, and all its pieces are chosen or none.
        probability: each word with probability mask_fraction. count: the words with the highest draws, as many
        as fit whole in k tokens (so a row has at most k labels, often a piece or two fewer)."""
        batch, seq = input_ids.shape
        positions = torch.arange(seq).expand(batch, seq)  # (batch, seq)
        after_ordinary = torch.nn.functional.pad(maskable[:, :-1], (1, 0), value=False)
        # a word starts at an ordinary token that does not continue one (or follows no ordinary token)
        starts = maskable & (~self.continues[input_ids] | ~after_ordinary)
        start_of = torch.cummax(
            torch.where(starts, positions, 0), dim=1
        ).values  # (batch, seq): its word's start
        draws = scores.gather(1, start_of)
        if self.cfg.mode == "probability":
            return maskable & (draws < self.cfg.mask_fraction)
        k = self.num_masked(seq)
        # words by their draw, best first, each word's pieces together and in order (a stable sort)
        order = draws.masked_fill(~maskable, -1.0).argsort(dim=1, descending=True, stable=True)
        rank = torch.empty_like(order).scatter_(1, order, positions)  # (batch, seq): place in that order
        last = torch.full_like(rank, -1).scatter_reduce(  # per word (at its start): its last piece's place
            1, start_of, rank.masked_fill(~maskable, -1), reduce="amax", include_self=True
        )
        return maskable & (last.gather(1, start_of) < k)


class MLMObjective:
    """The masked-LM loss of one micro-batch: the one function the loop and the micro-batch search train
    through (the train step runs it under autocast and takes its loss backward)."""

    def __init__(self, masker: MLMMasker, device: torch.device, predicted_per_row: int | None):
        """predicted_per_row: masker.predicted_per_row(seq_length), the decoder's static shape (None: dynamic)."""
        self.masker, self.device, self.predicted_per_row = masker, device, predicted_per_row

    def __call__(
        self, model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """batch: (stream rows (micro,), input_ids (micro, seq)) -> (loss, correct predictions, predictions)."""
        rows, input_ids = batch
        corrupted, labels = self.masker(input_ids, rows)
        if self.device.type == "cuda":  # copies from pinned memory do not wait for the queued GPU work
            corrupted, labels = corrupted.pin_memory(), labels.pin_memory()
        corrupted = corrupted.to(self.device, non_blocking=True)
        labels = labels.to(self.device, non_blocking=True)
        out = model(corrupted, labels, predicted_per_row=self.predicted_per_row)
        return (out.loss, *mlm_accuracy_counts(out))


@torch.no_grad()
def mlm_accuracy_counts(out) -> tuple[torch.Tensor, torch.Tensor]:
    """(correct predictions, predictions) of an MLMOutput, on the device (no synchronization). Right where the
    label's logit is the row's maximum: argmax == label up to exact ties, and on CPU an amax is many times
    cheaper than an argmax (profiled: argmax was 9% of a tiny-model step)."""
    target = out.labels != IGNORE_INDEX
    label_logit = out.logits.gather(-1, out.labels.clamp(min=0)[:, None]).squeeze(-1)
    correct = ((label_logit >= out.logits.amax(dim=-1)) & target).sum()
    return correct, target.sum()
