"""The one training step: a finite loss with a non-finite gradient must not reach the weights (clipping
would turn the inf into NaN everywhere), and the loop counts such an update as skipped."""

from __future__ import annotations

import copy

import pytest
import torch
from test_train import make_config, run_dir, synthetic_data

from cramming.optim.step import TrainStep
from cramming.train import loop


def model_and_step(grad_clip: float | None = 0.5, dtype: torch.dtype = torch.float32):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    return model, TrainStep(model, optimizer, device_type="cpu", dtype=dtype, grad_clip=grad_clip)


def backward(model, step, poison: bool):
    x = torch.randn(16, 4)
    with step.autocast():
        loss = model(x).pow(2).mean()
    step.backward(loss)
    if poison:  # a finite loss, one inf gradient element
        model[0].weight.grad[0, 0] = float("inf")
    return loss.detach()


@pytest.mark.parametrize("grad_clip", [0.5, None])
def test_an_inf_gradient_skips_the_update(grad_clip):
    model, step = model_and_step(grad_clip)
    step.apply(backward(model, step, poison=False))  # an optimizer state to protect
    before = copy.deepcopy(model.state_dict())
    state_before = copy.deepcopy(step.optimizer.state_dict())
    assert step.apply(backward(model, step, poison=True)) is False
    for name, value in model.state_dict().items():
        assert torch.equal(value, before[name]), name
    exp_avg = step.optimizer.state_dict()["state"][0]["exp_avg"]
    assert torch.equal(exp_avg, state_before["state"][0]["exp_avg"])
    assert (step.stats.applied, step.stats.skipped, step.stats.skipped_in_a_row) == (1, 1, 1)
    assert all(p.grad is None for p in model.parameters())  # the bad gradient is dropped
    assert step.apply(backward(model, step, poison=False)) is True
    assert step.stats.skipped_in_a_row == 0
    assert all(torch.isfinite(p).all() for p in model.parameters())


def test_a_nan_loss_skips_and_counts_towards_divergence():
    model, step = model_and_step()
    x = torch.randn(16, 4)
    loss = model(x).pow(2).mean() * float("nan")
    step.backward(loss)
    before = copy.deepcopy(model.state_dict())
    assert step.apply(loss.detach()) is False
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())
    assert step.stats.skipped_in_a_row == 1


def test_the_pretraining_loop_skips_an_update_with_an_inf_gradient(tmp_path, monkeypatch):
    original, calls = loop.forward_backward, [0]

    def poisoned(run, batch, loss_scale):
        out = original(run, batch, loss_scale)
        calls[0] += 1
        if calls[0] == 3:  # the third update (one micro-batch per update)
            next(iter(run.model.parameters())).grad.view(-1)[0] = float("inf")
        return out

    monkeypatch.setattr(loop, "forward_backward", poisoned)
    cfg = make_config(tmp_path, "train.steps=5", "train.log_every=1")
    result = loop.train(cfg, synthetic_data(tmp_path / "data"), run_dir(cfg))
    assert result.skipped == 1 and result.progress.updates == 5
    assert all(torch.isfinite(p).all() for p in loop_model_weights(result))


def loop_model_weights(result):
    from cramming.model.checkpoint import load_pretrained

    return load_pretrained(result.checkpoint).model.parameters()


def test_without_clipping_the_gradients_reach_the_optimizer_untouched():
    """grad_clip=None measures the norm (for the non-finite check) but writes no gradient: bit-identical
    gradients reach optimizer.step, and the norm is the one clip_grad_norm_ reports."""
    model, step = model_and_step(grad_clip=None)
    loss = backward(model, step, poison=False)
    grads = [p.grad.clone() for p in model.parameters()]
    expected_norm = torch.linalg.vector_norm(torch.stack([g.norm() for g in grads]))
    seen = {}

    def spy(*args, **kwargs):
        seen["grads"] = [p.grad.clone() for p in model.parameters()]

    step.optimizer.step = spy
    assert step.apply(loss) is True
    assert all(torch.equal(a, b) for a, b in zip(seen["grads"], grads, strict=True))
    # the norm it checks: the 2-norm of all gradients (fp32 sums of 49 squares in another order: a few ulps)
    again, again_step = model_and_step(grad_clip=None)
    backward(again, again_step, poison=False)
    torch.testing.assert_close(again_step._unscale_and_clip(), expected_norm, rtol=1e-5, atol=0)


def test_skip_counters_live_in_the_step_and_survive_its_state():
    model, step = model_and_step()
    step.apply(backward(model, step, poison=True))
    step.apply(backward(model, step, poison=True))
    state = step.state_dict()
    _, fresh = model_and_step()
    fresh.load_state_dict(state)
    assert (fresh.stats.skipped, fresh.stats.skipped_in_a_row) == (2, 2)
    legacy = {"scaler": state["scaler"], "stats": {"skipped": 3, "skipped_in_a_row": 1}}  # an older state's
    fresh.load_state_dict(legacy)
    assert (fresh.stats.applied, fresh.stats.skipped, fresh.stats.skipped_in_a_row) == (0, 3, 1)
