"""scripts/studies/optim_study.py: the optimizer study's tables from evaluation and pretraining folders."""

from __future__ import annotations

import importlib
import json
import math
from pathlib import Path

import pytest

from cramming.eval.tasks import GLUE_TASKS

TASKS = ("SST-2", "MRPC", "STS-B", "RTE", "CoLA")
METRIC = {task: GLUE_TASKS[task].metrics[0] for task in TASKS}


def load_script():
    return importlib.import_module("scripts.studies.optim_study")


def write_eval(folder: Path, scores: dict[str, list[float]], state: int, ratio: float) -> str:
    runs = [
        {"task": task, "seed": seed, "metrics": {task: {METRIC[task]: value}}, "steps": 100,
         "seconds": 12.0, "train_seconds": 10.0, "optimizer_state_bytes": state + seed,
         "optimizer_state_ratio_to_adamw": ratio, "peak_memory_bytes": 2**20 * (seed + 1)}
        for task, values in scores.items()
        for seed, value in enumerate(values)
    ]  # fmt: skip
    folder.mkdir(parents=True)
    (folder / "glue_results.json").write_text(json.dumps({"checkpoint": "none", "runs": runs}))
    return str(folder)


def test_glue_rows_compare_with_the_reference_beyond_the_seed_spread(tmp_path, capsys):
    study = load_script()
    base = {task: [0.50, 0.52, 0.51] for task in TASKS}
    # RTE falls by 5 points, more than either spread (2 points); CoLA by 3 points, inside its own 10-point spread
    lean = {**base, "RTE": [0.45, 0.47, 0.46], "CoLA": [0.40, 0.48, 0.50]}
    rows = study.glue_rows({"adamw": write_eval(tmp_path / "a", base, 8000, 1.0),
                            "lean": write_eval(tmp_path / "b", lean, 2000, 0.25)})  # fmt: skip
    assert study.below_reference(rows[1], rows[0]) == ["RTE -5.0"]
    assert rows[1]["state_bytes"] == 2002 and rows[1]["state_ratio"] == 0.25  # the largest over runs
    assert rows[1]["peak_bytes"] == 3 * 2**20
    assert rows[0]["seed_averages"] == pytest.approx([50.0, 52.0, 51.0])
    study.main(
        ["glue", f"adamw={tmp_path / 'a'}", f"lean={tmp_path / 'b'}", "--plot", str(tmp_path / "p.png")]
    )
    table = capsys.readouterr().out
    lean_line = next(line for line in table.splitlines() if line.startswith("| lean"))
    assert (
        "RTE -5.0" in lean_line and "(25.0%)" in lean_line and "-1.60" in lean_line
    )  # medians: 49.40 against 51.00
    assert (tmp_path / "p.png").stat().st_size > 0


def test_a_row_without_all_five_tasks_is_refused(tmp_path):
    study = load_script()
    partial = {task: [0.5] for task in TASKS[:4]}
    with pytest.raises(SystemExit, match="CoLA"):
        study.glue_rows({"x": write_eval(tmp_path / "x", partial, 1, 1.0)})


def write_pretrain(folder: Path, val_loss: float, updates: int = 50, seed: int = 0) -> str:
    folder.mkdir(parents=True)
    card = {"status": "ok", "seed": seed, "config": {"train": {"optim": {"name": "adamw"}}},
            "seconds": {"train": 5.0},
            "metrics": {"updates": updates, "val_loss": val_loss, "optimizer_state_bytes": 800,
                        "optimizer_state_ratio_to_adamw": 1.0, "peak_memory_bytes": 2**20}}  # fmt: skip
    (folder / "run_card.json").write_text(json.dumps(card))
    (folder / "metrics.jsonl").write_text(json.dumps({"update": updates, "val_context_gain": 1.5}) + "\n")
    return str(folder)


