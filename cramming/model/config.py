"""Typed configuration of the `arch` group: the model's shape and architectural choices, checked.

The fields are cramming.model.bert.Arch's, documented there: bert.py imports torch alone, so that an exported
model can carry it, and the checks below name config keys (cramming.errors). The vocabulary size is not here:
it comes from the data (the tokenizer trained on the corpus).
"""

from __future__ import annotations

from dataclasses import dataclass

from cramming.errors import check_choice, config_error
from cramming.model.bert import CHOICES, Arch


@dataclass
class ArchConfig(Arch):
    """bert.Arch, checked when it is made (by Hydra from conf/arch/*.yaml, or from a checkpoint's config)."""

    def __post_init__(self) -> None:
        for key, allowed in CHOICES.items():
            check_choice(f"arch.{key}", getattr(self, key), allowed)
        for key in ("num_layers", "hidden_size", "num_heads", "intermediate_size", "max_seq_length"):
            if getattr(self, key) < 1:
                raise config_error(f"arch.{key}", getattr(self, key), "use a positive integer")
        if self.hidden_size % self.num_heads:
            raise config_error(
                "arch.num_heads", self.num_heads, f"must divide arch.hidden_size={self.hidden_size} evenly"
            )
        if self.ffn == "glu" and self.intermediate_size % 2:
            raise config_error(
                "arch.intermediate_size",
                self.intermediate_size,
                "a gated FFN (arch.ffn=glu) needs an even width",
            )
        if self.alibi_slopes is not None and (
            len(self.alibi_slopes) != self.num_heads or any(s < 0 for s in self.alibi_slopes)
        ):
            raise config_error(
                "arch.alibi_slopes", self.alibi_slopes,
                f"give one non-negative slope per head ({self.num_heads}), or null for 1, 1/4, 1/16, ...",
            )  # fmt: skip
        if self.type_vocab_size < 0:
            raise config_error("arch.type_vocab_size", self.type_vocab_size, "use 0 (no token types) or more")
        if not 0.0 <= self.dropout < 1.0:
            raise config_error("arch.dropout", self.dropout, "use a probability in [0, 1)")
        if self.norm_eps <= 0 or self.init_std <= 0:
            raise config_error(
                "arch.norm_eps/init_std", (self.norm_eps, self.init_std), "use positive values"
            )
