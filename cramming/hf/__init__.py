"""Models that leave the framework, and models that come in: Hugging Face `transformers` export and import.

export.py writes a checkpoint as a `transformers` folder (a native BertForMaskedLM where the arch is the
original BERT's, else the crammed BERT as remote code: cramming/model/bert.py and its transformers wrapper
cramming/model/modeling_crammed_bert.py, copied as they are); load.py wraps any local
`transformers` encoder folder as a fine-tuning Backbone. Importing this package registers the crammed BERT
with the Auto* factories, so exported folders load in this process without `trust_remote_code`.

`transformers` is an optional dependency: `pip install -e '.[hf]'`.
"""

from __future__ import annotations

try:
    import transformers
except ImportError as err:
    # a ModuleNotFoundError: what cramming.job.exits maps to exit 2 with this one line (`checkpoint=hf:...`,
    # scripts/export_hf.py), and still an ImportError for code that imports cramming.hf itself
    raise ModuleNotFoundError(
        "transformers is not installed: reading or writing a Hugging Face transformers folder (checkpoint=hf:<folder>,"
        " scripts/export_hf.py) needs it. Install it from the project's folder: pip install -e '.[hf]'",
        name="transformers",
    ) from err

from cramming.model.modeling_crammed_bert import (
    CrammedBertConfig,
    CrammedBertForMaskedLM,
    CrammedBertForMultipleChoice,
    CrammedBertForQuestionAnswering,
    CrammedBertForSequenceClassification,
    CrammedBertForTokenClassification,
    CrammedBertModel,
)

# the Auto* factory of each class, by the factory's name: an export's config.json maps the same names to the
# same classes in its auto_map (cramming.hf.export), so the folder loads alike with and without cramming
AUTO_CLASSES = {
    "AutoModel": CrammedBertModel,
    "AutoModelForMaskedLM": CrammedBertForMaskedLM,
    "AutoModelForSequenceClassification": CrammedBertForSequenceClassification,
    "AutoModelForTokenClassification": CrammedBertForTokenClassification,
    "AutoModelForQuestionAnswering": CrammedBertForQuestionAnswering,
    "AutoModelForMultipleChoice": CrammedBertForMultipleChoice,
}


def _register() -> None:
    """Register the classes with the Auto* factories, and for their auto class: save_pretrained of a model
    built here (a fine-tuned head) then writes the two code files beside the weights, as an export does, so
    the saved folder loads without cramming too (trust_remote_code), on the Hub or elsewhere."""
    transformers.AutoConfig.register(CrammedBertConfig.model_type, CrammedBertConfig, exist_ok=True)
    CrammedBertConfig.register_for_auto_class("AutoConfig")
    for factory, model in AUTO_CLASSES.items():
        getattr(transformers, factory).register(CrammedBertConfig, model, exist_ok=True)
        model.register_for_auto_class(factory)


_register()

__all__ = [
    "AUTO_CLASSES",
    "CrammedBertConfig",
    "CrammedBertForMaskedLM",
    "CrammedBertForMultipleChoice",
    "CrammedBertForQuestionAnswering",
    "CrammedBertForSequenceClassification",
    "CrammedBertForTokenClassification",
    "CrammedBertModel",
]
