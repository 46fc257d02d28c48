"""scripts/get_data.py: the GLUE folder it writes is what eval.glue_dir reads, the Wikipedia shards are what the
CPU study's recipe reads, and without network each command fails in one line. The hub is replaced by small
datasets in the hub's own columns and splits, handed in where the one network call of each command would be."""

from __future__ import annotations

import gzip
import importlib
import json
import os
import subprocess
import sys
from pathlib import Path

import datasets
import pytest
from conftest import WIKI_SHARD, data_dir
from hydra import compose, initialize_config_dir

from cramming.config import CONF_DIR, register_configs, validate
from cramming.data.sources import load_source, resolve_local_files
from cramming.errors import DataSourceError
from cramming.eval import glue_data
from cramming.eval.config import EvalConfig
from cramming.eval.glue_data import load_local, write_local
from cramming.eval.tasks import GLUE_TASKS

REPO = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def get_data():
    return importlib.import_module("scripts.get_data")


# ------------------------------------------------------------------------------------------------------- GLUE

# a few rows per task, as the hub's nyu-mll/glue holds them (its column and split names; test labels are -1)
HUB_ROWS = {
    "rte": {
        "train": {"sentence1": ["A man\twalks.", "It rains."], "sentence2": ["He moves.", "It is\ndry."], "label": [0, 1]},
        "validation": {"sentence1": ["Birds fly."], "sentence2": ["Birds move."], "label": [0]},
        "test": {"sentence1": ["x"], "sentence2": ["y"], "label": [-1]},
    },
    "cola": {
        "train": {"sentence": ["The cat sat.", "Cat the sat."], "label": [1, 0]},
        "validation": {"sentence": ["\"Quoted\" words, fine."], "label": [1]},
        "test": {"sentence": ["z"], "label": [-1]},
    },
    "stsb": {
        "train": {"sentence1": ["A dog runs.", "Two men."], "sentence2": ["A dog is running.", "A cat."], "label": [4.75, 0.2]},
        "validation": {"sentence1": ["Rain."], "sentence2": ["Snow."], "label": [1.8]},
        "test": {"sentence1": ["a"], "sentence2": ["b"], "label": [-1.0]},
    },
    "mnli": {
        "train": {"premise": ["He sleeps.", "She reads."], "hypothesis": ["He rests.", "She sings."], "label": [0, 2]},
        "validation_matched": {"premise": ["It is red."], "hypothesis": ["It has a colour."], "label": [0]},
        "validation_mismatched": {"premise": ["Dogs bark."], "hypothesis": ["Cats bark."], "label": [1]},
        "test_matched": {"premise": ["p"], "hypothesis": ["h"], "label": [-1]},
    },
}  # fmt: skip


def one_line(text: str) -> str:
    """A text as the TSV files hold it: tabs and line breaks would end its field or row."""
    return text.replace("\t", " ").replace("\n", " ")


@pytest.fixture
def local_hub(tmp_path, monkeypatch) -> Path:
    """nyu-mll/glue's four tasks above saved with `datasets`; the hub call reads them instead."""
    hub = tmp_path / "hub"
    for config, splits in HUB_ROWS.items():
        datasets.DatasetDict(
            {split: datasets.Dataset.from_dict(columns | {"idx": list(range(len(columns["label"])))})
             for split, columns in splits.items()}
        ).save_to_disk(hub / config)  # fmt: skip
    monkeypatch.setattr(
        glue_data, "hub_dataset", lambda task, cache_dir=None: datasets.load_from_disk(hub / task.hub_config)
    )
    return hub


