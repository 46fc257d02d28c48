"""cramming/study/report.py: a study's report from its kept figures alone. The budget curve's committed tables
(results/budget-curve/README.md) come out of conf/study/budget-curve.yaml and results/budget-curve/runs/ as
they are; a comparison says whether it is beyond the seeds' spread, and with one run each that there is none."""

from __future__ import annotations

import re
from dataclasses import asdict
from pathlib import Path

import pytest

from cramming.data.config import TokenizerConfig
from cramming.errors import ConfigError
from cramming.study import judge, tables
from cramming.study import kept as kept_
from cramming.study.__main__ import main
from cramming.study.config import load_study
from cramming.study.plan import Point
from cramming.study.report import build_report

REPO = Path(__file__).resolve().parent.parent


def markdown_tables(text: str) -> list[str]:
    """Each run of consecutive lines that begin with `|`."""
    found, current = [], []
    for line in [*text.splitlines(), ""]:
        if line.startswith("|"):
            current.append(line)
        elif current:
            found.append("\n".join(current))
            current = []
    return found


def test_the_budget_curves_tables_are_reproduced_from_its_kept_runs(tmp_path):
    name, study = load_study("budget-curve", [f"out={tmp_path}"])
    report = build_report(name, study).read_text()
    committed = markdown_tables((REPO / "results" / "budget-curve" / "README.md").read_text())
    assert len(committed) == 6  # the runs, GLUE by task, BLiMP by phenomenon of four shapes
    for table in committed:
        assert table in report, table.splitlines()[0]
    assert (
        tmp_path / "curve.png"
    ).stat().st_size > 0  # drawn, its layout checked (plot_curve refuses overlaps)
    conclusion = report.split("## Conclusion")[1].split("\n## ")[0]
    # six layers at two hours, two seeds (61.2, 58.7), against the control's one run (57.2) on the same CPU
    assert re.search(r"6layers-lr2e3\*\* against \*\*tiny\*\* at 120 min .*BLiMP 59.9 \(58.7–61.2\) against 57.2: "
                     r"\+2.7, beyond the seeds' spread \(2.5\); seed by seed: s0 \+4.0", conclusion)  # fmt: skip
    # bert-mini scored 200 pairs a paradigm, bert-tiny all: not compared on BLiMP
    assert "BLiMP not compared" in conclusion


def point(label: str, recipe: str, seed: int) -> Point:
    return Point(label, recipe, 60, seed)


def kept(blimp: float, loss: float = 4.0) -> dict:
    card = {
        "status": "ok",
        "metrics": {"val_loss": loss, "updates": 100},
        "device": {"cpu": "X", "precision": {"dtype": "float32"}},
    }
    return {
        "pretraining_card": card,
        "blimp": {"overall": blimp, "pairs_scored": 67_000},
        "arch": "bert-tiny",
    }


def test_a_difference_is_judged_against_the_widest_spread_of_seeds():
    runs = {"b0": kept(55.0), "b1": kept(56.0), "n0": kept(57.5), "n1": kept(58.0)}
    plan = [point("b0", "base", 0), point("b1", "base", 1), point("n0", "new", 0), point("n1", "new", 1)]
    cells = judge.cells(plan, runs)
    lines, unmatched = judge.against_control(cells, "base")
    assert unmatched == [] and len(lines) == 1
    assert "BLiMP 57.8 (57.5–58.0) against 55.5 (55.0–56.0): +2.2, beyond the seeds' spread (1.0)" in lines[0]
    assert "seed by seed: s0 +2.5, s1 +2.0" in lines[0]
    runs["n1"] = kept(54.0)  # now the new recipe's seeds spread wider than the difference
    lines, _ = judge.against_control(judge.cells(plan, runs), "base")
    assert "within the seeds' spread (3.5)" in lines[0]


def test_one_run_each_is_said_to_have_no_spread_and_other_machines_are_not_compared():
    other = kept(60.0)
    other["pretraining_card"]["device"] = {"cpu": "Y", "precision": {"dtype": "bfloat16"}}
    runs = {"b0": kept(55.0), "n0": kept(56.0), "m0": other}
    plan = [point("b0", "base", 0), point("n0", "new", 0), point("m0", "new", 1)]
    lines, unmatched = judge.against_control(judge.cells(plan, runs), "base")
    assert "one seed per budget: no seed spread to judge it by" in lines[0]
    assert unmatched == ["new at 60 min (Y, bfloat16)"]


