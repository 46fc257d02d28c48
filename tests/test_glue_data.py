"""GLUE tasks from the local TSV layout, and the metrics module against scipy / scikit-learn."""

from __future__ import annotations

import numpy as np
import pytest

from cramming.errors import DataSourceError
from cramming.eval import glue_metric
from cramming.eval.glue_data import TaskDataMissing, load_local, read_tsv
from cramming.eval.tasks import GLUE_SANE, GLUE_TASKS

# Row counts (train, dev) of the real GLUE copy (CRAMMING_DATA/glue), as its README states them.
SHARED_ROWS = {
    "CoLA": (8551, 1043),
    "SST-2": (67349, 872),
    "MRPC": (3668, 408),
    "STS-B": (5749, 1500),
    "RTE": (2490, 277),
    "WNLI": (635, 71),
}


@pytest.mark.parametrize("name", sorted(SHARED_ROWS))
def test_local_task_row_counts_and_labels(glue_dir, name):
    task = GLUE_TASKS[name]
    splits = load_local(task, glue_dir)
    assert (len(splits["train"]), len(splits["dev"])) == SHARED_ROWS[name]
    labels = np.asarray(splits["train"]["label"])
    if task.is_regression:
        assert labels.min() >= 0.0 and labels.max() <= 5.0
    else:
        assert set(np.unique(labels)) == set(range(task.num_labels))
    texts_b = splits["dev"]["text_b"]
    assert all(texts_b) if task.tsv.text_b else not any(texts_b)
    assert all(t.strip() for t in splits["dev"]["text_a"])


def test_formats_of_the_original_files(glue_dir):
    cola = load_local(GLUE_TASKS["CoLA"], glue_dir)["train"][0]  # no header row
    assert cola["text_a"].startswith("Our friends won't buy this analysis")
    mrpc = load_local(GLUE_TASKS["MRPC"], glue_dir)["train"][0]  # header behind a byte-order mark
    assert mrpc["label"] == 1 and mrpc["text_a"].startswith("Amrozi accused his brother")
    rte = load_local(GLUE_TASKS["RTE"], glue_dir)["dev"][0]  # string labels, hub order
    assert rte["label"] == GLUE_TASKS["RTE"].labels.index("not_entailment") == 1
    assert '" the witness "' in mrpc["text_a"], "quotes must stay literal text (no CSV quoting)"


@pytest.mark.parametrize("name", ["QQP", "MNLI", "QNLI"])
def test_tasks_absent_here_are_reported_missing(glue_dir, name):
    with pytest.raises(TaskDataMissing, match=f"{name}: missing"):
        load_local(GLUE_TASKS[name], glue_dir)


@pytest.mark.parametrize(
    "task, content, message",
    [
        ("RTE", "index\tsentence1\tsentence2\tlabel\n0\ta\tb\tentailment\n1\ta\tb\tmaybe\n",
         r"train.tsv:3 label 'maybe' is not one of"),
        ("RTE", "index\tsentence1\tsentence2\tlabel\n0\ta\tb\n1\ta\tb\tentailment\n",
         r"train.tsv:2 has 3 fields, expected 4"),
        ("STS-B", "index\tgenre\tfilename\tyear\told_index\tsource1\tsource2\tsentence1\tsentence2\tscore\n"
         "0\tg\tf\ty\to\ts\ts\ta\tb\tabc\n1\tg\tf\ty\to\ts\ts\ta\tb\t2.5\n",
         r"train.tsv:2 score 'abc' is not a number"),
    ],
)  # fmt: skip
def test_a_bad_row_names_file_and_line_and_can_be_skipped(tmp_path, task, content, message):
    path = tmp_path / "train.tsv"
    path.write_text(content)
    with pytest.raises(DataSourceError, match=message + r".*eval.skip_bad_rows=true"):
        read_tsv(path, GLUE_TASKS[task])
    bad_rows = []
    rows = read_tsv(path, GLUE_TASKS[task], bad_rows)
    assert len(bad_rows) == 1 and str(path) in bad_rows[0]
    assert len(rows) == content.count("\n") - 2


