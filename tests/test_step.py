"""The one training step: it owns the update from its learning rate to its counter. A finite loss with a
non-finite gradient must not reach the weights (clipping would turn the inf into NaN everywhere); an update
cut short is discarded without a trace; one counter counts applied and skipped updates alike."""

from __future__ import annotations

import contextlib
import copy
import random

import numpy as np
import pytest
import torch
from test_train import make_config, run_dir, synthetic_data

from cramming.errors import TrainingDiverged
from cramming.optim.step import TrainStep
from cramming.train import loop


def model_and_step(grad_clip: float | None = 0.5, dtype: torch.dtype = torch.float32, **kwargs):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    return model, TrainStep(model, optimizer, device_type="cpu", dtype=dtype, grad_clip=grad_clip, **kwargs)


def squared(model, x: torch.Tensor, nan: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    loss = model(x).pow(2).mean()
    return (loss * float("nan") if nan else loss, torch.tensor(float(len(x))))


def one_update(model, step, poison: bool = False, nan: bool = False):
    """begin, one micro-batch, apply; `poison` sets one gradient element to inf (a finite loss)."""
    step.begin()
    step.microbatch(squared, model, torch.randn(16, 4), nan)
    if poison:
        model[0].weight.grad[0, 0] = float("inf")
    return step.apply()


@pytest.mark.parametrize("grad_clip", [0.5, None])
def test_an_inf_gradient_skips_the_update(grad_clip):
    model, step = model_and_step(grad_clip)
    assert one_update(model, step).applied  # an optimizer state to protect
    before = copy.deepcopy(model.state_dict())
    state_before = copy.deepcopy(step.optimizer.state_dict())
    assert one_update(model, step, poison=True).applied is False
    for name, value in model.state_dict().items():
        assert torch.equal(value, before[name]), name
    exp_avg = step.optimizer.state_dict()["state"][0]["exp_avg"]
    assert torch.equal(exp_avg, state_before["state"][0]["exp_avg"])
    stats = step.stats
    assert (stats.updates, stats.applied, stats.skipped, stats.skipped_in_a_row) == (2, 1, 1, 1)
    assert all(p.grad is None for p in model.parameters())  # the bad gradient is dropped
    assert one_update(model, step).applied
    assert step.stats.skipped_in_a_row == 0
    assert all(torch.isfinite(p).all() for p in model.parameters())


def test_a_nan_loss_skips_and_counts_towards_divergence():
    model, step = model_and_step(max_skipped_in_a_row=2)
    before = copy.deepcopy(model.state_dict())
    update = one_update(model, step, nan=True)
    assert not update.applied and torch.isnan(update.loss)
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())
    assert step.stats.skipped_in_a_row == 1
    with pytest.raises(TrainingDiverged, match="2 updates in a row"):
        one_update(model, step, nan=True)


def test_the_update_is_the_mean_over_its_microbatches_and_its_counts_their_sum():
    """Three micro-batches of the same rows: the mean loss is that of one, the gradient that of one (each
    micro-batch's backward is scaled by 1/3), the counts add up."""
    model, step = model_and_step(grad_clip=None)
    twin, twin_step = model_and_step(grad_clip=None)
    x = torch.randn(16, 4)
    step.begin(1.0, 3)
    for _ in range(3):
        assert not step.complete
        step.microbatch(squared, model, x)
    assert step.complete
    with pytest.raises(RuntimeError, match="every micro-batch"):
        step.microbatch(squared, model, x)
    update = step.apply()
    twin_step.begin()
    twin_step.microbatch(squared, twin, x)
    single = twin_step.apply()
    torch.testing.assert_close(update.loss, single.loss, rtol=1e-6, atol=0)
    assert update.counts[0].item() == 3 * 16 and single.counts[0].item() == 16
    for a, b in zip(model.parameters(), twin.parameters(), strict=True):  # sums of 3 in another order
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)


def test_ranks_meet_the_step_through_the_callables_handed_in():
    """grad_sync(last) is True on the last micro-batch only and is open during its backward too (DDP's
    no_sync must be); reduce() sees the summed (loss, counts) once."""
    seen, reduced, open_, in_backward = [], [], [], []

    @contextlib.contextmanager
    def grad_sync(last: bool):
        seen.append(last)
        open_.append(True)
        yield
        open_.pop()

    def reduce(loss_sum, *counts):
        reduced.append((loss_sum.clone(), *counts))
        return [loss_sum, *counts]

    model, step = model_and_step(grad_sync=grad_sync, reduce=reduce)
    model[0].weight.register_hook(lambda grad: in_backward.append(bool(open_)))
    step.begin(1.0, 3)
    for _ in range(3):
        step.microbatch(squared, model, torch.randn(8, 4))
    step.apply()
    assert seen == [False, False, True] and in_backward == [True, True, True]
    assert len(reduced) == 1 and reduced[0][1].item() == 24


