"""Tokens per second of one training update (mask + forward + backward + clip + AdamW step), per arch.

    python scripts/bench_step.py                                   # tiny and crammed-bert, micro-batch 8
    python scripts/bench_step.py --arch crammed-bert --microbatch 128 --steps 20 --device cuda

Random token rows (sequence 128, vocabulary 32768), the bert-o4 masking (25%, sparse prediction), the
default optimizer; the first `--warmup` updates are not timed. Prints a markdown table. On a shared CPU the
figures move with the load: run it alone, and say how many threads it had (--threads).
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch
from omegaconf import OmegaConf

from cramming.model import ArchConfig, build_model, count_parameters
from cramming.optim import OptimConfig, build_optimizer
from cramming.train.config import MLMConfig
from cramming.train.mlm import MLMMasker

CONF = Path(__file__).resolve().parent.parent / "conf" / "arch"


def load_arch(name: str) -> ArchConfig:
    return OmegaConf.to_object(
        OmegaConf.merge(OmegaConf.structured(ArchConfig), OmegaConf.load(CONF / f"{name}.yaml"))
    )


def time_updates(arch: ArchConfig, args: argparse.Namespace) -> dict:
    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    model = build_model(arch, args.vocab, device=device, dropout=0.0)
    optimizer = build_optimizer(model, OptimConfig())
    masker = MLMMasker(MLMConfig(), args.vocab, (0, 1, 2, 3, 4), mask_id=4)
    generator = torch.Generator().manual_seed(0)
    rows = torch.randint(5, args.vocab, (args.microbatch, args.seq), generator=generator)
    seconds = []
    for step in range(args.warmup + args.steps):
        if device.type == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        input_ids, labels = masker(rows, generator)
        with torch.autocast(device.type, dtype=dtype, enabled=dtype != torch.float32):
            loss = model(input_ids.to(device), labels.to(device)).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if device.type == "cuda":
            torch.cuda.synchronize()
        if step >= args.warmup:
            seconds.append(time.perf_counter() - start)
    median = statistics.median(seconds)
    return {
        "arch": arch.name,
        "params": count_parameters(model) / 1e6,
        "ms": 1000 * median,
        "tok_per_s": args.microbatch * args.seq / median,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arch", nargs="+", default=["tiny", "crammed-bert"])
    parser.add_argument("--microbatch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--vocab", type=int, default=32768)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    print(
        f"device {args.device}, {torch.get_num_threads()} threads, micro-batch {args.microbatch} x {args.seq} tokens,"
        f" vocab {args.vocab}, median of {args.steps} updates after {args.warmup} warm-up\n"
    )
    print("| arch | parameters | ms / update | tokens/s |")
    print("|---|---:|---:|---:|")
    for name in args.arch:
        r = time_updates(load_arch(name), args)
        print(f"| {r['arch']} | {r['params']:.1f}M | {r['ms']:.0f} | {r['tok_per_s']:,.0f} |", flush=True)


if __name__ == "__main__":
    main()
