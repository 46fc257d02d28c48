"""The pretraining loop: micro-batches accumulate into updates until the wall-clock budget is spent.

    train()
      set_up()            model, optimizer, loader, clock; restores a resumable state when resuming
      while no stop reason:
        run_update()      accumulate micro-batches (check_stop after each), then apply_update()
        log / save state  every train.log_every updates / train.checkpoint_every_min minutes
        run_anytime_eval  GLUE fine-tuning at the fractions of the budget in train.anytime.at
      finish()            resumable state, final checkpoint, validation loss

The host measures elapsed time while the GPU may still be working through queued micro-batches; the one
synchronization per update (the non-finite loss check) bounds that lag to a single update.
"""

from __future__ import annotations

import itertools
import json
import logging
import math
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
import torch._dynamo  # noqa: F401  imported before the budget clock starts: the first optimizer does it (5-10 s)
from torch import nn

from cramming.budget import BudgetClock
from cramming.config import PretrainConfig
from cramming.data import PretrainingData
from cramming.errors import ConfigError
from cramming.eval.anytime import AnytimeEval
from cramming.model import IGNORE_INDEX, ArchConfig, build_model, count_parameters
from cramming.model import checkpoint as model_checkpoint
from cramming.optim import build_optimizer, check_layerwise_loop, format_state_report, optimizer_state_report
from cramming.train import autobatch, checkpoint, distributed
from cramming.train.batches import microbatches
from cramming.train.mlm import MLMMasker
from cramming.train.schedules import LR_SCHEDULES, accumulation_steps
from cramming.train.signals import StopSignals, catch_stop_signals
from cramming.train.tensorboard import TensorBoardWriter
from cramming.utils import seed_everything

log = logging.getLogger("cramming")
STATE_VERSION = 1


class TrainingDiverged(RuntimeError):
    """The loss stayed non-finite for train.max_nonfinite_updates updates in a row."""


@dataclass
class Progress:
    """How far the run got; saved in the resumable state."""

    updates: int = 0
    microbatches: int = 0
    # training rows of completed updates: the data position a resumed run starts from
    rows: int = 0
    # updates skipped for a non-finite loss, in all and in a row
    skipped: int = 0
    skipped_in_a_row: int = 0


@dataclass
class Window:
    """Sums since the last log line; loss and accuracy counts stay on the device until it is written."""

    loss: torch.Tensor | float = 0.0
    correct: torch.Tensor | float = 0.0
    predicted: torch.Tensor | float = 0.0
    updates: int = 0
    rows: int = 0
    since: float = field(default_factory=time.monotonic)


@dataclass
class Run:
    """Everything the loop works with."""

    cfg: PretrainConfig
    data: PretrainingData
    run_dir: Path
    device: torch.device
    dtype: torch.dtype
    model: nn.Module  # plain module: saved state dicts use its key names
    step_model: nn.Module  # what runs forward: the model or its torch.compile wrapper
    optimizer: torch.optim.Optimizer
    scaler: torch.amp.GradScaler
    masker: MLMMasker
    mask_generator: torch.Generator
    clock: BudgetClock
    progress: Progress
    batches: Iterator[torch.Tensor] | None = None
    window: Window = field(default_factory=Window)
    last_save: float = 0.0  # budget seconds at the last resumable state
    signals: StopSignals | None = None
    metrics_file: Path | None = None  # None: no metrics written (ranks other than 0)
    ranks: distributed.Ranks = field(default_factory=distributed.Ranks)  # a single process by default
    anytime: AnytimeEval | None = None  # GLUE fine-tuning at fractions of the budget (train.anytime)
    tensorboard: TensorBoardWriter | None = None  # the metrics records as TensorBoard scalars too


@dataclass
class TrainResult:
    run_dir: Path
    stop_reason: str  # budget | steps | SIGINT | SIGTERM
    progress: Progress
    elapsed: float  # seconds of budget spent in all parts of the run
    checkpoint: Path | None  # the final model; None when interrupted
    validation: dict | None


# ---------------------------------------------------------------------------------------------------- set-up


