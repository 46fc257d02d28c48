"""MLflow: the run's config and provenance as params, every metrics record as metrics at its update, the
status as the run's status (FINISHED, FAILED, KILLED for an interrupted run), the final numbers as metrics.
A sweep's jobs are child runs of one parent run (cramming.trackers.sweep). Metrics are sent at log steps, from
the main thread, at most every FLUSH_SECONDS (each with the time it was logged), and at the end.

The tracking URI: tracking.mlflow_uri, else MLFLOW_TRACKING_URI, else sqlite:///{base_dir}/mlflow.db. MLflow's
client retries a request for minutes by default; unless MLFLOW_HTTP_REQUEST_MAX_RETRIES and
MLFLOW_HTTP_REQUEST_TIMEOUT are set, they are set for this process to 2 retries and tracking.timeout_s, so a
server that goes away costs a run seconds, not minutes.
"""

from __future__ import annotations

import json
import logging
import os
import time
import urllib.error
import urllib.request
from pathlib import Path

from cramming.trackers.base import RunInfo, Tracker
from cramming.trackers.config import TrackingConfig
from cramming.utils import atomic_write_text, flatten

log = logging.getLogger("cramming")

STATUS = {"ok": "FINISHED", "failed": "FAILED", "interrupted": "KILLED"}
MAX_PARAM_LENGTH = 6000  # MLflow's limit on a param value
PARAMS_PER_REQUEST = 100  # and on params per log_batch
METRICS_PER_REQUEST = 1000  # and on metrics
# metrics go out at most this often, the records of the interval in one request: a request costs 14 ms for
# one record and 3.6 ms a record for ten (SQLite store, measured in results/trackers/)
FLUSH_SECONDS = 5.0
# in a multirun's sweep folder: the parent run its jobs nest under
SWEEP_FILE = "trackers.json"


def tracking_uri(settings: TrackingConfig, base_dir: Path) -> str:
    """tracking.mlflow_uri, else MLFLOW_TRACKING_URI, else an SQLite file beside the runs."""
    return (
        settings.mlflow_uri
        or os.environ.get("MLFLOW_TRACKING_URI")
        or f"sqlite:///{(Path(base_dir) / 'mlflow.db').resolve()}"
    )


def check_reachable(uri: str, timeout: float) -> None:
    """A tracking server answers at all (any HTTP status will do), in one request without retries: an
    unreachable server is found in seconds. Raises ConnectionError naming the URI."""
    if not uri.startswith(("http://", "https://")):
        return
    try:
        with urllib.request.urlopen(uri.rstrip("/") + "/health", timeout=timeout):
            pass
    except urllib.error.HTTPError:  # an answer: the server is there (it may want a token)
        return
    except (urllib.error.URLError, OSError) as err:
        raise ConnectionError(f"no MLflow server answers at {uri} ({getattr(err, 'reason', err)})") from err


def params_of(info: RunInfo) -> dict[str, str]:
    """The resolved config under its dotted keys, the run card's provenance under card.*, as strings."""
    flat = flatten(info.config) | flatten({"card": info.provenance})
    return {key: str(value)[:MAX_PARAM_LENGTH] for key, value in flat.items()}


