"""What GLUE fine-tuning needs of a pretrained model, wherever it came from (a cramming checkpoint, a model
in memory during pretraining, a local `transformers` folder)."""

from __future__ import annotations

from dataclasses import dataclass, field

from tokenizers import Tokenizer
from torch import nn


@dataclass
class Backbone:
    """A pretrained encoder with its tokenizer. Fine-tuning deep-copies `encoder` for each (task, seed)."""

    encoder: nn.Module  # forward(input_ids, attention_mask, token_type_ids) -> (batch, seq, hidden)
    hidden_size: int
    dropout: float  # the classifier head's dropout (the arch's fine-tuning dropout)
    tokenizer: Tokenizer  # adds [CLS] a [SEP] (b [SEP]) itself (its post-processor)
    pad_id: int
    info: dict = field(default_factory=dict)  # what the results record about where it came from
    # the most positions the encoder takes; inputs are truncated to min(eval.max_length, this)
    max_positions: int | None = None

    def input_length(self, wanted: int) -> int:
        return wanted if self.max_positions is None else min(wanted, self.max_positions)
