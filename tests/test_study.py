"""`python -m cramming.study` end to end on the embedded corpus (no data needed): a tiny model at 0 and 1 minute
of budget with two seeds, stopped in the middle of its first pretraining and continued by the same command,
then reported; with BLiMP in CRAMMING_DATA, its floor and BLiMP on two pairs of each paradigm."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import data_dir

from cramming.job.runcard import cards_under
from cramming.study.plan import normalized

REPO = Path(__file__).resolve().parent.parent
PRETRAIN = [
    "arch=tiny", "data=embedded", "data.seq_length=32", "impl.microbatch_size=8", "train.batch_size=16",
    "train.batch_size_ramp=0", "impl.cpu_threads=1", "impl.num_workers=0", "train.validation_rows=16",
    "train.log_every=5",
]  # fmt: skip


def study(*args: str, **kwargs) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "cramming.study", *args],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=900,
        **kwargs,
    )


@pytest.fixture(scope="module")
def tiny_study(tmp_path_factory) -> Path:
    """The study, pretrained: stopped by SIGTERM once its first run has logged an update, then run again."""
    folder = tmp_path_factory.mktemp("study")
    (folder / "tiny.yaml").write_text(
        f"pretrain: [{', '.join(PRETRAIN)}]\nrecipes: {{tiny: []}}\nminutes: [0, 1]\nseeds: [0, 1]\n"
        f"stages: [pretrain]\nbase_dir: {folder / 'outputs'}\nkeep: {folder / 'runs'}\nout: {folder / 'report'}\n"
    )
    first = subprocess.Popen(
        [sys.executable, "-m", "cramming.study", "run", str(folder / "tiny.yaml")], cwd=REPO,
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    deadline = time.monotonic() + 600
    while not any(
        "loss" in p.read_text() for p in (folder / "outputs").glob("tiny-tiny-1/*/0/metrics.jsonl")
    ):
        assert first.poll() is None and time.monotonic() < deadline, first.communicate()[0][-3000:]
        time.sleep(0.5)
    first.send_signal(signal.SIGTERM)
    out = first.communicate(timeout=300)[0]
    assert first.returncode == 128 + signal.SIGTERM, out[-3000:]
    return folder


@pytest.mark.slow
def test_a_stopped_study_continues_its_run_in_the_same_folder_and_skips_what_is_done(tiny_study):
    (stopped, card), *_ = cards_under(tiny_study / "outputs" / "tiny-tiny-1")
    assert card["status"] == "interrupted" and (stopped / "state.pt").is_file()
    again = study("run", str(tiny_study / "tiny.yaml"))
    assert again.returncode == 0, again.stderr[-3000:]
    assert f"resuming from {stopped}/state.pt" in again.stdout + again.stderr
    cards = cards_under(tiny_study / "outputs" / "tiny-tiny-1")
    assert [f for f, c in cards if c["status"] == "ok"][0] == stopped and len(cards) == 2  # seed 1 ran afresh
    kept = {p.stem: json.loads(p.read_text()) for p in (tiny_study / "runs").glob("*.json")}
    assert set(kept) == {"tiny-0-s0", "tiny-0-s1", "tiny-1-s0", "tiny-1-s1"}
    assert all(r["pretraining_card"]["status"] == "ok" and "load_average" in r for r in kept.values())
    assert kept["tiny-0-s0"]["pretraining_card"]["metrics"]["updates"] == 1
    folders = {f for f, _ in cards_under(tiny_study / "outputs")}
    third = study("run", str(tiny_study / "tiny.yaml"))
    assert third.returncode == 0 and "nothing to do" in third.stderr
    assert {f for f, _ in cards_under(tiny_study / "outputs")} == folders  # nothing started
    report = study("report", str(tiny_study / "tiny.yaml"))
    assert report.returncode == 0, report.stderr[-3000:]
    text = (tiny_study / "report" / "report.md").read_text()
    assert "**tiny** 0 → 1 min" in text and "the seeds' spread" in text and "tiny-1-s1" in text


@pytest.mark.slow
def test_the_floor_and_blimp_of_the_study(tiny_study):
    blimp = data_dir("blimp")
    # parallel=2: the floor's twins are scored in two spawned processes
    settings = [f"blimp_dir={blimp}", "blimp_pairs=2", "stages=[floor,blimp]", "parallel=2"]
    done = study("run", str(tiny_study / "tiny.yaml"), *settings, env=os.environ | {"PYTHONUNBUFFERED": "1"})
    assert done.returncode == 0, done.stderr[-3000:]
    floor = json.loads((tiny_study / "runs" / "floor-tiny.json").read_text())
    assert len(floor["twins"]) == 3 and floor["pairs_per_paradigm"] == 2
    record = json.loads((tiny_study / "runs" / "tiny-1-s0.json").read_text())
    assert record["blimp"]["pairs_scored"] == 2 * record["blimp"]["paradigms"]
    report = study("report", str(tiny_study / "tiny.yaml"), *settings)
    assert report.returncode == 0, report.stderr[-3000:]
    text = (tiny_study / "report" / "report.md").read_text()
    assert "BLiMP by phenomenon, tiny" in text and "floor (mean, range)" in text
    assert (tiny_study / "report" / "curve.png").stat().st_size > 0


@pytest.mark.slow
def test_a_study_on_the_reference_clock_runs_two_at_once_and_each_buys_the_same_updates(tmp_path):
    """The reference clock lets runs share the machine: a one-minute study of two seeds, calibrated on this
    machine first, pretrains both at once, and each stops after the update its calibrated costs allow."""
    calibration = tmp_path / "calibration.json"
    measured = subprocess.run(
        [sys.executable, "-m", "cramming.calibrate", *PRETRAIN, f"base_dir={tmp_path / 'outputs'}",
         "--out", str(calibration), "--rounds", "2", "--microbatches", "2", "--warmup", "0"],
        cwd=REPO, capture_output=True, text=True, timeout=900,
    )  # fmt: skip
    assert measured.returncode == 0, measured.stderr[-3000:]
    pretrain = [*PRETRAIN, "train.clock=reference", f"train.calibration={calibration}"]
    (tmp_path / "reference.yaml").write_text(
        f"pretrain: [{', '.join(pretrain)}]\nrecipes: {{tiny: []}}\nminutes: [1]\nseeds: [0, 1]\nparallel: 2\n"
        f"stages: [pretrain]\nbase_dir: {tmp_path / 'outputs'}\nkeep: {tmp_path / 'runs'}\n"
        f"out: {tmp_path / 'report'}\n"
    )
    done = study("run", str(tmp_path / "reference.yaml"))
    assert done.returncode == 0, done.stderr[-3000:]
    cards = [card for _, card in cards_under(tmp_path / "outputs" / "reference-tiny-1")]
    assert len(cards) == 2 and all(card["status"] == "ok" for card in cards)
    clocks = [card["metrics"]["clock"] for card in cards]
    assert all(c["clock"] == "reference" and c["calibration"] == str(calibration) for c in clocks)
    assert cards[0]["metrics"]["updates"] == cards[1]["metrics"]["updates"] > 0  # the costs alone decide
    assert cards[0]["metrics"]["budget_hours_spent"] == cards[1]["metrics"]["budget_hours_spent"]
    (first, last) = sorted(cards, key=lambda card: card["started"])
    assert last["started"] < first["finished"]  # they ran at once
    report = study("report", str(tmp_path / "reference.yaml"))
    assert report.returncode == 0 and "reference clock" in (tmp_path / "report" / "report.md").read_text()


def test_a_key_given_twice_is_told_by_its_last_value_as_hydras_multirun_records_it():
    # the study's rate, then a recipe's: the run card holds train.optim.lr=0.003 alone, and the runner must
    # find that run finished (it once ran it again)
    study_then_recipe = ["train.optim.lr=2e-3", "arch.num_layers=6", "train.optim.lr=3e-3", "seed=0"]
    recorded = ["seed=0", "arch.num_layers=6", "train.optim.lr=0.003"]
    assert normalized(study_then_recipe) == normalized(recorded)
    assert normalized(["train.optim.lr=2e-3"]) != normalized(["train.optim.lr=3e-3"])
