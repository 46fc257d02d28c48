"""Tables and plots of a folder of runs (a multirun, or any tree of run folders): see cramming/study/runs_report.py.

python scripts/report.py outputs/<name>/multirun_<timestamp> [--out results/<study>]
"""

from cramming.study.runs_report import main

if __name__ == "__main__":
    main()
