"""The training loop on synthetic rows: the budget stop rule (fake clock), accumulation, step limit, non-finite
losses, stop signals, logs and metrics."""

from __future__ import annotations

import json
import logging
import os
import signal
from pathlib import Path

import datasets
import numpy as np
import pytest
import torch
from hydra import compose, initialize_config_dir
from tokenizers import Tokenizer
from tokenizers.models import WordLevel

from cramming.budget import BudgetClock, budget_clock
from cramming.config import CONF_DIR, PretrainConfig, register_configs, validate
from cramming.data import PretrainingData
from cramming.errors import TrainingDiverged
from cramming.train import loop
from cramming.train.mlm import MLMObjective

VOCAB = 200
SEQ = 32


def make_config(base_dir: Path, *overrides: str) -> PretrainConfig:
    """The real YAML recipe with arch=tiny, sized for a CPU test."""
    register_configs()
    defaults = [
        "arch=tiny",
        "data=embedded",
        f"data.seq_length={SEQ}",
        f"base_dir={base_dir}",
        "name=test",
        "impl.device=cpu",
        "impl.precision=fp32",  # the same numbers on every CPU (auto is bf16 on CPUs with native bf16)
        "impl.microbatch_size=8",
        "impl.num_workers=0",
        "train.batch_size=8",
        "train.log_every=5",
        "train.validation_rows=16",
    ]
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        return validate(compose("pretrain", overrides=[*defaults, *overrides]))


