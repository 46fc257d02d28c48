"""cramming/study/runner.py: `run` starts only what no run card or kept file says is done, continues a stopped
run in its own folder, and runs N at once only where the clock allows it. The entry points are not started
here (launch.call records the command lines); tests/test_study.py runs a study for real."""

from __future__ import annotations

import concurrent.futures
import contextlib
import json
from pathlib import Path

import pytest

from cramming.errors import ConfigError
from cramming.study import kept, launch, plan, runner
from cramming.study.config import load_study
from cramming.study.figures import shape

RECIPES = (
    "recipes: {base: [arch=tiny, data=embedded], fast: [arch=tiny, data=embedded, train.optim.lr=2e-3]}\n"
)


@pytest.fixture
def study(tmp_path):
    def make(*overrides: str) -> tuple[str, object]:
        path = tmp_path / "s.yaml"
        path.write_text(
            RECIPES + "minutes: [1]\nseeds: [0, 1]\nstages: [pretrain, blimp]\n"
            f"base_dir: {tmp_path / 'outputs'}\nkeep: {tmp_path / 'runs'}\n"
        )
        return load_study(str(path), list(overrides))

    return make


@pytest.fixture
def started(monkeypatch) -> list[list[str]]:
    """The command lines the study starts; none of them runs."""
    calls: list[list[str]] = []
    monkeypatch.setattr(launch, "call", lambda *argvs: calls.extend(argv[2:] for argv in argvs) or 0)
    return calls


def write_card(
    folder: Path, overrides: list[str], status: str = "ok", started: str = "00:00", ended: str = "00:10"
) -> Path:
    folder.mkdir(parents=True)
    card = {"status": status, "job": {"overrides": overrides}, "config": {"arch": {"name": "tiny"}},
            "started": f"2026-01-01T{started}:00+00:00", "finished": f"2026-01-01T{ended}:00+00:00",
            "metrics": {"updates": 7}}  # fmt: skip
    (folder / "run_card.json").write_text(json.dumps(card))
    return folder


def pretraining(name, config, label: str, job: int, **card) -> Path:
    point = next(p for p in plan.points(config) if p.label == label)
    root = Path(config.base_dir) / plan.pretrain_name(name, point)
    return write_card(
        root / "multirun_2026-01-01_00-00-00" / str(job), plan.pretrain_overrides(config, name, point), **card
    )


def as_study(name, config) -> runner.Study:
    return runner.Study(
        name, config, plan.points(config), Path(config.keep), runner.compose_recipes(name, config)
    )


def test_a_stage_is_done_when_a_card_of_the_same_command_says_ok(study):
    name, config = study()
    pretraining(name, config, "fast-1-s0", 0)  # the card records train.optim.lr=0.002: the same command
    pretraining(name, config, "fast-1-s1", 1, status="failed")
    todo = [p.label for p in runner.todo(as_study(name, config), "pretrain")]
    assert todo == ["base-1-s0", "base-1-s1", "fast-1-s1"]


def test_a_kept_stage_is_done_without_its_run_folder(study, started):
    name, config = study("stages=[pretrain]")
    for point in plan.points(config):
        kept.keep_run(Path(config.keep), point, [], {}, {"pretraining_card": {"status": "ok"}})
    runner.run_study(name, config)
    assert started == []  # nothing started


def test_a_stopped_run_continues_in_its_own_folder_and_the_rest_start_as_multiruns(study, started):
    name, config = study("stages=[pretrain]")
    stopped = pretraining(name, config, "base-1-s1", 1, status="interrupted")
    (stopped / "state.pt").write_bytes(b"")
    pretraining(name, config, "fast-1-s0", 0, status="interrupted")  # no state saved: starts afresh
    runner.run_study(name, config)
    assert started[0][-1] == f"hydra.run.dir={stopped}" and "seed=1" in started[0]
    assert started[1][0] == "-m" and "seed=0,1" in started[1] and "name=s-base-1" in started[1]
    assert "seed=0,1" in started[2] and "name=s-fast-1" in started[2]
    assert len(started) == 3


