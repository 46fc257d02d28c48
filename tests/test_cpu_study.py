"""scripts/studies/cpu_study.py: the study's tables from evaluation folders."""

from __future__ import annotations

import importlib
import json
from pathlib import Path

from cramming.eval.tasks import GLUE_TASKS

# each task's score in the GLUE average, from the task registry
METRIC = {task: GLUE_TASKS[task].metrics[0] for task in ("SST-2", "MRPC", "STS-B", "RTE", "CoLA")}


def load_script():
    return importlib.import_module("scripts.studies.cpu_study")


def write_eval(folder: Path, scores: dict[str, list[float]], minutes: float) -> Path:
    runs = [
        {"task": task, "seed": seed, "metrics": {task: {METRIC[task]: value}}, "seconds": 10.0}
        for task, values in scores.items()
        for seed, value in enumerate(values)
    ]
    folder.mkdir(parents=True)
    results = {"checkpoint": str(folder / "none"), "runs": runs, "seconds": 50.0,
               "pretraining": {"updates": 7, "elapsed_h": minutes / 60, "validation": {"loss": 5.0}}}  # fmt: skip
    (folder / "glue_results.json").write_text(json.dumps(results))
    return folder


def test_margins_count_only_when_larger_than_the_seed_spread(tmp_path, capsys):
    base = {task: [0.50, 0.52, 0.51] for task in METRIC}
    better = {**base, "SST-2": [0.60, 0.61, 0.62], "RTE": [0.51, 0.53, 0.60]}
    scratch = write_eval(tmp_path / "scratch", base, 0.0)
    pretrained = write_eval(tmp_path / "pre", better, 60.0)
    load_script().main(
        [f"tiny-scratch={scratch}", f"tiny-60min={pretrained}", "--out", str(tmp_path / "out")]
    )
    out = capsys.readouterr().out
    assert "| tiny-60min | SST-2 | +10.0 | 2.0 | yes |" in out  # 61 - 51, spreads 2 and 2
    assert "| tiny-60min | RTE | +2.0 | 9.0 | no |" in out  # 53 - 51 is inside RTE's spread of 9
    assert "| tiny-60min | 7 | 60.0 | 5.000 |" in out
    assert (tmp_path / "out" / "glue_vs_minutes.png").stat().st_size > 0


def test_one_seed_has_no_spread_to_judge_by(tmp_path, capsys):
    one = {task: [0.5] for task in METRIC}
    scratch = write_eval(tmp_path / "scratch", one, 0.0)
    pretrained = write_eval(tmp_path / "pre", {task: [0.6] for task in METRIC}, 60.0)
    load_script().main([f"mini-scratch={scratch}", f"mini-60min={pretrained}"])
    out = capsys.readouterr().out
    assert "one seed: no spread" in out and "| yes |" not in out


def test_the_curve_says_whether_each_point_clears_the_seed_range_of_the_one_before(tmp_path, capsys):
    # per-seed averages: scratch 50, 51, 52; 15 min 53, 54, 55 (clears 52); 60 min 54, 56, 57 (54 < 55: not)
    def scores(values):
        return {task: values for task in METRIC}

    folders = {
        "tiny-scratch": write_eval(tmp_path / "s", scores([0.50, 0.51, 0.52]), 0.0),
        "tiny-15min": write_eval(tmp_path / "a", scores([0.53, 0.54, 0.55]), 15.0),
        "tiny-60min": write_eval(tmp_path / "b", scores([0.54, 0.56, 0.57]), 60.0),
    }
    for label, updates in (("tiny-15min", 100), ("tiny-60min", 400)):
        path = folders[label] / "glue_results.json"
        results = json.loads(path.read_text())
        results["pretraining"]["updates"] = updates
        path.write_text(json.dumps(results))
    kept = tmp_path / "kept"
    load_script().main([f"{label}={folder}" for label, folder in folders.items()] + ["--keep", str(kept)])
    first = capsys.readouterr().out
    assert "| tiny-15min | 15.0 | 100 | 54.0 | [53.0, 55.0] | yes |" in first
    assert "| tiny-60min | 60.0 | 400 | 56.0 | [54.0, 57.0] | no |" in first
    # the kept files stand in for the folders: the same tables again
    load_script().main([f"{label}={kept / label}.json" for label in folders])
    again = capsys.readouterr().out
    assert again.split("\n| model | data s")[0] == first.split("\n| model | data s")[0]


def test_the_plot_takes_a_point_whose_median_lies_outside_its_seed_range(tmp_path, capsys):
    # each task's median (55) comes from another seed, while each seed is low on some task: per-seed averages
    # 42, 50 and 43, and the average of the medians, 55, lies above all three. The plot once refused such a
    # point (a negative error bar).
    cycle = ([0.55, 0.60, 0.20], [0.20, 0.55, 0.60], [0.60, 0.20, 0.55])
    scores = dict(zip(METRIC, (cycle[0], cycle[0], cycle[1], cycle[1], cycle[2]), strict=True))
    scratch = write_eval(tmp_path / "s", {task: [0.5, 0.5, 0.5] for task in METRIC}, 0.0)
    point = write_eval(tmp_path / "p", scores, 30.0)
    load_script().main([f"tiny-scratch={scratch}", f"tiny-30min={point}", "--out", str(tmp_path / "out")])
    out = capsys.readouterr().out
    assert "| tiny-30min | 30.0 | 7 | 55.0 | [42.0, 50.0] |" in out
    assert (tmp_path / "out" / "glue_vs_minutes.png").stat().st_size > 0


def test_the_fit_table_shows_the_median_last_epoch_loss_of_runs_that_recorded_it(tmp_path, capsys):
    old = write_eval(tmp_path / "old", {task: [0.5, 0.5, 0.5] for task in METRIC}, 15.0)  # no epoch_losses
    new = write_eval(tmp_path / "new", {task: [0.5, 0.5, 0.5] for task in METRIC}, 60.0)
    results = json.loads((new / "glue_results.json").read_text())
    for run in results["runs"]:
        run["epoch_losses"] = [0.9, 0.3 + 0.1 * run["seed"]]  # seeds' last epochs 0.3, 0.4, 0.5
    (new / "glue_results.json").write_text(json.dumps(results))
    load_script().main([f"tiny-15min={old}", f"tiny-60min={new}"])
    out = capsys.readouterr().out
    assert "| tiny-60min | 0.400 | 0.400 | 0.400 | 0.400 | 0.400 |" in out
    assert "| tiny-15min | — | — | — | — | — |" in out
