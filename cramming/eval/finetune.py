"""Fine-tune a pretrained encoder on one GLUE task and evaluate it.

The classifier is `cramming.eval.head.SequenceClassifier` as `eval.head` configures it: by default cramming's
GLUE head (the final hidden state of [CLS], a 1024-wide dense layer with Tanh, dropout, a linear layer);
`eval.head.dim=0` is the bare linear layer on the pooled vector. It gives class logits, or one score for
STS-B (regression, mean-squared error).
Batches are padded only to their longest input. Each (task, seed) starts from a fresh copy of the
pretrained encoder (a `Backbone`: from a checkpoint, a `transformers` folder, or a model in memory).
Updates go through the one training step (cramming.optim.step) at a rate from the one schedule registry.
"""

from __future__ import annotations

import copy
import logging
import math
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import asdict, dataclass, field

import datasets
import numpy as np
import torch
import torch.nn.functional as F
from tokenizers import Tokenizer

from cramming.budget import BudgetClock
from cramming.errors import ConfigError, RunStopped
from cramming.eval.backbone import Backbone
from cramming.eval.config import EvalConfig
from cramming.eval.glue_metric import load_glue_metric
from cramming.eval.head import SequenceClassifier
from cramming.eval.tasks import GlueTask
from cramming.impl import ImplConfig
from cramming.optim import build_optimizer
from cramming.optim.config import OptimConfig
from cramming.optim.report import optimizer_state_report
from cramming.optim.schedules import LR_SCHEDULES, step_progress
from cramming.optim.step import TrainStep
from cramming.signals import StopSignals
from cramming.utils import peak_memory_bytes, per_second, seed_everything

log = logging.getLogger("cramming")


class EvaluationStopped(RunStopped):
    """A stop signal (SIGINT, SIGTERM, SIGUSR2: cramming.signals) ended the fine-tuning after an update.

    The runs finished before it are on disk (run_glue's glue_runs.json); the one under way is dropped."""

    def __init__(self, signal_name: str):
        super().__init__(signal_name, "fine-tuning stopped")


@dataclass
class Encoded:
    """A split tokenized once: token ids and segment ids per example, and the labels."""

    ids: list[list[int]]
    type_ids: list[list[int]]
    labels: np.ndarray

    def __len__(self) -> int:
        return len(self.ids)


def encode(
    split: datasets.Dataset, tokenizer: Tokenizer, max_length: int, limit: int | None, seed: int
) -> Encoded:
    """`[CLS] a [SEP]` or `[CLS] a [SEP] b [SEP]`, truncated to max_length; `limit` draws a random subset."""
    if limit is not None and limit < len(split):
        split = split.shuffle(seed=seed).select(range(limit))
    tokenizer = Tokenizer.from_str(tokenizer.to_str())  # a copy: truncation is a setting of the object
    tokenizer.enable_truncation(max_length)
    tokenizer.no_padding()
    pairs = [(a, b) if b else a for a, b in zip(split["text_a"], split["text_b"], strict=True)]
    encodings = tokenizer.encode_batch(pairs)
    return Encoded([e.ids for e in encodings], [e.type_ids for e in encodings], np.asarray(split["label"]))


def padded_batch(
    data: Encoded, index: np.ndarray, pad_id: int, device: torch.device
) -> dict[str, torch.Tensor]:
    """Pad the chosen examples to the longest of them."""
    longest = max(len(data.ids[i]) for i in index)
    ids = torch.full((len(index), longest), pad_id, dtype=torch.long)
    types = torch.zeros((len(index), longest), dtype=torch.long)
    mask = torch.zeros((len(index), longest), dtype=torch.bool)
    for row, i in enumerate(index):
        n = len(data.ids[i])
        ids[row, :n] = torch.tensor(data.ids[i])
        types[row, :n] = torch.tensor(data.type_ids[i])
        mask[row, :n] = True
    label_dtype = torch.float32 if data.labels.dtype.kind == "f" else torch.long
    return {
        "input_ids": ids.to(device),
        "token_type_ids": types.to(device),
        "attention_mask": mask.to(device),
        "labels": torch.as_tensor(data.labels[index], dtype=label_dtype).to(device),
    }


def task_loss(logits: torch.Tensor, labels: torch.Tensor, regression: bool) -> torch.Tensor:
    if regression:
        return F.mse_loss(logits.squeeze(-1).float(), labels)
    return F.cross_entropy(logits.float(), labels)


