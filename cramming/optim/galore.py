"""GaLore: optimizer state in a low-rank projection of each targeted weight's gradient.

Zhao et al., "GaLore: Memory-Efficient LLM Training by Gradient Low-Rank Projection" (arXiv 2403.03507).
For a weight gradient G (m×n), every `update_proj_gap` steps (and at the first) take the SVD of G in fp32
and keep r singular vectors as the projector; the optimizer then sees only the projected gradient and keeps
its moments at that size, and its normalized update is projected back to m×n and multiplied by `scale`.

    side   projector (stored)        low-rank gradient   state shape   back to m×n
    right  P = Vh[:r]       (r×n)    G Pᵀ                (m×r)         N P
    left   P = U[:, :r]     (m×r)    Pᵀ G                (r×n)         P N
    full   L = U[:, :r], R = Vh[:r]  Lᵀ G Rᵀ             (r×r)         L N R

`std` projects the smaller side (right when m >= n), so the state is r×max(m, n); `reverse_std` the larger.
The projectors are plain fp32 tensors in the optimizer state (`galore_left`, `galore_right`), so the state
saves and loads with `torch.load(weights_only=True)`.

Under FSDP2 a rank holds rows [start, start + rows) of W, and of G (see LeanOptimizer._step_galore_shard).
The projector comes from the whole gradient, gathered on refresh steps only; then, per side:
    right  G_rows Pᵀ is this rank's rows of G Pᵀ: the moments shard by rows with W. Every rank needs all of
           P (r×n): each keeps a 1/ranks piece and gathers it every step (r×n, r/m of the weight's own
           all-gather), so that the projectors too are sharded
    left   Pᵀ G = Σ_ranks P_rowsᵀ G_rows: one all-reduce of (r×n); the moments are replicated, and
           each rank keeps only its rows of P, which is all that P N needs for its rows
    full   as left, (r×r)
`std` projects on the right when m >= n; proj_type=right projects every weight there, which under FSDP2
shards all of GaLore's state (results/optimizers/memory.md). `rows` below is a rank's row count: the shapes
of what one rank holds.

Adam is not rotation-invariant: even at full rank (r = min(m, n), where projecting and projecting back is
the identity on G) GaLore-AdamW equals AdamW only when the singular vectors are signed unit vectors.
"""

from __future__ import annotations

import re

import torch
from torch import nn

from cramming.optim.config import ALL_LINEAR

# `all-linear` leaves out the output layer: a Linear whose weight is tied to an embedding, or one named so
OUTPUT_LAYER_NAMES = ("head", "lm_head", "decoder", "classifier")

_PROJECTOR_KEYS = ("galore_left", "galore_right")


def projection_side(shape: tuple[int, int], proj_type: str) -> str:
    """'left', 'right' or 'full' for a weight of `shape` (m, n)."""
    m, n = shape
    if proj_type == "std":
        return "right" if m >= n else "left"
    if proj_type == "reverse_std":
        return "left" if m >= n else "right"
    return proj_type


def effective_rank(shape: tuple[int, int], rank: int) -> int:
    """The SVD gives min(m, n) singular vectors: a larger rank is that."""
    return min(rank, *shape)


def low_rank_shape(
    shape: tuple[int, int], rank: int, proj_type: str, rows: int | None = None
) -> tuple[int, int]:
    """Shape of the projected gradient, hence of the optimizer's moments; with `rows`, of what a rank
    holding that many rows of the (m, n) weight holds (only the right side's is a row shard)."""
    m, n = shape
    r = effective_rank(shape, rank)
    side = projection_side(shape, proj_type)
    return {"right": (m if rows is None else rows, r), "left": (r, n), "full": (r, r)}[side]


def projector_shapes(
    shape: tuple[int, int], rank: int, proj_type: str, rows: int | None = None
) -> dict[str, tuple[int, int]]:
    """Shapes of the stored projectors; with `rows`, as for low_rank_shape (the left one is a row shard)."""
    m, n = shape
    r = effective_rank(shape, rank)
    side = projection_side(shape, proj_type)
    shapes = {}
    if side in ("left", "full"):
        shapes["galore_left"] = (m if rows is None else rows, r)
    if side in ("right", "full"):
        shapes["galore_right"] = (r, n)
    return shapes


def refresh_due(step: int, update_proj_gap: int) -> bool:
    """Steps count from 1: the projector is (re)computed at steps 1, 1 + gap, 1 + 2·gap, ..."""
    return (step - 1) % update_proj_gap == 0


def needs_projectors(state: dict, step: int, update_proj_gap: int) -> bool:
    return refresh_due(step, update_proj_gap) or not any(k in state for k in _PROJECTOR_KEYS)


