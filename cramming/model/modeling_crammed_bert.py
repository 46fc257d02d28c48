"""The crammed BERT in Hugging Face `transformers`: a config and the Auto* model classes around bert.py.

An export (cramming/hf/export.py) copies this file and bert.py, both as they are, next to the weights:
`trust_remote_code=True` loads the two with torch and transformers alone (this file imports bert.py
relatively, as it does here). `import cramming.hf` registers these classes with the Auto* factories, so in a
process with cramming no remote code is needed.

The model is bert.py's, module for module, so a cramming state dict loads unchanged, computed with bert.py's
plain PyTorch kernels. Only what transformers expects around it is here: the config under Hugging Face's
names, every block's hidden states, the loss over all positions, and the fine-tuning heads of transformers'
BERT: sequence classification, token classification, extractive question answering and multiple choice.
"""

from __future__ import annotations

import math
from dataclasses import fields

import torch
import torch.nn.functional as F
from torch import nn
from transformers import PretrainedConfig, PreTrainedModel
from transformers.modeling_outputs import (
    BaseModelOutput,
    MaskedLMOutput,
    MultipleChoiceModelOutput,
    QuestionAnsweringModelOutput,
    SequenceClassifierOutput,
    TokenClassifierOutput,
)
from transformers.utils import ModelOutput

from .bert import (
    CHOICES,
    IGNORE_INDEX,
    Arch,
    Encoder,
    LayerNorm,
    PredictionHead,
    ScaledSinusoidal,
    SelfAttention,
    cross_entropy,
    sinusoid_table,
)

try:  # transformers >= 5 loads weights before initializing: its init functions skip loaded tensors
    from transformers import initialization as init
except ImportError:  # 4.x initializes first, then loads
    from torch.nn import init

# Hugging Face's name for an Arch field that transformers knows under another; the other fields keep ours
HF_NAMES = {
    "num_layers": "num_hidden_layers",
    "num_heads": "num_attention_heads",
    "max_seq_length": "max_position_embeddings",
    "norm_eps": "layer_norm_eps",
    "dropout": "hidden_dropout_prob",  # attention_probs_dropout_prob may differ from it here
    "init_std": "initializer_range",
    "tie_embeddings": "tie_word_embeddings",
}
# Arch fields that change no output: `name` is a label, `sparse_prediction` picks which positions the
# training loss decodes, `padding_idx` only keeps the [PAD] row's gradient at zero
NOT_EXPORTED = ("name", "sparse_prediction", "padding_idx")
# the config's name -> the Arch field it holds (with its default), for every field an exported model reads
ARCH_FIELDS = {HF_NAMES.get(f.name, f.name): f for f in fields(Arch) if f.name not in NOT_EXPORTED}
CLASSIFIER_POOLINGS = ("zero_index",)  # the first token ([CLS]) represents the sequence


class CrammedBertConfig(PretrainedConfig):
    """Every field of ARCH_FIELDS (Arch's defaults), plus the vocabulary, the attention dropout and the
    classifier head: pooling (`zero_index`) -> [Linear(hidden, classifier_head_dim) -> Tanh, when
    classifier_head_dim is set] -> Dropout(classifier_dropout, default hidden_dropout_prob) -> Linear(num_labels).
    """

    model_type = "crammed_bert"

    def __init__(
        self,
        vocab_size: int = 32768,
        attention_probs_dropout_prob: float = 0.1,
        classifier_pooling: str = "zero_index",
        classifier_head_dim: int | None = None,
        classifier_dropout: float | None = None,
        pad_token_id: int = 0,
        **kwargs,
    ):
        values = {name: kwargs.pop(name, field.default) for name, field in ARCH_FIELDS.items()}
        allowed = {**CHOICES, "classifier_pooling": CLASSIFIER_POOLINGS}
        chosen = {**{key: values[key] for key in CHOICES}, "classifier_pooling": classifier_pooling}
        for name, value in chosen.items():
            if value not in allowed[name]:
                raise ValueError(
                    f"CrammedBertConfig.{name}={value!r}: this modeling file knows {allowed[name]}"
                )
        tie_word_embeddings = values.pop("tie_word_embeddings")
        for name, value in values.items():
            setattr(self, name, value)
        self.vocab_size = vocab_size
        self.attention_probs_dropout_prob = attention_probs_dropout_prob
        self.classifier_pooling = classifier_pooling
        self.classifier_head_dim = classifier_head_dim
        self.classifier_dropout = classifier_dropout
        # base-class keywords in transformers 4 (set there, overriding anything assigned above)
        super().__init__(tie_word_embeddings=tie_word_embeddings, pad_token_id=pad_token_id, **kwargs)

    def to_arch(self) -> Arch:
        """bert.py's Arch of this config. The [PAD] row is an ordinary one: a model here is fine-tuned or run,
        where cramming's frozen zero row matters no more."""
        return Arch(
            **{field.name: getattr(self, name) for name, field in ARCH_FIELDS.items()}, padding_idx=None
        )