def set_up(cfg: PretrainConfig, data: PretrainingData, run_dir: Path, clock: Callable[[], float]) -> Run:
    ranks = distributed.init_from_env(cfg.impl)  # under torchrun: its process group; else a single process
    run_dir.mkdir(parents=True, exist_ok=True)
    state = load_resume_state(cfg)
    elapsed_before = state["elapsed"] if state else 0.0
    budget = distributed.budget_clock(ranks, cfg.budget, clock, elapsed_before)  # rank 0's, when several
    device = ranks.device
    dtype = cfg.impl.compute_dtype(device)
    seed_everything(cfg.seed)
    if device.type == "cuda":
        torch.set_float32_matmul_precision("high")  # TF32 for any fp32 matmul left: rounding only
    elif cfg.impl.cpu_threads is not None:
        torch.set_num_threads(cfg.impl.cpu_threads)

    model = build_model(
        cfg.arch,
        data.vocab_size,
        device=device,
        attention=cfg.impl.attention,
        layernorm=cfg.impl.layernorm,
        strict_kernels=cfg.impl.strict_kernels,
        dropout=cfg.train.dropout,
    )
    log_model_size(model, cfg.arch, data.vocab_size)
    if cfg.impl.microbatch_size == "auto":  # searched now, on the budget's clock, before any optimizer hook
        cfg.impl.microbatch_size = autobatch.choose_microbatch(
            model,
            MLMMasker(cfg.train.mlm, data.vocab_size, data.special.all, data.special.mask),
            device,
            dtype,
            data.seq_length,
            cache_path=Path(cfg.base_dir) / autobatch.CACHE_FILE,
            most=cfg.train.batch_size,
            time_limit=autobatch.time_limit_for(cfg.budget),
            search_allowed=ranks.world_size == 1,
        )
    # DDP wrapper / FSDP2 shards: before the optimizer, which must see FSDP2's parameters
    step_model = distributed.prepare_model(model, ranks, cfg.train.optim.name, dtype)
    optimizer, scaler = set_up_optimizer(model, cfg, device, dtype)
    special = data.special
    masker = MLMMasker(cfg.train.mlm, data.vocab_size, special.all, special.mask)
    run = Run(
        cfg=cfg,
        data=data,
        run_dir=run_dir,
        device=device,
        dtype=dtype,
        model=model,
        step_model=step_model,
        optimizer=optimizer,
        scaler=scaler,
        masker=masker,
        mask_generator=torch.Generator().manual_seed(cfg.seed),
        clock=budget,
        progress=Progress(),
        metrics_file=run_dir / "metrics.jsonl" if ranks.is_main else None,
        ranks=ranks,
    )
    if state:
        restore(run, state)
    run.last_save = budget.elapsed()
    set_up_reporting(run)
    if cfg.impl.compile_on(device):
        # compiles on the first micro-batches: on the budget's clock
        run.step_model = torch.compile(run.step_model)
    run.batches = iter(
        microbatches(
            data.train,
            cfg.impl.microbatch_size,
            cfg.seed,
            start=run.progress.rows,
            num_workers=cfg.impl.num_workers,
            pin_memory=device.type == "cuda",
            rank=ranks.rank,
            world_size=ranks.world_size,
        )
    )
    log.info(
        "training on %s in %s: %d rows of %d tokens, micro-batch %d, %d sequences per update at %.0f%% of the budget",
        device,
        str(dtype).removeprefix("torch."),
        len(data.train),
        data.seq_length,
        cfg.impl.microbatch_size,
        cfg.train.batch_size,
        100 * cfg.train.batch_size_ramp,
    )
    return run


def set_up_optimizer(
    model: nn.Module, cfg: PretrainConfig, device: torch.device, dtype: torch.dtype
) -> tuple[torch.optim.Optimizer, torch.amp.GradScaler]:
    """The optimizer of train.optim and a loss scaler (active for fp16 only)."""
    # layerwise optimizers clip each gradient in their hooks; the others ignore max_grad_norm
    optimizer = build_optimizer(model, cfg.train.optim, max_grad_norm=cfg.train.grad_clip)
    scaler = torch.amp.GradScaler(device.type, enabled=dtype == torch.float16)
    most_accumulation = accumulation_steps(1.0, cfg.train.batch_size, cfg.impl.microbatch_size, 0.0)
    check_layerwise_loop(
        optimizer,
        grad_accumulation=most_accumulation,
        distributed=distributed.is_multiprocess(),
        grad_scaler=scaler.is_enabled(),
    )
    for group in optimizer.param_groups:
        group.setdefault("peak_lr", group["lr"])  # the schedule multiplies this
    log.info("optimizer %s: %s", cfg.train.optim.name, format_state_report(optimizer_state_report(optimizer)))
    return optimizer, scaler


