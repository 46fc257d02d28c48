"""Read a GLUE task from a local folder in the original TSV layout, or from the hub (`nyu-mll/glue`)."""

from __future__ import annotations

import csv
import logging
import math
import re
from pathlib import Path

import datasets

from cramming.errors import DataSourceError, check_readable
from cramming.eval.tasks import HUB_PATH, GlueTask

log = logging.getLogger("cramming")

FEATURES = {
    "classification": datasets.Features(
        {
            "text_a": datasets.Value("string"),
            "text_b": datasets.Value("string"),
            "label": datasets.Value("int64"),
        }
    ),
    "regression": datasets.Features(
        {
            "text_a": datasets.Value("string"),
            "text_b": datasets.Value("string"),
            "label": datasets.Value("float32"),
        }
    ),
}


class TaskDataMissing(DataSourceError):
    """A task's files are not there (e.g. QQP and MNLI in a partial copy of GLUE); the task is skipped."""


def _features(task: GlueTask) -> datasets.Features:
    return FEATURES["regression" if task.is_regression else "classification"]


# characters that would end a field or a row of a TSV file read without quoting
TSV_BREAKS = re.compile(r"[\t\r\n]")

SKIP_HINT = "fix the file, or set eval.skip_bad_rows=true to skip such rows (counted in glue_results.json)"


def read_tsv(path: Path, task: GlueTask, bad_rows: list[str] | None = None) -> datasets.Dataset:
    """One TSV file of the original GLUE layout: tab-separated, no quoting, a header unless the task says not.

    A bad row (too few fields, a label outside the task's labels, a score that is not a number) raises
    DataSourceError naming the file and line; with a `bad_rows` list it is skipped and described there
    instead. A header without the task's columns always raises: no row of such a file can be read."""
    try:
        rows = _read_rows(path, task, bad_rows)
    except (UnicodeDecodeError, OSError) as err:
        raise DataSourceError(
            f"{path} does not read as UTF-8 text ({type(err).__name__}: {err}): copy the task's file again, or"
            f" leave {task.name} out of eval.tasks"
        ) from err
    if not rows["label"]:
        skipped = " (every row was a bad row, skipped)" if bad_rows else ""
        raise DataSourceError(
            f"{path} has no examples{skipped}: a header at most. Copy the task's file again, or leave"
            f" {task.name} out of eval.tasks"
        )
    return datasets.Dataset.from_dict(rows, features=_features(task))


def _read_rows(path: Path, task: GlueTask, bad_rows: list[str] | None) -> dict[str, list]:
    """The columns text_a, text_b and label of read_tsv's file."""
    layout = task.tsv
    rows: dict[str, list] = {"text_a": [], "text_b": [], "label": []}
    with open(path, encoding="utf-8-sig", newline="") as f:  # -sig: MRPC's files start with a byte-order mark
        reader = csv.reader(f, delimiter="\t", quoting=csv.QUOTE_NONE)
        header = list(layout.columns) if layout.columns else next(reader, [])
        missing = [c for c in (layout.text_a, layout.text_b, layout.label) if c and c not in header]
        if missing:
            raise DataSourceError(
                f"{path}:1 has no column(s) {missing}; its header is {header}. {task.name} needs the original"
                f" GLUE layout: a header row naming {[c for c in (layout.text_a, layout.text_b, layout.label) if c]}"
            )
        col = {name: header.index(name) for name in (layout.text_a, layout.text_b, layout.label) if name}
        for line_no, fields in enumerate(reader, start=2 if not layout.columns else 1):
            if not fields:
                continue
            try:
                if len(fields) < len(header):
                    raise BadRow(f"has {len(fields)} fields, expected {len(header)}")
                label = _label(fields[col[layout.label]], task)
            except BadRow as err:
                if bad_rows is None:
                    raise DataSourceError(f"{path}:{line_no} {err}: {SKIP_HINT}") from None
                bad_rows.append(f"{path}:{line_no} {err}")
                continue
            rows["text_a"].append(fields[col[layout.text_a]])
            rows["text_b"].append(fields[col[layout.text_b]] if layout.text_b else "")
            rows["label"].append(label)
    return rows


class BadRow(ValueError):
    """What is wrong with one row (read_tsv adds the file and line)."""


def _label(raw: str, task: GlueTask) -> int | float:
    if task.is_regression:
        try:
            score = float(raw)
        except ValueError:
            raise BadRow(f"score {raw!r} is not a number") from None
        if not math.isfinite(score):
            raise BadRow(f"score {raw!r} is not a finite number")
        return score
    if raw not in task.labels:
        raise BadRow(f"label {raw!r} is not one of {task.labels}")
    return task.labels.index(raw)