@pytest.mark.parametrize(
    "content", ["index\tsentence1\tsentence2\tlabel\n", "index\tsentence1\tsentence2\tlabel\n0\ta\tb\n"]
)
def test_a_file_without_examples_fails_naming_it(tmp_path, content):
    path = tmp_path / "train.tsv"
    path.write_text(content)  # a header only; or, with bad rows skipped, nothing left
    with pytest.raises(DataSourceError, match=r"train.tsv has no examples"):
        read_tsv(path, GLUE_TASKS["RTE"], bad_rows=[])


def test_a_header_without_the_label_column_fails_even_when_skipping_rows(tmp_path):
    path = tmp_path / "train.tsv"
    path.write_text("index\tsentence1\tsentence2\tgold\n0\ta\tb\tentailment\n")
    with pytest.raises(DataSourceError, match=r"train.tsv:1 has no column\(s\) \['label'\]"):
        read_tsv(path, GLUE_TASKS["RTE"], bad_rows=[])


def test_glue_sane_is_eight_tasks_with_two_mnli_entries():
    assert len(GLUE_SANE) == 8 and "WNLI" not in GLUE_SANE
    mnli = GLUE_TASKS["MNLI"]
    assert [mnli.entry_name(s) for s, _, _ in mnli.eval_splits] == ["MNLI-m", "MNLI-mm"]


# ---------------------------------------------------------------- metrics


@pytest.fixture
def labels():
    rng = np.random.default_rng(0)
    ref = rng.integers(0, 2, size=500)
    pred = np.where(rng.random(500) < 0.7, ref, 1 - ref)
    return pred, ref


def test_metrics_match_scikit_learn(labels):
    sklearn_metrics = pytest.importorskip("sklearn.metrics")
    pred, ref = labels
    assert glue_metric.accuracy(pred, ref) == pytest.approx(
        sklearn_metrics.accuracy_score(ref, pred), abs=1e-12
    )
    assert glue_metric.f1(pred, ref) == pytest.approx(sklearn_metrics.f1_score(ref, pred), abs=1e-12)
    mcc = sklearn_metrics.matthews_corrcoef(ref, pred)
    assert glue_metric.matthews_correlation(pred, ref) == pytest.approx(mcc, abs=1e-12)
    three = np.random.default_rng(1).integers(0, 3, size=(2, 300))  # multi-class MCC too
    assert glue_metric.matthews_correlation(three[0], three[1]) == pytest.approx(
        sklearn_metrics.matthews_corrcoef(three[1], three[0]), abs=1e-12
    )
    assert glue_metric.matthews_correlation(np.ones(10, int), ref[:10]) == 0.0  # constant prediction


def test_correlations_match_scipy():
    stats = pytest.importorskip("scipy.stats")
    rng = np.random.default_rng(0)
    ref = np.round(rng.uniform(0, 5, size=400), 1)  # rounded: many ties, as in STS-B
    pred = ref + rng.normal(0, 1.0, size=400)
    assert glue_metric.pearson(pred, ref) == pytest.approx(stats.pearsonr(pred, ref)[0], abs=1e-10)
    assert glue_metric.spearman(pred, ref) == pytest.approx(stats.spearmanr(pred, ref)[0], abs=1e-10)
    assert glue_metric.spearman(np.round(pred), ref) == pytest.approx(
        stats.spearmanr(np.round(pred), ref)[0], abs=1e-10
    )


def test_metric_module_loads_offline_through_evaluate(labels, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    pred, ref = labels
    metric = glue_metric.load_glue_metric("mrpc")
    out = metric.compute(predictions=pred.tolist(), references=ref.tolist())
    assert set(out) == {"f1", "accuracy"}
    assert out["f1"] == pytest.approx(glue_metric.f1(pred, ref))
    stsb = glue_metric.load_glue_metric("stsb").compute(
        predictions=[0.5, 2.0, 4.5], references=[1.0, 2.0, 4.0]
    )
    assert stsb["pearson"] > 0.9
