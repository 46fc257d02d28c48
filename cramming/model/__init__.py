"""The crammed BERT: config (`arch` group), the model, and its attention/LayerNorm backends; flops.py counts
its model FLOPs for throughput and MFU reports; checkpoint.py writes and reads a finished model."""

from __future__ import annotations

from cramming.model.bert import IGNORE_INDEX, BertForMLM, Encoder, MLMOutput, count_parameters
from cramming.model.build import build_model
from cramming.model.config import ArchConfig
from cramming.model.ops import KernelUnavailableError

__all__ = [
    "IGNORE_INDEX",
    "ArchConfig",
    "BertForMLM",
    "Encoder",
    "KernelUnavailableError",
    "MLMOutput",
    "build_model",
    "count_parameters",
]
