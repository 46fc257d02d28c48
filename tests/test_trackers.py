"""Experiment trackers (cramming.trackers): the `trackers` key, a tracker that fails costing one warning and
never the run, and, end to end on CPU, tiny pretrainings whose metrics.jsonl reappears in Weights & Biases
(offline, read back from its own .wandb file), in MLflow (a real tracking server on 127.0.0.1, queried with
MlflowClient) and in TensorBoard: params, status, a resume into the same runs, a run killed (SIGKILL) and
resumed logging each update once, an evaluation resumed into its MLflow run, a sweep under one parent run,
an Optuna search's trials, and an unreachable server."""

from __future__ import annotations

import json
import logging
import os
import signal
import socket
import struct
import subprocess
import sys
import time
from pathlib import Path

import pytest
from test_train import make_config

from cramming.errors import ConfigError
from cramming.job import trackers as session
from cramming.job.runcard import RunCard
from cramming.trackers import registry
from cramming.trackers.base import Tracker, numbers
from cramming.trackers.config import TrackingConfig

REPO = Path(__file__).resolve().parent.parent
STEPS = 12  # updates of the tracked run; its resume runs to 2 * STEPS


# ------------------------------------------------------------------------------------- configuration


def test_an_unknown_tracker_fails_at_start_up_naming_the_valid_ones(tmp_path):
    with pytest.raises(ConfigError, match="`trackers`: 'neptune'. choose one of: tensorboard, wandb, mlflow"):
        make_config(tmp_path, "trackers=[wandb,neptune]")
    with pytest.raises(ConfigError, match="`trackers`"):
        make_config(tmp_path, "trackers=[wandb,wandb]")
    with pytest.raises(ConfigError, match="tracking.wandb_mode"):
        make_config(tmp_path, "tracking.wandb_mode=sometimes")
    assert make_config(tmp_path).trackers == []  # none by default: nothing new runs unless asked


def test_train_tensorboard_still_turns_tensorboard_on(tmp_path, caplog):
    with caplog.at_level(logging.WARNING, logger="cramming"):
        config = make_config(tmp_path, "train.tensorboard=true")
    assert config.tracker_names == ["tensorboard"]
    assert "trackers=[tensorboard]" in caplog.text  # the warning names the new key
    both = make_config(tmp_path, "train.tensorboard=true", "trackers=[tensorboard,mlflow]")
    assert both.tracker_names == ["tensorboard", "mlflow"]


# ------------------------------------------------------------------- the session: failures, resume


class Recording(Tracker):
    """A tracker that keeps what it is told."""

    name = "recording"
    package = "recording"
    fix = "nothing to fix"
    runs: list[Recording] = []

    def __init__(self, settings, info):
        super().__init__(settings, info)
        self.logged, self.finished = [], None
        Recording.runs.append(self)
        self.id = info.resumed.get("id") or f"run-{len(Recording.runs)}"
        self.continued = bool(info.resumed.get("id"))

    def saved(self) -> dict:
        return {"id": self.id}

    def log(self, values, step):
        self.logged.append((step, values))

    def finish(self, status, summary):
        self.finished = (status, summary)


class Flaky(Recording):
    """Raises at its second record."""

    name = "flaky"
    fix = "the fix for flaky"

    def log(self, values, step):
        if len(self.logged) == 1:
            raise ConnectionError("server gone")
        super().log(values, step)


@pytest.fixture
def fakes(monkeypatch):
    Recording.runs = []
    monkeypatch.setitem(registry.TRACKERS, "recording", Recording)
    monkeypatch.setitem(registry.TRACKERS, "flaky", Flaky)


def card_in(run_dir: Path, **job) -> RunCard:
    return RunCard(run_dir, "pretrain", {"base_dir": str(run_dir.parent), "name": "t"}, job)


def tracker_warnings(caplog) -> list[str]:
    return [
        r.getMessage() for r in caplog.records if r.levelno == logging.WARNING and "tracker" in r.getMessage()
    ]


