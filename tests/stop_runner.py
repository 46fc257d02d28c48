"""Stop `pretrain.py`'s preprocessing with a signal at a chosen phase, the same way every time, in a process of
its own per case. tests/test_bad_inputs.py checks how each case ends.

    python tests/stop_runner.py <cases.json> <results.json>

cases.json: [{"id", "phase", "signal", "wrap", "argv": [<pretrain.py>, <argument>, ...], "tmpdir"}, ...]. The
phase is a key of PHASES. The runner imports pretrain.py's dependencies once (seconds), then forks one child per
case. The child patches the code that does the phase's work so that, when the phase starts, the process sends
itself the signal from inside that work: inside `datasets`' JSON reader, inside the function `datasets` maps
over the texts, inside the text iterator the tokenizer trainer pulls from, inside the packing loop, inside the
Arrow writer of save_to_disk. With `wrap`, the patched code also does what some libraries do to an error that
passes through them: it raises its own error from the stop (as `datasets` did before stops were
interruptions). Then the child runs pretrain.py as __main__, with TMPDIR set to the case's `tmpdir`.
results.json: {id: {"code": exit status, "output": stdout and stderr together, "seconds": float}}.
"""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from command_runner import REPO, _run

# preprocessing phase -> what it does (the steps of cramming/data/pipeline.py)
PHASES = {
    "read": "reading the sources",
    "normalize": "normalizing and filtering",
    "train-tokenizer": "training the tokenizer",
    "tokenize": "tokenizing",
    "pack": "packing rows",
    "save": "saving",
}
CASE_SECONDS = 180  # a child still running then is killed and reported with code None


class LibraryError(RuntimeError):
    """What a library that wraps whatever passes through it raises (`wrap`)."""


def stop_here(phase: str, signal_name: str, wrap: bool) -> Callable[[Callable], Callable]:
    """A decorator for the function that does the phase's work: its first call sends the signal first."""
    fired = []

    def patch(work: Callable) -> Callable:
        def patched(*args, **kwargs):
            try:
                if not fired:
                    fired.append(True)
                    print(f"stop_runner: sending {signal_name} while {PHASES[phase]}", flush=True)
                    os.kill(os.getpid(), signal.Signals[signal_name])
                return work(*args, **kwargs)
            except BaseException as err:
                if wrap:
                    raise LibraryError(f"{PHASES[phase]} failed") from err
                raise

        return patched

    return patch


def arm(phase: str, signal_name: str, wrap: bool) -> None:
    """Patch the phase's work to stop the process as it starts."""
    import datasets
    from datasets.arrow_writer import ArrowWriter
    from datasets.packaged_modules.json.json import Json

    from cramming.data import pipeline

    stop = stop_here(phase, signal_name, wrap)
    if phase == "read":  # the generator `datasets` reads JSON files with: the stop lands in its loop
        generate = Json._generate_tables

        def start(self, *args, **kwargs):
            return generate(self, *args, **kwargs)

        def tables(self, *args, **kwargs):
            yield from stop(start)(self, *args, **kwargs)

        Json._generate_tables = tables
    elif phase in ("normalize", "tokenize"):  # the function Dataset.map applies, by the step's description
        description = {"normalize": "normalize + length filter", "tokenize": "tokenize"}[phase]
        dataset_map = datasets.Dataset.map

        def map_stopping(self, function=None, *args, **kwargs):
            if kwargs.get("desc") == description:
                function = stop(function)
            return dataset_map(self, function, *args, **kwargs)

        datasets.Dataset.map = map_stopping
    elif phase == "train-tokenizer":  # the iterator of texts the trainer pulls from
        train = pipeline.train_tokenizer

        def train_stopping(texts, *args, **kwargs):
            first = stop(lambda: None)

            def pulled():
                first()
                yield from texts

            return train(pulled(), *args, **kwargs)

        pipeline.train_tokenizer = train_stopping
    elif phase == "pack":  # inside the packing loop, with its Arrow file open
        pipeline.join_with_separator = stop(pipeline.join_with_separator)
    elif phase == "save":  # the Arrow writer of save_to_disk
        save = datasets.DatasetDict.save_to_disk
        write = ArrowWriter.write_table
        stopping_write = stop(write)

        def save_stopping(self, *args, **kwargs):
            ArrowWriter.write_table = stopping_write
            try:
                return save(self, *args, **kwargs)
            finally:
                ArrowWriter.write_table = write

        datasets.DatasetDict.save_to_disk = save_stopping
    else:
        raise ValueError(f"no phase {phase!r}; the phases are {', '.join(PHASES)}")


def run_case(case: dict, output: Path) -> None:
    """In the forked child: never returns."""
    code = 1
    try:
        fd = os.open(output, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
        os.dup2(fd, 1)
        os.dup2(fd, 2)
        os.environ["TMPDIR"] = case["tmpdir"]
        tempfile.tempdir = None  # read from TMPDIR again
        arm(case["phase"], case["signal"], case["wrap"])
        sys.argv = list(case["argv"])
        code = _run(case["argv"][0])
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def wait(pid: int) -> int | None:
    deadline = time.monotonic() + CASE_SECONDS
    while time.monotonic() < deadline:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return os.waitstatus_to_exitcode(status)
        time.sleep(0.05)
    os.kill(pid, signal.SIGKILL)
    os.waitpid(pid, 0)
    return None


def main() -> None:
    cases_path, results_path = map(Path, sys.argv[1:3])
    cases = json.loads(cases_path.read_text())
    os.chdir(REPO)
    sys.path.insert(0, str(REPO))
    # import what pretrain.py imports, once: each child then starts at once
    spec = importlib.util.spec_from_file_location("pretrain_imports", REPO / "pretrain.py")
    spec.loader.exec_module(importlib.util.module_from_spec(spec))
    results = {}
    for case in cases:
        output = cases_path.parent / f"{case['id']}.log"
        start = time.perf_counter()
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            run_case(case, output)
        code = wait(pid)
        results[case["id"]] = {
            "code": code,
            "output": output.read_text(errors="replace"),
            "seconds": time.perf_counter() - start,
        }
    results_path.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
