"""Typed configuration of the `data` group: where raw text comes from and how it becomes training rows.

Everything here changes *what* the model sees, so all of it (except `name`) feeds the hash that names the
processed-data cache. Speed-only knobs (worker processes) live in `impl`. The names a choice accepts are
the keys of the registries beside the code that implements them (SOURCE_KINDS, TOKENIZER_KINDS, ORDERINGS).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from cramming.data.pipeline import ORDERINGS, ROW_STARTS
from cramming.data.sources import SOURCE_KINDS, TXT_UNITS
from cramming.data.tokenizer import TOKENIZER_KINDS
from cramming.errors import check_choice, config_error


@dataclass
class SourceConfig:
    """One raw-text source. Several sources are concatenated in the order of their names."""

    kind: str = "local"  # a key of sources.SOURCE_KINDS: hub, local or embedded
    # hub: dataset path on the Hugging Face hub, e.g. "wikimedia/wikipedia"
    path: str | None = None
    # hub: subset / configuration name, e.g. "20231101.en"
    subset: str | None = None
    split: str = "train"
    # hub: stream instead of downloading the whole corpus (needs max_entries to stay bounded)
    streaming: bool = False
    # hub: a commit, tag or branch to pin the data version (results depend on it)
    revision: str | None = None
    # local: a folder or a glob of .txt, .jsonl, .jsonl.gz, .json or .parquet files
    files: str | None = None
    # name of the column / JSON field that holds the text
    text_field: str = "text"
    # .txt files: one entry per line, per blank-line separated paragraph, or per file
    txt_unit: str = "paragraph"
    # cap on raw entries taken from this source (None: all)
    max_entries: int | None = None
    # join every n consecutive entries into one document (sentence-per-row corpora such as BookCorpus)
    join_entries: int = 1

    def check(self, key: str) -> None:
        """Validate; `key` is where this source sits in the config, e.g. data.sources.local."""
        check_choice(f"{key}.kind", self.kind, SOURCE_KINDS)
        check_choice(f"{key}.txt_unit", self.txt_unit, TXT_UNITS)
        if self.kind == "hub" and not self.path:
            raise config_error(
                f"{key}.path", self.path, "a hub source needs `path`, e.g. wikimedia/wikipedia"
            )
        if self.kind == "local" and not self.files:
            raise config_error(
                f"{key}.files",
                self.files,
                f"a local source needs a folder or glob of files, e.g. {key}.files='/data/*.jsonl.gz'",
            )
        if self.max_entries is not None and self.max_entries < 1:
            raise config_error(f"{key}.max_entries", self.max_entries, "use a positive count or null")
        if self.join_entries < 1:
            raise config_error(f"{key}.join_entries", self.join_entries, "use 1 (no joining) or more")


@dataclass
class NormalizerConfig:
    """Unicode and case normalization, applied to the corpus and saved into the tokenizer."""

    nfkc: bool = True
    lowercase: bool = True
    strip_accents: bool = True
    # delete every character outside 7-bit ASCII, after the steps above (cramming's `force_english_keyboard`).
    # Without it the WordPiece trainer keeps every character of the corpus in the vocabulary: one Wikipedia
    # shard gives ~1,600 single-character entries at 32768 (results/tokenizer.md). Off keeps other scripts.
    ascii_only: bool = True


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
class TokenizerConfig:
    """A tokenizer trained from scratch on the corpus with the `tokenizers` library."""

    kind: str = "wordpiece"  # a key of tokenizer.TOKENIZER_KINDS: wordpiece, bpe (byte-level) or unigram
    vocab_size: int = 32768
    # pairs seen fewer times than this are not merged into a vocabulary entry (wordpiece, bpe; the unigram
    # trainer has no such setting)
    min_frequency: int = 2
    # keep at most this many distinct characters, the most frequent (BERT: ~1000; null: all). wordpiece and
    # bpe; byte-level BPE has 256 symbols whatever the text, so it needs at least 256; the unigram trainer has
    # no such setting (ascii_only bounds its alphabet).
    limit_alphabet: int | None = 1000
    # train on at most this many texts, drawn at random from all sources in proportion to their document
    # counts (None: all of them)
    max_train_entries: int | None = None

    def __post_init__(self) -> None:
        check_choice("data.tokenizer.kind", self.kind, TOKENIZER_KINDS)
        if self.min_frequency < 1:
            raise config_error("data.tokenizer.min_frequency", self.min_frequency, "use 1 (keep all) or more")
        if self.limit_alphabet is not None:
            least = 256 if self.kind == "bpe" else 1
            if self.limit_alphabet < least:
                raise config_error(
                    "data.tokenizer.limit_alphabet",
                    self.limit_alphabet,
                    f"use at least {least} for {self.kind}, or null for no limit",
                )
        if self.max_train_entries is not None and self.max_train_entries < 1:
            raise config_error(
                "data.tokenizer.max_train_entries", self.max_train_entries, "use a positive count or null"
            )
        if self.vocab_size < 64:
            raise config_error(
                "data.tokenizer.vocab_size", self.vocab_size, "use at least 64 (cramming uses 32768)"
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
    # how each row begins (a key of pipeline.ROW_STARTS): none (anywhere in the [SEP]-joined stream, cramming)
    # or cls ([CLS], then seq_length - 1 tokens of the stream, as every fine-tuning input begins with [CLS])
    row_start: str = "none"
    # order of the packed rows (a key of pipeline.ORDERINGS): none (as read), random, or curriculum
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
