"""The optimizer registry (cramming.optim): building by name, AdamW 8-bit against fp32 AdamW, state-dict
round trips, layerwise semantics, the memory report, and a convergence comparison of every optimizer."""

from __future__ import annotations

import copy
import io
import math

import pytest
import torch
from torch import nn

from cramming.errors import ConfigError
from cramming.optim import (
    OPTIMIZERS,
    AdamW,
    OptimConfig,
    build_optimizer,
    check_layerwise_loop,
    format_state_report,
    layer_scales,
    optimizer_state_report,
    param_groups,
)
from cramming.optim.quant import dequantize_blockwise, first_moment_map, second_moment_map
from cramming.optim.step import TrainStep

BASE_NAMES = [
    "adamw",
    "adamw_8bit",
    "adamw_4bit",
    "galore_adamw",
    "galore_adamw_8bit",
    "galore_adamw_4bit",
    "galore_adafactor",
]
LEAN_NAMES = [n for n in OPTIMIZERS if n != "adamw"]


class TinyLM(nn.Module):
    """Embedding -> two pre-LN gated-FFN-ish blocks -> tied decoder: the parameter kinds of crammed BERT."""

    def __init__(self, vocab: int = 64, hidden: int = 32) -> None:
        super().__init__()
        self.embedding = nn.Embedding(vocab, hidden)
        self.layers = nn.ModuleList(
            nn.ModuleDict(
                {
                    "norm": nn.LayerNorm(hidden),
                    "attn": nn.Linear(hidden, hidden, bias=False),
                    "up": nn.Linear(hidden, 4 * hidden, bias=False),
                    "down": nn.Linear(2 * hidden, hidden, bias=False),
                }
            )
            for _ in range(2)
        )
        self.final_norm = nn.LayerNorm(hidden)
        self.decoder = nn.Linear(hidden, vocab, bias=False)
        self.decoder.weight = self.embedding.weight

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embedding(tokens)  # (batch, seq, hidden)
        for layer in self.layers:
            h = layer["norm"](x)
            x = x + layer["attn"](h)
            gate, value = layer["up"](layer["norm"](x)).chunk(2, dim=-1)  # (batch, seq, 2 hidden) each
            x = x + layer["down"](gate * nn.functional.gelu(value))
        return self.decoder(self.final_norm(x))  # (batch, seq, vocab)


def _batch(step: int, vocab: int = 64) -> tuple[torch.Tensor, torch.Tensor]:
    """A learnable synthetic task: predict (token + 1) mod vocab."""
    g = torch.Generator().manual_seed(1000 + step)
    tokens = torch.randint(0, vocab, (8, 16), generator=g)
    return tokens, (tokens + 1) % vocab


def _loss(model: nn.Module, step: int) -> torch.Tensor:
    tokens, targets = _batch(step)
    logits = model(tokens)
    return nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten())


def _cfg(name: str, **kw) -> OptimConfig:
    settings = {
        "lr": 3e-3,
        "eps": 1e-8,
        "rank": 8,
        "update_proj_gap": 20,
        "scale": 1.0,
        "min_8bit_size": 1024,
    }
    return OptimConfig(name=name, **{**settings, **kw})


def _train(
    model: nn.Module, opt: torch.optim.Optimizer, steps: int, start: int = 0, sched=None
) -> list[float]:
    losses = []
    for step in range(start, start + steps):
        opt.zero_grad(set_to_none=True)
        loss = _loss(model, step)
        loss.backward()
        opt.step()
        if sched is not None:
            sched.step()
        losses.append(loss.item())
    return losses


# --- registry and config -------------------------------------------------------------------------------


def test_every_name_builds_and_steps():
    expected = set(BASE_NAMES) | {f"{n}_layerwise" for n in BASE_NAMES}
    assert set(OPTIMIZERS) == expected
    for name in OPTIMIZERS:
        model = TinyLM()
        opt = build_optimizer(model, _cfg(name))
        assert getattr(opt, "layerwise", False) == name.endswith("_layerwise")
        before = [p.detach().clone() for p in model.parameters()]
        _train(model, opt, 2)
        assert all(not torch.equal(b, p) for b, p in zip(before, model.parameters(), strict=True)), name


