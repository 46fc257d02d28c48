"""Which parameters' optimizer states move exactly between one process and N FSDP2 ranks, and which are
re-quantized (cramming.optim.reshard), for the real model shapes.

    python scripts/checks/reshard_counts.py [arch ...]      (default: bert-tiny bert-base)

For each arch and low-bit optimizer: one step of one process on random gradients gives a whole state; it is
cut into each of N ranks' states (whole -> N: a one-process or DDP state resumed under FSDP2) and those are
merged back (N -> whole: an FSDP2 state resumed in one process or under DDP). Prints, per direction, how many
parameters with a quantized state moved exactly, and the re-quantized ones with the moments ("m", "v") that
were. Parameters whose state is fp32 (fewer than min_8bit_size elements; GaLore's fp32 projectors) always move
exactly and are counted apart. The ranks' 4-bit second moments are stored as a rank stores them, with the
column maxima of its own rows; merged, they take the whole matrix's, and the line gives the share of values
that keep their value.
"""

from __future__ import annotations

import sys
import tempfile

import torch
from hydra import compose as hydra_compose
from hydra import initialize_config_dir

from cramming.config import CONF_DIR, register_configs, validate
from cramming.model import build_model
from cramming.optim import build_optimizer
from cramming.optim.lowbit import Maps4bit, decode_4bit, encode_second_moment_4bit
from cramming.optim.reshard import Layout, cut, merge

OPTIMIZERS = ("adamw_8bit", "adamw_4bit", "galore_adamw_8bit", "galore_adamw_4bit")
WORLD_SIZES = (2, 4, 8)
VOCAB = 32768  # cramming's tokenizer
MAPS = Maps4bit.build()


def compose(arch: str, optim: str):
    register_configs()
    with (
        tempfile.TemporaryDirectory() as base,
        initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"),
    ):
        return validate(
            hydra_compose("pretrain", overrides=[f"arch={arch}", f"train/optim={optim}", f"base_dir={base}"])
        )


def counts(arch: str, optim: str) -> list[str]:
    cfg = compose(arch, optim)
    torch.manual_seed(0)
    model = build_model(cfg.arch, VOCAB)
    optimizer = build_optimizer(model, cfg.train.optim)
    for param in model.parameters():  # rows over four decades, as a weight's gradients spread
        rows = 10 ** (torch.rand(param.shape[:1]) * 4 - 3)
        param.grad = torch.randn_like(param) * rows.view(-1, *[1] * (param.ndim - 1)).reshape(
            param.shape[:1] + (1,) * (param.ndim - 1)
        )
    optimizer.step()
    names = {id(p): n for n, p in model.named_parameters()}
    lines = []
    for world_size in WORLD_SIZES:
        tally = {"cut": [0, [], 0], "merge": [0, [], 0]}  # exact, re-quantized, fp32
        kept, total = 0, 0
        for group in optimizer.param_groups:
            for param in group["params"]:
                whole = optimizer.state[param]
                layout = Layout.of(tuple(param.shape), world_size, group)
                pieces = []
                quantized = "m_codes" in whole
                for rank in range(world_size):
                    piece, moments = cut(whole, layout, rank)
                    if (
                        "v_row" in piece and layout.moments_sharded
                    ):  # as a rank stores it: its own column maxima
                        shape = layout.moment_piece_shape(rank)
                        piece.update(
                            encode_second_moment_4bit(decode_4bit(piece, shape, MAPS)[1], shape, MAPS)
                        )
                    pieces.append(piece)
                    if moments:
                        tally["cut"][1].append(f"{names[id(param)]} ({'+'.join(moments)})")
                merged, moments = merge(pieces, layout)
                if moments:
                    tally["merge"][1].append(f"{names[id(param)]} ({'+'.join(moments)})")
                for direction in ("cut", "merge"):
                    listed = {entry.split(" ")[0] for entry in tally[direction][1]}
                    if not quantized:
                        tally[direction][2] += 1
                    elif names[id(param)] not in listed:
                        tally[direction][0] += 1
                if quantized and "v_row" in merged and layout.moments_sharded:
                    shape = layout.moment_shape
                    before = torch.cat(
                        [decode_4bit(p, layout.moment_piece_shape(r), MAPS)[1] for r, p in enumerate(pieces)]
                    )
                    after = decode_4bit(merged, shape, MAPS)[1]
                    kept, total = kept + int((before == after).sum()), total + before.numel()
        for direction, (exact, requantized, fp32) in tally.items():
            arrow = f"1 -> {world_size}" if direction == "cut" else f"{world_size} -> 1"
            unique = sorted(set(requantized))
            lines.append(
                f"| {arch} | {optim} | {arrow} | {exact} | {len(unique)} | {fp32} | "
                + (", ".join(unique[:3]) + (" ..." if len(unique) > 3 else "") or "-")
                + (f" (4-bit v values kept: {kept / total:.1%})" if total and direction == "merge" else "")
                + " |"
            )
    return lines


def main() -> None:
    archs = sys.argv[1:] or ["bert-tiny", "bert-base"]
    print(
        "| arch | optimizer | ranks | quantized, exact | re-quantized | fp32 (exact) | re-quantized moments |"
    )
    print("|---|---|---|---|---|---|---|")
    for arch in archs:
        for optim in OPTIMIZERS:
            for line in counts(arch, optim):
                print(line, flush=True)


if __name__ == "__main__":
    main()
