"""Typed configuration of the `data` group: where raw text comes from and how it becomes training rows.

Everything here changes *what* the model sees, so all of it (except `name`) feeds the hash that names the
processed-data cache. Speed-only knobs (worker processes) live in `impl`. The names a choice accepts are
the keys of the registries beside the code that implements them (SOURCE_KINDS, TOKENIZER_KINDS, ORDERINGS).
The parts that configure one module are defined in it, beside its registry (SourceConfig in sources.py,
NormalizerConfig and TokenizerConfig in tokenizer.py), so imports run one way: from here to them, never back.
They are importable from here too.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from cramming.data.ordering import ORDERINGS, ROW_STARTS, SEGMENTS
from cramming.data.sources import SourceConfig
from cramming.data.tokenizer import NormalizerConfig, TokenizerConfig
from cramming.errors import check_choice, config_error

__all__ = ["DataConfig", "FilterConfig", "NormalizerConfig", "SourceConfig", "TokenizerConfig"]


@dataclass
class FilterConfig:
    """Drop texts that are too short or that tokenize badly (the cramming "trash" filter)."""

    # texts shorter than this many characters (after normalization) are dropped
    min_chars: int = 64
    # texts whose tokens-per-character ratio is above this multiple of the corpus median are dropped
    # (tables, code, other scripts); null disables the filter. Relative to the median because the ratio
    # itself depends on the vocabulary size: English Wikipedia has a median of 0.21 with 32768 tokens,
    # 0.26 with 8192. 1.5x drops about 1% of Wikipedia articles at 32768.
    max_tokens_per_char_vs_median: float | None = 1.5
    # drop exact duplicates of normalized texts (first occurrence kept)
    deduplicate: bool = True

    def __post_init__(self) -> None:
        if self.min_chars < 0:
            raise config_error("data.filter.min_chars", self.min_chars, "use 0 or a positive count")
        if self.max_tokens_per_char_vs_median is not None and self.max_tokens_per_char_vs_median < 1:
            raise config_error(
                "data.filter.max_tokens_per_char_vs_median",
                self.max_tokens_per_char_vs_median,
                "use a multiple of the median of at least 1 (1.5 drops about 1% of Wikipedia), or null to keep all",
            )


@dataclass
class DataConfig:
    """The `data` group: sources, cleaning, tokenizer and packing into fixed-length rows."""

    # a short label, used in the cache folder name (not hashed)
    name: str = "custom"
    sources: dict[str, SourceConfig] = field(default_factory=dict)
    normalizer: NormalizerConfig = field(default_factory=NormalizerConfig)
    filter: FilterConfig = field(default_factory=FilterConfig)
    tokenizer: TokenizerConfig = field(default_factory=TokenizerConfig)
    # tokens per training row; documents are joined with [SEP] and cut, no padding
    seq_length: int = 128
    # how each row begins (a key of ordering.ROW_STARTS): none (anywhere in the [SEP]-joined stream, cramming)
    # or cls ([CLS], then seq_length - 1 tokens of the stream, as every fine-tuning input begins with [CLS])
    row_start: str = "none"
    # where [SEP] goes inside a document (a key of ordering.SEGMENTS): none (only after each document,
    # cramming), line (after each line of the source: Wikipedia's paragraphs) or sentence (after each sentence,
    # as BLiMP's sentences are scored: [CLS] sentence [SEP])
    segments: str = "none"
    # order of the packed rows (a key of ordering.ORDERINGS): none (as read), random, or curriculum
    # (easy to hard: rows of frequent tokens first)
    ordering: str = "random"
    # fraction of documents held out (before packing) for a validation split; 0 disables it
    validation_fraction: float = 0.005
    # cap on output training rows after ordering (None: all)
    max_rows: int | None = None
    # seed for the held-out split and the random ordering
    seed: int = 0

    def __post_init__(self) -> None:
        if not self.sources:
            raise config_error(
                "data.sources",
                "{}",
                "name at least one source, or pick a ready one: data=embedded, data=local, data=wikibooks",
            )
        for name, source in self.sources.items():
            source.check(f"data.sources.{name}")
        check_choice("data.ordering", self.ordering, ORDERINGS)
        check_choice("data.row_start", self.row_start, ROW_STARTS)
        check_choice("data.segments", self.segments, SEGMENTS)
        if self.seq_length < 8:
            raise config_error(
                "data.seq_length", self.seq_length, "use at least 8 tokens (cramming uses 128)"
            )
        if not 0.0 <= self.validation_fraction < 0.5:
            raise config_error(
                "data.validation_fraction", self.validation_fraction, "use a fraction in [0, 0.5)"
            )
        if self.max_rows is not None and self.max_rows < 1:
            raise config_error("data.max_rows", self.max_rows, "use a positive count or null")