def log_model_size(model: nn.Module, arch: ArchConfig, vocab_size: int) -> None:
    total = count_parameters(model)
    embedding = model.encoder.embeddings.word.weight.numel()
    log.info(
        "model %s: %.1fM parameters (%.1fM without the %d x %d word embedding)",
        arch.name,
        total / 1e6,
        (total - embedding) / 1e6,
        vocab_size,
        arch.hidden_size,
    )


# --------------------------------------------------------------------------------------------------- the loop


def train(
    cfg: PretrainConfig,
    data: PretrainingData,
    run_dir: str | Path,
    clock: Callable[[], float] = time.monotonic,
) -> TrainResult:
    """Pretrain until the budget (or train.steps, or a stop signal) ends the run; see the module docstring."""
    run = set_up(cfg, data, Path(run_dir), clock)
    with catch_stop_signals() as signals:
        run.signals = signals
        run.window = Window()  # throughput from here, set-up excluded
        reason = check_stop(run)
        while reason is None:
            reason = run_update(run)
            if run.progress.updates == 1 or run.progress.updates % cfg.train.log_every == 0:
                log_progress(run)
            if reason is None and run.anytime is not None and run.anytime.due(run.clock.fraction()):
                run_anytime_eval(run)
            if reason is None and cfg.train.steps is not None and run.progress.updates >= cfg.train.steps:
                reason = "steps"
            if reason is None and run.clock.elapsed() - run.last_save >= 60 * cfg.train.checkpoint_every_min:
                save_resumable_state(run)
    return finish(run, reason)


def check_stop(run: Run) -> str | None:
    """Checked after every micro-batch: a stop signal, or the budget spent. Several ranks stop after the same
    micro-batch: they agree here on rank 0's clock and on a signal any of them received."""
    received = run.signals.received if run.signals is not None else None
    if run.ranks.active:
        received = run.clock.agree(received)
    if received:
        return received
    if run.clock.expired():
        return "budget"
    return None


def run_update(run: Run) -> str | None:
    """Accumulate the micro-batches of one update and apply it. Returns a stop reason that came up on the way;
    an update cut short by it is dropped (its rows are trained on again after a resume)."""
    # mb: rows of one micro-batch over all ranks; batch_size counts global sequences per update
    train_cfg, mb = run.cfg.train, run.cfg.impl.microbatch_size * run.ranks.world_size
    accumulate = accumulation_steps(run.clock.fraction(), train_cfg.batch_size, mb, train_cfg.batch_size_ramp)
    run.step_model.train()
    loss_sum = torch.zeros((), device=run.device)
    correct = torch.zeros((), device=run.device)
    predicted = torch.zeros((), device=run.device)
    reason, done = None, 0
    while done < accumulate and reason is None:
        # several ranks reduce gradients once per update: after its last micro-batch
        with distributed.grad_sync(run.step_model, run.ranks, sync=done + 1 == accumulate):
            loss, right, count = forward_backward(run, next(run.batches), 1.0 / accumulate)
        loss_sum += loss
        correct += right
        predicted += count
        done += 1
        run.progress.microbatches += 1
        reason = check_stop(run)
    if done < accumulate:
        run.optimizer.zero_grad(set_to_none=True)
        return reason
    run.progress.rows += accumulate * mb  # consumed, whether applied or skipped as non-finite
    # several ranks: the mean loss over all of them (so all skip a non-finite update), summed counts
    loss_sum, correct, predicted = distributed.reduce_update_stats(run.ranks, loss_sum, correct, predicted)
    if apply_update(run, loss_sum / accumulate):
        run.window.loss += loss_sum / accumulate
        run.window.correct += correct
        run.window.predicted += predicted
        run.window.updates += 1
        run.window.rows += accumulate * mb
    return reason


