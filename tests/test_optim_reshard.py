"""An optimizer state between layouts (cramming.optim.reshard): whole tensors <-> FSDP2 ranks' row shards.

No processes: a rank's state is what a one-process optimizer holds for a tensor of that rank's rows, which is
exactly what an FSDP2 rank holds for an elementwise update (AdamW in 32, 8 and 4 bits; cramming.optim.base).
For GaLore and Adafactor, whose ranks also share entries, whole -> pieces -> whole must be the identity.
"""

from __future__ import annotations

import math

import pytest
import torch

from cramming.optim import Adafactor, AdamW
from cramming.optim.base import chunk_rows
from cramming.optim.lowbit import Maps4bit, decode_4bit
from cramming.optim.quant import (
    QBLOCK,
    dequantize_blockwise,
    first_moment_map,
    second_moment_map,
)
from cramming.optim.reshard import Layout, cut, merge


def trained(param_shape: tuple[int, ...], make, grads: list[torch.Tensor], rows: slice = slice(None)) -> dict:
    """The state an optimizer built by make(params) holds after stepping rows `rows` of a parameter of
    `param_shape` with each of `grads` (the rows of a whole gradient, as an FSDP2 rank's shard)."""
    param = torch.nn.Parameter(torch.ones(param_shape)[rows].clone() if param_shape else torch.tensor(1.0))
    optimizer = make([param])
    for grad in grads:
        param.grad = grad[rows].clone() if param_shape else grad.clone()
        optimizer.step()
    return {k: v.clone() if torch.is_tensor(v) else v for k, v in optimizer.state[param].items()}


def gradients(shape: tuple[int, ...], steps: int = 3) -> list[torch.Tensor]:
    # wide-ranged rows and columns, so that blocks and rank-1 scales differ across the tensor
    scale = torch.logspace(-3, 1, shape[0])[:, None] * torch.logspace(0, -2, math.prod(shape[1:]))[None, :]
    return [torch.randn(shape) * scale.view(shape) for _ in range(steps)]


def plain_layout(shape: tuple[int, ...], world_size: int) -> Layout:
    return Layout.of(shape, world_size, {"rank": 0})


def assert_same(ours: dict, theirs: dict, what: str = "") -> None:
    assert ours.keys() == theirs.keys(), (what, ours.keys(), theirs.keys())
    for key, value in theirs.items():
        if torch.is_tensor(value):
            assert ours[key].dtype == value.dtype and ours[key].shape == value.shape, (what, key)
            assert torch.equal(ours[key], value), (
                f"{what} {key}: differs in {(ours[key] != value).sum()} elements"
            )
        else:
            assert ours[key] == value, (what, key)


def adamw(bits: int, **kwargs):
    return lambda params: AdamW(params, lr=1e-2, optim_bits=bits, min_8bit_size=64, **kwargs)


# ---------------------------------------------------------------------------------------- exact layouts


@pytest.mark.parametrize("bits", [32, 8, 4])
def test_pieces_of_whole_blocks_merge_into_one_process_state_bit_for_bit(bits):
    # (8, 64) over 2 ranks: 256 elements each, whole blocks of 256 (8-bit) and 128 (4-bit)
    shape, grads = (8, 64), gradients((8, 64))
    whole = trained(shape, adamw(bits), grads)
    layout = plain_layout(shape, 2)
    pieces = [trained(shape, adamw(bits), grads, slice(s, s + r)) for s, r in layout.rows]
    for rank, piece in enumerate(pieces):
        ours, requantized = cut(whole, layout, rank)
        assert requantized == []
        if bits == 4:  # the rank ran its own column maxima; a cut keeps the whole's (test_a_4bit_cut_...)
            ours = {k: v for k, v in ours.items() if not k.startswith("v_")}
            piece = {k: v for k, v in piece.items() if not k.startswith("v_")}
        assert_same(ours, piece, f"cut, rank {rank}")
    merged, requantized = merge(pieces, layout)
    if bits == 4:
        # the first moments' blocks are the whole's; the second moment's column maxima are each rank's own
        # (rank-1 scales): re-quantized in the whole's (bounded: test_requantized_...)
        assert requantized == ["v"]
        merged = {k: v for k, v in merged.items() if not k.startswith("v_")}
        whole = {k: v for k, v in whole.items() if not k.startswith("v_")}
    assert_same(merged, whole, "merged")


