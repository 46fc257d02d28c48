"""The GLUE classifier on a pretrained encoder: pooling, an optional dense layer, the class logits."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

if TYPE_CHECKING:
    from cramming.eval.config import HeadConfig


def first_token(hidden: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    """zero_index pooling: the final hidden state of [CLS]."""
    return hidden[:, 0]  # (batch, hidden)


def mean_of_tokens(hidden: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    """mean pooling over the real (unpadded) tokens."""
    weights = attention_mask.to(hidden.dtype)[..., None]  # (batch, seq, 1)
    return (hidden * weights).sum(1) / weights.sum(1).clamp(min=1.0)  # (batch, hidden)


POOLERS = {"zero_index": first_token, "mean": mean_of_tokens}
NONLINEARITIES = {"tanh": nn.Tanh, "gelu": nn.GELU, "relu": nn.ReLU, "identity": nn.Identity}


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
        self.dense = nn.Linear(hidden_size, head.dim) if head.dim else None
        self.nonlinearity = NONLINEARITIES[head.nonlin]()
        self.dropout = nn.Dropout(dropout)
        self.head = nn.Linear(head.dim or hidden_size, num_labels)
        for linear in (self.dense, self.head):
            if linear is not None:
                nn.init.normal_(linear.weight, std=head.init_std)
                nn.init.zeros_(linear.bias)

    def forward(self, input_ids, attention_mask, token_type_ids=None) -> torch.Tensor:
        hidden = self.encoder(input_ids, attention_mask, token_type_ids)  # (batch, seq, hidden)
        pooled = self.pool(hidden, attention_mask)  # (batch, hidden)
        if self.dense is not None:
            pooled = self.nonlinearity(self.dense(pooled))  # (batch, head.dim)
        return self.head(self.dropout(pooled))  # (batch, num_labels)