def forward_backward(run: Run, input_ids: torch.Tensor, loss_scale: float):
    """One micro-batch: mask, forward, backward. Returns detached (loss, correct predictions, predictions)."""
    corrupted, labels = distributed.mask_local_rows(run.masker, input_ids, run.mask_generator, run.ranks)
    if run.device.type == "cuda":  # copies from pinned memory do not wait for the queued GPU work
        corrupted, labels = corrupted.pin_memory(), labels.pin_memory()
    corrupted = corrupted.to(run.device, non_blocking=True)
    labels = labels.to(run.device, non_blocking=True)
    with torch.autocast(run.device.type, dtype=run.dtype, enabled=run.dtype != torch.float32):
        out = run.step_model(corrupted, labels)
    run.scaler.scale(out.loss * loss_scale).backward()
    with torch.no_grad():
        target = out.labels != IGNORE_INDEX
        # right where the label's logit is the row's maximum: argmax == label up to exact ties, and on CPU
        # an amax is many times cheaper than an argmax (profiled: argmax was 9% of a tiny-model step)
        label_logit = out.logits.gather(-1, out.labels.clamp(min=0)[:, None]).squeeze(-1)
        correct = ((label_logit >= out.logits.amax(dim=-1)) & target).sum()
    return out.loss.detach(), correct, target.sum()


def apply_update(run: Run, loss: torch.Tensor) -> bool:
    """Set the learning rate, clip and step; or skip the update when the loss is not finite."""
    progress = run.progress
    # the one host-device synchronization per update. (A layerwise optimizer has updated the weights during
    # backward already: for it, a non-finite loss is counted and stops the run, but cannot be undone.)
    if not torch.isfinite(loss).item():
        run.optimizer.zero_grad(set_to_none=True)
        if run.scaler.is_enabled():  # fp16: an overflow, so lower the loss scale as a skipped step would
            run.scaler.update(run.scaler.get_scale() * run.scaler.get_backoff_factor())
        progress.skipped += 1
        progress.skipped_in_a_row += 1
        log.warning(
            "non-finite loss at update %d: update skipped (%d in a row)",
            progress.updates + 1,
            progress.skipped_in_a_row,
        )
        if progress.skipped_in_a_row >= run.cfg.train.max_nonfinite_updates:
            raise TrainingDiverged(
                f"the loss was non-finite for {progress.skipped_in_a_row} updates in a row at update"
                f" {progress.updates}: training diverged. Lower train.optim.lr, keep train.grad_clip on, or use"
                " impl.precision=bf16/fp32; resume=true restarts from the last saved state."
            )
        return False
    progress.skipped_in_a_row = 0
    factor = lr_factor(run)
    for group in run.optimizer.param_groups:
        group["lr"] = group["peak_lr"] * factor
    # a layerwise optimizer has already updated (and clipped) every parameter during backward
    if run.cfg.train.grad_clip is not None and not getattr(run.optimizer, "layerwise", False):
        run.scaler.unscale_(run.optimizer)
        torch.nn.utils.clip_grad_norm_(run.model.parameters(), run.cfg.train.grad_clip)
    run.scaler.step(run.optimizer)
    run.scaler.update()
    run.optimizer.zero_grad(set_to_none=True)
    progress.updates += 1
    return True


def lr_factor(run: Run) -> float:
    """Multiplier of the peak learning rate for the update about to be applied."""
    schedule = LR_SCHEDULES[run.cfg.train.lr_schedule]
    if schedule.clock == "budget":
        progress = run.clock.fraction()
    else:
        progress = run.progress.updates / run.cfg.train.steps
    return schedule.factor(progress, run.cfg.train.warmup)


# ------------------------------------------------------------------------------------------------ logging


