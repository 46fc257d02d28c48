"""The crammed BERT: config (`arch` group), the model, and its attention/LayerNorm kernels; flops.py counts
its model FLOPs for throughput and MFU reports; checkpoint.py writes and reads a finished model.

bert.py is the model and imports torch alone; modeling_crammed_bert.py wraps it for Hugging Face
`transformers` (imported by cramming.hf only), and an export carries the two files as they are.
"""

from __future__ import annotations

from cramming.model.bert import IGNORE_INDEX, BertForMLM, Encoder, Kernels, MLMOutput, count_parameters
from cramming.model.build import build_model, kernels_by_name
from cramming.model.config import ArchConfig
from cramming.model.ops import KernelUnavailableError

__all__ = [
    "IGNORE_INDEX",
    "ArchConfig",
    "BertForMLM",
    "Encoder",
    "KernelUnavailableError",
    "Kernels",
    "MLMOutput",
    "build_model",
    "count_parameters",
    "kernels_by_name",
]
