"""Raw sources: every local file format, the embedded corpus, and the hub's offline error."""

from __future__ import annotations

import gzip
import json
import os
import subprocess
import sys
import textwrap

import datasets
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from cramming.data import embedded
from cramming.data.config import SourceConfig
from cramming.data.sources import OFFLINE_HINT, load_source, resolve_local_files, source_fingerprint
from cramming.errors import DataSourceError, RunStopped


def _write_jsonl(path, texts, field="text", compress=False):
    opener = gzip.open if compress else open
    with opener(path, "wt", encoding="utf-8") as f:
        for i, t in enumerate(texts):
            f.write(json.dumps({"id": i, field: t}) + "\n")


@pytest.mark.parametrize("ending", [".jsonl", ".jsonl.gz", ".json"])
def test_json_lines_files(tmp_path, wiki_texts, ending):
    texts = wiki_texts[:5]
    _write_jsonl(tmp_path / f"part{ending}", texts, compress=ending.endswith(".gz"))
    ds = load_source(SourceConfig(kind="local", files=str(tmp_path / f"*{ending}")), tmp_path / "hf")
    assert ds.column_names == ["text"]
    assert ds["text"] == texts


def test_custom_text_field_and_missing_field(tmp_path, wiki_texts):
    folder = tmp_path / "data"
    folder.mkdir()
    _write_jsonl(folder / "a.jsonl", wiki_texts[:3], field="body")
    ds = load_source(SourceConfig(kind="local", files=str(folder), text_field="body"), tmp_path / "hf")
    assert ds["text"] == wiki_texts[:3]
    with pytest.raises(DataSourceError, match=r"no field 'text'.*'body'.*text_field"):
        load_source(SourceConfig(kind="local", files=str(folder)), tmp_path / "hf")


def test_parquet_files(tmp_path, wiki_texts):
    pq.write_table(pa.table({"text": wiki_texts[:4], "title": ["t"] * 4}), tmp_path / "a.parquet")
    ds = load_source(SourceConfig(kind="local", files=str(tmp_path / "a.parquet")), tmp_path / "hf")
    assert ds["text"] == wiki_texts[:4]


@pytest.mark.parametrize(("unit", "expected"), [("document", 2), ("paragraph", 5), ("line", 6)])
def test_txt_files_by_unit(tmp_path, unit, expected):
    folder = tmp_path / "data"
    folder.mkdir()
    (folder / "a.txt").write_text("First line.\nSecond line.\n\nNew paragraph.\n")
    (folder / "b.txt").write_text("One.\n\nTwo.\n\nThree.\n")
    ds = load_source(SourceConfig(kind="local", files=str(folder), txt_unit=unit), tmp_path / "hf")
    assert len([t for t in ds["text"] if t.strip()]) == expected


def test_folder_is_searched_recursively_and_in_order(tmp_path, wiki_texts):
    folder = tmp_path / "data"
    (folder / "sub").mkdir(parents=True)
    _write_jsonl(folder / "sub" / "b.jsonl", wiki_texts[2:4])
    _write_jsonl(folder / "a.jsonl", wiki_texts[:2])
    (folder / "notes.md").write_text("not a corpus file")
    files = resolve_local_files(str(folder))
    assert [os.path.basename(f) for f in files] == ["a.jsonl", "b.jsonl"]
    ds = load_source(SourceConfig(kind="local", files=str(folder)), tmp_path / "hf")
    assert ds["text"] == wiki_texts[:4]


def test_max_entries_and_join_entries(tmp_path, wiki_texts):
    files = str(tmp_path / "a.jsonl")
    _write_jsonl(files, wiki_texts[:10])
    capped = load_source(SourceConfig(kind="local", files=files, max_entries=6), tmp_path / "hf")
    assert capped["text"] == wiki_texts[:6]
    joined = load_source(
        SourceConfig(kind="local", files=files, max_entries=6, join_entries=4), tmp_path / "hf"
    )
    assert joined["text"] == ["\n".join(wiki_texts[:4]), "\n".join(wiki_texts[4:6])]


