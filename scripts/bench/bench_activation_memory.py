"""What one micro-batch of the real run's model holds: the memory a GPU needs per sequence, measured on a CPU.

    python scripts/bench/bench_activation_memory.py [--arch crammed-bert] [--vocab 32768]
        [--out results/real-run/gpu-memory.md]

Builds the model of `arch` (cramming.model.build_model) and counts, with autograd's saved-tensor hooks, the bytes
of every tensor its training forward keeps for backward (distinct storages, so a view is counted once), at
micro-batches of 2, 4 and 8 rows of 128 tokens with the recipe's count masking (32 predicted positions a row),
in bf16 autocast and in fp32. A straight line through the three gives the bytes per sequence (the slope) and what
any micro-batch keeps (the intercept: in autocast, the half-precision copies of the weights). Then, in a fresh
process per size, the peak resident memory of three fp32 training steps (forward, backward, AdamW) at
micro-batches of 8 and 16: its growth per sequence, against the saved tensors', says how much backward's
temporaries add. The fixed part of a run is counted from the parameters: fp32 weights, gradients and AdamW's
two moments. The reference of the ratios is the fp32 saved-tensor slope of the same run.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

import torch
from omegaconf import OmegaConf

REPO = Path(__file__).resolve().parents[2]
SEQ, PREDICTED = 128, 32
SIZES = (2, 4, 8)
PEAK_SIZES = (8, 16)
MB = 1e6


def model_and_batch(arch: str, vocab: int, rows: int, seed: int = 0):
    """The arch's model in training mode and one micro-batch: token ids, and labels at PREDICTED positions."""
    from cramming.model import build_model
    from cramming.model.config import ArchConfig

    cfg = OmegaConf.merge(
        OmegaConf.structured(ArchConfig), OmegaConf.load(REPO / "conf" / "arch" / f"{arch}.yaml")
    )
    # dropout 0: pretraining runs without it (train.dropout), which lets attention keep no (seq, seq) matrix
    model = build_model(OmegaConf.to_object(cfg), vocab, dropout=0.0).train()
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(5, vocab, (rows, SEQ), generator=generator)
    labels = torch.full_like(ids, -100)
    picked = torch.rand(rows, SEQ, generator=generator).argsort(dim=1)[:, :PREDICTED]
    labels.scatter_(1, picked, ids.gather(1, picked))
    return model, ids, labels


def saved_bytes(model, ids, labels, dtype: torch.dtype) -> int:
    """Bytes of the distinct storages the forward saves for backward."""
    from cramming.optim.step import autocast

    storages: dict[int, int] = {}

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        storage = tensor.untyped_storage()
        storages[storage.data_ptr()] = storage.nbytes()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), autocast("cpu", dtype):
        model(ids, labels, predicted_per_row=PREDICTED).loss.backward()
    return sum(storages.values())


def line(xs: tuple[int, ...], ys: list[float]) -> tuple[float, float]:
    """(slope, intercept) of the least-squares line."""
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / sum((x - mx) ** 2 for x in xs)
    return slope, my - slope * mx


PEAK_CHILD = """
import importlib.util, resource, torch
spec = importlib.util.spec_from_file_location("bench", {script!r})
bench = importlib.util.module_from_spec(spec)
spec.loader.exec_module(bench)
model, ids, labels = bench.model_and_batch({arch!r}, {vocab}, {rows})
PREDICTED = bench.PREDICTED
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
for _ in range(3):
    model(ids, labels, predicted_per_row=PREDICTED).loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)
"""


def peak_bytes(arch: str, vocab: int, rows: int) -> int:
    """Peak resident bytes of a fresh process that runs three fp32 training steps at `rows` sequences."""
    code = PEAK_CHILD.format(script=str(Path(__file__).resolve()), arch=arch, vocab=vocab, rows=rows)
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, check=True)
    return int(done.stdout.split()[-1])


