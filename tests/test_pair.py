"""The pair side of GLUE: the pair pooler of the classifier head and the training-free pair probe."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import data_dir

from cramming.eval.config import HeadConfig
from cramming.eval.head import SequenceClassifier, segment_pair
from cramming.eval.pair_probe import pair_probe
from cramming.eval.run import checkpoint_backbone
from cramming.impl import ImplConfig
from tests.test_eval import _save_tiny_checkpoint

ROOT = Path(__file__).resolve().parents[1]


class _Lookup(torch.nn.Module):
    """A stand-in encoder: each id's embedding, no context: (ids, mask, types) -> (batch, seq, 8)."""

    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Embedding(50, 8)

    def forward(self, ids, mask, types=None):
        return self.embed(ids)


def test_pair_pooling_averages_each_segment_and_ignores_padding():
    hidden = torch.randn(2, 6, 4)
    types = torch.tensor([[0, 0, 0, 1, 1, 0], [0, 0, 0, 0, 0, 0]])
    mask = torch.tensor([[1, 1, 1, 1, 1, 0], [1, 1, 1, 1, 0, 0]])
    pooled = segment_pair(hidden, mask, types)
    u, v = hidden[0, :3].mean(0), hidden[0, 3:5].mean(0)  # position 5 is padding (type 0 there too)
    torch.testing.assert_close(pooled[0], torch.cat([u, v, (u - v).abs(), u * v]))
    single = hidden[1, :4].mean(0)  # one sentence: v = u
    torch.testing.assert_close(pooled[1], torch.cat([single, single, torch.zeros(4), single * single]))


def test_the_pair_head_reads_four_vectors_and_its_score_is_symmetric_in_swapped_features():
    model = SequenceClassifier(_Lookup(), 8, 1, dropout=0.0, head=HeadConfig(pooler="pair")).eval()
    assert model.dense.in_features == 32
    bare = SequenceClassifier(_Lookup(), 8, 1, dropout=0.0, head=HeadConfig(pooler="pair", dim=0))
    assert bare.head.in_features == 32
    ids = torch.tensor([[2, 7, 8, 3, 9, 3, 0]])
    types, mask = torch.tensor([[0, 0, 0, 0, 1, 1, 0]]), torch.tensor([[1, 1, 1, 1, 1, 1, 0]])
    out = model(ids, mask, types)
    assert out.shape == (1, 1) and torch.isfinite(out).all()
    out.sum().backward()  # the gradient reaches the encoder through both segments
    grad = model.encoder.embed.weight.grad
    assert grad[7].abs().sum() > 0 and grad[9].abs().sum() > 0 and grad[0].abs().sum() == 0


@pytest.fixture(scope="module")
def tiny_backbone(tmp_path_factory):
    from cramming.eval.glue_data import load_local
    from cramming.eval.tasks import GLUE_TASKS

    texts = load_local(GLUE_TASKS["STS-B"], data_dir("glue"))["train"]["text_a"][:3000]
    checkpoint = _save_tiny_checkpoint(tmp_path_factory.mktemp("probe") / "tiny" / "run", texts)
    return checkpoint, checkpoint_backbone(checkpoint, ImplConfig(device="cpu"))


def test_the_probe_scores_identical_pairs_above_unrelated_ones(tiny_backbone):
    _, backbone = tiny_backbone
    sentences = [
        "a man is playing a guitar .",
        "the cat sat on the mat .",
        "two dogs run in a field .",
        "a woman slices an onion .",
        "stocks fell sharply on monday .",
    ]
    first = sentences + sentences
    second = sentences + sentences[1:] + sentences[:1]  # the same sentence, then a different one
    scores = np.array([5.0] * 5 + [0.0] * 5)
    result = pair_probe(backbone, first, second, scores, batch_size=3)
    # a sentence encoded alone is identical to itself: cosine 1, above every different pair, so the
    # correlation with (5 for the same, 0 for different) is positive whatever the random weights
    assert result["pairs"] == 10 and result["alone"] > 0
    assert -100 <= result["joint"] <= 100
    assert backbone.encoder.training  # the probe leaves the encoder's mode as it found it
    with pytest.raises(ValueError, match="at least 2 pairs"):
        pair_probe(backbone, first[:1], second[:1], scores[:1])


@pytest.mark.slow
def test_the_probe_script_prints_one_line_per_checkpoint_and_refuses_bad_input(tiny_backbone, glue_dir):
    checkpoint, _ = tiny_backbone
    command = [sys.executable, str(ROOT / "scripts" / "pair_probe.py")]
    ok = subprocess.run(
        [*command, str(checkpoint), "--glue-dir", str(glue_dir), "--pairs", "64", "--json"],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=300,
    )
    assert ok.returncode == 0, ok.stderr
    assert "pair probe on 64 STS-B dev pairs" in ok.stdout and '"alone"' in ok.stdout
    bad = subprocess.run(
        [*command, str(checkpoint), "--glue-dir", str(glue_dir), "--pairs", "1"],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=300,
    )
    assert bad.returncode == 2 and "at least 2 pairs" in bad.stderr
    missing = subprocess.run(
        [*command, str(checkpoint), "--glue-dir", str(ROOT / "no-such-glue")],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=300,
    )
    assert missing.returncode == 2 and "--glue-dir" in missing.stderr