def test_pretraining_on_the_wall_clock_runs_one_at_a_time_and_evaluations_n_at_once(study, started):
    pytest.importorskip(
        "hydra_plugins.hydra_joblib_launcher", reason="the cluster extra: pip install .[cluster]"
    )
    name, config = study("parallel=2", "stages=[pretrain]")
    runner.run_study(name, config)
    assert len(started) == 2 and not any(a.startswith("hydra/launcher") for a in started[0] + started[1])
    name, config = study("parallel=2", "stages=[blimp]")
    labels = [p.label for p in plan.points(config)]
    folders = [pretraining(name, config, label, i) for i, label in enumerate(labels)]
    started.clear()
    runner.run_study(name, config)
    assert (
        len(started) == 1
        and "hydra/launcher=joblib" in started[0]
        and "hydra.launcher.n_jobs=2" in started[0]
    )
    assert f"checkpoint={','.join(map(str, folders))}" in started[0] and "eval=blimp" in started[0]
    recipes = as_study(name, config).recipes | {"base": runner.Recipe("reference", "tiny")}
    reference = runner.Study(name, config, [], Path(config.keep), recipes)
    assert reference.at_once("base") == 2 and reference.at_once("fast") == 1 and reference.at_once(None) == 2


def test_runs_that_may_share_the_machine_go_side_by_side_seed_by_seed(study, monkeypatch):
    pytest.importorskip(
        "hydra_plugins.hydra_joblib_launcher", reason="the cluster extra: pip install .[cluster]"
    )
    waves: list[list[list[str]]] = []
    monkeypatch.setattr(launch, "call", lambda *argvs: waves.append([a[2:] for a in argvs]) or 0)
    name, config = study(
        "parallel=2", "stages=[pretrain]", "seeds=[0,1,2]", "pretrain=[train.clock=reference]"
    )
    stopped = pretraining(name, config, "fast-1-s1", 1, status="interrupted")
    (stopped / "state.pt").write_bytes(b"")
    runner.run_study(name, config)
    # three waves of two: each seed's recipes together; the stopped run beside the fresh one of its seed
    assert len(waves) == 3
    assert [sorted(a for a in c if a.startswith(("seed=", "name="))) for c in waves[0]] == [
        ["name=s-base-1", "seed=0"], ["name=s-fast-1", "seed=0"]
    ]  # fmt: skip
    assert waves[1][0][-1] == f"hydra.run.dir={stopped}" and "seed=1" in waves[1][0]
    assert "name=s-base-1" in waves[1][1] and "seed=1" in waves[1][1]
    assert all(len(wave) == 2 and not any("n_jobs" in a for c in wave for a in c) for wave in waves)


def test_an_evaluation_whose_pretraining_is_not_here_is_refused(study):
    name, config = study("stages=[blimp]")
    with pytest.raises(ConfigError, match="no finished pretraining"):
        runner.run_study(name, config)


def test_a_misspelled_recipe_is_refused_before_anything_starts(tmp_path, started):
    path = tmp_path / "s.yaml"
    path.write_text("recipes: {base: [arch=tiny, train.optim.lrr=1]}\nminutes: [1]\n")
    with pytest.raises(ConfigError, match="recipe base"):
        runner.run_study(*load_study(str(path)))
    assert started == []


def test_finished_runs_are_kept_with_the_runs_that_shared_the_machine(study):
    name, config = study()
    pretraining(name, config, "base-1-s0", 0, started="00:00", ended="00:10")
    pretraining(name, config, "base-1-s1", 1, started="00:05", ended="00:15")
    pretraining(name, config, "fast-1-s0", 0, started="00:20", ended="00:30")
    study_ = as_study(name, config)
    runner.keep(study_, study_.plan)
    record = kept.read_run(Path(config.keep), "base-1-s0")
    assert record["arch"] == "tiny" and record["pretraining_card"]["metrics"]["updates"] == 7
    assert record["beside"] == {"pretrain": ["base-1-s1"]}
    assert kept.read_run(Path(config.keep), "fast-1-s0")["beside"] == {"pretrain": []}
    assert not kept.run_path(Path(config.keep), "fast-1-s1").exists()  # nothing finished: nothing kept


