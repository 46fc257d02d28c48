"""Preprocessing throughput and peak memory on one shard of the shared Wikipedia data.

    python scripts/bench/bench_preprocess.py [--shard PATH] [--vocab 32768] [--num-proc 2]

Each phase runs in a fresh child process, so its peak memory (its own plus its worker processes') is its
alone. The reference, measured in the same run, is the floor any pipeline pays: decompressing and parsing
the JSON lines of the same shard. Writes results/preprocessing/one-shard.md.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
# the twelve Wikipedia shards: the tests' copy where CRAMMING_DATA names one, else what scripts/get_data.py
# wikipedia writes
WIKI = (
    Path(os.environ["CRAMMING_DATA"], "wikipedia-en-2015")
    if "CRAMMING_DATA" in os.environ
    else REPO / "data" / "wikipedia"
)
DEFAULT_SHARD = WIKI / "train-00000-of-00012.jsonl.gz"

# Runs in the child: does the work, then prints one JSON line with wall time and peak memory.
CHILD = textwrap.dedent(
    """
    import json, resource, sys, time
    start = time.perf_counter()
    phase, shard, cache, vocab, num_proc = sys.argv[1:6]
    result = {}
    if phase == "read":
        import gzip
        with gzip.open(shard, "rt", encoding="utf-8") as f:
            result["megabytes"] = sum(len(json.loads(line)["text"].encode()) for line in f) / 1e6
    else:
        from omegaconf import OmegaConf
        from cramming.data import prepare_pretraining_data
        from cramming.data.config import DataConfig
        cfg = OmegaConf.merge(OmegaConf.structured(DataConfig), OmegaConf.load("conf/data/local.yaml"))
        cfg.sources.local.files = shard
        cfg.tokenizer.vocab_size = int(vocab)
        data = prepare_pretraining_data(OmegaConf.to_object(cfg), cache, num_proc=int(num_proc))
        result["stats"] = data.stats
    result["wall"] = time.perf_counter() - start
    own = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    workers = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    result["peak_rss_mb"] = max(own, workers) / 1024
    print("RESULT " + json.dumps(result))
    """
)


def run_phase(phase: str, shard: Path, cache: Path, vocab: int, num_proc: int) -> dict:
    args = [sys.executable, "-c", CHILD, phase, str(shard), str(cache), str(vocab), str(num_proc)]
    out = subprocess.run(args, capture_output=True, text=True, cwd=REPO)
    if out.returncode != 0:
        raise SystemExit(f"phase {phase} failed:\n{out.stderr[-3000:]}")
    line = next(ln for ln in out.stdout.splitlines() if ln.startswith("RESULT "))
    return json.loads(line.removeprefix("RESULT "))


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shard", type=Path, default=DEFAULT_SHARD)
    parser.add_argument("--vocab", type=int, default=32768)
    parser.add_argument("--num-proc", type=int, default=2)
    parser.add_argument("--out", type=Path, default=REPO / "results" / "preprocessing" / "one-shard.md")
    return parser.parse_args()


def table_rows(read: dict, first: dict, second: dict) -> list[tuple[str, str, str, str]]:
    """(phase, seconds, MB of raw text / s, peak RSS) of each phase and of the first run's parts."""
    stats, mb = first["stats"], read["megabytes"]
    sec = stats["seconds"]
    tok_mb = stats["tokenizer_train_megabytes"]
    return [
        (
            "reference: gunzip + JSON parse only",
            f"{read['wall']:.1f}",
            f"{mb / read['wall']:.2f}",
            f"{read['peak_rss_mb']:.0f}",
        ),
        (
            "first run, end to end (incl. start-up)",
            f"{first['wall']:.1f}",
            f"{mb / first['wall']:.2f}",
            f"{first['peak_rss_mb']:.0f}",
        ),
        ("  of which the pipeline itself", f"{sec['total']:.1f}", f"{mb / sec['total']:.2f}", ""),
        (
            "  of which tokenizer training",
            f"{sec['train tokenizer']:.1f}",
            f"{tok_mb / sec['train tokenizer']:.2f}",
            "",
        ),
        (
            "second run (cache found, incl. start-up)",
            f"{second['wall']:.1f}",
            "",
            f"{second['peak_rss_mb']:.0f}",
        ),
    ]


def report(args: argparse.Namespace, read: dict, first: dict, second: dict, load_before: float) -> str:
    stats, mb = first["stats"], read["megabytes"]
    sec = stats["seconds"]
    lines = [
        f"# Preprocessing one Wikipedia shard ({args.shard.name})",
        "",
        f"{stats['raw_documents']} articles, {mb:.1f} MB of raw text; vocabulary {args.vocab} (WordPiece), "
        f"seq_length {stats['seq_length']}, num_proc {args.num_proc}. "
        f"{stats['train_rows']} training rows, {stats['train_tokens']} tokens; "
        f"{stats.get('train_dropped_by_token_ratio', 0)} articles dropped by the trash filter.",
        "",
        "| phase | seconds | MB of raw text / s | peak RSS (MB) |",
        "|---|---:|---:|---:|",
        *[f"| {' | '.join(r)} |" for r in table_rows(read, first, second)],
        "",
        f"End-to-end speed is {mb / first['wall'] / (mb / read['wall']):.2f}x that of only reading the shard "
        f"(same run). Pipeline step seconds: "
        + ", ".join(f"{k} {v:.1f}" for k, v in sec.items() if k != "total")
        + ".",
        "",
        f"Machine: {os.cpu_count()} cores; 1-minute load average {load_before:.1f} before and "
        f"{os.getloadavg()[0]:.1f} after the run (other work slows every phase, the reference too).",
        "",
        f"Command: `python scripts/bench/bench_preprocess.py --vocab {args.vocab} --num-proc {args.num_proc}`",
    ]
    return "\n".join(lines) + "\n"


def main() -> None:
    args = parse_args()
    if not args.shard.exists():
        raise SystemExit(
            f"no shard at {args.shard}: pass --shard PATH to a .jsonl.gz file with a `text` field"
        )

    load_before = os.getloadavg()[0]
    with tempfile.TemporaryDirectory() as tmp:
        cache = Path(tmp) / "cache"
        read = run_phase("read", args.shard, cache, args.vocab, args.num_proc)
        first = run_phase("build", args.shard, cache, args.vocab, args.num_proc)
        second = run_phase("build", args.shard, cache, args.vocab, args.num_proc)

    text = report(args, read, first, second, load_before)
    print(text)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(text)
    print(f"written to {args.out}")


if __name__ == "__main__":
    main()
