"""Pretraining: the MLM objective and the budgeted loop. Imports data/, model/, optim/, the budget clock and
the run folders; never eval/ (evaluation during pretraining is handed in as a hook by pretrain.py).

config.py         the `train` group (TrainConfig, MLMConfig)
mlm.py            masking (which tokens to predict and how they are corrupted, keyed by stream row) and the
                  MLM objective of one micro-batch, which the loop and the micro-batch search train through
batches.py        the endless, resumable stream of micro-batches and the data position (Progress)
autobatch.py      the micro-batch: impl.microbatch_size checked, or with `auto` searched once and cached
loop.py           train(): set-up, updates, logs, evaluations, periodic state, finish
metrics.py        the log lines and metrics.jsonl
validation.py     the final model's held-out MLM loss, and the context diagnostic
state.py          the checkpointer: the resumable state (versioned) found, restored and saved, gathered from
                  and loaded into the ranks' layout; the final model
parallel.py       DDP / FSDP2: sharding or wrapping the model, gradient sync and reduced update statistics

The train step (one update: cramming.optim.step), the learning-rate schedules and the batch-size ramp
(cramming.optim.schedules) are shared with fine-tuning; the budget clock is cramming.budget, the process group
cramming.ranks, run folders cramming.runs, stop signals cramming.signals.
"""
