"""Choosing the gated-activation and loss kernels by name (`impl.ffn_activation`, `impl.loss`): the registry,
the fallback to PyTorch where Triton cannot launch, and the model wiring. The numerical match of the kernels
is in tests/test_kernels_glu.py / test_kernels_cross_entropy.py, training with them in the convergence test."""

from __future__ import annotations

import logging

import pytest
import torch

from cramming.errors import ConfigError
from cramming.impl import ImplConfig
from cramming.model import ArchConfig, BertForMLM, KernelUnavailableError, build_model, kernels_by_name
from cramming.model.ops import FFN_ACTIVATION, LOSS, resolve_kernels

TINY = ArchConfig(
    name="tiny", num_layers=1, hidden_size=32, num_heads=2, intermediate_size=64, max_seq_length=16
)


def test_every_kind_has_a_torch_and_a_triton_entry():
    assert set(FFN_ACTIVATION) == set(LOSS) == {"torch", "triton"}


def test_unknown_names_fail_at_start_up():
    with pytest.raises(ConfigError, match="impl.ffn_activation"):
        ImplConfig(ffn_activation="fused")
    with pytest.raises(ConfigError, match="impl.loss"):
        ImplConfig(loss="liger")


def test_triton_activation_and_loss_fall_back_with_one_warning(monkeypatch, caplog):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    requested = {"attention": "sdpa", "layernorm": "torch", "ffn_activation": "triton", "loss": "triton"}
    with caplog.at_level(logging.WARNING, logger="cramming"):
        chosen = resolve_kernels(requested, torch.device("cpu"), strict=False)
    assert chosen == {"attention": "sdpa", "layernorm": "torch", "ffn_activation": "torch", "loss": "torch"}
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1, [r.message for r in warnings]
    assert "impl.ffn_activation=triton" in warnings[0].message and "impl.loss=triton" in warnings[0].message


def test_strict_raises_for_the_loss_kernel(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(KernelUnavailableError, match="impl.loss=triton"):
        build_model(TINY, 40, loss="triton", strict_kernels=True)


def test_model_calls_the_chosen_implementations(monkeypatch):
    """The names reach the FFN and the loss (spied through the registry, so no kernel runs)."""
    calls = []

    def spy(kind, fn):
        def wrapped(*args):
            calls.append(kind)
            return fn(*args)

        return wrapped

    monkeypatch.setitem(FFN_ACTIVATION, "triton", spy("ffn", FFN_ACTIVATION["torch"]))
    monkeypatch.setitem(LOSS, "triton", spy("loss", LOSS["torch"]))
    model = BertForMLM(TINY, 40, dropout=0.0, kernels=kernels_by_name(ffn_activation="triton", loss="triton"))
    ids = torch.randint(2, 40, (2, 16))
    labels = torch.where(torch.rand(2, 16) < 0.3, ids, -100)
    labels[:, 0] = ids[:, 0]
    model(ids, labels)
    assert calls == ["ffn", "loss"]