def batch_loss(
    model: SequenceClassifier, batch: dict[str, torch.Tensor], regression: bool
) -> tuple[torch.Tensor]:
    """The task loss of one padded batch: what the train step takes backward."""
    logits = model(batch["input_ids"], batch["attention_mask"], batch["token_type_ids"])
    return (task_loss(logits, batch["labels"], regression),)


@dataclass
class TaskResult:
    metrics: dict[str, dict[str, float]]  # entry name -> metric -> value
    train_examples: int
    steps: int
    seconds: float
    final_loss: float
    stopped_by_budget: bool
    # the training epochs alone (`seconds` also counts encoding and evaluation)
    train_seconds: float | None = None
    # measured after training, from the optimizer's own state tensors (cramming.optim.report)
    optimizer_state_bytes: int | None = None
    optimizer_state_ratio_to_adamw: float | None = None
    # on CUDA this run's peak of allocated GPU memory; on a CPU the process's peak resident memory so far
    # (monotone: an evaluation's peak is its last run's), see cramming.utils.peak_memory_bytes
    peak_memory_bytes: int | None = None
    # the mean training loss of each epoch (dropout on; a budget-stopped epoch: its updates so far): how well
    # the model fits the task's training set, which a longer-pretrained checkpoint can do worse at the same
    # recipe (results/cpu-study/)
    epoch_losses: list[float] | None = None


def finetune(
    task: GlueTask,
    splits: datasets.DatasetDict,
    backbone: Backbone,
    cfg: EvalConfig,
    impl: ImplConfig,
    seed: int,
    clock: BudgetClock | None = None,
    stop: StopSignals | None = None,
) -> TaskResult:
    """Fine-tune a fresh copy of `backbone` on `task` and evaluate every evaluation split.

    Raises EvaluationStopped after the update during which `stop` noted a stop signal (the run is dropped)."""
    start = time.perf_counter()
    device = impl.torch_device()
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    model = fresh_classifier(task, backbone, cfg, device, seed)
    _, lr, _ = cfg.for_task(task.name)
    length = backbone.input_length(cfg.max_length)
    train = encode(splits["train"], backbone.tokenizer, length, cfg.max_train_examples, seed)
    optimizer = build_optimizer(model, _with_lr(cfg, lr), max_grad_norm=cfg.grad_clip, scope="eval.optim")
    step = TrainStep(
        model, optimizer, device_type=device.type, dtype=impl.compute_dtype(device), grad_clip=cfg.grad_clip
    )
    loss_value, epoch_losses, stopped, train_seconds = train_epochs(
        model, step, train, task, backbone, cfg, seed, clock, stop
    )
    metrics = {
        task.entry_name(split): evaluate(model, task, splits[split or "dev"], backbone, cfg, seed)
        for split, _, _ in task.eval_splits
    }
    state = optimizer_state_report(optimizer)
    return TaskResult(
        metrics, len(train), step.stats.updates, time.perf_counter() - start, loss_value, stopped,
        train_seconds=train_seconds,
        optimizer_state_bytes=state["state_bytes"],
        optimizer_state_ratio_to_adamw=state["ratio_to_adamw_fp32"],
        peak_memory_bytes=peak_memory_bytes(device),
        epoch_losses=epoch_losses,
    )  # fmt: skip


def fresh_classifier(
    task: GlueTask, backbone: Backbone, cfg: EvalConfig, device: torch.device, seed: int
) -> SequenceClassifier:
    """eval.head on a fresh copy of the backbone's encoder, on `device`; `seed` draws the head's weights.
    eval.dropout, when set, replaces the checkpoint's dropout in the copy and the head."""
    seed_everything(seed)
    encoder = copy.deepcopy(backbone.encoder)
    dropout = backbone.dropout
    if cfg.dropout is not None:
        if not hasattr(encoder, "set_dropout"):
            raise ConfigError(
                f"eval.dropout={cfg.dropout}: this encoder ({type(encoder).__name__}) has no set_dropout, so its"
                " dropout cannot be changed here. Leave eval.dropout null; for a transformers folder, edit the"
                " dropout fields of its config.json instead"
            )
        encoder.set_dropout(cfg.dropout)
        dropout = cfg.dropout
    model = SequenceClassifier(encoder, backbone.hidden_size, task.num_labels, dropout, cfg.head)
    return model.to(device)


