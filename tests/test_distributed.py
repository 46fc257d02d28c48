"""Multi-process pretraining (cramming.train.parallel): one torchrun launch of 2 CPU processes (gloo) runs
the scenarios of tests/distributed_worker.py (DDP, 8-bit AdamW and GaLore under DDP, FSDP2; a step-limited run,
a fake-clock budget run, an interrupted one resumed in the same mode and in the other); the tests read what
each rank recorded. One more launch runs pretrain.py itself. The unit tests at the end need no second process.

"Same data" for 2 ranks x micro-batch b and 1 rank x 2b holds by construction: rank r trains on slice r of
the global micro-batch of 2b stream rows, and masks it with the random draws one process would use for
those rows (every rank draws for the global micro-batch and keeps its slice). So the two runs see the same
rows with the same masks, and the mean of the ranks' mean losses is the one process's mean loss (count
masking: every row has the same number of masked tokens). What remains is float rounding.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import logging
import os
import shutil
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from test_train import FakeClock, make_config, read_metrics, run_dir, synthetic_data

from cramming.errors import ConfigError
from cramming.model import build_model
from cramming.model import checkpoint as model_checkpoint
from cramming.optim import (
    AdamW,
    LeanOptimizer,
    build_optimizer,
    format_state_report,
    optimizer_state_report,
    reshard,
)
from cramming.ranks import Ranks, init_from_env
from cramming.train import loop
from cramming.train import state as train_state
from cramming.train.batches import RowStream, numbered
from cramming.train.mlm import MLMMasker, MLMObjective
from cramming.train.parallel import Parallel
from cramming.utils import seed_everything

REPO = Path(__file__).resolve().parent.parent
WORKER = Path(__file__).resolve().parent / "distributed_worker.py"
MODES = ("ddp", "fsdp2")
LOWBIT_OPTIMIZERS = ("adamw", "adamw_8bit", "adamw_4bit")  # as in the worker's `lowbit` scenario
LOWBIT_ARCH = "arch.intermediate_size=202"  # likewise: shards that end inside quantization blocks
GALORE_SETTINGS = ("train.optim.rank=8", "train.optim.update_proj_gap=10")  # as in the worker's `galore`


def torchrun(out: Path, *scenarios: str) -> list[dict]:
    """`torchrun --nproc_per_node=2` of the worker's scenarios; returns each rank's record."""
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run(
        [*command, str(WORKER), str(out), *scenarios],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-6000:]
    return [json.loads((out / f"rank{rank}.json").read_text()) for rank in range(2)]


@pytest.fixture(scope="module")
def launched(tmp_path_factory) -> tuple[Path, list[dict]]:
    """One launch of every scenario on the CPU; the output folder and each rank's record."""
    out = tmp_path_factory.mktemp("torchrun")
    return out, torchrun(out, "ddp", "optimizers", "fsdp2")


def losses(path: str | Path) -> list[float]:
    return [r["loss"] for r in read_metrics(Path(path)) if "loss" in r]


def final_weights(path: str | Path) -> dict[str, torch.Tensor]:
    return model_checkpoint.load_pretrained(path).model.state_dict()


@pytest.mark.slow
@pytest.mark.parametrize("scenario", ["ddp", "adamw_8bit", "galore_adamw", "fsdp2"])
def test_parameters_identical_across_ranks_after_every_update(launched, scenario):
    _, ranks = launched
    for record in ranks:
        run = record[scenario]
        assert run["reason"] == "steps"
        # the largest |parameter - rank 0's parameter| after each update
        assert run["differences"] == [0.0] * run["progress"]["updates"], (scenario, run["differences"])


@pytest.mark.slow
def test_gradients_are_reduced_once_per_update(launched):
    _, ranks = launched
    for record in ranks:
        run = record["ddp"]
        # 32 sequences per update = 2 global micro-batches of 2 x 8: no all-reduce on the first of each
        assert run["progress"] == {**run["progress"], "updates": 4, "microbatches": 8, "rows": 128}
        assert run["allreduces"] == [0, 1] * 4


def single_vocab(tmp_path) -> int:
    return synthetic_data(tmp_path / "vocab").vocab_size


@pytest.mark.slow
def test_two_ranks_match_one_rank_with_twice_the_microbatch(launched, tmp_path):
    _, ranks = launched
    cfg = make_config(
        tmp_path,
        "name=single",
        "budget=1",
        "train.steps=4",
        "train.lr_schedule=steps-linear",
        "train.warmup=0.25",
        "train.batch_size=32",
        "train.batch_size_ramp=0",
        "train.log_every=1",
        "impl.microbatch_size=16",
    )
    single = loop.train(cfg, synthetic_data(tmp_path), run_dir(cfg))
    expected, weights = losses(single.run_dir), final_weights(single.checkpoint)
    seed_everything(cfg.seed)  # the loop's initialization: the same seed, the same draws
    initial = build_model(cfg.arch, single_vocab(tmp_path), dropout=cfg.train.dropout).state_dict()
    for mode in MODES:
        run = ranks[0][mode]
        torch.testing.assert_close(losses(run["run_dir"]), expected, rtol=1e-5, atol=0, msg=mode)
        theirs = final_weights(run["checkpoint"])
        # The gradients differ only in summation order (~1e-7 relative), but AdamW divides by sqrt(v): an
        # element whose gradient is near zero can take a step of another size or sign. So compare each
        # tensor's difference with how far training moved it: rounding keeps it a small fraction of that.
        for key, value in weights.items():
            moved = (value - initial[key]).norm()
            assert (theirs[key] - value).norm() <= 1e-3 * moved + 1e-7, f"{mode}: {key}"