def test_a_tracker_that_raises_is_dropped_with_one_warning(tmp_path, fakes, caplog):
    card = card_in(tmp_path / "run")
    card.run_dir.mkdir()
    trackers = session.start_trackers(["recording", "flaky"], TrackingConfig(), card)
    with caplog.at_level(logging.WARNING, logger="cramming"):
        for update in (1, 5, 10):
            trackers.log({"update": update, "loss": 1.0 / update, "anytime": {"RTE": 0.5}, "charged": False})
        card.objective = 0.25
        card.end("ok")
    (warning,) = tracker_warnings(caplog)
    assert "flaky" in warning and "the fix for flaky" in warning
    healthy, flaky = Recording.runs
    assert [step for step, _ in healthy.logged] == [1, 5, 10]  # the others go on receiving every record
    assert healthy.logged[1] == (5, {"update": 5, "loss": 0.2, "anytime/RTE": 0.5})
    assert healthy.finished == ("ok", {"objective": 0.25})
    assert flaky.finished is None  # dropped: never called again
    # each run id, and the last record its tracker run holds: a dropped tracker's stays, where it stopped
    progress = session.record_name({"update": 1, "loss": 1.0, "anytime": {}, "charged": False})
    assert json.loads((card.run_dir / session.IDS_FILE).read_text()) == {
        "recording": {"id": "run-1", "logged": {"update": 10, "records": [progress]}},
        "flaky": {"id": "run-2", "logged": {"update": 1, "records": [progress]}},
    }


def test_a_missing_package_costs_one_warning(tmp_path, monkeypatch, caplog):
    monkeypatch.setitem(sys.modules, "wandb", None)  # `import wandb` raises ImportError
    card = card_in(tmp_path)
    with caplog.at_level(logging.WARNING, logger="cramming"):
        trackers = session.start_trackers(["wandb"], TrackingConfig(), card)
        trackers.log({"update": 1, "loss": 2.0})
        card.end("ok")
    (warning,) = tracker_warnings(caplog)
    assert "wandb" in warning and "pip install wandb" in warning
    assert not trackers.active and not (tmp_path / session.IDS_FILE).exists()


def test_a_resumed_run_is_handed_the_ids_its_predecessor_saved(tmp_path, fakes):
    first = card_in(tmp_path / "first")
    first.run_dir.mkdir()
    session.start_trackers(["recording"], TrackingConfig(), first)
    second = card_in(tmp_path / "second")
    second.run_dir.mkdir()
    session.start_trackers(["recording"], TrackingConfig(), second, continues=first.run_dir)
    assert Recording.runs[0].info.resumed == {}
    assert Recording.runs[1].info.resumed == {"id": "run-1"}
    # a file that does not read: a new run, not a failed one
    (second.run_dir / session.IDS_FILE).write_text("{not json")
    third = card_in(tmp_path / "third")
    third.run_dir.mkdir()
    session.start_trackers(["recording"], TrackingConfig(), third, continues=second.run_dir)
    assert Recording.runs[2].info.resumed == {}


def progress(update: int) -> dict:
    return {"update": update, "loss": 10.0 / update}


def test_a_run_resumed_after_a_kill_logs_each_record_once(tmp_path, fakes):
    """Killed after logging past its last saved state, a run is resumed from that state and computes those
    records again: its tracker run holds them already, so they are skipped; at the update it got to, only
    the records it did not log yet (here the final validation) go out."""
    validation = {"update": 6, "val_loss": 2.5}
    killed = card_in(tmp_path / "killed")
    killed.run_dir.mkdir()
    trackers = session.start_trackers(["recording"], TrackingConfig(), killed)
    for update in (2, 4, 6):  # saved its state at update 2, killed after logging update 6
        trackers.log(progress(update))
    # no card.end: SIGKILL; trackers.json was rewritten at every record
    resumed = card_in(tmp_path / "resumed")
    resumed.run_dir.mkdir()
    trackers = session.start_trackers(["recording"], TrackingConfig(), resumed, continues=killed.run_dir)
    for record in (progress(4), progress(6), validation, progress(8)):
        trackers.log(record)
    first, second = Recording.runs
    assert second.id == first.id and second.continued
    steps = [step for step, _ in first.logged + second.logged]
    assert steps == [2, 4, 6, 6, 8]  # update 6: the progress record once, then the validation
    assert second.logged[0] == (6, {"update": 6, "val_loss": 2.5})
    # killed again before it logs anything new, a resume still knows what the tracker run holds
    again = card_in(tmp_path / "again")
    again.run_dir.mkdir()
    trackers = session.start_trackers(["recording"], TrackingConfig(), again, continues=resumed.run_dir)
    trackers.log(progress(8))
    trackers.log(progress(10))
    assert [step for step, _ in Recording.runs[2].logged] == [10]
    # a tracker that starts a new run (another project, another server) gets every record
    fresh = card_in(tmp_path / "fresh")
    fresh.run_dir.mkdir()
    (killed.run_dir / session.IDS_FILE).write_text(
        json.dumps({"recording": {"logged": {"update": 6, "records": []}}})
    )
    trackers = session.start_trackers(["recording"], TrackingConfig(), fresh, continues=killed.run_dir)
    trackers.log(progress(4))
    assert [step for step, _ in Recording.runs[3].logged] == [4]