def test_config_errors_name_the_key():
    with pytest.raises(ConfigError, match="train.optim.name"):
        build_optimizer(TinyLM(), OptimConfig(name="adam_9bit"))
    for kw, key in [
        ({"proj_type": "diagonal"}, "proj_type"),
        ({"rank": 0}, "rank"),
        ({"update_proj_gap": 0}, "update_proj_gap"),
        ({"scale": 0.0}, "scale"),
        ({"target_modules": ["attn", "all-linear"]}, "target_modules"),
        ({"target_modules": ["("]}, "target_modules"),
        ({"target_modules": []}, "target_modules"),
        ({"layer_decay": 0.0}, "layer_decay"),
        ({"layer_decay": 1.5}, "layer_decay"),
    ]:
        # checked by the config's owner, naming the key where it sits (train.optim or eval.optim)
        with pytest.raises(ConfigError, match=f"train.optim.{key}"):
            OptimConfig(name="galore_adamw", **kw).check("train.optim")
        with pytest.raises(ConfigError, match=f"eval.optim.{key}"):
            build_optimizer(TinyLM(), OptimConfig(name="galore_adamw", **kw), scope="eval.optim")


# --- layer-wise learning-rate decay --------------------------------------------------------------------


def test_layer_scales_follow_the_blocks():
    """TinyLM: the embedding (tied to the decoder, so counted once, before the blocks), two blocks, the final
    norm after them."""
    model = TinyLM()
    scales = layer_scales(model, 0.5)
    assert set(scales) == {id(p) for p in model.parameters()}
    assert scales[id(model.embedding.weight)] == 0.5**3
    for i, layer in enumerate(model.layers):
        assert {scales[id(p)] for p in layer.parameters()} == {0.5 ** (2 - i)}
    assert {scales[id(p)] for p in model.final_norm.parameters()} == {1.0}


def test_layer_decay_one_keeps_the_groups_and_a_model_without_blocks_is_refused():
    model = TinyLM()
    plain = build_optimizer(model, _cfg("adamw", layer_decay=1.0))
    assert [[id(p) for p in g["params"]] for g in plain.param_groups] == [
        [id(p) for p in g["params"]] for g in param_groups(model, 0.01)
    ]
    assert all(g["lr"] == 3e-3 and "lr_scale" not in g for g in plain.param_groups)
    with pytest.raises(ConfigError, match=r"eval.optim.layer_decay=0.8.*no list of blocks.*layer_decay=1.0"):
        build_optimizer(nn.Sequential(nn.Linear(4, 4)), _cfg("adamw", layer_decay=0.8), scope="eval.optim")


@pytest.mark.parametrize(
    "name", ["adamw", "adamw_8bit", "galore_adamw", "galore_adafactor", "adamw_layerwise"]
)
def test_layer_decay_scales_each_parameters_update(name):
    """The first update of every parameter under layer_decay is its layer's factor times the update without
    it (the same gradients, so the same direction: only the rate differs). The two updates are computed as
    new - old values, each rounded once at the parameter's magnitude, hence the absolute tolerance."""
    torch.manual_seed(0)
    plain_model = TinyLM()
    decayed_model = copy.deepcopy(plain_model)
    start = [p.detach().clone() for p in plain_model.parameters()]
    _train(plain_model, build_optimizer(plain_model, _cfg(name)), 1)
    _train(decayed_model, build_optimizer(decayed_model, _cfg(name, layer_decay=0.5)), 1)
    scales = layer_scales(decayed_model, 0.5)
    assert sorted(set(scales.values())) == [0.125, 0.25, 0.5, 1.0]
    for p0, plain, decayed in zip(start, plain_model.parameters(), decayed_model.parameters(), strict=True):
        rounding = 4 * torch.finfo(torch.float32).eps * p0.abs().max().item()
        expected = (plain.detach() - p0) * scales[id(decayed)]
        torch.testing.assert_close(decayed.detach() - p0, expected, rtol=1e-5, atol=rounding)
        assert (expected != 0).any()


