"""Pretraining: the MLM objective and the wall-clock-budget loop. Imports data/, model/, optim/ and the
budget clock; never eval/ (evaluation during pretraining is handed in as a hook by pretrain.py).

config.py       the `train` group (TrainConfig, MLMConfig)
mlm.py          masking: which tokens to predict and how they are corrupted, keyed by stream row
schedules.py    the one registry of learning-rate schedules (budget-* and steps-*), batch-size ramp
step.py         TrainStep: one optimizer update (autocast, backward, clip, non-finite check, step), used by
                pretraining, GLUE fine-tuning, the micro-batch search and the benchmarks
batches.py      the endless, resumable stream of training micro-batches, with their stream positions
autobatch.py    impl.microbatch_size=auto: the fastest micro-batch that fits, searched once and cached
loop.py         train(): set-up, updates, logging, evaluation hooks, periodic state, finish
checkpoint.py   the resumable state on disk (the final model: cramming.model.checkpoint)
signals.py      SIGINT/SIGTERM -> save and stop
distributed.py  torchrun: process group, DDP / FSDP2, sharded data, the ranks' shared stop decision
"""