def test_a_record_waiting_to_be_sent_is_not_counted_as_held(tmp_path, fakes, monkeypatch):
    """A tracker that sends in batches (MLflow) holds only what it sent: a kill loses what waited, and the
    resumed run logs it again."""
    sent: list[int] = []
    monkeypatch.setattr(Recording, "delivered", lambda self: self.logged[-1][0] in sent)
    killed = card_in(tmp_path / "killed")
    killed.run_dir.mkdir()
    trackers = session.start_trackers(["recording"], TrackingConfig(), killed)
    sent.append(2)
    for update in (2, 4, 6):  # 4 and 6 still wait to be sent when the run is killed
        trackers.log(progress(update))
    resumed = card_in(tmp_path / "resumed")
    resumed.run_dir.mkdir()
    trackers = session.start_trackers(["recording"], TrackingConfig(), resumed, continues=killed.run_dir)
    for update in (2, 4, 6):
        trackers.log(progress(update))
    assert [step for step, _ in Recording.runs[1].logged] == [4, 6]


@pytest.mark.parametrize(
    ("status", "mlflow_status"), [("ok", "FINISHED"), ("failed", "FAILED"), ("interrupted", "KILLED")]
)
def test_mlflow_run_ends_with_the_run_cards_status(tmp_path, status, mlflow_status):
    pytest.importorskip("mlflow", reason="the trackers extra: pip install -e .[trackers]")
    from mlflow import MlflowClient

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"  # MLflow into a file: no server needed
    card = card_in(tmp_path / "run")
    card.run_dir.mkdir()
    trackers = session.start_trackers(["mlflow"], TrackingConfig(mlflow_uri=uri), card)
    trackers.log({"update": 4, "loss": 5.5})
    card.end(status)
    run_id = json.loads((card.run_dir / session.IDS_FILE).read_text())["mlflow"]["run_id"]
    found = MlflowClient(uri).get_run(run_id)
    assert found.info.status == mlflow_status and found.data.tags["cramming.status"] == status
    assert found.data.metrics["loss"] == 5.5


def test_numbers_are_the_records_numbers_under_their_names():
    record = {"update": 3, "loss": 2.5, "anytime": {"SST-2": 0.8}, "anytime_charged": True, "average": None}
    assert numbers(record) == {"update": 3, "loss": 2.5, "anytime/SST-2": 0.8}


def test_tensorboard_writes_the_metrics_records(tmp_path):
    pytest.importorskip("tensorboard", reason="tensorboard is an optional extra: pip install -e .[trackers]")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from cramming.trackers.tensorboard_tracker import TENSORBOARD_DIR

    card = card_in(tmp_path)
    trackers = session.start_trackers(["tensorboard"], TrackingConfig(), card)
    trackers.log({"update": 10, "loss": 7.5, "lr": 1e-3, "skipped": 0})
    trackers.log({"update": 20, "loss": 6.5, "anytime": {"RTE": 0.55}, "anytime_charged": False})
    card.end("ok")
    events = EventAccumulator(str(tmp_path / TENSORBOARD_DIR))
    events.Reload()
    assert {"loss", "lr", "skipped", "anytime/RTE"} <= set(events.Tags()["scalars"])
    assert [(e.step, e.value) for e in events.Scalars("loss")] == [(10, 7.5), (20, 6.5)]


# ------------------------------------------------------------------------- W&B's own offline files

WANDB_BLOCK = 32768  # the .wandb file: a header, then records in blocks of 32 KiB (LevelDB's log format)
WANDB_HEADER = 7  # ':W&B', magic, version; and each record's chunk header: crc32, length, type


def wandb_records(path: Path) -> list:
    """Every record of an offline run's .wandb file, as wandb's own protobuf messages."""
    from wandb.proto import wandb_internal_pb2

    data = path.read_bytes()
    assert data[:4] == b":W&B", f"{path} is no .wandb file"
    records, pending, pos = [], b"", WANDB_HEADER
    while pos + WANDB_HEADER <= len(data):
        if WANDB_BLOCK - pos % WANDB_BLOCK < WANDB_HEADER:  # a block's tail too short for a header: padding
            pos += WANDB_BLOCK - pos % WANDB_BLOCK
            continue
        _, length, kind = struct.unpack("<IHB", data[pos : pos + WANDB_HEADER])
        if pos + WANDB_HEADER + length > len(data):  # a chunk still being written
            break
        pending += data[pos + WANDB_HEADER : pos + WANDB_HEADER + length]
        pos += WANDB_HEADER + length
        if kind in (1, 4):  # a full record, or the last chunk of one
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            records.append(record)
            pending = b""
    return records


