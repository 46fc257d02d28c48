"""Train a BERT-style tokenizer from scratch with the `tokenizers` library (WordPiece, BPE or Unigram).

NormalizerConfig and TokenizerConfig, the `data.normalizer` and `data.tokenizer` schemas, live here beside
the code they configure; TokenizerConfig accepts the kinds TOKENIZER_KINDS registers.
"""

from __future__ import annotations

import json
import string
import unicodedata
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers

from cramming.errors import ConfigError, check_choice, config_error

# Trainers place special tokens first, in this order, so their ids are fixed for every tokenizer kind.
SPECIAL_TOKENS = ("[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]")


@dataclass(frozen=True)
class SpecialTokens:
    pad: int = 0
    unk: int = 1
    cls: int = 2
    sep: int = 3
    mask: int = 4

    @property
    def all(self) -> tuple[int, ...]:
        return (self.pad, self.unk, self.cls, self.sep, self.mask)


UNK = SPECIAL_TOKENS[SpecialTokens().unk]
# longer words become [UNK] (BERT's limit)
MAX_WORD_CHARS = 100

# Every run of characters outside 7-bit ASCII, deleted by `ascii_only` (cramming's `force_english_keyboard`).
NON_ASCII = r"[^\x00-\x7F]+"


@dataclass
class NormalizerConfig:
    """Unicode and case normalization, applied to the corpus and saved into the tokenizer."""

    # Unicode NFKC: compatibility characters to their plain form (ligatures, full-width letters)
    nfkc: bool = True
    lowercase: bool = True  # lowercase everything (an uncased model)
    # drop accents (é -> e): decompose, remove the combining marks, recompose
    strip_accents: bool = True
    # delete every character outside 7-bit ASCII, after the steps above (cramming's `force_english_keyboard`).
    # Without it the WordPiece trainer keeps every character of the corpus in the vocabulary: one Wikipedia
    # shard gives ~1,600 single-character entries at 32768 (results/tokenizer/). Off keeps other scripts.
    ascii_only: bool = True


@dataclass
class TokenizerConfig:
    """A tokenizer trained from scratch on the corpus with the `tokenizers` library."""

    kind: str = "wordpiece"  # a key of TOKENIZER_KINDS (below): wordpiece, bpe (byte-level) or unigram
    # entries of the vocabulary, special tokens included
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


def build_normalizer(cfg: NormalizerConfig) -> normalizers.Normalizer:
    """The corpus normalization, also saved into the tokenizer so fine-tuning text is treated alike.

    Idempotent, so text normalized once by the pipeline can be tokenized without a second pass.
    """
    steps: list[normalizers.Normalizer] = []
    if cfg.nfkc:
        steps.append(normalizers.NFKC())
    if cfg.lowercase:
        steps.append(normalizers.Lowercase())
    if cfg.strip_accents:
        # decompose, drop the combining marks, recompose what is left
        steps += [normalizers.NFD(), normalizers.StripAccents(), normalizers.NFC()]
    if cfg.ascii_only:
        # last, so "café" has become "cafe" (with strip_accents) before anything is deleted
        steps.append(normalizers.Replace(Regex(NON_ASCII), ""))
    return normalizers.Sequence(steps)


def _alphabet_limit(cfg: TokenizerConfig) -> dict[str, int]:
    # the trainers take no None: leaving the argument out is "no limit"
    return {} if cfg.limit_alphabet is None else {"limit_alphabet": cfg.limit_alphabet}


def _wordpiece(cfg: TokenizerConfig) -> tuple[Tokenizer, trainers.Trainer]:
    tok = Tokenizer(models.WordPiece(unk_token=UNK, max_input_chars_per_word=MAX_WORD_CHARS))
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tok.decoder = decoders.WordPiece(prefix="##")
    trainer = trainers.WordPieceTrainer(
        vocab_size=cfg.vocab_size,
        min_frequency=cfg.min_frequency,
        **_alphabet_limit(cfg),
        special_tokens=list(SPECIAL_TOKENS),
        show_progress=True,
    )
    return tok, trainer


def word_inner_characters(batches: Iterable[list[str]]) -> list[str]:
    """The characters of the texts that can stand inside a word after BERT's pre-tokenization (all but
    whitespace and punctuation, which it splits off), sorted: what train_tokenizer's `inner_chars` takes."""
    seen: set[str] = set()
    for batch in batches:
        for text in batch:
            seen.update(text)
    return sorted(c for c in seen if not c.isspace() and not _bert_punctuation(c))


def _bert_punctuation(char: str) -> bool:
    """BertPreTokenizer's punctuation, each character a word of its own: ASCII's and Unicode's P* classes."""
    return char in string.punctuation or unicodedata.category(char).startswith("P")


