"""The 4-bit second moment's rank-1 scales under FSDP2: per-shard column maxima against the whole matrix's.

    python scripts/studies/rank1_shards.py

FSDP2 splits a matrix's rows over the ranks. Each rank can take the column maxima over its own rows (the
per-shard form cramming uses, no communication) or all-reduce them to the whole matrix's. This quantizes one
second moment both ways and prints the median relative error of the decoded v and the relative error of
sqrt(v) (what the update divides by), for the whole matrix and for 2 and 8 row shards. v has row and column
structure over four decades, as a weight's squared gradients have.
"""

from __future__ import annotations

import torch

from cramming.optim.lowbit import Maps4bit
from cramming.optim.quant import dequantize_rank1, quantize_rank1

SHAPES = ((200, 64), (768, 768), (3072, 768))  # the test model's embedding; bert-base's attention, FFN


def second_moment(rows: int, cols: int) -> torch.Tensor:
    """A positive (rows, cols) v: row scale x column scale (each over four decades) x noise."""
    row = 10 ** (torch.rand(rows, 1) * 4 - 3)
    col = 10 ** (torch.rand(1, cols) * 4 - 3)
    return row * col * torch.rand(rows, cols) ** 2


def errors(v: torch.Tensor, shards: int, maps: Maps4bit) -> tuple[float, float]:
    """(median |v' - v| / v, ||sqrt v' - sqrt v|| / ||sqrt v||) with rank-1 scales per row shard."""
    decoded = []
    for part in torch.tensor_split(v, shards, dim=0):
        codes, row, col = quantize_rank1(part, maps.v)
        decoded.append(dequantize_rank1(codes, row, col, maps.v))
    back = torch.cat(decoded)
    relative = ((back - v).abs() / v).median().item()
    root = ((back.sqrt() - v.sqrt()).norm() / v.sqrt().norm()).item()
    return relative, root


def main() -> None:
    torch.manual_seed(0)
    maps = Maps4bit.build()
    print("| shape | whole matrix | 2 row shards | 8 row shards |  (median rel. error of v; of sqrt v)")
    print("|---|---:|---:|---:|")
    for rows, cols in SHAPES:
        v = second_moment(rows, cols)
        cells = [errors(v, shards, maps) for shards in (1, 2, 8)]
        print(f"| {rows} x {cols} | " + " | ".join(f"{a:.3f}; {b:.3f}" for a, b in cells) + " |")


if __name__ == "__main__":
    main()