def written_wandb_records(folder: Path, wait_s: float = 120, until_update: int | None = None) -> list:
    """The records of folder's one offline run, once wandb's service has written them to its last one (its
    exit record; for a killed run, which has none, the history row of `until_update`).

    `run.finish()` returns when the service has the run's end, not when its writer has flushed the file: on a
    loaded machine the file may still lack every record for a moment (seen in CI: no run record at all).
    """
    (path,) = folder.glob("wandb/offline-run-*/run-*.wandb")
    deadline = time.monotonic() + wait_s
    while True:
        records = wandb_records(path) if path.stat().st_size >= WANDB_HEADER else []
        kinds = [record.WhichOneof("record_type") for record in records]
        if until_update is None:
            done, missing = "exit" in kinds, "the run's exit record"
        else:
            done = any(row.get("update") == until_update for row in history_rows(records))
            missing = f"the history row of update {until_update}"
        if done or time.monotonic() > deadline:
            assert done, f"{path} lacks {missing} after {wait_s:.0f} s; it holds {kinds}"
            return records
        time.sleep(0.2)


def history_rows(records: list) -> list[dict]:
    """The history rows of a run's records (wandb's own _step etc. left out)."""
    rows = []
    for record in records:
        if record.WhichOneof("record_type") == "history":
            row = {
                item.key or "/".join(item.nested_key): json.loads(item.value_json)
                for item in record.history.item
            }
            rows.append({k: v for k, v in row.items() if not k.startswith("_")})
    return rows


def wandb_run(folder: Path, until_update: int | None = None) -> dict:
    """The offline W&B run in folder/wandb: its id, group, history rows and summary."""
    records = written_wandb_records(folder, until_update=until_update)
    run, summary = None, {}
    for record in records:
        kind = record.WhichOneof("record_type")
        if kind == "run":
            run = record.run
        elif kind == "summary":
            summary |= {
                item.key or "/".join(item.nested_key): json.loads(item.value_json)
                for item in record.summary.update
            }
    return {"id": run.run_id, "group": run.run_group, "history": history_rows(records), "summary": summary}


def test_wandb_offline_run_is_grouped_by_its_sweep(tmp_path, monkeypatch):
    pytest.importorskip("wandb", reason="the trackers extra: pip install -e .[trackers]")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.delenv("WANDB_DIR", raising=False)
    sweep = tmp_path / "search" / "multirun_2026-01-01_00-00-00"
    card = card_in(sweep / "1", multirun=True, num=1, sweep_dir=str(sweep), overrides=["train.optim.lr=1e-3"])
    card.run_dir.mkdir(parents=True)
    # a loaded CI machine may take long to start wandb's service: more than the default 30 s is allowed
    trackers = session.start_trackers(["wandb"], TrackingConfig(timeout_s=300), card)
    trackers.log({"update": 1, "loss": 3.0})
    card.end("failed")
    run = wandb_run(card.run_dir)
    assert run["group"] == "search/multirun_2026-01-01_00-00-00"
    assert run["history"] == [{"update": 1, "loss": 3.0}] and run["summary"]["status"] == "failed"


# --------------------------------------------------------------------------- end to end: pretrain.py


def tiny_pretraining(base_dir: Path, *overrides: str) -> list[str]:
    """pretrain.py on the embedded corpus, arch=tiny, a fixed number of updates: seconds on one CPU thread."""
    return [
        sys.executable, str(REPO / "pretrain.py"), "arch=tiny", "data=embedded", "data.seq_length=32",
        f"base_dir={base_dir}", "budget=1", f"train.steps={STEPS}", "train.lr_schedule=steps-linear",
        "impl.microbatch_size=8", "train.batch_size=16", "train.batch_size_ramp=0", "impl.cpu_threads=1",
        "impl.num_workers=0", "train.validation_rows=16", "train.log_every=5", "tracking.timeout_s=300", *overrides,
    ]  # fmt: skip


def run_env() -> dict[str, str]:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HYDRA_FULL_ERROR": "1", "WANDB_MODE": "offline"}
    env.pop("WANDB_DIR", None)  # the offline runs go into their run folders
    env.pop("MLFLOW_TRACKING_URI", None)
    # each run starts its own wandb service, as a user's job does: not the one a test of this process started,
    # which would outlive a killed run and keep its W&B run "in use"
    env.pop("WANDB_SERVICE", None)
    return env


def run(command: list[str], base_dir: Path, timeout: float = 600) -> subprocess.CompletedProcess:
    return subprocess.run(
        command, cwd=base_dir, env=run_env(), capture_output=True, text=True, timeout=timeout
    )


def metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def mlflow_server(tmp_path_factory):
    """A real MLflow tracking server on 127.0.0.1 (SQLite store), stopped at the end of the module."""
    pytest.importorskip("mlflow", reason="the trackers extra: pip install -e .[trackers]")
    pytest.importorskip("wandb", reason="the trackers extra: pip install -e .[trackers]")
    folder = tmp_path_factory.mktemp("mlflow")
    port = free_port()
    command = [
        sys.executable, "-m", "mlflow", "server", "--backend-store-uri", f"sqlite:///{folder / 'mlflow.db'}",
        "--artifacts-destination", str(folder / "artifacts"), "--host", "127.0.0.1", "--port", str(port),
        "--workers", "1",
    ]  # fmt: skip
    log_file = open(folder / "server.log", "w")  # noqa: SIM115  closed below, after the server
    server = subprocess.Popen(command, stdout=log_file, stderr=subprocess.STDOUT)
    uri = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 180
        while not answers(uri):
            if server.poll() is not None or time.monotonic() > deadline:
                raise AssertionError(
                    f"the MLflow server did not start:\n{(folder / 'server.log').read_text()[-3000:]}"
                )
            time.sleep(0.5)
        yield uri
    finally:
        server.terminate()
        try:
            server.wait(timeout=30)
        except subprocess.TimeoutExpired:
            server.kill()
        log_file.close()


def answers(uri: str) -> bool:
    import urllib.request

    try:
        with urllib.request.urlopen(f"{uri}/health", timeout=2) as response:
            return response.status == 200
    except OSError:
        return False


@pytest.fixture(scope="module")
def base_dir(tmp_path_factory) -> Path:
    """Shared by this module's runs: the second finds the processed corpus in the cache."""
    return tmp_path_factory.mktemp("tracked")


@pytest.fixture(scope="module")
def tracked(mlflow_server, base_dir) -> tuple[Path, Path]:
    """A run with all three trackers, then the same run resumed (resume=true) for STEPS more updates.
    Returns both run folders."""
    command = tiny_pretraining(
        base_dir,
        "name=tracked",
        f"tracking.mlflow_uri={mlflow_server}",
        "trackers=[tensorboard,wandb,mlflow]",
    )
    done = run(command, base_dir)
    assert done.returncode == 0, done.stderr[-4000:]
    time.sleep(1.1)  # run folders are named by the second
    resumed = run([*command, "resume=true", f"train.steps={2 * STEPS}"], base_dir)
    assert resumed.returncode == 0, resumed.stderr[-4000:]
    first, second = sorted(p for p in (base_dir / "tracked").iterdir() if p.is_dir())
    return first, second


def mlflow_history(client, run_id: str) -> dict[str, list[tuple[int, float]]]:
    metrics = client.get_run(run_id).data.metrics
    return {key: sorted((m.step, m.value) for m in client.get_metric_history(run_id, key)) for key in metrics}


def expected_history(*run_dirs: Path) -> dict[str, list[tuple[int, float]]]:
    """metrics.jsonl as (update, value) per name, the way a tracker gets it."""
    expected: dict[str, list] = {}
    for run_dir in run_dirs:
        for record in metrics(run_dir):
            for key, value in numbers(record).items():
                if key != "update":
                    expected.setdefault(key, []).append((record["update"], value))
    return {key: sorted(values) for key, values in expected.items()}


@pytest.mark.slow
def test_wandb_offline_history_holds_metrics_jsonl(tracked):
    first, second = tracked
    run = wandb_run(first)
    assert run["history"] == [numbers(record) for record in metrics(first)]  # every record, same values
    assert run["summary"]["status"] == "ok" and run["summary"]["objective"] > 0
    # the resumed run continued the same W&B run: same id, the records from where it took up
    continued = wandb_run(second)
    assert continued["id"] == run["id"]
    assert continued["history"] == [numbers(record) for record in metrics(second)]


@pytest.mark.slow
def test_mlflow_run_holds_metrics_params_and_status(tracked, mlflow_server):
    from mlflow import MlflowClient

    first, second = tracked
    saved = json.loads((first / session.IDS_FILE).read_text())["mlflow"]
    assert saved["tracking_uri"] == mlflow_server
    client = MlflowClient(mlflow_server)
    found = client.get_run(saved["run_id"])
    # a resumed run keeps its run id: the same MLflow run holds both parts, ended by the second
    assert json.loads((second / session.IDS_FILE).read_text())["mlflow"]["run_id"] == saved["run_id"]
    assert found.info.status == "FINISHED" and found.data.tags["cramming.status"] == "ok"
    history = mlflow_history(client, saved["run_id"])
    expected = expected_history(first, second)
    assert {key: history[key] for key in expected} == expected
    assert max(step for step, _ in history["loss"]) == 2 * STEPS
    assert {key for key in history if key not in expected} <= {"objective"} | {
        k for k in history if k.startswith("final/")
    }
    card = json.loads((second / "run_card.json").read_text())
    assert history["objective"][-1][1] == pytest.approx(card["metrics"]["val_loss"])
    # params: the resolved config under its keys, the run card's provenance under card.*
    params = found.data.params
    assert params["arch.name"] == "tiny" and params["train.steps"] == str(STEPS)
    assert params["card.git.commit"] == card["git"]["commit"]
    assert params["card.data.tokenizer_sha256"] == card["data"]["tokenizer_sha256"]
    assert params["card.packages.torch"] == card["packages"]["torch"] and "card.device.cpu" in params