def _renumber_wordpiece(tok: Tokenizer, seeded: set[str]) -> Tokenizer:
    """Give a trained WordPiece vocabulary the same ids every time: the special tokens first, then the rest
    sorted. The trainer numbers tokens of equal count in hash-map order, which changes from one training to
    the next (same texts, same vocabulary, some ids swapped). WordPiece splits a word by the longest match
    in the vocabulary set, so the ids can be renumbered without changing any segmentation. The `##c`
    pieces seeded as special tokens (train_tokenizer) become plain vocabulary; one whose character the
    alphabet left out (data.tokenizer.limit_alphabet) never took part in training and is dropped."""
    vocab = tok.get_vocab(with_added_tokens=False)
    unused = {piece for piece in seeded if piece[2:] not in vocab}
    rest = sorted(token for token in vocab if token not in SPECIAL_TOKENS and token not in unused)
    ordered = {token: i for i, token in enumerate([*SPECIAL_TOKENS, *rest])}
    renumbered = Tokenizer(models.WordPiece(ordered, unk_token=UNK, max_input_chars_per_word=MAX_WORD_CHARS))
    renumbered.pre_tokenizer = tok.pre_tokenizer
    renumbered.decoder = tok.decoder
    renumbered.add_special_tokens(list(SPECIAL_TOKENS))
    return renumbered


def _byte_level_bpe(cfg: TokenizerConfig) -> tuple[Tokenizer, trainers.Trainer]:
    # byte-level: every string is representable, so [UNK] never occurs
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=cfg.vocab_size,
        min_frequency=cfg.min_frequency,
        **_alphabet_limit(cfg),
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=True,
    )
    return tok, trainer


def _unigram(cfg: TokenizerConfig) -> tuple[Tokenizer, trainers.Trainer]:
    # the Unigram trainer has neither a minimum frequency nor an alphabet limit
    tok = Tokenizer(models.Unigram())
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.decoder = decoders.Metaspace()
    trainer = trainers.UnigramTrainer(
        vocab_size=cfg.vocab_size, special_tokens=list(SPECIAL_TOKENS), unk_token=UNK, show_progress=True
    )
    return tok, trainer


# data.tokenizer.kind -> an untrained tokenizer (model, pre-tokenizer, decoder) and its trainer
TOKENIZER_KINDS: dict[str, Callable[[TokenizerConfig], tuple[Tokenizer, trainers.Trainer]]] = {
    "wordpiece": _wordpiece,
    "bpe": _byte_level_bpe,
    "unigram": _unigram,
}


def train_tokenizer(
    texts: Iterable[list[str]],
    cfg: TokenizerConfig,
    normalizer_cfg: NormalizerConfig,
    length: int | None = None,
    inner_chars: Sequence[str] = (),
) -> Tokenizer:
    """Train on batches of already-normalized texts; the returned tokenizer normalizes raw text itself.

    Inputs are encoded as `[CLS] a [SEP]` or `[CLS] a [SEP] b [SEP]` (token types 0 and 1), the BERT layout
    fine-tuning expects; pretraining rows are encoded without special tokens and joined with [SEP].

    inner_chars (WordPiece): word_inner_characters of the same texts, for the same vocabulary every time.
    The trainer numbers each `##c` piece when it first meets it, in a hash map's order that changes from one
    training to the next, and breaks ties between merges of equal count by those numbers; where counts tie
    (a corpus whose vocabulary stops at min_frequency before vocab_size, as a small one) the same texts then
    give other merges. Seeded first, as special tokens, the pieces are numbered in this order instead.
    """
    tok, trainer = TOKENIZER_KINDS[cfg.kind](cfg)
    seeded = [f"##{c}" for c in inner_chars] if cfg.kind == "wordpiece" else []
    if seeded:
        trainer.special_tokens = [*SPECIAL_TOKENS, *seeded]
    tok.train_from_iterator(texts, trainer=trainer, length=length)
    if cfg.kind == "wordpiece":
        tok = _renumber_wordpiece(tok, set(seeded))
    tok.normalizer = build_normalizer(normalizer_cfg)
    special = SpecialTokens()
    for i, token in enumerate(SPECIAL_TOKENS):
        if tok.token_to_id(token) != special.all[i]:
            raise RuntimeError(f"tokenizer trainer put {token} at id {tok.token_to_id(token)}, expected {i}")
    cls, sep = SPECIAL_TOKENS[special.cls], SPECIAL_TOKENS[special.sep]
    tok.post_processor = processors.TemplateProcessing(
        single=f"{cls} $A {sep}",
        pair=f"{cls} $A {sep} $B:1 {sep}:1",
        special_tokens=[(cls, special.cls), (sep, special.sep)],
    )
    return tok


def word_continuations(tokenizer: Tokenizer) -> list[int]:
    """The ids of the tokens that continue the word before them: WordPiece's pieces with its continuing prefix
    (`##`). Other kinds mark words otherwise (byte-level BPE, Unigram: the start of a word), and are refused."""
    model = json.loads(tokenizer.to_str())["model"]
    if model.get("type") != "WordPiece":
        raise ConfigError(
            f"whole-word masking reads word pieces from a WordPiece tokenizer; this one is {model.get('type')}:"
            " use data.tokenizer.kind=wordpiece, or train.mlm.whole_words=false"
        )
    prefix = model.get("continuing_subword_prefix") or "##"
    return sorted(i for token, i in tokenizer.get_vocab().items() if token.startswith(prefix))
