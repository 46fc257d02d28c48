"""scripts/checks/chaos.py, short: a tiny CPU pretraining stopped once by SIGTERM and once by SIGKILL at random
points, resumed each time, ends with the weights of an uninterrupted run (exactly: same code path, same
inputs, deterministic single-threaded CPU), leaves no temporary file and only states that load."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow
REPO = Path(__file__).resolve().parent.parent


def test_interrupted_and_resumed_run_ends_identical(tmp_path):
    out = tmp_path / "reliability.md"
    done = subprocess.run(
        [sys.executable, "scripts/checks/chaos.py", "--interruptions", "2", "--steps", "30",
         "--workdir", str(tmp_path / "runs"), "--out", str(out)],
        cwd=REPO, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    table = out.read_text()
    rows = [line for line in table.splitlines() if line.startswith("| ") and line[2].isdigit()]
    assert {row.split(" | ")[1] for row in rows} >= {"SIGTERM", "SIGKILL", "final"}, table
    assert "| final | after update 30 | yes | 0 |" in table
    assert "Temporary files left behind: 0." in table and "States that do not load: 0." in table
