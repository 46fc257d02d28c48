"""The preprocessing pipeline: normalization, filters, dedup, tokenizers, packing, ordering and the cache."""

from __future__ import annotations

import json
import logging
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from cramming.data import SPECIAL_TOKENS, load_pretraining_data, prepare_pretraining_data
from cramming.data import pipeline as pipeline_module
from cramming.data.config import NormalizerConfig, SourceConfig, TokenizerConfig
from cramming.data.ordering import SEGMENTS
from cramming.data.pipeline import cache_dir_for, join_with_separator
from cramming.data.sources import FILE_HASHES
from cramming.data.tokenizer import build_normalizer, train_tokenizer
from cramming.errors import ConfigError, DataSourceError

REPO = Path(__file__).resolve().parent.parent


def _write_jsonl(path, texts):
    with open(path, "w", encoding="utf-8") as f:
        for t in texts:
            f.write(json.dumps({"text": t}) + "\n")


@pytest.fixture
def corpus(tmp_path, wiki_texts):
    """A folder with one JSONL file of 60 real articles."""
    folder = tmp_path / "corpus"
    folder.mkdir()
    _write_jsonl(folder / "wiki.jsonl", wiki_texts[:60])
    return folder


def _all_rows(ds) -> np.ndarray:
    return np.asarray(ds.with_format("numpy")["input_ids"])


# ---------------------------------------------------------------- normalization and filters


def test_normalizer_nfkc_lowercase_accents():
    norm = build_normalizer(NormalizerConfig())
    assert norm.normalize_str("Ｃafé Ǆ ﬁne Ⅻ") == "cafe dz fine xii"
    keep_case = build_normalizer(NormalizerConfig(lowercase=False, strip_accents=False, ascii_only=False))
    assert keep_case.normalize_str("Café ﬁne") == "Café fine"
    nothing = build_normalizer(
        NormalizerConfig(nfkc=False, lowercase=False, strip_accents=False, ascii_only=False)
    )
    assert nothing.normalize_str("Ｃafé ﬁne") == "Ｃafé ﬁne"


def test_ascii_only_deletes_what_normalization_leaves_outside_ascii():
    text = "Naïve Ｔokyo (東京) — Москва, 3×4 ½"
    # accents are stripped and NFKC folds full-width letters first; the rest of non-ASCII goes, even the
    # fraction slash NFKC makes of ½
    assert build_normalizer(NormalizerConfig()).normalize_str(text) == "naive tokyo ()  , 34 12"
    kept = build_normalizer(NormalizerConfig(ascii_only=False)).normalize_str(text)
    assert kept == "naive tokyo (東京) — москва, 3×4 1⁄2"
    # without strip_accents the accented letter itself is deleted, as in cramming
    no_strip = NormalizerConfig(strip_accents=False)
    assert build_normalizer(no_strip).normalize_str("Naïve café") == "nave caf"
    # idempotent, which the pipeline relies on when it tokenizes text it normalized already
    norm = build_normalizer(NormalizerConfig())
    assert norm.normalize_str(norm.normalize_str(text)) == norm.normalize_str(text)


def test_length_filter_dedup_and_trash_filter(tmp_path, wiki_texts, data_config):
    articles = [t for t in wiki_texts if len(t) > 1000][:30]
    short = "Too short."
    # the same article again, differing only in case: a duplicate once normalized
    duplicate = articles[0].replace("e", "E")
    # a long text of rare symbol runs tokenizes at far more tokens per character than prose
    rng = np.random.default_rng(0)
    trash = " ".join("".join(rng.choice(list("qxzj#%&@0987"), size=3)) for _ in range(400))
    folder = tmp_path / "c"
    folder.mkdir()
    _write_jsonl(folder / "a.jsonl", [*articles, short, duplicate, trash])
    cfg = data_config(folder, {"validation_fraction": 0.0, "ordering": "none"})
    stats = prepare_pretraining_data(cfg, tmp_path / "cache").stats
    assert stats["raw_documents"] == 33
    assert stats["documents_after_length_filter"] == 32  # the short text is gone
    assert stats["documents_after_dedup"] == 31  # the duplicate is gone
    assert stats["train_dropped_by_token_ratio"] == 1  # the trash is gone
    assert stats["train_documents"] == 30
    # counts are of the kept documents only: the rows hold all their tokens but the last partial row
    assert stats["train_rows"] * 64 <= stats["train_tokens"] < (stats["train_rows"] + 1) * 64


