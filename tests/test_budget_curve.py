"""scripts/studies/budget_curve.py: the plan runs one stage at a time, skips what is done, and reports from the
kept figures alone."""

from __future__ import annotations

import importlib
import json
import subprocess
from pathlib import Path

import pytest

from cramming.eval.tasks import GLUE_TASKS

METRIC = {task: GLUE_TASKS[task].metrics[0] for task in ("SST-2", "MRPC", "STS-B", "RTE", "CoLA")}
TERMS = ("anaphor_agreement", "island_effects", "quantifiers")


@pytest.fixture
def study():
    return importlib.import_module("scripts.studies.budget_curve")


def blimp_result(overall: float, per_term: dict[str, float]) -> dict:
    return {
        "overall": overall,
        "per_linguistics_term": per_term,
        "pairs_scored": 67000,
        "paradigms": 67,
        "variant": "within_word_l2r",
    }


def glue_result(score: float) -> dict:
    runs = [
        {"task": task, "seed": seed, "metrics": {task: {METRIC[task]: score + 0.01 * seed}}}
        for task in METRIC
        for seed in range(3)
    ]
    return {"runs": runs}


def finished(base: Path, name: str, files: dict[str, dict]) -> Path:
    folder = base / name / "2026-12-04_10-00-00"
    folder.mkdir(parents=True)
    (folder / "run_card.json").write_text(
        json.dumps({"status": "ok", "metrics": {"updates": 5, "tokens": 640}})
    )
    for file, content in files.items():
        (folder / file).write_text(json.dumps(content))
    return folder


def args_for(study, tmp_path: Path, *extra: str):
    return study.parse_args(
        ["run", "--data", "wiki", "--glue-dir", "glue", "--blimp-dir", "blimp", "--base-dir", str(tmp_path / "out"),
         "--keep", str(tmp_path / "keep"), *extra]
    )  # fmt: skip


def test_each_point_is_a_recipe_of_the_cpu_study_and_zero_minutes_is_one_update(study):
    tiny0, tiny15 = study.BY_LABEL["tiny-0"], study.BY_LABEL["tiny-15-s1"]
    assert tiny0.pretrain_args("d") == [
        "+sweep=cpu-study", "arch=bert-tiny", "seed=0", "data.sources.local.files=d/train-*-of-00012.jsonl.gz",
        "budget=1", "train.steps=1",
    ]  # fmt: skip
    assert tiny15.pretrain_args("d")[2] == "seed=1" and tiny15.pretrain_args("d")[-1] == "budget=0.25"
    # the plan: two seeds at 15 and 60 minutes, bert-mini at 0 and 60
    minutes = sorted((p.arch, p.minutes) for p in study.PLAN if p.on_curve and not p.overrides)
    assert minutes.count(("bert-tiny", 15)) == 2 and minutes.count(("bert-tiny", 60)) == 2
    assert ("bert-mini", 0) in minutes and ("bert-mini", 60) in minutes


def test_run_does_only_the_stages_not_done_and_keeps_every_figure(study, tmp_path, monkeypatch):
    base = tmp_path / "out"
    finished(base, "budget-curve-tiny-15-s0", {})
    finished(base, "budget-curve-tiny-15-s0-blimp", {"blimp_results.json": blimp_result(55.0, {})})
    ran = []

    def fake_run(command, check):
        ran.append(command)
        name = next(a.removeprefix("name=") for a in command if a.startswith("name="))
        finished(base, name, {"glue_results.json": glue_result(0.6)})
        return subprocess.CompletedProcess(command, 0)

    monkeypatch.setattr(study.subprocess, "run", fake_run)
    study.run(args_for(study, tmp_path, "--points", "tiny-15-s0", "--stages", "pretrain", "blimp", "glue1k"))
    assert len(ran) == 1  # pretraining and BLiMP were done already
    assert "eval.max_train_examples=1000" in ran[0] and "checkpoint=budget-curve-tiny-15-s0" in ran[0]
    assert "impl.cpu_threads=1" in ran[0]
    kept = json.loads((tmp_path / "keep" / "tiny-15-s0.json").read_text())
    assert kept["blimp"]["overall"] == 55.0 and kept["glue1k"]["runs"] and "glue" not in kept
    assert kept["pretraining_card"]["metrics"]["updates"] == 5
    assert set(kept["load_average"]) == {"glue1k"}  # only the stage that ran was sampled