def svd_projectors(grad: torch.Tensor, rank: int, proj_type: str) -> dict[str, torch.Tensor]:
    """The projectors of a whole (m, n) gradient, from its fp32 SVD: galore_left (m, r), galore_right (r, n)."""
    g = grad.float()
    side = projection_side(tuple(g.shape), proj_type)
    r = effective_rank(tuple(g.shape), rank)
    u, _, vh = torch.linalg.svd(g, full_matrices=False)  # (m, k), (k,), (k, n) with k = min(m, n)
    u, vh = canonical_signs(u, vh, side)
    projectors = {}
    if side in ("left", "full"):
        projectors["galore_left"] = u[:, :r].contiguous()  # (m, r)
    if side in ("right", "full"):
        projectors["galore_right"] = vh[:r].contiguous()  # (r, n)
    return projectors


def canonical_signs(u: torch.Tensor, vh: torch.Tensor, side: str) -> tuple[torch.Tensor, torch.Tensor]:
    """The SVD with each singular pair's sign chosen so that the stored vector's largest-magnitude entry is
    positive (u's column for the left side, vh's row otherwise); u S vh is unchanged.

    The SVD fixes each pair only up to a sign, and LAPACK's choice can flip when the gradient changes by
    rounding. The moments carry over a refresh, so a flipped vector reverses what they mean for it: measured
    on the tiny model, one process with micro-batch 16 or 8 (the same gradients up to summation order) ended
    56% of the training move apart on a weight after 50 updates, and 2 FSDP2 ranks likewise. With this rule
    the runs agree within 1e-4 of the move."""
    stored = u.T if side == "left" else vh  # (k, m) or (k, n): one vector per row
    sign = stored.gather(1, stored.abs().argmax(dim=1, keepdim=True)).sign()  # (k, 1)
    sign[sign == 0] = 1.0
    return u * sign.T, vh * sign


def apply_projection(grad: torch.Tensor, state: dict, side: str) -> torch.Tensor:
    """The fp32 low-rank gradient with the stored projectors (under FSDP2, of a rank's rows: for the left
    and full sides a partial sum over the ranks' rows)."""
    g = grad.float()  # (m, n)
    if side == "right":
        return g @ state["galore_right"].T  # (m, r)
    if side == "left":
        return state["galore_left"].T @ g  # (r, n)
    return state["galore_left"].T @ g @ state["galore_right"].T  # (r, r)


def project(grad: torch.Tensor, state: dict, step: int, rank: int, proj_type: str, gap: int) -> torch.Tensor:
    """The fp32 low-rank gradient of a whole matrix; computes the projector into `state` when due."""
    if needs_projectors(state, step, gap):
        state.update(svd_projectors(grad, rank, proj_type))
    return apply_projection(grad, state, projection_side(tuple(grad.shape), proj_type))


def project_back(low: torch.Tensor, state: dict, proj_type: str, shape: tuple[int, int]) -> torch.Tensor:
    """A low-rank update (same shape as the projected gradient) mapped back to `shape` (m, n), the whole
    weight's, in fp32; under FSDP2 the result is the rank's rows (its row shard of the left projector)."""
    side = projection_side(shape, proj_type)
    if side == "right":
        return low @ state["galore_right"]
    if side == "left":
        return state["galore_left"] @ low
    return state["galore_left"] @ low @ state["galore_right"]


def _matches(name: str, targets: list[str]) -> bool:
    return any(re.search(t, name) for t in targets)


def galore_parameters(model: nn.Module, targets: list[str]) -> list[nn.Parameter]:
    """The 2-D weights to project: those of the modules whose name a target matches, or every Linear's.

    A target is a regular expression searched in the module's full name (`re.search`, so a plain "attn"
    matches "layers.3.attn.qkv"); the single target "all-linear" takes every nn.Linear except the output
    layer (see OUTPUT_LAYER_NAMES and tied embeddings). Only a matched module's own parameters count, and
    only those with 2 dims; a parameter shared between modules is taken once.
    """
    embedding_weights = {id(mod.weight) for mod in model.modules() if isinstance(mod, nn.Embedding)}
    chosen: dict[int, nn.Parameter] = {}
    for name, module in model.named_modules():
        if targets == [ALL_LINEAR]:
            if not isinstance(module, nn.Linear) or id(module.weight) in embedding_weights:
                continue
            if name.rsplit(".", 1)[-1] in OUTPUT_LAYER_NAMES:
                continue
        elif not name or not _matches(name, targets):
            continue
        for param in module.parameters(recurse=False):
            if param.ndim == 2 and param.requires_grad:
                chosen.setdefault(id(param), param)
    return list(chosen.values())
