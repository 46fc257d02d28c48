"""One rank of tests/test_distributed.py's torchrun launch (CPU, gloo):

    torchrun --standalone --nproc_per_node=2 tests/distributed_worker.py OUT_DIR SCENARIO...

SCENARIO: ddp, optimizers, fsdp2, lowbit (AdamW with 32-, 8- and 4-bit moments under FSDP2, and our
optimizers' states saved in one mode and resumed in the other), galore (the galore_* optimizers under FSDP2),
layerwise (layerwise optimizers under DDP and FSDP2, 2 micro-batches per update), from_one (states that one
process saved, which the test writes under OUT_DIR/runs before the launch, resumed by 2 FSDP2 ranks),
fsdp2_held (the gradient bytes each FSDP2 rank holds during backward); add `cuda` to run them on GPUs (nccl)
instead of the CPU (gloo).

Each scenario trains the tiny model of tests/test_train.py with loop.train() and records, per rank, what the
tests check (progress, stop reason, parameter differences to rank 0 after every update, gradient all-reduces
per micro-batch, errors) into OUT_DIR/rank<r>.json. Run folders go under OUT_DIR/runs.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from test_train import FakeClock, make_config, run_dir, synthetic_data

from cramming.errors import ConfigError
from cramming.impl import PARALLEL_MODES
from cramming.optim import LeanOptimizer, optimizer_state_report
from cramming.optim.step import TrainStep
from cramming.ranks import shutdown
from cramming.train import loop
from cramming.train.mlm import MLMObjective
from cramming.train.parallel import Parallel

torch.set_num_threads(1)
# scenario lowbit: the optimizers run under FSDP2, and how many updates (tests/test_distributed.py compares
# them with one process)
LOWBIT_OPTIMIZERS = ("adamw", "adamw_8bit", "adamw_4bit")
LOWBIT_STEPS = 50
# an FFN whose shards end inside quantization blocks: 2 ranks hold 101 x 64 of up (202, 64) and 32 x 101 of
# down (64, 101), 6464 and 3232 elements, multiples of neither 256 (8-bit) nor 128 (4-bit)
LOWBIT_ARCH = "arch.intermediate_size=202"
# scenario galore: the GaLore optimizers under FSDP2 on the same FFN, rank 8, the projector refreshed every
# 10 updates (5 refreshes in the 50): `std` projects up (404, 64) on the right, down (64, 202) on the left
GALORE_OPTIMIZERS = ("galore_adamw", "galore_adamw_8bit", "galore_adamw_4bit", "galore_adafactor")
GALORE_SETTINGS = ("train.optim.rank=8", "train.optim.update_proj_gap=10")
# scenario lowbit, too: a state saved in either mode resumed in the other (FSDP2 ranks' shards <-> whole
# tensors), for each kind of state: 8-bit, 4-bit, fp32 GaLore-AdamW (with plain fp32 moments for the rest)
# and GaLore-Adafactor (with the ranks' shared column statistics); on the tiny model, whose 2-rank shards are
# whole quantization blocks
RESHARD_OPTIMIZERS = ("adamw_8bit", "adamw_4bit", "galore_adamw", "galore_adafactor")
# scenario layerwise: under DDP mode and FSDP2, with 2 accumulated global micro-batches per update
LAYERWISE_OPTIMIZERS = ("adamw_layerwise", "galore_adamw_layerwise", "adamw_8bit_layerwise")
# scenario from_one: the optimizers whose one-process states 2 FSDP2 ranks resume (as in the test)
FROM_ONE_OPTIMIZERS = ("adamw", "adamw_4bit")
# scenario fsdp2_held: blocks enough that the two FSDP2 keeps in flight are a minority of the model's
HELD_LAYERS = 6
RANK = int(os.environ["RANK"])


@contextlib.contextmanager
def patched(owner, name: str, make):
    """Replace owner.name by make(original) for the block."""
    original = getattr(owner, name)
    setattr(owner, name, make(original))
    try:
        yield
    finally:
        setattr(owner, name, original)


def whole(param: torch.Tensor) -> torch.Tensor:
    """The full parameter: FSDP2 holds a DTensor shard (gathering it is collective)."""
    return param.full_tensor() if hasattr(param, "full_tensor") else param.detach()


def watch_parameters(differences: list[float]):
    """TrainStep.apply, then the largest difference of this rank's parameters to rank 0's."""

    def make(apply):
        def checked(self):
            update = apply(self)
            flat = torch.cat([whole(p).reshape(-1) for p in self.model.parameters()])
            reference = flat.clone()
            dist.broadcast(reference, src=0)
            differences.append((flat - reference).abs().max().item())
            return update

        return checked

    return patched(TrainStep, "apply", make)


def count_allreduces(per_microbatch: list[int]):
    """DDP with a comm hook that counts bucket all-reduces; records how many each micro-batch started."""
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

    calls = [0]

    def hook(state, bucket):
        calls[0] += 1
        return allreduce_hook(None, bucket)

    def make_wrap(wrap):
        def wrapped_with_hook(*args, **kwargs):
            wrapped = wrap(*args, **kwargs)
            if hasattr(wrapped, "register_comm_hook"):  # a layerwise optimizer reduces without DDP
                wrapped.register_comm_hook(None, hook)
            return wrapped

        return wrapped_with_hook

    def make_microbatch(microbatch):
        def counted(self, forward, *args):
            before = calls[0]
            microbatch(self, forward, *args)
            per_microbatch.append(calls[0] - before)

        return counted

    stack = contextlib.ExitStack()
    stack.enter_context(patched(Parallel, "wrap", make_wrap))
    stack.enter_context(patched(TrainStep, "microbatch", make_microbatch))
    return stack


def record_lr(rates: list[float]):
    """The learning rate of every applied update, as this rank set it."""

    def make(apply):
        def recorded(self):
            update = apply(self)
            if update.applied:
                rates.append(self.optimizer.param_groups[0]["lr"])
            return update

        return recorded

    return patched(TrainStep, "apply", make)


def ticking(clock: FakeClock, signal_at: int | None = None):
    """Advance this rank's fake clock by its tick every micro-batch; optionally SIGINT itself at one."""
    calls = [0]

    def make(objective):
        def timed(self, model, batch):
            calls[0] += 1
            clock.now += clock.tick
            if calls[0] == signal_at:
                os.kill(os.getpid(), signal.SIGINT)
            return objective(self, model, batch)

        return timed

    return patched(MLMObjective, "__call__", make)


