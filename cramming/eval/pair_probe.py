"""Can a model compare two sentences before it is fine-tuned? A training-free probe on STS-B's dev pairs.

    alone   each sentence encoded on its own ([CLS] s [SEP]), its real tokens' final hidden states averaged,
            and the cosine of the two averages
    joint   the pair encoded as fine-tuning sees it ([CLS] a [SEP] b [SEP]), each segment's tokens averaged
            on their own (the u and v of the pair head, eval.head.pooler=pair), and their cosine

Each figure is the Pearson correlation (x100) of the cosines with the human scores, as GLUE scores STS-B. A
model with random weights still scores well above zero, because averaged random embeddings of shared words
are alike: compare a checkpoint with the same arch after no pretraining (`train.steps=1`), as GLUE is.
"""

from __future__ import annotations

import numpy as np
import torch
from tokenizers import Tokenizer

from cramming.eval.backbone import Backbone
from cramming.eval.finetune import Encoded, padded_batch


def _segment_means(backbone: Backbone, encodings: list) -> tuple[torch.Tensor, torch.Tensor]:
    """(first segment's mean, second segment's mean; zeros where there is none), in fp32."""
    device = next(backbone.encoder.parameters()).device
    data = Encoded([e.ids for e in encodings], [e.type_ids for e in encodings], np.zeros(len(encodings)))
    batch = padded_batch(data, np.arange(len(encodings)), backbone.pad_id, device)  # fine-tuning's padding
    ids, types, mask = batch["input_ids"], batch["token_type_ids"], batch["attention_mask"]
    hidden = backbone.encoder(ids, mask, types).float().cpu()
    types, mask = types.cpu(), mask.cpu()
    means = []
    for segment in (0, 1):
        weights = (mask & (types == segment)).float()[..., None]  # (batch, seq, 1)
        means.append((hidden * weights).sum(1) / weights.sum(1).clamp(min=1.0))
    return means[0], means[1]


def _pearson(x: np.ndarray, y: np.ndarray) -> float:
    if np.std(x) == 0 or np.std(y) == 0:
        return float("nan")
    return float(np.corrcoef(x, y)[0, 1] * 100)


@torch.no_grad()
def pair_probe(
    backbone: Backbone, first: list[str], second: list[str], scores: np.ndarray, batch_size: int = 64
) -> dict[str, float]:
    """Pearson x100 of the two cosines (`alone`, `joint`) with `scores`, over the pairs (first[i], second[i])."""
    if not (len(first) == len(second) == len(scores)) or len(first) < 2:
        raise ValueError(
            f"pair_probe needs at least 2 pairs of equal counts, got {len(first)}, {len(second)},"
            f" {len(scores)}"
        )
    tokenizer = Tokenizer.from_str(backbone.tokenizer.to_str())  # a copy: truncation is a setting
    tokenizer.enable_truncation(backbone.input_length(512))
    tokenizer.no_padding()
    was_training = backbone.encoder.training
    backbone.encoder.eval()
    alone, joint = [], []
    try:
        for start in range(0, len(first), batch_size):
            a, b = first[start : start + batch_size], second[start : start + batch_size]
            u, _ = _segment_means(backbone, tokenizer.encode_batch(a))
            v, _ = _segment_means(backbone, tokenizer.encode_batch(b))
            alone.append(torch.cosine_similarity(u, v, dim=-1))
            u, v = _segment_means(backbone, tokenizer.encode_batch(list(zip(a, b, strict=True))))
            joint.append(torch.cosine_similarity(u, v, dim=-1))
    finally:
        backbone.encoder.train(was_training)
    scores = np.asarray(scores, dtype=np.float64)
    return {
        "alone": _pearson(torch.cat(alone).numpy(), scores),
        "joint": _pearson(torch.cat(joint).numpy(), scores),
        "pairs": len(first),
    }


def describe(result: dict[str, float]) -> str:
    return (
        f"pair probe on {result['pairs']} STS-B dev pairs: cosine of mean-pooled sentences, Pearson x100:"
        f" alone {result['alone']:.1f}, joint {result['joint']:.1f}"
    )