def test_a_blimp_subset_names_its_runs_and_is_scored_on_the_same_pairs_as_the_floor(study, tmp_path):
    args = args_for(study, tmp_path, "--blimp-pairs", "200")
    command = study.stage_command(study.BY_LABEL["mini-60"], "blimp", args)
    assert "blimp.pairs_per_paradigm=200" in command and "name=budget-curve-mini-60-blimp200" in command
    assert "name=budget-curve-mini-60-blimp" in study.stage_command(
        study.BY_LABEL["mini-60"], "blimp", args_for(study, tmp_path)
    )
    subset = blimp_result(55.0, {}) | {"pairs_scored": 13_400}
    point = {"m": {"arch": "bert-mini", "minutes": 60, "blimp": subset}}
    assert (
        study.pairs_note(point, {"twins": [subset] * 3}, "bert-mini")
        == "the first 200 pairs of each paradigm"
    )
    assert study.pairs_note(point, {"twins": [blimp_result(50.0, {})]}, "bert-mini").startswith(
        "NOT COMPARABLE"
    )
    assert study.blimp_cell(subset) == "55.0 (200 pairs/paradigm)"
    assert study.blimp_cell(blimp_result(55.04, {})) == "55.0"


def test_a_recipe_change_is_judged_beside_the_curve_on_its_own_machine(study):
    change = study.BY_LABEL["tiny-60-mask15"]
    assert change.pretrain_args("d")[-2:] == ["budget=1", "train.mlm.mask_fraction=0.15"]

    def point(overall, updates, overrides=None, cpu="AMD EPYC", dtype="float32", **extra):
        device = {"cpu": cpu, "precision": {"dtype": dtype}}
        record = {"arch": "bert-tiny", "minutes": 60, "blimp": blimp_result(overall, {}),
                  "pretraining_card": {"metrics": {"updates": updates}, "device": device}}  # fmt: skip
        return record | ({"overrides": overrides} if overrides else {}) | extra

    points = {
        "s0": point(54.0, 100),
        "s1": point(55.0, 110),
        "m15": point(57.0, 120, ["m=0.15"]),
        # on a faster CPU: the change is judged against the control beside it, and neither joins the curve
        "ctl": point(56.0, 200, cpu="Xeon", dtype="bfloat16", on_curve=False),
        "cls": point(58.0, 190, ["row=cls"], cpu="Xeon", dtype="bfloat16"),
        "alone": point(60.0, 300, ["x=1"], cpu="Other"),
    }
    assert study.by_budget(points, "bert-tiny", study.blimp_overall) == {60: [54.0, 55.0]}
    assert study.recipe_changes(points) == [
        "m15 (m=0.15; AMD EPYC, float32): BLiMP 57.0 against 54.0–55.0 (+2.5); updates 120 against 100–110 (+15)",
        "cls (row=cls; Xeon, bfloat16): BLiMP 58.0 against 56.0 (+2.0); updates 190 against 200 (-10)",
        "alone (x=1; Other, float32): no run of the study's recipe of this arch and budget on this machine yet",
    ]


def test_a_failed_stage_stops_the_study_non_zero(study, tmp_path, monkeypatch):
    monkeypatch.setattr(
        study.subprocess, "run", lambda command, check: subprocess.CompletedProcess(command, 3)
    )
    with pytest.raises(SystemExit, match="tiny-30 pretrain failed \\(exit 3\\)"):
        study.run(args_for(study, tmp_path, "--points", "tiny-30", "--stages", "pretrain"))


def test_an_evaluation_without_its_pretraining_run_is_refused(study, tmp_path):
    with pytest.raises(SystemExit, match="run the pretrain stage first"):
        study.run(args_for(study, tmp_path, "--points", "tiny-30", "--stages", "blimp"))


def test_run_names_the_folders_its_stages_need(study):
    with pytest.raises(SystemExit):
        study.parse_args(["run", "--stages", "glue"])


