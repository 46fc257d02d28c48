"""scripts/studies/diag_4bit_moments.py: pretraining with one adamw_4bit moment in 4 bits and the other in
fp32 (the diagnostic of results/optimizers/). The fp32 moment must follow Adam's recursion exactly;
the 4-bit one must be what the optimizer codes."""

from __future__ import annotations

import importlib

import pytest
import torch
from torch import nn

from cramming.optim import OptimConfig, build_optimizer
from cramming.optim import adamw as adamw_module

BETAS = (0.9, 0.99)


def load_script():
    return importlib.import_module("scripts.studies.diag_4bit_moments")


@pytest.mark.parametrize("quantized", ["first", "second"])
def test_the_other_moment_stays_fp32_and_exact(monkeypatch, quantized):
    script = load_script()
    monkeypatch.setattr(adamw_module, "adamw4bit_update_torch", script.one_moment_update(quantized))
    torch.manual_seed(0)
    model = nn.Linear(128, 64, bias=False)  # 8192 elements: 4-bit state
    cfg = OptimConfig(name="adamw_4bit", lr=1e-3, betas=list(BETAS), weight_decay=0.0)
    opt = build_optimizer(model, cfg)
    m, v = torch.zeros(64 * 128), torch.zeros(64 * 128)
    for _ in range(5):
        grad = torch.randn(64, 128) * torch.logspace(-3, 0, 128)  # three decades across a row
        model.weight.grad = grad
        opt.step()
        g = grad.reshape(-1)
        m = BETAS[0] * m + (1 - BETAS[0]) * g
        v = BETAS[1] * v + (1 - BETAS[1]) * g * g
    state = opt.state[model.weight]
    kept, exact, coded = ("diag_v", v, "m_codes") if quantized == "first" else ("diag_m", m, "v_codes")
    assert set(state) >= {kept, coded}
    # the same recursion in fp32; only the order of the two products may round differently
    torch.testing.assert_close(state[kept], exact, rtol=1e-5, atol=1e-12)
    assert state[coded].any()  # the 4-bit moment is coded
    unused = "v_codes" if quantized == "first" else "m_codes"
    assert not state[unused].any()  # the other moment's codes stay zero: it lives in fp32
    assert torch.isfinite(model.weight).all()


def test_non_default_4bit_settings_are_refused(monkeypatch):
    script = load_script()
    monkeypatch.setattr(adamw_module, "adamw4bit_update_torch", script.one_moment_update("first"))
    model = nn.Linear(128, 64, bias=False)
    opt = build_optimizer(model, OptimConfig(name="adamw_4bit", first_moment_format="normalized"))
    model.weight.grad = torch.randn(64, 128)
    with pytest.raises(SystemExit, match="default 4-bit settings"):
        opt.step()