def test_filters_can_be_switched_off(tmp_path, wiki_texts, data_config):
    folder = tmp_path / "c"
    folder.mkdir()
    _write_jsonl(folder / "a.jsonl", [*wiki_texts[:10], wiki_texts[0], "short"])
    cfg = data_config(
        folder,
        {
            "filter.min_chars": 0,
            "filter.deduplicate": False,
            "filter.max_tokens_per_char_vs_median": None,
            "validation_fraction": 0.0,
        },
    )
    stats = prepare_pretraining_data(cfg, tmp_path / "cache").stats
    assert stats["train_documents"] == 12


# ---------------------------------------------------------------- tokenizers


@pytest.mark.parametrize("kind", ["wordpiece", "bpe", pytest.param("unigram", marks=pytest.mark.slow)])
def test_tokenizer_round_trip_and_special_ids(kind, wiki_texts):
    norm_cfg = NormalizerConfig()
    norm = build_normalizer(norm_cfg)
    texts = [norm.normalize_str(t) for t in wiki_texts[:80]]
    tok = train_tokenizer([texts], TokenizerConfig(kind=kind, vocab_size=2000), norm_cfg, length=len(texts))
    for i, token in enumerate(SPECIAL_TOKENS):
        assert tok.token_to_id(token) == i
    assert tok.get_vocab_size() <= 2000
    raw = wiki_texts[3][:2000]
    ids = tok.encode(raw, add_special_tokens=False).ids
    assert tok.token_to_id("[UNK]") not in ids
    decoded = tok.decode(ids)
    # decoders may re-space punctuation; the characters themselves must survive, normalized
    assert "".join(decoded.split()) == "".join(norm.normalize_str(raw).split())
    pair = tok.encode("first part", "second part")
    assert pair.ids[0] == tok.token_to_id("[CLS]")
    assert pair.ids.count(tok.token_to_id("[SEP]")) == 2
    assert set(pair.type_ids) == {0, 1}


def test_a_wordpiece_vocabulary_gets_the_same_ids_every_time_without_changing_any_split(wiki_texts):
    """The trainer numbers tokens of equal count in hash order, different from one training to the next;
    renumbered, the same texts give the same tokenizer file, and every word splits as the trainer's would."""
    from cramming.data.tokenizer import TOKENIZER_KINDS

    norm_cfg, tok_cfg = NormalizerConfig(), TokenizerConfig(kind="wordpiece", vocab_size=2000)
    norm = build_normalizer(norm_cfg)
    texts = [norm.normalize_str(t) for t in wiki_texts[:80]]
    files = {train_tokenizer([texts], tok_cfg, norm_cfg).to_str() for _ in range(4)}
    assert len(files) == 1
    ours = train_tokenizer([texts], tok_cfg, norm_cfg)
    trainers_own, trainer = TOKENIZER_KINDS["wordpiece"](tok_cfg)
    trainers_own.train_from_iterator([texts], trainer=trainer)
    trainers_own.normalizer = norm
    assert set(ours.get_vocab()) == set(trainers_own.get_vocab())
    sample = " ".join(wiki_texts[100][:3000].split())  # an article the vocabulary was not trained on
    split = ours.encode(sample, add_special_tokens=False).tokens
    assert split == trainers_own.encode(sample, add_special_tokens=False).tokens
    assert len(split) > 300 and "[UNK]" not in split


def test_seeded_wordpiece_pieces_give_the_same_vocabulary_every_time():
    """The trainer breaks ties between merges of equal count by ids it gives the ##pieces in hash order: on
    a corpus whose vocabulary stops at min_frequency, the same texts gave a different vocabulary in each of
    three trainings (4145 to 4148 tokens, in the rehearsal of the real run). With the pieces seeded in a
    fixed order, every training gives the same file; punctuation, a word of its own, gets no piece."""
    from cramming.data import embedded
    from cramming.data.tokenizer import word_inner_characters

    docs = (doc["text"] for doc in embedded.iter_stdlib_docs() if len(doc["text"]) >= 400)
    norm_cfg, tok_cfg = NormalizerConfig(), TokenizerConfig(kind="wordpiece", vocab_size=32768)
    norm = build_normalizer(norm_cfg)
    texts = [norm.normalize_str(next(docs)) for _ in range(150)]
    inner = word_inner_characters([texts])
    assert set(inner) >= set("abcxyz019") and not set(inner) & set(".,;()[]-_ \n")
    files = {train_tokenizer([texts], tok_cfg, norm_cfg, inner_chars=inner).to_str() for _ in range(4)}
    assert len(files) == 1
    tok = train_tokenizer([texts], tok_cfg, norm_cfg, inner_chars=inner)
    assert tok.get_vocab_size() < tok_cfg.vocab_size  # stopped by min_frequency: where the ties were
    assert [t.content for t in tok.get_added_tokens_decoder().values()] == list(SPECIAL_TOKENS)
    assert "[UNK]" not in tok.encode(texts[7], add_special_tokens=False).tokens