def train_epochs(
    model: SequenceClassifier,
    step: TrainStep,
    train: Encoded,
    task: GlueTask,
    backbone: Backbone,
    cfg: EvalConfig,
    seed: int,
    clock: BudgetClock | None,
    stop: StopSignals | None,
) -> tuple[float, list[float], bool, float]:
    """The task's epochs over `train`, one log line each, until `clock` (if any) runs out, and a warning for
    skipped updates: (last loss, each epoch's mean loss, stopped by the clock, seconds spent in the epochs).
    `seed` draws the order of the examples."""
    epochs, _, batch_size = cfg.for_task(task.name)
    schedule = LR_SCHEDULES[cfg.schedule]
    total = epochs * math.ceil(len(train) / batch_size)
    rng = np.random.default_rng(seed)
    loss_value, stopped, train_seconds = float("nan"), False, 0.0
    epoch_losses: list[float] = []
    model.train()
    for epoch in range(epochs):
        epoch_start = time.perf_counter()
        loss_value, mean_loss, stopped = train_epoch(
            model, step, train, epoch_order(train, batch_size, rng, cfg.group_by_length), batch_size,
            backbone.pad_id, task.is_regression,
            lambda updates: schedule.factor(step_progress(updates, total), cfg.warmup), clock, stop,
        )  # fmt: skip
        epoch_seconds = time.perf_counter() - epoch_start
        train_seconds += epoch_seconds
        epoch_losses.append(float(mean_loss))
        log.info(
            "%s seed %d epoch %d/%d: loss %.4f, %s examples/s%s",
            task.name, seed, epoch + 1, epochs, mean_loss, per_second(len(train) / max(epoch_seconds, 1e-9)),
            " (eval budget spent: stopping here)" if stopped else "",
        )  # fmt: skip
        if stopped:
            break
    warn_skipped_updates(task, seed, step)
    return loss_value, epoch_losses, stopped, train_seconds


def warn_skipped_updates(task: GlueTask, seed: int, step: TrainStep) -> None:
    """Say how many updates the training step skipped for a non-finite loss or gradient, if any."""
    if step.stats.skipped:
        log.warning(
            "%s seed %d: %d updates skipped for a non-finite loss or gradient",
            task.name,
            seed,
            step.stats.skipped,
        )


# with eval.group_by_length, examples are sorted by length within windows of this many batches
LENGTH_WINDOW_BATCHES = 50


def epoch_order(
    train: Encoded, batch_size: int, rng: np.random.Generator, group_by_length: bool
) -> np.ndarray:
    """The order of one epoch: a random permutation; grouped by length, each window of
    LENGTH_WINDOW_BATCHES batches of that permutation is sorted by length and cut into batches, which are then
    shuffled. Batches pad to their longest input, so grouping cuts the padded tokens (on SST-2 about in half)
    while every batch still comes from a random part of the data."""
    order = rng.permutation(len(train))
    if not group_by_length:
        return order
    lengths = np.array([len(ids) for ids in train.ids])
    window = batch_size * LENGTH_WINDOW_BATCHES
    chunks = [order[i : i + window] for i in range(0, len(order), window)]
    chunks = [chunk[np.argsort(-lengths[chunk], kind="stable")] for chunk in chunks]
    batches = [chunk[i : i + batch_size] for chunk in chunks for i in range(0, len(chunk), batch_size)]
    # only the last window can end in a short batch: it stays last, so train_epoch's slices of batch_size
    # cut exactly these batches
    full = [b for b in batches if len(b) == batch_size]
    short = [b for b in batches if len(b) < batch_size]
    return np.concatenate([full[i] for i in rng.permutation(len(full))] + short)


