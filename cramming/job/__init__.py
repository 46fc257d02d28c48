"""A job's life, from start to exit, for pretrain.py, eval.py and the export command.

runcard.py   run_card.json: what ran, where, with which settings, and how it ended (sections are recorded
             by the code that owns them), and the one reader of cards
exits.py     the exit status of each kind of failure, and what a job stopped by a signal does
trackers.py  the run's experiment trackers: started by the entry point, fed every metrics record,
             finished with the run card (the trackers themselves: cramming.trackers)
cluster.py   sweeps as cluster jobs: time limits, and handing a stopped job back to its launcher
sweeps.py    the start and end of a multirun (Hydra callback): the sweep's summary and trackers
summary.py   the lines a finished pretraining run ends with: what it learned, where it is, what to run next

Tables and plots across many runs (scripts/report.py) live beside the study command: cramming.study.runs_report.
"""
