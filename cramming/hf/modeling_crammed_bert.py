"""The crammed BERT for Hugging Face `transformers`: config, encoder, masked-LM and sequence-classification models.

This one file is copied next to an exported model's weights and loaded with `trust_remote_code=True`, so it
imports only torch and transformers. It mirrors cramming/model/bert.py (every ArchConfig option of the model)
with the same module names, so a cramming state dict loads into it unchanged. `import cramming.hf` registers
these classes with the Auto* factories, so in a process with cramming no remote code is needed.

Read top to bottom: config -> embeddings -> blocks (attention + feed-forward, pre- or post-LayerNorm)
-> encoder -> masked-LM head / classifier head.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn
from transformers import PretrainedConfig, PreTrainedModel
from transformers.modeling_outputs import BaseModelOutput, MaskedLMOutput, SequenceClassifierOutput

try:  # transformers >= 5 loads weights before initializing: its init functions skip loaded tensors
    from transformers import initialization as init
except ImportError:  # 4.x initializes first, then loads
    from torch.nn import init

FFN_KINDS = ("glu", "gelu")
NORM_SCHEMES = ("pre", "post")
POSITION_EMBEDDINGS = ("scaled-sinusoidal", "learned")
ATTENTION_BIASES = ("none", "alibi")
CLASSIFIER_POOLINGS = ("zero_index",)  # the first token ([CLS]) represents the sequence


class CrammedBertConfig(PretrainedConfig):
    """The fields of cramming's ArchConfig under Hugging Face names where one exists, plus the classifier head.

    Classifier head: pooling (`zero_index`) -> [Linear(hidden, classifier_head_dim) -> Tanh, when
    classifier_head_dim is set] -> Dropout(classifier_dropout, default hidden_dropout_prob) -> Linear(num_labels).
    """

    model_type = "crammed_bert"

    def __init__(
        self,
        vocab_size: int = 32768,
        hidden_size: int = 768,
        num_hidden_layers: int = 16,
        num_attention_heads: int = 12,
        intermediate_size: int = 3072,
        ffn: str = "glu",
        norm_scheme: str = "pre",
        bias: bool = False,
        norm_bias: bool = True,
        position_embedding: str = "scaled-sinusoidal",
        max_position_embeddings: int = 128,
        attention_bias: str = "none",
        alibi_slopes: list[float] | None = None,
        type_vocab_size: int = 0,
        embedding_norm: bool = True,
        final_norm: bool = True,
        head_transform: bool = False,
        decoder_bias: bool = False,
        layer_norm_eps: float = 1e-12,
        hidden_dropout_prob: float = 0.1,
        attention_probs_dropout_prob: float = 0.1,
        initializer_range: float = 0.02,
        classifier_pooling: str = "zero_index",
        classifier_head_dim: int | None = None,
        classifier_dropout: float | None = None,
        tie_word_embeddings: bool = True,
        pad_token_id: int = 0,
        **kwargs,
    ):
        for name, value, allowed in (
            ("ffn", ffn, FFN_KINDS),
            ("norm_scheme", norm_scheme, NORM_SCHEMES),
            ("position_embedding", position_embedding, POSITION_EMBEDDINGS),
            ("attention_bias", attention_bias, ATTENTION_BIASES),
            ("classifier_pooling", classifier_pooling, CLASSIFIER_POOLINGS),
        ):
            if value not in allowed:
                raise ValueError(f"CrammedBertConfig.{name}={value!r}: this modeling file knows {allowed}")
        self.vocab_size = vocab_size
        self.hidden_size = hidden_size
        self.num_hidden_layers = num_hidden_layers
        self.num_attention_heads = num_attention_heads
        self.intermediate_size = intermediate_size
        self.ffn = ffn
        self.norm_scheme = norm_scheme
        self.bias = bias
        self.norm_bias = norm_bias
        self.position_embedding = position_embedding
        self.max_position_embeddings = max_position_embeddings
        # alibi: -slope_h * |i - j| added to head h's attention scores; slopes null: 1, 1/4, 1/16, ...
        self.attention_bias = attention_bias
        self.alibi_slopes = alibi_slopes
        self.type_vocab_size = type_vocab_size
        self.embedding_norm = embedding_norm
        self.final_norm = final_norm
        self.head_transform = head_transform
        self.decoder_bias = decoder_bias
        self.layer_norm_eps = layer_norm_eps
        self.hidden_dropout_prob = hidden_dropout_prob
        self.attention_probs_dropout_prob = attention_probs_dropout_prob
        self.initializer_range = initializer_range
        self.classifier_pooling = classifier_pooling
        self.classifier_head_dim = classifier_head_dim
        self.classifier_dropout = classifier_dropout
        # base-class keywords in transformers 4 (set there, overriding anything assigned above)
        super().__init__(tie_word_embeddings=tie_word_embeddings, pad_token_id=pad_token_id, **kwargs)


def layer_norm(config: CrammedBertConfig) -> nn.LayerNorm:
    return nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps, bias=config.norm_bias)


def sinusoid_table(max_length: int, hidden_size: int) -> torch.Tensor:
    """Fixed sinusoidal positions (Vaswani et al.), computed on the CPU in fp32 as cramming does."""
    position = torch.arange(max_length, dtype=torch.float32)[:, None]  # (seq, 1)
    frequency = torch.exp(
        torch.arange(0, hidden_size, 2, dtype=torch.float32) * (-math.log(10000.0) / hidden_size)
    )
    table = torch.zeros(max_length, hidden_size)
    table[:, 0::2] = torch.sin(position * frequency)
    table[:, 1::2] = torch.cos(position * frequency[: hidden_size // 2])
    return table  # (max_length, hidden)


class ScaledSinusoidal(nn.Module):
    """Sinusoids times one learned scale. The table is no buffer: transformers 5 builds models on the meta
    device and never fills unsaved buffers, so it is computed on first use, per device."""

    def __init__(self, config: CrammedBertConfig):
        super().__init__()
        self.max_length, self.hidden_size = config.max_position_embeddings, config.hidden_size
        self.scale = nn.Parameter(torch.tensor(1.0 / math.sqrt(config.hidden_size)))
        self._table: torch.Tensor | None = None

    def forward(self, seq_length: int) -> torch.Tensor:
        if self._table is None or self._table.device != self.scale.device:
            self._table = sinusoid_table(self.max_length, self.hidden_size).to(self.scale.device)
        return self._table[:seq_length].to(self.scale.dtype) * self.scale  # (seq, hidden)


class LearnedPositions(nn.Module):
    def __init__(self, config: CrammedBertConfig):
        super().__init__()
        self.table = nn.Embedding(config.max_position_embeddings, config.hidden_size)

    def forward(self, seq_length: int) -> torch.Tensor:
        return self.table.weight[:seq_length]  # (seq, hidden)


POSITIONS = {"scaled-sinusoidal": ScaledSinusoidal, "learned": LearnedPositions}


class Embeddings(nn.Module):
    """word + position (+ token type) embeddings, then an optional LayerNorm and dropout."""

    def __init__(self, config: CrammedBertConfig):
        super().__init__()
        self.word = nn.Embedding(config.vocab_size, config.hidden_size)
        self.position = POSITIONS[config.position_embedding](config)
        self.token_type = (
            nn.Embedding(config.type_vocab_size, config.hidden_size) if config.type_vocab_size else None
        )
        self.norm = layer_norm(config) if config.embedding_norm else nn.Identity()
        self.dropout = nn.Dropout(config.hidden_dropout_prob)

    def forward(self, input_ids: torch.Tensor, token_type_ids: torch.Tensor | None) -> torch.Tensor:
        x = self.word(input_ids) + self.position(input_ids.shape[1])  # (batch, seq, hidden)
        if self.token_type is not None:
            x = x + self.token_type(
                token_type_ids if token_type_ids is not None else torch.zeros_like(input_ids)
            )
        return self.dropout(self.norm(x))


class SelfAttention(nn.Module):
    def __init__(self, config: CrammedBertConfig):
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.qkv = nn.Linear(config.hidden_size, 3 * config.hidden_size, bias=config.bias)
        self.out = nn.Linear(config.hidden_size, config.hidden_size, bias=config.bias)
        self.dropout_p = config.attention_probs_dropout_prob
        # ALiBi slopes as plain floats, not a buffer (transformers 5 never fills unsaved buffers)
        self.slopes: list[float] | None = None
        if getattr(config, "attention_bias", "none") == "alibi":
            given = getattr(config, "alibi_slopes", None)
            self.slopes = (
                [float(s) for s in given] if given is not None else [4.0**-h for h in range(self.num_heads)]
            )

    def forward(self, x: torch.Tensor, key_padding_mask: torch.Tensor | None) -> torch.Tensor:
        batch, seq, hidden = x.shape
        qkv = self.qkv(x).view(batch, seq, 3, self.num_heads, hidden // self.num_heads)
        q, k, v = qkv.permute(2, 0, 3, 1, 4).unbind(0)  # each (batch, heads, seq, head_dim)
        mask = None if key_padding_mask is None else key_padding_mask[:, None, None, :]  # True = attend
        if self.slopes is not None:  # ALiBi: one float mask, the distance bias and -max on padded keys
            position = torch.arange(seq, device=x.device)
            distance = (position[:, None] - position[None, :]).abs().float()  # (seq, seq)
            slopes = torch.tensor(self.slopes, device=x.device)
            bias = (-slopes[:, None, None] * distance).to(q.dtype)  # (heads, seq, seq)
            mask = bias if mask is None else bias.masked_fill(~mask, torch.finfo(q.dtype).min)
        y = F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, dropout_p=self.dropout_p if self.training else 0.0
        )
        return self.out(y.transpose(1, 2).reshape(batch, seq, hidden))  # (batch, seq, hidden)


class FeedForward(nn.Module):
    """up-projection -> GELU (or gate x GELU(value) when gated) -> down-projection."""

    def __init__(self, config: CrammedBertConfig):
        super().__init__()
        self.gated = config.ffn == "glu"
        inner = config.intermediate_size // 2 if self.gated else config.intermediate_size
        self.up = nn.Linear(config.hidden_size, config.intermediate_size, bias=config.bias)
        self.down = nn.Linear(inner, config.hidden_size, bias=config.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.up(x)  # (batch, seq, intermediate)
        if self.gated:
            gate, value = h.chunk(2, dim=-1)  # each (batch, seq, intermediate / 2)
            h = gate * F.gelu(value)
        else:
            h = F.gelu(h)
        return self.down(h)  # (batch, seq, hidden)


class Block(nn.Module):
    """pre-LN: x + f(norm(x)) for f in (attention, ffn); post-LN: norm(x + f(x))."""

    def __init__(self, config: CrammedBertConfig):
        super().__init__()
        self.pre_norm = config.norm_scheme == "pre"
        self.norm1 = layer_norm(config)
        self.attention = SelfAttention(config)
        self.norm2 = layer_norm(config)
        self.ffn = FeedForward(config)
        self.dropout = nn.Dropout(config.hidden_dropout_prob)

    def forward(self, x: torch.Tensor, key_padding_mask: torch.Tensor | None) -> torch.Tensor:
        if self.pre_norm:
            x = x + self.dropout(self.attention(self.norm1(x), key_padding_mask))
            return x + self.dropout(self.ffn(self.norm2(x)))
        x = self.norm1(x + self.dropout(self.attention(x, key_padding_mask)))
        return self.norm2(x + self.dropout(self.ffn(x)))


class CrammedBertPreTrainedModel(PreTrainedModel):
    config_class = CrammedBertConfig
    base_model_prefix = "encoder"  # cramming's name for the encoder: its state-dict keys load unchanged

    def _init_weights(self, module: nn.Module) -> None:
        """cramming's initialization, for whatever the folder does not hold (a new classifier head)."""
        if isinstance(module, nn.Linear | nn.Embedding):
            init.normal_(module.weight, mean=0.0, std=self.config.initializer_range)
        if isinstance(module, nn.Linear) and module.bias is not None:
            init.zeros_(module.bias)
        if isinstance(module, nn.LayerNorm):
            init.ones_(module.weight)
            if module.bias is not None:
                init.zeros_(module.bias)
        if isinstance(module, ScaledSinusoidal):
            init.constant_(module.scale, 1.0 / math.sqrt(module.hidden_size))