def write_kept(
    keep: Path, label: str, minutes: int, blimp: dict, glue: float, arch: str = "bert-tiny"
) -> None:
    keep.mkdir(parents=True, exist_ok=True)
    record = {"label": label, "arch": arch, "minutes": minutes, "seed": 0, "blimp": blimp,
              "glue1k": glue_result(glue), "load_average": {"pretrain": {"mean": 1.02, "max": 1.3, "samples": 4}},
              "pretraining_card": {"metrics": {"updates": 1629, "tokens": 13_000_000, "val_loss": 4.77}}}  # fmt: skip
    (keep / f"{label}.json").write_text(json.dumps(record))


def test_the_report_says_what_rises_beyond_the_floor_first_and_what_never_does(study, tmp_path, capsys):
    keep = tmp_path / "keep"
    twins = [
        blimp_result(50 + s, {"anaphor_agreement": 40 + s, "island_effects": 50 + s, "quantifiers": 30 + s})
        for s in range(3)
    ]  # floor ranges: anaphor 40-42, islands 50-52, quantifiers 30-32
    published = {"5-gram": {"overall": 61.2}, "LSTM": {"overall": 69.8}}
    (keep / "floor-bert-tiny.json").parent.mkdir(parents=True)
    (keep / "floor-bert-tiny.json").write_text(json.dumps({"twins": twins, "published": published}))
    # quantifiers clear 32 in both 15-minute runs; anaphor agreement in one of them only, then at 60; islands never
    write_kept(
        keep,
        "tiny-15-s0",
        15,
        blimp_result(53, {"anaphor_agreement": 43, "island_effects": 49, "quantifiers": 40}),
        0.6,
    )
    write_kept(
        keep,
        "tiny-15-s1",
        15,
        blimp_result(52, {"anaphor_agreement": 41, "island_effects": 53, "quantifiers": 35}),
        0.6,
    )
    write_kept(
        keep,
        "tiny-60-s0",
        60,
        blimp_result(56, {"anaphor_agreement": 50, "island_effects": 45, "quantifiers": 45}),
        0.62,
    )
    study.report(study.parse_args(["report", "--keep", str(keep), "--out", str(tmp_path / "plot")]))
    out = capsys.readouterr().out
    assert "quantifiers (15 min), anaphor_agreement (60 min); never: island_effects" in out
    # the points table: pretraining figures from the card, BLiMP against the floor, the 1k-example GLUE average
    assert (
        "| tiny-15-s0 | 15 | 1,629 | 13.0M | 4.77 | 53.0 | 51.0 (50.0–52.0) | – | 61.0 [60.0, 62.0] |" in out
    )
    assert "1.02 (max 1.30)" in out
    # per task: median over fine-tuning seeds and their lowest and highest, as the kept results hold them
    assert "| model | SST-2 | MRPC | STS-B | RTE | CoLA | Avg |" in out
    assert (
        "| tiny-60-s0 | 63.0 [62.0, 64.0] | 63.0 [62.0, 64.0] | 63.0 [62.0, 64.0] | 63.0 [62.0, 64.0] | 63.0 [62.0, 64.0] | 63.0 |"
        in out
    )
    assert "| **overall** | 51.0 (50.0–52.0) | 53.0 | 52.0 | 56.0 | 61.2 | 69.8 |" in out
    assert (tmp_path / "plot" / "budget_curve.png").stat().st_size > 0
    # the goals, judged from the same figures: the two 15-minute runs (53, 52) set the spread
    assert "- BLiMP spread of two runs of one budget: 1.0 (largest of: 15 min 1.0)" in out
    assert "- BLiMP 15 -> 60 min: +3.5 (means of 2 and 1 runs), beyond the spread" in out
    assert "- BLiMP at 60 min: lowest run 56.0, 4.0 above the floor's highest draw (52.0)" in out


