"""Optimizer state per rank under DDP and FSDP2, measured from the state tensors after one step (2 CPU ranks).

    torchrun --standalone --nproc_per_node=2 scripts/bench/bench_fsdp2_memory.py [--arch bert-base] [--vocab 32768]
        [--optimizers adamw adamw_8bit ...] [--modes ddp fsdp2]

Builds the model of `arch` on every rank, wraps it as `impl.distributed=ddp` or shards it as
`impl.distributed=fsdp2` does (cramming.train.parallel.Parallel.shard), gives each parameter a
random gradient, takes one step of each optimizer and prints, on rank 0, a markdown row per optimizer: the
whole state of one process (predicted exactly, as the start-up log line does), what each rank holds, and
what each rank holds (one process's state under DDP, a shard's under FSDP2). No data and no forward pass.
"""

from __future__ import annotations

import argparse

import torch
import torch.distributed as dist
from hydra import compose, initialize_config_dir

from cramming.config import CONF_DIR, register_configs, validate
from cramming.model import build_model
from cramming.optim import build_optimizer, optimizer_state_report
from cramming.ranks import Ranks, init_from_env, shutdown
from cramming.train.parallel import Parallel

# row label -> train/optim and overrides; GaLore at its default rank 128, with the config's `std` sides
# (FFN down, 768 x 3072, is projected on the left: replicated moments) and with every weight on the right
OPTIMIZERS = {
    "adamw": ("adamw",),
    "adamw_8bit": ("adamw_8bit",),
    "adamw_4bit": ("adamw_4bit",),
    "galore_adamw": ("galore_adamw",),
    "galore_adamw, proj_type=right": ("galore_adamw", "train.optim.proj_type=right"),
    "galore_adamw_8bit": ("galore_adamw_8bit",),
    "galore_adamw_8bit, proj_type=right": ("galore_adamw_8bit", "train.optim.proj_type=right"),
    "galore_adamw_4bit, proj_type=right": ("galore_adamw_4bit", "train.optim.proj_type=right"),
    "galore_adafactor, proj_type=right": ("galore_adafactor", "train.optim.proj_type=right"),
}


def config(arch: str, optim: str, *overrides: str):
    register_configs()
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        overrides = [f"arch={arch}", f"train/optim={optim}", "impl.device=cpu", *overrides]
        return validate(compose("pretrain", overrides=overrides))


def per_rank_bytes(cfg, vocab: int, ranks: Ranks) -> tuple[int, list[int], int]:
    """(one process's state bytes, each rank's measured state bytes, parameters)."""
    torch.manual_seed(0)
    whole = optimizer_state_report(build_optimizer(build_model(cfg.arch, vocab), cfg.train.optim))
    model = Parallel(ranks).shard(build_model(cfg.arch, vocab), torch.float32)
    optimizer = build_optimizer(model, cfg.train.optim)
    for param in model.parameters():
        param.grad = torch.ones_like(param)  # the state's size does not depend on the values
    optimizer.step()
    mine = torch.tensor([optimizer_state_report(optimizer)["state_bytes"]], dtype=torch.int64)
    gathered = [torch.zeros_like(mine) for _ in range(ranks.world_size)]
    dist.all_gather(gathered, mine)
    return whole["state_bytes"], [int(t.item()) for t in gathered], whole["params"]


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--arch", default="bert-base")
    parser.add_argument("--vocab", type=int, default=32768)
    parser.add_argument("--optimizers", nargs="+", default=list(OPTIMIZERS), choices=list(OPTIMIZERS))
    parser.add_argument("--modes", nargs="+", default=["ddp", "fsdp2"], choices=["ddp", "fsdp2"])
    args = parser.parse_args()
    rows = []
    for mode in args.modes:
        ranks = init_from_env(torch.device("cpu"), mode)
        for optim in args.optimizers:
            whole, each, params = per_rank_bytes(config(args.arch, *OPTIMIZERS[optim]), args.vocab, ranks)
            share = params / ranks.world_size if mode == "fsdp2" else params  # parameters a rank updates
            mib = 2.0**20
            held = " / ".join(f"{b / mib:.1f} MiB ({100 * b / whole:.1f}%)" for b in each)
            rows.append(
                f"| {optim} | {mode}, {ranks.world_size} CPU ranks | {whole / mib:.1f} | {held} |"
                f" {max(each) / share:.2f} |"
            )
    if ranks.is_main:
        print(f"{args.arch}, vocab {args.vocab}, {params / 1e6:.1f}M parameters")
        print(
            "| optimizer | mode | one process MiB | each rank: MiB (share of one process's) | B/param of the rank's share |"
        )
        print("|---|---|---:|---|---:|")
        print("\n".join(rows))
    shutdown()


if __name__ == "__main__":
    main()