def synthetic_data(path: Path, rows: int = 256) -> PretrainingData:
    """Rows of tokens drawn from a Zipf distribution, [CLS] first: a model that learns anything at all
    (the unigram frequencies, first) gets its loss well below log(vocab)."""
    rng = np.random.default_rng(0)
    ranks = np.arange(1, VOCAB - 4)
    p = 1.0 / ranks**1.1
    ids = 5 + rng.choice(VOCAB - 5, size=(rows, SEQ), p=p / p.sum())
    ids[:, 0] = 2
    vocab = {tok: i for i, tok in enumerate(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"])}
    vocab.update({f"w{i}": i for i in range(5, VOCAB)})
    train = datasets.Dataset.from_dict({"input_ids": ids.astype(np.uint16)})
    validation = datasets.Dataset.from_dict({"input_ids": ids[:16].astype(np.uint16)})
    tokenizer = Tokenizer(WordLevel(vocab, unk_token="[UNK]"))
    return PretrainingData(path, train, validation, tokenizer, SEQ, stats={})


class FakeClock:
    """Time that moves only when a micro-batch runs: `tick` seconds each."""

    def __init__(self, tick: float):
        self.now, self.tick = 1000.0, tick

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def fake_clock(monkeypatch):
    """A FakeClock advanced by every forward/backward of the loop."""
    clock = FakeClock(tick=60.0)
    original = MLMObjective.__call__

    def timed(self, model, batch):
        clock.now += clock.tick
        return original(self, model, batch)

    monkeypatch.setattr(MLMObjective, "__call__", timed)
    return clock


def run_dir(cfg: PretrainConfig, stamp: str = "2026-01-01_00-00-00") -> Path:
    return Path(cfg.base_dir) / cfg.name / stamp


def read_metrics(path: Path) -> list[dict]:
    return [json.loads(line) for line in (path / "metrics.jsonl").read_text().splitlines()]


def test_budget_clock_stop_rule():
    now = [0.0]
    clock = BudgetClock(0.5, clock=lambda: now[0], elapsed_before=600.0)
    now[0] = 1200.0  # 600 s before + 1200 s now = exactly the budget: not yet over
    assert clock.elapsed() == 1800.0 and clock.fraction() == 1.0 and not clock.expired()
    now[0] = 1200.5
    assert clock.expired()


def test_stop_reason_puts_a_signal_before_the_budget():
    """One process: the signal it received wins over a spent budget (it names why the run stopped), and the
    budget alone stops it once spent; budget_clock gives a plain clock without an active process group."""
    now = [0.0]
    clock = budget_clock(1 / 3600, lambda: now[0])
    assert type(clock) is BudgetClock
    assert clock.stop_reason(None) is None and clock.stop_reason("SIGTERM") == "SIGTERM"
    now[0] = 1.5
    assert clock.stop_reason(None) == "budget" and clock.stop_reason("SIGINT") == "SIGINT"


def test_stops_after_the_microbatch_that_passes_the_budget(tmp_path, fake_clock):
    # 0.1 h = 360 s at 60 s per micro-batch: the 6th ends at exactly 360 s (not over), the 7th passes it
    cfg = make_config(tmp_path, "budget=0.1")
    result = loop.train(cfg, synthetic_data(tmp_path), run_dir(cfg), clock=fake_clock)
    assert result.stop_reason == "budget"
    assert (result.progress.microbatches, result.updates) == (7, 7)
    assert result.elapsed == pytest.approx(420.0)
    assert result.checkpoint is not None and (result.checkpoint / "model.safetensors").is_file()


def test_update_cut_short_by_the_budget_is_dropped(tmp_path, fake_clock):
    # 4 micro-batches per update: update 1 = micro-batches 1-4; 5-7 are cut off by the budget at the 7th
    cfg = make_config(tmp_path, "budget=0.1", "train.batch_size=32", "train.batch_size_ramp=0")
    result = loop.train(cfg, synthetic_data(tmp_path), run_dir(cfg), clock=fake_clock)
    assert (result.progress.microbatches, result.updates, result.progress.rows) == (7, 1, 32)


def test_batch_size_ramps_with_the_budget(tmp_path, fake_clock):
    # 100 micro-batches in the budget; the batch grows from 1 to 4 micro-batches by 50% of it
    fake_clock.tick = 36.0
    cfg = make_config(
        tmp_path, "budget=1", "train.batch_size=32", "train.batch_size_ramp=0.5", "train.log_every=1",
        "train.batch_size_start=8",  # the ramp is defined in sequences: here from one micro-batch
    )  # fmt: skip
    loop.train(cfg, synthetic_data(tmp_path), run_dir(cfg), clock=fake_clock)
    batches = [r["batch_size"] for r in read_metrics(run_dir(cfg)) if "batch_size" in r]
    assert batches[0] == 8 and batches[-1] == 32
    assert batches == sorted(batches)


def test_steps_limit_and_loss_falls(tmp_path):
    cfg = make_config(
        tmp_path,
        "budget=1",
        "train.steps=60",
        "train.lr_schedule=steps-linear",
        "train.warmup=0.1",
        "train.log_every=10",
    )
    result = loop.train(cfg, synthetic_data(tmp_path), run_dir(cfg))
    assert result.stop_reason == "steps" and result.updates == 60
    losses = [r["loss"] for r in read_metrics(run_dir(cfg)) if "loss" in r]
    assert losses[-1] < losses[0] - 1.0, losses
    assert result.validation["loss"] < losses[0] - 1.0


def test_log_line_and_metrics_record(tmp_path, caplog):
    cfg = make_config(tmp_path, "budget=1", "train.steps=5", "train.lr_schedule=steps-linear")
    with caplog.at_level(logging.INFO, logger="cramming"):
        loop.train(cfg, synthetic_data(tmp_path), run_dir(cfg))
    assert "model tiny:" in caplog.text and "M parameters" in caplog.text
    line = next(r.message for r in caplog.records if r.message.startswith("update 5 "))
    for part in ("loss", "mlm acc", "lr", "seq/s", "tok/s", "h / 1.00h", "ends"):
        assert part in line
    records = read_metrics(run_dir(cfg))
    assert [r["update"] for r in records if "loss" in r] == [1, 5]
    keys = {"loss", "mlm_acc", "lr", "seq_per_s", "tok_per_s", "elapsed_h", "budget_fraction", "batch_size"}
    assert keys <= records[-3].keys()
    memory = records[-2]  # measured at the end: AdamW holds two fp32 moments per parameter
    assert memory["optimizer_state_ratio_to_adamw"] == 1.0 and memory["optimizer_state_bytes"] > 0
    assert memory["peak_memory_bytes"] > 0
    assert "val_loss" in records[-1]


def test_rates_below_one_a_second_do_not_read_as_zero():
    from cramming.utils import per_second

    # crammed-bert on a CPU: 0.146 sequences/s, which the log line used to print as "0 seq/s"
    assert (per_second(0.146), per_second(18.68), per_second(50432.6)) == ("0.146", "18.7", "50433")


def test_nonfinite_loss_skips_the_update_then_stops(tmp_path, monkeypatch):
    original = MLMObjective.__call__
    poisoned = {3}  # micro-batches (1-based) whose loss is NaN
    calls = [0]

    def nan_sometimes(self, model, batch):
        calls[0] += 1
        loss, right, count = original(self, model, batch)
        return (loss * float("nan") if calls[0] in poisoned else loss), right, count

    monkeypatch.setattr(MLMObjective, "__call__", nan_sometimes)
    cfg = make_config(tmp_path, "budget=1", "train.steps=5", "train.lr_schedule=steps-linear")
    result = loop.train(cfg, synthetic_data(tmp_path), run_dir(cfg))
    # one counter: train.steps counts finished updates, the skipped one among them
    assert (result.updates, result.skipped, result.progress.microbatches) == (5, 1, 5)

    poisoned.update(range(4, 100))
    calls[0] = 0
    cfg = make_config(tmp_path, "budget=1", "train.max_nonfinite_updates=3")
    with pytest.raises(TrainingDiverged, match="3 updates in a row"):
        loop.train(cfg, synthetic_data(tmp_path), run_dir(cfg, "2026-01-01_00-00-01"))


def send_signal_after(monkeypatch, microbatches: int, signum: int) -> None:
    """Make the loop receive `signum` during its `microbatches`-th micro-batch."""
    original = MLMObjective.__call__
    calls = [0]

    def signalling(self, model, batch):
        calls[0] += 1
        if calls[0] == microbatches:
            os.kill(os.getpid(), signum)
        return original(self, model, batch)

    monkeypatch.setattr(MLMObjective, "__call__", signalling)


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM, signal.SIGUSR2])  # USR2: SLURM's warning
def test_stop_signal_saves_a_resumable_state(tmp_path, monkeypatch, signum):
    send_signal_after(monkeypatch, 4, signum)
    previous = signal.getsignal(signum)
    cfg = make_config(tmp_path, "budget=1")
    result = loop.train(cfg, synthetic_data(tmp_path), run_dir(cfg))
    assert result.stop_reason == signal.Signals(signum).name
    assert result.checkpoint is None
    assert result.progress.microbatches == 4 and result.updates == 4
    assert (run_dir(cfg) / "state.pt").is_file()
    assert signal.getsignal(signum) is previous  # handlers restored


