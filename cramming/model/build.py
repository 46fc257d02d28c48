"""Build a model with the kernel backends that can run on its device."""

from __future__ import annotations

import torch

from cramming.model.bert import BertForMLM
from cramming.model.config import ArchConfig
from cramming.model.ops import resolve_kernels


def build_model(
    arch: ArchConfig,
    vocab_size: int,
    *,
    device: torch.device | str = "cpu",
    attention: str = "sdpa",
    layernorm: str = "torch",
    ffn_activation: str = "torch",
    loss: str = "torch",
    strict_kernels: bool = False,
    dropout: float | None = None,
) -> BertForMLM:
    """A freshly initialized model on `device`, with the kernel backends that can run there."""
    device = torch.device(device)
    requested = dict(attention=attention, layernorm=layernorm, ffn_activation=ffn_activation, loss=loss)
    model = BertForMLM(
        arch, vocab_size, dropout=dropout, **resolve_kernels(requested, device, strict_kernels)
    )
    return model.to(device)
