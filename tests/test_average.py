"""Weight averaging (train.average): an EMA of the weights after every applied update, the final model the
average, kept across a resume."""

from __future__ import annotations

import signal

import pytest
import torch
from test_train import SEQ, VOCAB, make_config, run_dir, send_signal_after, synthetic_data

from cramming import calibration
from cramming.errors import ConfigError
from cramming.model.checkpoint import load_pretrained
from cramming.optim.average import WeightAverage
from cramming.train import loop


def test_the_average_follows_the_recurrence_with_a_warming_decay():
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2)
    average = WeightAverage(model, decay=0.9)
    expected = [p.detach().clone() for p in model.parameters()]
    for t in range(1, 30):
        with torch.no_grad():
            for p in model.parameters():
                p.add_(torch.randn_like(p))
        average.update()
        keep = min(0.9, (1 + t) / (10 + t))  # 0.18, 0.27, ... then 0.9 from t = 80/... (here: until t=80)
        expected = [
            keep * e + (1 - keep) * p.detach() for e, p in zip(expected, model.parameters(), strict=True)
        ]
    for mine, theirs in zip(average.shadow, expected, strict=True):  # fp32 lerp vs the formula: a few ulps
        torch.testing.assert_close(mine, theirs, rtol=1e-5, atol=1e-6)
    state = average.state_dict()
    other = WeightAverage(model, decay=0.9)
    other.load_state_dict(state)
    assert other.updates == 29 and all(
        torch.equal(a, b) for a, b in zip(other.shadow, average.shadow, strict=True)
    )
    average.copy_to_model()
    assert all(torch.equal(p, s) for p, s in zip(model.parameters(), average.shadow, strict=True))


def test_the_final_model_is_the_average_and_a_resume_keeps_it(tmp_path, monkeypatch):
    data = synthetic_data(tmp_path)
    settings = ("budget=1", "train.steps=8", "train.lr_schedule=steps-linear", "train.average.kind=ema",
                "train.average.decay=0.8")  # fmt: skip
    whole_cfg = make_config(tmp_path, *settings, "name=whole")
    whole = loop.train(whole_cfg, data, run_dir(whole_cfg))
    plain_cfg = make_config(tmp_path, *settings[:3], "name=plain")
    plain = loop.train(plain_cfg, data, run_dir(plain_cfg))
    averaged, last = (load_pretrained(r.checkpoint).model.state_dict() for r in (whole, plain))
    assert any(not torch.equal(averaged[k], last[k]) for k in last)  # the average is not the last weights
    # stopped after 3 updates and resumed: the same average at the end, to the bit
    send_signal_after(monkeypatch, 3, signal.SIGTERM)
    cfg = make_config(tmp_path, *settings)
    loop.train(cfg, data, run_dir(cfg))
    monkeypatch.undo()
    resumed = loop.train(cfg, data, run_dir(cfg))  # its own folder: continues the saved state
    ours = load_pretrained(resumed.checkpoint).model.state_dict()
    for key, value in averaged.items():
        torch.testing.assert_close(ours[key], value, rtol=0, atol=0, msg=key)
    # a state of a run that did not average is not resumed as one that does
    send_signal_after(monkeypatch, 2, signal.SIGTERM)
    stopped = make_config(tmp_path, *settings[:3], "name=stopped")
    loop.train(stopped, data, run_dir(stopped))
    monkeypatch.undo()
    with pytest.raises(ConfigError, match="train.average"):
        loop.train(make_config(tmp_path, *settings, "name=stopped", "resume=true"), data,
                   run_dir(stopped, "2026-01-01_02-00-00"))  # fmt: skip


def test_averaging_is_part_of_the_shape_the_reference_clock_prices(tmp_path):
    plain = calibration.recipe_shape(make_config(tmp_path), VOCAB, SEQ)
    ema = calibration.recipe_shape(make_config(tmp_path, "train.average.kind=ema"), VOCAB, SEQ)
    assert calibration.shape_key(plain) != calibration.shape_key(ema)
    decay = calibration.recipe_shape(
        make_config(tmp_path, "train.average.kind=ema", "train.average.decay=0.5"), VOCAB, SEQ
    )
    assert calibration.shape_key(decay) == calibration.shape_key(ema)  # the decay costs nothing more


@pytest.mark.parametrize("override", ["train.average.kind=lawa", "train.average.decay=1.0"])
def test_bad_settings_are_refused(tmp_path, override):
    with pytest.raises(ConfigError, match="train.average"):
        make_config(tmp_path, override)
