"""Data the documented commands read, made from the Hugging Face hub in project-local folders:

    python scripts/get_data.py glue --out data/glue              # for eval.glue_dir=data/glue
    python scripts/get_data.py wikipedia --out data/wikipedia    # the CPU study's shards (conf/sweep/cpu-study.yaml)
    python scripts/get_data.py blimp --out data/blimp            # for eval=blimp blimp.dir=data/blimp
    python scripts/get_data.py test-data --out data/test         # all three, in the layout CRAMMING_DATA names

glue: the GLUE tasks of `nyu-mll/glue` (all nine, or --tasks RTE MRPC ...) in GLUE's original TSV layout, the
one `eval.glue_dir` reads: <out>/<task>/train.tsv and the task's dev files (dev.tsv; MNLI dev_matched.tsv and
dev_mismatched.tsv). Test splits, which have no labels, are not written. Without `eval.glue_dir` the
evaluation reads the same tasks from the hub itself; the folder is for machines without network.

wikipedia: a fixed sample of `wikimedia/wikipedia` (the dump --dump names, 20231101.en by default): its first
articles in the order the hub stores them, written into --shards gzipped JSON-lines files
train-000NN-of-000SS.jsonl.gz, each closed once it holds --shard-chars characters of text (the article that
crosses the mark ends the shard). One article per line, {"id", "url", "title", "text"}, paragraphs separated
by single newlines: the layout, count and size (12 x 25.4 million characters) of the 2015 shards the CPU study
was measured on. It streams only those articles (about 0.3 GB of text), and writes each shard beside its
final name before renaming it, so an interrupted command leaves no half-written shard.

blimp: BLiMP's 67 paradigms from `nyu-mll/blimp`, one <out>/<UID>.jsonl.gz each, 1,000 pairs in pairID order, in
the fields of BLiMP's own files (UID, pairID, sentence_good, sentence_bad, field, linguistics_term, ...): the
folder `blimp.dir` reads.

test-data: the folder the tests read real data from when the environment variable CRAMMING_DATA names it
(tests/conftest.py): <out>/glue, <out>/wikipedia-en-2015 (the twelve shards; from the 20231101 dump, so their
text differs from the 2015 shards the studies were measured on) and <out>/blimp. The reference checkpoint
(<out>/checkpoints/cpu-study-tiny-30min) cannot be downloaded: the command prints the pretraining run that makes
it (30 minutes on a CPU).

Without network each command fails in one line that says so and names the alternative, with exit code 2.
"""

from __future__ import annotations

import argparse
import gzip
import itertools
import json
import re
import sys
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path

from cramming.errors import DataSourceError, first_line
from cramming.eval.glue_data import load_hub, write_local
from cramming.eval.tasks import GLUE_TASKS

WIKIPEDIA = "wikimedia/wikipedia"
DUMP = "20231101.en"
SHARDS = 12
# characters of article text per shard: those of the study's 2015 shards (25.3 to 25.5 million each)
SHARD_CHARS = 25_400_000
FIELDS = ("id", "url", "title", "text")
BLANK_LINES = re.compile(r"\n\s*\n+")


class HubUnreachable(Exception):
    """The hub could not be read; the message is the one line the command prints."""


def hub_rows(rows: Iterable, what: str, instead: str) -> Iterator:
    """`rows` as they come from the hub, with a failure to reach it (a ConnectionError or another OSError,
    also in the middle of a stream) turned into HubUnreachable naming `what` and what to do `instead`."""
    iterator = iter(rows)
    while True:
        try:
            row = next(iterator)
        except StopIteration:
            return
        except OSError as err:  # ConnectionError and TimeoutError are OSErrors
            raise HubUnreachable(
                f"could not reach the Hugging Face hub for {what} ({first_line(err)}): this command needs the"
                f" network. {instead}"
            ) from err
        yield row


# ------------------------------------------------------------------------------------------------------- GLUE

GLUE_INSTEAD = (
    "Run it on a machine that has network and copy the folder here, or point eval.glue_dir at any copy of GLUE"
    " in its original TSV layout."
)


def write_glue(out: Path, tasks: list[str]) -> list[Path]:
    """Each task's train and dev files under `out`, from the hub (cramming.eval.glue_data.hub_dataset, the one
    network call, renamed to the local columns by load_hub). Returns the files written."""
    written = []
    for name in tasks:
        task = GLUE_TASKS[name]
        try:
            splits = load_hub(task)
        except DataSourceError as err:  # load_hub's "could not reach the hub", a ConnectionError underneath
            if not isinstance(err.__cause__, OSError):
                raise
            raise HubUnreachable(
                f"could not reach the Hugging Face hub for nyu-mll/glue ({task.hub_config})"
                f" ({first_line(err.__cause__)}): this command needs the network. {GLUE_INSTEAD}"
            ) from err
        files = write_local(task, splits, out)
        rows = ", ".join(
            f"{path.name} {len(splits[split]):,} rows" for split, path in zip(splits, files, strict=True)
        )
        print(f"{out / task.name}: {rows}")
        written += files
    return written


