"""Run folders: each run claims its own, a resumed run finds the earlier one it takes up (its own folder, the
newest of its name, job N of the newest multirun), and refuses one that ran with other settings."""

from __future__ import annotations

from pathlib import Path

import pytest

from cramming import runs
from cramming.errors import ConfigError


def test_runs_started_in_the_same_second_get_folders_of_their_own(tmp_path, monkeypatch):
    stamp = "2026-01-01_00-00-00"
    first = runs.claim_run_dir(str(tmp_path), "conc", stamp)
    assert runs.claim_run_dir(str(tmp_path), "conc", stamp) == first  # Hydra resolving it again: the same
    claimed = [first]
    for _ in range(10):  # each a new process: nothing remembered of the claims before
        monkeypatch.setattr(runs, "_CLAIMED", {})
        claimed.append(runs.claim_run_dir(str(tmp_path), "conc", stamp))
    assert len(set(claimed)) == 11 and Path(claimed[-1]).name == f"{stamp}_11"
    for folder in claimed:  # the newest is the last claimed, _11 after _2
        (Path(folder) / "state.pt").touch()
    assert runs.newest_run_dir(tmp_path, "conc", "state.pt") == Path(claimed[-1])


def test_concurrent_processes_claim_different_folders(tmp_path):
    import subprocess
    import sys

    claim = (
        "import sys, time; from cramming.runs import claim_run_dir; time.sleep(max(0, float(sys.argv[1]) -"
        " time.time())); print(claim_run_dir(sys.argv[2], 'conc', '2026-01-01_00-00-00'))"
    )
    start = f"{__import__('time').time() + 4:.3f}"  # all claim at the same moment, after their imports
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", claim, start, str(tmp_path)], stdout=subprocess.PIPE, text=True
        )
        for _ in range(3)
    ]
    folders = [p.communicate(timeout=120)[0].strip() for p in procs]
    assert all(p.returncode == 0 for p in procs)
    assert len(set(folders)) == 3, folders


def make_run(base: Path, name: str, stamp: str, marker: str) -> Path:
    folder = base / name / stamp
    (folder / marker).parent.mkdir(parents=True, exist_ok=True)
    (folder / marker).write_text("{}")
    return folder


def test_a_run_takes_up_its_own_folder_first_then_with_resume_the_newest_of_its_name(tmp_path):
    older = make_run(tmp_path, "x", "2026-01-01_00-00-00", "done.json")
    newer = make_run(tmp_path, "x", "2026-01-02_00-00-00", "done.json")
    fresh = tmp_path / "x" / "2026-01-03_00-00-00"
    fresh.mkdir()
    look = {"base_dir": tmp_path, "name": "x", "what": "evaluation"}
    assert runs.earlier_run(fresh, ("done.json",), resume=False, **look) is None  # a fresh start
    assert runs.earlier_run(fresh, ("done.json",), resume=True, **look) == newer
    assert runs.earlier_run(older, ("done.json",), resume=False, **look) == older  # a requeued job: its own
    # several markers: the first found in any run wins over a later marker in a newer run
    make_run(tmp_path, "x", "2026-01-04_00-00-00", "backup.json")
    assert runs.earlier_run(fresh, ("done.json", "backup.json"), resume=True, **look) == newer


def test_job_n_of_a_multirun_takes_up_job_n_of_the_newest_multirun(tmp_path):
    make_run(tmp_path, "sweep", "multirun_2026-01-01_00-00-00", "1/done.json")
    newest = make_run(tmp_path, "sweep", "multirun_2026-01-02_00-00-00", "1/done.json")
    make_run(tmp_path, "sweep", "multirun_2026-01-03_00-00-00", "0/done.json")  # has no job 1
    run_dir = tmp_path / "sweep" / "multirun_2026-01-04_00-00-00" / "1"
    found = runs.earlier_run(
        run_dir, ("done.json",), resume=True, base_dir=tmp_path, name="sweep", what="evaluation", sweep_job=1
    )
    assert found == newest / "1"


def test_resume_without_an_earlier_run_names_where_it_looked(tmp_path):
    with pytest.raises(
        ConfigError, match=r"no earlier BLiMP evaluation named 'y'.*done\.json.*drop resume=true"
    ):
        runs.earlier_run(
            tmp_path / "new",
            ("done.json",),
            resume=True,
            base_dir=tmp_path,
            name="y",
            what="BLiMP evaluation",
        )


def test_other_settings_are_refused_naming_each_difference():
    theirs = {"eval.lr": 1e-4, "eval.epochs": 3, "checkpoint": "a"}
    ours = {"eval.lr": 2e-4, "eval.epochs": 3, "checkpoint": "a", "eval.new_key": None}
    assert runs.settings_differ(theirs, ours) == ["eval.lr: 0.0001 there, 0.0002 here"]  # None = absent
    runs.refuse_other_settings(theirs, dict(theirs), what="w", fix="f")  # the same: nothing raised
    with pytest.raises(
        ConfigError, match=r"resume=true: it differs \(eval.lr: 0.0001 there, 0.0002 here\)\. Fix"
    ):
        runs.refuse_other_settings(theirs, ours, what="it differs", fix="Fix it")
    many = {f"k{i}": i for i in range(9)}
    with pytest.raises(ConfigError, match="and 7 more"):
        runs.refuse_other_settings(many, {}, what="w", fix="f", shown=2)


def test_newest_run_with_is_none_without_a_run(tmp_path):
    assert runs.newest_run_with(tmp_path, "nothing", ("a",)) is None
