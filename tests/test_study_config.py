"""cramming/study/config.py: the study file is read against its schema, and a wrong key or value is refused
naming it (exit 2 from the command, never a traceback); plan.py: its runs and their commands."""

from __future__ import annotations

from pathlib import Path

import pytest

from cramming.errors import ConfigError
from cramming.study import plan
from cramming.study.__main__ import main
from cramming.study.config import STUDY_DIR, load_study


def study_file(tmp_path: Path, text: str) -> str:
    path = tmp_path / "s.yaml"
    path.write_text(text)
    return str(path)


GOOD = (
    "recipes: {base: [arch=tiny], wide: [arch=tiny, arch.hidden_size=64]}\nminutes: [0, 1]\nseeds: [0, 1]\n"
)


def test_a_study_is_every_recipe_at_every_budget_with_every_seed(tmp_path):
    name, study = load_study(study_file(tmp_path, GOOD))
    assert name == "s" and study.control_recipe == "base"
    runs = plan.points(study)
    assert [p.label for p in runs][:4] == ["base-0-s0", "base-0-s1", "base-1-s0", "base-1-s1"]
    assert len(runs) == 8 and {p.group for p in runs} == {"base-0", "base-1", "wide-0", "wide-1"}


def test_overrides_of_the_command_line_change_the_study(tmp_path):
    _, study = load_study(study_file(tmp_path, GOOD), ["seeds=[3]", "parallel=2", "control=wide"])
    assert study.seeds == [3] and study.parallel == 2 and study.control_recipe == "wide"


def test_only_runs_the_recipes_it_names(tmp_path):
    _, study = load_study(study_file(tmp_path, GOOD), ["only=[wide]"])
    assert {p.recipe for p in plan.points(study)} == {"wide"} and len(plan.points(study)) == 4


def test_each_stage_runs_the_entry_points_command(tmp_path):
    _, study = load_study(study_file(tmp_path, GOOD + "blimp_pairs: 5\nglue_dir: data/glue\n"))
    zero, one = plan.points(study)[0], plan.points(study)[2]
    assert plan.pretrain_overrides(study, "s", zero)[-5:] == [
        "budget=1", "train.steps=1", "base_dir=outputs", "name=s-base-0", "seed=0",
    ]  # fmt: skip
    assert "budget=0.0166667" in plan.pretrain_overrides(study, "s", one)
    blimp = plan.eval_overrides(study, "s", "blimp", "outputs/x/0")
    assert {"eval=blimp", "blimp.pairs_per_paradigm=5", "checkpoint=outputs/x/0", "name=s-blimp"} <= set(
        blimp
    )
    glue1k = plan.eval_overrides(study, "s", "glue1k", "c")
    assert {"eval=glue-small", "eval.glue_dir=data/glue", "eval.max_train_examples=1000"} <= set(glue1k)


def test_commands_are_the_same_as_hydra_writes_them_back():
    # a multirun's jobs record train.optim.lr=2e-3 as 0.002: the same command all the same
    assert plan.normalized(["train.optim.lr=2e-3", "seed=1"]) == plan.normalized(
        ["seed=1", "train.optim.lr=0.002"]
    )


@pytest.mark.parametrize(
    ("text", "key"),
    [
        (GOOD + "seed: [0]\n", "seeds"),  # a misspelled key: the closest are named
        ("minutes: [1]\n", "recipes"),
        ("recipes: {a: [seed=1]}\nminutes: [1]\n", "recipes.a"),  # the study sets seeds itself
        ("recipes: {a: [budget=1]}\nminutes: [1]\n", "recipes.a"),
        ("recipes: {a: [lr]}\nminutes: [1]\n", "recipes.a"),  # not key=value
        ("recipes: {a/b: []}\nminutes: [1]\n", "recipes.a/b"),  # it names folders
        ("recipes: {a: []}\n", "minutes"),
        ("recipes: {a: []}\nminutes: [-1]\n", "minutes"),
        ("recipes: {a: []}\nminutes: [1]\ncontrol: b\n", "control"),
        ("recipes: {a: []}\nminutes: [1]\nseeds: [0, 0]\n", "seeds"),
        ("recipes: {a: []}\nminutes: [1]\nonly: [b]\n", "only"),
        ("recipes: {a: []}\nminutes: [1]\nstages: [pretrain, glue2k]\n", "stages"),
        ("recipes: {a: []}\nminutes: [1]\nparallel: 0\n", "parallel"),
        ("recipes: {a: []}\nminutes: [1]\nparallel: two\n", "parallel"),
        ("recipes: {a: []}\nminutes: [1]\nlauncher: ray\n", "launcher"),
        ("recipes: {a: []}\nminutes: [1]\nblimp_pairs: 0\n", "blimp_pairs"),
        ("recipes: {a: []}\npoints: [{recipe: b, minutes: 1}]\n", "points[0].recipe"),
        ("recipes: {a: []}\npoints: [{recipe: a, minutes: 1}, {recipe: a, minutes: 1}]\n", "points"),
    ],
)
def test_a_wrong_study_file_is_refused_naming_the_key(tmp_path, text, key):
    with pytest.raises(ConfigError, match=key.replace("[", r"\[").replace("]", r"\]")):
        load_study(study_file(tmp_path, text))


def test_the_command_exits_2_with_one_line_for_a_mistake(tmp_path, caplog):
    assert main(["report", study_file(tmp_path, "recipes: {a: []}\nminutes: [1]\nparallel: 0\n")]) == 2
    assert "parallel" in caplog.text and "Traceback" not in caplog.text
    assert main(["run", "no-such-study"]) == 2
    assert "budget-curve" in caplog.text  # the studies there are named


def test_the_committed_study_files_load():
    for path in STUDY_DIR.glob("*.yaml"):
        name, study = load_study(path.stem)
        assert plan.points(study), name


def test_every_reference_clock_recipe_of_the_committed_studies_is_priced():
    """Each recipe of a reference-clock study has its shape in the calibration: one added to a study file without
    being measured would stop the study at its first run. The vocabulary and row length are the configured ones,
    which is what the tokenizer makes for these recipes."""
    from cramming import calibrate, calibration

    for path in sorted(STUDY_DIR.glob("*.yaml")):
        name, study = load_study(path.stem)
        for recipe, overrides in study.recipes.items():
            cfg = calibrate.compose([*study.pretrain, *overrides])
            if cfg.train.clock != "reference":
                continue
            shape = calibration.recipe_shape(cfg, cfg.data.tokenizer.vocab_size, cfg.data.seq_length)
            try:
                calibration.reference_costs(cfg.train.calibration, shape)
            except ConfigError as err:
                pytest.fail(f"study {name}, recipe {recipe}: {err}")