def test_a_4bit_cut_decodes_to_the_whole_values():
    shape, grads = (10, 48), gradients((10, 48))  # 240 elements a rank: blocks of 128 end inside it
    whole = trained(shape, adamw(4), grads)
    whole_m, whole_v = decode_4bit(whole, shape, Maps4bit.build())
    for world_size in (2, 3):
        layout = plain_layout(shape, world_size)
        for rank, (start, rows) in enumerate(layout.rows):
            piece, requantized = cut(whole, layout, rank)
            m, v = decode_4bit(piece, (rows, 48), Maps4bit.build())
            elements = slice(start * 48, (start + rows) * 48)
            assert torch.equal(v, whole_v[elements]), (world_size, rank)  # codes and scales kept: exact
            # rank 1 starts at element 240 (2 ranks) or 192 (3), inside a block of 128: the first moment
            # is re-quantized in the rank's blocks (bounded: test_requantized_4bit_...)
            assert requantized == ["m"]


@pytest.mark.parametrize(
    "make",
    [
        pytest.param(adamw(32), id="adamw"),
        pytest.param(lambda params: Adafactor(params, lr=1e-2), id="adafactor"),
    ],
)
@pytest.mark.parametrize("shape", [(5, 3), (7,), (1,), ()], ids=str)
def test_fp32_states_cut_and_merge_back_bit_for_bit(make, shape):
    grads = [torch.randn(shape) for _ in range(3)]
    whole = trained(shape, make, grads)
    for world_size in (2, 3):  # (1,) and (): fewer rows than ranks, some hold none
        layout = plain_layout(shape, world_size)
        pieces = [cut(whole, layout, rank)[0] for rank in range(world_size)]
        for (_, rows), piece in zip(layout.rows, pieces, strict=True):
            for key in ("exp_avg", "exp_avg_sq", "exp_avg_sq_row"):
                if key in piece:
                    assert piece[key].shape[0] == rows, (key, piece[key].shape, rows)
        merged, requantized = merge(pieces, layout)
        assert requantized == []
        assert_same(merged, whole, f"{world_size} ranks")


