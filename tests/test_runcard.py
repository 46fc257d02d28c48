"""Run cards: what they record, how a failing job ends in a single run and in a multirun, the time split;
the paused budget clock and the TensorBoard hook that go with them."""

from __future__ import annotations

import json
import socket
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from omegaconf import DictConfig, open_dict

from cramming.budget import BudgetClock
from cramming.config import register_configs
from cramming.errors import ConfigError
from cramming.job import runcard
from cramming.job.runcard import (
    RUN_CARD,
    JobFailed,
    RunCard,
    cards_under,
    git_state,
    newest_card,
    run_job,
    split_training_time,
)

REPO = Path(__file__).resolve().parent.parent


@pytest.fixture
def hydra_job(tmp_path):
    """Compose conf/eval.yaml as Hydra would for one job (a single run or job 3 of a multirun)."""

    def make(mode: RunMode) -> DictConfig:
        register_configs()
        with initialize_config_dir(str(REPO / "conf"), version_base="1.3"):
            cfg = compose("eval", overrides=["checkpoint=some/run"], return_hydra_config=True)
        with open_dict(cfg):
            cfg.hydra.mode = mode
            cfg.hydra.job.num = 3
            cfg.hydra.runtime.output_dir = str(tmp_path / "job")
            cfg.hydra.sweep.dir = str(tmp_path)
        HydraConfig.instance().set_config(cfg)
        with open_dict(cfg):
            del cfg["hydra"]
        return cfg

    yield make
    HydraConfig.instance().cfg = None


def read_card(tmp_path: Path) -> dict:
    return json.loads((tmp_path / "job" / RUN_CARD).read_text())


def test_a_finished_job_records_code_device_config_and_times(hydra_job, tmp_path):
    cfg = hydra_job(RunMode.RUN)

    def task(cfg, card: RunCard) -> None:
        assert read_card(tmp_path)["status"] == "running"  # written when the job starts
        with card.timed("eval"):
            card.metrics["answer"] = 42

    run_job(task, cfg, kind="eval")
    card = read_card(tmp_path)
    assert card["status"] == "ok" and card["error"] is None and card["finished"]
    assert card["config"]["checkpoint"] == "some/run" and card["seed"] == 0
    assert card["job"] == {
        "multirun": False,
        "num": None,
        "sweep_dir": None,
        "overrides": ["checkpoint=some/run"],
        "command": "python " + card["job"]["command"].split(" ", 1)[1],
    }
    assert card["job"]["command"].endswith(" checkpoint=some/run")
    assert card["metrics"] == {"answer": 42} and card["seconds"]["eval"] >= 0 and card["seconds"]["total"] > 0
    assert card["packages"]["torch"] and card["packages"]["hydra-core"].startswith("1.3")
    assert card["device"]["cpu"] and card["device"]["cpu_count"] >= 1
    assert card["git"] == git_state()


def test_a_failed_single_run_exits_non_zero(hydra_job, tmp_path):
    cfg = hydra_job(RunMode.RUN)

    def task(cfg, card):
        raise JobFailed(ConfigError("bad value for `eval.lr`: -1"), exit_code=2)

    with pytest.raises(SystemExit) as exit_info:
        run_job(task, cfg, kind="eval")
    assert exit_info.value.code == 2
    card = read_card(tmp_path)
    assert card["status"] == "failed" and card["error"] == "bad value for `eval.lr`: -1"

    def crash(cfg, card):
        raise RuntimeError("out of memory")

    with pytest.raises(RuntimeError, match="out of memory"):  # a single run keeps its traceback
        run_job(crash, cfg, kind="eval")
    assert read_card(tmp_path)["error"].startswith("RuntimeError: out of memory\nTraceback")


def test_a_failed_multirun_job_is_recorded_and_returns(hydra_job, tmp_path):
    cfg = hydra_job(RunMode.MULTIRUN)

    def crash(cfg, card):
        raise RuntimeError("out of memory")

    run_job(crash, cfg, kind="eval")  # returns: the sweep goes on with the next job
    card = read_card(tmp_path)
    assert card["status"] == "failed" and "RuntimeError: out of memory" in card["error"]
    assert card["job"]["multirun"] and card["job"]["num"] == 3 and card["job"]["sweep_dir"] == str(tmp_path)

    def interrupted(cfg, card):
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):  # stopping a sweep stops it
        run_job(interrupted, cfg, kind="eval")
    assert read_card(tmp_path)["status"] == "interrupted"


