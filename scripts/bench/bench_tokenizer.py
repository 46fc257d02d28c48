"""What the alphabet settings do to a WordPiece vocabulary trained on the shared Wikipedia data.

    RAYON_NUM_THREADS=1 python scripts/bench/bench_tokenizer.py [--shards 1 6] [--vocab 32768] [--heldout 11]

For each training set (the first N shards) and each setting, trains the project's tokenizer
(`cramming.data.tokenizer.train_tokenizer`) on the normalized articles, as the pipeline does (without its
length, trash and dedup filters), and counts:

- single-character entries (`x` and `##x`) and entries holding any non-ASCII character;
- on a held-out shard that no setting trained on: tokens per character and the [UNK] share of tokens. The
  characters are those of the held-out text normalized *without* ascii_only, the same denominator for
  every setting, so text that ascii_only deletes counts as characters that cost no tokens; the share of
  characters it deletes is reported beside it. To compare the vocabularies alone, also the tokens per
  character of the held-out text with its non-ASCII characters deleted, the same text for every setting.

Settings: `before` = ascii_only off, no alphabet limit (the behaviour before both existed); `limit` =
ascii_only off, limit_alphabet 1000 (BERT's choice); `after` = ascii_only on, limit_alphabet 1000 (the
data configs' default). Writes the figures as JSON to --out (default results/tokenizer/alphabet.json).
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import platform
import time
from collections import Counter
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
# the twelve Wikipedia shards: the tests' copy where CRAMMING_DATA names one, else what scripts/get_data.py
# wikipedia writes
WIKI = (
    Path(os.environ["CRAMMING_DATA"], "wikipedia-en-2015")
    if "CRAMMING_DATA" in os.environ
    else REPO / "data" / "wikipedia"
)

SETTINGS = {
    "before": {"ascii_only": False, "limit_alphabet": None},
    "limit": {"ascii_only": False, "limit_alphabet": 1000},
    "after": {"ascii_only": True, "limit_alphabet": 1000},
}


def shard_path(i: int) -> Path:
    return WIKI / f"train-{i:05d}-of-00012.jsonl.gz"


def read_texts(shards: list[int]) -> list[str]:
    texts = []
    for i in shards:
        with gzip.open(shard_path(i), "rt", encoding="utf-8") as f:
            texts += [json.loads(line)["text"] for line in f]
    return texts


def vocabulary_counts(vocab: list[str]) -> dict[str, int]:
    pieces = [v.removeprefix("##") for v in vocab]
    return {
        "vocab_size": len(vocab),
        "single_char_entries": sum(len(p) == 1 for p in pieces),
        "distinct_chars": len({p for p in pieces if len(p) == 1}),
        "non_ascii_entries": sum(not v.isascii() for v in vocab),
    }


def count_tokens(tokenizer, texts: list[str]) -> tuple[int, int]:
    """(tokens, [UNK] tokens) of the texts, special tokens left out."""
    unk = tokenizer.token_to_id("[UNK]")
    tokens = unks = 0
    for start in range(0, len(texts), 500):
        for enc in tokenizer.encode_batch(texts[start : start + 500], add_special_tokens=False):
            tokens += len(enc.ids)
            unks += enc.ids.count(unk)
    return tokens, unks


def markdown_table(runs: list[dict]) -> str:
    lines = [
        "| shards | setting | ascii_only | limit_alphabet | distinct chars in text | single-char entries | "
        "non-ASCII entries | held-out tokens/char | held-out tokens/char, ASCII text | held-out [UNK] |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in runs:
        lines.append(
            f"| {r['shards']} | {r['setting']} | {r['ascii_only']} | {r['limit_alphabet']} | "
            f"{r['train_distinct_chars']:,} | {r['single_char_entries']:,} ({r['single_char_entries'] / r['vocab_size']:.1%}) | "
            f"{r['non_ascii_entries']:,} | {r['heldout_tokens_per_char']:.5f} | "
            f"{r['heldout_ascii_tokens_per_char']:.5f} | {r['heldout_unk_share']:.4%} |"
        )
    return "\n".join(lines)


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--shards", type=int, nargs="+", default=[1, 6], help="train on the first N shards")
    parser.add_argument("--vocab", type=int, default=32768)
    parser.add_argument("--heldout", type=int, default=11, help="index of the held-out shard")
    parser.add_argument("--settings", nargs="+", default=list(SETTINGS), choices=list(SETTINGS))
    parser.add_argument("--out", type=Path, default=REPO / "results" / "tokenizer" / "alphabet.json")
    args = parser.parse_args()
    if args.heldout < max(args.shards):
        raise SystemExit(
            f"--heldout {args.heldout} is one of the training shards; use {max(args.shards)} or more"
        )
    return args


def heldout_texts(heldout: int) -> tuple[list[str], list[str], dict]:
    """The held-out shard's raw articles, the same normalized with ascii_only, and its figures."""
    from cramming.data.config import NormalizerConfig
    from cramming.data.tokenizer import build_normalizer

    plain = build_normalizer(NormalizerConfig(ascii_only=False))
    heldout_raw = read_texts([heldout])
    heldout_plain = [plain.normalize_str(t) for t in heldout_raw]
    heldout_chars = sum(map(len, heldout_plain))
    heldout_non_ascii = sum(not c.isascii() for t in heldout_plain for c in t)
    ascii_norm = build_normalizer(NormalizerConfig(ascii_only=True))
    heldout_ascii = [ascii_norm.normalize_str(t) for t in heldout_raw]
    figures = {
        "shard": shard_path(heldout).name,
        "articles": len(heldout_raw),
        "chars": heldout_chars,
        "non_ascii_char_share": heldout_non_ascii / heldout_chars,
        "ascii_chars": sum(map(len, heldout_ascii)),
    }
    return heldout_raw, heldout_ascii, figures


