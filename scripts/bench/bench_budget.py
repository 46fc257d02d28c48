"""The cramming question: for the same wall-clock budget on the same data, how far does each recipe get?

    python scripts/bench/bench_budget.py                         # CPU: tiny shapes, 10 minutes per recipe
    python scripts/bench/bench_budget.py --minutes 5 --threads 1 # a loaded machine
    python scripts/bench/bench_budget.py --gpu                   # GPU: full shapes (crammed-bert vs bert-base)

Each recipe is an ordinary `python pretrain.py` run (the normal data pipeline and training loop, its budget
clock, its own masking), one after the other. The data is two of the CPU study's Wikipedia shards (--files;
python scripts/get_data.py wikipedia makes them) through the `local` data config, so both recipes read the
same cached rows and the same tokenizer. At the end both final checkpoints are scored here on the whole
held-out split with one fixed masking, identical for both (the same rows, the same seeded masks), at 15% and
at 25% masking: the loss each run logs itself uses its own recipe's masking and would not compare.

Recipes:
- crammed: `arch=tiny` (the crammed design: pre-LN, gated GELU, no biases, sparse prediction) with the
  bert-o4 recipe (AdamW 1e-3, betas 0.9/0.98, budget-triangle2, batch ramp to 60%, 25% masking, no dropout),
  the batch scaled down from 8192 to the CPU's `--batch`.
- bert: our `bert-base` arch (post-LN, GELU FFN, biases, learned positions, token types, head transform)
  at the same width and depth as `tiny`, with dense prediction like Hugging Face's BertForMaskedLM, and the
  original BERT recipe: AdamW 1e-4, betas 0.9/0.999, eps 1e-6, 15% masking, dropout 0.1, clipping 1.0, the
  same batch without a ramp, linear warm-up over 1% then linear decay to 0. Its step-based schedule is put
  on the budget clock (triangle2 with warm-up 0.01 is BERT's linear schedule starting at 25% of the peak):
  a step-based recipe cannot know its step count in a time budget, so this helps the baseline.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import torch

REPO = Path(__file__).resolve().parents[2]
# the first two shards of the CPU study's Wikipedia data (python scripts/get_data.py wikipedia)
WIKI = "data/wikipedia/train-0000[01]-of-00012.jsonl.gz"

CPU_SHAPE = ["arch.num_layers=2", "arch.hidden_size=64", "arch.num_heads=2", "arch.intermediate_size=256"]
RECIPES = {
    "crammed": {
        "cpu": ["arch=tiny"],
        "gpu": ["arch=crammed-bert"],
        "train": ["train=bert-o4"],
    },
    "bert": {
        "cpu": ["arch=bert-base", *CPU_SHAPE, "arch.sparse_prediction=false"],
        "gpu": ["arch=bert-base", "arch.sparse_prediction=false"],
        "train": [
            "train.optim.lr=1e-4",
            "train.optim.betas=[0.9,0.999]",
            "train.optim.eps=1e-6",
            "train.mlm.mode=probability",
            "train.mlm.mask_fraction=0.15",
            "train.dropout=0.1",
            "train.grad_clip=1.0",
            "train.batch_size_ramp=0",
            "train.lr_schedule=budget-triangle2",
            "train.warmup=0.01",
        ],
    },
}


def run_recipe(name: str, args: argparse.Namespace, run_dir: Path) -> dict:
    """Train one recipe with pretrain.py in a child process; returns its last metrics records."""
    kind = "gpu" if args.gpu else "cpu"
    overrides = [
        "data=local",
        f"data.sources.local.files='{args.files}'",  # quoted: a glob's [] is Hydra syntax
        f"data.tokenizer.vocab_size={args.vocab}",
        *RECIPES[name][kind],
        *RECIPES[name]["train"],
        f"train.batch_size={args.batch}",
        f"impl.microbatch_size={args.microbatch}",
        f"budget={args.minutes / 60}",
        f"name=budget-{name}",
        f"base_dir={args.base_dir}",
        f"hydra.run.dir={run_dir}",
        "train.log_every=25",
    ]
    if not args.gpu:
        overrides += [f"impl.cpu_threads={args.threads}", "impl.num_workers=0", "impl.device=cpu"]
    print(f"== {name}: python pretrain.py {' '.join(overrides)}", flush=True)
    started = time.monotonic()
    subprocess.run([sys.executable, "pretrain.py", *overrides], cwd=REPO, check=True)
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if "loss" in r]
    return {
        "wall_s": time.monotonic() - started,
        "updates": steps[-1]["update"] if steps else 0,
        "tok_per_s": sum(r["tok_per_s"] for r in steps) / max(len(steps), 1),
        "train_loss": steps[-1]["loss"] if steps else float("nan"),
    }


@torch.no_grad()
def held_out(run_dir: Path, fraction: float, mode: str, args: argparse.Namespace) -> tuple[float, float]:
    """(MLM loss, accuracy) of a run's final model on the whole validation split, masks seeded identically."""
    from cramming.data import load_pretraining_data
    from cramming.model import IGNORE_INDEX
    from cramming.model.checkpoint import load_pretrained
    from cramming.train.config import MLMConfig
    from cramming.train.mlm import MLMMasker

    device = torch.device("cuda" if args.gpu else "cpu")
    state = torch.load(run_dir / "state.pt", map_location="cpu", weights_only=True)
    data = load_pretraining_data(state["data_path"])
    model = load_pretrained(run_dir, device=device, dropout=0.0).model.eval()
    masker = MLMMasker(
        MLMConfig(mode=mode, mask_fraction=fraction), data.vocab_size, data.special.all, data.special.mask
    )
    ids = data.validation.with_format("numpy")["input_ids"][:]
    rows = torch.from_numpy(np.asarray(ids, dtype=np.int64))  # (rows, seq)
    loss, correct, predicted = 0.0, 0, 0
    for first, batch in zip(range(0, len(rows), 64), rows.split(64), strict=True):
        corrupted, labels = masker(batch, torch.arange(first, first + len(batch)))
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=args.gpu):
            out = model(corrupted.to(device), labels.to(device))
        target = out.labels != IGNORE_INDEX
        n = int(target.sum())
        loss += float(out.loss) * n
        correct += int(((out.logits.argmax(-1) == out.labels) & target).sum())
        predicted += n
    return loss / predicted, correct / predicted


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--minutes", type=float, default=10.0, help="wall-clock budget per recipe")
    parser.add_argument("--recipes", nargs="+", default=list(RECIPES), choices=list(RECIPES))
    parser.add_argument("--files", default=WIKI, help="data.sources.local.files")
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument(
        "--batch", type=int, default=128, help="sequences per update (the recipe's 8192, scaled)"
    )
    parser.add_argument("--microbatch", default="32")
    parser.add_argument("--threads", type=int, default=1, help="torch threads per run on CPU")
    parser.add_argument("--gpu", action="store_true", help="full shapes on CUDA (pass --batch, --microbatch)")
    parser.add_argument("--base-dir", default="outputs")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    kind = "gpu" if args.gpu else "cpu"
    out = args.out or REPO / "results" / "budget" / f"{kind}.md"
    stamp = time.strftime("%Y-%m-%d_%H-%M-%S")
    torch.set_num_threads(args.threads)

    rows = []
    for name in args.recipes:
        run_dir = REPO / args.base_dir / f"budget-{name}" / stamp
        trained = run_recipe(name, args, run_dir)
        loss15, acc15 = held_out(run_dir, 0.15, "probability", args)
        loss25, acc25 = held_out(run_dir, 0.25, "count", args)
        rows.append((name, trained, loss15, acc15, loss25, acc25))
        print(f"== {name}: held-out loss {loss15:.4f} (15%), {loss25:.4f} (25%)", flush=True)

    lines = [
        f"# Budget benchmark ({kind}): same wall-clock budget, same data",
        "",
        f"`python scripts/bench/bench_budget.py {' '.join(sys.argv[1:])}` on {os.uname().nodename.split('.')[0]},"
        f" {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}: {args.minutes:g} minutes of budget per recipe,"
        f" batch {args.batch}, micro-batch {args.microbatch}, vocabulary {args.vocab}, data `{args.files}`"
        + (
            ""
            if args.gpu
            else f", CPU with {args.threads} torch thread(s) on a machine shared with other jobs"
        )
        + ". Held-out: the whole validation split of the cached data, the same seeded masks for every"
        " recipe, at 15% (each token with probability 0.15) and at 25% (32 tokens per row) masking, 80/10/10.",
        "",
        "| recipe | updates | tokens/s (mean of log windows) | last train loss | held-out loss @15% | acc @15%"
        " | held-out loss @25% | acc @25% |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for name, t, loss15, acc15, loss25, acc25 in rows:
        lines.append(
            f"| {name} | {t['updates']} | {t['tok_per_s']:,.0f} | {t['train_loss']:.3f} | {loss15:.3f} |"
            f" {acc15:.3f} | {loss25:.3f} | {acc25:.3f} |"
        )
    lines += ["", "Recipes (see the docstring of scripts/bench/bench_budget.py):", ""]
    for name in args.recipes:
        lines.append(f"- {name}: `{' '.join(RECIPES[name][kind] + RECIPES[name]['train'])}`")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
