"""The context-use diagnostic: shuffling keeps each row's words and masked positions, a model that reads
context gains from real order, and one that cannot read context gains nothing."""

from __future__ import annotations

import math

import torch
from test_train import make_config, run_dir, synthetic_data

from cramming.model import IGNORE_INDEX, MLMOutput
from cramming.train import loop
from cramming.train.config import MLMConfig
from cramming.train.mlm import MLMMasker
from cramming.train.validation import context_use, masked_for_diagnosis, shuffle_within_rows, unigram_entropy

SPECIAL = torch.tensor([0, 1, 2, 3, 4])


def test_shuffling_keeps_words_specials_and_masked_positions():
    ids = torch.randint(5, 100, (6, 32))
    ids[:, 0], ids[:, 15] = 2, 3
    shuffled = shuffle_within_rows(ids, SPECIAL, seed=0)
    assert torch.equal(shuffled[:, [0, 15]], ids[:, [0, 15]])
    assert all(torch.equal(a.sort().values, b.sort().values) for a, b in zip(shuffled, ids, strict=True))
    assert not torch.equal(shuffled, ids)
    masker = MLMMasker(MLMConfig(), 100, (0, 1, 2, 3, 4), 4)
    (inputs, labels), (_, shuffled_labels) = (
        masked_for_diagnosis(masker, ids),
        masked_for_diagnosis(masker, shuffled),
    )
    assert torch.equal(labels != IGNORE_INDEX, shuffled_labels != IGNORE_INDEX)  # the same positions
    assert torch.all(inputs[labels != IGNORE_INDEX] == 4)  # every target hidden behind [MASK]


def test_unigram_entropy_of_the_targets():
    labels = torch.tensor([[5, 5, 6, 7, IGNORE_INDEX]])
    expected = -(0.5 * math.log(0.5) + 2 * 0.25 * math.log(0.25))
    assert abs(unigram_entropy(labels) - expected) < 1e-12


class Copycat(torch.nn.Module):
    """An oracle that reads context: predicts a masked token as its left neighbour's successor (rows that
    count up); with `blind`, the same uniform guess everywhere."""

    def __init__(self, vocab: int, blind: bool):
        super().__init__()
        self.vocab, self.blind = vocab, blind
        self.weight = torch.nn.Parameter(torch.zeros(1))

    def forward(self, input_ids, labels, predicted_per_row=None):  # BertForMLM.forward's signature
        left = 5 + (torch.roll(input_ids, 1, dims=1) - 5 + 1) % 45  # the successor of the left neighbour
        logits = torch.full((*input_ids.shape, self.vocab), -10.0).scatter(-1, left[..., None], 10.0)
        if self.blind:
            logits = torch.zeros_like(logits)
        keep = labels.flatten() != IGNORE_INDEX
        logits, labels = logits.flatten(0, 1)[keep], labels.flatten()[keep]
        return MLMOutput(torch.nn.functional.cross_entropy(logits, labels), logits, labels)


def test_a_model_that_reads_context_gains_and_a_blind_one_does_not():
    starts = torch.randint(0, 45, (64, 1))
    ids = 5 + (starts + torch.arange(32)) % 45  # rows that count up: the left neighbour predicts a token
    ids[:, 0] = 2
    masker = MLMMasker(MLMConfig(mask_fraction=0.1), 50, (0, 1, 2, 3, 4), 4)
    seeing = context_use(Copycat(50, blind=False), masker, ids, batch_size=16)
    blind = context_use(Copycat(50, blind=True), masker, ids, batch_size=16)
    assert seeing["gain"] > 5.0 and seeing["loss_real"] < seeing["unigram_entropy"]
    assert abs(blind["gain"]) < 1e-9


def test_the_final_validation_reports_context_use(tmp_path):
    cfg = make_config(tmp_path, "train.steps=3")
    result = loop.train(cfg, synthetic_data(tmp_path / "data"), run_dir(cfg))
    keys = {"context_loss_real", "context_loss_shuffled", "context_gain", "context_unigram_entropy"}
    assert keys <= set(result.validation)
    # an untrained model on rows of independent tokens: no order to read
    assert abs(result.validation["context_gain"]) < 0.5