def test_the_schedule_multiplies_each_layers_rate():
    model = TinyLM()
    opt = build_optimizer(model, _cfg("adamw", layer_decay=0.5))
    step = TrainStep(model, opt, device_type="cpu", dtype=torch.float32, grad_clip=None)
    step.begin(lr_factor=0.5)
    for group in opt.param_groups:
        assert group["lr"] == pytest.approx(0.5 * 3e-3 * group["lr_scale"], rel=1e-12)
    assert sorted({g["lr_scale"] for g in step.optimizer.param_groups}) == [0.125, 0.25, 0.5, 1.0]


def test_yaml_files_compose_for_every_name():
    """conf/train/optim/<name>.yaml for every registered name, composed by Hydra against the schema."""
    from hydra import compose, initialize_config_dir

    from cramming.config import CONF_DIR, register_configs

    register_configs()
    with initialize_config_dir(str(CONF_DIR), version_base=None):
        for name in OPTIMIZERS:
            cfg = compose("pretrain", overrides=[f"train/optim={name}"])
            optim = OptimConfig(**cfg.train.optim)
            assert optim.name == name


# --- AdamW 32 / 8 bit ----------------------------------------------------------------------------------


def test_our_32bit_adamw_equals_torch_adamw():
    model = TinyLM()
    twin = copy.deepcopy(model)
    ours = AdamW(model.parameters(), lr=3e-3, betas=(0.9, 0.98), eps=1e-8, weight_decay=0.01)
    ref = torch.optim.AdamW(twin.parameters(), lr=3e-3, betas=(0.9, 0.98), eps=1e-8, weight_decay=0.01)
    _train(model, ours, 10)
    _train(twin, ref, 10)
    for a, b in zip(model.parameters(), twin.parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)


class _MLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(
            nn.Linear(64, 128), nn.Tanh(), nn.Linear(128, 64), nn.Tanh(), nn.Linear(64, 1)
        )

    def forward(self, x):
        return self.net(x)


def test_8bit_tracks_fp32_adamw_over_250_steps():
    """Loss curves close; the 8-bit moments stay within quantization error of fp32 moments fed the same
    gradients."""
    torch.manual_seed(0)
    x = torch.randn(256, 64)
    y = torch.sin(x[:, :8].sum(dim=1, keepdim=True))
    model8, model32 = _MLP(), _MLP()
    model32.load_state_dict(model8.state_dict())
    opt8 = AdamW(model8.parameters(), lr=2e-3, betas=(0.9, 0.99), eps=1e-8, optim_bits=8, min_8bit_size=4096)
    opt32 = torch.optim.AdamW(model32.parameters(), lr=2e-3, betas=(0.9, 0.99), eps=1e-8)
    w = model8.net[0].weight  # 8192 elements: 8-bit state
    shadow_m, shadow_v = torch.zeros_like(w), torch.zeros_like(w)
    curves = {8: [], 32: []}
    for step in range(250):
        batch = torch.randint(0, 256, (32,), generator=torch.Generator().manual_seed(step))
        for bits, model, opt in ((8, model8, opt8), (32, model32, opt32)):
            opt.zero_grad(set_to_none=True)
            loss = nn.functional.mse_loss(model(x[batch]), y[batch])
            loss.backward()
            if bits == 8:
                shadow_m.mul_(0.9).add_(w.grad, alpha=0.1)
                shadow_v.mul_(0.99).addcmul_(w.grad, w.grad, value=0.01)
            opt.step()
            curves[bits].append(loss.item())
    assert "m_codes" in opt8.state[w]
    c8, c32 = torch.tensor(curves[8]), torch.tensor(curves[32])
    assert c32[-20:].mean() < 0.3 * c32[:5].mean(), "the fp32 run must learn"
    # smoothed curves within 10% of each other over the whole run
    smooth8, smooth32 = c8.unfold(0, 10, 10).mean(1), c32.unfold(0, 10, 10).mean(1)
    rel = ((smooth8 - smooth32).abs() / smooth32).max().item()
    assert rel < 0.1, f"8-bit and fp32 loss curves differ by {rel:.1%}"
    st = opt8.state[w]
    m = dequantize_blockwise(st["m_codes"], st["m_absmax"], first_moment_map(8)).view_as(w)
    v = dequantize_blockwise(
        st["v_codes"], st["v_absmax"], second_moment_map(opt8.second_moment_map)
    ).view_as(w)
    if st["v_map"] == "sqrt":  # the codes are of sqrt(v)
        v = v * v
    # per-step quantization error <= half a code gap (<= 0.7% of the block absmax), decaying with beta
    # (sqrt(v) stored: a relative error e of sqrt(v) is 2e of v)
    v_bound = 0.06 if st["v_map"] == "sqrt" else 0.03
    for name, q, ref, bound in (("m", m, shadow_m, 0.03), ("v", v, shadow_v, v_bound)):
        err = ((q - ref).norm() / ref.norm()).item()
        assert err < bound, f"8-bit {name} is {err:.1%} (relative norm) away from the fp32 recursion"