@pytest.mark.slow
@pytest.mark.parametrize("mode", MODES)
def test_budget_stops_every_rank_after_the_same_microbatch(launched, mode):
    _, ranks = launched
    # budget 360 s. Rank 0's fake clock: 60 s a micro-batch, past the budget at the 7th. Rank 1's own clock
    # (20 s each) would run to the 19th: rank 0's decides for both.
    for record in ranks:
        run = record[f"{mode}_budget"]["reference"]
        assert run["reason"] == "budget"
        assert (run["progress"]["microbatches"], run["progress"]["updates"]) == (7, 3)  # the 4th cut short
        assert run["elapsed"] == pytest.approx(420.0)
    # both ranks' schedules read rank 0's budget fraction when each update starts, 0, 1/3 and 2/3 (triangle2:
    # 25% of the 1e-3 peak rising to it at 75%); rank 1's own clock would have said 0, 1/9, 2/9. (The rate is
    # set before the update's backward: a layerwise optimizer steps inside it.)
    for record in ranks:
        assert record[f"{mode}_budget"]["reference"]["lr"] == pytest.approx(
            [1e-3 * 3 / 12, 1e-3 * 7 / 12, 1e-3 * 11 / 12]
        )


@pytest.mark.slow
@pytest.mark.parametrize("mode", MODES)
def test_save_and_resume_with_two_ranks_gives_the_same_next_step(launched, mode):
    _, ranks = launched
    for record in ranks:
        runs = record[f"{mode}_budget"]
        # SIGINT reached rank 1 alone, during its 4th micro-batch: both ranks stopped after it
        interrupted = runs["interrupted"]
        assert interrupted["reason"] == "SIGINT" and interrupted["checkpoint"] is None
        assert (interrupted["progress"]["microbatches"], interrupted["progress"]["updates"]) == (4, 2)
        assert interrupted["elapsed"] == pytest.approx(240.0)
        assert runs["resumed"]["progress"] == runs["reference"]["progress"]
        assert runs["resumed"]["elapsed"] == pytest.approx(420.0)
    runs = ranks[0][f"{mode}_budget"]
    reference = read_metrics(Path(runs["reference"]["run_dir"]))
    resumed = read_metrics(Path(runs["resumed"]["run_dir"]))
    assert resumed[0]["update"] == 3 and resumed[0]["loss"] == reference[2]["loss"]
    ours, theirs = (
        final_weights(runs["resumed"]["checkpoint"]),
        final_weights(runs["reference"]["checkpoint"]),
    )
    for key, value in theirs.items():
        torch.testing.assert_close(ours[key], value, rtol=0, atol=0, msg=key)


@pytest.mark.slow
@pytest.mark.parametrize("mode", MODES)
def test_a_state_saved_in_one_mode_resumes_in_the_other(launched, mode):
    # one state format: plain keys, whole tensors, optimizer state by index (FSDP2's gathered and converted)
    _, ranks = launched
    runs = ranks[0][f"{mode}_budget"]
    assert runs["crossed_interrupted"]["progress"]["updates"] == 2
    assert runs["crossed"]["progress"] == runs["reference"]["progress"]
    ours, theirs = (
        final_weights(runs["crossed"]["checkpoint"]),
        final_weights(runs["reference"]["checkpoint"]),
    )
    for key, value in theirs.items():  # DDP's all-reduce and FSDP2's reduce-scatter round differently
        torch.testing.assert_close(ours[key], value, rtol=1e-5, atol=1e-6, msg=key)


@pytest.mark.slow
@pytest.mark.parametrize("mode", MODES)
def test_rank_zero_writes_plain_checkpoints_and_one_metrics_record_per_update(launched, mode):
    _, ranks = launched
    run = ranks[0][mode]
    assert ranks[1][mode]["checkpoint"] == run["checkpoint"]
    with safe_open(str(Path(run["checkpoint"]) / model_checkpoint.WEIGHTS), "pt") as f:
        keys = list(f.keys())
    assert keys and not any(k.startswith(("module.", "_orig_mod.")) or "._fsdp" in k for k in keys), keys
    state = train_state.load_state(Path(run["run_dir"]) / train_state.STATE)
    assert set(state["model"]) == set(final_weights(run["checkpoint"]))
    assert state["model"]["encoder.embeddings.position.scale"].shape == ()  # not FSDP2's 1-element copy
    assert all(isinstance(index, int) for index in state["optimizer"]["state"])  # one format for all modes
    records = [r["update"] for r in read_metrics(Path(run["run_dir"])) if "loss" in r]
    assert records == [1, 2, 3, 4]


@pytest.mark.slow
def test_fp16_under_fsdp2_and_a_batch_the_ranks_cannot_share_are_refused(launched):
    _, ranks = launched
    for record in ranks:
        assert "impl.precision=bf16" in record["fsdp2_fp16_error"]
        # the batch is global: 8 rows cannot be 2 ranks' micro-batches of 8, and is refused, not trained as 16
        assert (
            "divisible by 16" in record["batch_error"] and "impl.microbatch_size=4" in record["batch_error"]
        )


