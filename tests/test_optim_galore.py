"""GaLore (cramming.optim.galore and the galore_* optimizers): shapes, refresh, scale, full-rank equality."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from cramming.optim import AdamW, OptimConfig, build_optimizer, galore
from cramming.optim.galore import galore_parameters, low_rank_shape, projection_side

PROJ_TYPES = ["std", "reverse_std", "left", "right", "full"]


def _galore(
    params, *, rank, proj_type="std", gap=200, scale=1.0, bits=32, lr=1e-2, wd=0.0, min_8bit_size=4096
):
    group = {
        "params": list(params),
        "rank": rank,
        "update_proj_gap": gap,
        "scale": scale,
        "proj_type": proj_type,
    }
    return AdamW(
        [group],
        lr=lr,
        betas=(0.9, 0.98),
        eps=1e-8,
        weight_decay=wd,
        optim_bits=bits,
        min_8bit_size=min_8bit_size,
    )


@pytest.mark.parametrize("shape", [(32, 12), (12, 32), (16, 16)])
@pytest.mark.parametrize("proj_type", PROJ_TYPES)
def test_state_shapes_per_proj_type(shape, proj_type):
    m, n = shape
    r = 4
    side = {("std", True): "right", ("std", False): "left", ("reverse_std", True): "left"}.get(
        (proj_type, m >= n), {"reverse_std": "right"}.get(proj_type, proj_type)
    )
    assert projection_side(shape, proj_type) == side
    expected = {"right": (m, r), "left": (r, n), "full": (r, r)}[side]
    weight = nn.Parameter(torch.randn(shape))
    opt = _galore([weight], rank=r, proj_type=proj_type)
    weight.grad = torch.randn(shape)
    opt.step()
    state = opt.state[weight]
    assert state["exp_avg"].shape == expected == low_rank_shape(shape, r, proj_type)
    if side in ("left", "full"):
        assert state["galore_left"].shape == (m, r) and state["galore_left"].dtype == torch.float32
    if side in ("right", "full"):
        assert state["galore_right"].shape == (r, n)
    if proj_type == "std":  # the state is r x max(m, n)
        assert sorted(expected) == sorted((r, max(m, n)))
    # the projector has orthonormal columns/rows
    for key, dim in (("galore_left", 0), ("galore_right", 1)):
        if key in state:
            gram = state[key].T @ state[key] if dim == 0 else state[key] @ state[key].T
            torch.testing.assert_close(gram, torch.eye(r), atol=1e-5, rtol=0)


def test_rank_larger_than_matrix_is_clamped():
    weight = nn.Parameter(torch.randn(6, 20))
    opt = _galore([weight], rank=128)
    weight.grad = torch.randn(6, 20)
    opt.step()
    assert opt.state[weight]["exp_avg"].shape == (6, 20)  # std, m < n: left side, r = min(m, n) = 6


@pytest.mark.parametrize("gap", [1, 3, 5])
def test_projector_refreshed_exactly_every_gap_steps(gap):
    weight = nn.Parameter(torch.randn(24, 10))
    opt = _galore([weight], rank=3, gap=gap)
    refreshed, previous = [], None
    for step in range(1, 13):
        weight.grad = torch.randn(24, 10)  # a new random gradient: a new SVD gives a new projector
        opt.step()
        projector = opt.state[weight]["galore_right"]
        if previous is None or not torch.equal(projector, previous):
            refreshed.append(step)
        previous = projector.clone()
    assert refreshed == list(range(1, 13, gap)), f"refreshed at {refreshed}"


def test_scale_multiplies_the_update():
    p0 = torch.randn(20, 8)
    grad = torch.randn(20, 8)
    moved = {}
    for scale in (1.0, 0.25, 4.0):
        weight = nn.Parameter(p0.clone())
        opt = _galore([weight], rank=3, scale=scale)
        weight.grad = grad.clone()
        opt.step()
        moved[scale] = weight.detach() - p0
    assert moved[1.0].abs().max() > 1e-4
    torch.testing.assert_close(moved[0.25], 0.25 * moved[1.0], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(moved[4.0], 4.0 * moved[1.0], rtol=1e-5, atol=1e-6)


def _generalized_permutation(n: int, steps: int) -> list[torch.Tensor]:
    """Gradients with one non-zero per row and column, on a fixed pattern, with distinct magnitudes.

    Their singular vectors are signed unit vectors, so a full-rank projector is a signed permutation and
    GaLore-AdamW must equal AdamW exactly (Adam commutes with permutations and sign flips, not rotations).
    """
    perm = torch.randperm(n)
    grads = []
    for _ in range(steps):
        g = torch.zeros(n, n)
        g[torch.arange(n), perm] = (torch.arange(1, n + 1) * 10.0 + torch.rand(n)) * torch.sign(
            torch.randn(n)
        )
        grads.append(g)
    return grads


def _disjoint_columns(m: int, n: int, steps: int) -> list[torch.Tensor]:
    """Dense-ish gradients whose columns live on disjoint rows (orthogonal columns, fixed norm order)."""
    rows = torch.randperm(m).view(n, m // n)  # column j lives on rows[j]
    grads = []
    for _ in range(steps):
        g = torch.zeros(m, n)
        for j in range(n):
            g[rows[j], j] = torch.randn(m // n) + (j + 1) * 5.0
        grads.append(g)
    return grads


@pytest.mark.parametrize(
    ("proj_type", "family"),
    [(t, "perm") for t in PROJ_TYPES] + [("std", "columns"), ("right", "columns")],
)
def test_full_rank_equals_adamw(proj_type, family):
    """rank = full dimension, scale 1: the same steps as torch.optim.AdamW (weight decay included)."""
    grads = _generalized_permutation(8, 12) if family == "perm" else _disjoint_columns(24, 6, 12)
    shape = grads[0].shape
    p0 = torch.randn(shape)
    ours = nn.Parameter(p0.clone())
    ref = nn.Parameter(p0.clone())
    opt = _galore([ours], rank=min(shape), proj_type=proj_type, gap=1000, scale=1.0, lr=1e-2, wd=0.1)
    ref_opt = torch.optim.AdamW([ref], lr=1e-2, betas=(0.9, 0.98), eps=1e-8, weight_decay=0.1)
    for g in grads:
        ours.grad, ref.grad = g.clone(), g.clone()
        opt.step()
        ref_opt.step()
    assert (ref.detach() - p0).abs().max() > 0.05, "the steps must move the weights"
    torch.testing.assert_close(ours.detach(), ref.detach(), rtol=1e-5, atol=1e-6)


def test_galore_8bit_first_step_equals_32bit():
    """Step 1 uses the unquantized new moments: 8-bit low-rank state must give the 32-bit update."""
    p0, grad = torch.randn(64, 200), torch.randn(64, 200)
    results = []
    for bits in (32, 8):
        weight = nn.Parameter(p0.clone())
        opt = _galore([weight], rank=32, bits=bits, min_8bit_size=1024, wd=0.1)
        weight.grad = grad.clone()
        opt.step()
        results.append(weight.detach())
        if bits == 8:
            state = opt.state[weight]
            assert state["m_codes"].dtype == torch.uint8 and state["m_codes"].numel() == 32 * 200
    torch.testing.assert_close(results[1], results[0], rtol=1e-5, atol=1e-6)


class _Tiny(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embedding = nn.Embedding(50, 16)
        self.attn = nn.ModuleDict({"qkv": nn.Linear(16, 48), "out": nn.Linear(16, 16, bias=False)})
        self.ffn = nn.ModuleDict({"up": nn.Linear(16, 64, bias=False), "down": nn.Linear(32, 16, bias=False)})
        self.norm = nn.LayerNorm(16)
        self.head = nn.Linear(16, 3)
        self.decoder = nn.Linear(16, 50, bias=False)
        self.decoder.weight = self.embedding.weight  # tied


@pytest.mark.parametrize(
    ("targets", "expected"),
    [
        (["all-linear"], ["attn.qkv.weight", "attn.out.weight", "ffn.up.weight", "ffn.down.weight"]),
        (["attn"], ["attn.qkv.weight", "attn.out.weight"]),
        (["attn", "ffn"], ["attn.qkv.weight", "attn.out.weight", "ffn.up.weight", "ffn.down.weight"]),
        ([r"ffn\.(up|down)$"], ["ffn.up.weight", "ffn.down.weight"]),
        (["embedding"], ["embedding.weight"]),
    ],
)
def test_target_modules(targets, expected):
    model = _Tiny()
    names = {id(p): n for n, p in model.named_parameters()}
    assert [names[id(p)] for p in galore_parameters(model, targets)] == expected


def test_build_galore_groups_and_no_match_error():
    model = _Tiny()
    opt = build_optimizer(model, OptimConfig(name="galore_adamw", rank=4, target_modules=["ffn"]))
    projected = [g for g in opt.param_groups if g["rank"] > 0]
    assert len(projected) == 1 and len(projected[0]["params"]) == 2
    assert sum(len(g["params"]) for g in opt.param_groups) == len(list(model.parameters()))
    from cramming.errors import ConfigError

    with pytest.raises(ConfigError, match="target_modules"):
        build_optimizer(model, OptimConfig(name="galore_adamw", target_modules=["nothing_here"]))


@pytest.mark.parametrize("side", ["left", "right", "full"])
def test_projectors_do_not_depend_on_the_svd_sign_choice(side):
    # the SVD gives each singular pair up to a sign; rounding can flip LAPACK's choice (galore.canonical_signs)
    u, _, vh = torch.linalg.svd(torch.randn(12, 9), full_matrices=False)
    flip = torch.tensor([1.0, -1.0, -1.0, 1.0, -1.0, 1.0, 1.0, -1.0, -1.0])
    ours = galore.canonical_signs(u, vh, side)
    flipped = galore.canonical_signs(u * flip, vh * flip[:, None], side)
    for a, b in zip(ours, flipped, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    stored = ours[0].T if side == "left" else ours[1]
    assert (stored.gather(1, stored.abs().argmax(dim=1, keepdim=True)) > 0).all()


def _galore_torch_with_our_signs(galore_torch, monkeypatch) -> None:
    """galore-torch keeps LAPACK's signs; give its projectors our sign rule, so that the parity test compares
    the rest of the algorithm (with the moments carried over refreshes, the signs change the result)."""
    projector = galore_torch.galore_projector.GaLoreProjector
    original = projector.get_orthogonal_matrix

    def signed(self, weights, rank, type):
        out = original(self, weights, rank, type)
        if type == "right":  # Vh[:r] (r, n)
            return galore.canonical_signs(torch.zeros(1, out.shape[0]), out, "right")[1]
        if type == "left":  # U[:, :r] (m, r)
            return galore.canonical_signs(out, torch.zeros(out.shape[1], 1), "left")[0]
        raise AssertionError(f"the parity test uses one-sided projections, got {type}")

    monkeypatch.setattr(projector, "get_orthogonal_matrix", signed)


def _apart_from_galore_torch(galore_torch, steps: int) -> list[float]:
    """Ours and galore-torch's GaLoreAdamW on the same weight and gradients, projectors refreshed every 3
    updates: after each update, the distance between the two weights over the distance ours has moved."""
    torch.manual_seed(0)
    p0 = torch.randn(48, 20)
    grads = [torch.randn(48, 20) for _ in range(steps)]
    ours, theirs = nn.Parameter(p0.clone()), nn.Parameter(p0.clone())
    group = {"rank": 4, "update_proj_gap": 3, "scale": 0.5, "proj_type": "std"}
    opt = _galore([ours], rank=4, gap=3, scale=0.5, lr=1e-2, wd=0.0)
    ref_opt = galore_torch.GaLoreAdamW(
        [{"params": [theirs], **group}], lr=1e-2, betas=(0.9, 0.98), eps=1e-8, weight_decay=0.0
    )
    apart = []
    for g in grads:
        ours.grad, theirs.grad = g.clone(), g.clone()
        opt.step()
        ref_opt.step()
        apart.append(((ours - theirs).norm() / (ours - p0).norm()).item())
    return apart


@pytest.mark.parametrize("same_signs", [False, True], ids=["lapack-signs", "our-sign-rule"])
def test_galore_torch_parts_from_ours_at_the_first_refresh_only_by_the_sign_rule(monkeypatch, same_signs):
    # what docs/optimizers.md says of galore-torch: equal (to rounding, 4e-6 of the move) until the first
    # refresh, then apart (95% of the move after 60 updates here); with our sign rule given to it, equal
    # throughout
    galore_torch = pytest.importorskip("galore_torch", reason="galore-torch is not installed (a test extra)")
    if same_signs:
        _galore_torch_with_our_signs(galore_torch, monkeypatch)
    apart = _apart_from_galore_torch(galore_torch, 60)
    if same_signs:
        assert max(apart) < 1e-5, max(apart)
    else:
        assert max(apart[:3]) < 1e-5 and apart[3] > 0.1 and apart[-1] > 0.5, apart


def test_parity_with_galore_torch(monkeypatch):
    """Our GaLore-AdamW against galore-torch's GaLoreAdamW: same seeds, same gradients."""
    galore_torch = pytest.importorskip("galore_torch", reason="galore-torch is not installed (a test extra)")
    _galore_torch_with_our_signs(galore_torch, monkeypatch)
    p0 = torch.randn(48, 20)
    grads = [torch.randn(48, 20) for _ in range(10)]
    ours, theirs = nn.Parameter(p0.clone()), nn.Parameter(p0.clone())
    group = {"rank": 4, "update_proj_gap": 3, "scale": 0.5, "proj_type": "std"}
    opt = _galore([ours], rank=4, gap=3, scale=0.5, lr=1e-2, wd=0.0)
    ref_opt = galore_torch.GaLoreAdamW(
        [{"params": [theirs], **group}], lr=1e-2, betas=(0.9, 0.98), eps=1e-8, weight_decay=0.0
    )
    for g in grads:
        ours.grad, theirs.grad = g.clone(), g.clone()
        opt.step()
        ref_opt.step()
    # galore-torch adds eps to sqrt(v) before bias correction; with eps 1e-8 that is far below this tolerance
    torch.testing.assert_close(ours.detach(), theirs.detach(), rtol=1e-4, atol=1e-5)