def log_progress(run: Run) -> None:
    """A log line and a metrics record for the updates since the last one."""
    w, p = run.window, run.progress
    if w.updates == 0:
        return
    seconds = max(time.monotonic() - w.since, 1e-9)
    record = {
        "update": p.updates,
        "microbatches": p.microbatches,
        "loss": float(w.loss) / w.updates,
        "mlm_acc": float(w.correct) / max(float(w.predicted), 1.0),
        "lr": run.optimizer.param_groups[0]["lr"],
        "batch_size": w.rows // w.updates,
        "seq_per_s": w.rows / seconds,
        "tok_per_s": w.rows * run.data.seq_length / seconds,
        "elapsed_h": run.clock.elapsed() / 3600,
        "budget_fraction": run.clock.fraction(),
        "skipped": p.skipped,
    }
    log.info(
        "update %d | loss %.4f | mlm acc %.3f | lr %.2e | batch %d | %.0f seq/s, %.0f tok/s | %s",
        p.updates,
        record["loss"],
        record["mlm_acc"],
        record["lr"],
        record["batch_size"],
        record["seq_per_s"],
        record["tok_per_s"],
        run.clock.describe(),
    )
    write_metrics(run, record)
    run.window = Window()


def write_metrics(run: Run, record: dict) -> None:
    if run.metrics_file is None:
        return
    with open(run.metrics_file, "a", encoding="utf-8") as f:
        f.write(json.dumps(record) + "\n")
    if run.tensorboard is not None:
        run.tensorboard.write(record)


def set_up_reporting(run: Run) -> None:
    """Anytime evaluation and TensorBoard, when the config asks for them."""
    cfg = run.cfg.train
    if cfg.anytime.at:
        if run.ranks.active:
            raise ConfigError("train.anytime evaluates in a single process only; run without torchrun")
        run.anytime = AnytimeEval(
            cfg.anytime,
            tokenizer=run.data.tokenizer,
            seq_length=run.data.seq_length,
            special=run.data.special,
            impl=run.cfg.impl,
            run_dir=run.run_dir,
            cache_dir=run.cfg.data_cache_root / "hf",
            # a resumed run does not repeat the fractions it passed
            fraction_done=run.clock.fraction() if run.cfg.resume else 0.0,
        )
    if cfg.tensorboard and run.ranks.is_main:
        run.tensorboard = TensorBoardWriter(run.run_dir)


def run_anytime_eval(run: Run) -> None:
    """Fine-tune the current weights on the anytime tasks; the throughput figures leave its time out."""
    log_progress(run)  # closes the throughput window before the evaluation
    write_metrics(run, run.anytime.evaluate(run.model, run.clock, run.progress.updates))
    run.window = Window()


def close_reporting(run: Run, final: bool) -> None:
    """The anytime evaluation due at the end of the budget (of the final model only), then TensorBoard."""
    if final and run.anytime is not None and run.anytime.due(run.clock.fraction()):
        run_anytime_eval(run)
    if run.tensorboard is not None:
        run.tensorboard.close()


# ------------------------------------------------------------------------------------- state, resume, finish


def save_resumable_state(run: Run) -> None:
    """Written by rank 0; the others only join in gathering a sharded (FSDP2) state."""
    elapsed = run.clock.elapsed()
    model_state, optimizer_state = distributed.full_state(run.model, run.optimizer, run.ranks)
    if not run.ranks.is_main:
        run.last_save = run.clock.elapsed()
        return
    state = {
        "version": STATE_VERSION,
        "model": model_state,
        "optimizer": optimizer_state,
        "scaler": run.scaler.state_dict(),
        "progress": asdict(run.progress),
        "elapsed": elapsed,
        "rng": {
            "torch": torch.get_rng_state(),
            "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else [],
            "mask": run.mask_generator.get_state(),
        },
        "arch": asdict(run.cfg.arch),
        "data_path": str(run.data.path),
    }
    path = run.run_dir / checkpoint.STATE
    checkpoint.save_state(path, state)
    run.last_save = run.clock.elapsed()
    log.info(
        "resumable state saved at update %d (%.2fh of budget) to %s",
        run.progress.updates,
        elapsed / 3600,
        path,
    )


def load_resume_state(cfg: PretrainConfig) -> dict | None:
    """With resume=true, the state of the newest run of this name that saved one."""
    if not cfg.resume:
        return None
    path = checkpoint.find_resumable_state(cfg.base_dir, cfg.name)
    if path is None:
        raise ConfigError(
            f"resume=true but no run named {cfg.name!r} under {cfg.base_dir} left a resumable state"
            f" ({checkpoint.STATE}); check `name` and `base_dir`, or start afresh with resume=false"
        )
    state = checkpoint.load_state(path)
    if state.get("version") != STATE_VERSION:
        raise ConfigError(f"{path} has state version {state.get('version')}, this code reads {STATE_VERSION}")
    log.info(
        "resuming from %s: update %d, %.2fh of budget spent",
        path,
        state["progress"]["updates"],
        state["elapsed"] / 3600,
    )
    return state


