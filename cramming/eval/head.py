"""The GLUE classifier on a pretrained encoder: pooling, an optional dense layer, the class logits.

HeadConfig, the `eval.head` schema, lives here beside POOLERS and NONLINEARITIES, the names it accepts.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from cramming.errors import check_choice, config_error


def first_token(hidden: torch.Tensor, attention_mask: torch.Tensor, token_type_ids=None) -> torch.Tensor:
    """zero_index pooling: the final hidden state of [CLS]."""
    return hidden[:, 0]  # (batch, hidden)


def mean_of_tokens(hidden: torch.Tensor, attention_mask: torch.Tensor, token_type_ids=None) -> torch.Tensor:
    """mean pooling over the real (unpadded) tokens."""
    weights = attention_mask.to(hidden.dtype)[..., None]  # (batch, seq, 1)
    return (hidden * weights).sum(1) / weights.sum(1).clamp(min=1.0)  # (batch, hidden)


def segment_pair(
    hidden: torch.Tensor, attention_mask: torch.Tensor, token_type_ids: torch.Tensor | None
) -> torch.Tensor:
    """pair pooling: each segment of `[CLS] a [SEP] b [SEP]` mean-pooled on its own (u from a, v from b,
    told apart by the segment ids), then [u, v, |u - v|, u * v], the features of InferSent and Sentence-BERT.

    A linear head on one pooled vector can only add features up; whether two halves agree is a product of
    them, which the encoder must otherwise learn to compute from the task's few thousand pairs. A single
    sentence (no segment b) gives v = u, so the single-sentence tasks get [u, u, 0, u * u]."""
    real = attention_mask.to(hidden.dtype)  # (batch, seq)
    second = real if token_type_ids is None else real * (token_type_ids == 1).to(hidden.dtype)
    first = real - second
    u = _masked_mean(hidden, first)  # (batch, hidden)
    has_b = second.sum(1, keepdim=True) > 0  # (batch, 1)
    v = torch.where(has_b, _masked_mean(hidden, second), u)  # (batch, hidden)
    return torch.cat([u, v, (u - v).abs(), u * v], dim=-1)  # (batch, 4 * hidden)


def _masked_mean(hidden: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    return (hidden * weights[..., None]).sum(1) / weights.sum(1, keepdim=True).clamp(min=1.0)


POOLERS = {"zero_index": first_token, "mean": mean_of_tokens, "pair": segment_pair}
# how many hidden-size vectors each pooler puts side by side
POOLED_WIDTH = {"zero_index": 1, "mean": 1, "pair": 4}
NONLINEARITIES = {"tanh": nn.Tanh, "gelu": nn.GELU, "relu": nn.ReLU, "identity": nn.Identity}


@dataclass
class HeadConfig:
    """`eval.head`: the classifier on the encoder. Default: cramming's GLUE head."""

    # how the hidden states become one vector: zero_index (the [CLS] token) | mean (of the real tokens) |
    # pair (each segment mean-pooled, then [u, v, |u - v|, u * v]: the two halves of a pair compared)
    pooler: str = "zero_index"
    # width of the dense layer between pooling and classifier (cramming: 1024); 0: the bare linear head
    dim: int = 1024
    # after the dense layer: tanh (cramming, BERT's pooler) | gelu | relu | identity
    nonlin: str = "tanh"
    # normal(init_std) weights and zero biases, as the rest of the model
    init_std: float = 0.02

    def check(self) -> None:
        check_choice("eval.head.pooler", self.pooler, POOLERS)
        check_choice("eval.head.nonlin", self.nonlin, NONLINEARITIES)
        if self.dim < 0:
            raise config_error("eval.head.dim", self.dim, "use a width, or 0 for the bare linear head")
        if self.init_std <= 0:
            raise config_error("eval.head.init_std", self.init_std, "use a positive standard deviation")


class SequenceClassifier(nn.Module):
    """encoder -> pool -> [Linear(hidden, head.dim) -> nonlinearity] -> Dropout -> Linear(num_labels).

    The default is cramming's GLUE head (zero_index, 1024 wide, Tanh); eval.head.dim=0 is the bare linear
    head on the pooled vector. The head is initialized like the model: normal(init_std), zero biases."""

    def __init__(
        self, encoder: nn.Module, hidden_size: int, num_labels: int, dropout: float, head: HeadConfig
    ):
        super().__init__()
        self.encoder = encoder
        self.pool = POOLERS[head.pooler]
        pooled_size = POOLED_WIDTH[head.pooler] * hidden_size
        self.dense = nn.Linear(pooled_size, head.dim) if head.dim else None
        self.nonlinearity = NONLINEARITIES[head.nonlin]()
        self.dropout = nn.Dropout(dropout)
        self.head = nn.Linear(head.dim or pooled_size, num_labels)
        for linear in (self.dense, self.head):
            if linear is not None:
                nn.init.normal_(linear.weight, std=head.init_std)
                nn.init.zeros_(linear.bias)

    def forward(self, input_ids, attention_mask, token_type_ids=None) -> torch.Tensor:
        hidden = self.encoder(input_ids, attention_mask, token_type_ids)  # (batch, seq, hidden)
        pooled = self.pool(hidden, attention_mask, token_type_ids)  # (batch, width x hidden)
        if self.dense is not None:
            pooled = self.nonlinearity(self.dense(pooled))  # (batch, head.dim)
        return self.head(self.dropout(pooled))  # (batch, num_labels)
