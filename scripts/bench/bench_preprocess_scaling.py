"""How preprocessing scales with the corpus: time, memory and disk at 1, 4, 12 and 48 Wikipedia shards.

    python scripts/bench/bench_preprocess_scaling.py --shards data/wikipedia [--sizes 1 4 12 48]
        [--checkout <another checkout of the project>] [--out results/preprocessing/scaling.md]

Each size runs `python pretrain.py +sweep=cpu-study dryrun=true impl.num_proc=1` on that many shards, in a fresh
data folder, one run at a time. While it runs, /proc is sampled five times a second: the resident memory of the
process and its children split into anonymous memory (what the program holds) and file-backed memory (mapped
Arrow files, which the kernel can drop), each attributed to the pipeline step the log says is running; and the
size of the data folder. The 48-shard corpus is the twelve shards and three copies of them whose articles have
their paragraphs rotated (by one, two and three places; an article of one paragraph its words): texts that
deduplication keeps, in the same words, so the tokenizer's table of distinct words does not grow past 12 shards,
as it would on new text. The reference of the ratios is the 12-shard run of the same invocation.

--checkout runs another checkout's pretrain.py (e.g. a `git worktree` of an older commit) with this one's
environment: the same measurement of the code before a change. The table lists what else used the CPU during
each run (other processes' CPU time over the run's wall time). Writes the page and a JSON of every figure.
"""

from __future__ import annotations

import argparse
import contextlib
import gzip
import json
import os
import platform
import re
import shutil
import subprocess
import sys
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
WORD = re.compile(r"\w+|[^\w\s]")
STEP_START = re.compile(r"\] - ([a-z +]+(?: train| validation)?) \.\.\.$")
SAMPLE_SECONDS = 0.2
MB = 1e6
# the twelve Wikipedia shards: the tests' copy where CRAMMING_DATA names one, else what scripts/get_data.py
# wikipedia writes
WIKI = (
    Path(os.environ["CRAMMING_DATA"], "wikipedia-en-2015")
    if "CRAMMING_DATA" in os.environ
    else REPO / "data" / "wikipedia"
)


@dataclass
class Run:
    """What one preprocessing run measured: seconds, bytes, and the peak per step."""

    shards: int
    wall_s: float = 0.0
    text_mb: float = 0.0
    documents: int = 0
    train_rows: int = 0
    peak_anon_mb: float = 0.0
    peak_file_mb: float = 0.0
    peak_rss_mb: float = 0.0
    peak_disk_mb: float = 0.0
    disk_after_mb: float = 0.0
    processed_mb: float = 0.0
    step_seconds: dict = field(default_factory=dict)
    step_peak_anon_mb: dict = field(default_factory=dict)
    load_average: float = 0.0
    beside: list = field(default_factory=list)
    distinct_words: int | None = None


# ------------------------------------------------------------------------------------------------ the corpus


def rotated(text: str, places: int) -> str:
    """The article with its paragraphs rotated by `places` (its words, when it has one paragraph)."""
    for sep in ("\n", " "):
        parts = text.split(sep)
        if len(parts) > 1 and places % len(parts):
            k = places % len(parts)
            return sep.join(parts[k:] + parts[:k])
    return text


def make_copy(shard: Path, out: Path, places: int) -> None:
    with gzip.open(shard, "rt", encoding="utf-8") as src, gzip.open(out, "wt", encoding="utf-8") as dst:
        for line in src:
            row = json.loads(line)
            row["text"] = rotated(row["text"], places)
            dst.write(json.dumps(row, ensure_ascii=False) + "\n")