def test_a_step_within_the_spread_and_a_run_inside_the_floor_are_said_so(study):
    def point(minutes, overall, glue=None):
        record = {"arch": "bert-tiny", "minutes": minutes, "blimp": blimp_result(overall, {})}
        return record | ({"glue1k": glue_result(glue)} if glue is not None else {})

    points = {
        "a": point(0, 49.0, glue=0.40), "b": point(15, 52.0), "c": point(15, 54.0),
        "d": point(60, 53.5, glue=0.43), "e": point(60, 55.5, glue=0.45),
    }  # fmt: skip
    floors = {"bert-tiny": {"twins": [blimp_result(v, {}) for v in (48.0, 50.0, 54.0)]}}
    lines = study.goals(points, floors, "bert-tiny")
    assert lines[0] == "BLiMP spread of two runs of one budget: 2.0 (largest of: 15 min 2.0, 60 min 2.0)"
    assert lines[1] == "BLiMP 15 -> 60 min: +1.5 (means of 2 and 2 runs), NOT beyond the spread"
    assert lines[2] == "BLiMP at 60 min: lowest run 53.5, 0.5 short of the floor's highest draw (54.0)"
    # GLUE's average is in points (scores x 100); the 60-minute mean 44.01 against 40.01 falls short of +5
    assert lines[3].startswith("GLUE, 1,000 examples: 60 min +4.0 over no pretraining (2 run(s) at 60 min)")
    assert lines[3].endswith("goal >= +5 NOT met")
    # one run per budget: no spread to judge a step by, and none is claimed
    single = {"b": point(15, 52.0), "d": point(60, 55.0)}
    assert study.goals(single, {}, "bert-tiny")[0].startswith("BLiMP steps: no budget has two runs yet")


def test_the_report_refuses_an_empty_keep_folder(study, tmp_path):
    (tmp_path / "keep").mkdir()
    with pytest.raises(SystemExit, match="no point has been measured yet"):
        study.report(study.parse_args(["report", "--keep", str(tmp_path / "keep")]))


def test_a_change_of_the_models_shape_gets_a_floor_of_its_own_shape(study, tmp_path, monkeypatch):
    deep = study.BY_LABEL["tiny-30-4layers-s1"]
    assert deep.shape == "bert-tiny.num_layers=4" and deep.pretrain_args("d")[-1] == "arch.num_layers=4"
    # a change of data or training keeps its arch's floor
    assert study.BY_LABEL["tiny-30-cls-s1"].shape == "bert-tiny"
    # the floor's twins take the architecture of the run they are drawn from: the changed shape's own run
    base, drawn = tmp_path / "out", []
    folder = finished(base, "budget-curve-tiny-30-4layers-s1", {})
    monkeypatch.setattr(study.blimp, "load_pairs", lambda config: {"uid": [{"linguistics_term": "t"}]})
    monkeypatch.setattr(study, "random_twin", lambda checkpoint, seed: drawn.append((checkpoint, seed)) or ())
    monkeypatch.setattr(study, "blimp_score", lambda *args: blimp_result(50.0 + len(drawn), {}))
    monkeypatch.setattr(study, "published", lambda blimp_dir, terms: {})
    study.keep_floor(deep, args_for(study, tmp_path))
    assert drawn == [(str(folder / "checkpoint"), s) for s in study.FLOOR_SEEDS]
    floor = json.loads((tmp_path / "keep" / "floor-bert-tiny.num_layers=4.json").read_text())
    assert floor["arch"] == "bert-tiny.num_layers=4"
    assert [t["overall"] for t in floor["twins"]] == [51, 52, 53]
    # the report reads it back under that shape and judges the change beside its control and its own floor
    record = {"arch": "bert-tiny", "minutes": 30, "blimp": blimp_result(57.0, {})}
    for label, extra in (
        ("tiny-30-control-s1", {"on_curve": False}),
        (deep.label, {"overrides": list(deep.overrides)}),
    ):
        (tmp_path / "keep" / f"{label}.json").write_text(json.dumps(record | extra))
    points, floors = study.read_kept(tmp_path / "keep")
    assert study.recipe_changes(points, floors) == [
        "tiny-30-4layers-s1 (arch.num_layers=4; ?, ?): BLiMP 57.0 against 57.0 (+0.0); "
        "its shape's floor 52.0 (51.0–53.0)"
    ]
    assert study.recipe_changes(points, {})[0].endswith("its shape's floor not measured yet")
    assert "| 57.0 | 52.0 (51.0–53.0) |" in study.points_table(points, floors)
