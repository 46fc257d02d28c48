"""Studies: recipes compared at budgets over seeds, as a file and a command (docs/studies.md).

    python -m cramming.study run <study>       every stage of every run that is not done yet
    python -m cramming.study report <study>    what the kept figures say, conclusion first

config.py       the study file (conf/study/<name>.yaml): its keys, defaults and checks
plan.py         its runs (points) and the overrides of each stage of each
runner.py       `run`: skips what a run card or a kept file says is done, continues what a stop left, starts
                the rest as Hydra multiruns of pretrain.py and eval.py (launch.py: launchers, signals, load)
kept.py         the small JSON files that outlive the run folders: one per run, one per model shape's floor
floor.py        BLiMP of random weights of a model shape, and BLiMP by phenomenon beside it
figures.py      what a kept run measured (GLUE averages per fine-tuning seed, BLiMP, the pretraining card)
judge.py        cells of runs, means and spreads over seeds, differences and their verdicts
tables.py       one row per run, GLUE by task, BLiMP by phenomenon, what each recipe learns first
report.py       `report`: report.md; plot.py: the budget curve (curve.png)
runs_report.py  tables and plots of any folders of runs, a sweep's or several (scripts/report.py)

The study sits above the entry points it starts (pretrain.py, eval.py) and the job layer it reads (run cards).
"""
