"""What a user sees of a sweep in MLflow: a local tracking server, a two-job tiny pretraining sweep logged to it
(trackers=[mlflow]), and a headless Chromium screenshot of the experiment page with the sweep's runs.

    python scripts/studies/screenshot_mlflow.py --out results/trackers/mlflow-sweep.png

Needs mlflow (pip install -e .[trackers]) and a Chromium (Debian: apt-get install chromium). Everything else
(the server's SQLite store, the runs) goes into a temporary folder, removed at the end; --keep leaves the server
running for a look in a browser.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
# two tiny pretrainings on the embedded corpus that differ in their learning rate: a minute on one CPU thread
SWEEP = [
    "arch=tiny", "data=embedded", "data.seq_length=32", "budget=1", "train.steps=40",
    "train.lr_schedule=steps-linear", "impl.microbatch_size=8", "train.batch_size=16",
    "train.batch_size_ramp=0", "impl.cpu_threads=1", "impl.num_workers=0", "train.validation_rows=16",
    "train.log_every=5", "name=lr-sweep", "trackers=[mlflow]", "train.optim.lr=1e-3,3e-3",
]  # fmt: skip
# MLflow's UI reads a shared view of an experiment page from the experiment's tag SHARED_VIEW + key
SHARED_VIEW = "mlflow.sharedViewState."
VIEW_KEY = "cramming-sweep"
CHROMIUM_FLAGS = [
    "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
    "--disable-background-networking", "--disable-component-update", "--disable-sync", "--hide-scrollbars",
]  # fmt: skip


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(folder: Path, port: int) -> subprocess.Popen:
    """An MLflow tracking server with an SQLite store in `folder`; returns once it answers."""
    command = [
        sys.executable, "-m", "mlflow", "server", "--backend-store-uri", f"sqlite:///{folder / 'mlflow.db'}",
        "--artifacts-destination", str(folder / "artifacts"), "--host", "127.0.0.1", "--port", str(port),
        "--workers", "1",
    ]  # fmt: skip
    server = subprocess.Popen(command, stdout=open(folder / "server.log", "w"), stderr=subprocess.STDOUT)  # noqa: SIM115
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline and server.poll() is None:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2):
                return server
        except OSError:
            time.sleep(0.5)
    server.kill()
    raise SystemExit(f"the MLflow server did not start; see {folder / 'server.log'}")


def run_sweep(base_dir: Path, uri: str) -> Path:
    """The two-job sweep; returns its folder."""
    command = [
        sys.executable,
        str(REPO / "pretrain.py"),
        "-m",
        *SWEEP,
        f"base_dir={base_dir}",
        f"tracking.mlflow_uri={uri}",
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    subprocess.run(command, cwd=REPO, env=env, check=True)
    (sweep,) = (base_dir / "lr-sweep").glob("multirun_*")
    return sweep


def sweep_view(uri: str, experiment: str) -> str:
    """The experiment page showing the sweep's runs flat (sorted by name: the parent, then its jobs, rather than
    the jobs folded under the parent) with the columns that tell them apart: the learning rate each job swept
    and the losses. Saved as a shared view (an experiment tag MLflow's UI reads); returns the page's URL."""
    from mlflow import MlflowClient

    view = {
        "orderByKey": "tags.`mlflow.runName`",
        "orderByAsc": True,
        "selectedColumns": ["params.`train.optim.lr`", "metrics.`loss`", "metrics.`val_loss`"],
        "viewMaximized": True,
    }
    MlflowClient(uri).set_experiment_tag(experiment, f"{SHARED_VIEW}{VIEW_KEY}", json.dumps(view))
    return f"{uri}/#/experiments/{experiment}/runs?viewStateShareKey={VIEW_KEY}"


def screenshot(url: str, out: Path, profile: Path, size: str) -> None:
    chromium = shutil.which("chromium") or shutil.which("chromium-browser") or shutil.which("google-chrome")
    if chromium is None:
        raise SystemExit("no Chromium found: apt-get install chromium")
    out.parent.mkdir(parents=True, exist_ok=True)
    command = [
        chromium, *CHROMIUM_FLAGS, f"--user-data-dir={profile}", f"--window-size={size}",
        "--virtual-time-budget=20000", f"--screenshot={out.resolve()}", url,
    ]  # fmt: skip
    subprocess.run(command, check=True, capture_output=True, timeout=300)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=REPO / "results" / "trackers" / "mlflow-sweep.png")
    parser.add_argument("--size", default="1400,900", help="browser window, width,height")
    parser.add_argument("--keep", action="store_true", help="leave the server running (its URL is printed)")
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="mlflow-screenshot-"))
    port = free_port()
    uri = f"http://127.0.0.1:{port}"
    server = start_server(work, port)
    try:
        sweep = run_sweep(work / "outputs", uri)
        experiment = json.loads((sweep / "trackers.json").read_text())["mlflow"]["experiment_id"]
        url = sweep_view(uri, experiment)
        screenshot(url, args.out, work / "chromium-profile", args.size)
        print(f"{args.out}: {url}")
    finally:
        if args.keep:
            print(f"server left running at {uri} (pid {server.pid}); its files: {work}")
        else:
            server.terminate()
            server.wait(timeout=30)
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