# -------------------------------------------------------------------------------------------------- Wikipedia

WIKI_INSTEAD = (
    "Run it on a machine that has network and copy the folder here, or pretrain on text you have:"
    " data.sources.local.files='<your files>' (docs/data.md), or data=embedded."
)


def wikipedia_articles(dump: str = DUMP, revision: str | None = None) -> Iterable[dict]:
    """The dump's articles in the hub's order, streamed (the network call)."""
    import datasets

    return datasets.load_dataset(WIKIPEDIA, dump, split="train", streaming=True, revision=revision)


def shard_name(index: int, shards: int) -> str:
    return f"train-{index:05d}-of-{shards:05d}.jsonl.gz"


def write_wikipedia_shards(
    articles: Iterable[dict], out: Path, shards: int = SHARDS, shard_chars: int = SHARD_CHARS
) -> list[dict]:
    """The first articles of `articles` with text, as `shards` shards of `shard_chars` characters each (the
    article that crosses the mark ends its shard). Raises DataSourceError when the articles run out first.
    Returns one summary per shard: file, articles, characters."""
    articles = iter(articles)
    first = next(articles, None)  # from the hub before anything is written: no network, no folder
    if first is not None:
        articles = itertools.chain([first], articles)
    out.mkdir(parents=True, exist_ok=True)
    summary = []
    for index in range(shards):
        path = out / shard_name(index, shards)
        partial = path.with_name(path.name + ".partial")
        try:
            count, chars = _write_shard(articles, partial, shard_chars)
        except BaseException:
            partial.unlink(missing_ok=True)
            raise
        if chars < shard_chars:
            partial.unlink()
            raise DataSourceError(
                f"the articles ran out in shard {index} of {shards} ({chars:,} of {shard_chars:,} characters):"
                " ask for fewer shards (--shards) or smaller ones (--shard-chars)"
            )
        partial.replace(path)
        summary.append({"file": path.name, "articles": count, "characters": chars})
        print(f"{path}: {count:,} articles, {chars:,} characters")
    return summary


def _write_shard(articles: Iterator[dict], path: Path, shard_chars: int) -> tuple[int, int]:
    """Articles with text into `path` until it holds `shard_chars` characters: (articles, characters)."""
    count = chars = 0
    with gzip.open(path, "wt", encoding="utf-8") as f:
        for article in articles:
            text = BLANK_LINES.sub("\n", article["text"]).strip()
            if not text:
                continue
            row = {key: str(article[key]) for key in FIELDS[:-1]} | {"text": text}
            f.write(json.dumps(row, ensure_ascii=False) + "\n")
            count, chars = count + 1, chars + len(text)
            if chars >= shard_chars:
                break
    return count, chars


# ------------------------------------------------------------------------------------------------------ BLiMP

BLIMP = "nyu-mll/blimp"
BLIMP_INSTEAD = (
    "Run it on a machine that has network and copy the folder here, or point blimp.dir at BLiMP's own files"
    " (data/*.jsonl of github.com/alexwarstadt/blimp)."
)


def blimp_paradigms(revision: str | None = None) -> Iterator[tuple[str, Iterable[dict]]]:
    """(UID, its rows) of every paradigm of the hub's BLiMP, one configuration each (the network calls)."""
    import datasets

    for uid in datasets.get_dataset_config_names(BLIMP, revision=revision):
        yield uid, datasets.load_dataset(BLIMP, uid, split="train", revision=revision)


def write_blimp(paradigms: Iterable[tuple[str, Iterable[dict]]], out: Path) -> list[Path]:
    """Each paradigm as <out>/<UID>.jsonl.gz, its pairs in pairID order with pairID as BLiMP's files write it (a
    string; the hub may call it pair_id). Each file is written beside its name and renamed when complete."""
    written = []
    for uid, rows in paradigms:
        pairs = sorted((_blimp_pair(row) for row in rows), key=lambda pair: int(pair["pairID"]))
        out.mkdir(parents=True, exist_ok=True)
        path = out / f"{uid}.jsonl.gz"
        partial = path.with_name(path.name + ".partial")
        with gzip.open(partial, "wt", encoding="utf-8") as f:
            f.writelines(json.dumps(pair, ensure_ascii=False) + "\n" for pair in pairs)
        partial.replace(path)
        print(f"{path}: {len(pairs):,} pairs")
        written.append(path)
    return written


