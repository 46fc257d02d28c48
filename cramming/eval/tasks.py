"""The GLUE tasks: where their text and labels are, in the original TSV layout and on the hub.

Every task is read into the same shape: columns `text_a`, `text_b` (empty for single-sentence tasks) and
`label` (an int class id, or a float score for STS-B), with one training split and one or more
evaluation splits (MNLI has a matched and a mismatched one).
"""

from __future__ import annotations

from dataclasses import dataclass

HUB_PATH = "nyu-mll/glue"


@dataclass(frozen=True)
class TsvLayout:
    """Where the fields sit in a task's original TSV files."""

    # column names of the two texts (text_b None for single-sentence tasks) and of the label
    text_a: str
    text_b: str | None
    label: str
    # files without a header row (CoLA's train/dev) name their columns here
    columns: tuple[str, ...] | None = None


@dataclass(frozen=True)
class GlueTask:
    name: str
    # hub configuration of nyu-mll/glue and its column names
    hub_config: str
    hub_text_a: str
    hub_text_b: str | None
    tsv: TsvLayout
    # class names in the order of their ids (the hub's order); empty for regression (STS-B)
    labels: tuple[str, ...]
    # metrics reported, the first one is the task's score in the GLUE average
    metrics: tuple[str, ...]
    # evaluation splits: reported name -> (TSV file stem, hub split)
    eval_splits: tuple[tuple[str, str, str], ...] = (("", "dev", "validation"),)

    @property
    def is_regression(self) -> bool:
        return not self.labels

    @property
    def num_labels(self) -> int:
        return 1 if self.is_regression else len(self.labels)

    def entry_name(self, split: str) -> str:
        """The name of one evaluation split in tables, e.g. MNLI-m."""
        return f"{self.name}-{split}" if split else self.name


_COLA_COLUMNS = ("source", "label", "original_label", "sentence")

GLUE_TASKS: dict[str, GlueTask] = {
    task.name: task
    for task in (
        GlueTask(
            "CoLA", "cola", "sentence", None, TsvLayout("sentence", None, "label", _COLA_COLUMNS),
            labels=("0", "1"), metrics=("matthews_correlation", "accuracy"),
        ),
        GlueTask(
            "SST-2", "sst2", "sentence", None, TsvLayout("sentence", None, "label"),
            labels=("0", "1"), metrics=("accuracy",),
        ),
        GlueTask(
            "MRPC", "mrpc", "sentence1", "sentence2", TsvLayout("#1 String", "#2 String", "Quality"),
            labels=("0", "1"), metrics=("f1", "accuracy"),
        ),
        GlueTask(
            "STS-B", "stsb", "sentence1", "sentence2", TsvLayout("sentence1", "sentence2", "score"),
            labels=(), metrics=("pearson", "spearman"),
        ),
        GlueTask(
            "QQP", "qqp", "question1", "question2", TsvLayout("question1", "question2", "is_duplicate"),
            labels=("0", "1"), metrics=("f1", "accuracy"),
        ),
        GlueTask(
            "MNLI", "mnli", "premise", "hypothesis", TsvLayout("sentence1", "sentence2", "gold_label"),
            labels=("entailment", "neutral", "contradiction"), metrics=("accuracy",),
            eval_splits=(("m", "dev_matched", "validation_matched"), ("mm", "dev_mismatched", "validation_mismatched")),
        ),
        GlueTask(
            "QNLI", "qnli", "question", "sentence", TsvLayout("question", "sentence", "label"),
            labels=("entailment", "not_entailment"), metrics=("accuracy",),
        ),
        GlueTask(
            "RTE", "rte", "sentence1", "sentence2", TsvLayout("sentence1", "sentence2", "label"),
            labels=("entailment", "not_entailment"), metrics=("accuracy",),
        ),
        GlueTask(
            "WNLI", "wnli", "sentence1", "sentence2", TsvLayout("sentence1", "sentence2", "label"),
            labels=("0", "1"), metrics=("accuracy",),
        ),
    )
}  # fmt: skip

# The eight tasks of cramming's "GLUE-sane" evaluation; WNLI is optional and never in the average.
GLUE_SANE = ("CoLA", "SST-2", "MRPC", "STS-B", "QQP", "MNLI", "QNLI", "RTE")