def one_run(
    n: int,
    name: str,
    raw: list[str],
    vocab: int,
    heldout_raw: list[str],
    heldout_ascii: list[str],
    heldout: dict,
) -> dict:
    """Train the tokenizer of one setting on the texts of the first n shards and count its figures."""
    from cramming.data.config import NormalizerConfig, TokenizerConfig
    from cramming.data.tokenizer import build_normalizer, train_tokenizer

    setting = SETTINGS[name]
    norm_cfg = NormalizerConfig(ascii_only=setting["ascii_only"])
    norm = build_normalizer(norm_cfg)
    start = time.perf_counter()
    texts = [norm.normalize_str(t) for t in raw]
    normalize_s = time.perf_counter() - start
    chars = Counter()
    for t in texts:
        chars.update(t)
    n_chars = sum(chars.values())
    tok_cfg = TokenizerConfig(vocab_size=vocab, limit_alphabet=setting["limit_alphabet"])
    start = time.perf_counter()
    tokenizer = train_tokenizer(
        (texts[i : i + 1000] for i in range(0, len(texts), 1000)), tok_cfg, norm_cfg, len(texts)
    )
    train_s = time.perf_counter() - start
    tokens, unks = count_tokens(tokenizer, heldout_raw)
    ascii_tokens, _ = count_tokens(tokenizer, heldout_ascii)
    return {
        "shards": n,
        "setting": name,
        **setting,
        "articles": len(texts),
        "train_chars": n_chars,
        "train_distinct_chars": len(chars),
        "train_non_ascii_char_share": sum(c for ch, c in chars.items() if not ch.isascii()) / n_chars,
        **vocabulary_counts(list(tokenizer.get_vocab())),
        "heldout_tokens": tokens,
        "heldout_tokens_per_char": tokens / heldout["chars"],
        "heldout_unk_share": unks / max(1, tokens),
        "heldout_ascii_tokens_per_char": ascii_tokens / heldout["ascii_chars"],
        "normalize_s": round(normalize_s, 1),
        "train_s": round(train_s, 1),
    }


def main() -> None:
    args = parse_args()
    heldout_raw, heldout_ascii, heldout = heldout_texts(args.heldout)
    results = {
        "machine": {
            "cpu_count": os.cpu_count(),
            "rayon_threads": os.environ.get("RAYON_NUM_THREADS"),
            "python": platform.python_version(),
            "tokenizers": __import__("tokenizers").__version__,
        },
        "heldout": heldout,
        "runs": [],
    }
    for n in args.shards:
        raw = read_texts(list(range(n)))
        for name in args.settings:
            run = one_run(n, name, raw, args.vocab, heldout_raw, heldout_ascii, heldout)
            results["runs"].append(run)
            print(json.dumps(run), flush=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=2) + "\n")
    print(markdown_table(results["runs"]))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
