"""The report of a folder of runs: one table row per run, labels from the sweep's overrides, valid PNG plots."""

from __future__ import annotations

import csv
import datetime as dt
import json
import math
from pathlib import Path

import matplotlib.image
import pytest

from cramming.job.runcard import RUN_CARD, RunCard, card_status
from cramming.study.runs_report import build_report, collect_runs

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def _pretrain_run(folder: Path, num: int, optim: str, budget: float, status: str = "ok") -> None:
    """A run folder as pretrain.py leaves it: a card and a metrics.jsonl with a falling loss."""
    folder.mkdir(parents=True)
    overrides = [f"budget={budget}", f"train/optim={optim}", "arch=tiny"]
    records = []
    for i in range(1, 21):
        fraction = i / 20
        records.append(
            {"update": 10 * i, "loss": 9.0 - 2 * math.log1p(i) - (0.3 if optim == "adamw" else 0.0),
             "mlm_acc": 0.01 * i, "lr": 1e-3 * min(fraction / 0.75, (1 - fraction) / 0.25),
             "batch_size": min(128, 32 * (1 + i // 4)), "seq_per_s": 100.0 + i, "tok_per_s": 12800.0 + 128 * i,
             "elapsed_h": budget * fraction, "budget_fraction": fraction, "skipped": 0}
        )  # fmt: skip
        if i % 10 == 0:
            records.append(
                {"update": 10 * i, "elapsed_h": budget * fraction, "anytime_fraction": fraction,
                 "anytime": {"RTE": 0.5 + 0.01 * i, "SST-2": 0.6 + 0.01 * i}, "anytime_average": 0.6,
                 "anytime_blimp": 50.0 + i / 2, "anytime_blimp_terms": {"binding": 50.0}, "tokens": 128_000 * i,
                 "anytime_seconds": 3.0, "anytime_charged": False}
            )  # fmt: skip
    records.append({"update": 200, "val_loss": 5.1, "val_mlm_acc": 0.2})
    (folder / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    card = {
        "kind": "pretrain", "status": status, "error": "RuntimeError: boom\ntraceback" if status != "ok" else None,
        "job": {"multirun": True, "num": num, "overrides": overrides},
        "config": {"budget": budget, "arch": {"name": "tiny"}, "train": {"optim": {"name": optim}}},
        "git": {"commit": "0123456789abcdef", "dirty": True},
        "seconds": {"data": 1.0, "setup": 0.5, "compile": 0.1, "train": 100.0, "eval": 5.0, "total": 107.0},
        "metrics": {"updates": 200, "loss": records[-3]["loss"], "val_loss": 5.1, "tokens": 3_200_000},
    }  # fmt: skip
    (folder / RUN_CARD).write_text(json.dumps(card))


def _eval_run(folder: Path, num: int, optim: str) -> None:
    folder.mkdir(parents=True)
    card = {
        "kind": "eval", "status": "ok", "job": {"multirun": True, "num": num, "overrides": [f"eval.optim={optim}"]},
        "config": {"eval": {"optim": optim}}, "data": {"checkpoint": "outputs/x/checkpoint"},
        "seconds": {"eval": 30.0, "total": 31.0},
        "metrics": {"optimizer": optim, "scores": {"SST-2": 0.8, "RTE": 0.55 if optim == "adamw" else 0.53},
                    "glue_average": 0.67},
    }  # fmt: skip
    (folder / RUN_CARD).write_text(json.dumps(card))


@pytest.fixture
def runs_folder(tmp_path) -> Path:
    sweep = tmp_path / "pretrain" / "multirun_2026-01-01_00-00-00"
    for num, (optim, budget) in enumerate([("adamw", 0.05), ("adamw_8bit", 0.05), ("adamw", 0.1)]):
        _pretrain_run(sweep / str(num), num, optim, budget)
    _pretrain_run(sweep / "3", 3, "adamw_8bit", 0.1, status="failed")
    glue = tmp_path / "glue" / "multirun_2026-01-01_01-00-00"
    for num, optim in enumerate(["adamw", "adamw_8bit", "galore_adamw"]):
        _eval_run(glue / str(num), num, optim)
    return tmp_path


def test_report_has_one_row_per_run_and_valid_plots(runs_folder, tmp_path):
    out = tmp_path / "report"
    report = build_report(runs_folder, out).read_text()

    pretrain_rows = [line for line in report.splitlines() if line.startswith("| pretrain/")]
    eval_rows = [line for line in report.splitlines() if line.startswith("| glue/")]
    assert len(pretrain_rows) == 4 and len(eval_rows) == 3, report
    assert "| failed |" in pretrain_rows[3] and "RuntimeError: boom" in pretrain_rows[3]
    assert "1 not ok: pretrain/multirun_2026-01-01_00-00-00/3" in report
    with open(out / "runs.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    assert [r["kind"] for r in rows] == ["pretrain"] * 4 + ["eval"] * 3
    assert rows[4]["RTE"] == "0.55" and rows[5]["RTE"] == "0.53"

    for name in ("loss", "schedule", "throughput", "glue", "anytime", "blimp"):
        path = out / f"{name}.png"
        assert f"]({name}.png)" in report
        assert path.read_bytes()[:8] == PNG_SIGNATURE, name
        assert path.stat().st_size > 15_000, f"{name}.png has only {path.stat().st_size} bytes"
        image = matplotlib.image.imread(path)
        assert image.shape[0] > 300 and image.shape[1] > 500
        assert image[..., :3].std() > 0.05, f"{name}.png is (nearly) blank"


def test_runs_are_labelled_by_what_the_sweep_changed(runs_folder):
    runs = collect_runs(runs_folder)
    labels = [run.label for run in runs if run.kind == "pretrain"]
    # arch=tiny is shared by every run, so it is not part of any label
    assert labels[:2] == ["budget=0.05 train/optim=adamw", "budget=0.05 train/optim=adamw_8bit"]
    assert [run.name for run in runs][:2] == [
        "glue/multirun_2026-01-01_01-00-00/0",
        "glue/multirun_2026-01-01_01-00-00/1",
    ]


def test_a_run_folder_without_a_card_is_read_from_its_files(tmp_path):
    run = tmp_path / "old" / "2026-01-01_00-00-00"
    (run / ".hydra").mkdir(parents=True)
    (run / ".hydra" / "overrides.yaml").write_text("- budget=0.1\n- name=old\n")
    (run / ".hydra" / "config.yaml").write_text("budget: 0.1\narch:\n  name: tiny\n")
    (run / "metrics.jsonl").write_text(
        json.dumps({"update": 1, "loss": 9.0, "mlm_acc": 0.0, "lr": 0.0, "batch_size": 32,
                    "seq_per_s": 10.0, "tok_per_s": 1280.0, "elapsed_h": 0.01, "budget_fraction": 0.1}) + "\n"
    )  # fmt: skip
    report = build_report(run, tmp_path / "out").read_text()
    assert "| 2026-01-01_00-00-00 | unknown |" in report and "| tiny |" in report
    assert (tmp_path / "out" / "loss.png").exists()


def test_an_empty_folder_is_an_error(tmp_path):
    with pytest.raises(FileNotFoundError, match="no run folders"):
        build_report(tmp_path)


def test_a_running_card_whose_process_was_killed_shows_killed(tmp_path):
    import os
    import signal
    import subprocess
    import sys
    import time

    run = tmp_path / "pretrain" / "2026-01-01_00-00-00"
    writer = (
        "import sys, time; from pathlib import Path; from cramming.job.runcard import RunCard;"
        " RunCard(Path(sys.argv[1]), 'pretrain', {}).write(); time.sleep(120)"
    )
    proc = subprocess.Popen([sys.executable, "-c", writer, str(run)])
    try:
        deadline = time.monotonic() + 90
        while not (run / RUN_CARD).exists() and time.monotonic() < deadline:
            time.sleep(0.1)
        assert [r.card["status"] for r in collect_runs(tmp_path)] == ["running"]  # alive: still running
    finally:
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
    card = json.loads((run / RUN_CARD).read_text())
    assert card["status"] == "running" and card["process"]["pid"] == proc.pid
    assert [r.card["status"] for r in collect_runs(tmp_path)] == ["killed"]
    assert "killed" in build_report(tmp_path, tmp_path / "out").read_text()
    # a card from another machine (a cluster node): its process cannot be looked up from here, its heartbeat
    # can. Written 30 s ago: still running; 11 minutes ago: killed; a card from before heartbeats: as it says.
    elsewhere = card | {"process": {"pid": proc.pid, "host": "elsewhere"}}
    beat = dt.datetime.fromisoformat(card["heartbeat"])
    assert card_status(elsewhere, now=beat + dt.timedelta(seconds=30)) == "running"
    assert card_status(elsewhere, now=beat + dt.timedelta(minutes=11)) == "killed"
    assert card_status(elsewhere | {"heartbeat": None}, now=beat + dt.timedelta(days=1)) == "running"
    (run / RUN_CARD).write_text(json.dumps(elsewhere | {"heartbeat": "2000-01-01T00:00:00+00:00"}))
    assert [r.card["status"] for r in collect_runs(tmp_path)] == ["killed"]


def test_a_running_job_keeps_its_heartbeat_until_it_ends(tmp_path):
    import time

    card = RunCard(tmp_path, "pretrain", {})
    card.write()
    card.start_heartbeat(every=0.05)
    card.metrics["seen"] = 1  # written by the next beat, not by the code that set it
    deadline = time.monotonic() + 30
    while (
        "seen" not in json.loads((tmp_path / RUN_CARD).read_text())["metrics"] and time.monotonic() < deadline
    ):
        time.sleep(0.02)
    assert json.loads((tmp_path / RUN_CARD).read_text())["metrics"] == {"seen": 1}
    card.end("ok")
    card.metrics["after"] = 2
    time.sleep(0.3)  # six beats' worth: none comes after end()
    written = json.loads((tmp_path / RUN_CARD).read_text())
    assert written["status"] == "ok" and "after" not in written["metrics"] and written["finished"]


def _hand_started_runs(root: Path, count: int) -> None:
    """Runs started by hand, differing in many keys: long override labels, as in a folder of mixed runs."""
    for i in range(count):
        folder = root / f"run{i}" / f"2026-01-01_00-00-{i:02d}"
        _pretrain_run(folder, i, "adamw" if i % 2 else "adamw_8bit", 0.05 * (1 + i % 3))
        card = json.loads((folder / RUN_CARD).read_text())
        card["job"] = {"multirun": False, "overrides": [
            f"name=run{i}", "data=local", "data.sources.local.files=data/wikipedia/*.gz",
            f"train.optim.lr={1e-3 * (i + 1):g}", f"train.batch_size={16 * (1 + i % 4)}", "arch=bert-tiny",
            f"arch.attention_bias={'alibi' if i % 3 else 'none'}", "impl.cpu_threads=1", f"seed={i}"]}  # fmt: skip
        card["config"]["name"] = f"run{i}"
        (folder / RUN_CARD).write_text(json.dumps(card))


@pytest.mark.parametrize("count", [2, 4, 13])
def test_legends_stay_inside_the_figure_and_off_the_data(tmp_path, count):
    from cramming.study.runs_report import (
        collect_runs,
        layout_problems,
        plot_anytime,
        plot_blimp,
        plot_loss,
        plot_schedule,
        plot_throughput,
    )

    _hand_started_runs(tmp_path / "runs", count)
    runs = collect_runs(tmp_path / "runs")
    assert all(len(line) <= 28 for run in runs for line in run.key.split("\n"))
    assert len({run.key for run in runs}) == count  # one key per run
    for draw in (plot_loss, plot_schedule, plot_throughput, plot_anytime, plot_blimp):
        fig = draw(runs, tmp_path / f"{draw.__name__}.png")
        assert not layout_problems(fig), (draw.__name__, layout_problems(fig))
    report = build_report(tmp_path / "runs", tmp_path / "out").read_text()
    assert "what each run changed" in report and "train.optim.lr=0.001" in report


def test_the_layout_check_can_fail(tmp_path):
    from matplotlib.figure import Figure

    from cramming.study.runs_report import layout_problems

    fig = Figure(figsize=(4, 3))
    ax = fig.subplots()
    ax.plot(range(10), label="a label far too long to fit beside a small plot " * 3)
    ax.legend(loc="center")  # over the data, and wider than the figure
    problems = layout_problems(fig)
    assert any("covers axes" in p for p in problems) and any("leaves the figure" in p for p in problems)