class CrammedBertModel(CrammedBertPreTrainedModel):
    """Token ids -> contextual hidden states (batch, seq, hidden), after the final LayerNorm."""

    def __init__(self, config: CrammedBertConfig):
        super().__init__(config)
        self.embeddings = Embeddings(config)
        self.blocks = nn.ModuleList(Block(config) for _ in range(config.num_hidden_layers))
        self.final_norm = layer_norm(config) if config.final_norm else nn.Identity()
        self.post_init()

    def get_input_embeddings(self) -> nn.Embedding:
        return self.embeddings.word

    def set_input_embeddings(self, value: nn.Embedding) -> None:
        self.embeddings.word = value

    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        token_type_ids: torch.Tensor | None = None,
        output_hidden_states: bool | None = None,
        return_dict: bool | None = None,
        **kwargs,
    ) -> BaseModelOutput | tuple:
        """attention_mask: (batch, seq), 1 = real token. hidden_states, when asked for: the embeddings' output
        and every block's, the last before the final LayerNorm."""
        key_padding_mask = None if attention_mask is None else attention_mask.bool()
        x = self.embeddings(input_ids, token_type_ids)  # (batch, seq, hidden)
        states = [x]
        for block in self.blocks:
            x = block(x, key_padding_mask)
            states.append(x)
        x = self.final_norm(x)
        hidden_states = tuple(states) if output_hidden_states else None
        if return_dict is False:
            return (x,) if hidden_states is None else (x, hidden_states)
        return BaseModelOutput(last_hidden_state=x, hidden_states=hidden_states)