@pytest.mark.slow
def test_torchrun_pretrain_py(tmp_path):
    # the real entry point: Hydra, preprocessing on local rank 0 first, rank 0's run folder for both ranks
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]
    overrides = ["data=embedded", "arch=tiny", "budget=0.003", "name=pair", f"base_dir={tmp_path}"]
    overrides += ["impl.device=cpu", "impl.num_workers=0", "impl.microbatch_size=8", "train.batch_size=32"]
    overrides += ["train.batch_size_start=16"]  # the ramp is defined in sequences, not micro-batches
    done = subprocess.run(
        [*command, str(REPO / "pretrain.py"), *overrides, "train.log_every=5"],
        cwd=REPO,
        env={**os.environ, "OMP_NUM_THREADS": "1", "HYDRA_FULL_ERROR": "1"},
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-6000:]
    (run,) = [p for p in (tmp_path / "pair").iterdir() if (p / train_state.STATE).is_file()]
    assert (run / model_checkpoint.CHECKPOINT_DIR / model_checkpoint.WEIGHTS).is_file()
    updates = [r["update"] for r in read_metrics(run) if "loss" in r]
    assert updates and updates == sorted(set(updates))  # one writer
    assert read_metrics(run)[0]["batch_size"] == 16  # the ramp starts at batch_size_start: 2 ranks x 8
    assert "torchrun: 2 processes, ddp over gloo" in done.stdout + done.stderr
    assert "each of the 2 ranks holds all of it" in done.stdout + done.stderr  # DDP replicates the state


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA devices (nccl)")
def test_two_gpus_stay_in_step_and_stop_together(tmp_path):
    # CUDA kernels are not bitwise deterministic (embedding backward): no exact resume comparison here.
    # GaLore: the ranks' SVDs of the same all-reduced gradient must agree, or the replicas drift apart
    for record in torchrun(tmp_path, "cuda", "ddp", "optimizers", "fsdp2"):
        for scenario in (*MODES, "adamw_8bit", "galore_adamw"):
            run = record[scenario]
            assert run["differences"] == [0.0] * run["progress"]["updates"], (scenario, run["differences"])
        for mode in MODES:
            runs = record[f"{mode}_budget"]
            assert runs["reference"]["progress"]["microbatches"] == 7
            assert runs["interrupted"]["reason"] == "SIGINT"
            assert runs["resumed"]["progress"] == runs["reference"]["progress"]


# ------------------------------------------------------------------- low-bit AdamW under FSDP2 (scenario lowbit)


@pytest.fixture(scope="module")
def launched_lowbit(tmp_path_factory) -> list[dict]:
    """One launch of the worker's `lowbit` scenario: adamw, adamw_8bit, adamw_4bit under FSDP2."""
    return torchrun(tmp_path_factory.mktemp("torchrun-lowbit"), "lowbit")


def one_process_run(tmp_path: Path, optim: str, steps: int, *overrides: str) -> dict[str, torch.Tensor]:
    """The final weights of 1 process with micro-batch 16: the rows and masks of 2 ranks x 8."""
    cfg = make_config(
        tmp_path,
        f"name=single-{optim}",
        f"train/optim={optim}",
        LOWBIT_ARCH,
        "budget=1",
        f"train.steps={steps}",
        "train.lr_schedule=steps-linear",
        "train.warmup=0.25",
        "train.batch_size=32",
        "train.batch_size_ramp=0",
        "train.log_every=1",
        "impl.microbatch_size=16",
        *overrides,
    )
    return final_weights(loop.train(cfg, synthetic_data(tmp_path), run_dir(cfg)).checkpoint)


@pytest.mark.slow
@pytest.mark.parametrize("optim", ["adamw_8bit", "adamw_4bit"])
def test_lowbit_adamw_under_fsdp2_stays_within_its_quantization_drift_of_one_process(
    launched_lowbit, tmp_path, optim
):
    steps = launched_lowbit[0][f"fsdp2_{optim}"]["progress"]["updates"]
    assert steps >= 10  # the worker's LOWBIT_STEPS
    for record in launched_lowbit:  # the ranks agree exactly after every update
        run = record[f"fsdp2_{optim}"]
        assert run["reason"] == "steps" and run["differences"] == [0.0] * steps, run["differences"]
    ours = final_weights(launched_lowbit[0][f"fsdp2_{optim}"]["checkpoint"])
    single = one_process_run(tmp_path, optim, steps)
    fp32 = one_process_run(tmp_path, "adamw", steps)
    cfg = make_config(tmp_path, LOWBIT_ARCH)
    seed_everything(cfg.seed)  # the loop's initialization
    initial = build_model(cfg.arch, single_vocab(tmp_path), dropout=cfg.train.dropout).state_dict()
    # Bound. Each rank quantizes its shard with the same code maps and scales no coarser than one process's
    # (a shard's block or column maximum is at most the whole tensor's), so each run is a quantized
    # approximation of the same fp32 trajectory, the 2-rank one no further from it than the 1-process one
    # is. The triangle inequality then bounds their distance by twice the 1-process run's drift from fp32
    # AdamW, plus the fp32 rounding of the reduce-scatter (the plain adamw test's 1e-3 of the move).
    # Were the two drifts independent and of one size, the distance would be about sqrt(2) times the drift.
    # Measured at 50 updates: at most 0.88 of the drift (4-bit, ffn.up) and 0.87 (8-bit, ffn.down: shards
    # ending inside blocks). Breaking the per-shard scales (each rank's codes decoded with the neighbouring
    # block's or column's scale) fails it on the embedding (8-bit at 16x the drift, 4-bit at 2.3x).
    for key, value in single.items():
        drift = (value - fp32[key]).norm()
        moved = (value - initial[key]).norm()
        difference = (ours[key] - value).norm()
        bound = 2 * drift + 1e-3 * moved + 1e-7
        assert difference <= bound, f"{optim} {key}: {difference:.3e} > {bound:.3e} (drift {drift:.3e})"


