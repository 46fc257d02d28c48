"""Optimizer-state memory and CPU step time of every optimizer, side by side, written as a markdown table.

    python scripts/bench_optim.py                  # crammed-BERT-sized parameter set; writes results/optim_memory.md
    python scripts/bench_optim.py --layers 2       # a scaled copy (quick look)
    python scripts/bench_optim.py --device cuda    # step times on the GPU (8-bit: the fused Triton kernel)

Memory: a stack of plain nn modules with the crammed-BERT parameter set (16 layers, hidden 768, QKV
768->2304, attention output 768->768, gated FFN up 768->3072 and down 1536->768, no biases, LayerNorms,
a 32768x768 embedding tied to the decoder). Each optimizer takes one real step on random gradients, and
its allocated state tensors are counted (the `step` counters left out); the ratios are against fp32
AdamW's 8 B/param, and torch AdamW is measured in the same run. "2-D weights" is the set GaLore projects
with target `all-linear`: every Linear except the tied decoder (the embedding is not in it).

Step time: the same optimizers on a smaller copy (4 layers, hidden 256, vocab 8192) on this CPU: the
median of 10 steps without an SVD (update_proj_gap 200), and the first step, which for GaLore includes
the SVDs. CPU times only rank the PyTorch paths; with --device cuda the 8-bit update runs as the fused
Triton kernel and the timed model is the full crammed-BERT set (each step then ends with a synchronize).
"""

from __future__ import annotations

import argparse
import gc
import importlib.util
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn

from cramming.optim import OptimConfig, build_optimizer, optimizer_state_report, param_groups

REPO = Path(__file__).resolve().parent.parent