def on_the_reference_clock(record: dict, calibration: str, sha: str, machine: str = "AMD EPYC") -> dict:
    card = record["pretraining_card"]
    card["config"] = {"train": {"clock": "reference"}}
    card["metrics"]["clock"] = {
        "clock": "reference",
        "calibration": calibration,
        "sha256": sha,
        "machine": machine,
    }
    return record


def test_reference_clock_runs_name_their_calibrations_machine_and_pool_across_rescalings_only():
    # seed 0 was charged before its calibration file was rescaled (another hash), seed 1 after: one cell; a run
    # of another calibration file (another reference machine) is not pooled with them, whatever CPU ran it
    runs = {
        "b0": on_the_reference_clock(kept(55.0), "/clone/conf/calibration/cpu-a.json", "11"),
        "b1": on_the_reference_clock(kept(56.0), "conf/calibration/cpu-a.json", "22"),
        "n0": on_the_reference_clock(kept(57.0), "conf/calibration/gpu-b.json", "33", machine="H200"),
    }
    plan = [point("b0", "base", 0), point("b1", "base", 1), point("n0", "new", 0)]
    cells = judge.cells(plan, runs)
    assert [cell.machine for cell in cells] == [
        "reference clock of AMD EPYC (cpu-a)",
        "reference clock of H200 (gpu-b)",
    ]
    assert [len(cell.runs) for cell in cells] == [2, 1]


def test_the_paired_table_has_a_row_per_seed_both_recipes_ran():
    runs = {"b0": kept(55.0, 4.1), "n0": kept(56.5, 4.0), "n1": kept(57.0, 3.9)}
    plan = [point("b0", "base", 0), point("n0", "new", 0), point("n1", "new", 1)]
    table = judge.paired_table(judge.cells(plan, runs), "base")
    rows = table.splitlines()[2:]
    assert len(rows) == 1 and "| new | 60 | X, float32 | 0 | +1.5 |" in rows[0] and "-0.10" in rows[0]


def test_a_study_without_kept_figures_is_refused_naming_the_folder(tmp_path, caplog):
    study = tmp_path / "s.yaml"
    study.write_text(f"recipes: {{a: []}}\nminutes: [1]\nkeep: {tmp_path / 'none'}\n")
    assert main(["report", str(study)]) == 2
    assert "none" in caplog.text
    (tmp_path / "none").mkdir()
    with pytest.raises(ConfigError, match="none of the study's runs"):
        build_report(*load_study(str(study)))


def test_the_report_writes_no_path_of_this_machine(tmp_path):
    name, study = load_study("budget-curve", [f"out={tmp_path}"])
    text = build_report(name, study).read_text()
    assert "../shared" not in text and "/work/" not in text and str(tmp_path) not in text


def test_a_run_kept_from_another_study_is_named_with_its_source(tmp_path):
    name, study = load_study("cpu-recipe-long", [f"out={tmp_path}"])
    text = build_report(name, study).read_text()
    source = "results/reference-clock/runs/6layers-lr2e3-60-s0.json"
    assert f"6layers-60-s0 from {source}" in text and (REPO / source).exists()


def blimp_result(overall: float, terms: dict[str, float], pairs: int = 67_000) -> dict:
    return {"overall": overall, "per_linguistics_term": terms, "pairs_scored": pairs, "paradigms": 67}


def test_what_rises_beyond_the_floor_first_and_what_never_does():
    floor = {"twins": [blimp_result(50, {"a": 40 + s, "b": 50 + s}) for s in (0, 1, 2)]}
    series = {
        0: [blimp_result(49, {"a": 30, "b": 40})],
        15: [blimp_result(52, {"a": 45, "b": 51}), blimp_result(53, {"a": 43, "b": 60})],  # b: not in both
        60: [blimp_result(55, {"a": 50, "b": 49})],
    }
    assert tables.learned_first(series, floor) == (["a (15 min)"], ["b"])


def test_a_blimp_subset_says_so_and_is_compared_only_with_its_own_floors_pairs():
    subset = blimp_result(55.04, {}, pairs=13_400)
    assert (
        tables.blimp_cell(subset) == "55.0 (200 pairs/paradigm)"
        and tables.blimp_cell(blimp_result(55.04, {})) == "55.0"
    )
    runs = {"m": {"arch": "bert-mini", "blimp": subset}}
    assert (
        tables.pairs_note(runs, {"twins": [subset] * 3}, "bert-mini")
        == "the first 200 pairs of each paradigm"
    )
    assert tables.pairs_note(runs, {"twins": [blimp_result(50, {})]}, "bert-mini").startswith(
        "NOT COMPARABLE"
    )


