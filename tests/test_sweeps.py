"""Hydra multiruns of both entry points on CPU: every job in its own folder with its run card, a failing job
recorded as failed while the others finish, and the report of the sweeps (one row per job, the plots)."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import data_dir

from cramming.job.runcard import RUN_CARD
from cramming.study.runs_report import build_report

REPO = Path(__file__).resolve().parent.parent
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
HAS_TENSORBOARD = importlib.util.find_spec("tensorboard") is not None

pytestmark = pytest.mark.slow


def environment() -> dict:
    return {**os.environ, "OMP_NUM_THREADS": "1", "HYDRA_FULL_ERROR": "1"}


def run(script: str, *overrides: str) -> subprocess.CompletedProcess:
    command = [sys.executable, str(REPO / script), "-m", *overrides]
    return subprocess.run(command, cwd=REPO, env=environment(), capture_output=True, text=True, timeout=600)


def cards(sweep_root: Path) -> list[dict]:
    (sweep,) = sweep_root.glob("multirun_*")  # one sweep per name in these tests
    found = sorted(sweep.glob(f"*/{RUN_CARD}"), key=lambda p: int(p.parent.name))
    return [json.loads(p.read_text()) for p in found]


@pytest.fixture(scope="module")
def base_dir(tmp_path_factory, wiki_texts) -> Path:
    """A tiny local corpus (120 Wikipedia articles) for the sweeps of this module."""
    base = tmp_path_factory.mktemp("sweeps")
    (base / "corpus.txt").write_text("\n\n".join(wiki_texts))
    return base


@pytest.fixture(scope="module")
def pretrain_sweep(base_dir, glue_dir_module) -> subprocess.CompletedProcess:
    """Three jobs: two tiny pretrainings (one with each optimizer) and one with an invalid budget."""
    return run(
        "pretrain.py",
        "name=pre",
        f"base_dir={base_dir}",
        "arch=tiny",
        "data=local",
        f"data.sources.local.files={base_dir / 'corpus.txt'}",
        "data.tokenizer.vocab_size=512",
        "data.seq_length=64",
        "impl.device=cpu",
        "impl.cpu_threads=1",
        "impl.num_workers=0",
        "impl.num_proc=1",
        "impl.microbatch_size=16",
        "train.batch_size=32",
        "train.log_every=5",
        "anytime.at=[1.0]",
        f"anytime.recipe.glue_dir={glue_dir_module}",
        "anytime.recipe.tasks=[RTE]",
        "anytime.recipe.max_train_examples=32",
        "anytime.recipe.max_eval_examples=32",
        *(["trackers=[tensorboard]"] if HAS_TENSORBOARD else []),
        "budget=0.004,-1",  # 14 s; set-up is on the budget's clock and takes seconds on a loaded CPU
        "train/optim=adamw,adamw_8bit",
    )


@pytest.fixture(scope="module")
def glue_dir_module() -> Path:
    return data_dir("glue")


@pytest.fixture(scope="module")
def eval_sweep(base_dir, pretrain_sweep, glue_dir_module) -> subprocess.CompletedProcess:
    checkpoint = Path(cards(base_dir / "pre")[0]["run_dir"])
    return run(
        "eval.py",
        "name=glue",
        f"base_dir={base_dir}",
        f"checkpoint={checkpoint}",
        f"eval.glue_dir={glue_dir_module}",
        "eval.tasks=[RTE,SST-2]",
        "eval.epochs=1",
        "eval.max_train_examples=32",
        "eval.max_eval_examples=32",
        "impl.device=cpu",
        "eval.optim.name=adamw,adamw_8bit",
    )


def test_pretrain_multirun_writes_a_card_per_job(pretrain_sweep, base_dir):
    found = cards(base_dir / "pre")
    ok = [card for card in found if card["status"] == "ok"]
    assert len(found) == 4 and len(ok) == 2, pretrain_sweep.stderr[-4000:]
    for card in ok:
        assert card["job"]["multirun"] and card["config"]["budget"] == 0.004
        assert Path(card["run_dir"], "checkpoint", "model.safetensors").is_file()
        assert card["data"]["cache_key"].startswith("local-") and len(card["data"]["tokenizer_sha256"]) == 64
        assert len(card["git"]["commit"]) == 40 and isinstance(card["git"]["dirty"], bool)
        assert card["packages"]["torch"] and card["device"]["cpu"]
        assert set(card["seconds"]) == {"data", "setup", "compile", "train", "eval", "total"}
        assert card["seconds"]["train"] > 0 and card["metrics"]["updates"] > 0
        assert card["metrics"]["loss"] > 0 and card["metrics"]["val_loss"] > 0
        (anytime,) = card["metrics"]["anytime"]
        assert anytime["anytime_fraction"] == 1.0 and 0.0 <= anytime["anytime"]["RTE"] <= 1.0
        if HAS_TENSORBOARD:
            assert any(Path(card["run_dir"], "tensorboard").glob("events.out.tfevents.*"))
        assert (
            card["job"]["command"].startswith("python pretrain.py ")
            and "budget=0.004" in card["job"]["command"]
        )
    assert [card["config"]["train"]["optim"]["name"] for card in ok] == ["adamw", "adamw_8bit"]


def test_a_failing_job_is_recorded_and_the_sweep_goes_on(pretrain_sweep, base_dir):
    found = cards(base_dir / "pre")
    failed = [card for card in found if card["status"] == "failed"]
    assert [card["job"]["num"] for card in failed] == [2, 3]  # budget=-1 with each optimizer
    assert all("bad value for `budget`: -1" in card["error"] for card in failed)
    # every job ran; the sweep still says that some failed
    assert pretrain_sweep.returncode == 1
    assert "2 of 4 jobs of the sweep" in pretrain_sweep.stdout + pretrain_sweep.stderr


def test_eval_multirun_writes_a_card_per_job(eval_sweep, base_dir):
    assert eval_sweep.returncode == 0, eval_sweep.stderr[-4000:]
    found = cards(base_dir / "glue")
    assert [card["status"] for card in found] == ["ok", "ok"]
    assert [card["metrics"]["optimizer"] for card in found] == ["adamw", "adamw_8bit"]
    for card in found:
        assert set(card["metrics"]["scores"]) == {"RTE", "SST-2"}
        assert card["data"]["pretraining_run_card"].endswith(f"/0/{RUN_CARD}")
        assert card["seconds"]["eval"] > 0


def test_report_of_both_sweeps(pretrain_sweep, eval_sweep, base_dir, tmp_path):
    report = build_report(base_dir, tmp_path).read_text()
    rows = [line for line in report.splitlines() if line.startswith(("| pre/", "| glue/"))]
    assert len(rows) == 6, report  # one per job: four pretraining jobs, two evaluations
    for name in ("loss", "schedule", "throughput", "glue", "anytime"):
        data = (tmp_path / f"{name}.png").read_bytes()
        assert data[:8] == PNG_SIGNATURE and len(data) > 15_000, name
