"""The pretraining loop: micro-batches accumulate into updates until the wall-clock budget is spent.

    train()
      set_up()            model, train step, loader, clock; restores a resumable state when resuming
      while no stop reason:
        run_update()      accumulate micro-batches (check_stop after each), then apply_update()
        log / save state  every train.log_every updates / train.checkpoint_every_min minutes
        run_hooks()       callbacks the entry point passed in (pretrain.py: anytime GLUE evaluation)
      finish()            resumable state, final checkpoint, validation loss

One update is cramming.optim.step.TrainStep; masks are keyed by stream row (cramming.train.mlm), so neither
the micro-batch size nor a resume changes what is computed.

The host measures elapsed time while the GPU may still be working through queued micro-batches; the one
synchronization per update (the non-finite check of loss and gradient norm) bounds that lag to a single
update.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

import torch
import torch._dynamo  # noqa: F401  imported before the budget clock starts: the first optimizer does it (5-10 s)
from torch import nn

from cramming.budget import BudgetClock
from cramming.data import PretrainingData
from cramming.errors import ConfigError, TrainingDiverged, WriteFailed
from cramming.model import ArchConfig, build_model, count_parameters
from cramming.model import checkpoint as model_checkpoint
from cramming.optim import build_optimizer, format_state_report, optimizer_state_report
from cramming.optim.schedules import LR_SCHEDULES, step_progress
from cramming.optim.step import TrainStep
from cramming.signals import STOP_SIGNALS, StopSignals, catch_stop_signals
from cramming.train import autobatch, checkpoint, distributed
from cramming.train.batches import accumulation_steps, microbatches, numbered
from cramming.train.config import check_batch_division
from cramming.train.context import context_use
from cramming.train.context import describe as describe_context_use
from cramming.train.mlm import MLMMasker, mlm_accuracy_counts, mlm_totals
from cramming.utils import peak_memory_bytes, seed_everything

if TYPE_CHECKING:  # annotations only: the top-level schema also knows eval/, which train/ never imports
    from cramming.config import PretrainConfig

log = logging.getLogger("cramming")
STATE_VERSION = 2  # 2: masks keyed by stream row (no masking RNG), the train step's scaler


@dataclass
class Progress:
    """How far the run got; saved in the resumable state."""

    updates: int = 0
    microbatches: int = 0
    # training rows of completed updates: the data position a resumed run starts from
    rows: int = 0
    # (updates skipped for a non-finite loss are counted once, in TrainStep.stats, saved with the step)


@dataclass
class Window:
    """Sums since the last log line; loss and accuracy counts stay on the device until it is written."""

    loss: torch.Tensor | float = 0.0
    correct: torch.Tensor | float = 0.0
    predicted: torch.Tensor | float = 0.0
    updates: int = 0
    rows: int = 0
    since: float = field(default_factory=time.monotonic)


class EvalHook(Protocol):
    """A callback the loop runs between updates (pretrain.py passes anytime GLUE evaluation this way)."""

    def start(self, fraction_done: float) -> None: ...

    def due(self, fraction: float) -> bool: ...

    def __call__(self, model: nn.Module, clock: BudgetClock, update: int) -> dict: ...


@dataclass
class Run:
    """Everything the loop works with."""

    cfg: PretrainConfig
    data: PretrainingData
    run_dir: Path
    device: torch.device
    model: nn.Module  # plain module: saved state dicts use its key names
    step_model: nn.Module  # what runs forward: the model, its DDP/FSDP2 form or its torch.compile wrapper
    step: TrainStep
    masker: MLMMasker
    clock: BudgetClock
    microbatch_size: int  # impl.microbatch_size, or the one the search chose (the config is never written)
    predicted_per_row: int | None  # the decoder's static positions per row (count masking), else None
    progress: Progress
    data_identity: dict  # PretrainingData.identity(): saved with the state, checked on resume
    batches: Iterator[tuple[torch.Tensor, torch.Tensor]] | None = None  # (stream rows, input_ids)
    window: Window = field(default_factory=Window)
    last_save: float = 0.0  # budget seconds at the last resumable state
    elapsed_before: float = 0.0  # budget seconds the resumed state had spent (0 for a fresh run)
    signals: StopSignals | None = None
    metrics_file: Path | None = None  # None: no metrics written (ranks other than 0)
    ranks: distributed.Ranks = field(default_factory=distributed.Ranks)  # a single process by default
    hooks: Sequence[EvalHook] = ()
    # each metrics record is handed to it too (pretrain.py: the experiment trackers); rank 0 only
    on_record: Callable[[dict], None] | None = None

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
    cfg: PretrainConfig,
    data: PretrainingData,
    run_dir: Path,
    clock: Callable[[], float],
    hooks: Sequence[EvalHook] = (),
    on_record: Callable[[dict], None] | None = None,
) -> Run:
    ranks = distributed.init_from_env(cfg.impl)  # under torchrun: its process group; else a single process
    run_dir.mkdir(parents=True, exist_ok=True)
    loading = clock()
    state = load_resume_state(cfg, run_dir)
    data_identity = data.identity()
    if state:  # before anything is built: a state for other data is refused by name
        check_same_data(state, data_identity, data.path)
    # reading the state is part of this run's set-up, on the budget; the downtime before it is not
    spent = (state["elapsed"] if state else 0.0) + clock() - loading
    budget = distributed.budget_clock(ranks, cfg.budget, clock, spent)
    dtype, why = cfg.impl.precision_choice(ranks.device)
    log.info("precision %s (%s)", str(dtype).removeprefix("torch."), why)
    configure_torch(cfg, ranks.device)
    model = build_model(
        cfg.arch,
        data.vocab_size,
        device=ranks.device,
        dropout=cfg.train.dropout,
        **cfg.impl.kernel_choices(),
    )
    log_model_size(model, cfg.arch, data.vocab_size)
    masker = MLMMasker(cfg.train.mlm, data.vocab_size, data.special.all, data.special.mask, seed=cfg.seed)
    microbatch_size = choose_microbatch_size(cfg, model, masker, ranks, dtype, data.seq_length)
    # DDP wrapper / FSDP2 shards: before the optimizer, which must see FSDP2's parameters
    step_model = distributed.prepare_model(model, ranks, cfg.train.optim.name, dtype)
    run = Run(
        cfg=cfg,
        data=data,
        run_dir=run_dir,
        device=ranks.device,
        model=model,
        step_model=step_model,
        step=make_train_step(model, cfg, ranks, dtype),
        masker=masker,
        clock=budget,
        microbatch_size=microbatch_size,
        predicted_per_row=masker.predicted_per_row(data.seq_length),
        progress=Progress(),
        data_identity=data_identity,
        metrics_file=run_dir / "metrics.jsonl" if ranks.is_main else None,
        ranks=ranks,
        on_record=on_record,
    )
    if state:
        restore(run, state)
        run.elapsed_before = state["elapsed"]
    run.last_save = budget.elapsed()
    open_reporting(run, hooks)
    if cfg.impl.compile_on(ranks.device):
        run.step_model = torch.compile(run.step_model)  # compiles on the first micro-batches: on the budget
    run.batches = training_batches(run)
    log_set_up(run, dtype)
    return run


def configure_torch(cfg: PretrainConfig, device: torch.device) -> None:
    """Seeds, and the speed settings of impl that act process-wide."""
    seed_everything(cfg.seed)
    cfg.impl.apply_threads()  # on any device, as evaluation does: the run card reports the setting
    if device.type == "cuda":
        torch.set_float32_matmul_precision("high")  # TF32 for any fp32 matmul left: rounding only


def choose_microbatch_size(
    cfg: PretrainConfig, model: nn.Module, masker: MLMMasker, ranks, dtype: torch.dtype, seq_length: int
) -> int:
    """impl.microbatch_size, or with `auto` the searched one: now, on the budget's clock, before any
    optimizer hook. Returned, never written back into the config. Either way it must form train.batch_size
    exactly on this many processes."""
    chosen = cfg.impl.microbatch_size
    if chosen == "auto":
        chosen = autobatch.choose_microbatch(
            model,
            masker,
            ranks.device,
            dtype,
            seq_length,
            cache_path=Path(cfg.base_dir) / autobatch.CACHE_FILE,
            most=cfg.train.batch_size,
            time_limit=autobatch.time_limit_for(cfg.budget),
            search_allowed=ranks.world_size == 1,
        )
    check_batch_division(cfg.train.batch_size, chosen, ranks.world_size)
    return chosen


def make_train_step(
    model: nn.Module, cfg: PretrainConfig, ranks: distributed.Ranks, dtype: torch.dtype
) -> TrainStep:
    """The optimizer of train.optim inside the one training step (a loss scaler for fp16 only)."""
    # layerwise optimizers clip each gradient in their hooks; the others ignore max_grad_norm
    optimizer = build_optimizer(
        model,
        cfg.train.optim,
        max_grad_norm=cfg.train.grad_clip,
        reduce_group=distributed.layerwise_reduce_group(ranks),
    )
    train = cfg.train
    log.info(
        "optimizer %s: %s",
        train.optim.name,
        format_state_report(optimizer_state_report(optimizer), ranks.world_size),
    )
    return TrainStep(
        model,
        optimizer,
        device_type=ranks.device.type,
        dtype=dtype,
        grad_clip=train.grad_clip,
    )


def training_batches(run: Run) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """This rank's micro-batches from the saved data position on, each with its stream row numbers."""
    loader = microbatches(
        run.data.train,
        run.microbatch_size,
        run.cfg.seed,
        start=run.progress.rows,
        num_workers=run.cfg.impl.num_workers,
        pin_memory=run.device.type == "cuda",
        rank=run.ranks.rank,
        world_size=run.ranks.world_size,
    )
    return numbered(loader, run.progress.rows, run.microbatch_size, run.ranks.rank, run.ranks.world_size)


