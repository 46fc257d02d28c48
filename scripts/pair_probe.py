"""Can a checkpoint compare two sentences before fine-tuning? The pair probe of cramming/eval/pair_probe.py:

    python scripts/pair_probe.py <run folder | run name | checkpoint folder> [more ...]
        [--glue-dir data/glue] [--pairs 1500] [--json]

For each checkpoint, one line: the Pearson correlation (x100) with STS-B's dev scores of the cosine between the
two sentences' mean-pooled final hidden states, each sentence encoded alone and the pair encoded together.
Without --glue-dir the dev split comes from the hub (nyu-mll/glue); `python scripts/get_data.py glue` writes
data/glue for machines without network. Runs on one CPU thread in about 10 s per
bert-tiny checkpoint.
"""

from __future__ import annotations

import argparse
import json
import sys

import numpy as np
import torch

from cramming.errors import ConfigError, DataSourceError
from cramming.eval.glue_data import load_task
from cramming.eval.pair_probe import describe, pair_probe
from cramming.eval.run import checkpoint_backbone
from cramming.eval.tasks import GLUE_TASKS
from cramming.impl import ImplConfig


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("checkpoints", nargs="+", help="run folders, checkpoint/ folders or run names")
    parser.add_argument("--base-dir", default="outputs")
    parser.add_argument("--glue-dir", help="local GLUE copy (original TSV layout); default: the hub")
    parser.add_argument("--pairs", type=int, default=None, help="use the first N dev pairs (default: all)")
    parser.add_argument("--json", action="store_true", help="also print the figures as JSON")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    if args.pairs is not None and args.pairs < 2:
        print(f"--pairs {args.pairs}: the probe needs at least 2 pairs", file=sys.stderr)
        return 2
    try:
        dev = load_task(GLUE_TASKS["STS-B"], args.glue_dir)["dev"]
    except DataSourceError as error:
        print(f"STS-B dev pairs unavailable: {error} (pass --glue-dir <local GLUE copy>)", file=sys.stderr)
        return 2
    if args.pairs is not None:
        dev = dev.select(range(min(args.pairs, len(dev))))
    results = {}
    for name in args.checkpoints:
        try:
            backbone = checkpoint_backbone(name, ImplConfig(device="cpu"), args.base_dir)
        except ConfigError as error:
            print(f"{name}: {error}", file=sys.stderr)
            return 2
        results[name] = pair_probe(backbone, dev["text_a"], dev["text_b"], np.asarray(dev["label"]))
        print(f"{name}: {describe(results[name])}")
    if args.json:
        print(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