def _copy(tensor: torch.Tensor, value: torch.Tensor) -> None:
    """Fill a buffer that is never saved. transformers 5 builds the model on the meta device and leaves such
    buffers empty (its init.copy_ fills them); 4.x builds it for real, and has no copy_ to call."""
    if hasattr(init, "copy_"):
        init.copy_(tensor, value)
    else:
        with torch.no_grad():
            tensor.copy_(value)


class CrammedBertPreTrainedModel(PreTrainedModel):
    config_class = CrammedBertConfig
    base_model_prefix = "encoder"  # cramming's name for the encoder: its state-dict keys load unchanged

    def _init_weights(self, module: nn.Module) -> None:
        """cramming's initialization, for whatever the folder does not hold (a new classifier head), and the
        buffers bert.py rebuilds from the arch."""
        config = self.config
        if isinstance(module, nn.Linear | nn.Embedding):
            init.normal_(module.weight, mean=0.0, std=config.initializer_range)
        if isinstance(module, nn.Linear) and module.bias is not None:
            init.zeros_(module.bias)
        if isinstance(module, LayerNorm):
            init.ones_(module.weight)
            if module.bias is not None:
                init.zeros_(module.bias)
        if isinstance(module, ScaledSinusoidal):
            init.constant_(module.scale, 1.0 / math.sqrt(config.hidden_size))
            _copy(module.table, sinusoid_table(config.max_position_embeddings, config.hidden_size))
        if isinstance(module, SelfAttention) and module.slopes is not None:
            _copy(module.slopes, torch.tensor(config.to_arch().head_slopes()))


class CrammedBertModel(CrammedBertPreTrainedModel):
    """Token ids -> contextual hidden states (batch, seq, hidden), after the final LayerNorm: bert.py's
    Encoder, whose modules it holds directly (its state-dict keys are the Encoder's)."""

    def __init__(self, config: CrammedBertConfig):
        super().__init__(config)
        encoder = Encoder(config.to_arch(), config.vocab_size, config.hidden_dropout_prob)
        self.embeddings, self.blocks, self.final_norm = encoder.embeddings, encoder.blocks, encoder.final_norm
        for module in self.blocks.modules():
            if isinstance(module, SelfAttention):
                module.dropout_p = config.attention_probs_dropout_prob
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
        """Encoder.forward, keeping every block's output. attention_mask: (batch, seq), 1 = real token.
        hidden_states, when asked for: the embeddings' output and every block's, the last before the final
        LayerNorm."""
        key_padding_mask = None if attention_mask is None else attention_mask.bool()
        x = self.embeddings(input_ids, token_type_ids)  # (batch, seq, hidden)
        states = [x]
        for block in self.blocks:
            x = block(x, key_padding_mask)  # (batch, seq, hidden)
            states.append(x)
        x = self.final_norm(x)
        hidden_states = tuple(states) if output_hidden_states else None
        if return_dict is False:
            return (x,) if hidden_states is None else (x, hidden_states)
        return BaseModelOutput(last_hidden_state=x, hidden_states=hidden_states)