def test_no_matching_files_is_a_clear_error(tmp_path):
    with pytest.raises(
        DataSourceError, match=r"no readable text files match .*data.sources.*get_data.py wikipedia"
    ):
        resolve_local_files(str(tmp_path / "*.jsonl"))


def test_fingerprint_changes_with_file_content(tmp_path, wiki_texts):
    _write_jsonl(tmp_path / "a.jsonl", wiki_texts[:2])
    cfg = SourceConfig(kind="local", files=str(tmp_path / "a.jsonl"))
    before = source_fingerprint(cfg)
    _write_jsonl(tmp_path / "a.jsonl", wiki_texts[:3])
    assert source_fingerprint(cfg) != before


def _corpus(folder, texts_per_file: dict[str, list[str]]) -> SourceConfig:
    folder.mkdir(parents=True)
    for name, texts in texts_per_file.items():
        _write_jsonl(folder / name, texts)
    return SourceConfig(kind="local", files=str(folder))


def _later(path, seconds: int = 3600) -> None:
    """Move a file's modification time `seconds` on, as a copy made later would have it."""
    stat = os.stat(path)
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns + seconds * 10**9))


TEXTS = {
    "a.jsonl": ["The first file's text, about rivers."] * 3,
    "b.jsonl": ["The second one, about hills."] * 2,
}


def test_fingerprint_is_the_content_not_the_path_nor_the_time(tmp_path):
    original = _corpus(tmp_path / "here", TEXTS)
    cache = tmp_path / "cache"
    before = source_fingerprint(original, cache)
    assert str(tmp_path) not in before
    copy = _corpus(tmp_path / "copied" / "elsewhere", TEXTS)  # another path, written later
    _later(tmp_path / "copied" / "elsewhere" / "a.jsonl")
    assert source_fingerprint(copy, cache) == before
    assert source_fingerprint(copy) == before  # the same without the index of known hashes


def test_fingerprint_changes_with_one_byte_even_at_the_same_size_and_time(tmp_path):
    cfg = _corpus(tmp_path / "corpus", TEXTS)
    cache = tmp_path / "cache"
    before = source_fingerprint(cfg, cache)
    path = tmp_path / "corpus" / "b.jsonl"
    stat = os.stat(path)
    path.write_bytes(path.read_bytes().replace(b"hills", b"hilts", 1))
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns))  # the modification time put back
    assert os.stat(path).st_size == stat.st_size
    assert source_fingerprint(cfg, cache) != before


def test_fingerprint_follows_the_order_files_are_read_in(tmp_path):
    cache = tmp_path / "cache"
    one = source_fingerprint(_corpus(tmp_path / "one", TEXTS), cache)
    swapped = {"a.jsonl": TEXTS["b.jsonl"], "b.jsonl": TEXTS["a.jsonl"]}
    assert source_fingerprint(_corpus(tmp_path / "two", swapped), cache) != one
    # a file of 0 bytes is left out when read, so also from the fingerprint
    (tmp_path / "one" / "empty.jsonl").write_bytes(b"")
    assert source_fingerprint(SourceConfig(kind="local", files=str(tmp_path / "one")), cache) == one


def test_unchanged_files_are_not_read_again(tmp_path, monkeypatch):
    from cramming.data import sources

    cfg = _corpus(tmp_path / "corpus", TEXTS)
    cache = tmp_path / "cache"
    hashed = []
    real = sources.file_sha256
    monkeypatch.setattr(
        sources, "file_sha256", lambda path: hashed.append(os.path.basename(path)) or real(path)
    )
    first = source_fingerprint(cfg, cache)
    assert sorted(hashed) == ["a.jsonl", "b.jsonl"]
    assert (cache / sources.FILE_HASHES).exists()
    hashed.clear()
    assert source_fingerprint(cfg, cache) == first and hashed == []
    _later(tmp_path / "corpus" / "a.jsonl")  # touched, not changed: read once more, same fingerprint
    assert source_fingerprint(cfg, cache) == first and hashed == ["a.jsonl"]
    # a damaged index is only a shortcut lost
    (cache / sources.FILE_HASHES).write_text("{not json")
    hashed.clear()
    assert source_fingerprint(cfg, cache) == first and sorted(hashed) == ["a.jsonl", "b.jsonl"]


