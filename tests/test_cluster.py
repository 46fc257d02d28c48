"""Sweeps as cluster jobs (cramming.job.cluster, conf/hydra/launcher/): the time limit from the budget, the hand-over
of a stopped job to submitit, and, with submitit's local launcher (the twin of the SLURM one), a pretraining
sweep whose jobs run as processes of their own, one of them interrupted by the scheduler's signal, requeued
and finished bit-identical to its uninterrupted twin."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from conftest import data_dir

from cramming.job.cluster import SUBMITIT_ENV, hand_back_to_launcher, job_minutes
from cramming.job.runcard import RUN_CARD
from cramming.model.checkpoint import load_pretrained
from cramming.study.runs_report import build_report
from cramming.train import state as train_state

REPO = Path(__file__).resolve().parent.parent


def test_job_minutes_is_the_budget_and_a_margin():
    assert job_minutes(24) == 24 * 60 + 30
    assert job_minutes(0.004, margin_min=5) == 6  # 0.24 minutes, rounded up
    assert job_minutes(None) == 240  # an evaluation without a budget


def test_only_submitits_signal_in_a_submitit_job_is_handed_back(monkeypatch):
    received = []
    previous = signal.signal(signal.SIGUSR2, lambda signum, frame: received.append(signum))
    try:
        monkeypatch.delenv(SUBMITIT_ENV, raising=False)
        hand_back_to_launcher("SIGUSR2")  # a plain run: stops with exit 140, nothing to hand back to
        pytest.importorskip("submitit", reason="the cluster extra: pip install .[cluster]")
        monkeypatch.setenv(SUBMITIT_ENV, "local")
        hand_back_to_launcher("SIGTERM")  # a cancel (or SLURM's own preemption requeue): no requeue asked
        hand_back_to_launcher("SIGINT")
        assert received == []
        hand_back_to_launcher("SIGUSR2")
        assert received == [signal.SIGUSR2]  # submitit's handler would requeue the job and exit
    finally:
        signal.signal(signal.SIGUSR2, previous)


def test_a_run_finds_a_state_only_in_its_own_folder(tmp_path):
    assert train_state.own_state(tmp_path) is None  # a first start: a new, empty folder
    (tmp_path / train_state.PREVIOUS).write_bytes(b"")
    assert train_state.own_state(tmp_path) == tmp_path / train_state.PREVIOUS
    (tmp_path / train_state.STATE).write_bytes(b"")
    assert train_state.own_state(tmp_path) == tmp_path / train_state.STATE


# ------------------------------------------------------------------------ a sweep through the local launcher

STEPS = 100  # ~0.1 s an update on one CPU thread: the signal lands well inside training


def pretraining(base_dir: Path) -> list[str]:
    """Tiny runs whose result depends on the updates only (a step schedule, train.steps; the budget is far)."""
    return [
        "arch=tiny", "data=embedded", "data.seq_length=32", f"base_dir={base_dir}", "name=cluster",
        "budget=1", f"train.steps={STEPS}", "train.lr_schedule=steps-linear", "impl.microbatch_size=8",
        "train.batch_size=32", "train.batch_size_ramp=0", "train.dropout=0.1", "impl.cpu_threads=1",
        "impl.num_workers=0", "train.validation_rows=16", "hydra/launcher=local",
    ]  # fmt: skip


def wait_for(condition, proc: subprocess.Popen, timeout: float = 300.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if proc.poll() is not None or time.monotonic() > deadline:
            out, _ = proc.communicate(timeout=60) if proc.poll() is not None else ("", "")
            raise AssertionError(f"the sweep ended or stalled before the condition held:\n{out[-4000:]}")
        time.sleep(0.05)


def interrupt_when_training(job_dir: Path, proc: subprocess.Popen) -> int:
    """SIGUSR2, as SLURM sends it before a time limit, to the job's own process once it has trained."""
    wait_for(lambda: (job_dir / "metrics.jsonl").exists() and (job_dir / RUN_CARD).exists(), proc)
    pid = json.loads((job_dir / RUN_CARD).read_text())["process"]["pid"]
    os.kill(pid, signal.SIGUSR2)
    return pid


