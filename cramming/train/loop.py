"""The pretraining loop: micro-batches accumulate into updates until the wall-clock budget is spent.

    train()
      set_up()            model, train step, loader, clock; a resumable state restored when resuming
      while no stop reason:
        run_update()      accumulate micro-batches (the clock's stop rule after each), then apply_update()
        log / save state  every train.log_every updates / train.checkpoint_every_min minutes
        due evaluations   the hooks the entry point handed in (pretrain.py: anytime GLUE), run by metrics
      finish()            resumable state, final checkpoint, validation loss

Its collaborators: the train step (cramming.optim.step), the budget clock and its stop rule
(cramming.budget), the ranks (parallel.Parallel), the resumable state (state), what is logged and evaluated
(metrics). Masks are keyed by stream row (mlm): neither the micro-batch size nor a
resume changes what is computed.

The host measures elapsed time while the GPU may still be working through queued micro-batches; the one
synchronization per update (the non-finite check of loss and gradient norm) bounds that lag to a single
update.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch._dynamo  # noqa: F401  imported before the budget clock starts: the first optimizer does it (5-10 s)
from torch import nn

from cramming.budget import BudgetClock, budget_clock
from cramming.data import PretrainingData
from cramming.errors import ConfigError, TrainingDiverged
from cramming.model import build_model
from cramming.model import checkpoint as model_checkpoint
from cramming.optim import build_optimizer, format_state_report, optimizer_state_report
from cramming.optim.schedules import LR_SCHEDULES
from cramming.optim.step import TrainStep
from cramming.signals import STOP_SIGNALS, StopSignals, catch_stop_signals
from cramming.train import autobatch, sharded_state, state
from cramming.train.batches import accumulation_steps, microbatches, numbered
from cramming.train.config import PretrainRecipe
from cramming.train.metrics import EvalHook, Metrics, log_model_size, log_set_up
from cramming.train.mlm import MLMMasker, mlm_accuracy_counts
from cramming.train.parallel import Parallel
from cramming.train.ranks import init_from_env
from cramming.train.state import Progress
from cramming.train.validation import validation_metrics
from cramming.utils import peak_memory_bytes, seed_everything

log = logging.getLogger("cramming")


@dataclass
class Run:
    """Everything the loop works with."""

    cfg: PretrainRecipe
    data: PretrainingData
    run_dir: Path
    parallel: Parallel
    model: nn.Module  # plain module: saved state dicts use its key names
    step_model: nn.Module  # what runs forward: the model, its DDP/FSDP2 form or its torch.compile wrapper
    step: TrainStep
    masker: MLMMasker
    clock: BudgetClock
    microbatch_size: int  # impl.microbatch_size, or the one the search chose (the config is never written)
    predicted_per_row: int | None  # the decoder's static positions per row (count masking), else None
    metrics: Metrics
    progress: Progress
    batches: Iterator[tuple[torch.Tensor, torch.Tensor]] | None = None  # (stream rows, input_ids)
    signals: StopSignals | None = None
    last_save: float = 0.0  # budget seconds at the last resumable state
    elapsed_before: float = 0.0  # budget seconds the resumed state had spent (0 for a fresh run)

    @property
    def device(self) -> torch.device:
        return self.parallel.ranks.device

    @property
    def optimizer(self) -> torch.optim.Optimizer:
        return self.step.optimizer


@dataclass
class TrainResult:
    run_dir: Path
    stop_reason: str  # budget | steps | SIGINT | SIGTERM | SIGUSR2
    progress: Progress
    elapsed: float  # seconds of budget spent in all parts of the run
    checkpoint: Path | None  # the final model; None when interrupted
    validation: dict | None
    elapsed_before: float = 0.0  # of `elapsed`, the part spent before a resume (by the runs resumed from)
    skipped: int = 0  # updates skipped for a non-finite loss or gradient, in all parts of the run


# ---------------------------------------------------------------------------------------------------- set-up


def set_up(
    cfg: PretrainRecipe,
    data: PretrainingData,
    run_dir: Path,
    clock: Callable[[], float],
    hooks: Sequence[EvalHook] = (),
    on_record: Callable[[dict], None] | None = None,
) -> Run:
    parallel = Parallel(init_from_env(cfg.impl))  # under torchrun: its process group; else one process
    ranks, train = parallel.ranks, cfg.train
    run_dir.mkdir(parents=True, exist_ok=True)
    loading = clock()
    resumed = state.find_resume_state(run_dir, cfg.resume, Path(cfg.base_dir), cfg.name)
    saved = resumed[0] if resumed else None
    if resumed:  # before anything is built: a state for other data or another model is refused by name
        if not resumed[1]:  # a requeued job that had finished only writes its final model again
            state.check_unfinished(saved, train.steps, cfg.budget, run_dir)
        state.check_same_run(saved, data.identity(), asdict(cfg.arch))
    # reading the state is part of this run's set-up, on the budget; the downtime before it is not
    elapsed_before = saved.elapsed if saved else 0.0
    budget = budget_clock(cfg.budget, clock, elapsed_before + clock() - loading, ranks)
    dtype, why = cfg.impl.precision_choice(ranks.device)
    log.info("precision %s (%s)", str(dtype).removeprefix("torch."), why)
    seed_everything(cfg.seed)
    cfg.impl.apply_to_process(ranks.device)  # threads on any device, as evaluation does; CPU allocator
    if ranks.device.type == "cuda":
        torch.set_float32_matmul_precision("high")  # TF32 for any fp32 matmul left: rounding only
    model = build_model(
        cfg.arch, data.vocab_size, device=ranks.device, dropout=train.dropout, **cfg.impl.kernel_choices()
    )
    masker = MLMMasker(train.mlm, data.vocab_size, data.special.all, data.special.mask, seed=cfg.seed)
    microbatch_size = autobatch.microbatch_size_for(
        cfg.impl.microbatch_size, model, masker, ranks.device, dtype, data.seq_length,
        base_dir=Path(cfg.base_dir), batch_size=train.batch_size, budget_hours=cfg.budget,
        world_size=ranks.world_size,
    )  # fmt: skip
    # FSDP2 shards before the optimizer is built (it replaces the parameters); DDP wraps after it
    model = parallel.shard(model, dtype)
    step = make_train_step(model, cfg, parallel, dtype)
    step_model = parallel.wrap(model, step.optimizer)
    progress = state.restore(saved, ranks, model, step) if saved else Progress()
    metrics = Metrics(run_dir / "metrics.jsonl" if ranks.is_main else None, data.seq_length, hooks, on_record)
    metrics.start_hooks(budget.fraction(), ranks.active)
    log_model_size(model, cfg.arch.name, data.vocab_size)
    predicted_per_row = masker.predicted_per_row(data.seq_length)
    log_set_up(
        ranks.device, dtype, len(data.train), data.seq_length, microbatch_size, cfg.train,
        probability_masking=cfg.arch.sparse_prediction and predicted_per_row is None,
    )  # fmt: skip
    if cfg.impl.compile_on(ranks.device):
        step_model = torch.compile(step_model)  # compiles on the first micro-batches: on the budget
    run = Run(
        cfg, data, run_dir, parallel, model, step_model, step, masker, budget, microbatch_size,
        predicted_per_row, metrics, progress, elapsed_before=elapsed_before, last_save=budget.elapsed(),
    )  # fmt: skip
    run.batches = training_batches(run)
    return run


def make_train_step(
    model: nn.Module, cfg: PretrainRecipe, parallel: Parallel, dtype: torch.dtype
) -> TrainStep:
    """The optimizer of train.optim inside the one training step (a loss scaler for fp16 only)."""
    # layerwise optimizers clip each gradient in their hooks, and under DDP average it over reduce_group
    optimizer = build_optimizer(
        model, cfg.train.optim, max_grad_norm=cfg.train.grad_clip, reduce_group=parallel.reduce_group
    )
    report = optimizer_state_report(optimizer)
    log.info("optimizer %s: %s", cfg.train.optim.name, format_state_report(report, parallel.ranks.world_size))
    return TrainStep(
        model, optimizer, device_type=parallel.ranks.device.type, dtype=dtype, grad_clip=cfg.train.grad_clip
    )


def training_batches(run: Run) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """This rank's micro-batches from the saved data position on, each with its stream row numbers."""
    ranks = run.parallel.ranks
    loader = microbatches(
        run.data.train,
        run.microbatch_size,
        run.cfg.seed,
        start=run.progress.rows,
        num_workers=run.cfg.impl.num_workers,
        pin_memory=run.device.type == "cuda",
        rank=ranks.rank,
        world_size=ranks.world_size,
    )
    return numbered(loader, run.progress.rows, run.microbatch_size, ranks.rank, ranks.world_size)


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
    run = set_up(cfg, data, Path(run_dir), clock, hooks, on_record)
    steps = cfg.train.steps if cfg.train.steps is not None else math.inf
    with catch_stop_signals() as signals:
        run.signals = signals
        run.metrics.restart_window()  # throughput from here, set-up excluded
        # a requeued job that had finished goes straight to finish
        reason = run.clock.stop_reason(signals.received) or (
            "steps" if run.progress.updates >= steps else None
        )
        # this process's first update is logged, a resumed run's too: that record alone covers the set-up and
        # one update, as the run card's split of the time (set-up, compile, train) reads it
        first = run.progress.updates + 1
        while reason is None:
            reason = run_update(run)
            progress, lr, skipped = run.progress, run.optimizer.param_groups[0]["lr"], run.step.stats.skipped
            if progress.updates == first or progress.updates % cfg.train.log_every == 0:
                run.metrics.log_progress(progress, lr, skipped, run.clock)
            if reason is None:
                tokens = progress.rows * data.seq_length
                run.metrics.run_due_hooks(run.model, run.clock, progress, lr, skipped, tokens)
            reason = reason or ("steps" if progress.updates >= steps else None)
            if reason is None and run.clock.elapsed() - run.last_save >= 60 * cfg.train.checkpoint_every_min:
                save_state(run)
    return finish(run, reason)