def test_a_run_started_again_in_its_own_folder_continues_without_resume(tmp_path, monkeypatch):
    """What a sweep job requeued after a time limit does: the state in its own folder is its own, so it
    continues from it (resume=false); a run in a new folder starts afresh."""
    send_signal_after(monkeypatch, 4, signal.SIGUSR2)
    cfg = make_config(tmp_path, "budget=1", "train.steps=6")
    data = synthetic_data(tmp_path)
    first = loop.train(cfg, data, run_dir(cfg))
    assert first.stop_reason == "SIGUSR2" and first.updates == 4 and not cfg.resume
    again = loop.train(cfg, data, run_dir(cfg))
    assert again.stop_reason == "steps" and again.updates == 6
    assert 0 < again.elapsed_before <= first.elapsed  # the budget counts on from the saved state
    # each process logs its first update, so its first record covers its set-up and one update only (the run
    # card's split of set-up and training time reads it so)
    assert [r["update"] for r in read_metrics(run_dir(cfg)) if "loss" in r] == [1, 4, 5, 6]
    fresh = loop.train(cfg, data, run_dir(cfg, "2026-01-01_00-10-00"))
    assert fresh.elapsed_before == 0.0 and fresh.updates == 6


def test_config_checks_across_groups(tmp_path):
    from cramming.errors import ConfigError

    with pytest.raises(ConfigError, match="data.seq_length"):
        make_config(tmp_path, "data.seq_length=256")  # arch tiny covers 128 positions
    with pytest.raises(ConfigError, match="train.steps"):
        make_config(tmp_path, "train.lr_schedule=steps-linear")  # a step schedule needs a step count
    cfg = make_config(tmp_path)
    assert cfg.impl.compute_dtype(torch.device("cpu")) == torch.float32


def test_row_stream_order_and_resume(tmp_path):
    from cramming.train.batches import RowStream

    rows = datasets.Dataset.from_dict(
        {"input_ids": np.arange(10, dtype=np.uint16)[:, None].repeat(4, axis=1)}
    )
    stream = RowStream(rows, microbatch_size=4, seed=0)
    seen = torch.cat([stream[i][:, 0] for i in range(5)]).tolist()  # 20 rows: two epochs
    assert seen[:10] == list(range(10))  # the stored order first (it may be a curriculum)
    assert sorted(seen[10:]) == list(range(10)) and seen[10:] != list(range(10))  # then a permutation
    # a stream resumed at row 6 with another micro-batch size continues with exactly the same rows
    resumed = RowStream(rows, microbatch_size=7, seed=0, start=6)
    assert torch.cat([resumed[0][:, 0], resumed[1][:, 0]]).tolist()[:14] == seen[6:20]
    assert stream[0].dtype == torch.int64