class CrammedBertForMaskedLM(CrammedBertPreTrainedModel):
    # transformers 5 reads the mapping (tied copy -> source); 4 reads its keys and the *_embeddings getters
    _tied_weights_keys = {"head.decoder.weight": "encoder.embeddings.word.weight"}

    def __init__(self, config: CrammedBertConfig):
        super().__init__(config)
        self.encoder = CrammedBertModel(config)
        self.head = PredictionHead(config.to_arch(), config.vocab_size)
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
            loss = cross_entropy(logits.flatten(0, 1), labels.flatten(), IGNORE_INDEX)
        if return_dict is False:
            return tuple(t for t in (loss, logits, out.hidden_states) if t is not None)
        return MaskedLMOutput(loss=loss, logits=logits, hidden_states=out.hidden_states)


def _classifier_dropout(config: CrammedBertConfig) -> nn.Dropout:
    """Dropout before a classifier: classifier_dropout, or hidden_dropout_prob when that is unset."""
    dropout = config.classifier_dropout
    return nn.Dropout(config.hidden_dropout_prob if dropout is None else dropout)


def _pooled_head(config: CrammedBertConfig, outputs: int) -> tuple[nn.Module | None, nn.Dropout, nn.Linear]:
    """The head on the first token: [pooler: Linear(hidden, classifier_head_dim) + Tanh, when that is set],
    dropout, and the classifier Linear(width, outputs)."""
    width = config.classifier_head_dim or config.hidden_size
    pooler = (
        nn.Sequential(nn.Linear(config.hidden_size, width), nn.Tanh()) if config.classifier_head_dim else None
    )
    return pooler, _classifier_dropout(config), nn.Linear(width, outputs)


def _first_token_logits(model: nn.Module, hidden: torch.Tensor) -> torch.Tensor:
    """hidden (rows, seq, hidden) -> the model's pooled head on each row's first token: (rows, outputs)."""
    pooled = hidden[:, 0]  # zero_index pooling: (rows, hidden)
    if model.pooler is not None:
        pooled = model.pooler(pooled)  # (rows, classifier_head_dim)
    return model.classifier(model.dropout(pooled))


def _outputs(
    kind: type, return_dict: bool | None, loss: torch.Tensor | None, **values
) -> ModelOutput | tuple:
    """transformers' output class `kind`, or with return_dict=False its tuple: the loss first when there is
    one, then the values that are set, in order."""
    if return_dict is False:
        return tuple(t for t in (loss, *values.values()) if t is not None)
    return kind(loss=loss, **values)


class CrammedBertForSequenceClassification(CrammedBertPreTrainedModel):
    """The first token's final hidden state -> [pooler: Linear + Tanh] -> Dropout -> Linear(num_labels)."""

    def __init__(self, config: CrammedBertConfig):
        super().__init__(config)
        self.num_labels = config.num_labels
        self.encoder = CrammedBertModel(config)
        self.pooler, self.dropout, self.classifier = _pooled_head(config, config.num_labels)
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
        logits = _first_token_logits(self, out.last_hidden_state)  # (batch, num_labels)
        loss = None if labels is None else self._loss(logits, labels)
        return _outputs(
            SequenceClassifierOutput, return_dict, loss, logits=logits, hidden_states=out.hidden_states
        )

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