def test_the_glue_command_writes_the_folder_eval_glue_dir_reads(get_data, local_hub, tmp_path):
    out = tmp_path / "data" / "glue"
    assert get_data.main(["glue", "--out", str(out), "--tasks", "RTE", "CoLA", "STS-B", "MNLI"]) == 0
    assert sorted(p.relative_to(out).as_posix() for p in out.rglob("*") if p.is_file()) == [
        "CoLA/dev.tsv", "CoLA/train.tsv", "MNLI/dev_matched.tsv", "MNLI/dev_mismatched.tsv", "MNLI/train.tsv",
        "RTE/dev.tsv", "RTE/train.tsv", "STS-B/dev.tsv", "STS-B/train.tsv",
    ]  # fmt: skip
    assert EvalConfig(glue_dir=str(out), tasks=["RTE", "CoLA", "STS-B", "MNLI"]).glue_dir == str(out)
    for name in ("RTE", "CoLA", "STS-B", "MNLI"):
        task = GLUE_TASKS[name]
        hub = HUB_ROWS[task.hub_config]
        local = load_local(task, out)  # what an evaluation with eval.glue_dir reads
        for split, _, hub_split in (("train", "", "train"), *task.eval_splits):
            rows = local[split or "dev"]
            assert rows["text_a"] == [one_line(t) for t in hub[hub_split][task.hub_text_a]], (name, split)
            if task.hub_text_b:
                assert rows["text_b"] == [one_line(t) for t in hub[hub_split][task.hub_text_b]], (name, split)
            assert rows["label"] == pytest.approx(hub[hub_split]["label"], abs=1e-6)
    assert not list(out.rglob("*.partial"))


def test_the_real_glue_copy_reads_the_same_after_a_write(tmp_path):
    # the writer against GLUE's original files: quotes, non-ASCII text, MRPC's byte-order mark, CoLA's columns
    real = data_dir("glue")
    for name in ("CoLA", "MRPC", "STS-B", "RTE"):
        task = GLUE_TASKS[name]
        original = load_local(task, real)
        write_local(task, original, tmp_path)
        again = load_local(task, tmp_path)
        for split in original:
            assert again[split]["text_a"] == original[split]["text_a"], (name, split)
            assert again[split]["text_b"] == original[split]["text_b"], (name, split)
            assert again[split]["label"] == pytest.approx(original[split]["label"], abs=1e-5), (name, split)


def test_a_test_split_label_is_refused_by_the_writer(tmp_path):
    splits = datasets.DatasetDict(
        {"train": datasets.Dataset.from_dict({"text_a": ["a"], "text_b": ["b"], "label": [-1]}),
         "dev": datasets.Dataset.from_dict({"text_a": ["a"], "text_b": ["b"], "label": [0]})}
    )  # fmt: skip
    with pytest.raises(DataSourceError, match="not a class id"):
        write_local(GLUE_TASKS["RTE"], splits, tmp_path)


# -------------------------------------------------------------------------------------------------- Wikipedia


def hub_articles(path: Path, count: int) -> datasets.IterableDataset:
    """`count` articles in wikimedia/wikipedia's columns, streamed as the hub streams them."""
    with open(path, "w", encoding="utf-8") as f:
        for i in range(count):
            text = (
                ""
                if i == 3
                else f"Article {i} opens here.\n\nSection {i}\n\nIts second paragraph, number {i}."
            )
            row = {
                "id": str(10 + i),
                "url": f"https://en.wikipedia.org/wiki/A{i}",
                "title": f"A{i}",
                "text": text,
            }
            f.write(json.dumps(row) + "\n")
    return datasets.load_dataset("json", data_files=str(path), split="train", streaming=True)


def test_the_wikipedia_command_writes_the_shards_the_cpu_study_reads(get_data, tmp_path, monkeypatch):
    stream = hub_articles(tmp_path / "hub.jsonl", 60)
    monkeypatch.setattr(get_data, "wikipedia_articles", lambda dump, revision: stream)
    monkeypatch.chdir(tmp_path)  # the recipe names its data relative to where it runs
    # shards of 150 characters: the articles have 63 to 66, so each shard closes on its third
    assert get_data.main(["wikipedia", "--shard-chars", "150"]) == 0
    register_configs()
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        cfg = validate(compose("pretrain", overrides=["+sweep=cpu-study"]))
    source = cfg.data.sources["local"]
    files = resolve_local_files(source.files)
    assert [Path(f).name for f in files] == [f"train-{i:05d}-of-00012.jsonl.gz" for i in range(12)]
    assert all(Path(f).resolve().parent == (tmp_path / "data" / "wikipedia").resolve() for f in files)
    rows = []
    for f in files:
        with gzip.open(f, "rt", encoding="utf-8") as lines:
            rows += [json.loads(line) for line in lines]
    assert len(rows) == 12 * 3 and all(list(row) == ["id", "url", "title", "text"] for row in rows)
    assert rows[0]["text"] == "Article 0 opens here.\nSection 0\nIts second paragraph, number 0."
    assert "13" not in [row["id"] for row in rows]  # the article without text is left out
    texts = load_source(source, tmp_path / "cache")["text"]  # as the recipe's pipeline reads them
    assert len(texts) == len(rows) and texts[0] == rows[0]["text"]