@pytest.mark.slow
def test_tensorboard_events_hold_metrics_jsonl(tracked):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    first, _ = tracked
    events = EventAccumulator(str(first / "tensorboard"))
    events.Reload()
    expected = expected_history(first)["loss"]
    assert [(e.step, e.value) for e in events.Scalars("loss")] == [
        (s, pytest.approx(v, rel=1e-6)) for s, v in expected
    ]


def kill_past_a_save(process: subprocess.Popen, runs: Path, wait_s: float = 400) -> tuple[Path, int, int]:
    """SIGKILL a training process at a moment when its W&B run holds updates past its last saved state: (its
    run folder, the update of that state, the last update it logged). The process is paused (SIGSTOP) while
    its state, metrics.jsonl and trackers.json are read, so they are what it leaves when it dies; it is killed
    where its trackers.json has noted the last record it handed to W&B, once W&B has written that record."""
    from cramming.train.state import StateUnreadable, read_state

    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline:
        assert process.poll() is None, f"the run ended (exit {process.returncode}) before it could be killed"
        time.sleep(0.05)
        found = sorted(runs.glob("*/state.pt"))
        if not found:
            continue
        run_dir = found[-1].parent
        os.kill(process.pid, signal.SIGSTOP)
        try:
            saved = read_state(run_dir / "state.pt").updates
            logged = json.loads((run_dir / session.IDS_FILE).read_text())["wandb"]["logged"]["update"]
            last = metrics(run_dir)[-1]["update"]
        except (OSError, ValueError, KeyError, StateUnreadable):  # a line or file half written: look again
            os.kill(process.pid, signal.SIGCONT)
            continue
        if logged == last and logged >= saved + 2:
            written_wandb_records(run_dir, until_update=logged)  # W&B writes its file every second
            os.kill(process.pid, signal.SIGKILL)
            process.wait(timeout=60)
            return run_dir, saved, logged
        os.kill(process.pid, signal.SIGCONT)
    process.kill()
    raise AssertionError(f"no moment with updates logged past a saved state came within {wait_s:.0f} s")


@pytest.mark.slow
def test_a_run_killed_between_two_saves_and_resumed_logs_each_update_once(mlflow_server, base_dir):
    """SIGKILL (the out-of-memory killer, a lost node) leaves no chance to save: the run resumes from its last
    saved state and computes the updates after it again. Its W&B history (read from the offline run files)
    holds each update once, the ones the killed run logged from that run; MLflow holds each step once."""
    from mlflow import MlflowClient

    command = tiny_pretraining(
        base_dir,
        "name=killed",
        f"tracking.mlflow_uri={mlflow_server}",
        "trackers=[wandb,mlflow]",
        "train.steps=100000",  # killed long before
        "train.log_every=1",
        "train.checkpoint_every_min=0.01",  # a state every 0.6 s of training: several updates apart
    )
    with open(base_dir / "killed.log", "w") as output:
        process = subprocess.Popen(
            command, cwd=base_dir, env=run_env(), stdout=output, stderr=subprocess.STDOUT
        )
        try:
            killed, saved, logged = kill_past_a_save(process, base_dir / "killed")
        finally:
            if process.poll() is None:
                process.kill()
    first = wandb_run(killed, until_update=logged)  # no exit record: what W&B wrote before the kill
    assert [row["update"] for row in first["history"]] == list(range(1, logged + 1))
    final = logged + 3
    time.sleep(1.1)  # run folders are named by the second
    done = run([*command, "resume=true", f"train.steps={final}"], base_dir)
    assert done.returncode == 0, done.stderr[-4000:]
    (resumed,) = (p for p in (base_dir / "killed").iterdir() if p.is_dir() and p != killed)
    assert metrics(resumed)[0]["update"] == saved + 1  # it took up the saved state, before what W&B holds
    second = wandb_run(resumed)
    assert second["id"] == first["id"]
    # every update's progress record once: up to the kill from the killed run, then from the resumed one
    rows = first["history"] + second["history"]
    assert [row["update"] for row in rows if "loss" in row] == list(range(1, final + 1))
    assert second["history"] == [numbers(record) for record in metrics(resumed) if record["update"] > logged]
    assert "val_loss" in second["history"][-1] and second["summary"]["status"] == "ok"
    # MLflow: the same run, each step once; what the killed run had not sent yet came from the resumed run
    run_id = json.loads((killed / session.IDS_FILE).read_text())["mlflow"]["run_id"]
    assert json.loads((resumed / session.IDS_FILE).read_text())["mlflow"]["run_id"] == run_id
    client = MlflowClient(mlflow_server)
    steps = [step for step, _ in mlflow_history(client, run_id)["loss"]]
    assert len(steps) == len(set(steps)) and set(range(saved + 1, final + 1)) <= set(steps)
    assert client.get_run(run_id).info.status == "FINISHED"