def _non_english(n: int) -> list[str]:
    """Texts in other scripts, each word frequent enough for the trainer to keep its characters."""
    words = ["東京都", "москва", "ελληνικά", "العربية", "हिन्दी"]
    return [" ".join(words[(i + j) % len(words)] for j in range(40)) for i in range(n)]


def _entries(tok) -> dict[str, int]:
    vocab = list(tok.get_vocab())
    pieces = [v.removeprefix("##") for v in vocab]
    return {
        "non_ascii": sum(not v.isascii() for v in vocab),
        "chars": len({p for p in pieces if len(p) == 1}),
    }


def test_ascii_only_and_limit_alphabet_bound_the_vocabulary(wiki_texts):
    raw = wiki_texts[:60] + _non_english(30)

    def train(norm_cfg, tok_cfg):
        norm = build_normalizer(norm_cfg)
        texts = [norm.normalize_str(t) for t in raw]
        return train_tokenizer([texts], tok_cfg, norm_cfg, length=len(texts))

    everything = _entries(
        train(NormalizerConfig(ascii_only=False), TokenizerConfig(vocab_size=2000, limit_alphabet=None))
    )
    assert everything["non_ascii"] > 40  # the other scripts' characters, plain and ##
    ascii_tok = train(NormalizerConfig(), TokenizerConfig(vocab_size=2000, limit_alphabet=None))
    assert _entries(ascii_tok)["non_ascii"] == 0
    assert ascii_tok.token_to_id("[UNK]") not in ascii_tok.encode(raw[-1] + " " + raw[0][:500]).ids
    # the 40 most frequent characters are all ASCII letters, digits and punctuation of the English text
    limited = _entries(
        train(NormalizerConfig(ascii_only=False), TokenizerConfig(vocab_size=2000, limit_alphabet=40))
    )
    assert limited["chars"] <= 40 < everything["chars"]
    assert limited["non_ascii"] == 0


def test_tokenizer_config_checks_the_alphabet_limit():
    with pytest.raises(ConfigError, match=r"data.tokenizer.limit_alphabet.*at least 256 for bpe"):
        TokenizerConfig(kind="bpe", limit_alphabet=100)
    with pytest.raises(ConfigError, match=r"data.tokenizer.min_frequency"):
        TokenizerConfig(min_frequency=0)
    assert (
        TokenizerConfig(kind="unigram").limit_alphabet == 1000
    )  # accepted; the unigram trainer has no limit


def test_ascii_only_applies_in_the_pipeline_and_its_cache_key(tmp_path, wiki_texts, data_config):
    """The pipeline strips non-ASCII once, before tokenizing without the tokenizer's own normalizer pass; the
    rows equal what the saved tokenizer (which strips it too) makes of the raw text."""
    folder = tmp_path / "c"
    folder.mkdir()
    articles = [t for t in wiki_texts if len(t) > 1000][:30]  # none dropped by the length filter
    texts = [t + " " + other for t, other in zip(articles, _non_english(30), strict=True)]
    _write_jsonl(folder / "a.jsonl", texts)
    base = {"ordering": "none", "validation_fraction": 0.0, "filter.max_tokens_per_char_vs_median": None}
    data = prepare_pretraining_data(data_config(folder, base), tmp_path / "cache")
    assert _entries(data.tokenizer)["non_ascii"] == 0
    stream = []
    for text in texts:
        stream += data.tokenizer.encode(text, add_special_tokens=False).ids + [data.special.sep]
    rows = _all_rows(data.train)
    np.testing.assert_array_equal(rows.ravel(), np.array(stream[: rows.size]))
    assert data.tokenizer.token_to_id("[UNK]") not in stream

    kept = data_config(folder, base | {"normalizer.ascii_only": False})
    assert cache_dir_for(kept, tmp_path / "cache") != data.path
    kept_data = prepare_pretraining_data(kept, tmp_path / "cache")
    assert _entries(kept_data.tokenizer)["non_ascii"] > 0


