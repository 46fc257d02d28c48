"""The reference clock (train.clock=reference): every micro-batch and update is charged its calibrated cost,
the set-up once, so a budget buys the same updates whatever this machine's speed or load. Calibration files
(cramming.calibration), the command that measures them (cramming.calibrate), refusals, resume."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from test_train import SEQ, VOCAB, make_config, read_metrics, run_dir, send_signal_after, synthetic_data

from cramming import calibrate, calibration
from cramming.budget import Costs, ReferenceClock
from cramming.errors import ConfigError
from cramming.model.checkpoint import load_pretrained
from cramming.train import loop

REPO = Path(__file__).resolve().parent.parent
COSTS = {"setup_s": 30.0, "microbatch_s": 10.0, "update_s": 2.0}


def write_calibration(path: Path, cfg, vocab: int = VOCAB, seq: int = SEQ, costs: dict = COSTS) -> Path:
    """A calibration file holding one entry: the shape of `cfg` on data of `vocab` and `seq`, at `costs`."""
    shape = calibration.recipe_shape(cfg, vocab, seq)
    entry = {"shape": shape, **costs}
    document = {"format": calibration.FORMAT, "machine": {"cpu": "test CPU", "gpu": None}, "entries": {}}
    document["entries"][calibration.shape_key(shape)] = entry
    path.write_text(json.dumps(document))
    return path


def reference_config(tmp_path: Path, *overrides: str):
    """The tests' tiny recipe on the reference clock with a calibration of its own (written once)."""
    path = tmp_path / "calibration.json"
    cfg = make_config(tmp_path, "train.clock=reference", f"train.calibration={path}", *overrides)
    if not path.exists():
        write_calibration(path, cfg)
    return cfg


# ------------------------------------------------------------------------------------------------- the clock


def test_the_reference_clock_charges_costs_not_time():
    now = [0.0]
    clock = ReferenceClock(0.05, Costs(30.0, 10.0, 2.0), lambda: now[0], fresh=True, source={})
    assert clock.elapsed() == 30.0  # the set-up, once
    now[0] = 1e6  # a slow or loaded machine: its time is not charged
    assert clock.after_microbatch(None, completes_update=False) is None and clock.elapsed() == 40.0
    with clock.paused():  # nothing to pause
        now[0] += 50.0
    assert clock.after_microbatch(None, completes_update=True) is None and clock.elapsed() == 52.0
    assert (
        clock.after_microbatch("SIGTERM", completes_update=False) == "SIGTERM"
    )  # a signal before the budget
    resumed = ReferenceClock(0.05, Costs(30.0, 10.0, 2.0), lambda: 0.0, 62.0, fresh=False, source={})
    assert resumed.elapsed() == 62.0  # a resumed run continues without a second set-up
    assert clock.figures()["wall_h"] > 0 and "reference" in clock.describe()


def test_a_budget_buys_the_same_updates_however_long_they_take(tmp_path):
    """0.05 h = 180 reference seconds: 30 of set-up, then 12 per update (one micro-batch of 10, its step 2):
    the 13th update passes the budget. The wall clock of the run is irrelevant, so is the machine."""
    cfg = reference_config(tmp_path, "budget=0.05")
    result = loop.train(cfg, synthetic_data(tmp_path), run_dir(cfg))
    assert result.stop_reason == "budget" and result.updates == 13
    assert result.elapsed == 30.0 + 13 * 12.0
    assert result.clock["clock"] == "reference" and result.clock["sha256"]
    assert result.clock["calibration"] == str(tmp_path / "calibration.json")
    records = [r for r in read_metrics(result.run_dir) if "loss" in r]
    assert records[-1]["elapsed_h"] == pytest.approx(result.elapsed / 3600) and "wall_h" in records[-1]