def log_set_up(run: Run, dtype: torch.dtype) -> None:
    train = run.cfg.train
    log.info(
        "training on %s in %s: %d rows of %d tokens, micro-batch %d, %d sequences per update at %.0f%% of the"
        " budget (from %d)",
        run.device,
        str(dtype).removeprefix("torch."),
        len(run.data.train),
        run.data.seq_length,
        run.microbatch_size,
        train.batch_size,
        100 * train.batch_size_ramp,
        min(train.batch_size_start, train.batch_size),
    )
    if run.cfg.arch.sparse_prediction and run.predicted_per_row is None:
        log.info(
            "probability masking: the decoder runs on each micro-batch's masked positions, a data-dependent"
            " shape (a host synchronization per micro-batch; a graph break under torch.compile)"
        )


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
    hooks: Sequence[EvalHook] = (),
    on_record: Callable[[dict], None] | None = None,
) -> TrainResult:
    """Pretrain until the budget (or train.steps, or a stop signal) ends the run; see the module docstring.
    hooks: evaluations run between updates when due (each returns a metrics record). on_record: called with
    every metrics record after it is written (on rank 0, at log steps only)."""
    run = set_up(cfg, data, Path(run_dir), clock, hooks, on_record)
    with catch_stop_signals() as signals:
        run.signals = signals
        run.window = Window()  # throughput from here, set-up excluded
        reason = check_stop(run) or steps_done(run)  # a requeued job that had finished: straight to finish
        while reason is None:
            reason = run_update(run)
            if run.progress.updates == 1 or run.progress.updates % cfg.train.log_every == 0:
                log_progress(run)
            if reason is None:
                run_hooks(run)
            reason = reason or steps_done(run)
            if reason is None and run.clock.elapsed() - run.last_save >= 60 * cfg.train.checkpoint_every_min:
                save_resumable_state(run)
    return finish(run, reason)