# ---------------------------------------------------------------- the tokenizer's training sample


def _two_sources(tmp_path, wiki_texts, data_config, overrides):
    """Source `wiki`: 60 articles; source `made_up`: 20 texts of a word found nowhere else."""
    for name, texts in (
        ("wiki", wiki_texts[:60]),
        ("made_up", ["the zorblaxian council met again. " * 30] * 20),
    ):
        (tmp_path / name).mkdir()
        _write_jsonl(tmp_path / name / "a.jsonl", [f"{i}: {t}" for i, t in enumerate(texts)])
    cfg = data_config(tmp_path / "wiki", {"validation_fraction": 0.0} | overrides)
    cfg.sources = {
        "wiki": cfg.sources["local"],
        "made_up": SourceConfig(kind="local", files=str(tmp_path / "made_up")),
    }
    return cfg


def test_tokenizer_sample_draws_from_every_source(tmp_path, wiki_texts, data_config, caplog):
    cfg = _two_sources(tmp_path, wiki_texts, data_config, {"tokenizer.max_train_entries": 40})
    with caplog.at_level(logging.INFO, logger="cramming"):
        data = prepare_pretraining_data(cfg, tmp_path / "cache")
    kept = {"wiki": data.stats["documents_after_dedup"] - 20, "made_up": 20}
    # exact shares of 40 by largest remainder
    expected = {name: round(40 * n / sum(kept.values())) for name, n in kept.items()}
    assert sum(expected.values()) == 40
    assert data.stats["tokenizer_train_documents"] == expected
    assert f"{expected['wiki']} from wiki, {expected['made_up']} from made_up" in caplog.text
    # the first 40 documents would all have been Wikipedia: the second source's word would be unknown
    assert data.tokenizer.encode("zorblaxian", add_special_tokens=False).tokens == ["zorblaxian"]


def test_tokenizer_sample_is_seeded_and_exact():
    import datasets

    sources = ["a"] * 70 + ["b"] * 25 + ["c"] * 5
    docs = datasets.Dataset.from_dict({"text": [str(i) for i in range(100)], "source": sources})
    first = pipeline_module._tokenizer_sample(docs, 11, seed=0)
    assert pipeline_module._count_by_source(first) == {"a": 8, "b": 3}  # 7.7, 2.75, 0.55 -> 8, 3, 0
    assert first["text"] == pipeline_module._tokenizer_sample(docs, 11, seed=0)["text"]
    assert first["text"] != pipeline_module._tokenizer_sample(docs, 11, seed=1)["text"]
    assert len(pipeline_module._tokenizer_sample(docs, 100, seed=0)) == 100


# ---------------------------------------------------------------- packing


def test_join_with_separator():
    values = np.array([1, 2, 3, 4, 5, 6], dtype=np.uint16)
    offsets = np.array([0, 2, 2, 6])  # documents [1 2], [], [3 4 5 6]
    assert join_with_separator(values, offsets, 9).tolist() == [1, 2, 9, 9, 3, 4, 5, 6, 9]


@pytest.mark.parametrize(
    ("seq_length", "row_start", "segments"),
    [
        pytest.param(16, "none", "none", marks=pytest.mark.slow),
        (128, "none", "none"),
        pytest.param(16, "cls", "none", marks=pytest.mark.slow),
        (64, "none", "sentence"),
    ],
)
def test_rows_are_exact_and_reproduce_the_documents(
    tmp_path, corpus, data_config, seq_length, row_start, segments
):
    """Every row has seq_length tokens; the rows, concatenated, are the documents joined with [SEP]. With
    data.row_start=cls each row is [CLS] and then the next seq_length - 1 tokens of that stream; with
    data.segments=sentence a document is its sentences joined with [SEP]."""
    cfg = data_config(
        corpus,
        {
            "seq_length": seq_length,
            "row_start": row_start,
            "segments": segments,
            "ordering": "none",
            "validation_fraction": 0.0,
            "filter.min_chars": 1,
            "filter.max_tokens_per_char_vs_median": None,
        },
    )
    data = prepare_pretraining_data(cfg, tmp_path / "cache")
    rows = _all_rows(data.train)
    assert rows.ndim == 2 and rows.shape[1] == seq_length
    assert data.train.features["input_ids"].length == seq_length
    # an independent tokenization of the raw texts (the tokenizer carries the normalizer)
    texts = [json.loads(line)["text"] for line in (corpus / "wiki.jsonl").read_text().splitlines()]
    stream = []
    for text in texts:
        # the sentence rule itself is checked in test_sentence_segments; here, that each of its lines is one
        # segment of the stream, closed by [SEP]
        parts = SEGMENTS["sentence"](text).split("\n") if segments == "sentence" else [text]
        for part in (p for p in parts if p.strip()):
            stream += data.tokenizer.encode(part, add_special_tokens=False).ids + [data.special.sep]
    if row_start == "cls":
        assert np.all(rows[:, 0] == data.special.cls)
        rows = rows[:, 1:]
    n = rows.size
    assert len(stream) - n < rows.shape[1]  # only the last partial row is dropped
    np.testing.assert_array_equal(rows.ravel(), np.array(stream[:n]))
    assert data.stats["train_tokens"] == len(stream)


