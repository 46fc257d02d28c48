"""`make rehearsal` (scripts/rehearsal.py): the real run's recipe through every stage on a CPU. It passes, and
what it says it did is in the files the stages left: run cards that show the recipe (data wikibooks read by
the hub loaders, crammed-bert, budget-triangle2, the batch ramp), a run stopped by SIGTERM and one resumed
from its state to the end of the budget, glue-sane scores, and an export transformers loads. Five to ten
minutes on two shared cores."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow
REPO = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def rehearsal(tmp_path_factory) -> tuple[Path, dict, str]:
    out = tmp_path_factory.mktemp("rehearsal") / "out"
    done = subprocess.run(
        [sys.executable, "scripts/rehearsal.py", "--out", str(out)],
        cwd=REPO, capture_output=True, text=True, timeout=2400,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    return out, json.loads((out / "rehearsal.json").read_text()), done.stdout


def card(run_dir: str) -> dict:
    return json.loads((Path(run_dir) / "run_card.json").read_text())


def test_every_stage_passed_and_said_what_it_ran(rehearsal):
    out, summary, stdout = rehearsal
    assert summary["failed"] is None
    assert list(summary["stages"]) == ["data", "pretrain", "resume", "glue", "export", "card"]
    assert all(stage["ok"] for stage in summary["stages"].values())
    for command in (
        "$ python pretrain.py budget=",
        "$ python eval.py checkpoint=",
        "$ python scripts/export_hf.py",
    ):
        assert command in stdout
    assert "rehearsal passed in" in stdout


def test_the_data_is_in_the_hub_layout_and_read_by_the_hub_loaders(rehearsal):
    out, summary, _ = rehearsal
    assert summary["stages"]["data"]["wikipedia_rows"] == 300
    assert summary["stages"]["data"]["bookcorpus_rows"] == 640
    assert sorted(p.name for p in (out / "hub" / "wikipedia" / "20231101.en").iterdir()) == [
        "train-00000-of-00002.parquet",
        "train-00001-of-00002.parquet",
    ]
    assert "config_name: 20231101.en" in (out / "hub" / "wikipedia" / "README.md").read_text()
    config = card(summary["stages"]["pretrain"]["run_dir"])["config"]
    sources = config["data"]["sources"]
    assert {name: source["kind"] for name, source in sources.items()} == {
        "wikipedia": "hub",
        "bookcorpus": "hub",
    }
    assert sources["wikipedia"]["path"] == str(out / "hub" / "wikipedia")
    assert sources["wikipedia"]["subset"] == "20231101.en"
    assert sources["bookcorpus"]["join_entries"] == 64  # the recipe's, as everything but the paths


def test_the_cards_show_the_real_recipe_with_only_budget_data_and_batch_sizes_scaled(rehearsal):
    _, summary, _ = rehearsal
    for part in ("pretrain", "resume"):
        config = card(summary["stages"][part]["run_dir"])["config"]
        train = config["train"]
        assert config["data"]["name"] == "wikibooks" and config["arch"]["name"] == "crammed-bert"
        assert (config["arch"]["num_layers"], config["arch"]["hidden_size"]) == (16, 768)
        assert train["lr_schedule"] == "budget-triangle2" and train["batch_size_ramp"] == 0.6
        assert (train["batch_size_start"], train["batch_size"], config["impl"]["microbatch_size"]) == (
            4,
            16,
            4,
        )
        assert config["data"]["tokenizer"]["vocab_size"] == 32768  # asked for; the small data gives fewer
    assert summary["stages"]["card"]["resume"]["overrides"] == sorted(
        ["base_dir", "budget", "data.sources.bookcorpus.path", "data.sources.wikipedia.path",
         "impl.cpu_threads", "impl.microbatch_size", "name", "resume", "train.batch_size",
         "train.batch_size_start"]
    )  # fmt: skip


def test_a_run_stopped_by_sigterm_resumes_to_the_end_of_its_budget(rehearsal):
    _, summary, _ = rehearsal
    stopped, resumed = summary["stages"]["pretrain"], summary["stages"]["resume"]
    assert stopped["exit"] == 143 and stopped["status"] == "interrupted" and stopped["updates"] >= 1
    assert Path(stopped["run_dir"], "state.pt").is_file()
    assert resumed["stop_reason"] == "budget" and resumed["updates"] > stopped["updates"]
    # the ramp: from batch_size_start (4) up; the last log window holds the run's last update, late in the budget
    assert resumed["last_batch"] >= resumed["first_batch"] >= 4 and resumed["last_batch"] > 4
    assert Path(resumed["run_dir"], "checkpoint", "model.safetensors").is_file()
    resumed_card = card(resumed["run_dir"])
    assert resumed_card["status"] == "ok"
    # its first update is logged, so the card's set-up is the set-up (loading the state), not its updates
    assert resumed_card["seconds"]["setup"] < resumed_card["seconds"]["train"]


def test_glue_sane_scores_the_checkpoint_and_transformers_loads_its_export(rehearsal):
    _, summary, _ = rehearsal
    glue = summary["stages"]["glue"]
    assert glue["recipe"] == "glue-sane" and glue["status"] == "ok"
    assert set(glue["scores"]) == {"MNLI-m", "MNLI-mm", "STS-B"}
    export = summary["stages"]["export"]
    assert export["model_type"] == "crammed_bert"
    assert export["loaded"].startswith("loaded CrammedBertForMaskedLM")
    assert Path(export["folder"], "README.md").is_file()  # the model card, with the run's provenance
