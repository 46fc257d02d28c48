"""Short probes of the unigram plateau: does an architecture or recipe change make a small model use context?

A plain loop (AdamW, linear warm-up then a constant rate, clipping 0.5, no batch ramp) over the rows of a
processed dataset, with the package's model, MLM masker and context-use diagnostic
(cramming/train/validation.py), printed every 500 updates on 256 validation rows and at the end on all of them.
It is deliberately simpler than pretrain.py (no budget schedule, no checkpoints) so each knob can be flipped
alone; results/cpu-study/ lists the probes that were run and what they showed.

    python scripts/studies/plateau_probe.py --data outputs/data/<folder> --seconds 400                 # bert-tiny as is
    python scripts/studies/plateau_probe.py --data outputs/data/<folder> --set attention_bias=alibi    # + distance bias
    python scripts/studies/plateau_probe.py --data outputs/data/<folder> --set init_std=0.088 --lr 3e-3
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import numpy as np
import torch
import yaml

from cramming.data.pipeline import load_pretraining_data
from cramming.model import BertForMLM
from cramming.model.config import ArchConfig
from cramming.train.config import MLMConfig
from cramming.train.mlm import MLMMasker
from cramming.train.validation import context_use

CONF = Path(__file__).resolve().parents[2] / "conf" / "arch"


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--data", type=Path, required=True, help="a processed dataset: outputs/data/<folder>")
    parser.add_argument("--arch", default="bert-tiny", help="a conf/arch preset")
    parser.add_argument(
        "--set", nargs="*", default=[], metavar="KEY=VALUE", help="arch fields, e.g. init_std=0.05"
    )
    parser.add_argument("--seconds", type=float, default=400.0, help="wall-clock training time")
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--batch", type=int, default=64, help="sequences per update")
    parser.add_argument("--warmup", type=int, default=100, help="updates of linear warm-up")
    parser.add_argument(
        "--seq", type=int, default=None, help="cut each row into rows of this length (divides it)"
    )
    parser.add_argument("--mask", type=float, default=0.25, help="masking fraction")
    parser.add_argument("--threads", type=int, default=1)
    return parser.parse_args(argv)


def arch_fields(arch: str, overrides: list[str]) -> dict:
    """The fields of conf/arch/<arch>.yaml with the KEY=VALUE overrides applied."""
    fields = yaml.safe_load((CONF / f"{arch}.yaml").read_text())
    for item in overrides:
        key, sep, value = item.partition("=")
        if not sep:
            raise SystemExit(f"--set {item!r}: use KEY=VALUE")
        fields[key] = yaml.safe_load(value)
    return fields


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)

    data = load_pretraining_data(args.data)
    seq = args.seq or data.seq_length
    if data.seq_length % seq:
        raise SystemExit(f"--seq {seq} must divide the data's row length {data.seq_length}")
    masker = MLMMasker(
        MLMConfig(mask_fraction=args.mask), data.vocab_size, data.special.all, data.special.mask
    )
    train = torch.from_numpy(np.asarray(data.train["input_ids"], dtype=np.int64))
    val = torch.from_numpy(np.asarray(data.validation["input_ids"], dtype=np.int64))
    fields = arch_fields(args.arch, args.set)
    torch.manual_seed(0)
    model = BertForMLM(ArchConfig(**fields), data.vocab_size, dropout=0.0)
    optimizer = torch.optim.AdamW(
        model.parameters(), lr=args.lr, betas=(0.9, 0.98), eps=1e-12, weight_decay=0.01
    )
    order = np.random.default_rng(0).permutation(len(train))

    def diagnose(rows: torch.Tensor) -> str:
        # masks are drawn on the stored rows, then the rows are cut, as in training
        result = context_use(model, masker, rows.reshape(-1, seq), 64)
        return ", ".join(f"{k} {v:.3f}" for k, v in result.items() if k != "rows")

    start, update, position = time.time(), 0, 0
    while time.time() - start < args.seconds:
        if position + args.batch > len(order):
            position = 0
        index = torch.from_numpy(order[position : position + args.batch])
        position += args.batch
        inputs, labels = masker(train[index], index)
        inputs, labels = inputs.reshape(-1, seq), labels.reshape(-1, seq)
        for group in optimizer.param_groups:
            group["lr"] = args.lr * min(1.0, (update + 1) / args.warmup)
        out = model(inputs, labels)
        out.loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        update += 1
        if update % 100 == 0:
            print(f"update {update} ({time.time() - start:.0f} s): loss {out.loss.item():.3f}", flush=True)
        if update % 500 == 0:
            print(f"  context use (256 rows): {diagnose(val[:256])}", flush=True)
    print(f"final after {update} updates, {time.time() - start:.0f} s: {diagnose(val)}", flush=True)


if __name__ == "__main__":
    main()
