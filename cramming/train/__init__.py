"""Pretraining: the MLM objective and the wall-clock-budget loop.

config.py       the `train` group (TrainConfig, MLMConfig)
mlm.py          masking: which tokens to predict and how they are corrupted
schedules.py    learning-rate schedules over the budget fraction, batch-size ramp
budget.py       the budget clock and the stop rule
batches.py      the endless, resumable stream of training micro-batches
autobatch.py    impl.microbatch_size=auto: the fastest micro-batch that fits, searched once and cached
loop.py         train(): set-up, updates, logging, periodic state, finish
checkpoint.py   final model and resumable state on disk; load_pretrained for eval
signals.py      SIGINT/SIGTERM -> save and stop
distributed.py  torchrun: process group, DDP / FSDP2, sharded data, the ranks' shared stop decision
"""
