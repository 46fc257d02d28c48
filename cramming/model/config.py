"""Typed configuration of the `arch` group: the model's shape and architectural choices.

The vocabulary size is not here: it comes from the data (the tokenizer trained on the corpus).
"""

from __future__ import annotations

from dataclasses import dataclass

from cramming.errors import check_choice, config_error

FFN_KINDS = ("glu", "gelu")
NORM_SCHEMES = ("pre", "post")
POSITION_EMBEDDINGS = ("scaled-sinusoidal", "learned")
ATTENTION_BIASES = ("none", "alibi")


@dataclass
class ArchConfig:
    name: str = "crammed-bert"
    num_layers: int = 16
    hidden_size: int = 768
    num_heads: int = 12
    # width of the feed-forward up-projection; a gated FFN splits it in two halves (3072 -> gate x GELU(value)
    # of width 1536), so its down-projection reads intermediate_size / 2
    intermediate_size: int = 3072
    # glu: gated GELU (cramming); gelu: the plain two-layer FFN of the original BERT
    ffn: str = "glu"
    # pre: x + f(norm(x)) (cramming); post: norm(x + f(x)) (original BERT)
    norm_scheme: str = "pre"
    # biases of the linear layers (QKV, attention output, FFN, head transform)
    bias: bool = False
    # the LayerNorms' additive bias; `bias` above covers only the linear layers
    norm_bias: bool = True
    # scaled-sinusoidal: fixed sinusoids times one learned scale (cramming); learned: a table (original BERT)
    position_embedding: str = "scaled-sinusoidal"
    # an additive bias on the attention scores. none: cramming. alibi: -slope_h * |i - j| for head h (Press et
    # al. 2022, symmetric), a prior toward nearby tokens; it lets small models leave the unigram plateau within
    # a few hundred updates where absolute positions alone leave them there (results/cpu-study.md)
    attention_bias: str = "none"
    # one slope per head; null: 1, 1/4, 1/16, ... (the first head looks at its neighbours, later ones wider)
    alibi_slopes: list[float] | None = None
    # longest sequence the position embedding covers; data.seq_length must not exceed it
    max_seq_length: int = 128
    # token-type (segment) embeddings of the original BERT; 0 disables them
    type_vocab_size: int = 0
    # LayerNorm after the sum of the embeddings
    embedding_norm: bool = True
    # LayerNorm after the last block (needed with pre-LN, redundant with post-LN)
    final_norm: bool = True
    # dense + GELU + LayerNorm before the decoder, as in the original BERT
    head_transform: bool = False
    decoder_bias: bool = False
    # the decoder reuses the word-embedding matrix
    tie_embeddings: bool = True
    # run the decoder and the loss only on the masked positions; the loss is the same as with dense prediction
    sparse_prediction: bool = True
    norm_eps: float = 1e-12
    # dropout on hidden states and attention probabilities when fine-tuning; pretraining uses train.dropout
    dropout: float = 0.1
    # standard deviation of the normal initialization of every weight matrix and embedding
    init_std: float = 0.02
    # the [PAD] id (0 in our tokenizers): its word-embedding row starts at zero and gets no gradient, as in
    # cramming; null: an ordinary row
    padding_idx: int | None = 0

    def __post_init__(self) -> None:
        check_choice("arch.ffn", self.ffn, FFN_KINDS)
        check_choice("arch.norm_scheme", self.norm_scheme, NORM_SCHEMES)
        check_choice("arch.position_embedding", self.position_embedding, POSITION_EMBEDDINGS)
        check_choice("arch.attention_bias", self.attention_bias, ATTENTION_BIASES)
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

    @property
    def head_size(self) -> int:
        return self.hidden_size // self.num_heads

    def head_slopes(self) -> list[float]:
        """The ALiBi slope of each head (arch.alibi_slopes, or 4**-h for head h)."""
        if self.alibi_slopes is not None:
            return [float(s) for s in self.alibi_slopes]
        return [4.0**-h for h in range(self.num_heads)]
