"""The crammed BERT (Geiping & Goldstein, arXiv 2212.14034), and the original BERT shape, from one Arch.

This file imports torch and nothing else. The export to transformers (cramming/hf/export.py) copies it as it
is next to a thin wrapper (modeling_crammed_bert.py), so an exported model runs the very code that trained.

Read top to bottom: the arch -> the kernels (plain PyTorch by default) -> embeddings -> blocks (attention +
feed-forward, pre- or post-LayerNorm) -> encoder -> masked-language-model head. The kernels are handed in when
the model is built: cramming.model.build picks them by name (`impl.attention`, ...), Triton ones where they
can launch; a model built here without them computes the same with PyTorch's operations.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

IGNORE_INDEX = -100  # label of positions that are not predicted

# the values each choice of the arch can take, described at its field of Arch (cramming.model.config checks a
# run's arch against them, the transformers wrapper a config's)
CHOICES = {
    "ffn": ("glu", "gelu"),
    "norm_scheme": ("pre", "post"),
    "position_embedding": ("scaled-sinusoidal", "learned"),
    "attention_bias": ("none", "alibi"),
}


@dataclass
class Arch:
    """The model's shape and architectural choices: the `arch` group of the config (cramming.model.config's
    ArchConfig adds the checks). The vocabulary size is not here: it comes from the data."""

    # a short label of the shape (conf/arch/<name>.yaml), recorded with the checkpoint
    name: str = "crammed-bert"
    num_layers: int = 16  # transformer blocks
    hidden_size: int = 768  # width of the hidden states
    num_heads: int = 12  # attention heads; each is hidden_size / num_heads wide
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
    # an additive bias on the attention scores. none: cramming. alibi: -slope_h * |i - j| added to head h's
    # scores (Press et al. 2022, symmetric), a prior toward nearby tokens; it lets small models leave the
    # unigram plateau within a few hundred updates where absolute positions alone leave them there
    # (results/cpu-study/)
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
    # a bias on the decoder's vocabulary logits
    decoder_bias: bool = False
    # the decoder reuses the word-embedding matrix
    tie_embeddings: bool = True
    # run the decoder and the loss only on the masked positions; the loss is the same as with dense prediction
    sparse_prediction: bool = True
    # the LayerNorms' epsilon
    norm_eps: float = 1e-12
    # dropout on hidden states and attention probabilities when fine-tuning; pretraining uses train.dropout
    dropout: float = 0.1
    # standard deviation of the normal initialization of every weight matrix and embedding
    init_std: float = 0.02
    # the [PAD] id (0 in our tokenizers): its word-embedding row starts at zero and gets no gradient, as in
    # cramming; null: an ordinary row
    padding_idx: int | None = 0

    def head_slopes(self) -> list[float]:
        """The ALiBi slope of each head (arch.alibi_slopes, or 4**-h for head h)."""
        if self.alibi_slopes is not None:
            return [float(s) for s in self.alibi_slopes]
        return [4.0**-h for h in range(self.num_heads)]


# ------------------------------------------------------------------------------------------------ kernels
# attention(q, k, v, key_padding_mask, dropout_p, alibi_slopes) -> out; q, k, v, out: (batch, heads, seq,
# head_dim); key_padding_mask: (batch, seq) bool, True = a real token, or None when nothing is padded;
# alibi_slopes: None, or (heads,) fp32 slopes of the ALiBi bias -slope_h * |i - j| on the scaled scores
AttentionFn = Callable[..., torch.Tensor]
# layer_norm(x, weight, bias, eps) -> x normalized over its last dimension
LayerNormFn = Callable[[torch.Tensor, torch.Tensor, "torch.Tensor | None", float], torch.Tensor]
# gated_activation(h) -> gate * gelu(value) for h = [gate | value]: (..., 2F) -> (..., F)
GatedActivationFn = Callable[[torch.Tensor], torch.Tensor]
# loss(logits, labels, ignore_index) -> mean cross-entropy over the labelled rows, an fp32 scalar;
# logits (n, vocab) in any float dtype, labels (n,) int64
LossFn = Callable[[torch.Tensor, torch.Tensor, int], torch.Tensor]


def alibi_bias(slopes: torch.Tensor, seq: int) -> torch.Tensor:
    """ALiBi (Press et al., arXiv 2108.12409), symmetric for a bidirectional model: the (heads, seq, seq)
    fp32 bias -slope_h * |i - j| for query i and key j, on the slopes' device."""
    position = torch.arange(seq, device=slopes.device)
    distance = (position[:, None] - position[None, :]).abs().float()  # (seq, seq)
    return -slopes.float()[:, None, None] * distance