def test_a_stop_wrapped_by_datasets_is_a_stop_not_a_bad_file(tmp_path, monkeypatch):
    """A stop signal landing while `datasets` reads a file, wrapped in its generation error: the source
    reader lets the stop through instead of naming the file as unreadable."""
    (tmp_path / "a.jsonl").write_text('{"text": "fine"}\n')
    stop = RunStopped("SIGTERM", "preprocessing stopped; nothing of it is kept", resumable=False)

    def interrupted(*args, **kwargs):
        try:
            raise stop
        except BaseException as err:
            raise datasets.exceptions.DatasetGenerationError("An error occurred while generating") from err

    monkeypatch.setattr(datasets, "load_dataset", interrupted)
    with pytest.raises(RunStopped) as raised:
        load_source(SourceConfig(kind="local", files=str(tmp_path)), tmp_path / "hf")
    assert raised.value is stop
    with pytest.raises(RunStopped):
        load_source(SourceConfig(kind="hub", path="some/corpus"), tmp_path / "hf")


@pytest.mark.slow
def test_embedded_corpus_is_real_english_prose():
    docs = list(embedded.iter_stdlib_docs())
    text = " ".join(d["text"] for d in docs)
    assert len(docs) > 2000 and len(text) > 1_000_000
    words = text.lower().split()
    # function words of English prose are frequent, as in any real English text
    for word in ("the", "of", "and", "is", "to", "a"):
        assert words.count(word) / len(words) > 0.005, word
    assert any(d["source"] == "pydoc_data/topics.py" for d in docs)


def test_hub_unreachable_names_offline_alternatives(tmp_path):
    """The real `datasets` hub path in offline mode: fails fast with the embedded/local hint."""
    script = textwrap.dedent(
        f"""
        from cramming.data.config import SourceConfig
        from cramming.data.sources import load_source
        from cramming.errors import DataSourceError
        try:
            load_source(SourceConfig(kind="hub", path="wikimedia/wikipedia", subset="20231101.en"), {str(tmp_path)!r})
        except DataSourceError as err:
            print("ERROR:", err)
        """
    )
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
    out = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=120)
    assert "ERROR: could not reach the Hugging Face hub for hub dataset wikimedia/wikipedia" in out.stdout, (
        out.stderr
    )
    assert OFFLINE_HINT in out.stdout


# ---------------------------------------------------------------- unreadable local files


def test_empty_txt_file_is_named(tmp_path):
    (tmp_path / "empty.txt").write_bytes(b"")
    with pytest.raises(DataSourceError, match=r"every file of the source is empty \(0 bytes\): .*empty\.txt"):
        load_source(SourceConfig(kind="local", files=str(tmp_path)), tmp_path / "hf")


def test_empty_file_beside_others_is_left_out_with_a_warning(tmp_path, caplog):
    (tmp_path / "a.txt").write_text("One paragraph of text.\n\nAnother one.\n")
    (tmp_path / "b.txt").write_bytes(b"")
    with caplog.at_level("WARNING", logger="cramming"):
        ds = load_source(SourceConfig(kind="local", files=str(tmp_path)), tmp_path / "hf")
    assert [t.strip() for t in ds["text"]] == ["One paragraph of text.", "Another one."]
    assert "leaving out 1 empty file(s)" in caplog.text and "b.txt" in caplog.text


@pytest.mark.parametrize("name", ["data.txt", "data.jsonl"])
def test_binary_file_is_named_with_the_bad_byte(tmp_path, name):
    good = tmp_path / ("a.txt" if name.endswith(".txt") else "a.jsonl")
    good.write_text('{"text": "fine"}\n' if name.endswith(".jsonl") else "fine\n")
    # a PNG header: 0x89 is not a valid first byte of a UTF-8 sequence
    (tmp_path / name).write_bytes(b"ok\n" + b"\x89PNG\r\n\x1a\n" + bytes(range(256)))
    with pytest.raises(DataSourceError, match=rf"{name} is not UTF-8 text: byte 0x89 at offset 3"):
        load_source(SourceConfig(kind="local", files=str(tmp_path)), tmp_path / "hf")