def test_a_resumed_run_continues_the_reference_time_and_ends_as_an_uninterrupted_one(tmp_path, monkeypatch):
    data = synthetic_data(tmp_path)
    whole = reference_config(tmp_path, "budget=0.05", "name=whole")
    reference = loop.train(whole, data, run_dir(whole))
    send_signal_after(monkeypatch, 5, signal.SIGTERM)
    cfg = reference_config(tmp_path, "budget=0.05")
    first = loop.train(cfg, data, run_dir(cfg, "2026-01-01_00-00-00"))
    monkeypatch.undo()
    assert first.stop_reason == "SIGTERM" and first.elapsed == 30.0 + 5 * 12.0
    second = loop.train(
        reference_config(tmp_path, "budget=0.05", "resume=true"), data, run_dir(cfg, "2026-01-01_01-00-00")
    )
    assert (second.updates, second.elapsed) == (reference.updates, reference.elapsed)  # no second set-up
    ours = load_pretrained(second.checkpoint).model.state_dict()
    theirs = load_pretrained(reference.checkpoint).model.state_dict()
    for key, value in theirs.items():
        torch.testing.assert_close(ours[key], value, rtol=0, atol=0, msg=key)


def test_a_state_of_the_other_clock_is_refused_on_resume(tmp_path, monkeypatch):
    send_signal_after(monkeypatch, 2, signal.SIGTERM)
    cfg = make_config(tmp_path, "budget=1")
    loop.train(cfg, synthetic_data(tmp_path), run_dir(cfg))
    monkeypatch.undo()
    resumed = reference_config(tmp_path, "budget=1", "resume=true")
    with pytest.raises(ConfigError, match="another clock.*clock: 'wall' there, 'reference' here"):
        loop.train(resumed, synthetic_data(tmp_path), run_dir(cfg, "2026-01-01_01-00-00"))


# ------------------------------------------------------------------------------------------------ refusals


def test_a_shape_the_calibration_lacks_is_refused_naming_the_command(tmp_path):
    reference_config(tmp_path)  # the file holds the tiny recipe at micro-batch 8
    cfg = reference_config(tmp_path, "impl.microbatch_size=4")
    with pytest.raises(
        ConfigError, match=r"no entry for this recipe's shape.*micro-batch 4.*python -m cramming.calibrate"
    ):
        loop.train(cfg, synthetic_data(tmp_path), run_dir(cfg))
    assert not run_dir(cfg).joinpath("metrics.jsonl").exists()  # refused before training


@pytest.mark.parametrize(
    "content, message",
    [(None, "no calibration file"), ("{not json", "not a calibration file"), ('{"format": 99}', "format 99")],
)
def test_a_calibration_file_that_does_not_read_is_a_clear_error(tmp_path, content, message):
    path = tmp_path / "calibration.json"
    if content is not None:
        path.write_text(content)
    with pytest.raises(ConfigError, match=f"{message}.*python -m cramming.calibrate"):
        calibration.read_calibration(path)


@pytest.mark.parametrize(
    "overrides, key",
    [(["impl.microbatch_size=auto"], "impl.microbatch_size"),
     (["anytime.at=[0.5]", "anytime.charged=true"], "anytime.charged"),
     (["train.clock=sundial"], "train.clock")],
)  # fmt: skip
def test_settings_the_reference_clock_cannot_price_are_refused(tmp_path, overrides, key):
    with pytest.raises(ConfigError, match=key):
        make_config(tmp_path, "train.clock=reference", *overrides)


def test_the_shape_holds_what_costs_time_and_not_what_does_not(tmp_path):
    base = calibration.recipe_shape(make_config(tmp_path), VOCAB, SEQ)
    same = [("train.optim.lr=5e-3",), ("seed=3",), ("budget=5",), ("name=other",), ("train.clock=reference",)]
    other = [("impl.microbatch_size=4",), ("arch.num_layers=3",), ("impl.cpu_threads=2",), ("impl.precision=bf16",),
             ("train.optim.name=adamw_8bit",), ("train.dropout=0.1",)]  # fmt: skip
    key = calibration.shape_key(base)
    for overrides in same:
        assert (
            calibration.shape_key(calibration.recipe_shape(make_config(tmp_path, *overrides), VOCAB, SEQ))
            == key
        )
    for overrides in other:
        shape = calibration.recipe_shape(make_config(tmp_path, *overrides), VOCAB, SEQ)
        assert calibration.shape_key(shape) != key, overrides
    assert calibration.shape_key(calibration.recipe_shape(make_config(tmp_path), VOCAB + 1, SEQ)) != key


