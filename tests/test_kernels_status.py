"""`triton_status()`: whether a Triton kernel can launch here, and a reason that names the fix."""

from __future__ import annotations

import importlib.util

import torch

from cramming.kernels import triton_status


def test_interpreter_counts_as_launchable(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    ok, why = triton_status()
    if importlib.util.find_spec("triton") is None:
        assert not ok and "not installed" in why
    else:
        assert ok and "interpreter" in why


def test_cpu_without_interpreter_says_why(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    ok, why = triton_status()
    assert not ok
    assert "not installed" in why or "TRITON_INTERPRET=1" in why


def test_missing_triton_says_so(monkeypatch):
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "triton" else real_find_spec(name, *a)
    )
    ok, why = triton_status()
    assert not ok and "pip install triton" in why