def test_a_discarded_update_leaves_no_trace_and_rewinds_the_random_streams():
    model, step = model_and_step()
    before = copy.deepcopy(model.state_dict())
    step.begin(1.0, 2)
    draws = (torch.rand(3), random.random(), np.random.rand())  # what the update's dropout would draw
    step.microbatch(squared, model, torch.randn(16, 4))
    step.discard()
    assert (torch.equal(torch.rand(3), draws[0]), random.random(), np.random.rand()) == (True, *draws[1:])
    assert all(p.grad is None for p in model.parameters())
    assert step.stats.updates == 0
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())
    assert one_update(model, step).applied and step.stats.updates == 1  # the next update starts afresh


def test_without_an_optimizer_it_measures_forward_and_backward_only():
    """The micro-batch search's step: gradients are made and discarded, nothing is ever applied."""
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    step = TrainStep(model, None, device_type="cpu", dtype=torch.float32, grad_clip=None)
    step.begin()
    step.microbatch(squared, model, torch.randn(16, 4))
    assert model.weight.grad is not None
    with pytest.raises(RuntimeError, match="needs an optimizer"):
        step.apply()
    step.discard()
    assert model.weight.grad is None and step.stats.updates == 0


def test_the_pretraining_loop_skips_an_update_with_an_inf_gradient(tmp_path, monkeypatch):
    original, calls = TrainStep.microbatch, [0]

    def poisoned(self, forward, *args):
        original(self, forward, *args)
        calls[0] += 1
        if calls[0] == 3:  # the third update (one micro-batch per update)
            next(iter(self.model.parameters())).grad.view(-1)[0] = float("inf")

    monkeypatch.setattr(TrainStep, "microbatch", poisoned)
    cfg = make_config(tmp_path, "train.steps=5", "train.log_every=1")
    result = loop.train(cfg, synthetic_data(tmp_path / "data"), run_dir(cfg))
    assert result.skipped == 1 and result.updates == 5  # one counter: the skipped update counts
    assert all(torch.isfinite(p).all() for p in loop_model_weights(result))


def loop_model_weights(result):
    from cramming.model.checkpoint import load_pretrained

    return load_pretrained(result.checkpoint).model.parameters()


def test_without_clipping_the_gradients_reach_the_optimizer_untouched():
    """grad_clip=None measures the norm (for the non-finite check) but writes no gradient: bit-identical
    gradients reach optimizer.step, and the norm is the one clip_grad_norm_ reports."""
    model, step = model_and_step(grad_clip=None)
    x = torch.randn(16, 4)
    step.begin()
    step.microbatch(squared, model, x)
    grads = [p.grad.clone() for p in model.parameters()]
    expected_norm = torch.linalg.vector_norm(torch.stack([g.norm() for g in grads]))
    seen = {}

    def spy(*args, **kwargs):
        seen["grads"] = [p.grad.clone() for p in model.parameters()]

    step.optimizer.step = spy
    assert step.apply().applied
    assert all(torch.equal(a, b) for a, b in zip(seen["grads"], grads, strict=True))
    # the norm it checks: the 2-norm of all gradients (fp32 sums of 49 squares in another order: a few ulps)
    again, again_step = model_and_step(grad_clip=None)
    again_step.begin()
    again_step.microbatch(squared, again, x)
    torch.testing.assert_close(again_step._unscale_and_clip(), expected_norm, rtol=1e-5, atol=0)


def test_the_counter_lives_in_the_step_and_survives_its_state():
    model, step = model_and_step()
    one_update(model, step)
    one_update(model, step, poison=True)
    one_update(model, step, poison=True)
    state = step.state_dict()
    _, fresh = model_and_step()
    fresh.load_state_dict(state)
    assert (fresh.stats.updates, fresh.stats.skipped, fresh.stats.skipped_in_a_row) == (3, 2, 2)
    # a state of before the one counter: applied and skipped apart
    legacy = {"scaler": state["scaler"], "stats": {"applied": 4, "skipped": 3, "skipped_in_a_row": 1}}
    fresh.load_state_dict(legacy)
    assert (fresh.stats.updates, fresh.stats.applied, fresh.stats.skipped) == (7, 4, 3)