def state_report(reports: list[dict]):
    """The optimizer state report (this rank's bytes) after the run's last update."""

    def make(apply):
        def reported(self):
            update = apply(self)
            reports[:] = [optimizer_state_report(self.optimizer)]
            return update

        return reported

    return patched(TrainStep, "apply", make)


def held_gradients(held: list[int]):
    """Before each layerwise step: how many bytes of gradients this rank holds (every optimizer parameter's)."""

    def make(step_layer):
        def counted(self, param):
            params = [p for group in self.param_groups for p in group["params"]]
            held.append(sum(p.grad.numel() * p.grad.element_size() for p in params if p.grad is not None))
            return step_layer(self, param)

        return counted

    return patched(LeanOptimizer, "_step_layer", make)


def tensor_bytes(tensor: torch.Tensor) -> int:
    """The bytes this rank holds of `tensor`: its local shard of a DTensor."""
    local = tensor.to_local() if hasattr(tensor, "to_local") else tensor
    return local.numel() * local.element_size()


def fsdp2_held_gradients(held: list[int]):
    """At the start and at the end of every FSDP2 module's post-backward (its unsharded gradients complete, and
    then reduce-scattered): the bytes of gradients this rank holds. They are the shards of the gradients
    reduced so far (each sharded parameter's .grad), the unsharded gradients autograd has accumulated and FSDP2
    has not reduced yet, and the reduce-scatter inputs FSDP2 keeps alive for overlap (copies of reduced
    gradients). FSDP2's own structures are read: while a module is unsharded, its parameters are the unsharded
    ones, so model.parameters() would count their gradients as shards. (A gradient autograd still sums in its
    own buffers, as the tied embedding's from the decoder until the embedding's lookup, is not counted.)"""
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.fsdp._fully_shard._fsdp_param_group import FSDPParamGroup

    models: list[torch.nn.Module] = []

    def count() -> int:
        groups = [
            m._get_fsdp_state()._fsdp_param_group for m in models[-1].modules() if isinstance(m, FSDPModule)
        ]
        total = 0
        for group in groups:
            for fsdp_param in group.fsdp_params:
                for param in (fsdp_param.sharded_param, getattr(fsdp_param, "_unsharded_param", None)):
                    if param is not None and param.grad is not None:
                        total += tensor_bytes(param.grad)
        context = groups[0].comm_ctx  # shared by the model's groups
        kept = getattr(context, "reduce_scatter_states", None) or [
            getattr(context, "reduce_scatter_state", None)
        ]
        return total + sum(tensor_bytes(state.reduce_scatter_input) for state in kept if state is not None)

    def make_shard(shard):
        def keeping(self, model, dtype):
            models.append(shard(self, model, dtype))
            return models[-1]

        return keeping

    def make_post_backward(post_backward):
        def counted(self, *args):
            held.append(count())
            out = post_backward(self, *args)
            held.append(count())
            return out

        return counted

    stack = contextlib.ExitStack()
    stack.enter_context(patched(Parallel, "shard", make_shard))
    stack.enter_context(patched(FSDPParamGroup, "post_backward", make_post_backward))
    return stack