def sdpa_attention(q, k, v, key_padding_mask=None, dropout_p: float = 0.0, alibi_slopes=None):
    """PyTorch's fused scaled_dot_product_attention (flash / memory-efficient kernels where they apply).
    With ALiBi it takes the bias as a dense float mask of shape (1, heads, seq, seq): PyTorch's CPU flash
    kernel takes a 4-D mask, while a 3-D one sends it to the unfused math path. bert-tiny's whole training
    step is 1.15x faster for it in fp32 and 1.46x in bf16 (one thread; results/step-speed/cpu-tiny.md)."""
    mask = None if key_padding_mask is None else key_padding_mask[:, None, None, :]  # (batch, 1, 1, seq)
    if alibi_slopes is not None:  # one float mask: the bias, and the most negative number on padded keys
        bias = alibi_bias(alibi_slopes, q.shape[-2]).to(q.dtype)[None]  # (1, heads, seq, seq)
        mask = bias if mask is None else bias.masked_fill(~mask, torch.finfo(q.dtype).min)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout_p)


def torch_layer_norm(x, weight, bias=None, eps: float = 1e-12):
    return F.layer_norm(x, x.shape[-1:], weight, bias, eps)


def torch_gated_gelu(h):
    gate, value = h.chunk(2, dim=-1)  # each (..., F)
    return gate * F.gelu(value)


def cross_entropy(logits, labels, ignore_index: int = IGNORE_INDEX):
    """The log-sum-exp in fp32: bf16 logits lose too much in it."""
    return F.cross_entropy(logits.float(), labels, ignore_index=ignore_index)


@dataclass(frozen=True)
class Kernels:
    """The functions the model computes with. Every choice computes the same function; they differ only in
    speed and rounding (cramming.model.ops has them all, by name)."""

    attention: AttentionFn = sdpa_attention
    layernorm: LayerNormFn = torch_layer_norm
    ffn_activation: GatedActivationFn = torch_gated_gelu
    loss: LossFn = cross_entropy


PYTORCH = Kernels()  # PyTorch's operations throughout


# ------------------------------------------------------------------------------------------------ modules
class LayerNorm(nn.Module):
    """LayerNorm over the last dimension, computed by the kernel `fn`."""

    def __init__(self, size: int, eps: float, bias: bool = True, fn: LayerNormFn = torch_layer_norm):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.bias = nn.Parameter(torch.zeros(size)) if bias else None
        self.eps = eps
        self.fn = fn

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fn(x, self.weight, self.bias, self.eps)


def layer_norm(arch: Arch, kernels: Kernels) -> LayerNorm:
    """One LayerNorm of the model's width, as every norm of the model is."""
    return LayerNorm(arch.hidden_size, arch.norm_eps, arch.norm_bias, kernels.layernorm)


