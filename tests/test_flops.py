"""The analytic FLOP count against a hand count and against torch's FLOP counter on tiny models."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from cramming.model import IGNORE_INDEX, ArchConfig, build_model
from cramming.model.flops import forward_flops_per_token, train_flops_per_token

TINY = ArchConfig(name="t", num_layers=2, hidden_size=16, num_heads=2, intermediate_size=32, dropout=0.0)
BERT_LIKE = replace(
    TINY,
    ffn="gelu",
    norm_scheme="post",
    bias=True,
    position_embedding="learned",
    type_vocab_size=2,
    final_norm=False,
    head_transform=True,
    decoder_bias=True,
    sparse_prediction=False,
)


def test_hand_count():
    arch = ArchConfig(name="h", num_layers=1, hidden_size=4, num_heads=2, intermediate_size=8)
    parts = forward_flops_per_token(arch, vocab_size=10, seq_length=6, predicted_fraction=0.5)
    # qkv 2*4*12 + out 2*4*4 = 128; q k^T and probs v 2*6*4 each = 96; GLU up 2*4*8 + down 2*4*4 = 96;
    # decoder on half the tokens 0.5 * 2*4*10 = 40
    assert parts == {"attention": 224.0, "ffn": 96.0, "head": 40.0, "total": 360.0}
    dense = forward_flops_per_token(replace(arch, sparse_prediction=False), 10, 6, 0.5)
    assert dense["head"] == 80.0
    assert train_flops_per_token(arch, 10, 6, 0.5) == 3 * 360.0


@pytest.mark.parametrize("arch", [TINY, BERT_LIKE], ids=["crammed", "bert"])
def test_matches_torch_flop_counter(arch):
    """One training step (forward + backward) of a real model, counted by torch, equals the analytic count."""
    vocab, batch, seq, masked = 50, 3, 12, 4
    model = build_model(arch, vocab, attention="eager", dropout=0.0)  # eager: every product is an aten matmul
    input_ids = torch.randint(5, vocab, (batch, seq))
    labels = torch.full_like(input_ids, IGNORE_INDEX)
    positions = torch.rand(batch, seq).argsort(dim=1)[
        :, :masked
    ]  # exactly `masked` per row, as in count mode
    labels.scatter_(1, positions, input_ids.gather(1, positions))
    counter = FlopCounterMode(display=False)
    with counter:
        model(input_ids, labels).loss.backward()
    expected = batch * seq * train_flops_per_token(arch, vocab, seq, predicted_fraction=masked / seq)
    assert counter.get_total_flops() == pytest.approx(expected, rel=1e-9), counter.get_flop_counts()