def summary(result: loop.TrainResult) -> dict:
    return {
        "reason": result.stop_reason,
        "progress": {**vars(result.progress), "updates": result.updates},
        "elapsed": result.elapsed,
        "run_dir": str(result.run_dir),
        "checkpoint": str(result.checkpoint) if result.checkpoint else None,
    }


def steps(base: Path, data, *overrides: str) -> dict:
    """A few updates of 2 accumulated global micro-batches (2 ranks x 8 rows each), a step schedule."""
    cfg = make_config(
        base,
        "budget=1",
        "train.steps=4",
        "train.lr_schedule=steps-linear",
        "train.warmup=0.25",
        "train.batch_size=32",
        "train.batch_size_ramp=0",
        "train.log_every=1",
        *overrides,
    )
    differences: list[float] = []
    allreduces: list[int] = []
    reports: list[dict] = []
    with contextlib.ExitStack() as stack:
        stack.enter_context(watch_parameters(differences))
        stack.enter_context(state_report(reports))
        if cfg.impl.distributed == "ddp":
            stack.enter_context(count_allreduces(allreduces))
        result = loop.train(cfg, data, run_dir(cfg))
    return {**summary(result), "differences": differences, "allreduces": allreduces, "state": reports[0]}


def budget_then_resume(
    base: Path, data, prefix: str, mode: str, *overrides: str, legs: tuple[str, ...] = ("resumed", "crossed")
) -> dict:
    """A fake-clock budget run in `mode` (rank 1's clock runs 3x slower than rank 0's); then the same run
    interrupted by SIGINT on rank 1 during its 4th micro-batch and resumed, for each of `legs`: in the same
    mode ("resumed") and in the other one ("crossed"). A resume refused with ConfigError is recorded as
    `<leg>_error`."""
    tick = 60.0 if RANK == 0 else 20.0
    common = ("budget=0.1", "train.batch_size=32", "train.batch_size_ramp=0", "train.log_every=1", *overrides)
    clock = FakeClock(tick)
    cfg = make_config(base, f"name={prefix}-reference", f"impl.distributed={mode}", *common)
    rates: list[float] = []
    with ticking(clock), record_lr(rates):
        reference = loop.train(cfg, data, run_dir(cfg), clock=clock)
    results = {"reference": {**summary(reference), "lr": rates}}
    other = next(m for m in PARALLEL_MODES if m != mode)
    for leg, resume_mode in (("resumed", mode), ("crossed", other)):
        if leg not in legs:
            continue
        cfg = make_config(base, f"name={prefix}-{leg}", f"impl.distributed={mode}", *common)
        with ticking(clock, signal_at=4 if RANK == 1 else None):
            interrupted = loop.train(cfg, data, run_dir(cfg, "2026-01-01_00-00-00"), clock=clock)
        clock.now += 10_000.0  # downtime is free
        cfg = make_config(
            base, f"name={prefix}-{leg}", "resume=true", f"impl.distributed={resume_mode}", *common
        )
        results["interrupted" if leg == "resumed" else "crossed_interrupted"] = summary(interrupted)
        try:
            with ticking(clock):
                resumed = loop.train(cfg, data, run_dir(cfg, "2026-01-01_01-00-00"), clock=clock)
        except ConfigError as err:
            results[f"{leg}_error"] = str(err)
            continue
        results[leg] = summary(resumed)
    return results


def resumed_from_one(base: Path, data, optim: str, *overrides: str) -> dict:
    """The state one process saved under name=from-one-<optim> (2 updates of budget_then_resume's budget run,
    micro-batch 16 = 2 ranks x 8), resumed with resume=true by 2 FSDP2 ranks on budget_then_resume's clocks."""
    clock = FakeClock(60.0 if RANK == 0 else 20.0)
    common = ("budget=0.1", "train.batch_size=32", "train.batch_size_ramp=0", "train.log_every=1")
    cfg = make_config(
        base, f"name=from-one-{optim}", "resume=true", "impl.distributed=fsdp2", f"train/optim={optim}", *common,
        *overrides,
    )  # fmt: skip
    with ticking(clock):
        resumed = loop.train(cfg, data, run_dir(cfg, "2026-01-01_01-00-00"), clock=clock)
    return summary(resumed)


def refused(base: Path, data, *overrides: str) -> str | None:
    try:
        # a batch both ranks form exactly: 2 x 8 rows (a batch of 8 is refused before the settings under test)
        config = make_config(base, "budget=1", "train.steps=1", "train.batch_size=16", *overrides)
        loop.train(config, data, base / "refused")
    except ConfigError as err:
        return str(err)
    return None