def test_running_out_of_articles_fails_and_leaves_no_half_written_shard(get_data, tmp_path):
    stream = hub_articles(tmp_path / "hub.jsonl", 10)
    with pytest.raises(DataSourceError, match="ran out in shard 3 of 12"):
        get_data.write_wikipedia_shards(stream, tmp_path / "out", 12, 150)
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == [
        f"train-{i:05d}-of-00012.jsonl.gz" for i in range(3)
    ]


# ------------------------------------------------------------------------------------------------------ BLiMP


def hub_paradigms(uids=("adjunct_island", "passive_1"), pairs=3):
    """Paradigms as the hub's nyu-mll/blimp holds them: its pair ids are integers, stored out of order."""
    for uid in uids:
        rows = [
            {"sentence_good": f"{uid} good {i}.", "sentence_bad": f"{uid} bad {i}.", "field": "syntax",
             "linguistics_term": "island_effects", "UID": uid, "pair_id": i, "lexically_identical": True}
            for i in reversed(range(pairs))
        ]  # fmt: skip
        yield uid, datasets.Dataset.from_list(rows)


def test_the_blimp_command_writes_the_folder_blimp_dir_reads(get_data, tmp_path, monkeypatch):
    from cramming.eval.blimp import BlimpConfig, load_pairs

    monkeypatch.setattr(get_data, "blimp_paradigms", lambda revision: hub_paradigms())
    assert get_data.main(["blimp", "--out", str(tmp_path / "blimp")]) == 0
    assert sorted(p.name for p in (tmp_path / "blimp").iterdir()) == [
        "adjunct_island.jsonl.gz",
        "passive_1.jsonl.gz",
    ]
    pairs = load_pairs(BlimpConfig(dir=str(tmp_path / "blimp")))
    assert [pair["pairID"] for pair in pairs["passive_1"]] == ["0", "1", "2"]
    assert (
        pairs["passive_1"][0]["sentence_good"] == "passive_1 good 0."
        and "pair_id" not in pairs["passive_1"][0]
    )


def test_the_test_data_command_writes_the_layout_the_tests_read(get_data, local_hub, tmp_path, monkeypatch):
    stream = hub_articles(tmp_path / "hub.jsonl", 60)
    monkeypatch.setattr(get_data, "wikipedia_articles", lambda dump, revision=None: stream)
    monkeypatch.setattr(get_data, "blimp_paradigms", lambda revision=None: hub_paradigms())
    monkeypatch.setattr(get_data, "GLUE_TASKS", {name: GLUE_TASKS[name] for name in ("RTE", "CoLA")})
    monkeypatch.setattr(get_data, "write_wikipedia_shards", _small_shards(get_data.write_wikipedia_shards))
    out = tmp_path / "test-data"
    assert get_data.main(["test-data", "--out", str(out)]) == 0
    assert (out / "glue" / "RTE" / "train.tsv").is_file() and (out / "glue" / "CoLA" / "dev.tsv").is_file()
    assert out.joinpath(*WIKI_SHARD).is_file()  # the shard the tests' fixtures read
    assert (out / "wikipedia-en-2015" / "train-00011-of-00012.jsonl.gz").is_file()
    assert (out / "blimp" / "passive_1.jsonl.gz").is_file()


def _small_shards(write):
    return lambda articles, out, shards=12, shard_chars=0: write(articles, out, shards, 150)


# ------------------------------------------------------------------------------------------------- no network


@pytest.mark.parametrize(
    "what, alternative",
    [("glue", "eval.glue_dir"), ("wikipedia", "data.sources.local.files"), ("blimp", "blimp.dir")],
)
def test_without_network_each_command_fails_in_one_line(tmp_path, what, alternative):
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "HF_HOME": str(tmp_path / "hf")}
    out = tmp_path / "out"
    done = subprocess.run(
        [sys.executable, str(REPO / "scripts" / "get_data.py"), what, "--out", str(out)],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert done.returncode == 2
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1, done.stderr
    assert "could not reach the Hugging Face hub" in lines[0] and "network" in lines[0]
    assert alternative in lines[0]
    assert not out.exists() or not any(out.rglob("*"))