@pytest.mark.slow
def test_each_rank_holds_at_most_55_percent_of_the_optimizer_state(launched_lowbit, tmp_path):
    vocab = single_vocab(tmp_path)
    for optim in LOWBIT_OPTIMIZERS:
        cfg = make_config(tmp_path, f"train/optim={optim}", LOWBIT_ARCH)
        whole = optimizer_state_report(build_optimizer(build_model(cfg.arch, vocab), cfg.train.optim))
        for rank, record in enumerate(launched_lowbit):
            state = record[f"fsdp2_{optim}"]["state"]  # measured from the rank's state tensors
            assert state["sharded"] and state["whole_params"] == whole["params"]
            assert state["state_bytes"] <= 0.55 * whole["state_bytes"], (optim, rank, state, whole)
            line = format_state_report(state, world_size=2)
            assert "per rank" in line and "this rank's" in line, line


@pytest.mark.slow
def test_quantized_state_under_fsdp2_resumes_exactly_with_the_same_ranks(launched_lowbit):
    for record in launched_lowbit:
        runs = record["fsdp2_adamw_4bit_budget"]
        assert runs["interrupted"]["progress"]["updates"] == 2
        assert runs["resumed"]["progress"] == runs["reference"]["progress"]
    runs = launched_lowbit[0]["fsdp2_adamw_4bit_budget"]
    ours, theirs = (
        final_weights(runs["resumed"]["checkpoint"]),
        final_weights(runs["reference"]["checkpoint"]),
    )
    for key, value in theirs.items():
        torch.testing.assert_close(ours[key], value, rtol=0, atol=0, msg=key)
    # the codes and scales each rank holds at the end: the same bits as the uninterrupted run's
    saved = [
        train_state.load_state(Path(runs[leg]["run_dir"]) / train_state.STATE)
        for leg in ("resumed", "reference")
    ]
    ours, theirs = (state["optimizer"]["rank_states"] for state in saved)
    assert len(ours) == len(theirs) == 2
    for mine, reference in zip(ours, theirs, strict=True):
        assert mine.keys() == reference.keys()
        for index, entries in reference.items():
            assert any(k.endswith("codes") for k in entries) or "exp_avg" in entries
            for key, value in entries.items():
                if torch.is_tensor(value):
                    torch.testing.assert_close(mine[index][key], value, rtol=0, atol=0, msg=f"{index} {key}")
                else:
                    assert mine[index][key] == value, (index, key)


RESHARD_OPTIMIZERS = ("adamw_8bit", "adamw_4bit", "galore_adamw", "galore_adafactor")  # as in the worker


def budget_run_settings(optim: str) -> tuple[str, ...]:
    """The worker's budget runs (budget_then_resume) of `optim`, in one process: micro-batch 16 = 2 ranks x 8."""
    galore = GALORE_SETTINGS if optim.startswith("galore") else ()
    common = ("budget=0.1", "train.batch_size=32", "train.batch_size_ramp=0", "train.log_every=1")
    return (*common, "impl.microbatch_size=16", f"train/optim={optim}", *galore)


def one_process_budget_run(tmp_path: Path, clock, optim: str) -> dict[str, torch.Tensor]:
    cfg = make_config(tmp_path, f"name=single-budget-{optim}", *budget_run_settings(optim))
    return final_weights(loop.train(cfg, synthetic_data(tmp_path), run_dir(cfg), clock=clock).checkpoint)


def resumed_within_bound(ours: dict, reference: dict, initial: dict, drift: dict | None, what: str) -> None:
    """The resumed run's weights after its next update against the uninterrupted run's: within the rounding
    tolerance of the 2-ranks-vs-1-process tests (1e-3 of how far training moved each tensor), plus, where a
    quantized moment was re-quantized, twice one process's quantization drift from fp32 (the low-bit tests'
    bound: both runs are quantized approximations of one fp32 trajectory)."""
    of_move = of_bound = 0.0
    for key, value in reference.items():
        moved = (value - initial[key]).norm()
        difference = (ours[key] - value).norm()
        bound = 1e-3 * moved + 1e-7 + (0 if drift is None else 2 * drift[key])
        of_move, of_bound = max(of_move, difference / (moved + 1e-12)), max(of_bound, difference / bound)
        assert difference <= bound, f"{what} {key}: {difference:.3e} > {bound:.3e} (moved {moved:.3e})"
    print(f"{what}: at most {of_move:.2e} of the move apart, {of_bound:.2f} of the bound")


@contextlib.contextmanager
def ticking_clock(signal_at: int | None = None) -> Iterator[FakeClock]:
    """A FakeClock advanced by 60 s every micro-batch of the loop: rank 0's clock in the worker's budget runs.
    signal_at: SIGINT this process during that micro-batch, as the worker's rank 1 does."""
    clock = FakeClock(60.0)
    original = MLMObjective.__call__
    calls = [0]

    def timed(self, model, batch):
        calls[0] += 1
        clock.now += clock.tick
        if calls[0] == signal_at:
            os.kill(os.getpid(), signal.SIGINT)
        return original(self, model, batch)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(MLMObjective, "__call__", timed)
        yield clock


@pytest.fixture(scope="module")
def four_bit_drift(tmp_path_factory) -> dict[str, torch.Tensor]:
    """|one process's adamw_4bit - adamw| per tensor, over the worker's budget run (3 updates)."""
    path = tmp_path_factory.mktemp("drift")
    runs = {}
    for optim in ("adamw_4bit", "adamw"):
        with ticking_clock() as clock:
            runs[optim] = one_process_budget_run(path, clock, optim)
    return {key: (value - runs["adamw"][key]).norm() for key, value in runs["adamw_4bit"].items()}


def quantization_drift(optim: str, merged: bool, four_bit_drift: dict) -> dict | None:
    """The drift term of the bound where the resume re-quantized: the 4-bit second moment of FSDP2 shards made
    whole (rank-1 column maxima); every other state of the tiny model moves exactly (whole blocks)."""
    return four_bit_drift if optim == "adamw_4bit" and merged else None