def restore(run: Run, state: dict) -> None:
    if state["arch"] != asdict(run.cfg.arch):
        raise ConfigError(
            f"resume=true: the saved run used another arch ({state['arch']['name']}); resume with the same `arch`"
        )
    if state["data_path"] != str(run.data.path):
        log.warning(
            "resuming on other data than the saved run: %s (was %s)", run.data.path, state["data_path"]
        )
    distributed.load_full_state(run.model, run.optimizer, state["model"], state["optimizer"], run.ranks)
    run.scaler.load_state_dict(state["scaler"])
    run.progress = Progress(**state["progress"])
    torch.set_rng_state(state["rng"]["torch"])
    if state["rng"]["cuda"] and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["rng"]["cuda"])
    run.mask_generator.set_state(state["rng"]["mask"])


def finish(run: Run, reason: str) -> TrainResult:
    """Save what the run leaves behind; the final model only when training ended by its own rule."""
    log_progress(run)
    log.info("stopping (%s) after %d updates, %s", reason, run.progress.updates, run.clock.describe())
    save_resumable_state(run)
    elapsed = run.clock.elapsed()
    if reason in ("SIGINT", "SIGTERM"):
        distributed.barrier(run.ranks)  # every rank returns once rank 0's state is on disk
        close_reporting(run, final=False)
        return TrainResult(run.run_dir, reason, run.progress, elapsed, None, None)
    validation = evaluate(run)  # on every rank: FSDP2's forward is collective
    info = {"updates": run.progress.updates, "elapsed_h": elapsed / 3600, "stop_reason": reason}
    if validation:
        info["validation"] = validation
        log.info("validation: loss %.4f, mlm acc %.3f", validation["loss"], validation["mlm_acc"])
        write_metrics(run, {"update": run.progress.updates, **{f"val_{k}": v for k, v in validation.items()}})
    # whole weights on rank 0 (FSDP2: gathered into a CPU copy), None on the others
    model = distributed.exportable_model(
        run.model, run.ranks, lambda: build_model(run.cfg.arch, run.data.vocab_size)
    )
    path = run.run_dir / model_checkpoint.CHECKPOINT_DIR
    if model is not None:
        model_checkpoint.save_pretrained(
            model,
            path,
            run.data.tokenizer,
            seq_length=run.data.seq_length,
            special=run.data.special,
            info=info,
        )
        log.info("final model saved to %s", path)
    distributed.barrier(run.ranks)  # every rank returns once the checkpoint is on disk
    close_reporting(run, final=True)
    return TrainResult(run.run_dir, reason, run.progress, elapsed, path, validation)


@torch.no_grad()
def evaluate(run: Run) -> dict | None:
    """MLM loss and accuracy on the first train.eval_microbatches micro-batches of the validation split, with
    a fixed masking seed so runs compare."""
    rows, n = run.data.validation, run.cfg.train.eval_microbatches
    if rows is None or len(rows) == 0 or n == 0:
        return None
    run.model.eval()
    generator = torch.Generator().manual_seed(0)
    mb = min(run.cfg.impl.microbatch_size, len(rows))
    loader = microbatches(rows, mb, seed=0, start=0, num_workers=0, pin_memory=False)
    loss, correct, predicted = 0.0, 0.0, 0.0
    for input_ids in itertools.islice(loader, min(n, math.ceil(len(rows) / mb))):
        corrupted, labels = run.masker(input_ids, generator)
        with torch.autocast(run.device.type, dtype=run.dtype, enabled=run.dtype != torch.float32):
            out = run.model(corrupted.to(run.device), labels.to(run.device))
        target = out.labels != IGNORE_INDEX
        loss += out.loss.item() * target.sum().item()
        correct += ((out.logits.argmax(-1) == out.labels) & target).sum().item()
        predicted += target.sum().item()
    return {"loss": loss / max(predicted, 1.0), "mlm_acc": correct / max(predicted, 1.0)}
