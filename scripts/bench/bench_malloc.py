"""What glibc's allocator costs a CPU training step, and what `impl.keep_freed_memory` saves.

    python scripts/bench/bench_malloc.py                                  # the CPU study's bert-tiny step
    python scripts/bench/bench_malloc.py --set attention_bias=alibi num_layers=4 --rounds 5  # another shape
    python scripts/bench/bench_malloc.py --out results/step-speed/cpu-malloc.md         # also write the rounds

A CPU training step frees and reallocates the same tensors every time. glibc gives each block over its
mmap threshold (at most 32 MiB after the first frees) a mapping of its own, unmaps it on free() and maps it
again on the next malloc(), and the kernel hands back zeroed pages one fault at a time. `impl.keep_freed_memory`
(on by default; `cramming.impl.keep_freed_memory`) has glibc serve every block from its heap and keep what is
freed, so the next step reuses it.

The allocator's settings are per process and cannot be put back once changed, so each measurement is a child
process: it builds the model, runs warm-up steps, then times `--steps` updates of the training loop's own step
(cramming.optim.step.TrainStep: autocast in the precision impl.precision=auto picks, backward, clipping, AdamW)
on one fixed masked micro-batch, with or without the setting. Children alternate (system, kept, system,
kept, ...) so load that comes and goes hits both alike; the ratio kept/system is taken per round and its
median reported, beside the page faults per step, the share of the time spent in the kernel and the peak
resident memory of each. The rows are random tokens: the step's cost does not depend on which tokens.
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def child(args: argparse.Namespace) -> dict:
    """One measurement in this process: steps/s, faults/step, kernel share, peak RSS."""
    import torch

    # bench_pretrain sits beside this file, first on sys.path when it runs as a script
    from bench_pretrain import MASK_ID, SPECIAL

    from cramming.config import arch_preset
    from cramming.impl import ImplConfig, keep_freed_memory
    from cramming.model import build_model
    from cramming.optim import OptimConfig, build_optimizer
    from cramming.optim.step import TrainStep
    from cramming.train.config import MLMConfig
    from cramming.train.mlm import MLMMasker

    if args.child == "kept" and not keep_freed_memory()[0]:
        raise SystemExit("impl.keep_freed_memory does not apply here (not glibc): nothing to compare")
    torch.set_num_threads(args.threads)
    arch = arch_preset(args.arch, args.set)
    device = torch.device("cpu")
    dtype = ImplConfig(device="cpu").compute_dtype(device)
    torch.manual_seed(0)
    model = build_model(arch, args.vocab, device=device, dropout=0.0)
    step = TrainStep(
        model, build_optimizer(model, OptimConfig()), device_type="cpu", dtype=dtype, grad_clip=0.5
    )
    masker = MLMMasker(MLMConfig(), args.vocab, SPECIAL, MASK_ID)
    k = masker.predicted_per_row(args.seq)
    ids = torch.randint(
        len(SPECIAL), args.vocab, (args.microbatch, args.seq), generator=torch.Generator().manual_seed(0)
    )
    corrupted, labels = masker(ids, torch.arange(args.microbatch))

    def update() -> None:
        step.begin()
        step.microbatch(lambda: (model(corrupted, labels, predicted_per_row=k).loss,))
        step.apply()

    for _ in range(args.warmup):
        update()
    before, start = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
    for _ in range(args.steps):
        update()
    seconds, after = time.perf_counter() - start, resource.getrusage(resource.RUSAGE_SELF)
    return {
        "steps_per_s": args.steps / seconds,
        "faults_per_step": (after.ru_minflt - before.ru_minflt) / args.steps,
        "kernel_share": (after.ru_stime - before.ru_stime) / seconds,
        "peak_rss_mib": after.ru_maxrss / 1024,
        "precision": str(dtype).removeprefix("torch."),
    }


def measure(mode: str, args: argparse.Namespace) -> dict:
    command = [sys.executable, __file__, "--child", mode, *sys.argv[1:]]
    done = subprocess.run(command, capture_output=True, text=True, cwd=REPO)
    if done.returncode != 0:
        raise SystemExit(f"the {mode} child failed:\n{done.stderr[-2000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--arch", default="bert-tiny", help="a conf/arch file (default: bert-tiny)")
    parser.add_argument("--set", nargs="*", default=["attention_bias=alibi"], help="arch overrides key=value")
    parser.add_argument("--vocab", type=int, default=8192, help="the CPU study's vocabulary")
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--microbatch", type=int, default=64)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--steps", type=int, default=60, help="timed updates per child")
    parser.add_argument("--rounds", type=int, default=3, help="pairs of children (system, kept)")
    parser.add_argument(
        "--out", type=Path, help="also write the rounds and the summary to this markdown file"
    )
    parser.add_argument("--child", choices=("system", "kept"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(child(args)))
        return
    rounds, lines = [], []
    for r in range(args.rounds):
        pair = {mode: measure(mode, args) for mode in ("system", "kept")}
        rounds.append(pair)
        s, k = pair["system"], pair["kept"]
        lines.append(
            f"round {r + 1}: system {s['steps_per_s']:.2f} steps/s, {s['faults_per_step']:,.0f} faults/step, "
            f"kernel {s['kernel_share']:.0%}, {s['peak_rss_mib']:.0f} MiB | kept {k['steps_per_s']:.2f} steps/s, "
            f"{k['faults_per_step']:,.0f} faults/step, kernel {k['kernel_share']:.0%}, {k['peak_rss_mib']:.0f} MiB "
            f"| kept/system {k['steps_per_s'] / s['steps_per_s']:.3f}"
        )
        print(lines[-1], flush=True)
    ratios = [p["kept"]["steps_per_s"] / p["system"]["steps_per_s"] for p in rounds]
    lines.append(
        f"{args.arch} {' '.join(args.set)}, micro-batch {args.microbatch} x {args.seq}, {args.threads} thread(s), "
        f"{rounds[0]['system']['precision']}: impl.keep_freed_memory makes a step {statistics.median(ratios):.3f}x "
        f"as fast (median of {len(ratios)} rounds, range {min(ratios):.3f}-{max(ratios):.3f})"
    )
    print(lines[-1])
    if args.out:
        from cramming.job.runcard import cpu_model

        command = " ".join(["python", "scripts/bench/bench_malloc.py", *sys.argv[1:]])
        header = [
            "# What glibc's allocator costs a CPU training step (`impl.keep_freed_memory`)",
            "",
            f"`{command}` on {cpu_model()}, {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}.",
            "Each side of a round is its own process (the setting cannot be undone); rounds alternate.",
            "",
        ]
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text("\n".join(header + [f"- {line}" for line in lines]) + "\n")


if __name__ == "__main__":
    main()