@pytest.mark.parametrize(
    ("raw", "lines"),
    [
        ("It rains. The cat sleeps! Does it? Yes.", ["It rains.", "The cat sleeps!", "Does it?", "Yes."]),
        ('He said "Go." Then 3 left.', ['He said "Go."', "Then 3 left."]),
        (
            "J. R. R. Tolkien wrote it. The U.S. Army came.",
            ["J. R. R. Tolkien wrote it.", "The U.S. Army came."],
        ),
        ("pi is 3.14 today. e.g. this stays.", ["pi is 3.14 today. e.g. this stays."]),  # no capital after
        ("One line.\nAnother line.", ["One line.", "Another line."]),
    ],
)
def test_sentence_segments(raw, lines):
    assert SEGMENTS["sentence"](raw).split("\n") == lines


def test_segments_are_checked_and_only_new_values_change_the_cache_key(corpus, data_config):
    with pytest.raises(ConfigError, match="data.segments"):
        data_config(corpus, {"segments": "words"})
    keys = {pipeline_module.cache_key(data_config(corpus, {"segments": s})) for s in SEGMENTS}
    assert len(keys) == len(SEGMENTS)
    assert pipeline_module.cache_key(data_config(corpus)) == pipeline_module.cache_key(
        data_config(corpus, {"segments": "none"})
    )


def test_row_start_is_checked_and_only_its_new_value_changes_the_cache_key(corpus, data_config, monkeypatch):
    with pytest.raises(ConfigError, match="data.row_start"):
        data_config(corpus, {"row_start": "sep"})
    plain, cls_rows = data_config(corpus), data_config(corpus, {"row_start": "cls"})
    assert pipeline_module.cache_key(plain) != pipeline_module.cache_key(cls_rows)
    # the default hashes as a config from before the option existed did, so earlier caches are found again
    default_key = pipeline_module.cache_key(plain)
    as_dict = pipeline_module.asdict
    monkeypatch.setattr(
        pipeline_module, "asdict", lambda cfg: {k: v for k, v in as_dict(cfg).items() if k != "row_start"}
    )
    assert pipeline_module.cache_key(plain) == default_key


@pytest.mark.slow
def test_orderings_and_row_cap(tmp_path, corpus, data_config):
    # The orderings are applied to one build's rows: WordPiece training in `tokenizers` breaks ties in a
    # per-process hash order, so two builds of the same config may differ in a few vocabulary entries.
    base = {"validation_fraction": 0.0, "seq_length": 32}
    data = prepare_pretraining_data(data_config(corpus, base | {"ordering": "none"}), tmp_path / "c")
    plain = _all_rows(data.train)

    def ordered(overrides):
        return _all_rows(
            pipeline_module._order(data.train, data_config(corpus, base | overrides), data.vocab_size)
        )

    shuffled, curriculum = ordered({"ordering": "random"}), ordered({"ordering": "curriculum"})
    assert not np.array_equal(plain, shuffled)
    for rows in (shuffled, curriculum):  # the same rows, reordered
        np.testing.assert_array_equal(np.unique(rows, axis=0), np.unique(plain, axis=0))
    # curriculum: rows of frequent tokens first, so mean token surprisal rises
    counts = np.bincount(plain.ravel(), minlength=data.vocab_size)
    surprisal = -np.log((counts + 1) / (counts.sum() + len(counts)))
    assert np.all(np.diff(surprisal[curriculum].mean(axis=1)) >= -1e-9)
    assert not np.array_equal(curriculum, plain)
    np.testing.assert_array_equal(ordered({"ordering": "none", "max_rows": 7}), plain[:7])
    np.testing.assert_array_equal(ordered({"ordering": "random", "max_rows": 7}), shuffled[:7])