@pytest.mark.slow
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("optim", RESHARD_OPTIMIZERS)
def test_our_optimizer_state_resumes_in_the_other_mode_with_the_same_next_update(
    launched_lowbit, tmp_path, four_bit_drift, optim, mode
):
    # FSDP2 -> DDP: the ranks' shards made whole; DDP -> FSDP2: whole tensors (the format of one process)
    # cut into the ranks' rows
    for record in launched_lowbit:
        runs = record[f"{mode}_{optim}_budget"]
        assert runs["crossed_interrupted"]["progress"]["updates"] == 2
        assert runs["crossed"]["progress"] == runs["reference"]["progress"]
    runs = launched_lowbit[0][f"{mode}_{optim}_budget"]
    ours, reference = (
        final_weights(runs["crossed"]["checkpoint"]),
        final_weights(runs["reference"]["checkpoint"]),
    )
    drift = quantization_drift(optim, mode == "fsdp2", four_bit_drift)
    resumed_within_bound(ours, reference, initial_weights(tmp_path, ()), drift, f"{optim} {mode} -> other")


@pytest.mark.slow
@pytest.mark.parametrize("optim", RESHARD_OPTIMIZERS)
def test_a_state_of_two_fsdp2_ranks_resumes_in_one_process(
    launched_lowbit, tmp_path, four_bit_drift, caplog, optim
):
    runs = launched_lowbit[0][f"fsdp2_{optim}_budget"]
    interrupted = Path(runs["crossed_interrupted"]["run_dir"])  # 2 FSDP2 ranks stopped after 2 updates
    cfg = make_config(tmp_path, f"name={interrupted.parent.name}", "resume=true", *budget_run_settings(optim))
    shutil.copytree(interrupted, run_dir(cfg))
    with ticking_clock() as clock, caplog.at_level(logging.INFO, logger="cramming"):
        resumed = loop.train(cfg, synthetic_data(tmp_path), run_dir(cfg, "2026-01-01_01-00-00"), clock=clock)
    assert "2 FSDP2 ranks' shards -> whole tensors" in caplog.text
    assert {**vars(resumed.progress), "updates": resumed.updates} == runs["reference"]["progress"]
    ours, reference = final_weights(resumed.checkpoint), final_weights(runs["reference"]["checkpoint"])
    drift = quantization_drift(optim, True, four_bit_drift)
    resumed_within_bound(ours, reference, initial_weights(tmp_path, ()), drift, f"{optim} 2 FSDP2 -> 1")


# ------------------------------------------------------------------------------------ without torchrun


def test_single_process_makes_no_process_group(tmp_path, monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    impl = make_config(tmp_path).impl
    ranks = init_from_env(impl.torch_device(), impl.distributed)
    assert not ranks.active and ranks.is_main and not torch.distributed.is_initialized()
    model = torch.nn.Linear(2, 2)
    parallel = Parallel(ranks)
    assert parallel.shard(model, torch.float16) is model
    assert parallel.wrap(model) is model


def test_shards_partition_each_global_microbatch(tmp_path):
    rows = synthetic_data(tmp_path, rows=40).train
    for start in (0, 24):  # 24: a resumed stream, whose rows cross into the second (permuted) epoch
        whole = RowStream(rows, microbatch_size=12, seed=3, start=start)
        shards = [RowStream(rows, 4, seed=3, start=start, rank=r, world_size=3) for r in range(3)]
        for i in range(4):
            torch.testing.assert_close(torch.cat([s[i] for s in shards]), whole[i], rtol=0, atol=0)


def test_masks_do_not_depend_on_the_rank(tmp_path):
    """The loop's batches carry stream positions: a rank masks its slice as one process masks the whole."""
    data = synthetic_data(tmp_path)
    masker = MLMMasker(make_config(tmp_path).train.mlm, data.vocab_size, data.special.all, data.special.mask)
    whole = list(itertools.islice(numbered(RowStream(data.train, 12, seed=0), 0, 12), 2))
    for rank in range(3):
        shard = RowStream(data.train, 4, seed=0, rank=rank, world_size=3)
        for (positions, rows), (all_positions, all_rows) in zip(
            numbered(shard, 0, 4, rank, 3), whole, strict=False
        ):
            mine = slice(4 * rank, 4 * (rank + 1))
            torch.testing.assert_close(positions, all_positions[mine], rtol=0, atol=0)
            for ours, theirs in zip(masker(rows, positions), masker(all_rows, all_positions), strict=True):
                torch.testing.assert_close(ours, theirs[mine], rtol=0, atol=0)


def test_optimizer_state_by_name_and_back(tmp_path):
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Linear(4, 2))
    optimizer = torch.optim.AdamW(
        [{"params": [model[1].weight]}, {"params": [model[0].weight, model[0].bias]}]
    )
    model(torch.randn(5, 3)).sum().backward()
    optimizer.step()
    names = train_state._param_names(model, optimizer)
    assert names == ["1.weight", "0.weight", "0.bias"]
    state = optimizer.state_dict()
    named = train_state._by_name(state, names)
    assert named["param_groups"][1]["params"] == ["0.weight", "0.bias"]
    back = train_state._by_index(named, names)
    assert back["param_groups"] == state["param_groups"] and back["state"].keys() == state["state"].keys()


def test_the_state_line_says_ddp_replicates_the_state():
    model = torch.nn.Linear(64, 64)
    report = optimizer_state_report(torch.optim.AdamW(model.parameters()))
    assert not report["sharded"]
    assert "each of the 2 ranks holds all of it" in format_state_report(report, world_size=2)
    assert "ranks" not in format_state_report(report)


