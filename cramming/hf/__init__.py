"""Models that leave the framework, and models that come in: Hugging Face `transformers` export and import.

export.py writes a checkpoint as a `transformers` folder (a native BertForMaskedLM where the arch is the
original BERT's, else the crammed BERT as remote code: cramming/model/bert.py and its transformers wrapper
cramming/model/modeling_crammed_bert.py, copied as they are); load.py wraps any local
`transformers` encoder folder as a fine-tuning Backbone. Importing this package registers the crammed BERT
with the Auto* factories, so exported folders load in this process without `trust_remote_code`.

`transformers` is an optional dependency: `pip install 'cramming[hf]'`.
"""

from __future__ import annotations

try:
    import transformers
except ImportError as err:
    raise ImportError(
        "cramming.hf (export to / import from Hugging Face transformers) needs the `transformers` package:"
        " pip install 'cramming[hf]'"
    ) from err

from cramming.model.modeling_crammed_bert import (
    CrammedBertConfig,
    CrammedBertForMaskedLM,
    CrammedBertForSequenceClassification,
    CrammedBertModel,
)


def _register() -> None:
    transformers.AutoConfig.register(CrammedBertConfig.model_type, CrammedBertConfig, exist_ok=True)
    for factory, model in (
        (transformers.AutoModel, CrammedBertModel),
        (transformers.AutoModelForMaskedLM, CrammedBertForMaskedLM),
        (transformers.AutoModelForSequenceClassification, CrammedBertForSequenceClassification),
    ):
        factory.register(CrammedBertConfig, model, exist_ok=True)


_register()

__all__ = [
    "CrammedBertConfig",
    "CrammedBertForMaskedLM",
    "CrammedBertForSequenceClassification",
    "CrammedBertModel",
]
