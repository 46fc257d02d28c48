"""`python -m cramming.study run|report <study> [key=value ...]`: see cramming/study/__init__.py and docs/studies.md.

<study> is a name in conf/study/ or a YAML file; key=value pairs override the study file's keys (e.g.
`blimp_dir=data/blimp parallel=2 'seeds=[0,1]'`). Exit status: 0 done, 1 a run failed (its log says why), 2 a
mistake in the study or its data (one line names it and the fix), 128 + the signal when stopped (the same
command continues).
"""

from __future__ import annotations

import argparse
import logging
import sys

from cramming.errors import ConfigError, DataSourceError
from cramming.job.exits import SIGNAL_BASE, USER_ERROR
from cramming.study.config import STAGES, load_study
from cramming.study.launch import StudyStopped
from cramming.study.report import build_report
from cramming.study.runner import StageFailed, run_study

log = logging.getLogger("cramming")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m cramming.study", description=__doc__.split("\n\n")[0])
    parser.add_argument("action", choices=("run", "report"))
    parser.add_argument("study", help="a study of conf/study/ (its name) or a study file")
    parser.add_argument("overrides", nargs="*", metavar="key=value", help="settings of the study file")
    parser.add_argument("--stages", nargs="+", choices=STAGES, help="run: only these of the study's stages")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="[%(asctime)s][study] %(message)s", datefmt="%H:%M:%S")
    try:
        name, study = load_study(args.study, args.overrides)
        if args.action == "run":
            run_study(name, study, args.stages)
        else:
            print(build_report(name, study))
    except (ConfigError, DataSourceError, FileNotFoundError) as err:
        log.error("%s", err)
        return USER_ERROR
    except StageFailed as err:
        log.error("%s; the study stops here, and the same command continues it", err)
        return 1
    except StudyStopped as stop:
        log.warning("stopped by %s: the runs kept what they had; the same command continues the study", stop)
        return SIGNAL_BASE + stop.signum
    return 0


if __name__ == "__main__":
    sys.exit(main())