@pytest.mark.slow
def test_sweep_jobs_nest_under_one_parent_run(mlflow_server, base_dir, tracked):
    from mlflow import MlflowClient

    command = tiny_pretraining(
        base_dir,
        "name=sweep",
        f"tracking.mlflow_uri={mlflow_server}",
        "trackers=[mlflow]",
        "train.optim.lr=1e-3,2e-3",
    )
    command.insert(2, "-m")  # after the script: a multirun
    done = run(command, base_dir)
    assert done.returncode == 0, done.stderr[-4000:]
    (sweep,) = (base_dir / "sweep").glob("multirun_*")
    parent_id = json.loads((sweep / "trackers.json").read_text())["mlflow"]["run_id"]
    client = MlflowClient(mlflow_server)
    parent = client.get_run(parent_id)
    assert parent.info.status == "FINISHED" and parent.info.run_name == f"sweep/{sweep.name}"
    children = client.search_runs([parent.info.experiment_id], f"tags.mlflow.parentRunId = '{parent_id}'")
    assert sorted(c.data.params["train.optim.lr"] for c in children) == ["0.001", "0.002"]
    assert all(
        c.info.status == "FINISHED" and c.data.tags["cramming.sweep"] == f"sweep/{sweep.name}"
        for c in children
    )
    for child in children:
        job = Path(child.data.tags["cramming.run_dir"])
        assert job.parent == sweep
        assert mlflow_history(client, child.info.run_id)["loss"] == expected_history(job)["loss"]