def run_update(run: Run) -> str | None:
    """Accumulate the micro-batches of one update and apply it. Returns a stop reason that came up on the way;
    an update cut short by it is dropped: its gradients are zeroed, its rows are trained on again after a
    resume and the RNG is rewound to where the update began, so the state saved next is that of the last
    completed update and a resumed run draws the same dropout masks as an uninterrupted one."""
    # mb: rows of one micro-batch over all ranks; batch_size counts global sequences per update
    train, mb = run.cfg.train, run.microbatch_size * run.parallel.ranks.world_size
    accumulate = accumulation_steps(
        run.clock.fraction(), train.batch_size, mb, train.batch_size_ramp, train.batch_size_start
    )
    run.step_model.train()
    schedule = LR_SCHEDULES[train.lr_schedule]
    run.step.begin(
        schedule.factor_for_update(
            train.warmup,
            budget_fraction=run.clock.fraction(),
            updates=run.progress.updates,
            steps=train.steps,
        )
    )
    sums = [torch.zeros((), device=run.device) for _ in range(3)]  # loss, correct predictions, predictions
    reason, done = None, 0
    rng = state.rng_state()
    while done < accumulate and reason is None:
        last = done + 1 == accumulate  # several ranks reduce gradients once per update: after its last one
        with run.parallel.grad_sync(run.step_model, sync=last), run.step.microbatch(last):
            for total, value in zip(
                sums, forward_backward(run, next(run.batches), 1.0 / accumulate), strict=True
            ):
                total += value
        done += 1
        run.progress.microbatches += 1
        reason = run.clock.stop_reason(run.signals.received if run.signals is not None else None)
    if done < accumulate:
        run.optimizer.zero_grad(set_to_none=True)
        state.set_rng_state(rng)
        return reason
    run.progress.rows += accumulate * mb  # consumed, whether applied or skipped as non-finite
    # several ranks: the mean loss over all of them (so all skip a non-finite update), summed counts
    loss_sum, correct, predicted = run.parallel.reduce_update_stats(*sums)
    if apply_update(run, loss_sum / accumulate):
        run.metrics.window.add(loss_sum / accumulate, correct, predicted, accumulate * mb)
    return reason


