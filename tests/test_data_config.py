"""The data config: its choice lists are the keys of the registries that implement them."""

from __future__ import annotations

from pathlib import Path

import pytest

from cramming.data import pipeline, sources, tokenizer
from cramming.data.config import DataConfig, SourceConfig, TokenizerConfig
from cramming.errors import ConfigError

REPO = Path(__file__).resolve().parent.parent


def _data(**overrides) -> DataConfig:
    return DataConfig(sources={"s": SourceConfig(kind="embedded")}, **overrides)


def test_bad_choices_list_the_registry_keys():
    with pytest.raises(
        ConfigError, match=r"`data.ordering`: 'sideways'. choose one of: none, random, curriculum"
    ):
        _data(ordering="sideways")
    with pytest.raises(ConfigError, match=r"`data.tokenizer.kind`.*choose one of: wordpiece, bpe, unigram"):
        TokenizerConfig(kind="sentencepiece")
    with pytest.raises(
        ConfigError, match=r"`data.sources.s.kind`: 'ftp'. choose one of: hub, local, embedded"
    ):
        DataConfig(sources={"s": SourceConfig(kind="ftp")})
    with pytest.raises(
        ConfigError, match=r"`data.sources.s.txt_unit`.*choose one of: line, paragraph, document"
    ):
        DataConfig(sources={"s": SourceConfig(kind="embedded", txt_unit="page")})


def test_a_registered_implementation_is_a_valid_choice(monkeypatch):
    """Registering a new entry is all it takes: validation has no list of its own."""
    monkeypatch.setitem(pipeline.ORDERINGS, "reversed", lambda rows, seed, vocab: rows)
    monkeypatch.setitem(tokenizer.TOKENIZER_KINDS, "other", tokenizer.TOKENIZER_KINDS["wordpiece"])
    monkeypatch.setitem(sources.SOURCE_KINDS, "ftp", sources.SOURCE_KINDS["embedded"])
    assert _data(ordering="reversed").ordering == "reversed"
    assert TokenizerConfig(kind="other").kind == "other"
    assert DataConfig(sources={"s": SourceConfig(kind="ftp")}).sources["s"].kind == "ftp"


def test_loading_an_unregistered_source_kind_names_the_choices(tmp_path):
    # a SourceConfig built directly, without DataConfig's validation
    with pytest.raises(ConfigError, match="choose one of: hub, local, embedded"):
        sources.load_source(SourceConfig(kind="ftp"), tmp_path)


@pytest.mark.parametrize("name", ["wikibooks", "fineweb-edu", "local", "embedded"])
def test_data_configs_follow_the_cramming_tokenizer_recipe(name):
    """ASCII-only text (cramming's force_english_keyboard) and BERT's ~1000-character alphabet."""
    from omegaconf import OmegaConf

    cfg = OmegaConf.load(REPO / "conf" / "data" / f"{name}.yaml")
    assert cfg.normalizer.ascii_only is True
    assert cfg.tokenizer.limit_alphabet == 1000