class MlflowTracker(Tracker):
    name = "mlflow"
    package = "mlflow"
    fix = (
        "check tracking.mlflow_uri / MLFLOW_TRACKING_URI (is the server up, and reachable from this machine?),"
        " or track into a file: tracking.mlflow_uri=sqlite:///mlflow.db"
    )

    def __init__(self, settings: TrackingConfig, info: RunInfo) -> None:
        super().__init__(settings, info)
        self.uri = tracking_uri(settings, info.base_dir)
        check_reachable(self.uri, settings.timeout_s)
        if self.uri.startswith(("http://", "https://")):
            os.environ.setdefault("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "2")
            os.environ.setdefault("MLFLOW_HTTP_REQUEST_TIMEOUT", str(max(1, round(settings.timeout_s))))
        from mlflow import MlflowClient

        self.client = MlflowClient(tracking_uri=self.uri)
        self.step = 0
        self.pending: list = []  # metrics logged since the last request
        self.last_sent = float("-inf")  # the first record goes out at once
        earlier = info.resumed
        if earlier.get("run_id") and earlier.get("tracking_uri") == self.uri:
            self.run_id, self.continued = earlier["run_id"], True
            self.client.update_run(self.run_id, status="RUNNING")  # params stay those of its first start
            self.client.set_tag(self.run_id, "cramming.resumed_in", str(info.run_dir))
        else:
            self.run_id = self.create_run()
        log.info("mlflow: run %s at %s", self.run_id, self.uri)

    def create_run(self) -> str:
        """A new run in the project's experiment (a sweep job: under its sweep's parent run) with the params."""
        from mlflow.entities import Param

        info = self.info
        parent = parent_run(info.sweep_dir, self.uri) if info.sweep_dir else None
        tags = {
            "cramming.kind": info.kind,
            "cramming.run_dir": str(info.run_dir),
            "cramming.command": info.provenance.get("command", ""),
            "mlflow.source.git.commit": str((info.provenance.get("git") or {}).get("commit")),
        }
        if info.group:
            tags |= {"cramming.sweep": info.group, "cramming.overrides": " ".join(info.overrides)}
        if parent:
            tags["mlflow.parentRunId"] = parent["run_id"]
        experiment = parent["experiment_id"] if parent else experiment_id(self.client, self.settings.project)
        run_id = self.client.create_run(experiment, run_name=info.title, tags=tags).info.run_id
        params = [Param(key, value) for key, value in params_of(info).items()]
        for start in range(0, len(params), PARAMS_PER_REQUEST):
            self.client.log_batch(run_id, params=params[start : start + PARAMS_PER_REQUEST])
        return run_id

    def saved(self) -> dict:
        return {"run_id": self.run_id, "tracking_uri": self.uri}

    def log(self, values: dict[str, float], step: int) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        self.step = max(self.step, step)
        self.pending += [
            Metric(key, float(value), now, step) for key, value in values.items() if key != "update"
        ]
        if time.monotonic() - self.last_sent >= FLUSH_SECONDS:
            self.send()

    def delivered(self) -> bool:
        return not self.pending

    def send(self) -> None:
        """The metrics logged since the last request, in as few requests as MLflow takes."""
        pending, self.pending = self.pending, []
        self.last_sent = time.monotonic()
        for start in range(0, len(pending), METRICS_PER_REQUEST):
            self.client.log_batch(self.run_id, metrics=pending[start : start + METRICS_PER_REQUEST])

    def finish(self, status: str, summary: dict[str, float]) -> None:
        self.last_sent = float("inf")  # the summary joins the pending records: one request
        self.log(summary, self.step)
        self.send()
        self.client.set_tag(self.run_id, "cramming.status", status)
        self.client.set_terminated(self.run_id, status=STATUS[status])


def experiment_id(client, name: str) -> str:
    """The id of the experiment `name`, created when it is new (by another process at the same time: found)."""
    found = client.get_experiment_by_name(name)
    if found is not None:
        return found.experiment_id
    try:
        return client.create_experiment(name)
    except Exception:  # created meanwhile by a parallel job
        found = client.get_experiment_by_name(name)
        if found is None:
            raise
        return found.experiment_id


# ------------------------------------------------------------------------------------ a sweep's parent run


def start_parent_run(
    settings: TrackingConfig, base_dir: Path, sweep_dir: Path, group: str, command: str
) -> str:
    """The run a multirun's jobs nest under, started by the process that launches them (before any job, so
    parallel jobs find one parent); its id goes into {sweep_dir}/trackers.json. Returns the run id."""
    uri = tracking_uri(settings, base_dir)
    check_reachable(uri, settings.timeout_s)
    from mlflow import MlflowClient

    client = MlflowClient(tracking_uri=uri)
    experiment = experiment_id(client, settings.project)
    tags = {"cramming.sweep": group, "cramming.command": command, "cramming.run_dir": str(sweep_dir)}
    run_id = client.create_run(experiment, run_name=group, tags=tags).info.run_id
    saved = {"mlflow": {"run_id": run_id, "experiment_id": experiment, "tracking_uri": uri}}
    atomic_write_text(Path(sweep_dir) / SWEEP_FILE, json.dumps(saved, indent=1) + "\n")
    return run_id


def parent_run(sweep_dir: Path, uri: str) -> dict | None:
    """The parent run of the sweep in sweep_dir ({run_id, experiment_id, tracking_uri}) when one was started
    on the same tracking URI, else None (the job then stands alone, tagged with its sweep)."""
    try:
        saved = json.loads((Path(sweep_dir) / SWEEP_FILE).read_text()).get("mlflow")
    except (OSError, ValueError, AttributeError):
        return None
    return saved if isinstance(saved, dict) and saved.get("tracking_uri") == uri else None


def end_parent_run(sweep_dir: Path, jobs: int, failed: int) -> None:
    """FINISHED when every job finished, else FAILED; the counts as metrics."""
    saved = json.loads((Path(sweep_dir) / SWEEP_FILE).read_text())["mlflow"]
    from mlflow import MlflowClient
    from mlflow.entities import Metric

    client = MlflowClient(tracking_uri=saved["tracking_uri"])
    now = int(time.time() * 1000)
    counts = [Metric("jobs", float(jobs), now, 0), Metric("jobs_failed", float(failed), now, 0)]
    client.log_batch(saved["run_id"], metrics=counts)
    client.set_terminated(saved["run_id"], status="FAILED" if failed else "FINISHED")