def steps_done(run: Run) -> str | None:
    """ "steps" once train.steps updates are done."""
    steps = run.cfg.train.steps
    return "steps" if steps is not None and run.progress.updates >= steps else None


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
    an update cut short by it is dropped: its gradients are zeroed, its rows are trained on again after a
    resume and the RNG is rewound to where the update began, so the state saved next is that of the last
    completed update and a resumed run draws the same dropout masks as an uninterrupted one."""
    # mb: rows of one micro-batch over all ranks; batch_size counts global sequences per update
    train_cfg, mb = run.cfg.train, run.microbatch_size * run.ranks.world_size
    accumulate = accumulation_steps(
        run.clock.fraction(), train_cfg.batch_size, mb, train_cfg.batch_size_ramp, train_cfg.batch_size_start
    )
    run.step_model.train()
    run.step.begin(lr_factor(run))
    loss_sum = torch.zeros((), device=run.device)
    correct = torch.zeros((), device=run.device)
    predicted = torch.zeros((), device=run.device)
    reason, done = None, 0
    rng = rng_state()
    while done < accumulate and reason is None:
        # several ranks reduce gradients once per update: after its last micro-batch
        last = done + 1 == accumulate
        with distributed.grad_sync(run.step_model, run.ranks, sync=last), run.step.microbatch(last):
            loss, right, count = forward_backward(run, next(run.batches), 1.0 / accumulate)
        loss_sum += loss
        correct += right
        predicted += count
        done += 1
        run.progress.microbatches += 1
        reason = check_stop(run)
    if done < accumulate:
        run.optimizer.zero_grad(set_to_none=True)
        set_rng_state(rng)
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


def lr_factor(run: Run) -> float:
    """Multiplier of the peak learning rate for the update about to be applied."""
    schedule = LR_SCHEDULES[run.cfg.train.lr_schedule]
    if schedule.clock == "budget":
        progress = run.clock.fraction()
    else:
        progress = step_progress(run.progress.updates, run.cfg.train.steps)
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
        "skipped": run.step.stats.skipped,
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
    try:
        with open(run.metrics_file, "a", encoding="utf-8") as f:
            f.write(json.dumps(record) + "\n")
    except OSError as err:  # a full disk: stop with the last saved state kept (exit 4), not a traceback
        raise WriteFailed(f"could not append to {run.metrics_file}: {err}") from err
    if run.on_record is not None:
        run.on_record(record)


def open_reporting(run: Run, hooks: Sequence[EvalHook]) -> None:
    """The evaluation hooks (told how much of the budget a resumed run has spent)."""
    if hooks and run.ranks.active:
        raise ConfigError(
            "evaluation during pretraining (anytime) runs in a single process only; run without torchrun"
        )
    run.hooks = tuple(hooks)
    for hook in run.hooks:
        hook.start(run.clock.fraction())  # a resumed run does not repeat the fractions it passed


def run_hooks(run: Run) -> None:
    """Run each hook that is due on the current weights; the throughput figures leave its time out."""
    for hook in run.hooks:
        if hook.due(run.clock.fraction()):
            log_progress(run)  # closes the throughput window before the evaluation
            write_metrics(run, hook(run.model, run.clock, run.progress.updates))
            run.window = Window()


def close_reporting(run: Run, final: bool) -> None:
    """The evaluations due at the end of the budget (of the final model only)."""
    if final:
        run_hooks(run)


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
        "step": run.step.state_dict(),
        "progress": asdict(run.progress),
        "elapsed": elapsed,
        "rng": rng_state(),
        "arch": asdict(run.cfg.arch),
        "data_path": str(run.data.path),
        "data": run.data_identity,
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


def load_resume_state(cfg: PretrainConfig, run_dir: Path) -> dict | None:
    """The state this run continues from: the one in its own folder (a sweep job requeued by its launcher
    after a preemption or a time limit, checkpoint.own_state), else with resume=true the state of the newest
    run of this name that saved one."""
    path = checkpoint.own_state(run_dir)
    if path is None and not cfg.resume:
        return None
    for folder in (Path(cfg.base_dir) / cfg.name).glob("*/"):  # saves killed mid-write, in any run of it
        checkpoint.remove_stale_temporaries(folder)
    own = path is not None
    path = path or checkpoint.find_resumable_state(cfg.base_dir, cfg.name)
    if path is None:
        raise ConfigError(
            f"resume=true but no run named {cfg.name!r} under {cfg.base_dir} left a resumable state"
            f" ({checkpoint.STATE}); check `name` and `base_dir`, or start afresh with resume=false"
        )
    path, state = checkpoint.load_newest_state(path)  # falls back to state.prev.pt, with a warning
    if state.get("version") != STATE_VERSION:
        raise ConfigError(f"{path} has state version {state.get('version')}, this code reads {STATE_VERSION}")
    if not own:  # a requeued job that had finished only writes its final model again (train: steps_done)
        check_unfinished(cfg, state, path.parent)
    log.info(
        "resuming from %s: update %d, %.2fh of budget spent",
        path,
        state["progress"]["updates"],
        state["elapsed"] / 3600,
    )
    return state


def check_unfinished(cfg: PretrainConfig, state: dict, run_dir: Path) -> None:
    """resume=true continues a run that stopped early; one that ended by its own rule (its train.steps done,
    its budget spent) has nothing left to train, and another update would run at the schedule's end (lr 0)."""
    updates, spent = state["progress"]["updates"], state["elapsed"]
    if cfg.train.steps is not None and updates >= cfg.train.steps:
        done = f"did all train.steps={cfg.train.steps} updates"
        fix = "raise train.steps to train on"
    elif spent >= cfg.budget * 3600:
        done = f"spent its budget ({spent / 3600:.4g} h of budget={cfg.budget:g})"
        fix = "raise budget to train on"
    else:
        return
    raise ConfigError(
        f"resume=true: the run in {run_dir} already finished: it {done} in {updates} updates (its final model:"
        f" {run_dir / model_checkpoint.CHECKPOINT_DIR}). Nothing is left to resume; {fix}, or start afresh with"
        " resume=false"
    )