def test_time_split_from_the_metrics_records():
    # the first update took 1.0 s for 32 rows where a steady one takes 0.32 s; set-up took 2 s before it
    losses = [
        {"batch_size": 32, "seq_per_s": 32.0, "elapsed_h": 3.0 / 3600},
        {"batch_size": 64, "seq_per_s": 100.0, "elapsed_h": 10.0 / 3600},
        {"batch_size": 64, "seq_per_s": 100.0, "elapsed_h": 20.0 / 3600},
    ]
    anytime = [
        {"anytime_seconds": 4.0, "anytime_charged": True},
        {"anytime_seconds": 5.0, "anytime_charged": False},
    ]
    split = split_training_time(losses, anytime, wall=40.0, budget_spent=30.0)
    assert split["setup"] == pytest.approx(2.0)
    assert split["compile"] == pytest.approx(1.0 - 0.32)
    assert split["train"] == pytest.approx(30.0 - 2.0 - 0.68 - 4.0)
    assert sum(split.values()) == pytest.approx(40.0)
    # the same run resumed from a state that had spent 1000 s: the records count on from there, the split
    # is of this process's time (it took the set-up of a fresh run for 1000 s more)
    resumed = [r | {"elapsed_h": r["elapsed_h"] + 1000.0 / 3600} for r in losses]
    assert split_training_time(resumed, anytime, wall=40.0, budget_spent=30.0, elapsed_before=1000.0) == (
        pytest.approx(split)
    )


def test_paused_budget_clock_does_not_count_the_pause():
    now = [0.0]
    clock = BudgetClock(1.0, lambda: now[0])
    now[0] = 100.0
    with clock.paused():
        now[0] = 400.0
    now[0] = 450.0
    assert clock.elapsed() == pytest.approx(150.0)


@pytest.mark.parametrize(
    "override, message",
    [
        ("name=../escape", "bad value for `name`"),  # met by claim_run_dir, before any folder is made
        ("trian.steps=3", "Key 'trian' not in"),  # Hydra's own errors (also: budget=abc, arch=huge)
    ],
)
def test_configuration_errors_met_by_hydra_exit_2_before_any_folder(tmp_path, override, message):
    import subprocess
    import sys

    base = tmp_path / "base"
    done = subprocess.run(
        [sys.executable, "pretrain.py", "arch=tiny", "data=embedded", f"base_dir={base}", override],
        cwd=REPO, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    output = done.stdout + done.stderr  # once Hydra has set up logging, the message goes to stdout
    assert done.returncode == 2, output[-2000:]
    assert message in output and "Traceback" not in output
    assert list(tmp_path.iterdir()) == []  # neither base_dir nor ../escape was made


def test_cards_are_read_from_single_runs_and_multirun_jobs_alike(tmp_path):
    def card(folder: Path, started: str, **extra) -> Path:
        folder.mkdir(parents=True)
        (folder / RUN_CARD).write_text(json.dumps({"status": "ok", "started": started, **extra}))
        return folder

    single = card(tmp_path / "name" / "2026-01-01_00-00-00", "2026-01-01T00:00:00+00:00")
    job = card(tmp_path / "name" / "multirun_2026-01-01_00-00-05" / "1", "2026-01-01T00:00:05+00:00")
    # a `running` card whose process is gone on this host reads killed
    gone = card(tmp_path / "name" / "2026-01-01_00-00-09", "2026-01-01T00:00:09+00:00", status="running",
                process={"pid": 2**22 + 12345, "host": socket.gethostname()})  # fmt: skip
    (tmp_path / "name" / "2026-01-01_00-00-10").mkdir()
    (tmp_path / "name" / "2026-01-01_00-00-10" / RUN_CARD).write_text('{"status": "ok", ')  # cut short
    assert [folder for folder, _ in cards_under(tmp_path / "name")] == [single, job, gone]
    assert runcard.read_card(gone)["status"] == "killed"
    assert runcard.read_card(tmp_path / "name" / "2026-01-01_00-00-10") is None
    (tmp_path / "name" / "2026-01-01_00-00-10" / RUN_CARD).unlink()
    # single runs only: a multirun's jobs sit one level deeper
    assert newest_card(tmp_path, "name")[0] == gone and newest_card(tmp_path, "other") is None


def test_out_of_memory_is_the_users_to_fix_and_says_what_fits():
    import torch

    from cramming.job import exits

    gpu = torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB.\nIf reserved but ...")
    cpu = RuntimeError("[enforce fail at alloc_cpu.cpp:117] DefaultCPUAllocator: can't allocate memory: 9 GB")
    wrapped = RuntimeError("DataLoader worker failed")
    wrapped.__cause__ = gpu
    for err in (gpu, cpu, wrapped):
        assert exits.exit_code(err) == exits.USER_ERROR
    message = exits.failure_message(wrapped, "pretrain")
    assert "out of memory" in message and "impl.microbatch_size=auto" in message and "\n" not in message
    assert "eval.batch_size" in exits.failure_message(gpu, "eval")
    assert exits.exit_code(RuntimeError("shape mismatch")) is None  # a bug keeps its traceback
    assert exits.failure_message(ConfigError("bad value"), "pretrain") == "bad value"