def forward_backward(run: Run, batch: tuple[torch.Tensor, torch.Tensor], loss_scale: float):
    """One micro-batch (stream rows, input_ids): mask, forward, backward. Returns detached (loss, correct
    predictions, predictions)."""
    rows, input_ids = batch
    corrupted, labels = run.masker(input_ids, rows)
    if run.device.type == "cuda":  # copies from pinned memory do not wait for the queued GPU work
        corrupted, labels = corrupted.pin_memory(), labels.pin_memory()
    corrupted = corrupted.to(run.device, non_blocking=True)
    labels = labels.to(run.device, non_blocking=True)
    with run.step.autocast():
        out = run.step_model(corrupted, labels, predicted_per_row=run.predicted_per_row)
    run.step.backward(out.loss, loss_scale)
    return (out.loss.detach(), *mlm_accuracy_counts(out))


def apply_update(run: Run, loss: torch.Tensor) -> bool:
    """Step at the scheduled learning rate, or skip the update when the loss or the gradient is not finite."""
    progress, stats = run.progress, run.step.stats
    if run.step.apply(loss):
        progress.updates += 1
        return True
    log.warning(
        "non-finite loss or gradient at update %d: update skipped (%d in a row)",
        progress.updates + 1,
        stats.skipped_in_a_row,
    )
    if stats.skipped_in_a_row >= run.cfg.train.max_nonfinite_updates:
        raise TrainingDiverged(
            f"the loss was non-finite for {stats.skipped_in_a_row} updates in a row at update"
            f" {progress.updates}: training diverged. Lower train.optim.lr, keep train.grad_clip on, or use"
            " impl.precision=bf16/fp32; resume=true restarts from the last saved state."
        )
    return False


