"""Does a pretrained model use context? The diagnostic of cramming/train/validation.py for any checkpoint:

    python scripts/context_use.py <run folder | run name> [--base-dir outputs] [--rows 2048] [--data <folder>]

Masked loss on held-out rows as they are and with each row's tokens shuffled (same masked positions), and the
targets' unigram entropy. The rows are the run's own validation split (its state.pt names the processed data;
or pass --data <processed-data folder>). Prints one line and, with --json, the figures.
"""

from __future__ import annotations

import argparse
import json
import sys

import numpy as np
import torch

from cramming.data import load_pretraining_data
from cramming.model.checkpoint import CHECKPOINT_DIR, load_pretrained, resolve_checkpoint
from cramming.train.config import MLMConfig
from cramming.train.mlm import MLMMasker
from cramming.train.validation import context_use, describe


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("checkpoint", help="a run folder, its checkpoint/ folder, or a run name")
    parser.add_argument("--base-dir", default="outputs")
    parser.add_argument("--data", help="processed-data folder (default: the one the run's state.pt names)")
    parser.add_argument("--rows", type=int, default=2048, help="validation rows to use")
    parser.add_argument("--mask-fraction", type=float, default=MLMConfig().mask_fraction)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--json", action="store_true", help="also print the figures as JSON")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)

    directory = resolve_checkpoint(args.checkpoint, args.base_dir)
    data_path = args.data
    if data_path is None:
        state = directory.parent / "state.pt" if directory.name == CHECKPOINT_DIR else directory / "state.pt"
        if not state.is_file():
            print(f"no state.pt beside {directory}: pass --data <processed-data folder>", file=sys.stderr)
            return 2
        data_path = torch.load(state, map_location="cpu", weights_only=True)["data_path"]
    data = load_pretraining_data(data_path)
    if data.validation is None or len(data.validation) == 0:
        print(f"{data_path} has no validation split to measure on", file=sys.stderr)
        return 2
    rows = min(args.rows, len(data.validation))
    ids = data.validation.with_format("numpy", columns=["input_ids"])[:rows]["input_ids"]
    input_ids = torch.as_tensor(np.asarray(ids, dtype=np.int64))
    model = load_pretrained(directory, dropout=0.0).model
    special = data.special
    masker = MLMMasker(
        MLMConfig(mask_fraction=args.mask_fraction), data.vocab_size, special.all, special.mask
    )
    result = context_use(model, masker, input_ids, args.batch_size)
    print(f"{directory}: {describe(result)}")
    if args.json:
        print(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
