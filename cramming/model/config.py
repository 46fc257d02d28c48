"""Typed configuration of the `arch` group: the model's shape and architectural choices."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class ArchConfig:
    name: str = "crammed-bert"
    num_layers: int = 16
    hidden_size: int = 768
    num_heads: int = 12
