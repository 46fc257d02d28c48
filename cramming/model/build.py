"""Build a model with the kernels that can run on its device.

cramming/model/bert.py knows no kernel by name (it imports torch alone, so that an export can carry it): here
the names of the `impl` group become the functions of cramming.model.ops, handed to the model as its Kernels.
"""

from __future__ import annotations

import torch

from cramming.model.bert import BertForMLM, Kernels
from cramming.model.config import ArchConfig
from cramming.model.ops import ATTENTION, FFN_ACTIVATION, LAYERNORM, LOSS, resolve_kernels

REGISTRIES = {"attention": ATTENTION, "layernorm": LAYERNORM, "ffn_activation": FFN_ACTIVATION, "loss": LOSS}


def kernels_by_name(
    attention: str = "sdpa", layernorm: str = "torch", ffn_activation: str = "torch", loss: str = "torch"
) -> Kernels:
    """The kernels of these names, as they are: whether a Triton one can launch here is `build_model`'s
    question (cramming.model.ops.resolve_kernels)."""
    names = dict(attention=attention, layernorm=layernorm, ffn_activation=ffn_activation, loss=loss)
    return Kernels(**{kind: REGISTRIES[kind][name] for kind, name in names.items()})


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
    """A freshly initialized model on `device`, with the kernels that can run there."""
    device = torch.device(device)
    requested = dict(attention=attention, layernorm=layernorm, ffn_activation=ffn_activation, loss=loss)
    kernels = kernels_by_name(**resolve_kernels(requested, device, strict_kernels))
    return BertForMLM(arch, vocab_size, dropout=dropout, kernels=kernels).to(device)
