"""Pretraining: the MLM objective and the wall-clock-budget loop. Imports data/, model/, optim/ and the
budget clock; never eval/ (evaluation during pretraining is handed in as a hook by pretrain.py).

config.py         the `train` group (TrainConfig, MLMConfig)
mlm.py            masking: which tokens to predict and how they are corrupted, keyed by stream row
batches.py        the endless, resumable stream of micro-batches, and the batch-size ramp
autobatch.py      impl.microbatch_size=auto: the fastest micro-batch that fits, searched once and cached
loop.py           train(): set-up, updates, periodic state, finish
metrics.py        the log lines, metrics.jsonl and the evaluation hooks
validation.py     the final model's held-out MLM loss (and the context diagnostic, context.py)
state.py          the resumable state: what it holds (versioned), saving, finding and restoring it
checkpoint.py     the state's files on disk (the final model: cramming.model.checkpoint)
ranks.py          torchrun: the process group, where this process stands
parallel.py       DDP / FSDP2, gradient sync, reduced statistics, the ranks' agreed clock (Parallel)
sharded_state.py  model and optimizer state gathered from, and loaded into, the ranks' layout
summary.py        the lines a finished run ends with

The training step and the learning-rate schedules, shared with fine-tuning, are cramming.optim's (step.py,
schedules.py); stop signals are cramming.signals.
"""