def bert_sized_stack(layers: int, hidden: int, ffn: int, vocab: int) -> nn.Module:
    """The crammed-BERT parameter set from plain modules (no forward: gradients are set directly)."""
    model = nn.Module()
    model.embedding = nn.Embedding(vocab, hidden)
    model.embedding_norm = nn.LayerNorm(hidden)
    model.layers = nn.ModuleList()
    for _ in range(layers):
        block = nn.Module()
        block.norm1, block.norm2 = nn.LayerNorm(hidden), nn.LayerNorm(hidden)
        block.attn = nn.ModuleDict(
            {"qkv": nn.Linear(hidden, 3 * hidden, bias=False), "out": nn.Linear(hidden, hidden, bias=False)}
        )
        block.ffn = nn.ModuleDict(
            {"up": nn.Linear(hidden, ffn, bias=False), "down": nn.Linear(ffn // 2, hidden, bias=False)}
        )
        model.layers.append(block)
    model.final_norm = nn.LayerNorm(hidden)
    model.decoder = nn.Linear(hidden, vocab, bias=False)
    model.decoder.weight = model.embedding.weight
    return model


@dataclass
class Variant:
    label: str
    name: str  # a registry name, or "bitsandbytes"
    overrides: dict = field(default_factory=dict)


VARIANTS = [
    Variant("torch AdamW (fp32)", "adamw"),
    Variant("ours adamw_8bit", "adamw_8bit"),
    Variant("ours adamw_8bit, embedding 32-bit", "adamw_8bit", {"embedding_32bit": True}),
    Variant("bitsandbytes AdamW8bit", "bitsandbytes"),
    Variant("galore_adamw r128", "galore_adamw", {"rank": 128}),
    Variant("galore_adamw r4", "galore_adamw", {"rank": 4}),
    Variant("galore_adamw_8bit r128", "galore_adamw_8bit", {"rank": 128}),
    Variant("galore_adamw_8bit r4", "galore_adamw_8bit", {"rank": 4}),
    Variant("galore_adafactor r128", "galore_adafactor", {"rank": 128}),
]


def build(model: nn.Module, variant: Variant, kernel: str = "torch") -> torch.optim.Optimizer | None:
    if variant.name == "bitsandbytes":
        if importlib.util.find_spec("bitsandbytes") is None:
            return None
        import bitsandbytes as bnb

        return bnb.optim.AdamW8bit(param_groups(model, 0.01), lr=1e-3, betas=(0.9, 0.98), eps=1e-12)
    cfg = OptimConfig(name=variant.name, update_proj_gap=200, **variant.overrides)
    return build_optimizer(model, cfg, kernel=kernel)


def linear_weights(model: nn.Module) -> list[nn.Parameter]:
    tied = model.embedding.weight
    return [m.weight for m in model.modules() if isinstance(m, nn.Linear) and m.weight is not tied]


def state_bytes(optimizer: torch.optim.Optimizer, params: list[torch.Tensor]) -> int:
    total = 0
    for p in params:
        for key, value in optimizer.state.get(p, {}).items():
            if torch.is_tensor(value) and key != "step":
                total += value.numel() * value.element_size()
    return total


def set_random_grads(model: nn.Module) -> None:
    for p in model.parameters():
        p.grad = torch.randn_like(p) * 1e-3


def measure_memory(model: nn.Module) -> dict[str, dict]:
    params = list(model.parameters())
    weights2d = linear_weights(model)
    n_all, n_2d = sum(p.numel() for p in params), sum(p.numel() for p in weights2d)
    rows = {}
    for variant in VARIANTS:
        opt = build(model, variant)
        if opt is None:
            rows[variant.label] = None
            continue
        predicted = optimizer_state_report(opt)["state_bytes"] if variant.name != "bitsandbytes" else None
        set_random_grads(model)
        start = time.perf_counter()
        opt.step()
        first_step = time.perf_counter() - start
        total, on_2d = state_bytes(opt, params), state_bytes(opt, weights2d)
        if predicted is not None and predicted != total:
            raise AssertionError(
                f"{variant.label}: the report predicted {predicted} B, the step allocated {total} B"
            )
        rows[variant.label] = {
            "bytes": total,
            "per_param": total / n_all,
            "ratio": total / (8 * n_all),
            "ratio_2d": on_2d / (8 * n_2d),
            "first_step_s": first_step,
        }
        print(f"  {variant.label}: {total / 2**20:.1f} MiB, first step {first_step:.1f} s", file=sys.stderr)
        del opt
        gc.collect()
    return rows


def _timed_step(opt: torch.optim.Optimizer, device: torch.device) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    opt.step()
    if device.type == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - start


def measure_time(model: nn.Module, steps: int = 10) -> dict[str, tuple[float, float]]:
    device = next(model.parameters()).device
    times = {}
    for variant in VARIANTS:
        opt = build(model, variant, kernel="auto")
        if opt is None:
            continue
        set_random_grads(model)
        first = _timed_step(opt, device)  # allocates the state; GaLore: the SVDs
        samples = []
        for _ in range(steps):
            set_random_grads(model)
            samples.append(_timed_step(opt, device))
        times[variant.label] = (statistics.median(samples), first)
        del opt
        gc.collect()
    return times


def table(mem: dict, times: dict, n_all: int, n_2d: int) -> str:
    lines = [
        f"| optimizer | state MiB | B/param | vs fp32 AdamW (all {n_all / 1e6:.1f}M) | vs fp32 AdamW (2-D weights, "
        f"{n_2d / 1e6:.1f}M) | step ms | first step ms (incl. SVD) |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for label, row in mem.items():
        if row is None:
            lines.append(f"| {label} | not installed | | | | | |")
            continue
        step, first = times.get(label, (float("nan"), float("nan")))
        lines.append(
            f"| {label} | {row['bytes'] / 2**20:.1f} | {row['per_param']:.2f} | {100 * row['ratio']:.1f}% | "
            f"{100 * row['ratio_2d']:.1f}% | {1e3 * step:.1f} | {1e3 * first:.1f} |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=16)
    # one thread: on a shared CPU more threads mostly contend (2 threads ran SVDs 5x slower here)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--device", default="cpu", help="where the step times are taken (cpu or cuda)")
    parser.add_argument("--out", type=Path, default=REPO / "results" / "optim_memory.md")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)

    big = bert_sized_stack(args.layers, hidden=768, ffn=3072, vocab=32768)
    n_all = sum(p.numel() for p in big.parameters())
    n_2d = sum(p.numel() for p in linear_weights(big))
    print(f"memory: {args.layers} layers, {n_all / 1e6:.1f}M parameters", file=sys.stderr)
    with torch.no_grad():
        mem = measure_memory(big)
    del big
    gc.collect()
    device = torch.device(args.device)
    if device.type == "cuda":
        timing_model = bert_sized_stack(16, hidden=768, ffn=3072, vocab=32768).to(device)
    else:
        timing_model = bert_sized_stack(4, hidden=256, ffn=1024, vocab=8192)
    timed = f"{sum(p.numel() for p in timing_model.parameters()) / 1e6:.1f}M parameters on {device}"
    print(f"time: {timed}", file=sys.stderr)
    with torch.no_grad():
        times = measure_time(timing_model)

    command = "python scripts/bench_optim.py " + " ".join(sys.argv[1:])
    text = (
        "# Optimizer-state memory and CPU step time\n\n"
        f"Command: `{command.strip()}` ({args.threads} CPU threads, torch {torch.__version__}).\n"
        f"Memory on the crammed-BERT parameter set ({args.layers} layers, hidden 768, vocab 32768, "
        f"{n_all / 1e6:.1f}M parameters), counted from the state each optimizer allocated in one real step; "
        f"step times with {timed} (median of 10 steps without SVD, and the first step).\n"
        "Targets (issue 5): AdamW 8-bit <= 2.1 B/param; GaLore 8-bit at rank 128 <= 20% of fp32 AdamW on the "
        "2-D weights.\n\n" + table(mem, times, n_all, n_2d) + "\n"
    )
    print(text)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(text)


if __name__ == "__main__":
    main()