def test_8bit_parity_with_bitsandbytes():
    """Our AdamW 8-bit against bitsandbytes' AdamW8bit: the first step is exact in both (it uses the
    unquantized new moments), later steps agree to quantization error (their maps differ from ours)."""
    bnb = pytest.importorskip("bitsandbytes", reason="bitsandbytes is not installed (a test extra)")
    p0 = torch.randn(64, 128) * 0.1
    grads = [torch.randn(64, 128) for _ in range(30)]
    ours, theirs, exact = (nn.Parameter(p0.clone()) for _ in range(3))
    opt = AdamW([ours], lr=1e-3, betas=(0.9, 0.99), eps=1e-8, weight_decay=0.0, optim_bits=8)
    ref = bnb.optim.AdamW8bit([theirs], lr=1e-3, betas=(0.9, 0.99), eps=1e-8, weight_decay=0.0)
    fp32 = torch.optim.AdamW([exact], lr=1e-3, betas=(0.9, 0.99), eps=1e-8, weight_decay=0.0)
    for i, g in enumerate(grads):
        for p, o in ((ours, opt), (theirs, ref), (exact, fp32)):
            p.grad = g.clone()
            o.step()
        if i == 0:
            torch.testing.assert_close(ours.detach(), theirs.detach(), rtol=1e-5, atol=1e-7)
    drift_ours = (ours - exact).norm() / (exact - p0).norm()
    drift_theirs = (theirs - exact).norm() / (exact - p0).norm()
    assert drift_ours < 2 * drift_theirs + 1e-3, (
        f"ours drifts {drift_ours:.3g} from fp32, bitsandbytes {drift_theirs:.3g}"
    )


def test_small_tensors_and_embeddings_keep_32bit_state():
    """< min_8bit_size elements: 32-bit moments; with embedding_32bit the embedding too."""
    for embedding_32bit in (False, True):
        model = TinyLM()
        opt = build_optimizer(model, _cfg("adamw_8bit", min_8bit_size=2048, embedding_32bit=embedding_32bit))
        _train(model, opt, 1)
        bits = {name: 8 if "m_codes" in opt.state[p] else 32 for name, p in model.named_parameters()}
        assert bits["layers.0.up.weight"] == 8  # 4096 elements
        assert bits["layers.0.attn.weight"] == 32  # 1024 elements
        assert bits["layers.0.norm.weight"] == 32
        assert bits["embedding.weight"] == (32 if embedding_32bit else 8)  # 2048 elements


