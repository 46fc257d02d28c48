"""The pretraining loop: micro-batches accumulate into updates until the budget is spent.

    train()
      set_up()              model, train step, checkpointer, clock, micro-batches; built once, complete
      while no stop reason:
        run_update()        the train step's update: its micro-batches (the clock's stop rule after each)
        log                 every train.log_every updates (metrics)
        evaluations         the hooks the entry point handed in (pretrain.py: anytime GLUE/BLiMP), when due
        save                every train.checkpoint_every_min of budget (the checkpointer)
      finish()              resumable state, validation loss, final model, the evaluations due at the end

Each concern has one owner that the loop asks once: the train step (cramming.optim.step) owns the update and
its counter, the checkpointer (state) the saved state and the final model, metrics the log, the budget clock
(cramming.budget) the time spent and the stop rule, Parallel (parallel) the ranks' share of the model. Masks
are keyed by stream row (mlm): neither the micro-batch size nor a resume changes what is computed.

The host measures elapsed time while the GPU may still be working through queued micro-batches; the one
synchronization per update (the non-finite check of loss and gradient norm) bounds that lag to a single
update.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Protocol

import torch
import torch._dynamo  # noqa: F401  imported before the budget clock starts: the first optimizer does it (5-10 s)
from torch import nn

from cramming.budget import BudgetClock, budget_clock
from cramming.calibration import run_costs
from cramming.data import PretrainingData
from cramming.errors import ConfigError
from cramming.impl import dtype_name
from cramming.model import build_model
from cramming.optim import LAYERWISE, build_optimizer, format_state_report, optimizer_state_report
from cramming.optim.average import WeightAverage
from cramming.optim.schedules import LR_SCHEDULES, accumulation_steps
from cramming.optim.step import TrainStep
from cramming.ranks import init_from_env
from cramming.signals import STOP_SIGNALS, StopSignals, catch_stop_signals
from cramming.train import autobatch
from cramming.train.batches import Progress, microbatches, numbered
from cramming.train.config import PretrainRecipe
from cramming.train.metrics import Metrics, log_set_up
from cramming.train.mlm import MLMMasker, MLMObjective
from cramming.train.parallel import Parallel
from cramming.train.state import Checkpointer
from cramming.train.validation import VALIDATION_SEED, validation_metrics
from cramming.utils import peak_memory_bytes, seed_everything

log = logging.getLogger("cramming")


class EvalHook(Protocol):
    """An evaluation the loop runs between updates (pretrain.py passes anytime evaluation this way)."""

    def start(self, fraction_done: float) -> None: ...

    def due(self, fraction: float) -> bool: ...

    def __call__(self, model: nn.Module, clock: BudgetClock, update: int, tokens: int) -> dict: ...


@dataclass(frozen=True)
class Run:
    """Everything the loop works with, built once by set_up."""

    cfg: PretrainRecipe
    data: PretrainingData
    model: nn.Module  # plain module: saved state dicts use its key names
    step_model: nn.Module  # what runs forward: the model, its DDP/FSDP2 form or its torch.compile wrapper
    step: TrainStep
    objective: MLMObjective
    held_out: MLMMasker  # the validation's masks (VALIDATION_SEED)
    clock: BudgetClock
    checkpointer: Checkpointer
    metrics: Metrics
    hooks: tuple[EvalHook, ...]
    batches: Iterator[tuple[torch.Tensor, torch.Tensor]]  # (stream rows, input_ids) of this rank
    progress: Progress  # the data position, advanced by the loop
    signals: StopSignals
    microbatch_size: int  # impl.microbatch_size, or the one the search chose (the config is never written)
    world_size: int


@dataclass
class TrainResult:
    run_dir: Path
    stop_reason: str  # budget | steps | SIGINT | SIGTERM | SIGUSR2
    updates: int  # finished updates, applied or skipped, in all parts of the run
    skipped: int  # of them, skipped for a non-finite loss or gradient
    progress: Progress
    elapsed: float  # seconds of budget spent in all parts of the run
    elapsed_before: float  # of `elapsed`, the part spent before a resume (by the runs resumed from)
    checkpoint: Path | None = None  # the final model; None when interrupted
    validation: dict | None = None
    clock: dict = field(
        default_factory=dict
    )  # which clock counted the budget (its calibration, if reference)
    wall_seconds: float = 0.0  # what this process took, set-up to the end


# ---------------------------------------------------------------------------------------------------- set-up


def set_up(
    cfg: PretrainRecipe,
    data: PretrainingData,
    run_dir: Path,
    clock: Callable[[], float],
    hooks: Sequence[EvalHook],
    on_record: Callable[[dict], None] | None,
    signals: StopSignals,
) -> Run:
    ranks, train = init_from_env(cfg.impl.torch_device(), cfg.impl.distributed), cfg.train  # torchrun's, or 1
    run_dir.mkdir(parents=True, exist_ok=True)
    loading, reference = clock(), run_costs(cfg, data.vocab_size, data.seq_length, ranks.world_size)
    # before anything is built: a state for other data, another model or another clock is refused by name
    checkpointer = Checkpointer.find(
        run_dir, ranks, data, cfg.arch, every_seconds=60 * train.checkpoint_every_min, resume=cfg.resume,
        base_dir=Path(cfg.base_dir), name=cfg.name, steps=train.steps, budget_hours=cfg.budget,
        clock={"clock": train.clock, "costs": asdict(reference[0]) if reference else None},
    )  # fmt: skip
    # the wall clock charges reading the state to this run's set-up; the downtime before it is free
    before = checkpointer.elapsed_before + (clock() - loading if reference is None else 0.0)
    budget = budget_clock(cfg.budget, clock, before, ranks, reference, fresh=checkpointer.saved is None)
    dtype, why = cfg.impl.precision_choice(ranks.device)
    log.info("precision %s (%s); %s", dtype_name(dtype), why, budget.about())
    seed_everything(cfg.seed)
    cfg.impl.apply_to_process(ranks.device)  # threads on any device, as evaluation does; CPU allocator
    if ranks.device.type == "cuda":
        torch.set_float32_matmul_precision("high")  # TF32 for any fp32 matmul left: rounding only
    kernels = cfg.impl.kernel_choices()
    model = build_model(cfg.arch, data.vocab_size, device=ranks.device, dropout=train.dropout, **kernels)
    masker, held_out = (MLMMasker.for_data(train.mlm, data, seed) for seed in (cfg.seed, VALIDATION_SEED))
    objective = MLMObjective(masker, ranks.device, masker.predicted_per_row(data.seq_length))
    microbatch_size = autobatch.microbatch_size_for(
        cfg.impl.microbatch_size, model, objective, dtype, data.seq_length, base_dir=Path(cfg.base_dir),
        batch_size=train.batch_size, budget_hours=cfg.budget, world_size=ranks.world_size,
    )  # fmt: skip
    parallel = Parallel(ranks)
    model = parallel.shard(model, dtype)  # FSDP2: before the optimizer is built (it replaces parameters)
    step_model = parallel.wrap(model, layerwise=train.optim.name in LAYERWISE)
    start_evaluations(hooks, budget.fraction(), ranks.active)
    step = make_train_step(model, cfg, parallel, dtype)
    progress = checkpointer.resume(model, step, now=budget.elapsed())
    log_set_up(model, cfg.arch, data, ranks.device, dtype, microbatch_size, train)
    if cfg.impl.compile_on(ranks.device):
        step_model = torch.compile(step_model)  # compiles on the first micro-batches: on the budget
    metrics = Metrics(run_dir / "metrics.jsonl" if ranks.is_main else None, data.seq_length, on_record)
    loader = microbatches(
        data.train, microbatch_size, cfg.seed, progress.rows, cfg.impl.num_workers,
        pin_memory=ranks.device.type == "cuda", rank=ranks.rank, world_size=ranks.world_size,
    )  # fmt: skip
    batches = numbered(loader, progress.rows, microbatch_size, ranks.rank, ranks.world_size)  # keyed masks
    return Run(
        cfg, data, model, step_model, step, objective, held_out, budget, checkpointer, metrics, tuple(hooks),
        batches, progress, signals, microbatch_size, ranks.world_size,
    )  # fmt: skip


def make_train_step(
    model: nn.Module, cfg: PretrainRecipe, parallel: Parallel, dtype: torch.dtype
) -> TrainStep:
    """The optimizer of train.optim inside the one training step (a loss scaler for fp16 only), with the ranks'
    gradient sync and reductions handed in."""
    # layerwise optimizers clip each gradient in their hooks, and under DDP average it over reduce_group
    optimizer = build_optimizer(
        model, cfg.train.optim, max_grad_norm=cfg.train.grad_clip, reduce_group=parallel.reduce_group
    )
    report = optimizer_state_report(optimizer)
    log.info("optimizer %s: %s", cfg.train.optim.name, format_state_report(report, parallel.ranks.world_size))
    average = None
    if cfg.train.average.kind == "ema":
        if parallel.fsdp2:  # each rank would save its own shard of the average only
            raise ConfigError(
                "train.average=ema with impl.distributed=fsdp2 is not supported: use ddp, or none"
            )
        average = WeightAverage(model, cfg.train.average.decay)
    return TrainStep(
        model, optimizer, device_type=parallel.ranks.device.type, dtype=dtype, grad_clip=cfg.train.grad_clip,
        grad_sync=parallel.grad_sync, reduce=parallel.reduce_update_stats,
        max_skipped_in_a_row=cfg.train.max_nonfinite_updates, average=average,
    )  # fmt: skip


def start_evaluations(hooks: Sequence[EvalHook], fraction_done: float, several_ranks: bool) -> None:
    """Tell the evaluation hooks how much of the budget a resumed run has spent (they do not repeat what it
    passed)."""
    if hooks and several_ranks:
        raise ConfigError(
            "evaluation during pretraining (anytime) runs in a single process only; run without torchrun"
        )
    for hook in hooks:
        hook.start(fraction_done)


# --------------------------------------------------------------------------------------------------- the loop


def train(
    cfg: PretrainRecipe,
    data: PretrainingData,
    run_dir: str | Path,
    clock: Callable[[], float] = time.monotonic,
    hooks: Sequence[EvalHook] = (),
    on_record: Callable[[dict], None] | None = None,
) -> TrainResult:
    """Pretrain until the budget (or train.steps, or a stop signal) ends the run; see the module docstring.
    hooks: evaluations run between updates when due (each returns a metrics record). on_record: called with
    every metrics record after it is written (on rank 0, at log steps only)."""
    steps = cfg.train.steps if cfg.train.steps is not None else math.inf
    with catch_stop_signals() as signals:
        run = set_up(cfg, data, Path(run_dir), clock, hooks, on_record, signals)
        run.metrics.restart_window()  # throughput from here, set-up excluded
        # a requeued job that had finished goes straight to finish
        reason = run.clock.stop_reason(signals.received) or (
            "steps" if run.step.stats.updates >= steps else None
        )
        # this process's first update is logged, a resumed run's too: that record alone covers the set-up and
        # one update, as the run card's split of the time (set-up, compile, train) reads it
        first = run.step.stats.updates + 1
        while reason is None:
            reason = run_update(run)
            updates = run.step.stats.updates
            if updates == first or updates % cfg.train.log_every == 0:
                run.metrics.log_progress(run.step, run.progress, run.clock)
            if reason is None:
                run_due_evaluations(run)
            reason = reason or ("steps" if updates >= steps else None)
            if reason is None:
                run.checkpointer.maybe_save(run.clock.elapsed(), run.model, run.step, run.progress)
    return finish(run, reason)


def run_update(run: Run) -> str | None:
    """Accumulate the micro-batches of one update and apply it. Returns a stop reason that came up on the way;
    an update cut short by it is discarded: its gradients are zeroed, its rows are trained on again after a
    resume and the random streams are rewound to where the update began, so the state saved next is that of
    the last completed update and a resumed run draws the same dropout masks as an uninterrupted one."""
    train, fraction = run.cfg.train, run.clock.fraction()
    rows = run.microbatch_size * run.world_size  # of one micro-batch, over all ranks
    count = accumulation_steps(
        fraction, train.batch_size, rows, train.batch_size_ramp, train.batch_size_start
    )
    schedule = LR_SCHEDULES[train.lr_schedule]
    lr_factor = schedule.factor_for_update(
        train.warmup, budget_fraction=fraction, updates=run.step.stats.updates, steps=train.steps
    )
    run.step_model.train()
    run.step.begin(lr_factor, count)
    reason = None
    while not run.step.complete and reason is None:
        run.step.microbatch(run.objective, run.step_model, next(run.batches))
        run.progress.microbatches += 1
        reason = run.clock.after_microbatch(run.signals.received, run.step.complete)  # charged, reference
    if not run.step.complete:
        run.step.discard()
        return reason
    run.progress.rows += count * rows  # consumed, whether applied or skipped as non-finite
    update = run.step.apply()
    if update.applied:
        run.metrics.add(update, count * rows)
    return reason


def run_due_evaluations(run: Run) -> None:
    """Each evaluation hook that is due, on the current weights; the throughput figures leave its time out
    (the window is logged and closed before it)."""
    for hook in [hook for hook in run.hooks if hook.due(run.clock.fraction())]:
        run.metrics.log_progress(run.step, run.progress, run.clock)
        tokens = run.progress.rows * run.data.seq_length  # the training tokens seen so far
        run.metrics.write(hook(run.model, run.clock, run.step.stats.updates, tokens))
        run.metrics.restart_window()


# ----------------------------------------------------------------------------------------------------- the end


def finish(run: Run, reason: str) -> TrainResult:
    """Save what the run leaves behind; the final model only when training ended by its own rule."""
    run.metrics.log_progress(run.step, run.progress, run.clock)
    updates, elapsed = run.step.stats.updates, run.clock.elapsed()
    log.info("stopping (%s) after %d updates, %s", reason, updates, run.clock.describe())
    if updates == 0 and reason not in STOP_SIGNALS:
        raise ConfigError(
            f"budget={run.cfg.budget:g} h ({run.clock.budget_seconds:.3g} s) ran out before the first update"
            f" ({elapsed:.1f} s went to set-up): nothing was trained, so no model is saved. Give a"
            " budget that leaves time to train, e.g. budget=0.05 (3 minutes)"
        )
    run.checkpointer.save(elapsed, run.model, run.step, run.progress)
    result = TrainResult(
        run.checkpointer.run_dir, reason, updates, run.step.stats.skipped, run.progress, elapsed,
        run.checkpointer.elapsed_before, clock=run.clock.record(), wall_seconds=run.clock.wall_elapsed(),
    )  # fmt: skip
    if reason in STOP_SIGNALS:
        return result
    # the optimizer state measured from its tensors (as their sizes report it under FSDP2), and the peak memory
    report = optimizer_state_report(run.step.optimizer)
    run.metrics.write({
        "update": updates,
        "optimizer_state_bytes": report["state_bytes"],
        "optimizer_state_ratio_to_adamw": report["ratio_to_adamw_fp32"],
        "peak_memory_bytes": peak_memory_bytes(run.objective.device),
    })  # fmt: skip
    run.step.use_average()  # the final model (the resumable state above kept the weights themselves)
    train = run.cfg.train  # on every rank: FSDP2's forward is collective
    result.validation = validation_metrics(
        run.model, run.data.validation, run.held_out, limit=train.validation_rows,
        microbatch_size=run.microbatch_size, autocast=run.step.autocast,
        predicted_per_row=run.objective.predicted_per_row, context_diagnostic=train.context_diagnostic,
    )  # fmt: skip
    info = {"updates": updates, "elapsed_h": elapsed / 3600, "stop_reason": reason}
    if result.validation:
        info["validation"] = result.validation
        log.info(
            "validation: loss %.4f, mlm acc %.3f", result.validation["loss"], result.validation["mlm_acc"]
        )
        run.metrics.write({"update": updates, **{f"val_{k}": v for k, v in result.validation.items()}})
    result.checkpoint = run.checkpointer.save_final(run.model, info)
    run_due_evaluations(run)  # the evaluations due at the end of the budget, of the final model
    result.wall_seconds = run.clock.wall_elapsed()
    return result