def test_validation_split_holds_out_whole_documents(tmp_path, corpus, data_config):
    overrides = {"validation_fraction": 0.1, "filter.max_tokens_per_char_vs_median": None}
    data = prepare_pretraining_data(data_config(corpus, overrides), tmp_path / "cache")
    assert data.validation is not None and len(data.validation) > 0
    docs = data.stats["documents_after_dedup"]
    assert data.stats["validation_documents"] == round(0.1 * docs)
    assert data.stats["train_documents"] + data.stats["validation_documents"] == docs
    # no validation text appears in the training rows: check a distinctive 12-token window
    train = _all_rows(data.train).ravel()
    window = _all_rows(data.validation).ravel()[20:32]
    hits = np.flatnonzero(np.all(np.lib.stride_tricks.sliding_window_view(train, 12) == window, axis=1))
    assert len(hits) == 0


# ---------------------------------------------------------------- cache


def test_cache_is_reused_and_invalidated(tmp_path, corpus, data_config, caplog, monkeypatch):
    cfg = data_config(corpus)
    first = prepare_pretraining_data(cfg, tmp_path / "cache")

    def fail(*args, **kwargs):
        raise AssertionError("the cached data should have been used")

    with monkeypatch.context() as m, caplog.at_level(logging.INFO, logger="cramming"):
        m.setattr(pipeline_module, "_build", fail)
        second = prepare_pretraining_data(cfg, tmp_path / "cache")
    assert second.path == first.path
    assert "skipping preprocessing" in caplog.text
    np.testing.assert_array_equal(_all_rows(second.train), _all_rows(first.train))
    # the data config, the tokenizer and the data are saved together
    assert {"dataset", "tokenizer.json", "data_config.yaml", "stats.json"} <= {
        p.name for p in first.path.iterdir()
    }

    changed = data_config(corpus, {"seq_length": 32})
    assert cache_dir_for(changed, tmp_path / "cache") != first.path
    assert cache_dir_for(data_config(corpus, {"tokenizer.kind": "bpe"}), tmp_path / "cache") != first.path
    # the label is not part of the hash, only of the folder name
    relabeled = data_config(corpus)
    relabeled.name = "other"
    assert cache_dir_for(relabeled, tmp_path / "cache").name.split("-")[-1] == first.path.name.split("-")[-1]
    # new file content makes a new cache even with the same config
    _write_jsonl(corpus / "wiki.jsonl", ["An entirely different text about the history of bridges. " * 5] * 3)
    assert cache_dir_for(cfg, tmp_path / "cache") != first.path