def test_pretraining_rows_average_seeds_and_refuse_unequal_updates(tmp_path, capsys):
    study = load_script()
    ref = ",".join(write_pretrain(tmp_path / f"r{s}", 4.0 + 0.1 * s, seed=s) for s in range(2))
    other = write_pretrain(tmp_path / "o", 4.1)
    study.main(["pretrain", f"adamw={ref}", f"lean={other}"])
    line = next(x for x in capsys.readouterr().out.splitlines() if x.startswith("| lean"))
    assert f"{100 * (math.exp(4.1) / math.exp(4.05) - 1):+.2f}%" in line and "1.500" in line
    with pytest.raises(SystemExit, match="equal updates"):
        study.pretrain_rows({"adamw": ref, "short": write_pretrain(tmp_path / "s", 4.0, updates=40)})


def _apart(a: tuple, b: tuple) -> bool:
    """Two (x0, y0, x1, y1) boxes share no area."""
    return a[2] <= b[0] or b[2] <= a[0] or a[3] <= b[1] or b[3] <= a[1]


def test_labels_of_close_points_go_apart_and_clear_every_error_bar():
    study = load_script()
    # seven points within a few pixels, two of them the same point, each with a tall error bar
    points = [(200.0, 200.0), (200.0, 200.0), (204.0, 203.0), (210.0, 198.0), (196.0, 190.0),
              (230.0, 200.0), (207.0, 195.0)]  # fmt: skip
    sizes = [(120.0, 9.0), (150.0, 9.0), (60.0, 9.0), (90.0, 9.0), (70.0, 9.0), (40.0, 9.0), (100.0, 9.0)]
    bars = [(x - 4, y - 60, x + 4, y + 60) for x, y in points]
    area = (0.0, 0.0, 600.0, 400.0)
    boxes = study.place_labels(points, sizes, bars, area, clearance=6.0)
    assert boxes == study.place_labels(points, sizes, bars, area, clearance=6.0)  # deterministic
    for i, box in enumerate(boxes):
        assert (box[2] - box[0], box[3] - box[1]) == pytest.approx(sizes[i])
        assert area[0] <= box[0] and area[1] <= box[1] and box[2] <= area[2] and box[3] <= area[3]
        clashes = [j for j, other in enumerate(boxes) if j != i and not _apart(box, other)]
        covered = [j for j, bar in enumerate(bars) if not _apart(box, bar)]
        assert not clashes and not covered, f"label {i} at {box} overlaps labels {clashes}, bars {covered}"
        # its leader line, sampled from the point to the box, passes through no other label
        (x, y), near = (
            points[i],
            (min(max(points[i][0], box[0]), box[2]), min(max(points[i][1], box[1]), box[3])),
        )
        for t in (k / 200 for k in range(201)):
            px, py = x + t * (near[0] - x), y + t * (near[1] - y)
            inside = [j for j, o in enumerate(boxes) if j != i and o[0] < px < o[2] and o[1] < py < o[3]]
            assert not inside, f"the leader of label {i} crosses labels {inside}"


def test_a_label_without_room_is_refused():
    study = load_script()
    with pytest.raises(ValueError, match="no free place"):
        study.place_labels(
            [(50.0, 50.0)], [(200.0, 9.0)], [(46.0, 0.0, 54.0, 100.0)], (0.0, 0.0, 100.0, 100.0), 6.0
        )


def test_the_plot_labels_rows_at_the_same_point(tmp_path):
    study = load_script()
    base = {task: [0.50, 0.52, 0.51] for task in TASKS}
    rows = {"adamw": write_eval(tmp_path / "a", base, 8000, 1.0)}
    # four rows on two points (equal scores and state), as galore_adamw_8bit-r8 and its layerwise twin
    for name in ("galore_adamw_8bit-r8", "galore_adamw_8bit_layerwise-r8", "galore_adamw_4bit-r8", "lean"):
        rows[name] = write_eval(tmp_path / name, base, 2000, 0.25 if "4bit" not in name else 0.24)
    study.glue_plot([("close", study.glue_rows(rows))], tmp_path / "p.png")  # raises when labels overlap
    assert (tmp_path / "p.png").stat().st_size > 0