def test_each_phenomenon_is_judged_seed_by_seed_against_the_control_with_its_own_spread():
    def run(overall: float, a: float, b: float) -> dict:
        return {**kept(overall), "blimp": blimp_result(overall, {"a": a, "b": b})}

    # a: +5 and +6 with seeds 1 and 2 apart → beyond (starred); b: +1 and -1 with seeds 8 apart → within;
    # overall: +0.5 and +1.5 with seeds 1 and 2 apart → a mean of +1.0, within the wider spread (2)
    runs = {
        "b0": run(55.0, 40.0, 50.0),
        "b1": run(56.0, 41.0, 58.0),
        "n0": run(55.5, 45.0, 51.0),
        "n1": run(57.5, 47.0, 57.0),
    }
    plan = [point(label, "new" if label[0] == "n" else "base", int(label[1])) for label in runs]
    rows = judge.phenomena_against_control(judge.cells(plan, runs), "base").splitlines()
    assert rows[0] == "| phenomenon | base (60 min) | new (60 min) |"
    assert rows[2:] == ["| **overall** | 55.5 | +1.0 |", "| a | 40.5 | +5.5* |", "| b | 54.0 | +0.0 |"]
    # no recipe beside the control: no table
    assert judge.phenomena_against_control(judge.cells(plan[:2], runs), "base") == ""


def test_kept_files_name_no_folder_of_the_machine_that_wrote_them(tmp_path):
    data, cwd = tmp_path / "data", tmp_path / "clone"
    record = {
        "run_dir": f"{cwd}/outputs/a/0",
        "overrides": [f"data.sources.local.files={data}/wiki/train-*.jsonl.gz", "seed=1"],
        "card": {"command": f"python pretrain.py 'files={data}/wiki/x' base_dir={cwd}/outputs", "updates": 5},
    }
    assert kept_.portable(record, cwd=cwd, data=str(data)) == {
        "run_dir": "outputs/a/0",
        "overrides": ["data.sources.local.files=$CRAMMING_DATA/wiki/train-*.jsonl.gz", "seed=1"],
        "card": {
            "command": "python pretrain.py 'files=$CRAMMING_DATA/wiki/x' base_dir=outputs",
            "updates": 5,
        },
    }


def test_held_out_losses_of_different_maskings_are_not_compared():
    def masked(record: dict, fraction: float) -> dict:
        record["pretraining_card"]["config"] = {"train": {"mlm": {"mask_fraction": fraction}}}
        return record

    runs = {"b0": masked(kept(55.0, 4.8), 0.25), "n0": masked(kept(55.5, 5.2), 0.4)}
    cells = judge.cells([point("b0", "base", 0), point("n0", "new", 0)], runs)
    assert "MLM loss not compared" in judge.compare(cells[1], cells[0], "MLM loss", cells)
    assert "other task" in judge.paired_table(cells, "base")
    runs["n0"] = masked(kept(55.5, 4.7), 0.25)
    cells = judge.cells([point("b0", "base", 0), point("n0", "new", 0)], runs)
    assert judge.compare(cells[1], cells[0], "MLM loss", cells).startswith(
        "MLM loss 4.70 against 4.80: -0.10"
    )


@pytest.mark.parametrize(
    ("data", "compared"),
    [
        ({"seq_length": 64}, False),  # half the context
        ({"tokenizer": {"vocab_size": 4096}}, False),  # a loss over another vocabulary
        ({"segments": "sentence"}, False),
        # the defaults written out, against a card from before the settings (the base's data is {})
        ({"row_start": "none", "segments": "none", "seq_length": 128}, True),
        # a nested group at its default, written out as a card writes it
        ({"tokenizer": asdict(TokenizerConfig())}, True),
    ],
)
def test_held_out_losses_of_rows_cut_or_tokenized_differently_are_not_compared(data, compared):
    def with_data(record: dict, settings: dict) -> dict:
        record["pretraining_card"]["config"] = {"train": {"mlm": {"mask_fraction": 0.25}}, "data": settings}
        return record

    runs = {"b0": with_data(kept(55.0, 4.8), {}), "n0": with_data(kept(55.5, 4.7), data)}
    cells = judge.cells([point("b0", "base", 0), point("n0", "new", 0)], runs)
    text = judge.compare(cells[1], cells[0], "MLM loss", cells)
    assert text.startswith("MLM loss 4.70 against 4.80") is compared
    assert ("other task" in judge.paired_table(cells, "base")) is not compared