def corpus(shards: list[Path], size: int, work: Path) -> Path:
    """A folder of `size` shards: the first ones of `shards`, and past their number rotated copies of them."""
    folder = work / f"corpus-{size}"
    if folder.is_dir() and len(list(folder.glob("*.jsonl.gz"))) == size:
        return folder
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(parents=True)
    for i in range(size):
        source = shards[i % len(shards)]
        target = folder / f"part-{i:05d}.jsonl.gz"
        if i < len(shards):
            target.symlink_to(source.resolve())
        else:
            make_copy(source, target, i // len(shards))
    return folder


def distinct_words(folder: Path) -> int:
    """Distinct words of the corpus after the recipe's normalization (runs of letters and digits, and each
    punctuation mark: BERT's pre-tokenization, near enough): what the tokenizer trainer keeps a count of."""
    from cramming.data.tokenizer import NormalizerConfig, build_normalizer

    normalizer, words = build_normalizer(NormalizerConfig()), set()
    for shard in sorted(folder.glob("*.jsonl.gz")):
        with gzip.open(shard, "rt", encoding="utf-8") as lines:
            for line in lines:
                words.update(WORD.findall(normalizer.normalize_str(json.loads(line)["text"])))
    return len(words)


# --------------------------------------------------------------------------------------------- measurement


def memory_of(pid: int) -> tuple[int, int]:
    """(anonymous, file-backed) resident bytes of one process, from /proc/<pid>/status."""
    values = {}
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key in ("RssAnon", "RssFile", "RssShmem"):
                    values[key] = int(value.split()[0]) * 1024
    except OSError:
        return 0, 0
    return values.get("RssAnon", 0), values.get("RssFile", 0) + values.get("RssShmem", 0)


def process_tree(pid: int) -> list[int]:
    pids, i = [pid], 0
    while i < len(pids):
        try:
            with open(f"/proc/{pids[i]}/task/{pids[i]}/children") as f:
                pids += [int(c) for c in f.read().split()]
        except OSError:
            pass
        i += 1
    return pids


def folder_bytes(path: Path) -> int:
    total = 0
    for root, _, files in os.walk(path):
        for name in files:
            with contextlib.suppress(OSError):  # a scratch file removed meanwhile
                total += os.lstat(os.path.join(root, name)).st_blocks * 512
    return total


def cpu_seconds() -> dict[int, tuple[float, str]]:
    """CPU seconds and command line of every process now."""
    ticks = os.sysconf("SC_CLK_TCK")
    found = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            fields = Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()
            command = (
                Path(f"/proc/{entry}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            )
        except OSError:  # it ended meanwhile
            continue
        found[int(entry)] = ((int(fields[11]) + int(fields[12])) / ticks, command.strip()[:90])
    return found


def beside(before: dict, after: dict, ours: set[int], wall: float) -> list[str]:
    """Other processes that used more than 10% of a core over the run: `<share of a core> <command>`."""
    used = []
    for pid, (seconds, command) in after.items():
        share = (seconds - before.get(pid, (0.0, ""))[0]) / wall
        if pid not in ours and share > 0.1 and command:
            used.append((share, command))
    return [f"{share:.0%} {command}" for share, command in sorted(used, reverse=True)[:6]]


# ------------------------------------------------------------------------------------------------- one run


class Sampler:
    """Samples memory per step and the data folder's size while the run's log names its step."""

    def __init__(self, run: Run, data: Path) -> None:
        self.run, self.data, self.step, self.ours = run, data, "start-up", set()

    def watch_log(self, stream, log: Path) -> None:
        with open(log, "w") as out:
            for line in stream:
                out.write(line)
                found = STEP_START.search(line.rstrip())
                if found:
                    self.step = found.group(1)

    def sample(self, pid: int) -> None:
        pids = process_tree(pid)
        self.ours.update(pids)
        anon, mapped = (sum(values) for values in zip(*(memory_of(p) for p in pids), strict=True))
        run = self.run
        run.peak_anon_mb = max(run.peak_anon_mb, anon / MB)
        run.peak_file_mb = max(run.peak_file_mb, mapped / MB)
        run.peak_rss_mb = max(run.peak_rss_mb, (anon + mapped) / MB)
        step = run.step_peak_anon_mb
        step[self.step] = max(step.get(self.step, 0.0), round(anon / MB, 1))
        run.peak_disk_mb = max(run.peak_disk_mb, folder_bytes(self.data) / MB)


def measure(size: int, folder: Path, args: argparse.Namespace) -> Run:
    """One dry run on `folder`'s shards in a fresh data folder, sampled until it ends."""
    base = args.work / f"base-{size}"
    shutil.rmtree(base, ignore_errors=True)
    command = [sys.executable, str(args.checkout / "pretrain.py"), "+sweep=cpu-study", "dryrun=true",
               "impl.num_proc=1", f"base_dir={base}", f"data.sources.local.files={folder}/*.jsonl.gz",
               f"name=scaling-{size}"]  # fmt: skip
    run, cpu_before, start = Run(size), cpu_seconds(), time.perf_counter()
    sampler = Sampler(run, base / "data")
    process = subprocess.Popen(
        command, cwd=args.checkout, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    reader = threading.Thread(target=sampler.watch_log, args=(process.stdout, args.work / f"log-{size}.txt"))
    reader.start()
    loads = []
    while process.poll() is None:
        sampler.sample(process.pid)
        loads.append(os.getloadavg()[0])
        time.sleep(SAMPLE_SECONDS)
    reader.join()
    run.wall_s = time.perf_counter() - start
    if process.returncode != 0:
        raise SystemExit(f"{size} shards: the run failed; its log is {args.work / f'log-{size}.txt'}")
    run.beside = beside(cpu_before, cpu_seconds(), sampler.ours, run.wall_s)
    run.load_average = sum(loads) / len(loads) if loads else 0.0
    return finish(run, base / "data")


def finish(run: Run, data: Path) -> Run:
    """The figures the run's stats.json and the data folder give once it has ended."""
    (stats_path,) = data.glob("*/stats.json")
    stats = json.loads(stats_path.read_text())
    run.text_mb, run.documents, run.train_rows = (
        stats["raw_megabytes"],
        stats["raw_documents"],
        stats["train_rows"],
    )
    run.step_seconds = stats["seconds"]
    run.disk_after_mb = folder_bytes(data) / MB
    run.processed_mb = folder_bytes(stats_path.parent) / MB
    return run


# ------------------------------------------------------------------------------------------------- the page


def table(runs: list[Run], reference: Run | None) -> list[str]:
    lines = ["| shards | text (MB) | articles | distinct words | seconds | peak anonymous (MB) | peak file-backed (MB) "
             "| peak RSS (MB) | peak disk (MB) | disk after (MB) | of it processed (MB) | anonymous vs 12 |",
             "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]  # fmt: skip
    for r in runs:
        ratio = f"{r.peak_anon_mb / reference.peak_anon_mb:.2f}x" if reference else ""
        words = f"{r.distinct_words:,}" if r.distinct_words is not None else ""
        lines.append(
            f"| {r.shards} | {r.text_mb:,.0f} | {r.documents:,} | {words} | {r.wall_s:,.0f} | {r.peak_anon_mb:,.0f} |"
            f" {r.peak_file_mb:,.0f} | {r.peak_rss_mb:,.0f} | {r.peak_disk_mb:,.0f} | {r.disk_after_mb:,.0f} |"
            f" {r.processed_mb:,.0f} | {ratio} |"
        )
    return lines


def step_table(runs: list[Run]) -> list[str]:
    """Seconds and peak anonymous memory of each step (a step shorter than a sample has no peak: `-`)."""
    steps = [step for step in runs[-1].step_seconds if step != "total"]
    lines = ["| step | " + " | ".join(f"{r.shards} shards: s / peak anon. MB" for r in runs) + " |",
             "|---|" + "---:|" * len(runs)]  # fmt: skip
    for step in ["start-up", *steps]:
        cells = []
        for r in runs:
            peak = r.step_peak_anon_mb.get(step)
            cells.append(f"{r.step_seconds.get(step, 0):,.1f} / {'-' if peak is None else f'{peak:,.0f}'}")
        lines.append(f"| {step} | " + " | ".join(cells) + " |")
    return lines


def header(args: argparse.Namespace) -> list[str]:
    """The page's first lines: the command, the machine, the code measured."""
    cpuinfo = Path("/proc/cpuinfo").read_text().splitlines()
    cpu = next((ln.split(":", 1)[1].strip() for ln in cpuinfo if ln.startswith("model name")), "")
    command = " ".join(["python", "scripts/bench/bench_preprocess_scaling.py", *sys.argv[1:]])
    return [f"# Preprocessing at {', '.join(map(str, args.sizes))} shards", "",
            f"`{command}`, on {platform.node()} ({os.cpu_count()} cores, {cpu}), code of {args.checkout.name}."]  # fmt: skip


def page(runs: list[Run], first_lines: list[str]) -> str:
    reference = next((r for r in runs if r.shards == 12), None)
    lines = [*first_lines, "", *table(runs, reference), "", "Seconds and peak anonymous memory per pipeline step:",
             "", *step_table(runs), "", "What else ran (share of a core over the run):", ""]  # fmt: skip
    for r in runs:
        lines.append(
            f"- {r.shards} shards (mean load {r.load_average:.1f}): " + ("; ".join(r.beside) or "nothing")
        )
    return "\n".join(lines) + "\n"


def count_words_only(args: argparse.Namespace, shards: list[Path]) -> None:
    """Add each size's distinct words to a finished measurement (its JSON beside --out) and rewrite its page,
    keeping the measurement's command line."""
    runs = [Run(**r) for r in json.loads(args.out.with_suffix(".json").read_text())]
    for run in runs:
        run.distinct_words = distinct_words(corpus(shards, run.shards, args.work))
    command = " ".join(["python", "scripts/bench/bench_preprocess_scaling.py", *sys.argv[1:]])
    first = args.out.read_text().splitlines()[:3] + ["", f"Distinct words counted by `{command}`."]
    args.out.write_text(page(runs, first))
    args.out.with_suffix(".json").write_text(json.dumps([asdict(r) for r in runs], indent=1) + "\n")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shards", type=Path, default=WIKI, help="a folder of the twelve shards")
    parser.add_argument("--sizes", type=int, nargs="+", default=[1, 4, 12, 48])
    parser.add_argument("--checkout", type=Path, default=REPO, help="the project checkout whose code runs")
    parser.add_argument("--work", type=Path, default=Path("/tmp/cramming-preprocess-scaling"))
    parser.add_argument("--out", type=Path, default=REPO / "results" / "preprocessing" / "scaling.md")
    parser.add_argument("--words", action="store_true", help="also count each corpus's distinct words")
    parser.add_argument(
        "--words-only", action="store_true", help="count them for the measurement already in --out's JSON"
    )
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    args.checkout, args.work = args.checkout.resolve(), args.work.resolve()
    shards = sorted(args.shards.glob("*.jsonl.gz"))
    if not shards:
        raise SystemExit(f"no shards in {args.shards}: make them with python scripts/get_data.py wikipedia")
    args.work.mkdir(parents=True, exist_ok=True)
    if args.words_only:
        count_words_only(args, shards)
        return
    runs = []
    for size in args.sizes:
        folder = corpus(shards, size, args.work)
        runs.append(measure(size, folder, args))
        if args.words:
            runs[-1].distinct_words = distinct_words(folder)
        print(json.dumps(asdict(runs[-1])), flush=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(page(runs, header(args)))
    args.out.with_suffix(".json").write_text(json.dumps([asdict(r) for r in runs], indent=1) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