def test_the_microbatch_size_changes_no_result(tmp_path):
    """impl is speed only: micro-batches of 8 and 16 (batch 32, steps schedule) train on the same rows with
    the same masks and are validated on the same rows, so the runs agree up to float summation order (the
    gradient of an update is summed over 4 or 2 micro-batches). Before masks were keyed by stream row, the
    masks followed the micro-batch split and the losses differed in the second decimal."""
    results = []
    for microbatch in (8, 16):
        cfg = make_config(
            tmp_path / str(microbatch), f"impl.microbatch_size={microbatch}", "train.batch_size=32",
            "train.batch_size_ramp=0", "train.steps=6", "train.lr_schedule=steps-linear",
        )  # fmt: skip
        results.append(loop.train(cfg, synthetic_data(tmp_path / f"data{microbatch}"), run_dir(cfg)))
    eight, sixteen = results
    assert eight.progress.rows == sixteen.progress.rows == 6 * 32
    assert eight.updates == sixteen.updates == 6
    # fp32 sums in another order: relative differences of ~1e-7 per operation, a few hundred operations deep
    assert eight.validation["loss"] == pytest.approx(sixteen.validation["loss"], rel=1e-4)
    assert eight.validation["mlm_acc"] == pytest.approx(sixteen.validation["mlm_acc"], abs=1.5 / (16 * 8))


def test_bf16_autocast_on_cpu(tmp_path):
    """impl.precision=bf16 runs the GPU's autocast path on the CPU (PyTorch backends: the Triton interpreter
    computes bf16 wrongly): the loss falls and the weights stay fp32 and finite."""
    cfg = make_config(
        tmp_path,
        "impl.precision=bf16",
        "train.steps=30",
        "train.log_every=1",
        "train.lr_schedule=steps-linear",
    )
    result = loop.train(cfg, synthetic_data(tmp_path / "data"), run_dir(cfg))
    losses = [r["loss"] for r in read_metrics(run_dir(cfg)) if "loss" in r]
    assert result.updates == 30 and result.skipped == 0
    assert sum(losses[-5:]) / 5 < losses[0] - 0.5  # from ~log(200) = 5.3
    from cramming.model.checkpoint import load_pretrained

    weights = list(load_pretrained(result.checkpoint).model.parameters())
    assert all(p.dtype == torch.float32 and torch.isfinite(p).all() for p in weights)


@pytest.mark.slow
def test_compiled_training_on_cpu(tmp_path):
    """impl.compile=true on CPU (inductor): the loss falls, and the checkpoint's keys carry no _orig_mod."""
    cfg = make_config(
        tmp_path, "impl.compile=true", "train.steps=30", "train.log_every=1", "train.lr_schedule=steps-linear"
    )
    result = loop.train(cfg, synthetic_data(tmp_path / "data"), run_dir(cfg))
    losses = [r["loss"] for r in read_metrics(run_dir(cfg)) if "loss" in r]
    assert sum(losses[-5:]) / 5 < losses[0] - 0.5
    from safetensors import safe_open

    with safe_open(str(result.checkpoint / "model.safetensors"), "pt") as f:
        keys = list(f.keys())
    assert keys and not any("_orig_mod" in k for k in keys)


def test_due_evaluations_follow_a_closed_throughput_window(tmp_path, fake_clock):
    """The loop runs each evaluation hook once it is due, on the current weights, after logging the updates
    since the last record (so no throughput figure counts an evaluation's time); a hook never due is not
    run."""

    class Hook:
        def __init__(self, at: float):
            self.at, self.calls, self.started = at, [], None

        def start(self, fraction_done: float) -> None:
            self.started = fraction_done

        def due(self, fraction: float) -> bool:
            return fraction >= self.at and not self.calls

        def __call__(self, model, clock, update, tokens) -> dict:
            self.calls.append((update, tokens))
            return {"update": update, "hook": self.at}

    # 0.1 h = 360 s at 60 s a micro-batch (one per update here): the early hook is due after update 2, the
    # late one after update 5; the third never
    early, late, never = Hook(0.25), Hook(0.75), Hook(2.0)
    cfg = make_config(tmp_path, "budget=0.1", "train.log_every=100")
    result = loop.train(
        cfg, synthetic_data(tmp_path), run_dir(cfg), clock=fake_clock, hooks=[early, late, never]
    )
    assert (early.started, late.started) == (0.0, 0.0)
    assert early.calls == [(2, 2 * 8 * SEQ)] and late.calls == [(5, 5 * 8 * SEQ)] and never.calls == []
    records = [r for r in read_metrics(result.run_dir) if "loss" in r or "hook" in r]
    shown = [("hook" in r, r["update"]) for r in records]
    assert shown[:5] == [(False, 1), (False, 2), (True, 2), (False, 5), (True, 5)]