def restore(run: Run, state: dict) -> None:
    differ = arch_differences(state["arch"], asdict(run.cfg.arch))
    if differ:
        raise ConfigError(
            f"resume=true: the saved run's model differs from this config's ({'; '.join(differ)}). Resume"
            " with the saved run's settings, or start afresh with resume=false or another name"
        )
    distributed.load_full_state(run.model, run.optimizer, state["model"], state["optimizer"], run.ranks)
    progress = dict(state["progress"])
    # states written before the skip counters moved into the step's own state kept them in the progress
    legacy = {key: progress.pop(key) for key in ("skipped", "skipped_in_a_row") if key in progress}
    run.progress = Progress(**progress)
    run.step.load_state_dict({"stats": legacy, **state["step"]})
    set_rng_state(state["rng"])


def arch_differences(saved: dict, here: dict) -> list[str]:
    """'arch.<key>: <saved> there, <here> here' for each architecture setting that differs."""
    keys = sorted(saved.keys() | here.keys(), key=lambda key: (key == "name", key))  # the name last
    return [
        f"arch.{k}: {saved.get(k)!r} there, {here.get(k)!r} here" for k in keys if saved.get(k) != here.get(k)
    ]


def check_same_data(state: dict, here: dict, path: Path) -> None:
    """A resumed run continues on the rows and token ids it was trained on, or not at all: other ids would
    train the embeddings of other words (and another vocabulary size fails deep in load_state_dict)."""
    there = state.get("data")
    if there is None:  # a state from before the identity was saved: only its data folder is known
        if state["data_path"] == str(path):
            return
        differences = [f"data folder {state['data_path']} there, {path} here"]
    else:
        differences = [
            f"{key} {there.get(key)} there, {here[key]} here" for key in here if there.get(key) != here[key]
        ]
    if differences:
        raise ConfigError(
            f"resume=true: the saved run was trained on other data than this run's ({'; '.join(differences)})."
            f" Resume with the saved run's data config (its data_config.yaml is in {state['data_path']}),"
            " or start afresh with resume=false or another name"
        )


