"""GLUE score aggregation: medians over seeds, the cramming average, and what the table states."""

from __future__ import annotations

import pytest

from cramming.eval.scores import glue_average, markdown_table, summarize


def _results():
    return {
        "RTE": [{"accuracy": 0.50}, {"accuracy": 0.60}, {"accuracy": 0.55}],
        "CoLA": [{"matthews_correlation": 0.20, "accuracy": 0.7}] * 3,
        "MNLI-m": [{"accuracy": 0.80}] * 3,
        "MNLI-mm": [{"accuracy": 0.82}] * 3,
        "WNLI": [{"accuracy": 0.56}] * 3,
        "STS-B": [
            {"pearson": 0.85, "spearman": 0.84},
            {"pearson": 0.87, "spearman": 0.86},
            {"pearson": 0.86, "spearman": 0.80},
        ],
    }


def test_median_spread_and_main_metric():
    scores = summarize(_results())
    assert list(scores) == ["MNLI-m", "MNLI-mm", "CoLA", "STS-B", "RTE", "WNLI"]  # the paper's column order
    assert scores["RTE"].median == pytest.approx(0.55)
    assert scores["RTE"].spread == pytest.approx(0.10)
    assert scores["STS-B"].metric == "pearson" and scores["STS-B"].median == pytest.approx(0.86)
    assert scores["STS-B"].medians["spearman"] == pytest.approx(0.84)
    assert scores["CoLA"].metric == "matthews_correlation"


def test_average_counts_mnli_twice_and_never_wnli():
    avg, used = glue_average(summarize(_results()))
    assert used == ["MNLI-m", "MNLI-mm", "CoLA", "STS-B", "RTE"]
    assert avg == pytest.approx((0.80 + 0.82 + 0.20 + 0.86 + 0.55) / 5)


def test_table_states_coverage_and_skipped():
    table = markdown_table(summarize(_results()), skipped=["QQP", "QNLI"])
    assert "| MNLI-m | MNLI-mm | CoLA | STS-B | RTE | WNLI | Avg |" in table
    assert "55.0 ±5.0" in table
    assert "Average over 5 of the 9 GLUE-sane entries" in table
    assert "Skipped (no data): QQP, QNLI." in table
    assert "64.6" in table  # the average, x100
