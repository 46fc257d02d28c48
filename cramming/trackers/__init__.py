"""Experiment trackers: TensorBoard, Weights & Biases and MLflow, for pretraining, evaluation and sweeps.

`trackers=[tensorboard,wandb,mlflow]` (a top-level key of pretrain.py and eval.py, empty by default) sends a
run to each tracker named; `tracking.*` says where (docs/tracking.md). metrics.jsonl and the run card stay the
source of truth: a tracker gets a copy, and a tracker that cannot start or fails mid-run is dropped with one
warning that names it and the fix, never failing the run.

config.py       the `tracking` settings (TrackingConfig)
registry.py     the one registry of trackers (name -> class) and the check of the `trackers` list
base.py         what every tracker is told (RunInfo) and does (Tracker: log, finish)
tensorboard_tracker.py, wandb_tracker.py, mlflow_tracker.py   the three trackers
sweep.py        a multirun as one group: the MLflow parent run its jobs nest under

The trackers of one run (start, log, finish; their run ids beside the run, for a resume) are a session of the
job: cramming.job.trackers.
"""