def save_state(run: Run) -> None:
    """The resumable state, written by rank 0; the others only join in gathering a sharded (FSDP2) state."""
    saved = state.capture(
        run.parallel.ranks, run.model, run.step, run.progress, run.clock.elapsed(), asdict(run.cfg.arch),
        run.data.path, run.data.identity(),
    )  # fmt: skip
    if saved is not None:
        state.save(run.run_dir, saved)
    run.last_save = run.clock.elapsed()


def finish(run: Run, reason: str) -> TrainResult:
    """Save what the run leaves behind; the final model only when training ended by its own rule."""
    run.metrics.log_progress(
        run.progress, run.optimizer.param_groups[0]["lr"], run.step.stats.skipped, run.clock
    )
    log.info("stopping (%s) after %d updates, %s", reason, run.progress.updates, run.clock.describe())
    if run.progress.updates == 0 and reason not in STOP_SIGNALS:
        raise ConfigError(
            f"budget={run.cfg.budget:g} h ({run.clock.budget_seconds:.3g} s) ran out before the first update"
            f" ({run.clock.elapsed():.1f} s went to set-up): nothing was trained, so no model is saved. Give a"
            " budget that leaves time to train, e.g. budget=0.05 (3 minutes)"
        )
    save_state(run)
    elapsed = run.clock.elapsed()
    result = TrainResult(
        run.run_dir, reason, run.progress, elapsed, None, None, run.elapsed_before, run.step.stats.skipped
    )
    if reason in STOP_SIGNALS:
        run.parallel.barrier()  # every rank returns once rank 0's state is on disk
        return result
    # the optimizer state measured from its tensors (as their sizes report it under FSDP2), and the peak memory
    report = optimizer_state_report(run.optimizer)
    run.metrics.write({
        "update": run.progress.updates,
        "optimizer_state_bytes": report["state_bytes"],
        "optimizer_state_ratio_to_adamw": report["ratio_to_adamw_fp32"],
        "peak_memory_bytes": peak_memory_bytes(run.device),
    })  # fmt: skip
    data, train = run.data, run.cfg.train
    result.validation = validation_metrics(  # on every rank: FSDP2's forward is collective
        run.model, data.validation, limit=train.validation_rows, mlm=train.mlm, vocab_size=data.vocab_size,
        special_ids=data.special.all, mask_id=data.special.mask, microbatch_size=run.microbatch_size,
        autocast=run.step.autocast, predicted_per_row=run.predicted_per_row,
        context_diagnostic=train.context_diagnostic,
    )  # fmt: skip
    result.checkpoint = save_final_model(run, reason, elapsed, result.validation)
    run.parallel.barrier()  # every rank returns once the checkpoint is on disk
    # the evaluations due at the end of the budget, of the final model
    tokens = run.progress.rows * run.data.seq_length
    run.metrics.run_due_hooks(
        run.model,
        run.clock,
        run.progress,
        run.optimizer.param_groups[0]["lr"],
        run.step.stats.skipped,
        tokens,
    )
    return result


def save_final_model(run: Run, reason: str, elapsed: float, validation: dict | None) -> Path:
    info = {"updates": run.progress.updates, "elapsed_h": elapsed / 3600, "stop_reason": reason}
    if validation:
        info["validation"] = validation
        log.info("validation: loss %.4f, mlm acc %.3f", validation["loss"], validation["mlm_acc"])
        run.metrics.write({"update": run.progress.updates, **{f"val_{k}": v for k, v in validation.items()}})
    # whole weights on rank 0 (FSDP2: gathered into a CPU copy), None on the others
    model = sharded_state.exportable_model(
        run.model, run.parallel.ranks, lambda: build_model(run.cfg.arch, run.data.vocab_size)
    )
    path = run.run_dir / model_checkpoint.CHECKPOINT_DIR
    if model is not None:
        data = run.data
        model_checkpoint.save_pretrained(
            model, path, data.tokenizer, seq_length=data.seq_length, special=data.special, info=info
        )
        log.info("final model saved to %s", path)
    return path