def measure(args: argparse.Namespace) -> dict:
    torch.set_num_threads(args.threads)
    result = {"arch": args.arch, "vocab": args.vocab, "saved": {}, "peak": {}}
    for name, dtype in (("bf16", torch.bfloat16), ("fp32", torch.float32)):
        ys = []
        for rows in SIZES:
            model, ids, labels = model_and_batch(args.arch, args.vocab, rows)
            ys.append(saved_bytes(model, ids, labels, dtype))
        result["saved"][name] = {"bytes": ys, "per_sequence": line(SIZES, ys)[0], "fixed": line(SIZES, ys)[1]}
    result["parameters"] = sum(p.numel() for p in model.parameters())
    result["peak"] = {rows: peak_bytes(args.arch, args.vocab, rows) for rows in PEAK_SIZES}
    return result


def page(result: dict, args: argparse.Namespace) -> str:
    saved, params = result["saved"], result["parameters"]
    bf16, fp32 = saved["bf16"]["per_sequence"], saved["fp32"]["per_sequence"]
    peak_slope = (result["peak"][16] - result["peak"][8]) / (16 - 8)
    fixed = params * 16  # fp32 weights, gradients, two AdamW moments
    lines = [
        f"# What a micro-batch of {args.arch} holds (vocabulary {args.vocab:,}, {SEQ} tokens a row)",
        "",
        f"`python scripts/bench/bench_activation_memory.py {' '.join(sys.argv[1:])}`, torch {torch.__version__},"
        f" on a CPU, {args.threads} thread(s).",
        "",
        f"- Parameters: {params:,}: fp32 weights, gradients and AdamW's two moments {fixed / 1e9:.2f} GB whatever"
        f" the micro-batch; under bf16 or fp16 autocast also the half-precision weight copies the forward saves"
        f" ({saved['bf16']['fixed'] / 1e9:.2f} GB, the bf16 line's intercept).",
        f"- Saved for backward, per sequence: **{bf16 / MB:.1f} MB in bf16 autocast**, {fp32 / MB:.1f} MB in fp32"
        f" ({bf16 / fp32:.2f}x); at micro-batches {', '.join(map(str, SIZES))}: bf16"
        f" {', '.join(f'{b / MB:,.0f}' for b in saved['bf16']['bytes'])} MB, fp32"
        f" {', '.join(f'{b / MB:,.0f}' for b in saved['fp32']['bytes'])} MB.",
        f"- Peak resident memory of three fp32 training steps: {result['peak'][8] / 1e9:.2f} GB at 8,"
        f" {result['peak'][16] / 1e9:.2f} GB at 16: {peak_slope / MB:.1f} MB per sequence,"
        f" {peak_slope / fp32:.2f}x the fp32 saved tensors (backward's temporaries on top).",
        "",
        "Estimated GPU peak (not measured on a GPU; before the CUDA context and the allocator's cache), bf16"
        f" autocast: {(fixed + saved['bf16']['fixed']) / 1e9:.2f} GB + micro-batch x {bf16 / MB:.1f} to"
        f" {bf16 * peak_slope / fp32 / MB:.1f} MB (the upper end with backward's temporaries in the fp32 ratio):",
        "",
        "| micro-batch | estimated peak, bf16 |",
        "|---:|---|",
    ]
    for rows in (32, 64, 128, 256):
        low = fixed + saved["bf16"]["fixed"] + rows * bf16
        high = fixed + saved["bf16"]["fixed"] + rows * bf16 * peak_slope / fp32
        lines.append(f"| {rows} | {low / 1e9:.1f}-{high / 1e9:.1f} GB |")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arch", default="crammed-bert")
    parser.add_argument("--vocab", type=int, default=32768)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", type=Path, default=REPO / "results" / "real-run" / "gpu-memory.md")
    args = parser.parse_args()
    result = measure(args)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(page(result, args))
    args.out.with_suffix(".json").write_text(json.dumps(result, indent=1) + "\n")
    print(page(result, args))


if __name__ == "__main__":
    main()