def main() -> None:
    out, scenarios = Path(sys.argv[1]), sys.argv[2:]
    base = out / "runs"
    data = synthetic_data(base)
    # scenario `cuda`: every run on the GPU of its LOCAL_RANK (nccl), uncompiled to keep the test short
    cuda = ("impl.device=cuda", "impl.compile=false") if "cuda" in scenarios else ()
    results = {}
    if "ddp" in scenarios:
        results["ddp"] = steps(base, data, "name=ddp", *cuda)
        results["ddp_budget"] = budget_then_resume(base, data, "ddp", "ddp", *cuda)
    if "optimizers" in scenarios:
        for name in ("adamw_8bit", "galore_adamw"):
            overrides = (f"name={name}", f"train/optim={name}", "train.optim.rank=8", "train.steps=2", *cuda)
            results[name] = steps(base, data, *overrides)
        results["fsdp2_fp16_error"] = refused(base, data, "impl.precision=fp16", "impl.distributed=fsdp2")
        results["batch_error"] = refused(
            base, data, "train.batch_size=8"
        )  # 2 ranks x micro-batch 8 = 16 rows
    if "fsdp2" in scenarios:
        results["fsdp2"] = steps(base, data, "name=fsdp2", "impl.distributed=fsdp2", *cuda)
        results["fsdp2_budget"] = budget_then_resume(base, data, "fsdp2", "fsdp2", *cuda)
    if "lowbit" in scenarios:
        for name in LOWBIT_OPTIMIZERS:
            overrides = (
                f"name=fsdp2-{name}",
                f"train/optim={name}",
                f"train.steps={LOWBIT_STEPS}",
                LOWBIT_ARCH,
            )
            overrides += cuda
            results[f"fsdp2_{name}"] = steps(base, data, *overrides, "impl.distributed=fsdp2")
        for name in RESHARD_OPTIMIZERS:
            optim = (f"train/optim={name}", *(GALORE_SETTINGS if name.startswith("galore") else ()), *cuda)
            for mode in PARALLEL_MODES:  # 4-bit under FSDP2: also resumed with the same ranks
                legs = ("resumed", "crossed") if (name, mode) == ("adamw_4bit", "fsdp2") else ("crossed",)
                prefix = f"{mode}-{name}"
                results[f"{mode}_{name}_budget"] = budget_then_resume(
                    base, data, prefix, mode, *optim, legs=legs
                )
    if "galore" in scenarios:
        for name in GALORE_OPTIMIZERS:
            overrides = (
                f"name=fsdp2-{name}",
                f"train/optim={name}",
                f"train.steps={LOWBIT_STEPS}",
                LOWBIT_ARCH,
            )
            overrides += (*GALORE_SETTINGS, *cuda)
            results[f"fsdp2_{name}"] = steps(base, data, *overrides, "impl.distributed=fsdp2")
    if "layerwise" in scenarios:
        for name in LAYERWISE_OPTIMIZERS:
            for mode in PARALLEL_MODES:
                overrides = (
                    f"name={mode}-{name}",
                    f"train/optim={name}",
                    f"train.steps={LOWBIT_STEPS}",
                    LOWBIT_ARCH,
                    f"impl.distributed={mode}",
                )
                overrides += GALORE_SETTINGS if name.startswith("galore") else ()
                results[f"{mode}_{name}"] = steps(base, data, *overrides, *cuda)
        # one micro-batch per update (accumulation keeps every gradient between micro-batches)
        held: list[int] = []
        with held_gradients(held):
            overrides = ("name=ddp-held", "train/optim=adamw_layerwise", "train.batch_size=16", LOWBIT_ARCH)
            results["ddp_layerwise_held"] = steps(base, data, *overrides, *cuda)
        results["ddp_layerwise_held"]["most_gradient_bytes"] = max(held)
    if "from_one" in scenarios:
        for name in FROM_ONE_OPTIMIZERS:
            results[f"from_one_{name}"] = resumed_from_one(base, data, name, *cuda)
    if "fsdp2_held" in scenarios:
        # one micro-batch per update, as DDP's layerwise check (accumulation keeps every gradient between them)
        held = []
        overrides = ("name=fsdp2-held", "train.batch_size=16", LOWBIT_ARCH, f"arch.num_layers={HELD_LAYERS}")
        with fsdp2_held_gradients(held):
            results["fsdp2_held"] = steps(base, data, *overrides, "impl.distributed=fsdp2", *cuda)
        results["fsdp2_held"]["gradient_bytes"] = held
    (out / f"rank{RANK}.json").write_text(json.dumps(results, indent=1))
    shutdown()


if __name__ == "__main__":
    main()