def test_a_shard_state_resumes_with_any_ranks_and_mode(caplog):
    """The conversions themselves are tested in tests/test_optim_reshard.py; here, which one a job takes."""
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Linear(64, 3))  # (64, 64): 8-bit moments

    def optimizer() -> LeanOptimizer:
        return AdamW(model.parameters(), lr=1e-2, optim_bits=8, min_8bit_size=4096)

    trained = optimizer()
    for _ in range(2):
        model(torch.randn(5, 64)).sum().backward()
        trained.step()
    whole = trained.state_dict()
    names = train_state._param_names(model, trained)
    pieces = [reshard.cut_whole_state(trained, whole["state"], r, 2, names)[0] for r in range(2)]
    saved = {"param_groups": whole["param_groups"], "rank_states": pieces}

    def here(state: dict, ranks: Ranks, opt: torch.optim.Optimizer | None = None) -> dict:
        return train_state._optimizer_state_here(model, opt or optimizer(), state, ranks)

    fsdp2 = Ranks(rank=1, world_size=2, mode="fsdp2")
    assert here(saved, fsdp2)["state"] is pieces[1]  # the same job shape: as saved
    assert here(whole, Ranks()) is whole  # whole tensors for whole tensors: as before
    with caplog.at_level(logging.INFO, logger="cramming"):
        for ranks in (Ranks(), Ranks(rank=1, world_size=2, mode="ddp")):
            merged = here(saved, ranks)["state"]  # 2 FSDP2 ranks -> whole tensors: exact (whole blocks)
            for index, entries in whole["state"].items():
                for key, value in entries.items():
                    assert (
                        torch.equal(merged[index][key], value)
                        if torch.is_tensor(value)
                        else merged[index][key] == value
                    )
    assert "2 FSDP2 ranks' shards -> whole tensors; 4 of 4 parameters' states moved exactly" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="cramming"):
        cut = here(whole, fsdp2)["state"]  # whole tensors -> 2 FSDP2 ranks
        four = here(saved, Ranks(rank=3, world_size=4, mode="fsdp2"))["state"]  # 2 -> 4 ranks
    assert torch.equal(cut[0]["m_codes"], pieces[1][0]["m_codes"])
    assert four[0]["m_codes"].numel() == 16 * 64 and four[1]["exp_avg"].shape == (16,)
    assert "-> 2 FSDP2 ranks" in caplog.text and "-> 4 FSDP2 ranks" in caplog.text
    # the shards of our optimizer's state do not fit another optimizer (torch's AdamW): refused, named
    with pytest.raises(ConfigError, match="train.optim"):
        here(saved, Ranks(), torch.optim.AdamW(model.parameters()))


def test_impl_distributed_is_checked(tmp_path):
    with pytest.raises(ConfigError, match="impl.distributed"):
        make_config(tmp_path, "impl.distributed=deepspeed")


# ---------------------------------------------------------------------- GaLore under FSDP2 (scenario galore)


@pytest.fixture(scope="module")
def launched_galore(tmp_path_factory) -> list[dict]:
    """One launch of the worker's `galore` scenario: the four galore_* optimizers under FSDP2."""
    return torchrun(tmp_path_factory.mktemp("torchrun-galore"), "galore")


def initial_weights(tmp_path: Path, arch: tuple[str, ...] = (LOWBIT_ARCH,)) -> dict[str, torch.Tensor]:
    cfg = make_config(tmp_path, *arch)
    seed_everything(cfg.seed)  # the loop's initialization
    return build_model(cfg.arch, single_vocab(tmp_path), dropout=cfg.train.dropout).state_dict()


def fsdp2_galore_run(launched: list[dict], optim: str) -> tuple[dict[str, torch.Tensor], int]:
    """Rank 0's final weights of `optim` and its update count, once both ranks agreed after every update."""
    steps = launched[0][f"fsdp2_{optim}"]["progress"]["updates"]
    assert steps == 50  # the count (the worker's LOWBIT_STEPS)
    for record in launched:
        run = record[f"fsdp2_{optim}"]
        assert run["reason"] == "steps" and run["differences"] == [0.0] * steps, run["differences"]
    return final_weights(launched[0][f"fsdp2_{optim}"]["checkpoint"]), steps


@pytest.mark.slow
@pytest.mark.parametrize("optim", ["galore_adamw", "galore_adafactor"])
def test_fp32_galore_under_fsdp2_matches_one_process_within_rounding(launched_galore, tmp_path, optim):
    ours, steps = fsdp2_galore_run(launched_galore, optim)
    single = one_process_run(tmp_path, optim, steps, *GALORE_SETTINGS)
    initial = initial_weights(tmp_path)
    # The projectors come from the SVD of the whole gradient (gathered on the 5 refresh steps), which one
    # process and the reduce-scatter's sum compute up to rounding: the same tolerance as plain adamw's, a
    # small fraction of how far training moved each tensor.
    for key, value in single.items():
        moved = (value - initial[key]).norm()
        difference = (ours[key] - value).norm()
        assert difference <= 1e-3 * moved + 1e-7, f"{optim} {key}: {difference:.3e} vs moved {moved:.3e}"