def load_local(
    task: GlueTask, glue_dir: str | Path, bad_rows: list[str] | None = None
) -> datasets.DatasetDict:
    """`train` plus the task's evaluation splits (named as in GlueTask.eval_splits) from `glue_dir/<task>/`.
    bad_rows: see read_tsv."""
    folder = Path(glue_dir) / task.name
    files = {"train": folder / "train.tsv"} | {
        split or "dev": folder / f"{stem}.tsv" for split, stem, _ in task.eval_splits
    }
    for path in (Path(glue_dir), folder, *files.values()):  # one this process may not read: say so
        check_readable(path, "eval.glue_dir")
    absent = [str(p) for p in files.values() if not p.exists()]
    if absent:
        raise TaskDataMissing(f"{task.name}: missing {', '.join(absent)}")
    return datasets.DatasetDict({split: read_tsv(path, task, bad_rows) for split, path in files.items()})


def hub_dataset(task: GlueTask, cache_dir: str | Path | None = None) -> datasets.DatasetDict:
    """The task as the hub's `nyu-mll/glue` holds it (its own columns and split names): the one network call
    of this module. Raises ConnectionError without network."""
    return datasets.load_dataset(HUB_PATH, task.hub_config, cache_dir=str(cache_dir) if cache_dir else None)


def load_hub(task: GlueTask, cache_dir: str | Path | None = None) -> datasets.DatasetDict:
    """The same splits from the hub's `nyu-mll/glue`, renamed to the local layout."""
    try:
        hub = hub_dataset(task, cache_dir)
    except ConnectionError as err:
        raise TaskDataMissing(
            f"{task.name}: could not reach the Hugging Face hub ({err}); point eval.glue_dir at a local copy "
            "of GLUE in the original TSV layout"
        ) from err
    splits = {"train": "train"} | {split or "dev": hub_split for split, _, hub_split in task.eval_splits}
    out = {}
    for name, hub_split in splits.items():
        ds = hub[hub_split]
        text_b = ds[task.hub_text_b] if task.hub_text_b else [""] * len(ds)
        out[name] = datasets.Dataset.from_dict(
            {"text_a": ds[task.hub_text_a], "text_b": text_b, "label": ds["label"]}, features=_features(task)
        )
    return datasets.DatasetDict(out)


def write_local(task: GlueTask, splits: datasets.DatasetDict, glue_dir: str | Path) -> list[Path]:
    """Write `splits` (load_hub's or load_local's shape) as `glue_dir/<task>/<file>.tsv` in the layout
    load_local reads: `train.tsv` and the task's dev files, tab-separated, a header row of the columns the
    reader looks for (none for CoLA, whose original files have none), labels as the original files write
    them. Tabs and line breaks inside a text become spaces (the files are read without quoting). Each file
    is written beside its final name and then renamed, so a stopped command leaves no half-written file.
    Returns the files written."""
    layout, folder = task.tsv, Path(glue_dir) / task.name
    # CoLA's files have no header and four columns (source, label, original label, sentence); the others a
    # header naming the columns
    columns = layout.columns or tuple(c for c in (layout.text_a, layout.text_b, layout.label) if c)
    folder.mkdir(parents=True, exist_ok=True)
    stems = {"train": "train"} | {split or "dev": stem for split, stem, _ in task.eval_splits}
    written = []
    for split, stem in stems.items():
        path = folder / f"{stem}.tsv"
        partial = path.with_name(path.name + ".partial")
        with open(partial, "w", encoding="utf-8", newline="") as f:
            if not layout.columns:
                f.write("\t".join(columns) + "\n")
            for row in splits[split]:
                values = {
                    layout.text_a: _one_field(row["text_a"]),
                    layout.label: _label_text(row["label"], task),
                }
                if layout.text_b:
                    values[layout.text_b] = _one_field(row["text_b"])
                f.write("\t".join(values.get(c, "") for c in columns) + "\n")
        partial.replace(path)
        written.append(path)
    return written


def _one_field(text: str) -> str:
    return TSV_BREAKS.sub(" ", text)


def _label_text(label: int | float, task: GlueTask) -> str:
    """A label as the original TSV files write it: the class name, or the score."""
    if task.is_regression:
        return f"{float(label):.6g}"
    if not 0 <= label < len(task.labels):
        raise DataSourceError(
            f"{task.name}: label {label} is not a class id of {task.labels} (a test split?)"
        )
    return task.labels[label]


def load_task(
    task: GlueTask,
    glue_dir: str | Path | None,
    cache_dir: str | Path | None = None,
    bad_rows: list[str] | None = None,
) -> datasets.DatasetDict:
    """From `glue_dir` when given, else from the hub. Raises TaskDataMissing when the task's files are not
    there, DataSourceError for a file that cannot be read (bad_rows: see read_tsv)."""
    return load_local(task, glue_dir, bad_rows) if glue_dir else load_hub(task, cache_dir)
