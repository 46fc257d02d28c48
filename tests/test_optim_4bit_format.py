"""The 4-bit first-moment formats (optim.first_moment_format): `block` codes m in blocks of 128, `normalized`
codes m / sqrt(v) of each element's stored second moment. On the wide-gradient trajectory of
tests/test_optim_drift.py the block format lets single weights move several times as far as fp32 AdamW's
largest move; the normalized one much less (results/optimizers/quality.md). Also: the format is recorded in
the state, a state of the other format (or one saved before the format was recorded) is converted when
loaded, and a resumed run is exact."""

from __future__ import annotations

import io

import pytest
import torch
from torch import nn

from cramming.errors import ConfigError
from cramming.optim import OptimConfig, build_optimizer
from cramming.optim.lowbit import Maps4bit, decode_m4, decode_v4
from cramming.optim.quant import rank1_shape
from tests.test_optim_drift import HIGH, LOW, SETTINGS, moved, train_4bit, wide_gradients


@pytest.fixture(scope="module")
def fp32_move() -> torch.Tensor:
    return moved("torch_adamw")


def test_normalized_first_moment_moves_single_weights_less(fp32_move):
    """Measured: block 0.69x of fp32's total displacement and 5.7x its largest single move; normalized
    0.91x and 2.9x. Both figures are deterministic element-wise fp32 arithmetic (no reductions whose order
    could differ between CPUs decide a code), so the bounds only leave room for a future change of map."""
    block = moved("adamw_4bit", first_moment_format="block")
    normalized = moved("adamw_4bit", first_moment_format="normalized")
    total = (normalized.norm() / fp32_move.norm()).item()
    assert LOW <= total <= HIGH, f"normalized moved {total:.3g}x as far as fp32 AdamW"
    largest = {
        k: (d.abs().max() / fp32_move.abs().max()).item()
        for k, d in (("block", block), ("normalized", normalized))
    }
    assert largest["normalized"] < 4.0, largest
    assert largest["normalized"] < 0.75 * largest["block"], largest
    # closer to fp32 in total, too
    assert abs(total - 1) < abs((block.norm() / fp32_move.norm()).item() - 1)


def test_format_is_validated_and_recorded():
    with pytest.raises(ConfigError, match="first_moment_format"):
        build_optimizer(nn.Linear(64, 64), OptimConfig(name="adamw_4bit", first_moment_format="rowwise"))
    for fmt in ("block", "normalized"):
        model = nn.Linear(256, 64, bias=False)
        opt = build_optimizer(model, OptimConfig(name="adamw_4bit", first_moment_format=fmt))
        model.weight.grad = torch.randn(64, 256)
        opt.step()
        assert opt.state[model.weight]["m_format"] == fmt


def test_normalized_state_resumes_exactly():
    normalized = {"first_moment_format": "normalized"}
    assert torch.equal(train_4bit(12, **normalized), train_4bit(12, resume_at=6, **normalized))
    assert not torch.equal(train_4bit(12, **normalized), train_4bit(12, first_moment_format="block"))


def _saved_state(fmt: str, legacy: bool) -> tuple[nn.Module, dict]:
    """A 4-bit state after 20 wide-gradient steps, through torch.save / load(weights_only=True)."""
    torch.manual_seed(0)
    model = nn.Linear(256, 64, bias=False)
    opt = build_optimizer(model, OptimConfig(name="adamw_4bit", first_moment_format=fmt, **SETTINGS))
    for step, grad in enumerate(wide_gradients(), 1):
        model.weight.grad = grad[:, :256]
        opt.step()
        if step == 20:
            break
    saved = opt.state_dict()
    if legacy:  # a state.pt written before 4-bit states recorded their first-moment format
        for state in saved["state"].values():
            state.pop("m_format")
    buffer = io.BytesIO()
    torch.save(saved, buffer)
    buffer.seek(0)
    return model, torch.load(buffer, weights_only=True)


def _first_moment(state: dict, fmt: str) -> torch.Tensor:
    maps, shape = Maps4bit.build(), (64, 256)
    v = decode_v4(state, 64 * 256, rank1_shape(shape), maps)
    return decode_m4(state, 64 * 256, maps, v, fmt == "normalized")


@pytest.mark.parametrize(
    "saved_fmt, legacy, wanted",
    [
        ("block", True, "normalized"),
        ("block", False, "normalized"),
        ("normalized", False, "block"),
        ("block", True, "block"),
    ],
)
def test_state_of_another_format_is_converted_on_load(saved_fmt, legacy, wanted):
    """A state saved in one format (or before the format was recorded: `block`) loads into an optimizer of
    the other: its first moment is re-coded, within one rounding of 16 codes, and training goes on."""
    model, saved = _saved_state(saved_fmt, legacy)
    m_saved = _first_moment(saved["state"][0], saved_fmt)
    v_codes = saved["state"][0]["v_codes"].clone()
    opt = build_optimizer(model, OptimConfig(name="adamw_4bit", first_moment_format=wanted, **SETTINGS))
    opt.load_state_dict(saved)
    state = opt.state[model.weight]
    assert state["m_format"] == wanted
    assert torch.equal(state["v_codes"], v_codes)  # the second moment is not touched
    m_loaded = _first_moment(state, wanted)
    if wanted == saved_fmt:
        assert torch.equal(m_loaded, m_saved)
    else:
        # one rounding to 16 codes: the widest gap of the signed map is 0.225 of a block's scale, so each
        # element is within 0.1125 of its block's scale; on the norm that is far inside 30%, and the codes
        # keep the moment's direction
        assert ((m_loaded - m_saved).norm() / m_saved.norm()).item() < 0.3
        cosine = torch.nn.functional.cosine_similarity(m_loaded.view(1, -1), m_saved.view(1, -1)).item()
        assert cosine > 0.95
    model.weight.grad = torch.randn(64, 256) * 1e-3
    opt.step()
    assert torch.isfinite(model.weight).all()


def test_auto_format_normalizes_full_moments_and_keeps_blocks_for_galore():
    """`auto`: a GaLore optimizer's projected (low-rank) moments keep the block format, where it is closer to
    fp32 GaLore; its unprojected 4-bit tensors (here the embedding) are normalized, as in plain adamw_4bit."""

    class Tiny(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embedding = nn.Embedding(128, 256)  # 4-bit moments, not projected
            self.attn = nn.Linear(256, 512, bias=False)  # projected to rank 16: 16 x 512 4-bit moments

        def forward(self, ids: torch.Tensor) -> torch.Tensor:
            return self.attn(self.embedding(ids))

    model = Tiny()
    cfg = OptimConfig(name="galore_adamw_4bit", rank=16, target_modules=["attn"], first_moment_format="auto")
    opt = build_optimizer(model, cfg)
    model(torch.randint(0, 128, (4, 16))).square().mean().backward()
    opt.step()
    assert opt.state[model.attn.weight]["m_format"] == "block"
    assert opt.state[model.embedding.weight]["m_format"] == "normalized"
    # and plain adamw_4bit under auto normalizes every 4-bit tensor
    plain = build_optimizer(model, OptimConfig(name="adamw_4bit", first_moment_format="auto"))
    plain.step()
    assert {plain.state[p]["m_format"] for p in (model.attn.weight, model.embedding.weight)} == {"normalized"}