@pytest.mark.slow
@pytest.mark.parametrize("optim", ["galore_adamw_8bit", "galore_adamw_4bit"])
def test_quantized_galore_under_fsdp2_stays_within_its_quantization_drift(launched_galore, tmp_path, optim):
    ours, steps = fsdp2_galore_run(launched_galore, optim)
    single = one_process_run(tmp_path, optim, steps, *GALORE_SETTINGS)
    fp32 = one_process_run(tmp_path, "galore_adamw", steps, *GALORE_SETTINGS)
    initial = initial_weights(tmp_path)
    # Bound, as for the low-bit AdamW test above: the right-projected weights' low-rank moments are sharded
    # by rows and quantized per shard with scales no coarser than one process's; the left-projected ones are
    # whole on every rank and quantized as one process does. Each run is then a quantized approximation of
    # one fp32 GaLore trajectory, the 2-rank one no further from it than the 1-process one: their distance is
    # at most twice the 1-process drift from galore_adamw, plus the rounding of the fp32 test's tolerance.
    for key, value in single.items():
        drift = (value - fp32[key]).norm()
        moved = (value - initial[key]).norm()
        difference = (ours[key] - value).norm()
        bound = 2 * drift + 1e-3 * moved + 1e-7
        assert difference <= bound, f"{optim} {key}: {difference:.3e} > {bound:.3e} (drift {drift:.3e})"


@pytest.mark.slow
def test_each_rank_holds_a_sharded_galore_state(launched_galore, tmp_path):
    # the moments of right-projected weights and the rows of left projectors are sharded; right projectors
    # and left-projected moments are replicated (cramming.optim.galore), hence a little over 50%
    vocab = single_vocab(tmp_path)
    shares: dict[str, float] = {}
    for optim in ("galore_adamw", "galore_adamw_8bit", "galore_adamw_4bit", "galore_adafactor"):
        cfg = make_config(tmp_path, f"train/optim={optim}", LOWBIT_ARCH, *GALORE_SETTINGS)
        whole = optimizer_state_report(build_optimizer(build_model(cfg.arch, vocab), cfg.train.optim))
        for rank, record in enumerate(launched_galore):
            state = record[f"fsdp2_{optim}"]["state"]  # measured from the rank's state tensors
            assert state["sharded"] and state["whole_params"] == whole["params"]
            share = state["state_bytes"] / whole["state_bytes"]
            shares[optim] = max(shares.get(optim, 0.0), share)
            print(f"{optim} rank {rank}: {share:.3f} of one process's")
    # GALORE_SETTINGS project with `std`: weights with m < n go on the left, whose low-rank moments every rank
    # holds whole (replicated), as it holds the step counters and quantization scales of small tensors. On
    # this model that is 53.3% (fp32 moments), 55.4% (8-bit) and 56.1% (4-bit): the 55% goal of the issue is
    # met by proj_type=right (every moment sharded, results/optimizers/memory.md), not by `std`. A replicated
    # state would be 100%; the bound catches that and any projector or moment that stops being sharded.
    assert max(shares.values()) <= 0.6, shares


# ---------------------------------------------------- layerwise optimizers under DDP and FSDP2 (scenario layerwise)


@pytest.fixture(scope="module")
def launched_layerwise(tmp_path_factory) -> list[dict]:
    """One launch of the worker's `layerwise` scenario: layerwise optimizers under DDP mode and FSDP2."""
    return torchrun(tmp_path_factory.mktemp("torchrun-layerwise"), "layerwise")


@pytest.mark.slow
@pytest.mark.parametrize("optim", ["adamw_layerwise", "galore_adamw_layerwise", "adamw_8bit_layerwise"])
def test_layerwise_under_ddp_and_fsdp2_matches_one_process_with_accumulation(
    launched_layerwise, tmp_path, optim
):
    for mode in MODES:
        steps = launched_layerwise[0][f"{mode}_{optim}"]["progress"]
        # 50 updates of 2 global micro-batches (2 ranks x 8 rows): the hooks step on the second only
        assert (steps["updates"], steps["microbatches"]) == (50, 100)
        for record in launched_layerwise:  # the ranks agree exactly after every update
            run = record[f"{mode}_{optim}"]
            assert run["reason"] == "steps" and run["differences"] == [0.0] * 50, (mode, run["differences"])
    runs = {mode: final_weights(launched_layerwise[0][f"{mode}_{optim}"]["checkpoint"]) for mode in MODES}
    overrides = GALORE_SETTINGS if optim.startswith("galore") else ()
    single = one_process_run(tmp_path, optim, 50, *overrides)  # micro-batch 16, 2 per update, layerwise
    initial = initial_weights(tmp_path)
    # fp32 moments: within rounding, as the ranks average each gradient with an all-reduce instead of one
    # process's sum over 16 rows (plain adamw's tolerance). 8-bit moments: the blocks are whole tensors in
    # both runs, but a gradient that differs by rounding can land on the other side of a code boundary, and
    # from there the two runs are two quantized approximations of the same fp32 trajectory: their distance is
    # bounded by twice one process's drift from fp32 (the FSDP2 low-bit test's bound; measured 2.3e-3 against
    # 1e-3 of the move on the attention weight at 50 updates, so rounding alone is not the bound). Under FSDP2
    # each rank steps its shard in the hook FSDP2 runs after the reduce-scatter, clipping with the whole
    # gradient's norm; the 8-bit blocks are each shard's (the FSDP2 low-bit test's bound again).
    fp32 = one_process_run(tmp_path, "adamw_layerwise", 50) if "bit" in optim else None
    for mode, ours in runs.items():
        worst = 0.0
        for key, value in single.items():
            moved = (value - initial[key]).norm()
            difference = (ours[key] - value).norm()
            bound = 1e-3 * moved + 1e-7 + (0 if fp32 is None else 2 * (value - fp32[key]).norm())
            worst = max(worst, difference / bound)
            assert difference <= bound, (
                f"{optim} {mode} {key}: {difference:.3e} > {bound:.3e} (moved {moved:.3e})"
            )
        print(f"{optim} {mode}: at most {worst:.2f} of the bound")