# -------------------------------------------------------------------------------------------- the command


@pytest.mark.slow  # prepares the embedded corpus and measures two recipes
def test_the_command_measures_a_recipe_and_merges_it_into_the_file(tmp_path, monkeypatch):
    out = tmp_path / "here.json"
    common = ["arch=tiny", "data=embedded", "data.tokenizer.vocab_size=1024", "data.seq_length=32",
              f"base_dir={tmp_path}", "impl.device=cpu", "impl.precision=fp32", "impl.microbatch_size=4",
              "impl.num_workers=0", "impl.cpu_threads=1", "train.batch_size=8"]  # fmt: skip
    timing = ["--rounds", "2", "--microbatches", "2", "--warmup", "0", "--out", str(out)]
    assert calibrate.main([*common, *timing, "--recipe", "", "--recipe", "arch.num_layers=1"]) == 0
    saved = json.loads(out.read_text())
    assert len(saved["entries"]) == 2 and saved["machine"]["cpu"] and "setup" in saved["charges"]
    for entry in saved["entries"].values():
        assert entry["microbatch_s"] > 0 and entry["update_s"] > 0 and entry["setup_s"] >= 0
        assert entry["samples"] == {"microbatch": 4, "update": 2}
        assert (
            entry["spread"]["microbatch_s"][0] <= entry["microbatch_s"] <= entry["spread"]["microbatch_s"][1]
        )
    # the file prices exactly these recipes: a run of one of them finds its costs
    cfg = make_config(tmp_path, *common, "train.clock=reference", f"train.calibration={out}")
    vocab = next(iter(saved["entries"].values()))["shape"]["vocab_size"]  # what the tokenizer made
    costs, source = calibration.reference_costs(str(out), calibration.recipe_shape(cfg, vocab, 32))
    assert costs.microbatch > 0 and source["sha256"] and source["machine"] == saved["machine"]["cpu"]
    # measured again: the entries runs were charged stay, unless --remeasure
    assert calibrate.main([*common, *timing]) == 0
    assert json.loads(out.read_text()) == saved
    assert calibrate.main([*common, *timing, "--remeasure"]) == 0
    again = json.loads(out.read_text())["entries"]
    assert again.keys() == saved["entries"].keys() and again != saved["entries"]
    # another machine's file is not written into
    monkeypatch.setattr(calibrate, "machine", lambda: {**saved["machine"], "cpu": "another CPU"})
    before = out.read_text()
    assert calibrate.main([*common, *timing]) == 2
    assert out.read_text() == before


# ------------------------------------------------------------------------------------ the committed files


@pytest.mark.slow
def test_with_a_committed_calibration_a_run_alone_and_one_beside_a_busy_process_end_identical(tmp_path):
    """The Done-when of the reference clock: `make demo`'s recipe on the committed calibration, once alone and
    once beside a process that keeps a core busy: the same updates and bit-identical weights; the run card
    names the clock and the calibration file."""
    command = [sys.executable, "pretrain.py", "+sweep=demo", "train.clock=reference", "budget=0.004",
               f"base_dir={tmp_path}", "train.validation_rows=0"]  # fmt: skip
    alone = subprocess.run([*command, "name=alone"], cwd=REPO, capture_output=True, text=True, timeout=900)
    assert alone.returncode == 0, alone.stderr[-3000:]
    busy = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        beside = subprocess.run(
            [*command, "name=beside"], cwd=REPO, capture_output=True, text=True, timeout=900
        )
    finally:
        busy.kill()
    assert beside.returncode == 0, beside.stderr[-3000:]
    cards = [
        json.loads(next((tmp_path / name).glob("*/run_card.json")).read_text())
        for name in ("alone", "beside")
    ]
    assert cards[0]["metrics"]["updates"] == cards[1]["metrics"]["updates"] > 0
    clock = cards[0]["metrics"]["clock"]
    assert (
        clock["clock"] == "reference"
        and clock["calibration"] == "conf/calibration/cpu-epyc-avx2.json"  # the same in every clone
        and clock["sha256"]
    )
    weights = [
        load_pretrained(next((tmp_path / name).glob("*/checkpoint"))).model.state_dict()
        for name in ("alone", "beside")
    ]
    for key, value in weights[0].items():
        assert torch.equal(value, weights[1][key]), key