# --- state dict ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", LEAN_NAMES + ["adamw"])
def test_state_dict_round_trip_weights_only(name):
    """Save after 3 steps, load (weights_only=True) into a fresh optimizer: the next steps are identical.

    update_proj_gap 2 makes step 4 reuse the projector from step 3, so the loaded projector is used."""
    cfg = _cfg(name, update_proj_gap=2)
    model = TinyLM()
    opt = build_optimizer(model, cfg)
    _train(model, opt, 3)
    buffer = io.BytesIO()
    torch.save({"model": model.state_dict(), "optim": opt.state_dict()}, buffer)
    buffer.seek(0)
    saved = torch.load(buffer, weights_only=True)
    resumed = TinyLM()
    resumed.load_state_dict(saved["model"])
    resumed_opt = build_optimizer(resumed, cfg)
    resumed_opt.load_state_dict(saved["optim"])
    for p, q in zip(model.parameters(), resumed.parameters(), strict=True):
        for key, value in opt.state[p].items():
            loaded = resumed_opt.state[q][key]
            if torch.is_tensor(value):
                assert loaded.dtype == value.dtype and torch.equal(loaded, value), (name, key)
            else:
                assert loaded == value
    _train(model, opt, 2, start=3)
    _train(resumed, resumed_opt, 2, start=3)
    for (pname, p), q in zip(model.named_parameters(), resumed.parameters(), strict=True):
        assert torch.equal(p, q), f"{name}: {pname} differs after resume"


# --- layerwise -----------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "name", ["adamw", "adamw_8bit", "galore_adamw", "galore_adamw_8bit", "galore_adafactor"]
)
def test_layerwise_equals_normal_without_clipping(name):
    """Same gradients, same LambdaLR schedule: identical parameters after 6 steps."""
    model = TinyLM()
    twin = copy.deepcopy(model)
    if name == "adamw":  # plain `adamw` is torch's; compare with ours in its normal mode
        normal = AdamW(param_groups(model, 0.01), lr=3e-3, betas=(0.9, 0.98), eps=1e-8, weight_decay=0.01)
    else:
        normal = build_optimizer(model, _cfg(name))
    layerwise = build_optimizer(twin, _cfg(f"{name}_layerwise"))
    ramp = lambda step: min(1.0, (step + 1) / 3)  # noqa: E731
    _train(model, normal, 6, sched=torch.optim.lr_scheduler.LambdaLR(normal, ramp))
    _train(twin, layerwise, 6, sched=torch.optim.lr_scheduler.LambdaLR(layerwise, ramp))
    for (pname, p), q in zip(model.named_parameters(), twin.parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-7, msg=lambda m, pname=pname: f"{pname}: {m}")
    assert all(p.grad is None for p in twin.parameters()), "layerwise frees each gradient after its update"


def test_layerwise_refuses_a_second_stepping_backward():
    model = TinyLM()
    build_optimizer(model, _cfg("galore_adamw_layerwise"))  # its hooks live on the model's parameters
    _loss(model, 0).backward()
    with pytest.raises(ConfigError, match="gradient accumulation"):
        _loss(model, 1).backward()


@pytest.mark.parametrize("name", ["adamw_8bit", "galore_adamw"])
def test_layerwise_with_accumulation_steps_on_the_last_microbatch(name):
    """3 micro-batches per update through TrainStep.microbatch: the same as the normal optimizer on the
    summed gradient (the hooks leave the first two to add up and step on the third)."""
    model = TinyLM()
    twin = copy.deepcopy(model)
    normal = build_optimizer(model, _cfg(name))
    layerwise = build_optimizer(twin, _cfg(f"{name}_layerwise"))
    steps = [
        TrainStep(m, o, device_type="cpu", dtype=torch.float32, grad_clip=None)
        for m, o in ((model, normal), (twin, layerwise))
    ]
    for update in range(4):
        for net, step in zip((model, twin), steps, strict=True):
            step.begin(1.0, 3)
            for micro in range(3):
                step.microbatch(lambda net=net, i=3 * update + micro: (_loss(net, i),))
                if micro < 2:  # the layerwise hooks have not stepped (nor freed) the accumulating gradients
                    assert all(p.grad is not None for p in net.parameters())
            assert step.apply().applied
    for (pname, p), q in zip(model.named_parameters(), twin.parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-7, msg=lambda m, pname=pname: f"{pname}: {m}")


