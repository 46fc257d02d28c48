"""Run many command lines of `pretrain.py`, `eval.py` and `scripts/export_hf.py` in one Python process, each as a
shell would run it, and write what each ended with. tests/test_bad_inputs.py runs dozens of commands: one process
start (torch, datasets, transformers: seconds each) instead of one per command.

    python tests/command_runner.py <commands.json> <results.json>

commands.json: [{"id": ..., "argv": [<script path>, <argument>, ...]}, ...]. Each command gets what a process
of its own would: the script run as __main__ with that argv, a fresh Hydra, no run folder claimed before it, and
its output captured at the file-descriptor level (log handlers that hold the original stdout or stderr are
captured too). Its exit status is SystemExit's; an exception that escapes is printed as Python prints it (a
traceback) with status 1. results.json: {id: {"code": int, "output": str, "seconds": float}}.
"""

from __future__ import annotations

import json
import os
import runpy
import sys
import tempfile
import time
import traceback
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def run_command(argv: list[str]) -> tuple[int, str]:
    """(exit status, stdout and stderr together) of one command."""
    from hydra.core.global_hydra import GlobalHydra

    import cramming.runs

    GlobalHydra.instance().clear()
    cramming.runs._CLAIMED.clear()  # a process of its own claims its run folder afresh
    sys.argv = list(argv)
    with tempfile.TemporaryFile() as captured:
        sys.stdout.flush()
        sys.stderr.flush()
        saved = os.dup(1), os.dup(2)
        os.dup2(captured.fileno(), 1)
        os.dup2(captured.fileno(), 2)
        try:
            code = _run(argv[0])
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os.dup2(saved[0], 1)
            os.dup2(saved[1], 2)
            os.close(saved[0])
            os.close(saved[1])
        captured.seek(0)
        return code, captured.read().decode("utf-8", errors="replace")


def _run(script: str) -> int:
    try:
        runpy.run_path(script, run_name="__main__")
    except SystemExit as ended:
        if ended.code is None or isinstance(ended.code, int):
            return ended.code or 0
        print(ended.code, file=sys.stderr)  # as the interpreter does with a message
        return 1
    except BaseException:  # what a process would end with: the traceback, status 1
        traceback.print_exc()
        return 1
    return 0


def main() -> None:
    commands_path, results_path = map(Path, sys.argv[1:3])  # read now: each command sets sys.argv
    commands = json.loads(commands_path.read_text())
    os.chdir(REPO)
    sys.path.insert(0, str(REPO))
    results = {}
    for command in commands:
        start = time.perf_counter()
        code, output = run_command(command["argv"])
        results[command["id"]] = {"code": code, "output": output, "seconds": time.perf_counter() - start}
    results_path.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