class CrammedBertForTokenClassification(CrammedBertPreTrainedModel):
    """Every token's final hidden state -> Dropout -> Linear(num_labels), as transformers'
    BertForTokenClassification (named entities, parts of speech)."""

    def __init__(self, config: CrammedBertConfig):
        super().__init__(config)
        self.num_labels = config.num_labels
        self.encoder = CrammedBertModel(config)
        self.dropout = _classifier_dropout(config)
        self.classifier = nn.Linear(config.hidden_size, config.num_labels)
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
    ) -> TokenClassifierOutput | tuple:
        """Logits (batch, seq, num_labels); labels (batch, seq): -100 where a token has none (padding, [CLS],
        the word pieces after a word's first)."""
        out = self.encoder(
            input_ids, attention_mask, token_type_ids, output_hidden_states=output_hidden_states
        )
        logits = self.classifier(self.dropout(out.last_hidden_state))  # (batch, seq, num_labels)
        loss = None
        if labels is not None:
            loss = cross_entropy(logits.flatten(0, 1), labels.flatten(), IGNORE_INDEX)
        return _outputs(
            TokenClassifierOutput, return_dict, loss, logits=logits, hidden_states=out.hidden_states
        )


class CrammedBertForQuestionAnswering(CrammedBertPreTrainedModel):
    """Extractive question answering, as transformers' BertForQuestionAnswering: every token's final hidden
    state -> Linear(2), the scores of the answer span starting and ending there."""

    def __init__(self, config: CrammedBertConfig):
        super().__init__(config)
        self.encoder = CrammedBertModel(config)
        self.qa_outputs = nn.Linear(config.hidden_size, 2)
        self.post_init()

    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        token_type_ids: torch.Tensor | None = None,
        start_positions: torch.Tensor | None = None,
        end_positions: torch.Tensor | None = None,
        output_hidden_states: bool | None = None,
        return_dict: bool | None = None,
        **kwargs,
    ) -> QuestionAnsweringModelOutput | tuple:
        """start_logits, end_logits: (batch, seq). With start_positions and end_positions (batch,): the mean
        of the two cross-entropies; a position outside the sequence is clamped to its length and then
        ignored (transformers' rule: an answer cut off by truncation teaches nothing)."""
        out = self.encoder(
            input_ids, attention_mask, token_type_ids, output_hidden_states=output_hidden_states
        )
        logits = self.qa_outputs(out.last_hidden_state)  # (batch, seq, 2)
        start_logits, end_logits = (t.squeeze(-1).contiguous() for t in logits.split(1, dim=-1))
        loss = None
        if start_positions is not None and end_positions is not None:
            ignored = start_logits.size(1)
            start = start_positions.view(-1).clamp(0, ignored)
            end = end_positions.view(-1).clamp(0, ignored)
            loss = (cross_entropy(start_logits, start, ignored) + cross_entropy(end_logits, end, ignored)) / 2
        return _outputs(
            QuestionAnsweringModelOutput,
            return_dict,
            loss,
            start_logits=start_logits,
            end_logits=end_logits,
            hidden_states=out.hidden_states,
        )


class CrammedBertForMultipleChoice(CrammedBertPreTrainedModel):
    """Each (prompt, choice) pair scored on its own, as transformers' BertForMultipleChoice: the first token
    -> the sequence classifier's head with one output ([pooler] -> Dropout -> Linear(1)); the scores of a
    question's choices compete in one softmax."""

    def __init__(self, config: CrammedBertConfig):
        super().__init__(config)
        self.encoder = CrammedBertModel(config)
        self.pooler, self.dropout, self.classifier = _pooled_head(config, 1)
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
    ) -> MultipleChoiceModelOutput | tuple:
        """Inputs (batch, choices, seq) -> logits (batch, choices); labels (batch,): the right choice's index.
        hidden_states, when asked for, are those of the flattened (batch * choices) rows."""
        choices = input_ids.shape[1]

        def flat(t: torch.Tensor | None) -> torch.Tensor | None:
            return None if t is None else t.flatten(0, 1)  # (batch * choices, seq)

        out = self.encoder(
            flat(input_ids),
            flat(attention_mask),
            flat(token_type_ids),
            output_hidden_states=output_hidden_states,
        )
        logits = _first_token_logits(self, out.last_hidden_state).view(-1, choices)  # (batch, choices)
        loss = None if labels is None else cross_entropy(logits, labels.view(-1))
        return _outputs(
            MultipleChoiceModelOutput, return_dict, loss, logits=logits, hidden_states=out.hidden_states
        )
