"""The real run, rehearsed on a CPU: `python pretrain.py budget=24` through every stage a GPU run takes, scaled
only by the budget, the data's size and the batch sizes.

    python scripts/rehearsal.py [--out outputs/rehearsal] [--minutes 3] [--threads N]

Stages, each a command a user would type (printed before it runs; its output goes to <out>/logs/<stage>.log):

    data      writes a few hundred rows in the hub datasets' own layout: wikimedia/wikipedia's parquet shards of
              config 20231101.en (columns id, url, title, text) with the README.md whose `configs:` names them,
              and bookcorpus/bookcorpus's parquet export (a `text` column, split train), from the embedded
              corpus's English; and a small GLUE in the TSV layout eval.glue_dir reads. Checks that
              `datasets.load_dataset(<folder>, "20231101.en", split="train")` reads them offline.
    pretrain  the budget=24 recipe (data=wikibooks, arch=crammed-bert, train=bert-o4) with its hub loaders
              pointed at those folders: preprocessing, tokenizer training, then crammed-bert at its full shape
              under budget-triangle2 and the batch ramp; stopped by SIGTERM once the first update is logged
    resume    the same command with resume=true: continues from the saved state until the budget is spent,
              then validates and writes the checkpoint
    glue      `eval.py eval=glue-sane` on the checkpoint: two tasks (MNLI's two dev sets, STS-B's regression)
              on 16 training and 32 evaluation examples each, labels drawn at random
    export    `scripts/export_hf.py`, then the folder loaded by transformers' AutoModelForMaskedLM in a
              process of its own, which fills one mask
    card      the run cards say data wikibooks, arch crammed-bert, lr_schedule budget-triangle2 and the batch
              ramp of the recipe, with no override beyond the scaled ones; an interrupted run, then a resumed
              one that finished

What differs from the GPU run, and nothing else: budget (minutes, not 24 hours), data.sources.*.path (local
folders; a local folder has no revision, so bookcorpus's pinned one is not read), train.batch_size 16 and
train.batch_size_start 4 (8192 and 128), impl.microbatch_size 4 (128), impl.cpu_threads, name, base_dir. The
vocabulary is as large as the small data allows (the recipe asks for 32768), so the embedding is smaller; the
encoder is crammed-bert's. No command reaches the network (HF_*_OFFLINE=1).

Writes <out>/rehearsal.json (each stage's command, seconds and facts), the runs under <out>/runs, the export
under <out>/export. Exits 0 when every stage passed, else 1 naming the stage that failed. A folder given as
--out is emptied first when an earlier rehearsal wrote it, and refused when anything else is in it.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import shlex
import shutil
import signal
import sys
import time
from collections.abc import Callable
from pathlib import Path

from cramming.job.runcard import newest_card, read_card
from cramming.study import launch

MARKER = ".rehearsal"  # in an --out folder this script made: it may empty it again
SUMMARY = "rehearsal.json"

# the recipe's own values, for the card check: what conf/train/bert-o4.yaml and conf/pretrain.yaml say
RECIPE = {
    "data": "wikibooks",
    "arch": "crammed-bert",
    "lr_schedule": "budget-triangle2",
    "batch_size_ramp": 0.6,
}
# the batch sizes, scaled (the recipe: 8192, 128 and 128)
SCALED = {"train.batch_size": 16, "train.batch_size_start": 4, "impl.microbatch_size": 4}
# every override of the rehearsal's commands: the recipe is `python pretrain.py budget=24` without them
ALLOWED_OVERRIDES = {
    "budget", "name", "base_dir", "resume", "impl.cpu_threads", *SCALED,
    "data.sources.wikipedia.path", "data.sources.bookcorpus.path",
}  # fmt: skip
WIKI_CONFIG = "20231101.en"
WIKI_ROWS, BOOK_ROWS = 300, 640  # articles; sentences (bookcorpus joins 64 into a document)
GLUE = {"MNLI": 64, "STS-B": 64}  # tasks and the training rows written for each
# eval.max_train_examples (one batch of glue-sane's 16, five epochs: five updates) and eval.max_eval_examples
GLUE_TRAIN, GLUE_EVAL = 16, 32
GLUE_WORDS = 12  # GLUE's sentences are short, and a batch pads to its longest: at most this many words
OFFLINE = {"HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}


class StageFailed(Exception):
    """A stage did not do what it should; the message says what, and where its log is."""


# ------------------------------------------------------------------------------------------------- the data


def english_documents(count: int, min_chars: int) -> list[dict[str, str]]:
    """The first `count` documents of the embedded corpus (the standard library's documentation) with at least
    `min_chars` characters, in its fixed order."""
    from cramming.data import embedded

    docs = []
    for doc in embedded.iter_stdlib_docs():
        if len(doc["text"]) >= min_chars:
            docs.append(doc)
            if len(docs) == count:
                break
    return docs


def write_wikipedia(folder: Path, docs: list[dict[str, str]]) -> None:
    """wikimedia/wikipedia's layout: <config>/train-0000N-of-0000M.parquet with columns id, url, title, text,
    and a README.md whose front matter maps the config to its files."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    shards = 2
    (folder / WIKI_CONFIG).mkdir(parents=True)
    for shard in range(shards):
        part = list(enumerate(docs))[shard::shards]
        ids = [str(1000 + i) for i, _ in part]
        table = pa.table({
            "id": ids,
            "url": [f"https://en.wikipedia.org/wiki?curid={i}" for i in ids],
            "title": [doc["source"].removesuffix(".py").replace("/", " ") for _, doc in part],
            "text": [doc["text"] for _, doc in part],
        })  # fmt: skip
        pq.write_table(table, folder / WIKI_CONFIG / f"train-{shard:05d}-of-{shards:05d}.parquet")
    features = "".join(f"  - name: {name}\n    dtype: string\n" for name in ("id", "url", "title", "text"))
    (folder / "README.md").write_text(
        "---\n"
        f"dataset_info:\n- config_name: {WIKI_CONFIG}\n  features:\n{features}"
        f"configs:\n- config_name: {WIKI_CONFIG}\n  data_files:\n  - split: train\n"
        f"    path: {WIKI_CONFIG}/train-*\n"
        "---\n\n# A few articles in wikimedia/wikipedia's layout, written by scripts/rehearsal.py\n"
    )


def sentences(docs: list[dict[str, str]], count: int, max_words: int = 64) -> list[str]:
    """BookCorpus's rows: one lower-cased sentence each, words and punctuation separated by spaces."""
    found = []
    for doc in docs:
        for sentence in re.split(r"(?<=[.!?])\s+", " ".join(doc["text"].split())):
            words = re.findall(r"[\w']+|[^\w\s]", sentence.lower())
            if 4 <= len(words) <= max_words:
                found.append(" ".join(words))
                if len(found) == count:
                    return found
    raise StageFailed(f"the embedded corpus gave only {len(found)} of {count} sentences")


def write_bookcorpus(folder: Path, rows: list[str]) -> None:
    """bookcorpus/bookcorpus's parquet export (the revision the recipe pins): plain_text/train/000N.parquet
    with one `text` column."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    (folder / "plain_text" / "train").mkdir(parents=True)
    half = len(rows) // 2
    for shard, part in enumerate((rows[:half], rows[half:])):
        pq.write_table(pa.table({"text": part}), folder / "plain_text" / "train" / f"{shard:04d}.parquet")


def write_glue(folder: Path, texts: list[str]) -> dict[str, list[str]]:
    """Small GLUE tasks in the TSV layout eval.glue_dir reads (written by the package's own writer), labels
    drawn at random: the stage checks the path, not what is learnable. Returns the files per task."""
    import datasets

    from cramming.eval.glue_data import write_local
    from cramming.eval.tasks import GLUE_TASKS

    rng = random.Random(0)
    written = {}
    for name, train_rows in GLUE.items():
        task = GLUE_TASKS[name]

        def split(rows: int, task=task) -> datasets.Dataset:
            pairs = [(rng.choice(texts), rng.choice(texts)) for _ in range(rows)]
            labels = [
                round(rng.uniform(0, 5), 2) if task.is_regression else rng.randrange(task.num_labels)
                for _ in range(rows)
            ]
            return datasets.Dataset.from_dict(
                {"text_a": [a for a, _ in pairs], "text_b": [b for _, b in pairs], "label": labels}
            )

        splits = {"train": split(train_rows)} | {
            split_name or "dev": split(GLUE_EVAL) for split_name, _, _ in task.eval_splits
        }
        paths = write_local(task, datasets.DatasetDict(splits), folder)
        written[name] = [str(p.relative_to(folder)) for p in paths]
    return written


def check_hub_layout(wikipedia: Path, bookcorpus: Path) -> dict:
    """Read both folders as the hub loader does (path, config, split; offline), and report rows and columns."""
    import datasets

    datasets.disable_progress_bars()
    wiki = datasets.load_dataset(str(wikipedia), WIKI_CONFIG, split="train")
    books = datasets.load_dataset(str(bookcorpus), split="train")
    if wiki.column_names != ["id", "url", "title", "text"] or books.column_names != ["text"]:
        raise StageFailed(
            f"columns read back: wikipedia {wiki.column_names}, bookcorpus {books.column_names}"
        )
    return {"wikipedia_rows": len(wiki), "bookcorpus_rows": len(books)}


def stage_data(out: Path, args: argparse.Namespace, done: dict) -> dict:
    """The corpora in the hub's layout and a small GLUE, from the embedded corpus's first long documents."""
    docs = english_documents(WIKI_ROWS + 200, min_chars=400)
    hub = out / "hub"
    write_wikipedia(hub / "wikipedia", docs[:WIKI_ROWS])
    write_bookcorpus(hub / "bookcorpus", sentences(docs[WIKI_ROWS:], BOOK_ROWS))
    glue = write_glue(out / "glue", sentences(docs[:WIKI_ROWS], 400, max_words=GLUE_WORDS))
    facts = check_hub_layout(hub / "wikipedia", hub / "bookcorpus")
    return facts | {"glue_files": glue}


# ---------------------------------------------------------------------------------------------- the commands


def pretrain_command(out: Path, minutes: float, threads: int) -> list[str]:
    """`python pretrain.py budget=24`, with only the budget, the data paths, the batch sizes and the threads
    scaled (and base_dir, so that nothing lands beside the user's own runs)."""
    hub = out / "hub"
    return [
        sys.executable, "pretrain.py", f"budget={minutes / 60:.6g}", "name=rehearsal", f"base_dir={out / 'runs'}",
        f"data.sources.wikipedia.path={hub / 'wikipedia'}", f"data.sources.bookcorpus.path={hub / 'bookcorpus'}",
        *(f"{key}={value}" for key, value in SCALED.items()), f"impl.cpu_threads={threads}",
    ]  # fmt: skip


def run_logged(
    argv: list[str], log_path: Path, until: Callable[[str], bool] | None = None, timeout: float = 1800
) -> tuple[int, str, bool]:
    """The command, offline, with its output in `log_path` (launch.run_logged); SIGTERM once the log satisfies
    `until`. Returns (exit status, the log, whether SIGTERM was sent)."""
    return launch.run_logged(argv, log_path, until, timeout=timeout, env=os.environ | OFFLINE)


def newest_run(out: Path, name: str) -> tuple[Path, dict]:
    """(folder, run card) of the newest run of `name` under the rehearsal's runs."""
    found = newest_card(out / "runs", name)
    if found is None:
        raise StageFailed(f"it left no run card under {out / 'runs' / name}")
    return found


def stage_pretrain(out: Path, args: argparse.Namespace, done: dict) -> dict:
    """The first part of the run, stopped by SIGTERM after update 1: exit 128 + SIGTERM, a resumable state."""
    command = pretrain_command(out, args.minutes, args.threads)
    print_command(command)
    code, text, sent = run_logged(command, out / "logs" / "pretrain.log", until=lambda t: "update 1 |" in t)
    if not sent:
        raise StageFailed(f"it ended (exit {code}) before its first update was logged")
    if code != 128 + signal.SIGTERM:
        raise StageFailed(f"stopped by SIGTERM it exited {code}, not {128 + signal.SIGTERM}")
    run_dir, card = newest_run(out, "rehearsal")
    if card["status"] != "interrupted" or not (run_dir / "state.pt").is_file():
        raise StageFailed(
            f"card status {card['status']!r}; state.pt saved: {(run_dir / 'state.pt').is_file()}"
        )
    return {
        "run_dir": str(run_dir),
        "exit": code,
        "status": card["status"],
        "updates": card["metrics"].get("updates"),
        "vocab_size": card["data"].get("vocab_size"),
        "train_rows": card["data"].get("train_rows"),
        "seconds_data": card["seconds"].get("data"),
        "parameters": parameter_count(text),
    }


def parameter_count(text: str) -> str | None:
    """What the log says of the model's size: "120.0M parameters (94.8M without the ... embedding)"."""
    found = re.search(r"model crammed-bert: (.+ embedding\))", text)
    return found.group(1) if found else None


def stage_resume(out: Path, args: argparse.Namespace, done: dict) -> dict:
    """The same command with resume=true: from the saved state to the end of the budget, then the model."""
    first = done["pretrain"]
    command = [*pretrain_command(out, args.minutes, args.threads), "resume=true"]
    print_command(command)
    code, text, _ = run_logged(command, out / "logs" / "resume.log")
    if code != 0:
        raise StageFailed(f"exit {code}")
    if f"resuming from {first['run_dir']}/state.pt" not in text:
        raise StageFailed(f"it did not resume from {first['run_dir']}/state.pt")
    run_dir, card = newest_run(out, "rehearsal")
    metrics = card["metrics"]
    if card["status"] != "ok" or metrics.get("stop_reason") != "budget":
        raise StageFailed(f"card status {card['status']!r}, stop reason {metrics.get('stop_reason')!r}")
    if not (run_dir / "checkpoint" / "model.safetensors").is_file():
        raise StageFailed(f"no checkpoint in {run_dir}")
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    logged = [r for r in records if "batch_size" in r]
    return {
        "run_dir": str(run_dir),
        "updates": metrics["updates"],
        "updates_before": first["updates"],
        "stop_reason": metrics["stop_reason"],
        "budget_hours_spent": metrics["budget_hours_spent"],
        "val_loss": metrics.get("val_loss"),
        "first_batch": logged[0]["batch_size"] if logged else None,  # its first update's sequences
        "last_batch": logged[-1]["batch_size"] if logged else None,  # per update in its last log window
        "last_lr": logged[-1]["lr"] if logged else None,
    }


def stage_glue(out: Path, args: argparse.Namespace, done: dict) -> dict:
    """glue-sane on the checkpoint, scaled by its tasks and examples only."""
    command = [
        sys.executable, "eval.py", f"checkpoint={done['resume']['run_dir']}", "eval=glue-sane",
        f"eval.glue_dir={out / 'glue'}", f"eval.tasks=[{','.join(GLUE)}]",
        f"eval.max_train_examples={GLUE_TRAIN}", f"eval.max_eval_examples={GLUE_EVAL}",
        f"base_dir={out / 'runs'}", f"impl.cpu_threads={args.threads}",
    ]  # fmt: skip
    print_command(command)
    code, text, _ = run_logged(command, out / "logs" / "glue.log")
    if code != 0:
        raise StageFailed(f"exit {code}")
    eval_dir, card = newest_run(out, "glue")
    results = json.loads((eval_dir / "glue_results.json").read_text())
    scores = {entry: round(100 * score["median"], 1) for entry, score in results["scores"].items()}
    return {
        "eval_dir": str(eval_dir),
        "status": card["status"],
        "recipe": results["config"]["eval"]["name"],
        "scores": scores,
        "glue_average": round(100 * results["glue_average"], 1),
    }


LOAD_EXPORT = """
import sys, torch
from transformers import AutoModelForMaskedLM, AutoTokenizer
folder = sys.argv[1]
tokenizer = AutoTokenizer.from_pretrained(folder, trust_remote_code=True)
model = AutoModelForMaskedLM.from_pretrained(folder, trust_remote_code=True).eval()
inputs = tokenizer("the function returns a new " + tokenizer.mask_token + " of the list.", return_tensors="pt")
with torch.no_grad():
    logits = model(**inputs).logits
assert torch.isfinite(logits).all(), "non-finite logits"
position = (inputs["input_ids"][0] == tokenizer.mask_token_id).nonzero()[0, 0]
print("loaded", type(model).__name__, sum(p.numel() for p in model.parameters()), "parameters;",
      "logits", tuple(logits.shape), "; the mask filled with", repr(tokenizer.decode(logits[0, position].argmax())))
"""


def stage_export(out: Path, args: argparse.Namespace, done: dict) -> dict:
    """The transformers folder, then loaded as a user loads it, in a process of its own."""
    export, run_dir = out / "export", done["resume"]["run_dir"]
    command = [sys.executable, "scripts/export_hf.py", run_dir, str(export), "--base-dir", str(out / "runs")]
    print_command(command)
    code, _, _ = run_logged(command, out / "logs" / "export.log")
    if code != 0:
        raise StageFailed(f"export_hf.py exited {code}")
    load = [sys.executable, "-c", LOAD_EXPORT, str(export)]
    print_command(
        [sys.executable, "-c", "<AutoModelForMaskedLM.from_pretrained, one fill-mask>", str(export)]
    )
    code, text, _ = run_logged(load, out / "logs" / "export_load.log")
    if code != 0:
        raise StageFailed(f"loading the export with transformers exited {code}")
    loaded = next((line for line in text.splitlines() if line.startswith("loaded ")), "")
    config = json.loads((export / "config.json").read_text())
    return {"folder": str(export), "model_type": config.get("model_type"), "loaded": loaded}


def stage_card(out: Path, args: argparse.Namespace, done: dict) -> dict:
    """The run cards say the recipe ran, interrupted then resumed: data wikibooks read by the two hub loaders,
    arch crammed-bert, budget-triangle2, the batch ramp at 60% of the budget between the scaled sizes, and no
    override but the scaled ones."""
    facts = {}
    for part in ("pretrain", "resume"):
        card = read_card(Path(done[part]["run_dir"]))
        if card is None:
            raise StageFailed(f"no run card in {done[part]['run_dir']}")
        config, train = card["config"], card["config"]["train"]
        seen = {
            "data": config["data"]["name"],
            "arch": config["arch"]["name"],
            "lr_schedule": train["lr_schedule"],
            "batch_size_ramp": train["batch_size_ramp"],
            "train.batch_size": train["batch_size"],
            "train.batch_size_start": train["batch_size_start"],
            "impl.microbatch_size": config["impl"]["microbatch_size"],
            "data_sources": {name: src["kind"] for name, src in config["data"]["sources"].items()},
            "overrides": sorted(o.split("=", 1)[0] for o in card["job"]["overrides"]),
        }
        want = RECIPE | SCALED | {"data_sources": {"wikipedia": "hub", "bookcorpus": "hub"}}
        wrong = {key: seen[key] for key, value in want.items() if seen[key] != value}
        extra = set(seen["overrides"]) - ALLOWED_OVERRIDES
        if wrong or extra:
            raise StageFailed(
                f"the {part} card says {wrong}, overrides {sorted(extra)} beyond the scaled ones"
            )
        facts[part] = seen
    return facts


# ------------------------------------------------------------------------------------------------ the driver


def print_command(argv: list[str]) -> None:
    shown = [Path(argv[0]).name if i == 0 else arg for i, arg in enumerate(argv)]
    print("   $ " + shlex.join(shown), flush=True)


def prepare_out(out: Path) -> None:
    """An empty --out folder with the marker that lets a later rehearsal empty it again."""
    if out.exists() and any(out.iterdir()):
        if not (out / MARKER).exists():
            raise SystemExit(f"{out} holds files this script did not write: name another --out")
        shutil.rmtree(out)
    (out / "logs").mkdir(parents=True, exist_ok=True)
    (out / MARKER).write_text("written by scripts/rehearsal.py; emptied by its next run\n")


# name, what it does, the function (the rehearsal's folder, its arguments, the facts of the stages before)
STAGES: tuple[tuple[str, str, Callable[[Path, argparse.Namespace, dict], dict]], ...] = (
    ("data", "hub-layout corpora and GLUE TSVs", stage_data),
    ("pretrain", "data, tokenizer, training; SIGTERM after update 1", stage_pretrain),
    ("resume", "resume=true to the end of the budget", stage_resume),
    ("glue", "eval.py eval=glue-sane on a subset", stage_glue),
    ("export", "export_hf.py, loaded by transformers", stage_export),
    ("card", "the run cards show the recipe", stage_card),
)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--out", default="outputs/rehearsal", help="its folder (emptied when a rehearsal made it)"
    )
    parser.add_argument(
        "--minutes", type=float, default=3.0, help="the pretraining budget (the recipe: 1440)"
    )
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1, help="impl.cpu_threads")
    args = parser.parse_args(argv)
    out = Path(args.out).resolve()
    prepare_out(out)
    os.environ.update(OFFLINE)  # before `datasets` is imported: the data stage reads its folders offline too
    summary: dict = {"out": str(out), "minutes": args.minutes, "threads": args.threads, "stages": {}}
    results: dict = {}
    for number, (name, what, run) in enumerate(STAGES, start=1):
        print(f"[{number}/{len(STAGES)}] {name}: {what}", flush=True)
        start = time.perf_counter()
        try:
            results[name] = run(out, args, results)
        except Exception as err:  # any failure of a stage: named, with its log, and the rehearsal stops
            seconds = time.perf_counter() - start
            summary["stages"][name] = {"ok": False, "seconds": round(seconds, 1), "error": str(err)}
            summary["failed"] = name
            (out / SUMMARY).write_text(json.dumps(summary, indent=2) + "\n")
            log = out / "logs" / f"{name}.log"
            tail = "\n".join(log.read_text(errors="replace").splitlines()[-25:]) if log.exists() else ""
            print(f"{tail}\nrehearsal failed at stage {name!r} after {seconds:.0f} s: {err}", file=sys.stderr)
            if log.exists():
                print(f"its log: {log}", file=sys.stderr)
            return 1
        seconds = time.perf_counter() - start
        summary["stages"][name] = {"ok": True, "seconds": round(seconds, 1), **results[name]}
        print(f"   ok in {seconds:.0f} s: {brief(name, results[name])}", flush=True)
    summary["failed"] = None
    (out / SUMMARY).write_text(json.dumps(summary, indent=2) + "\n")
    total = sum(stage["seconds"] for stage in summary["stages"].values())
    print(f"rehearsal passed in {total / 60:.1f} min; {out / SUMMARY}")
    return 0


def brief(name: str, facts: dict) -> str:
    """One line of what a stage found."""
    if name == "data":
        return f"{facts['wikipedia_rows']} articles, {facts['bookcorpus_rows']} sentences, GLUE {list(GLUE)}"
    if name == "pretrain":
        return (
            f"{facts['parameters']}, {facts['train_rows']} rows of 128 tokens;"
            f" stopped after {facts['updates']} update(s), exit {facts['exit']}, state saved"
        )
    if name == "resume":
        return (
            f"from update {facts['updates_before']} to {facts['updates']} ({facts['stop_reason']}), batch"
            f" {facts['first_batch']} then {facts['last_batch']} (the ramp), val loss {facts['val_loss']:.3f}"
        )
    if name == "glue":
        return f"{facts['recipe']}: {facts['scores']} (random labels: the path is checked, not the scores)"
    if name == "export":
        return f"{facts['model_type']}: {facts['loaded']}"
    card = facts["resume"]
    return (
        f"data {card['data']} ({', '.join(f'{k}: {v}' for k, v in card['data_sources'].items())}), arch"
        f" {card['arch']}, {card['lr_schedule']}, batch {card['train.batch_size_start']} to"
        f" {card['train.batch_size']} at {card['batch_size_ramp']:.0%} of the budget, micro-batch"
        f" {card['impl.microbatch_size']}; in both cards, overrides {', '.join(card['overrides'])}"
    )


if __name__ == "__main__":
    sys.exit(main())