class PredictionHead(nn.Module):
    """Optional transform (dense + GELU + LayerNorm, original BERT), then the decoder to the vocabulary."""

    def __init__(self, config: CrammedBertConfig):
        super().__init__()
        if config.head_transform:
            self.transform = nn.Sequential(
                nn.Linear(config.hidden_size, config.hidden_size, bias=config.bias),
                nn.GELU(),
                layer_norm(config),
            )
        else:
            self.transform = nn.Identity()
        self.decoder = nn.Linear(config.hidden_size, config.vocab_size, bias=config.decoder_bias)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.decoder(self.transform(hidden))  # (..., vocab)


class CrammedBertForMaskedLM(CrammedBertPreTrainedModel):
    # transformers 5 reads the mapping (tied copy -> source); 4 reads its keys and the *_embeddings getters
    _tied_weights_keys = {"head.decoder.weight": "encoder.embeddings.word.weight"}

    def __init__(self, config: CrammedBertConfig):
        super().__init__(config)
        self.encoder = CrammedBertModel(config)
        self.head = PredictionHead(config)
        self.post_init()

    def get_output_embeddings(self) -> nn.Linear:
        return self.head.decoder

    def set_output_embeddings(self, value: nn.Linear) -> None:
        self.head.decoder = value

    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        token_type_ids: torch.Tensor | None = None,
        labels: torch.Tensor | None = None,
        output_hidden_states: bool | None = None,
        return_dict: bool | None = None,
        **kwargs,
    ) -> MaskedLMOutput | tuple:
        """Logits at every position (batch, seq, vocab); labels: -100 where nothing is predicted."""
        out = self.encoder(
            input_ids, attention_mask, token_type_ids, output_hidden_states=output_hidden_states
        )
        logits = self.head(out.last_hidden_state)  # (batch, seq, vocab)
        loss = None
        if labels is not None:
            loss = F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(), ignore_index=-100)
        if return_dict is False:
            return tuple(t for t in (loss, logits, out.hidden_states) if t is not None)
        return MaskedLMOutput(loss=loss, logits=logits, hidden_states=out.hidden_states)