def test_a_copied_corpus_finds_its_cache_and_a_changed_byte_does_not(
    tmp_path, corpus, data_config, caplog, monkeypatch
):
    first = prepare_pretraining_data(data_config(corpus), tmp_path / "cache")
    copy = tmp_path / "another" / "machine"
    shutil.copytree(corpus, copy, copy_function=shutil.copyfile)  # new modification times
    assert os.stat(copy / "wiki.jsonl").st_mtime_ns != os.stat(corpus / "wiki.jsonl").st_mtime_ns

    def fail(*args, **kwargs):
        raise AssertionError("the cached data should have been used")

    with monkeypatch.context() as m, caplog.at_level(logging.INFO, logger="cramming"):
        m.setattr(pipeline_module, "_build", fail)
        moved = prepare_pretraining_data(data_config(copy), tmp_path / "cache")
    assert moved.path == first.path
    assert "found processed data" in caplog.text and "skipping preprocessing" in caplog.text
    # one byte of one document changed: another cache
    path = copy / "wiki.jsonl"
    content = path.read_bytes()
    at = content.index(b"e", len(content) // 2)
    path.write_bytes(content[:at] + b"E" + content[at + 1 :])
    assert cache_dir_for(data_config(copy), tmp_path / "cache") != first.path


def test_interrupted_build_leaves_no_cache(tmp_path, corpus, data_config, monkeypatch):
    cfg = data_config(corpus)

    def crash(*args, **kwargs):
        raise KeyboardInterrupt

    with monkeypatch.context() as m:
        m.setattr(pipeline_module, "_pack", crash)
        with pytest.raises(KeyboardInterrupt):
            prepare_pretraining_data(cfg, tmp_path / "cache")
    assert [p.name for p in (tmp_path / "cache").iterdir() if p.name not in ("hf", FILE_HASHES)] == []
    data = prepare_pretraining_data(cfg, tmp_path / "cache")  # and a later run builds it cleanly
    assert len(data.train) > 0


def test_loading_an_incomplete_folder_is_a_clear_error(tmp_path):
    with pytest.raises(DataSourceError, match="no complete processed dataset"):
        load_pretraining_data(tmp_path)


def test_too_little_text_is_a_clear_error(tmp_path, data_config):
    folder = tmp_path / "c"
    folder.mkdir()
    _write_jsonl(
        folder / "a.jsonl", ["A single short sentence that is long enough to pass the length filter."]
    )
    with pytest.raises(DataSourceError, match="fewer than one row"):
        prepare_pretraining_data(data_config(folder, {"validation_fraction": 0.0}), tmp_path / "cache")


def test_every_text_filtered_out_names_the_filter_and_the_fix(tmp_path, data_config):
    folder = tmp_path / "c"
    folder.mkdir()
    (folder / "a.txt").write_text("A first short line.\nA second one.\n")
    cfg = data_config(folder, {"sources.local.txt_unit": "line"})
    with pytest.raises(
        DataSourceError, match=r"no text is left.*of 2 entries read from data.sources.local"
    ) as err:
        prepare_pretraining_data(cfg, tmp_path / "cache")
    assert "0 are empty after data.normalizer" in str(err.value)
    assert "2 are shorter than data.filter.min_chars=64" in str(err.value)
    assert "lower data.filter.min_chars (now 64)" in str(err.value)


def test_text_in_other_scripts_only_points_at_ascii_only(tmp_path, data_config):
    folder = tmp_path / "c"
    folder.mkdir()
    _write_jsonl(folder / "a.jsonl", _non_english(3) + [""])
    with pytest.raises(DataSourceError, match=r"1 are empty, 3 are empty after data.normalizer") as err:
        prepare_pretraining_data(data_config(folder), tmp_path / "cache")
    assert "data.normalizer.ascii_only=false" in str(err.value)


# ---------------------------------------------------------------- end to end on the shared Wikipedia data


@pytest.mark.slow
def test_pretrain_dryrun_on_shared_wikipedia(tmp_path, wiki_shard):
    """`pretrain.py dryrun=true` on a slice of a real shard: preprocesses once, then finds the cache."""
    args = [
        sys.executable,
        str(REPO / "pretrain.py"),
        "data=local",
        f"data.sources.local.files={wiki_shard}",
        "data.sources.local.max_entries=300",
        "data.tokenizer.vocab_size=4096",
        "dryrun=true",
        f"base_dir={tmp_path}",
        "impl.num_proc=2",
    ]
    first = subprocess.run(args, capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert first.returncode == 0, first.stderr[-3000:]
    assert "preprocessed" in first.stdout + first.stderr
    second = subprocess.run(args, capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert second.returncode == 0, second.stderr[-3000:]
    assert "skipping preprocessing" in second.stdout + second.stderr

    (cache,) = [p for p in (tmp_path / "data").iterdir() if p.name.startswith("local-")]
    data = load_pretraining_data(cache)
    assert data.vocab_size == 4096
    assert len(data.train) > 1000
    stats = data.stats
    assert stats["raw_documents"] == 300
    assert stats["documents_after_dedup"] <= stats["raw_documents"]
    # real English comes back out of the rows
    text = data.tokenizer.decode(_all_rows(data.train)[:20].ravel().tolist())
    words = text.split()
    assert words.count("the") / len(words) > 0.02


def test_the_identity_hashes_the_tokenizer_as_stats_and_run_cards_do(tmp_path, corpus, data_config):
    """A resumable state's tokenizer hash is the same value as stats.json's (and the run card's)."""
    data = prepare_pretraining_data(data_config(corpus), tmp_path / "cache")
    identity = data.identity()
    assert identity["tokenizer_sha256"] == data.stats["tokenizer_sha256"]
    assert (identity["train_rows"], identity["seq_length"]) == (len(data.train), data.seq_length)
