"""Train a BERT-style tokenizer from scratch with the `tokenizers` library (WordPiece, BPE or Unigram)."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers

from cramming.data.config import NormalizerConfig, TokenizerConfig

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


def build_normalizer(cfg: NormalizerConfig) -> normalizers.Normalizer:
    """The corpus normalization, also saved into the tokenizer so fine-tuning text is treated alike."""
    steps: list[normalizers.Normalizer] = []
    if cfg.nfkc:
        steps.append(normalizers.NFKC())
    if cfg.lowercase:
        steps.append(normalizers.Lowercase())
    if cfg.strip_accents:
        # decompose, drop the combining marks, recompose what is left
        steps += [normalizers.NFD(), normalizers.StripAccents(), normalizers.NFC()]
    return normalizers.Sequence(steps)


def _model_and_trainer(cfg: TokenizerConfig) -> tuple[Tokenizer, trainers.Trainer]:
    special = list(SPECIAL_TOKENS)
    unk = SPECIAL_TOKENS[SpecialTokens().unk]
    if cfg.kind == "wordpiece":
        tok = Tokenizer(models.WordPiece(unk_token=unk, max_input_chars_per_word=100))
        tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
        tok.decoder = decoders.WordPiece(prefix="##")
        trainer = trainers.WordPieceTrainer(
            vocab_size=cfg.vocab_size,
            min_frequency=cfg.min_frequency,
            special_tokens=special,
            show_progress=True,
        )
    elif cfg.kind == "bpe":
        # byte-level BPE: every string is representable, so [UNK] never occurs
        tok = Tokenizer(models.BPE())
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=True)
        tok.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(
            vocab_size=cfg.vocab_size,
            min_frequency=cfg.min_frequency,
            special_tokens=special,
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
            show_progress=True,
        )
    else:  # unigram
        tok = Tokenizer(models.Unigram())
        tok.pre_tokenizer = pre_tokenizers.Metaspace()
        tok.decoder = decoders.Metaspace()
        trainer = trainers.UnigramTrainer(
            vocab_size=cfg.vocab_size, special_tokens=special, unk_token=unk, show_progress=True
        )
    return tok, trainer


def train_tokenizer(
    texts: Iterable[list[str]],
    cfg: TokenizerConfig,
    normalizer_cfg: NormalizerConfig,
    length: int | None = None,
) -> Tokenizer:
    """Train on batches of already-normalized texts; the returned tokenizer normalizes raw text itself.

    Inputs are encoded as `[CLS] a [SEP]` or `[CLS] a [SEP] b [SEP]` (token types 0 and 1), the BERT layout
    fine-tuning expects; pretraining rows are encoded without special tokens and joined with [SEP].
    """
    tok, trainer = _model_and_trainer(cfg)
    tok.train_from_iterator(texts, trainer=trainer, length=length)
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