def test_a_failed_run_stops_the_study_non_zero(study, monkeypatch):
    monkeypatch.setattr(launch, "call", lambda *argvs: 3)
    name, config = study("stages=[pretrain]")
    with pytest.raises(runner.StageFailed, match="exit 3"):
        runner.run_study(name, config)


def test_each_model_shape_gets_its_floor_from_a_run_of_its_own_shape(study, monkeypatch):
    name, config = study("stages=[floor]", "recipes.fast=[arch=tiny,data=embedded,arch.num_layers=3]")
    shallow = pretraining(name, config, "base-1-s1", 1)
    deep = pretraining(name, config, "fast-1-s0", 0)
    drawn = []

    def fake_floor(checkpoint, shape, seeds, blimp_dir, pairs):
        drawn.append((checkpoint, shape))
        return {"arch": shape, "seeds": seeds, "twins": [], "published": {}}

    monkeypatch.setattr(runner.floor, "floor", fake_floor)
    runner.run_study(name, config)
    assert drawn == [(shallow, "tiny")] * 3 + [(deep, "tiny.num_layers=3")] * 3  # a twin a seed
    floors = kept.read_floors(Path(config.keep))
    assert set(floors) == {"tiny", "tiny.num_layers=3"} and floors["tiny"]["seeds"] == [0, 1, 2]
    runner.run_study(name, config)
    assert len(drawn) == 6  # kept: not drawn again


def test_the_floors_twins_are_scored_parallel_at_a_time_and_kept_in_seed_order(study, monkeypatch):
    name, config = study(
        "stages=[floor]", "parallel=2", "recipes.fast=[arch=tiny,data=embedded,arch.num_layers=3]"
    )
    pretraining(name, config, "base-1-s0", 0)
    pretraining(name, config, "fast-1-s0", 0)
    pools = []

    @contextlib.contextmanager
    def threads_for_processes(size, threads):
        pools.append(size)
        with concurrent.futures.ThreadPoolExecutor(max_workers=size) as pool:
            yield pool

    def fake_floor(checkpoint, shape, seeds, blimp_dir, pairs):
        return {"arch": shape, "seeds": seeds, "twins": [{"seed": seeds[0]}], "published": {}}

    monkeypatch.setattr(runner, "floor_pool", threads_for_processes)
    monkeypatch.setattr(runner.floor, "floor", fake_floor)
    runner.run_study(name, config)
    assert pools == [2]
    for floor in kept.read_floors(Path(config.keep)).values():
        assert floor["seeds"] == [0, 1, 2] and [t["seed"] for t in floor["twins"]] == [0, 1, 2]


def test_a_recipe_that_changes_the_tokenizer_has_a_floor_of_its_own():
    assert shape("tiny", ["arch.num_layers=6", "train.optim.lr=2e-3"]) == "tiny.num_layers=6"
    assert (
        shape("tiny", ["arch.num_layers=6", "data.tokenizer.vocab_size=4096", "data.seq_length=64"])
        == "tiny.num_layers=6.tokenizer.vocab_size=4096"
    )


def test_the_load_is_told_only_for_a_window_the_sampling_watched():
    sampler = launch.LoadSampler(every=30.0)
    sampler.samples = [(1000.0, 1.0), (1030.0, 3.0), (1060.0, 2.0)]
    assert sampler.summary(1000.0, 1060.0) == {"mean": 2.0, "max": 3.0, "samples": 3}
    assert sampler.summary(1031.0, 1040.0)["samples"] == 1  # a short run between two samples: the nearest
    assert sampler.summary(0.0, 900.0) is None  # a pretraining made before this stage began sampling