@pytest.mark.slow
def test_an_unreachable_tracker_costs_one_warning_not_the_run(base_dir, tracked):
    closed = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    done = run(
        tiny_pretraining(base_dir, "name=unreachable", f"tracking.mlflow_uri={closed}", "trackers=[mlflow]"),
        base_dir,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    (run_dir,) = (base_dir / "unreachable").iterdir()
    assert (run_dir / "checkpoint" / "model.safetensors").is_file()
    assert metrics(run_dir)[-1]["update"] == STEPS
    output = done.stdout + done.stderr
    warnings = [line for line in output.splitlines() if "[WARNING]" in line]
    assert len(warnings) == 1 and "mlflow" in warnings[0] and closed in warnings[0], warnings


# ------------------------------------------------------------------------- end to end: eval.py, Optuna


@pytest.mark.slow
def test_optuna_search_logs_each_trial_and_its_glue_scores(mlflow_server, base_dir, tracked, glue_dir):
    pytest.importorskip(
        "hydra_plugins.hydra_optuna_sweeper", reason="the cluster extra: pip install .[cluster]"
    )
    from mlflow import MlflowClient

    first, _ = tracked
    command = [
        sys.executable, str(REPO / "eval.py"), "-m", "+sweep=glue-lr-search", f"checkpoint={first}",
        f"base_dir={base_dir}", f"eval.glue_dir={glue_dir}", "eval.tasks=[RTE]", "eval.seeds=[0,1]",
        "eval.epochs=1", "eval.max_train_examples=32", "eval.max_eval_examples=32", "impl.device=cpu",
        "hydra.sweeper.n_trials=2", "trackers=[mlflow]", f"tracking.mlflow_uri={mlflow_server}",
    ]  # fmt: skip
    done = run(command, base_dir)
    assert done.returncode == 0, done.stderr[-4000:]
    (sweep,) = (base_dir / "glue-lr-search").glob("multirun_*")
    parent_id = json.loads((sweep / "trackers.json").read_text())["mlflow"]["run_id"]
    client = MlflowClient(mlflow_server)
    trials = client.search_runs(
        [client.get_run(parent_id).info.experiment_id], f"tags.mlflow.parentRunId = '{parent_id}'"
    )
    assert len(trials) == 2
    for trial in trials:
        job = Path(trial.data.tags["cramming.run_dir"])
        results = json.loads((job / "glue_results.json").read_text())
        # the trial's parameter (drawn by the sweeper) and its objective, the GLUE average
        assert float(trial.data.params["eval.optim.lr"]) == results["config"]["eval"]["optim"]["lr"]
        assert f"eval.optim.lr={trial.data.params['eval.optim.lr']}" in trial.data.tags["cramming.overrides"]
        logged = trial.data.metrics
        assert logged["objective"] == pytest.approx(results["glue_average"]) == logged["glue_average"]
        # every seed's scores and the medians
        seeds = {run["seed"]: run["metrics"]["RTE"]["accuracy"] for run in results["runs"]}
        assert {logged[f"glue/RTE/seed_{seed}/accuracy"] for seed in seeds} == set(seeds.values())
        assert logged["glue/RTE/accuracy"] == pytest.approx(results["scores"]["RTE"]["median"])


@pytest.mark.slow
def test_an_evaluation_resumed_with_resume_true_appends_to_its_mlflow_run(
    mlflow_server, base_dir, tracked, glue_dir
):
    """Stopped (SIGTERM) after its first fine-tuning run, an evaluation is taken up with resume=true: the same
    MLflow run, KILLED in between, ends FINISHED and holds the scores of the run the first part fine-tuned
    and of the one the second part did."""
    from mlflow import MlflowClient

    checkpoint, _ = tracked
    command = [
        sys.executable, str(REPO / "eval.py"), f"checkpoint={checkpoint}", f"base_dir={base_dir}",
        "name=glue-resumed", f"eval.glue_dir={glue_dir}", "eval.tasks=[RTE]", "eval.seeds=[0,1]", "eval.epochs=1",
        "eval.max_train_examples=256", "eval.max_eval_examples=32", "impl.device=cpu", "trackers=[mlflow]",
        f"tracking.mlflow_uri={mlflow_server}",
    ]  # fmt: skip
    runs = base_dir / "glue-resumed"
    with open(base_dir / "glue-resumed.log", "w") as output:
        process = subprocess.Popen(
            command, cwd=base_dir, env=run_env(), stdout=output, stderr=subprocess.STDOUT
        )
        try:
            stop_after_the_first_run(process, runs)
            assert process.wait(timeout=600) == 128 + signal.SIGTERM
        finally:
            if process.poll() is None:
                process.kill()
    (first,) = runs.iterdir()
    run_id = json.loads((first / session.IDS_FILE).read_text())["mlflow"]["run_id"]
    client = MlflowClient(mlflow_server)
    assert client.get_run(run_id).info.status == "KILLED"
    time.sleep(1.1)  # run folders are named by the second
    done = run([*command, "resume=true"], base_dir)
    assert done.returncode == 0, done.stderr[-4000:]
    (second,) = (p for p in runs.iterdir() if p != first)
    assert json.loads((second / session.IDS_FILE).read_text())["mlflow"]["run_id"] == run_id
    found = client.get_run(run_id)
    assert found.info.status == "FINISHED" and found.data.tags["cramming.resumed_in"] == str(second)
    results = json.loads((second / "glue_results.json").read_text())
    assert [(r["seed"], "reused_from" in r) for r in results["runs"]] == [(0, True), (1, False)]
    logged = found.data.metrics
    for part in results["runs"]:  # the first part's run and the second's, in the one MLflow run
        assert logged[f"glue/RTE/seed_{part['seed']}/accuracy"] == part["metrics"]["RTE"]["accuracy"]
    assert logged["glue_average"] == pytest.approx(results["glue_average"])
    # no second run for this evaluation in the experiment
    experiment = found.info.experiment_id
    assert [
        r.info.run_id for r in client.search_runs([experiment], "tags.cramming.run_dir LIKE '%glue-resumed%'")
    ] == [run_id]


def stop_after_the_first_run(process: subprocess.Popen, runs: Path, wait_s: float = 400) -> None:
    """SIGTERM an evaluation once its first (task, seed) is finished and kept, while the second fine-tunes. It
    is paused (SIGSTOP) while its kept runs are read, so the signal lands before the second one finishes."""
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline:
        assert process.poll() is None, (
            f"the evaluation ended (exit {process.returncode}) before it was stopped"
        )
        time.sleep(0.02)
        kept = list(runs.glob("*/glue_runs.json"))
        if not kept:
            continue
        os.kill(process.pid, signal.SIGSTOP)
        try:
            finished = len(json.loads(kept[0].read_text())["runs"])
        except (OSError, ValueError, KeyError):  # being replaced: look again
            os.kill(process.pid, signal.SIGCONT)
            continue
        assert finished == 1, "both fine-tuning runs finished before the evaluation could be stopped"
        os.kill(process.pid, signal.SIGTERM)
        os.kill(process.pid, signal.SIGCONT)
        return
    raise AssertionError(f"the evaluation kept no finished run within {wait_s:.0f} s")