@pytest.fixture(scope="module")
def local_sweep(tmp_path_factory) -> tuple[Path, subprocess.CompletedProcess, int]:
    """Two jobs that compute the same thing (train.log_every changes only how often a line is written); job 1
    is interrupted. Returns the sweep folder, the finished sweep and the pid of job 1's first process."""
    pytest.importorskip(
        "hydra_plugins.hydra_submitit_launcher", reason="the cluster extra: pip install .[cluster]"
    )
    base_dir = tmp_path_factory.mktemp("cluster")
    command = [sys.executable, "pretrain.py", "-m", *pretraining(base_dir), "train.log_every=10,20"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HYDRA_FULL_ERROR": "1"}
    proc = subprocess.Popen(
        command, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    try:
        wait_for(lambda: any((base_dir / "cluster").glob("multirun_*/1")), proc)
        (sweep,) = (base_dir / "cluster").glob("multirun_*")
        first_pid = interrupt_when_training(sweep / "1", proc)
        out, _ = proc.communicate(timeout=600)
    finally:
        if proc.poll() is None:
            proc.kill()
    return sweep, subprocess.CompletedProcess(command, proc.returncode, out, ""), first_pid


@pytest.mark.slow
def test_local_launcher_runs_each_job_in_a_process_of_its_own(local_sweep):
    sweep, done, _ = local_sweep
    assert done.returncode == 0, done.stdout[-4000:]
    assert list(sweep.parent.iterdir()) == [sweep]  # one sweep folder, not one per job process
    cards = [json.loads((sweep / str(n) / RUN_CARD).read_text()) for n in (0, 1)]
    assert [card["status"] for card in cards] == ["ok", "ok"]
    assert cards[0]["process"]["pid"] != cards[1]["process"]["pid"] != os.getpid()
    for card in cards:
        assert Path(card["run_dir"]).parent == sweep and card["job"]["multirun"]
        assert (Path(card["run_dir"]) / "checkpoint" / "model.safetensors").is_file()
        assert (Path(card["run_dir"]) / "pretrain.log").is_file()  # the job's log beside its card
        assert card["metrics"]["updates"] == STEPS
    report = build_report(sweep).read_text()
    rows = [line for line in report.splitlines() if line.startswith(("| 0 ", "| 1 "))]
    assert len(rows) == 2, report


@pytest.mark.slow
def test_an_interrupted_job_is_requeued_and_ends_bit_identical(local_sweep):
    sweep, _, first_pid = local_sweep
    interrupted = sweep / "1"
    card = json.loads((interrupted / RUN_CARD).read_text())
    assert card["process"]["pid"] != first_pid  # the card is the requeued process's
    log = (interrupted / "pretrain.log").read_text()
    assert "SIGUSR2 received" in log and "handing the job back to submitit" in log
    assert f"resuming from {interrupted / train_state.STATE}" in log  # no resume=true: its folder told it
    submitit_logs = "".join(p.read_text() for p in sweep.glob(".submitit/*/*_log.out"))
    assert "Requeued job" in submitit_logs
    # the budget counts on: the requeued process was charged only its own part
    assert card["metrics"]["budget_hours_spent"] * 3600 > card["seconds"]["train"]
    ours = load_pretrained(interrupted / "checkpoint").model.state_dict()
    theirs = load_pretrained(sweep / "0" / "checkpoint").model.state_dict()
    for name, value in theirs.items():
        assert torch.equal(ours[name], value), f"{name} differs after the requeue"


# -------------------------------------------------------------------------- evaluations and Optuna searches


def small_glue(base_dir: Path, checkpoint: Path) -> list[str]:
    return [
        f"checkpoint={checkpoint}", f"base_dir={base_dir}", f"eval.glue_dir={data_dir('glue')}", "eval.tasks=[RTE]",
        "eval.max_train_examples=32", "eval.max_eval_examples=32", "eval.epochs=1", "impl.device=cpu",
        "impl.cpu_threads=1",
    ]  # fmt: skip


def run_sweep(script: str, *overrides: str) -> subprocess.CompletedProcess:
    command = [sys.executable, script, "-m", *overrides]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HYDRA_FULL_ERROR": "1"}
    return subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)


@pytest.mark.slow
def test_an_interrupted_evaluation_job_is_requeued_and_keeps_its_finished_runs(local_sweep, tmp_path):
    """An evaluation sweep through the same launcher; SIGUSR2 reaches job 1 during its fine-tuning (submitit's
    own handler: requeue at once), and the requeued job fine-tunes only the (task, seed) runs not yet done."""
    sweep, _, _ = local_sweep
    seeds = f"eval.seeds=[{','.join(map(str, range(10)))}]"  # ~0.2 s each: time to land the signal
    command = [sys.executable, "eval.py", "-m", *small_glue(tmp_path, sweep / "0"), seeds, "name=glue",
               "hydra/launcher=local", "eval.optim.lr=1e-3,3e-3"]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HYDRA_FULL_ERROR": "1"}
    proc = subprocess.Popen(
        command, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    try:
        wait_for(lambda: any((tmp_path / "glue").glob("multirun_*/1/glue_runs.json")), proc)
        (job,) = (tmp_path / "glue").glob("multirun_*/1")
        kept = len(json.loads((job / "glue_runs.json").read_text())["runs"])
        pid = json.loads((job / RUN_CARD).read_text())["process"]["pid"]
        os.kill(pid, signal.SIGUSR2)
        out, _ = proc.communicate(timeout=600)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, out[-4000:]
    results = json.loads((job / "glue_results.json").read_text())
    assert len(results["runs"]) == 10 and results["reused_runs"] >= kept >= 1
    assert json.loads((job / RUN_CARD).read_text())["process"]["pid"] != pid  # the requeued process's card
    assert "Requeued job" in "".join(p.read_text() for p in job.parent.glob(".submitit/*/*_log.out"))
    assert json.loads((job.parent / "0" / RUN_CARD).read_text())["status"] == "ok"


@pytest.mark.slow
def test_the_learning_rate_search_is_a_seeded_optuna_study(local_sweep, tmp_path):
    """conf/sweep/glue-lr-search.yaml in small: three trials on RTE; the trials are the seeded sampler's draws,
    the sweeper's result names the best of them, and the report shows the result and the trial table."""
    optuna = pytest.importorskip("optuna", reason="the cluster extra: pip install .[cluster]")
    sweep, _, _ = local_sweep
    done = run_sweep(
        "eval.py", "+sweep=glue-lr-search", *small_glue(tmp_path, sweep / "0"), "hydra.sweeper.n_trials=3"
    )
    assert done.returncode == 0, done.stderr[-4000:]
    (search,) = (tmp_path / "glue-lr-search").glob("multirun_*")
    cards = [json.loads((search / str(n) / RUN_CARD).read_text()) for n in range(3)]
    tried = [card["config"]["eval"]["optim"]["lr"] for card in cards]
    # the same draws from a study of the same seed and range: the search replays from its seed
    study = optuna.create_study(sampler=optuna.samplers.TPESampler(seed=0), direction="maximize")
    expected = [study.ask().suggest_float("eval.optim.lr", 1e-5, 3e-3, log=True) for _ in range(3)]
    assert tried == pytest.approx(expected, rel=1e-12)
    result = (search / "optimization_results.yaml").read_text()
    scores = [card["metrics"]["glue_average"] for card in cards]
    assert f"best_value: {max(scores)}" in result
    report = build_report(search).read_text()
    section = report.split("## Optuna search", 1)[1].split("## Plots")[0]
    assert "optimization_results.yaml" in section and f"value {round(max(scores), 4)}" in section
    for n, lr in enumerate(tried):
        assert f"| {n} | ok | {lr} | {round(scores[n], 4)} |" in section, section


def test_the_slurm_launcher_asks_for_one_gpu_the_budgets_time_and_the_warning_signal(tmp_path, monkeypatch):
    """No SLURM here: the plugin's launcher, from conf/hydra/launcher/slurm.yaml, writes its sbatch script
    (a stand-in `srun` on PATH lets submitit build it; the submission itself is caught)."""
    pytest.importorskip(
        "hydra_plugins.hydra_submitit_launcher", reason="the cluster extra: pip install .[cluster]"
    )
    import submitit
    from hydra import compose, initialize_config_dir
    from hydra.utils import instantiate

    from cramming.config import CONF_DIR, register_configs

    (tmp_path / "bin").mkdir()
    (tmp_path / "bin" / "srun").write_text("#!/bin/sh\n")
    (tmp_path / "bin" / "srun").chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path / 'bin'}:{os.environ['PATH']}")
    scripts = []

    def caught(executor, fn, *iterables):
        scripts.append(executor._executor._make_submission_file_text("python -m submitit.core._submit", "u"))
        return []

    monkeypatch.setattr(submitit.AutoExecutor, "map_array", caught)
    register_configs()
    overrides = ["hydra/launcher=slurm", "hydra.launcher.partition=gpu", "budget=6", f"base_dir={tmp_path}"]
    with initialize_config_dir(str(CONF_DIR), version_base="1.3"):
        cfg = compose("pretrain", overrides=overrides, return_hydra_config=True)
    launcher = instantiate(cfg.hydra.launcher)
    launcher.setup(hydra_context=None, task_function=None, config=cfg)
    launcher.launch([["seed=0"], ["seed=1"]], initial_job_idx=0)
    (script,) = scripts
    for flag in ("--partition=gpu", "--gpus-per-node=1", "--ntasks-per-node=1", "--cpus-per-task=8",
                 f"--time={6 * 60 + 30}", "--signal=USR2@120"):  # fmt: skip
        assert f"#SBATCH {flag}\n" in script, script
