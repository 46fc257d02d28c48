"""GLUE metrics as an `evaluate` module that ships with the project and loads offline.

    metric = evaluate.load("cramming/eval/glue_metric.py", "cola")   # or load_glue_metric("CoLA")
    metric.compute(predictions=[...], references=[...])

The hub's metric scripts cannot be fetched without network, so the formulas are written out here with
numpy alone (the tests check them against scipy and scikit-learn): Matthews correlation for CoLA, F1 and
accuracy for MRPC and QQP, Pearson and Spearman correlation for STS-B, accuracy for the rest.
"""

from __future__ import annotations

from pathlib import Path

import datasets
import evaluate
import numpy as np

_DESCRIPTION = "GLUE metrics (Wang et al., 2018): Matthews correlation, accuracy, F1, Pearson, Spearman."
_CITATION = "Wang et al., GLUE: A Multi-Task Benchmark and Analysis Platform for Natural Language Understanding, 2018."
_INPUTS = "predictions: predicted class ids (a float score for stsb); references: the gold labels."

METRICS_BY_CONFIG = {
    "cola": ("matthews_correlation", "accuracy"),
    "sst2": ("accuracy",),
    "mrpc": ("f1", "accuracy"),
    "stsb": ("pearson", "spearman"),
    "qqp": ("f1", "accuracy"),
    "mnli": ("accuracy",),
    "mnli_matched": ("accuracy",),
    "mnli_mismatched": ("accuracy",),
    "qnli": ("accuracy",),
    "rte": ("accuracy",),
    "wnli": ("accuracy",),
}


def accuracy(pred: np.ndarray, ref: np.ndarray) -> float:
    return float(np.mean(pred == ref))


def f1(pred: np.ndarray, ref: np.ndarray) -> float:
    """F1 of the positive class (label 1); 0 when there are no true positives."""
    tp = np.sum((pred == 1) & (ref == 1))
    fp = np.sum((pred == 1) & (ref != 1))
    fn = np.sum((pred != 1) & (ref == 1))
    return float(2 * tp / (2 * tp + fp + fn)) if tp else 0.0


def matthews_correlation(pred: np.ndarray, ref: np.ndarray) -> float:
    """Multi-class Matthews correlation (Gorodkin's R_K) from the confusion matrix; 0 when undefined."""
    classes = np.union1d(pred, ref)
    confusion = np.zeros((len(classes), len(classes)), dtype=np.float64)
    np.add.at(confusion, (np.searchsorted(classes, ref), np.searchsorted(classes, pred)), 1)
    n = confusion.sum()
    correct = np.trace(confusion)
    true_per_class, pred_per_class = confusion.sum(axis=1), confusion.sum(axis=0)
    cov_pt = correct * n - true_per_class @ pred_per_class
    cov_pp = n * n - pred_per_class @ pred_per_class
    cov_tt = n * n - true_per_class @ true_per_class
    if cov_pp == 0 or cov_tt == 0:
        return 0.0
    return float(cov_pt / np.sqrt(cov_pp * cov_tt))


def pearson(pred: np.ndarray, ref: np.ndarray) -> float:
    pred, ref = pred.astype(np.float64), ref.astype(np.float64)
    dp, dr = pred - pred.mean(), ref - ref.mean()
    denom = np.sqrt((dp * dp).sum() * (dr * dr).sum())
    return float((dp * dr).sum() / denom) if denom > 0 else 0.0


def _average_ranks(x: np.ndarray) -> np.ndarray:
    """Ranks 1..n, ties sharing the mean of their ranks (as Spearman's rho needs)."""
    order = np.argsort(x, kind="stable")
    sorted_x = x[order]
    ranks = np.empty(len(x), dtype=np.float64)
    starts = np.flatnonzero(np.r_[True, sorted_x[1:] != sorted_x[:-1]])
    ends = np.r_[starts[1:], len(x)]
    for start, end in zip(starts, ends, strict=True):
        ranks[order[start:end]] = (start + end + 1) / 2  # mean of ranks start+1 .. end
    return ranks


def spearman(pred: np.ndarray, ref: np.ndarray) -> float:
    return pearson(_average_ranks(pred.astype(np.float64)), _average_ranks(ref.astype(np.float64)))


FUNCTIONS = {
    "accuracy": accuracy,
    "f1": f1,
    "matthews_correlation": matthews_correlation,
    "pearson": pearson,
    "spearman": spearman,
}


class GlueMetric(evaluate.Metric):
    def _info(self) -> evaluate.MetricInfo:
        if self.config_name not in METRICS_BY_CONFIG:
            raise KeyError(
                f"unknown GLUE config {self.config_name!r}; choose one of {sorted(METRICS_BY_CONFIG)}"
            )
        value = datasets.Value("float32" if self.config_name == "stsb" else "int64")
        return evaluate.MetricInfo(
            description=_DESCRIPTION,
            citation=_CITATION,
            inputs_description=_INPUTS,
            features=datasets.Features({"predictions": value, "references": value}),
        )

    def _compute(self, predictions, references) -> dict[str, float]:
        pred, ref = np.asarray(predictions), np.asarray(references)
        return {name: FUNCTIONS[name](pred, ref) for name in METRICS_BY_CONFIG[self.config_name]}


def load_glue_metric(config_name: str) -> evaluate.EvaluationModule:
    """This module through `evaluate.load`, by its path: no network needed."""
    return evaluate.load(str(Path(__file__).resolve()), config_name)
