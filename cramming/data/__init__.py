"""Raw text → normalized, filtered, deduplicated → tokenizer → packed fixed-length rows, cached by config hash."""

from cramming.data.pipeline import PretrainingData, load_pretraining_data, prepare_pretraining_data
from cramming.data.tokenizer import SPECIAL_TOKENS, SpecialTokens

__all__ = [
    "SPECIAL_TOKENS",
    "PretrainingData",
    "SpecialTokens",
    "load_pretraining_data",
    "prepare_pretraining_data",
]