def rng_state() -> dict:
    """The torch RNG streams (dropout draws from them; masks do not: they are keyed by stream row)."""
    return {
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else [],
    }


def set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    if state["cuda"] and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def finish(run: Run, reason: str) -> TrainResult:
    """Save what the run leaves behind; the final model only when training ended by its own rule."""
    log_progress(run)
    log.info("stopping (%s) after %d updates, %s", reason, run.progress.updates, run.clock.describe())
    if run.progress.updates == 0 and reason not in STOP_SIGNALS:
        raise ConfigError(
            f"budget={run.cfg.budget:g} h ({run.clock.budget_seconds:.3g} s) ran out before the first update"
            f" ({run.clock.elapsed():.1f} s went to set-up): nothing was trained, so no model is saved. Give a"
            " budget that leaves time to train, e.g. budget=0.05 (3 minutes)"
        )
    save_resumable_state(run)
    elapsed = run.clock.elapsed()
    if reason in STOP_SIGNALS:
        distributed.barrier(run.ranks)  # every rank returns once rank 0's state is on disk
        close_reporting(run, final=False)
        return TrainResult(
            run.run_dir, reason, run.progress, elapsed, None, None, run.elapsed_before, run.step.stats.skipped
        )
    # the optimizer state measured from its tensors (as their sizes report it under FSDP2), and the peak memory
    state = optimizer_state_report(run.optimizer)
    write_metrics(run, {
        "update": run.progress.updates,
        "optimizer_state_bytes": state["state_bytes"],
        "optimizer_state_ratio_to_adamw": state["ratio_to_adamw_fp32"],
        "peak_memory_bytes": peak_memory_bytes(run.ranks.device),
    })  # fmt: skip
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
    return TrainResult(
        run.run_dir,
        reason,
        run.progress,
        elapsed,
        path,
        validation,
        run.elapsed_before,
        run.step.stats.skipped,
    )


