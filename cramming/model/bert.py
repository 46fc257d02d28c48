"""The crammed BERT (Geiping & Goldstein, arXiv 2212.14034), and the original BERT shape, from one config.

Read top to bottom: embeddings -> blocks (attention + feed-forward, pre- or post-LayerNorm) -> final norm
-> masked-language-model head. Every choice is a field of ArchConfig; attention and LayerNorm go through
the backends of cramming.model.ops, and so do the gated activation and the loss.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from cramming.model.config import ArchConfig
from cramming.model.ops import ATTENTION, FFN_ACTIVATION, LAYERNORM, LOSS

IGNORE_INDEX = -100  # label of positions that are not predicted


class LayerNorm(nn.Module):
    """LayerNorm over the last dimension, computed by a selectable backend."""

    def __init__(self, size: int, eps: float, backend: str = "torch", bias: bool = True):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.bias = nn.Parameter(torch.zeros(size)) if bias else None
        self.eps = eps
        self.fn = LAYERNORM[backend]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fn(x, self.weight, self.bias, self.eps)


class ScaledSinusoidal(nn.Module):
    """Fixed sinusoidal positions (Vaswani et al.) times one learned scale, initialized to 1/sqrt(hidden)."""

    def __init__(self, hidden_size: int, max_seq_length: int):
        super().__init__()
        position = torch.arange(max_seq_length, dtype=torch.float32)[:, None]  # (seq, 1)
        frequency = torch.exp(
            torch.arange(0, hidden_size, 2, dtype=torch.float32) * (-math.log(10000.0) / hidden_size)
        )
        table = torch.zeros(max_seq_length, hidden_size)
        table[:, 0::2] = torch.sin(position * frequency)
        table[:, 1::2] = torch.cos(position * frequency[: hidden_size // 2])
        self.register_buffer("table", table, persistent=False)  # rebuilt, never saved
        self.scale = nn.Parameter(torch.tensor(1.0 / math.sqrt(hidden_size)))

    def forward(self, seq_length: int) -> torch.Tensor:
        return self.table[:seq_length] * self.scale  # (seq, hidden)


class LearnedPositions(nn.Module):
    def __init__(self, hidden_size: int, max_seq_length: int):
        super().__init__()
        self.table = nn.Embedding(max_seq_length, hidden_size)

    def forward(self, seq_length: int) -> torch.Tensor:
        return self.table.weight[:seq_length]  # (seq, hidden)


POSITIONS = {"scaled-sinusoidal": ScaledSinusoidal, "learned": LearnedPositions}


class Embeddings(nn.Module):
    """word + position (+ token type) embeddings, then an optional LayerNorm and dropout."""

    def __init__(self, arch: ArchConfig, vocab_size: int, dropout: float, layernorm: str):
        super().__init__()
        self.word = nn.Embedding(vocab_size, arch.hidden_size, padding_idx=arch.padding_idx)
        self.position = POSITIONS[arch.position_embedding](arch.hidden_size, arch.max_seq_length)
        self.token_type = (
            nn.Embedding(arch.type_vocab_size, arch.hidden_size) if arch.type_vocab_size else None
        )
        self.norm = (
            LayerNorm(arch.hidden_size, arch.norm_eps, layernorm, arch.norm_bias)
            if arch.embedding_norm
            else nn.Identity()
        )
        self.dropout = nn.Dropout(dropout)

    def forward(self, input_ids: torch.Tensor, token_type_ids: torch.Tensor | None = None) -> torch.Tensor:
        x = self.word(input_ids) + self.position(input_ids.shape[1])  # (batch, seq, hidden)
        if self.token_type is not None:
            x = x + self.token_type(
                token_type_ids if token_type_ids is not None else torch.zeros_like(input_ids)
            )
        return self.dropout(self.norm(x))


class SelfAttention(nn.Module):
    def __init__(self, arch: ArchConfig, dropout: float, attention: str):
        super().__init__()
        self.num_heads = arch.num_heads
        self.qkv = nn.Linear(arch.hidden_size, 3 * arch.hidden_size, bias=arch.bias)
        self.out = nn.Linear(arch.hidden_size, arch.hidden_size, bias=arch.bias)
        self.dropout_p = dropout
        self.fn = ATTENTION[attention]
        # ALiBi: every backend takes the slopes and adds -slope_h * |i - j| to head h's scores (the PyTorch
        # ones as a dense `ops.alibi_bias`, the Triton kernel in registers)
        slopes = torch.tensor(arch.head_slopes()) if arch.attention_bias == "alibi" else None
        self.register_buffer("slopes", slopes, persistent=False)  # (heads,) fp32 or None; from the arch

    def forward(self, x: torch.Tensor, key_padding_mask: torch.Tensor | None) -> torch.Tensor:
        batch, seq, hidden = x.shape
        qkv = self.qkv(x).view(batch, seq, 3, self.num_heads, hidden // self.num_heads)
        q, k, v = qkv.permute(2, 0, 3, 1, 4).unbind(0)  # each (batch, heads, seq, head_dim)
        dropout = self.dropout_p if self.training else 0.0
        y = self.fn(q, k, v, key_padding_mask, dropout, self.slopes)
        return self.out(y.transpose(1, 2).reshape(batch, seq, hidden))  # (batch, seq, hidden)


class FeedForward(nn.Module):
    """up-projection -> GELU (or gate x GELU(value) when gated, by the `ffn_activation` backend) ->
    down-projection."""

    def __init__(self, arch: ArchConfig, ffn_activation: str = "torch"):
        super().__init__()
        self.gated = arch.ffn == "glu"
        self.gated_activation = FFN_ACTIVATION[ffn_activation]
        inner = arch.intermediate_size // 2 if self.gated else arch.intermediate_size
        self.up = nn.Linear(arch.hidden_size, arch.intermediate_size, bias=arch.bias)
        self.down = nn.Linear(inner, arch.hidden_size, bias=arch.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.up(x)  # (batch, seq, intermediate)
        # gated: (batch, seq, intermediate / 2)
        h = self.gated_activation(h) if self.gated else F.gelu(h)
        return self.down(h)  # (batch, seq, hidden)


class Block(nn.Module):
    """pre-LN: x + f(norm(x)) for f in (attention, ffn); post-LN: norm(x + f(x))."""

    def __init__(
        self, arch: ArchConfig, dropout: float, attention: str, layernorm: str, ffn_activation: str = "torch"
    ):
        super().__init__()
        self.pre_norm = arch.norm_scheme == "pre"
        self.norm1 = LayerNorm(arch.hidden_size, arch.norm_eps, layernorm, arch.norm_bias)
        self.attention = SelfAttention(arch, dropout, attention)
        self.norm2 = LayerNorm(arch.hidden_size, arch.norm_eps, layernorm, arch.norm_bias)
        self.ffn = FeedForward(arch, ffn_activation)
        self.dropout = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor, key_padding_mask: torch.Tensor | None) -> torch.Tensor:
        if self.pre_norm:
            x = x + self.dropout(self.attention(self.norm1(x), key_padding_mask))
            return x + self.dropout(self.ffn(self.norm2(x)))
        x = self.norm1(x + self.dropout(self.attention(x, key_padding_mask)))
        return self.norm2(x + self.dropout(self.ffn(x)))


class Encoder(nn.Module):
    """Token ids -> contextual hidden states (batch, seq, hidden). Fine-tuning heads build on this."""

    def __init__(
        self,
        arch: ArchConfig,
        vocab_size: int,
        dropout: float,
        attention: str,
        layernorm: str,
        ffn_activation: str = "torch",
    ):
        super().__init__()
        self.embeddings = Embeddings(arch, vocab_size, dropout, layernorm)
        self.blocks = nn.ModuleList(
            Block(arch, dropout, attention, layernorm, ffn_activation) for _ in range(arch.num_layers)
        )
        self.final_norm = (
            LayerNorm(arch.hidden_size, arch.norm_eps, layernorm, arch.norm_bias)
            if arch.final_norm
            else nn.Identity()
        )

    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        token_type_ids: torch.Tensor | None = None,
    ) -> torch.Tensor:
        # attention_mask: (batch, seq), 1/True = real token. None (pretraining rows are never padded) lets
        # the attention backends take their unmasked fast path.
        key_padding_mask = None if attention_mask is None else attention_mask.bool()
        x = self.embeddings(input_ids, token_type_ids)  # (batch, seq, hidden)
        for block in self.blocks:
            x = block(x, key_padding_mask)
        return self.final_norm(x)

    def set_dropout(self, p: float) -> None:
        """Every dropout of the encoder (hidden and attention) to `p`: pretraining runs without, fine-tuning
        with arch.dropout."""
        for module in self.modules():
            if isinstance(module, nn.Dropout):
                module.p = p
            elif isinstance(module, SelfAttention):
                module.dropout_p = p


class PredictionHead(nn.Module):
    """Optional transform (dense + GELU + LayerNorm, original BERT), then the decoder to the vocabulary."""

    def __init__(self, arch: ArchConfig, vocab_size: int, layernorm: str):
        super().__init__()
        if arch.head_transform:
            self.transform = nn.Sequential(
                nn.Linear(arch.hidden_size, arch.hidden_size, bias=arch.bias),
                nn.GELU(),
                LayerNorm(arch.hidden_size, arch.norm_eps, layernorm, arch.norm_bias),
            )
        else:
            self.transform = nn.Identity()
        # with tied embeddings the weight is set to the word-embedding matrix by BertForMLM
        self.decoder = nn.Linear(arch.hidden_size, vocab_size, bias=arch.decoder_bias)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.decoder(self.transform(hidden))  # (..., vocab)


@dataclass
class MLMOutput:
    """loss: mean cross-entropy over the predicted positions. logits (n, vocab) and labels (n,) are flattened
    over the positions the decoder ran on: only the masked ones with sparse prediction, all of them otherwise
    (labels IGNORE_INDEX where nothing is predicted)."""

    loss: torch.Tensor
    logits: torch.Tensor
    labels: torch.Tensor


class BertForMLM(nn.Module):
    """Encoder + masked-language-model head; the loss is computed inside so sparse prediction can skip
    the decoder on unmasked positions (at 25% masking, 4x less decoder work)."""

    def __init__(
        self,
        arch: ArchConfig,
        vocab_size: int,
        *,
        dropout: float | None = None,
        attention: str = "sdpa",
        layernorm: str = "torch",
        ffn_activation: str = "torch",
        loss: str = "torch",
    ):
        """dropout: None uses arch.dropout (fine-tuning); pretraining passes train.dropout.
        attention, layernorm, ffn_activation, loss: backend names, already resolved by
        cramming.model.ops.resolve_kernels."""
        super().__init__()
        self.arch = arch
        self.vocab_size = vocab_size
        dropout = arch.dropout if dropout is None else dropout
        self.encoder = Encoder(arch, vocab_size, dropout, attention, layernorm, ffn_activation)
        self.head = PredictionHead(arch, vocab_size, layernorm)
        self.loss_fn = LOSS[loss]
        self.apply(self._init_weights)
        if arch.tie_embeddings:
            self.head.decoder.weight = self.encoder.embeddings.word.weight

    def _init_weights(self, module: nn.Module) -> None:
        if isinstance(module, nn.Linear | nn.Embedding):
            nn.init.normal_(module.weight, mean=0.0, std=self.arch.init_std)
        if isinstance(module, nn.Embedding) and module.padding_idx is not None:
            nn.init.zeros_(module.weight[module.padding_idx])
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)

    def forward(
        self,
        input_ids: torch.Tensor,
        labels: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        token_type_ids: torch.Tensor | None = None,
        predicted_per_row: int | None = None,
    ) -> MLMOutput:
        """predicted_per_row: with sparse prediction, the most labelled positions a row has (count masking
        knows it in advance). Given, the decoder runs on exactly that many positions per row: a static
        shape, no host synchronization, one graph under torch.compile. None (probability masking): on the
        labelled positions whatever their number (a data-dependent shape)."""
        hidden = self.encoder(input_ids, attention_mask, token_type_ids)  # (batch, seq, hidden)
        if self.arch.sparse_prediction and predicted_per_row is not None:
            hidden, labels = select_predicted(hidden, labels, predicted_per_row)  # (batch * k, hidden)
        else:
            hidden, labels = hidden.flatten(0, 1), labels.flatten()  # (batch * seq, hidden), (batch * seq,)
            if self.arch.sparse_prediction:
                predicted = labels != IGNORE_INDEX
                hidden, labels = hidden[predicted], labels[predicted]  # (n_masked, hidden), (n_masked,)
        logits = self.head(hidden)  # (n, vocab)
        loss = self.loss_fn(logits, labels, IGNORE_INDEX)
        return MLMOutput(loss=loss, logits=logits, labels=labels)


def select_predicted(hidden: torch.Tensor, labels: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The k positions of each row that carry a label (rows with fewer fill up with unlabelled positions,
    whose IGNORE_INDEX labels the loss skips): hidden (batch, seq, hidden) -> (batch * k, hidden), labels
    (batch, seq) -> (batch * k,). topk of a 0/1 mask has a fixed output shape, unlike boolean indexing."""
    k = min(k, labels.shape[1])
    index = (labels != IGNORE_INDEX).to(torch.int8).topk(k, dim=1, sorted=False).indices  # (batch, k)
    chosen = hidden.gather(1, index[..., None].expand(-1, -1, hidden.shape[-1]))  # (batch, k, hidden)
    return chosen.flatten(0, 1), labels.gather(1, index).flatten()


def count_parameters(model: nn.Module) -> int:
    """Distinct parameters (a tied matrix counts once)."""
    return sum(p.numel() for p in model.parameters())