@pytest.mark.slow
def test_layerwise_under_ddp_never_holds_all_gradients(launched_layerwise, tmp_path):
    cfg = make_config(tmp_path, LOWBIT_ARCH)
    model = build_model(cfg.arch, single_vocab(tmp_path))
    all_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    for record in launched_layerwise:
        run = record["ddp_layerwise_held"]  # one micro-batch per update
        assert run["progress"]["updates"] == 4 and run["differences"] == [0.0] * 4
        most = run["most_gradient_bytes"]  # before each step, over every parameter
        print(f"at most {most / all_bytes:.1%} of the model's gradient bytes held at once")
        assert most < all_bytes, (most, all_bytes)


# --------------------------------------- one process's state resumed by 2 FSDP2 ranks (scenario from_one)

FROM_ONE_OPTIMIZERS = ("adamw", "adamw_4bit")  # as in the worker
HELD_LAYERS = 6  # the worker's fsdp2_held model: LOWBIT_ARCH with this many blocks


@pytest.fixture(scope="module")
def launched_from_one(tmp_path_factory) -> list[dict]:
    """One process's budget runs (the worker's budget_then_resume settings, micro-batch 16 = 2 ranks x 8),
    stopped by SIGINT during their 4th micro-batch after 2 updates; then one launch of the worker's from_one
    scenario, which resumes them on 2 FSDP2 ranks, and of its fsdp2_held scenario."""
    out = tmp_path_factory.mktemp("torchrun-from-one")
    for optim in FROM_ONE_OPTIMIZERS:
        cfg = make_config(out / "runs", f"name=from-one-{optim}", *budget_run_settings(optim))
        with ticking_clock(signal_at=4) as clock:
            stopped = loop.train(cfg, synthetic_data(out / "runs"), run_dir(cfg), clock=clock)
        assert stopped.stop_reason == "SIGINT" and stopped.updates == 2
    return torchrun(out, "from_one", "fsdp2_held")


@pytest.mark.slow
@pytest.mark.parametrize("optim", FROM_ONE_OPTIMIZERS)
def test_a_state_of_one_process_resumes_on_two_fsdp2_ranks(launched_from_one, tmp_path, optim):
    """The state a single-process run saved (whole tensors) is cut into 2 FSDP2 ranks' shards, and the run
    continues to what one process would have reached without the stop: within the rounding tolerance of the
    other resume tests (cutting whole tensors, 4-bit blocks included, moves each value exactly)."""
    cfg = make_config(tmp_path, f"name=single-budget-{optim}", *budget_run_settings(optim))
    with ticking_clock() as clock:
        reference = loop.train(cfg, synthetic_data(tmp_path), run_dir(cfg), clock=clock)
    for record in launched_from_one:
        resumed = record[f"from_one_{optim}"]
        assert resumed["reason"] == reference.stop_reason == "budget"
        assert resumed["progress"] == {
            **vars(reference.progress),
            "updates": reference.updates,
        }  # 2 + 1 updates
        assert resumed["elapsed"] == pytest.approx(reference.elapsed)  # the saved 240 s counted on
    resumed = launched_from_one[0][f"from_one_{optim}"]
    assert [r["update"] for r in read_metrics(Path(resumed["run_dir"])) if "loss" in r] == [3]
    ours, theirs = final_weights(resumed["checkpoint"]), final_weights(reference.checkpoint)
    resumed_within_bound(ours, theirs, initial_weights(tmp_path, ()), None, f"{optim} 1 -> 2 FSDP2")


def padded_bytes(params) -> int:
    """The bytes of these parameters' gradients as FSDP2 lays them out on 2 ranks: dim 0 padded to a multiple
    of 2 (a 0-dim parameter becomes a 1-element vector first)."""
    total = 0
    for param in params:
        rows = param.shape[0] if param.ndim else 1
        total += -(-rows // 2) * 2 * (param.numel() // rows) * param.element_size()
    return total


@pytest.mark.slow
def test_fsdp2_never_holds_all_gradients(launched_from_one, tmp_path):
    """What FSDP2 lets a rank hold at once: its shard of every gradient; the root module's unsharded gradients
    (the root, with the word embedding tied with the decoder, is reduced last); those of the block being
    reduced; and one earlier block's reduce-scatter input, which FSDP2 keeps for overlap
    (reduce_scatter_max_input_buffers, 1 by default). A model with every gradient unsharded at once, or
    replicated, would be over it: the bound is below all of the model's gradient bytes."""
    cfg = make_config(tmp_path, LOWBIT_ARCH, f"arch.num_layers={HELD_LAYERS}")
    model = build_model(cfg.arch, single_vocab(tmp_path))
    all_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    blocks = [padded_bytes(block.parameters()) for block in model.encoder.blocks]
    in_blocks = {id(p) for p in model.encoder.blocks.parameters()}
    root = padded_bytes(p for p in model.parameters() if id(p) not in in_blocks)
    bound = (sum(blocks) + root) // 2 + root + 2 * max(blocks)
    assert bound < all_bytes  # the model is deep enough for the bound to say something
    for rank, record in enumerate(launched_from_one):
        run = record["fsdp2_held"]  # one micro-batch per update
        assert run["progress"]["updates"] == 4 and run["differences"] == [0.0] * 4
        held = run["gradient_bytes"]  # at the start and end of each module's post-backward
        assert len(held) == 2 * (HELD_LAYERS + 1) * 4, len(held)
        print(
            f"rank {rank}: at most {max(held) / all_bytes:.1%} of the gradient bytes (bound {bound / all_bytes:.1%})"
        )
        assert max(held) <= bound, (max(held), bound, all_bytes)