@torch.no_grad()
def evaluate(run: Run) -> dict | None:
    """MLM loss and accuracy on the first train.validation_rows rows of the validation split, masked once
    with a fixed seed: the same rows and masks whatever the micro-batch size (which only sets how many rows
    go through the model at once), so runs compare."""
    rows = run.data.validation
    n = 0 if rows is None else min(run.cfg.train.validation_rows, len(rows))
    if n == 0:
        return None
    input_ids = torch.as_tensor(
        rows.with_format("numpy", columns=["input_ids"])[:n]["input_ids"], dtype=torch.long
    )
    special = run.data.special
    masker = MLMMasker(run.cfg.train.mlm, run.data.vocab_size, special.all, special.mask, seed=0)
    corrupted, labels = masker(input_ids, torch.arange(n))
    run.model.eval()
    loss, correct, predicted = mlm_totals(
        run.model, corrupted, labels, run.microbatch_size, run.step.autocast, run.predicted_per_row
    )
    validation = {"loss": loss / max(predicted, 1), "mlm_acc": correct / max(predicted, 1)}
    if run.cfg.train.context_diagnostic:
        diagnosis = context_use(run.model, masker, input_ids, run.microbatch_size, run.step.autocast)
        log.info(describe_context_use(diagnosis))
        validation |= {f"context_{key}": value for key, value in diagnosis.items() if key != "rows"}
    return validation
