"""MLM masking: how many tokens are chosen, how they are corrupted, and that special tokens never are."""

from __future__ import annotations

import pytest
import torch

from cramming.model import IGNORE_INDEX
from cramming.train.config import MLMConfig
from cramming.train.mlm import MLMMasker

VOCAB = 500
SPECIAL = (0, 1, 2, 3, 4)  # pad, unk, cls, sep, mask
MASK = 4


def rows(batch=512, seq=128):
    """Rows like the packed pretraining data: [CLS] at the start, a [SEP] between documents every ~20 tokens."""
    ids = torch.randint(5, VOCAB, (batch, seq))
    ids[:, 0] = 2
    ids[torch.rand(batch, seq) < 0.05] = 3
    return ids


def mask(ids, seed=0, **cfg):
    """Mask `ids` as stream rows 0..batch-1 of a run with `seed`."""
    masker = MLMMasker(MLMConfig(**cfg), VOCAB, SPECIAL, MASK, seed=seed)
    return masker(ids, torch.arange(ids.shape[0]))


def test_count_mode_masks_a_fixed_number_per_row():
    ids = rows()
    _, labels = mask(ids)
    per_row = (labels != IGNORE_INDEX).sum(dim=1)
    assert torch.all(per_row == 32)  # 25% of 128


def test_special_tokens_are_never_chosen_nor_changed():
    ids = rows()
    corrupted, labels = mask(ids)
    special = torch.isin(ids, torch.tensor(SPECIAL))
    assert special.sum() > 1000
    assert torch.all(labels[special] == IGNORE_INDEX)
    assert torch.equal(corrupted[special], ids[special])


def test_labels_hold_the_original_tokens():
    ids = rows()
    _, labels = mask(ids)
    chosen = labels != IGNORE_INDEX
    assert torch.equal(labels[chosen], ids[chosen])


@pytest.mark.parametrize("mode", ["count", "probability"])
def test_80_10_10_replacement(mode):
    ids = rows()
    corrupted, labels = mask(ids, mode=mode, mask_fraction=0.25 if mode == "count" else 0.15)
    chosen = labels != IGNORE_INDEX
    n = chosen.sum().item()
    to_mask = (corrupted[chosen] == MASK).float().mean().item()
    kept = (corrupted[chosen] == ids[chosen]).float().mean().item()
    # a random replacement can draw the original token (1 in ~495): counted as kept, hence the tolerance
    randomized = 1.0 - to_mask - kept
    tol = 4 * (0.25 / n) ** 0.5  # four standard deviations of a share near 0.1-0.8
    assert to_mask == pytest.approx(0.8, abs=tol)
    assert randomized == pytest.approx(0.1, abs=tol)
    assert kept == pytest.approx(0.1, abs=tol)
    # random replacements are ordinary tokens of the vocabulary, never special ones
    replaced = corrupted[chosen & (corrupted != MASK) & (corrupted != ids)]
    assert replaced.min() >= 5 and replaced.max() < VOCAB
    # unchosen positions are untouched
    assert torch.equal(corrupted[~chosen], ids[~chosen])


def test_probability_mode_masks_the_given_share_of_ordinary_tokens():
    ids = rows()
    _, labels = mask(ids, mode="probability", mask_fraction=0.15)
    ordinary = ~torch.isin(ids, torch.tensor(SPECIAL))
    share = (labels != IGNORE_INDEX).sum().item() / ordinary.sum().item()
    assert share == pytest.approx(0.15, abs=0.005)
    assert (labels != IGNORE_INDEX).sum(dim=1).unique().numel() > 5  # varies per row, unlike count mode


def test_row_with_too_few_ordinary_tokens_masks_only_those():
    ids = torch.full((1, 16), 3)
    ids[0, [2, 7, 11]] = torch.tensor([10, 11, 12])
    _, labels = mask(ids, mask_fraction=0.5)  # asks for 8 of 16
    assert (labels != IGNORE_INDEX).nonzero()[:, 1].tolist() == [2, 7, 11]


def test_masking_is_reproducible_from_the_generator():
    ids = rows(batch=4)
    a, b, c = mask(ids, seed=1), mask(ids, seed=1), mask(ids, seed=2)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    assert not torch.equal(a[1], c[1])


def test_a_rows_mask_depends_on_its_stream_position_and_seed_only():
    """Masks keyed by (seed, stream row): any split into micro-batches gives the same masks (the micro-batch
    size changes no result, and a resume needs no masking state); other rows, seeds differ."""
    ids = rows(batch=64)
    masker = MLMMasker(MLMConfig(), VOCAB, SPECIAL, MASK, seed=3)
    positions = torch.arange(1000, 1064)
    whole = masker(ids, positions)
    for size in (1, 7, 16):
        parts = [masker(i, p) for i, p in zip(ids.split(size), positions.split(size), strict=True)]
        for k in range(2):
            assert torch.equal(torch.cat([part[k] for part in parts]), whole[k])
    other_rows = masker(ids, positions + 64)[1]
    other_seed = MLMMasker(MLMConfig(), VOCAB, SPECIAL, MASK, seed=4)(ids, positions)[1]
    assert not torch.equal(other_rows, whole[1]) and not torch.equal(other_seed, whole[1])