def _blimp_pair(row: dict) -> dict:
    pair = dict(row)
    pair["pairID"] = str(pair.pop("pair_id", pair.get("pairID")))
    return pair


# ---------------------------------------------------------------------------------------------- test data

# the reference checkpoint of the tests' data folder: the command that made it (results/cpu-study/)
CHECKPOINT_COMMAND = (
    "python pretrain.py +sweep=cpu-study arch=bert-tiny budget=0.5 name=cpu-study-tiny-30min"
    " 'data.sources.local.files=\"{shards}/train-0000[01]-of-00012.jsonl.gz\"'"
)


def write_test_data(out: Path, dump: str = DUMP) -> None:
    """GLUE, the Wikipedia shards and BLiMP in the layout of tests/conftest.py; then how to make the checkpoint."""
    write_glue(out / "glue", list(GLUE_TASKS))
    wiki = hub_rows(_lazy(lambda: wikipedia_articles(dump)), f"{WIKIPEDIA} ({dump})", WIKI_INSTEAD)
    write_wikipedia_shards(wiki, out / "wikipedia-en-2015")
    write_blimp(hub_rows(_lazy(blimp_paradigms), BLIMP, BLIMP_INSTEAD), out / "blimp")
    command = CHECKPOINT_COMMAND.format(shards=out / "wikipedia-en-2015")
    print(
        f"done. The reference checkpoint is made, not downloaded: run\n  {command}\nand copy the run's checkpoint"
        f" folder to {out / 'checkpoints' / 'cpu-study-tiny-30min'}. Then: export CRAMMING_DATA={out}"
    )


# ---------------------------------------------------------------------------------------------------- command


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    commands = parser.add_subparsers(dest="what", required=True)
    glue = commands.add_parser("glue", help="GLUE in its TSV layout, for eval.glue_dir")
    glue.add_argument("--out", type=Path, default=Path("data/glue"))
    glue.add_argument("--tasks", nargs="+", choices=list(GLUE_TASKS), default=list(GLUE_TASKS))
    wiki = commands.add_parser("wikipedia", help="the CPU study's Wikipedia shards")
    wiki.add_argument("--out", type=Path, default=Path("data/wikipedia"))
    wiki.add_argument("--dump", default=DUMP, help=f"a configuration of {WIKIPEDIA} (default {DUMP})")
    wiki.add_argument("--revision", default=None, help="a revision of the hub dataset (default: its newest)")
    wiki.add_argument("--shards", type=int, default=SHARDS)
    wiki.add_argument("--shard-chars", type=int, default=SHARD_CHARS)
    blimp = commands.add_parser("blimp", help="BLiMP's 67 paradigms, for blimp.dir")
    blimp.add_argument("--out", type=Path, default=Path("data/blimp"))
    blimp.add_argument("--revision", default=None, help=f"a revision of {BLIMP} (default: its newest)")
    tests = commands.add_parser(
        "test-data", help="GLUE, Wikipedia and BLiMP in the layout CRAMMING_DATA names"
    )
    tests.add_argument("--out", type=Path, default=Path("data/test"))
    args = parser.parse_args(argv)
    _quiet_hub()
    try:
        run_command(args)
    except (HubUnreachable, DataSourceError) as err:
        print(f"get_data: {err}", file=sys.stderr)
        return 2
    return 0


def run_command(args: argparse.Namespace) -> None:
    """What the subcommand `args.what` writes."""
    if args.what == "glue":
        write_glue(args.out, args.tasks)
    elif args.what == "wikipedia":
        stream = hub_rows(
            _lazy(lambda: wikipedia_articles(args.dump, args.revision)),
            f"{WIKIPEDIA} ({args.dump})",
            WIKI_INSTEAD,
        )
        write_wikipedia_shards(stream, args.out, args.shards, args.shard_chars)
    elif args.what == "blimp":
        write_blimp(hub_rows(_lazy(lambda: blimp_paradigms(args.revision)), BLIMP, BLIMP_INSTEAD), args.out)
    else:
        write_test_data(args.out)


def _lazy(make: Callable[[], Iterable]) -> Iterator:
    """Iterate what `make()` returns, calling it on the first next(): its own failure then reaches hub_rows."""
    yield from make()


def _quiet_hub() -> None:
    """Without network the hub's client retries each request and logs every attempt: the command's own line
    says it once."""
    try:
        from huggingface_hub.utils import logging as hub_logging
    except ImportError:
        return
    hub_logging.set_verbosity_error()


if __name__ == "__main__":
    sys.exit(main())