class CrammedBertForSequenceClassification(CrammedBertPreTrainedModel):
    """The first token's final hidden state -> [pooler: Linear + Tanh] -> Dropout -> Linear(num_labels)."""

    def __init__(self, config: CrammedBertConfig):
        super().__init__(config)
        self.num_labels = config.num_labels
        self.encoder = CrammedBertModel(config)
        width = config.classifier_head_dim or config.hidden_size
        self.pooler = (
            nn.Sequential(nn.Linear(config.hidden_size, width), nn.Tanh())
            if config.classifier_head_dim
            else None
        )
        dropout = config.classifier_dropout
        self.dropout = nn.Dropout(config.hidden_dropout_prob if dropout is None else dropout)
        self.classifier = nn.Linear(width, config.num_labels)
        self.post_init()

    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        token_type_ids: torch.Tensor | None = None,
        labels: torch.Tensor | None = None,
        output_hidden_states: bool | None = None,
        return_dict: bool | None = None,
        **kwargs,
    ) -> SequenceClassifierOutput | tuple:
        out = self.encoder(
            input_ids, attention_mask, token_type_ids, output_hidden_states=output_hidden_states
        )
        pooled = out.last_hidden_state[:, 0]  # zero_index pooling: (batch, hidden)
        if self.pooler is not None:
            pooled = self.pooler(pooled)  # (batch, classifier_head_dim)
        logits = self.classifier(self.dropout(pooled))  # (batch, num_labels)
        loss = None if labels is None else self._loss(logits, labels)
        if return_dict is False:
            return tuple(t for t in (loss, logits, out.hidden_states) if t is not None)
        return SequenceClassifierOutput(loss=loss, logits=logits, hidden_states=out.hidden_states)

    def _loss(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """The usual transformers rule: one label -> regression, integer labels -> single-label classification."""
        kind = self.config.problem_type
        if kind is None and self.num_labels == 1:
            kind = "regression"
        elif kind is None:
            integer = labels.dtype in (torch.long, torch.int)
            kind = "single_label_classification" if integer else "multi_label_classification"
        if kind == "regression":
            return F.mse_loss(logits.squeeze(-1).float(), labels.float().view(-1))
        if kind == "single_label_classification":
            return F.cross_entropy(logits.float(), labels.view(-1))
        return F.binary_cross_entropy_with_logits(logits.float(), labels.float())