# ------------------------------------------------------------------------------------------- whole words

PIECES = list(range(300, VOCAB))  # ids 300.. continue the word before them (WordPiece's ## pieces)


def words_of(ids: torch.Tensor) -> list[list[tuple[int, int]]]:
    """Each row's words as (first, end) spans: an ordinary token that is not a piece, or follows a special
    token, starts one; the pieces after it belong to it."""
    out = []
    for row in ids.tolist():
        spans, start = [], None
        for i, token in enumerate(row + [0]):
            ordinary = token not in SPECIAL
            starts = ordinary and (token not in PIECES or start is None)
            if start is not None and (starts or not ordinary):
                spans.append((start, i))
                start = None
            if starts:
                start = i
        out.append(spans)
    return out


@pytest.mark.parametrize("mode", ["count", "probability"])
def test_whole_words_are_chosen_with_all_their_pieces_or_not_at_all(mode):
    ids = rows(batch=256)
    masker = MLMMasker(
        MLMConfig(mode=mode, whole_words=True), VOCAB, SPECIAL, MASK, seed=3, continuations=PIECES
    )
    _, labels = masker(ids, torch.arange(ids.shape[0]))
    chosen = labels != IGNORE_INDEX
    for row, spans in enumerate(words_of(ids)):
        for first, end in spans:
            part = chosen[row, first:end]
            assert part.all() or not part.any(), (row, first, end, part.tolist())
    assert not chosen[torch.isin(ids, torch.tensor(SPECIAL))].any()
    per_row = chosen.sum(dim=1).float()
    if mode == "count":  # at most k; short of it by less than the longest word a row has
        longest = max(end - first for spans in words_of(ids) for first, end in spans)
        assert per_row.max() <= 32 and per_row.min() > 32 - longest
    else:  # about 25% of the tokens, in whole words
        assert abs(per_row.mean().item() / 128 - 0.25 * (1 - 0.05)) < 0.03


def test_whole_words_keep_the_row_keyed_draws_and_need_word_pieces():
    ids = rows(batch=8)
    masker = MLMMasker(MLMConfig(whole_words=True), VOCAB, SPECIAL, MASK, seed=1, continuations=PIECES)
    a = masker(ids, torch.arange(8))
    b = masker(ids[4:], torch.arange(4, 8))  # the same rows in another micro-batch: the same masks
    assert torch.equal(a[1][4:], b[1]) and torch.equal(a[0][4:], b[0])
    from cramming.errors import ConfigError

    with pytest.raises(ConfigError, match="whole_words"):
        MLMMasker(MLMConfig(whole_words=True), VOCAB, SPECIAL, MASK)
    # without whole words nothing changes: the masks of before
    assert torch.equal(
        mask(ids)[1],
        MLMMasker(MLMConfig(), VOCAB, SPECIAL, MASK, continuations=PIECES)(ids, torch.arange(8))[1],
    )


def test_word_pieces_come_from_a_wordpiece_tokenizer_only():
    from tokenizers import Tokenizer
    from tokenizers.models import BPE, WordPiece

    from cramming.data.tokenizer import word_continuations
    from cramming.errors import ConfigError

    vocab = {"[PAD]": 0, "[UNK]": 1, "play": 2, "##ing": 3, "##s": 4, "run": 5}
    assert word_continuations(Tokenizer(WordPiece(vocab, unk_token="[UNK]"))) == [3, 4]
    with pytest.raises(ConfigError, match="wordpiece"):
        word_continuations(Tokenizer(BPE()))


def test_the_loop_s_masker_reads_the_pieces_of_the_data_s_tokenizer():
    from types import SimpleNamespace

    from tokenizers import Tokenizer
    from tokenizers.models import WordPiece

    from cramming.data.tokenizer import SpecialTokens

    vocab = {"[PAD]": 0, "[UNK]": 1, "[CLS]": 2, "[SEP]": 3, "[MASK]": 4, "play": 5, "##ing": 6, "run": 7}
    data = SimpleNamespace(
        tokenizer=Tokenizer(WordPiece(vocab, unk_token="[UNK]")), vocab_size=8, special=SpecialTokens()
    )
    masker = MLMMasker.for_data(MLMConfig(whole_words=True), data, seed=0)
    assert masker.continues.tolist() == [False] * 6 + [True, False]
    assert not MLMMasker.for_data(MLMConfig(), data, seed=0).continues.any()