def train_epoch(
    model: SequenceClassifier,
    step: TrainStep,
    train: Encoded,
    order: np.ndarray,
    batch_size: int,
    pad_id: int,
    regression: bool,
    lr_factor: Callable[[int], float],
    clock: BudgetClock | None,
    stop: StopSignals | None = None,
) -> tuple[float, float, bool]:
    """One pass over `train` in `order`: (last loss, mean loss, stopped by the clock). Raises
    EvaluationStopped after an update during which `stop` noted a signal."""
    device = next(model.parameters()).device
    loss_value, loss_sum, seen = float("nan"), 0.0, 0
    for first in range(0, len(order), batch_size):
        batch = padded_batch(train, order[first : first + batch_size], pad_id, device)
        step.begin(lr_factor(step.stats.updates))
        step.microbatch(batch_loss, model, batch, regression)
        loss_value = step.apply().loss.item()
        loss_sum += loss_value * len(batch["labels"])
        seen += len(batch["labels"])
        if stop is not None and stop.received:
            raise EvaluationStopped(stop.received)
        if clock is not None and clock.expired():
            return loss_value, loss_sum / max(1, seen), True
    return loss_value, loss_sum / max(1, seen), False


def _with_lr(cfg: EvalConfig, lr: float) -> OptimConfig:
    """eval.optim at a task's learning rate (eval.per_task may change it)."""
    return OptimConfig(**{**asdict(cfg.optim), "lr": lr})


@dataclass
class GlueRuns:
    """Every (task, seed) fine-tuned on one backbone: metrics per entry, one record per run."""

    per_entry: dict[str, list[dict[str, float]]] = field(default_factory=dict)
    runs: list[dict] = field(default_factory=list)
    not_run: list[str] = field(default_factory=list)  # tasks not started: the budget was spent


def finetune_tasks(
    jobs: Iterable[tuple[GlueTask, datasets.DatasetDict]],
    backbone: Backbone,
    cfg: EvalConfig,
    impl: ImplConfig,
    seeds: list[int],
    clock: BudgetClock | None = None,
    done: Mapping[tuple[str, int], dict] | None = None,
    on_run: Callable[[dict], None] | None = None,
    stop: StopSignals | None = None,
) -> GlueRuns:
    """Fine-tune `backbone` on each task with each seed, until `clock` (if any) runs out.

    A (task, seed) found in `done` (the records of an earlier evaluation: resume=true) is taken from there
    instead of fine-tuned again. `on_run` gets every record as soon as it is there, so that an evaluation
    cut short keeps what it finished. A stop signal noted by `stop` ends it with EvaluationStopped after the
    current update: the runs finished before it have gone to `on_run`, the one under way is dropped.
    """
    out = GlueRuns()
    for task, splits in jobs:
        if clock is not None and clock.expired():
            out.not_run.append(task.name)
            continue
        for seed in seeds:
            record = (done or {}).get((task.name, seed))
            if record is None:
                if stop is not None and stop.received:
                    raise EvaluationStopped(stop.received)
                result = finetune(task, splits, backbone, cfg, impl, seed, clock, stop=stop)
                record = {"task": task.name, "seed": seed} | asdict(result)
            for entry, metrics in record["metrics"].items():
                out.per_entry.setdefault(entry, []).append(metrics)
                log.info(
                    "%s seed %d: %s%s", entry, seed, ", ".join(f"{k} {100 * v:.2f}" for k, v in metrics.items()),
                    f" (reused from {record['reused_from']})" if "reused_from" in record else "",
                )  # fmt: skip
            out.runs.append(record)
            if on_run is not None:
                on_run(record)
            if record["stopped_by_budget"]:
                break
    return out


@torch.no_grad()
def evaluate(
    model: SequenceClassifier, task: GlueTask, split: datasets.Dataset, backbone: Backbone, cfg: EvalConfig,
    seed: int,
) -> dict[str, float]:  # fmt: skip
    device = next(model.parameters()).device
    data = encode(
        split, backbone.tokenizer, backbone.input_length(cfg.max_length), cfg.max_eval_examples, seed
    )
    model.eval()
    predictions = []
    # longest first: batches of similar length pad little
    order = np.argsort([-len(x) for x in data.ids], kind="stable")
    for first in range(0, len(order), 4 * cfg.batch_size):
        index = order[first : first + 4 * cfg.batch_size]
        batch = padded_batch(data, index, backbone.pad_id, device)
        logits = model(batch["input_ids"], batch["attention_mask"], batch["token_type_ids"]).float()
        predictions.append(logits.squeeze(-1) if task.is_regression else logits.argmax(-1))
    model.train()
    pred = torch.cat(predictions).cpu().numpy()
    unsorted = np.empty_like(pred)
    unsorted[order] = pred
    metric = load_glue_metric(task.hub_config)
    return metric.compute(predictions=unsorted.tolist(), references=data.labels.tolist())