@pytest.mark.slow
def test_a_missing_shape_is_refused_by_pretrain_in_one_line_naming_the_command(tmp_path):
    done = subprocess.run(
        [sys.executable, "pretrain.py", "+sweep=demo", "train.clock=reference", "impl.microbatch_size=8",
         f"base_dir={tmp_path}"],
        cwd=REPO, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    output = done.stdout + done.stderr
    assert done.returncode == 2, output[-2000:]
    line = next(line for line in output.splitlines() if "python -m cramming.calibrate" in line)
    assert "+sweep=demo" in line and "impl.microbatch_size=8" in line and "Traceback" not in output


def test_every_committed_calibration_reads_and_says_what_it_charges():
    files = sorted(calibration.CALIBRATION_DIR.glob("*.json"))
    assert files, "conf/calibration/ holds the reference machines' files"
    for path in files:
        saved = calibration.read_calibration(path)
        assert set(saved["charges"]) == {"setup", "microbatch", "update"} and saved["not_charged"]
        assert saved["machine"]["cpu"] and saved["entries"]
        for key, entry in saved["entries"].items():
            assert calibration.shape_key(entry["shape"]) == key, path
            assert min(entry["microbatch_s"], entry["update_s"]) > 0 and entry["setup_s"] >= 0


def test_the_precision_auto_chose_on_the_reference_machine_is_charged_as_auto():
    """impl.precision=fp32 replays a fp32 reference in its own rounding on a bf16 CPU: the same computation on
    the reference machine, so it costs what its auto entry costs; bf16 there was never measured: refused."""
    saved = calibration.read_calibration(calibration.calibration_path("cpu-epyc-avx2"))
    key, entry = next((k, e) for k, e in saved["entries"].items() if e["shape"]["precision"] == "auto")
    assert entry["resolved_here"]["precision"] == "float32"  # the reference machine has no native bf16
    costs, source = calibration.reference_costs("cpu-epyc-avx2", {**entry["shape"], "precision": "fp32"})
    assert source["shape_key"] == key
    assert (costs.setup, costs.microbatch, costs.update) == (
        entry["setup_s"],
        entry["microbatch_s"],
        entry["update_s"],
    )
    with pytest.raises(ConfigError, match="no entry for this recipe's shape.*precision bf16"):
        calibration.reference_costs("cpu-epyc-avx2", {**entry["shape"], "precision": "bf16"})


def test_a_committed_calibration_is_named_by_its_place_in_the_repository(tmp_path):
    assert calibration.shown_path(calibration.calibration_path("cpu-epyc-avx2")) == (
        "conf/calibration/cpu-epyc-avx2.json"
    )
    elsewhere = tmp_path / "mine.json"
    assert calibration.shown_path(calibration.calibration_path(str(elsewhere))) == str(elsewhere)


def test_new_entries_are_put_on_the_scale_of_the_kept_ones_measured_beside_them():
    def measured(microbatch: float) -> dict:
        return {"microbatch_s": microbatch, "update_s": 0.01, "setup_s": 2.0,
                "spread": {"microbatch_s": [microbatch, microbatch], "update_s": [0.01, 0.01]}}  # fmt: skip

    # the machine runs 4% faster today: the kept control measures 0.96 s where its entry says 1.0
    entries = {"control": measured(0.96), "new": measured(1.2)}
    put = calibrate.on_the_files_scale(entries, {"control": measured(1.0)})
    assert put["control"] == entries["control"]  # kept as it was by write()
    assert put["new"]["microbatch_s"] == pytest.approx(1.25) and put["new"]["setup_s"] == pytest.approx(
        2.0 / 0.96
    )
    assert put["new"]["scaled"] == {"by": pytest.approx(1 / 0.96), "to_the_kept": ["control"]}
    assert (
        calibrate.on_the_files_scale(entries, {}) == entries
    )  # nothing kept among them: nothing to scale by