@pytest.mark.parametrize("proj_type", ["std", "left", "full"])
@pytest.mark.parametrize(
    ("optimizer", "bits"), [("adamw", 32), ("adamw", 8), ("adamw", 4), ("adafactor", 32)]
)
def test_galore_states_cut_and_merge_back_bit_for_bit(optimizer, bits, proj_type):
    # std: right, moments (128, 4) sharded by rows (2 ranks: whole blocks of 256; 3: 172 elements, not);
    # left and full: moments (4, 24) and (4, 4), whole on every rank
    shape = (128, 24)
    group = {"rank": 4, "proj_type": proj_type, "update_proj_gap": 2}

    def make(params):
        groups = [{"params": params, **group}]
        if optimizer == "adafactor":
            return Adafactor(groups, lr=1e-2)
        return AdamW(groups, lr=1e-2, optim_bits=bits, min_8bit_size=64)

    whole = trained(shape, make, gradients(shape))
    assert any(key.startswith("galore_") for key in whole)
    for world_size in (2, 3):
        layout = Layout.of(shape, world_size, group)
        pieces = [cut(whole, layout, rank)[0] for rank in range(world_size)]
        if "galore_left" in whole:
            assert [p["galore_left"].shape[0] for p in pieces] == [r for _, r in layout.rows]
        if "galore_right" in whole:
            assert {p["galore_right"].numel() for p in pieces} == {
                -(-whole["galore_right"].numel() // world_size)
            }
        merged, requantized = merge(pieces, layout)
        # re-quantized: only sharded low-bit moments, in blocks that end inside a rank's rows (3 ranks), and
        # the 4-bit second moment's column maxima; projectors and everything else exact
        expected = {"m": bits < 32 and world_size == 3, "v": bits == 4 or bits == 8 and world_size == 3}
        expected = sorted(k for k, yes in expected.items() if yes and layout.moments_sharded)
        assert requantized == expected, (requantized, expected)
        merged = {k: v for k, v in merged.items() if k[:2] not in {f"{m}_" for m in requantized}}
        kept = {k: v for k, v in whole.items() if k[:2] not in {f"{m}_" for m in requantized}}
        assert_same(merged, kept, f"{proj_type}, {world_size} ranks")


def test_rows_are_torch_chunks():
    for rows, ranks in ((7, 2), (7, 3), (1, 2), (2, 4), (9, 4)):
        chunks = torch.arange(rows).chunk(ranks)
        expected = [(int(c[0]), len(c)) for c in chunks] + [(rows, 0)] * (ranks - len(chunks))
        assert chunk_rows(rows, ranks) == expected


# ---------------------------------------------------------------------------------------- re-quantized


def nearest_code_error_bound(
    values: torch.Tensor, scale: torch.Tensor, codes: torch.Tensor, code: torch.Tensor
):
    """Half the gap between each element's code and its neighbour on the value's side, times its scale: how far
    rounding to the nearest code may move it (plus fp32 rounding of the division and product)."""
    index = codes.long().view(-1)
    y = values.view(-1) / scale.view(-1)
    side = torch.where(y > code[index], 1, -1)
    neighbour = index + side
    inside = (neighbour >= 0) & (neighbour < code.numel())
    gap = 0.5 * (code[neighbour.clamp(0, code.numel() - 1)] - code[index]).abs()
    # past the end codes (the signed maps' -1 is not a code, the maps without 0 start above it), every value
    # rounds to the end code: up to the whole distance to the range's end, -1 or 0
    end = torch.where(side > 0, 1.0, -1.0 if code[0] < 0 else 0.0)
    gap = torch.where(inside, gap, (code[index] - end).abs())
    return (gap + 1e-6) * scale.view(-1)


def check_nearest(before: torch.Tensor, codes: torch.Tensor, absmax: torch.Tensor, qmap) -> None:
    after = dequantize_blockwise(codes, absmax, qmap)
    scale = absmax.repeat_interleave(QBLOCK)[: before.numel()]
    bound = nearest_code_error_bound(before, scale, codes, qmap.code)
    excess = ((after - before).abs() - bound).max()
    assert excess <= 0, f"a re-quantized value moved {excess:.3e} past half a code step"


@pytest.mark.parametrize("world_size", [2, 3])
def test_requantized_8bit_values_move_at_most_half_a_code_step(world_size):
    shape, grads = (13, 40), gradients((13, 40))  # 7 x 40 = 280 elements: blocks end inside every rank's rows
    layout = plain_layout(shape, world_size)
    pieces = [trained(shape, adamw(8), grads, slice(s, s + r)) for s, r in layout.rows]
    maps = {"m": first_moment_map(8), "v": second_moment_map(pieces[0]["v_map"])}
    merged, requantized = merge(pieces, layout)
    assert requantized == ["m", "v"]
    for name, qmap in maps.items():
        before = torch.cat(
            [dequantize_blockwise(p[f"{name}_codes"], p[f"{name}_absmax"], qmap) for p in pieces]
        )
        check_nearest(before, merged[f"{name}_codes"], merged[f"{name}_absmax"], qmap)
    whole = trained(shape, adamw(8), grads)
    for rank, (first, numel) in enumerate(layout.offsets()):
        piece, requantized = cut(whole, layout, rank)
        assert requantized == ["m", "v"]
        for name, qmap in maps.items():
            before = dequantize_blockwise(whole[f"{name}_codes"], whole[f"{name}_absmax"], qmap)[
                first : first + numel
            ]
            check_nearest(before, piece[f"{name}_codes"], piece[f"{name}_absmax"], qmap)


@pytest.mark.parametrize("first_moment_format", ["block", "normalized"])
def test_requantized_4bit_values_move_at_most_half_a_code_step(first_moment_format):
    shape, grads = (13, 40), gradients((13, 40))
    layout, maps = plain_layout(shape, 2), Maps4bit.build()
    make = adamw(4, first_moment_format=first_moment_format)
    pieces = [trained(shape, make, grads, slice(s, s + r)) for s, r in layout.rows]
    decoded = [decode_4bit(p, layout.moment_piece_shape(r), maps) for r, p in enumerate(pieces)]
    merged, requantized = merge(pieces, layout)
    assert requantized == ["m", "v"]
    m, v = decode_4bit(merged, shape, maps)
    v_before = torch.cat([v for _, v in decoded])
    # the second moment: rank-1 scales min(row max, column max); the maxima themselves decode exactly
    torch.testing.assert_close(merged["v_row"], v_before.view(shape).amax(dim=1), rtol=0, atol=0)
    torch.testing.assert_close(merged["v_col"], v_before.view(shape).amax(dim=0), rtol=0, atol=0)
    v_codes = maps.v.nearest(v / torch.minimum(merged["v_row"][:, None], merged["v_col"][None, :]).view(-1))
    scale = torch.minimum(merged["v_row"][:, None], merged["v_col"][None, :])
    bound = nearest_code_error_bound(v_before, scale, v_codes, maps.v.code)
    assert ((v - v_before).abs() - bound).max() <= 0
    kept = (v == v_before).float().mean().item()
    print(f"4-bit v merged from 2 ranks: {kept:.1%} of the values kept")
    # the first moment, in blocks of 128 of m (block) or of m / sqrt(v) with the new v (normalized)
    m_before = torch.cat([m for m, _ in decoded])
    divisor = v.sqrt().where(v > 0, 1.0) if first_moment_format == "normalized" else torch.ones_like(v)
    coded = m_before / divisor
    blocks = torch.nn.functional.pad(coded, (0, -coded.numel() % 128)).view(-1, 128)
    absmax = blocks.abs().amax(dim=1).repeat_interleave(128)[: coded.numel()]
    bound = nearest_code_error_bound(coded, absmax, maps.m.nearest(coded / absmax), maps.m.code) * divisor
    assert ((m - m_before).abs() - bound).max() <= 0