def test_layerwise_clips_per_parameter_and_reports_global_norm():
    """max_grad_norm clips each parameter's gradient to that norm, as clip_grad_norm_ would on it alone."""
    max_norm = 0.05
    model = TinyLM()
    twin = copy.deepcopy(model)
    layerwise = build_optimizer(twin, _cfg("adamw_8bit_layerwise"), max_grad_norm=max_norm)
    normal = build_optimizer(model, _cfg("adamw_8bit"))
    for step in range(4):
        normal.zero_grad(set_to_none=True)
        _loss(model, step).backward()
        norms = [p.grad.norm() for p in model.parameters()]
        clipped = 0
        for p in model.parameters():
            clipped += int(torch.nn.utils.clip_grad_norm_([p], max_norm) > max_norm)
        normal.step()
        layerwise.zero_grad(set_to_none=True)
        _loss(twin, step).backward()
        layerwise.step()
        assert clipped > 0, "the threshold must bite for this test to mean anything"
        torch.testing.assert_close(layerwise.grad_norm, torch.stack(norms).norm(), rtol=1e-5, atol=0)
    for p, q in zip(model.parameters(), twin.parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-7)


def test_check_layerwise_loop_refusals():
    lw = build_optimizer(TinyLM(), _cfg("galore_adamw_layerwise"))
    check_layerwise_loop(lw, grad_scaler=False)
    with pytest.raises(ConfigError, match="GradScaler"):
        check_layerwise_loop(lw, grad_scaler=True)
    # a normal optimizer passes whatever the loop does
    check_layerwise_loop(build_optimizer(TinyLM(), _cfg("galore_adamw")), grad_scaler=True)


def test_max_grad_norm_is_refused_without_layerwise():
    with pytest.raises(ValueError, match="layerwise"):
        AdamW(TinyLM().parameters(), max_grad_norm=1.0)


# --- memory report -------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", BASE_NAMES)
def test_report_predicts_the_allocated_state(name):
    model = TinyLM()
    opt = build_optimizer(model, _cfg(name))
    predicted = optimizer_state_report(opt)
    _train(model, opt, 1)
    measured = optimizer_state_report(opt)
    assert predicted == measured
    assert measured["params"] == sum(p.numel() for p in model.parameters())
    assert "B/param" in format_state_report(measured)


def test_report_8bit_bytes_per_param():
    model = nn.Linear(1024, 1024, bias=False)
    report = optimizer_state_report(AdamW(model.parameters(), optim_bits=8))
    assert report["bytes_per_param"] == pytest.approx(2 + 2 * 4 / 256)
    assert report["ratio_to_adamw_fp32"] == pytest.approx((2 + 2 * 4 / 256) / 8)


# --- convergence ---------------------------------------------------------------------------------------


def test_convergence_of_every_optimizer():
    """80 steps of each optimizer on the tiny LM: each loss curve falls clearly, and the memory-lean ones
    end within reach of AdamW."""
    curves = {}
    for name in BASE_NAMES:
        torch.manual_seed(0)
        model = TinyLM()
        lr = 3e-2 if name == "galore_adafactor" else 1e-2
        curves[name] = _train(model, build_optimizer(model, _cfg(name, lr=lr, scale=2.0)), 80)
    table = "\n".join(f"{n:20s} {c[0]:.3f} -> {sum(c[-5:]) / 5:.3f}" for n, c in curves.items())
    start = curves["adamw"][0]
    assert all(abs(c[0] - start) < 1e-6 for c in curves.values()), "same model and batch at step 0"
    adamw_end = sum(curves["adamw"][-5:]) / 5
    for name, curve in curves.items():
        end = sum(curve[-5:]) / 5
        assert end < 0.5 * start, f"{name} did not learn:\n{table}"
        assert end < adamw_end + 0.5 * (start - adamw_end), f"{name} is far behind AdamW:\n{table}"
    assert math.isfinite(adamw_end)