def sinusoid_table(max_seq_length: int, hidden_size: int) -> torch.Tensor:
    """Fixed sinusoidal positions (Vaswani et al.), in fp32: (max_seq_length, hidden)."""
    position = torch.arange(max_seq_length, dtype=torch.float32)[:, None]  # (seq, 1)
    frequency = torch.exp(
        torch.arange(0, hidden_size, 2, dtype=torch.float32) * (-math.log(10000.0) / hidden_size)
    )
    table = torch.zeros(max_seq_length, hidden_size)
    table[:, 0::2] = torch.sin(position * frequency)
    table[:, 1::2] = torch.cos(position * frequency[: hidden_size // 2])
    return table


class ScaledSinusoidal(nn.Module):
    """Fixed sinusoidal positions times one learned scale, initialized to 1/sqrt(hidden)."""

    def __init__(self, hidden_size: int, max_seq_length: int):
        super().__init__()
        table = sinusoid_table(max_seq_length, hidden_size)
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

    def __init__(self, arch: Arch, vocab_size: int, dropout: float, kernels: Kernels):
        super().__init__()
        self.word = nn.Embedding(vocab_size, arch.hidden_size, padding_idx=arch.padding_idx)
        self.position = POSITIONS[arch.position_embedding](arch.hidden_size, arch.max_seq_length)
        self.token_type = (
            nn.Embedding(arch.type_vocab_size, arch.hidden_size) if arch.type_vocab_size else None
        )
        self.norm = layer_norm(arch, kernels) if arch.embedding_norm else nn.Identity()
        self.dropout = nn.Dropout(dropout)

    def forward(self, input_ids: torch.Tensor, token_type_ids: torch.Tensor | None = None) -> torch.Tensor:
        x = self.word(input_ids) + self.position(input_ids.shape[1])  # (batch, seq, hidden)
        if self.token_type is not None:
            x = x + self.token_type(
                token_type_ids if token_type_ids is not None else torch.zeros_like(input_ids)
            )
        return self.dropout(self.norm(x))


class SelfAttention(nn.Module):
    def __init__(self, arch: Arch, dropout: float, kernels: Kernels):
        super().__init__()
        self.num_heads = arch.num_heads
        self.qkv = nn.Linear(arch.hidden_size, 3 * arch.hidden_size, bias=arch.bias)
        self.out = nn.Linear(arch.hidden_size, arch.hidden_size, bias=arch.bias)
        self.dropout_p = dropout
        self.fn = kernels.attention
        # ALiBi: every kernel takes the slopes and adds -slope_h * |i - j| to head h's scores (the PyTorch
        # ones as a dense `alibi_bias`, the Triton kernel in registers)
        slopes = torch.tensor(arch.head_slopes()) if arch.attention_bias == "alibi" else None
        self.register_buffer("slopes", slopes, persistent=False)  # (heads,) fp32 or None; from the arch

    def forward(self, x: torch.Tensor, key_padding_mask: torch.Tensor | None) -> torch.Tensor:
        batch, seq, hidden = x.shape
        qkv = self.qkv(x).view(batch, seq, 3, self.num_heads, hidden // self.num_heads)
        q, k, v = qkv.permute(2, 0, 3, 1, 4).unbind(0)  # each (batch, heads, seq, head_dim)
        dropout = self.dropout_p if self.training else 0.0
        y = self.fn(q, k, v, key_padding_mask, dropout, self.slopes)  # (batch, heads, seq, head_dim)
        return self.out(y.transpose(1, 2).reshape(batch, seq, hidden))  # (batch, seq, hidden)


class FeedForward(nn.Module):
    """up-projection -> GELU (or gate x GELU(value) when gated, by the `ffn_activation` kernel) ->
    down-projection."""

    def __init__(self, arch: Arch, kernels: Kernels):
        super().__init__()
        self.gated = arch.ffn == "glu"
        self.gated_activation = kernels.ffn_activation
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

    def __init__(self, arch: Arch, dropout: float, kernels: Kernels):
        super().__init__()
        self.pre_norm = arch.norm_scheme == "pre"
        self.norm1 = layer_norm(arch, kernels)
        self.attention = SelfAttention(arch, dropout, kernels)
        self.norm2 = layer_norm(arch, kernels)
        self.ffn = FeedForward(arch, kernels)
        self.dropout = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor, key_padding_mask: torch.Tensor | None) -> torch.Tensor:
        if self.pre_norm:
            x = x + self.dropout(self.attention(self.norm1(x), key_padding_mask))
            return x + self.dropout(self.ffn(self.norm2(x)))
        x = self.norm1(x + self.dropout(self.attention(x, key_padding_mask)))
        return self.norm2(x + self.dropout(self.ffn(x)))


class Encoder(nn.Module):
    """Token ids -> contextual hidden states (batch, seq, hidden). Fine-tuning heads build on this."""

    def __init__(self, arch: Arch, vocab_size: int, dropout: float, kernels: Kernels = PYTORCH):
        super().__init__()
        self.embeddings = Embeddings(arch, vocab_size, dropout, kernels)
        self.blocks = nn.ModuleList(Block(arch, dropout, kernels) for _ in range(arch.num_layers))
        self.final_norm = layer_norm(arch, kernels) if arch.final_norm else nn.Identity()

    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        token_type_ids: torch.Tensor | None = None,
    ) -> torch.Tensor:
        # attention_mask: (batch, seq), 1/True = real token. None (pretraining rows are never padded) lets
        # the attention kernels take their unmasked fast path.
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

    def __init__(self, arch: Arch, vocab_size: int, kernels: Kernels = PYTORCH):
        super().__init__()
        if arch.head_transform:
            self.transform = nn.Sequential(
                nn.Linear(arch.hidden_size, arch.hidden_size, bias=arch.bias),
                nn.GELU(),
                layer_norm(arch, kernels),
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
        self, arch: Arch, vocab_size: int, *, dropout: float | None = None, kernels: Kernels = PYTORCH
    ):
        """dropout: None uses arch.dropout (fine-tuning); pretraining passes train.dropout."""
        super().__init__()
        self.arch = arch
        self.vocab_size = vocab_size
        dropout = arch.dropout if dropout is None else dropout
        self.encoder = Encoder(arch, vocab_size, dropout, kernels)
        self.head = PredictionHead(arch, vocab_size, kernels)
        self.loss_fn = kernels.loss
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
