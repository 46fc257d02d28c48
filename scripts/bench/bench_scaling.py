"""Tokens per second of pretraining updates on 1 vs N GPUs (DDP or FSDP2): the multi-GPU scaling check.

    torchrun --standalone --nproc_per_node=1 scripts/bench/bench_scaling.py                 # the 1-GPU baseline
    torchrun --standalone --nproc_per_node=8 scripts/bench/bench_scaling.py --mode fsdp2
    for n in 1 2 4 8; do torchrun --standalone --nproc_per_node=$n scripts/bench/bench_scaling.py --out results/step-speed/scaling.md; done

Each rank trains crammed-bert (or --arch) on random token rows (sequence 128, vocabulary 32768, the bert-o4
masking) with the loop's own pieces: cramming.ranks for the process group, cramming.train.parallel for the DDP /
FSDP2 wrapper and the gradient sync on the last of --accumulate micro-batches, and the loop's update
(cramming.optim.step.TrainStep through the MLM objective of cramming.train.mlm, rank-sliced masking); AdamW,
bf16 autocast on CUDA, clipping at 0.5. The first --warmup updates are not timed (compilation, NCCL set-up). Weak
scaling: the micro-batch per GPU is fixed, so the global batch grows with N, as the recipe's accumulation
count falls. Rank 0 prints one markdown row (and appends it to --out): GPUs, mode, global tokens/s, tokens/s
per GPU. Scaling efficiency = tokens/s per GPU at N / at 1. With one process there is no process group:
the baseline is the single-process path.

On CPU (gloo) it runs too, for a smoke test: --device cpu --arch tiny --microbatch 8.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch
import torch.distributed as dist

from cramming.config import arch_preset
from cramming.impl import PARALLEL_MODES, ImplConfig
from cramming.model import build_model
from cramming.optim import OptimConfig, build_optimizer
from cramming.optim.step import TrainStep
from cramming.ranks import init_from_env, shutdown
from cramming.train.config import MLMConfig
from cramming.train.mlm import MLMMasker, MLMObjective
from cramming.train.parallel import Parallel


def time_updates(args: argparse.Namespace) -> dict:
    parallel = Parallel(init_from_env(ImplConfig(device=args.device).torch_device(), args.mode))
    ranks = parallel.ranks
    device = ranks.device
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    torch.manual_seed(0)  # the same initial weights on every rank
    model = build_model(arch_preset(args.arch), args.vocab, device=device, dropout=0.0)
    model = parallel.shard(model, dtype)
    step_model = parallel.wrap(model)
    optimizer = build_optimizer(model, OptimConfig())
    if args.compile:
        step_model = torch.compile(step_model)
    masker = MLMMasker(MLMConfig(), args.vocab, (0, 1, 2, 3, 4), mask_id=4)
    objective = MLMObjective(masker, device, masker.predicted_per_row(args.seq))
    train_step = TrainStep(
        model, optimizer, device_type=device.type, dtype=dtype, grad_clip=0.5,
        grad_sync=parallel.grad_sync, reduce=parallel.reduce_update_stats,
    )  # fmt: skip
    generator = torch.Generator().manual_seed(0)
    rows = torch.randint(5, args.vocab, (args.microbatch, args.seq), generator=generator)
    batch = (torch.arange(len(rows)) + ranks.rank * len(rows), rows)  # this rank's stream rows
    seconds = []
    for step in range(args.warmup + args.steps):
        if device.type == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        train_step.begin(1.0, args.accumulate)
        while not train_step.complete:
            train_step.microbatch(objective, step_model, batch)
        train_step.apply()
        if device.type == "cuda":
            torch.cuda.synchronize()
        if step >= args.warmup:
            seconds.append(time.perf_counter() - start)
    median = torch.tensor(statistics.median(seconds))
    if ranks.active:  # the slowest rank sets the pace
        dist.all_reduce(median, op=dist.ReduceOp.MAX)
    tokens = args.microbatch * args.accumulate * args.seq * ranks.world_size
    return {
        "ranks": ranks,
        "ms": 1000 * median.item(),
        "tok_per_s": tokens / median.item(),
        "per_gpu": tokens / median.item() / ranks.world_size,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arch", default="crammed-bert")
    parser.add_argument("--mode", default="ddp", choices=PARALLEL_MODES)
    parser.add_argument("--microbatch", type=int, default=128, help="sequences per micro-batch on each GPU")
    parser.add_argument("--accumulate", type=int, default=4, help="micro-batches per update")
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--vocab", type=int, default=32768)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--device", default="auto")
    parser.add_argument("--compile", action="store_true")
    parser.add_argument("--out", type=Path, default=None, help="append the row to this markdown file")
    args = parser.parse_args()
    result = time_updates(args)
    ranks = result["ranks"]
    if ranks.is_main:
        name = torch.cuda.get_device_name() if ranks.device.type == "cuda" else "cpu"
        row = (
            f"| {name} | {ranks.world_size} | {args.mode if ranks.active else '-'} | {args.arch} |"
            f" {args.microbatch} x {args.accumulate} | {result['ms']:.0f} | {result['tok_per_s']:,.0f} |"
            f" {result['per_gpu']:,.0f} |"
        )
        header = (
            "| device | processes | mode | arch | micro-batch x accumulation per GPU | ms / update | tokens/s"
            " | tokens/s per process |\n|---|---:|---|---|---|---:|---:|---:|"
        )
        print(header + "\n" + row, flush=True)
        if args.out is not None:
            new = not args.out.exists()
            with open(args.out, "a", encoding="utf-8") as f:
                f.write((header + "\n" if new else "") + row + "\n")
    shutdown()


if __name__ == "__main__":
    main()
