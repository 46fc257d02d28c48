"""An optimizer state moved between layouts: whole tensors (one process, every DDP rank) and the pieces that
FSDP2 ranks hold, so that a state saved by any number of ranks in either mode resumes in any other.

Under FSDP2 each rank updates rows [start, start + rows) of every parameter (torch.chunk's pieces of dim 0,
`chunk_rows`) with a state of its own (cramming.optim.base). One parameter's state, entry by entry:

    entry                                 a rank holds                    whole from the pieces
    step, v_map, m_format                 the same as every rank          rank 0's
    fp32 moments: exp_avg, exp_avg_sq,    its rows                        rows concatenated
      Adafactor exp_avg_sq, _row
    Adafactor exp_avg_sq_col              the whole (summed over ranks)   rank 0's
    galore_left (m, r)                    its rows                        rows concatenated
    galore_right (r, n)                   piece i of r·n, flat            pieces concatenated
    the moments of a left- or full-       the whole (every rank)          rank 0's
      projected GaLore weight
    8-bit codes, absmax per 256           its rows' codes, in blocks      concatenated when every piece
    4-bit m: packed codes, absmax / 128     from its first element          is whole blocks; else re-quantized
    4-bit v of a matrix: packed codes,    its rows' codes, row maxima,    re-quantized (whole column maxima)
      row and column maxima                its rows' column maxima

Every entry but the quantized ones moves exactly, and so do quantized blocks whenever the pieces start on
block boundaries (2 ranks of every bert-tiny/bert-base weight). Otherwise the moment is decoded and coded
again in the new layout (`requantized`): each value is rounded to the nearest code of its new block's map, so
it moves by at most half a code step at the new scale, the error of one more optimizer step's own
re-quantization. The 4-bit second moment of a matrix is scaled by min(row max, column max), and a rank's
column maxima are over its rows only: whole -> pieces keeps the codes and gives every piece the whole
column maxima (each element decodes as before: exact); pieces -> whole re-quantizes, and an element keeps its
code wherever its scale stays (the maxima themselves decode exactly: the code 1 is in the map).
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, field

import torch

from cramming.errors import ConfigError
from cramming.optim import galore
from cramming.optim.base import chunk_rows, flat_piece
from cramming.optim.lowbit import (
    RANK1_DYNAMIC4,
    Maps4bit,
    decode_4bit,
    encode_first_moment_4bit,
    encode_second_moment_4bit,
    pack_nibbles,
    saved_first_moment_format,
    saved_format,
    unpack_nibbles,
)
from cramming.optim.quant import (
    QBLOCK,
    QBLOCK_4BIT,
    QuantMap,
    dequantize_blockwise,
    first_moment_map,
    quantize_blockwise,
    rank1_shape,
    second_moment_map,
)

# entries every rank holds the same of, whatever the layout
SHARED = ("step", "v_map", "m_format", "exp_avg_sq_col")
# fp32 moments whose dim 0 is the moment's rows
ROW_MOMENTS = ("exp_avg", "exp_avg_sq", "exp_avg_sq_row")
QUANTIZED = ("m_codes", "m_absmax", "v_codes", "v_absmax", "v_row", "v_col")


@dataclass(frozen=True)
class Layout:
    """How one parameter's state lies over `world_size` FSDP2 ranks."""

    shape: tuple[int, ...]  # the whole parameter's
    world_size: int
    moment_shape: tuple[int, ...]  # the whole moments' (the parameter's, or GaLore's low-rank shape)
    moments_sharded: bool  # each rank holds its rows of the moments; else all of them (left/full GaLore)
    projectors: dict[str, tuple[int, int]] = field(default_factory=dict)  # GaLore's whole projector shapes

    @classmethod
    def of(cls, shape: tuple[int, ...], world_size: int, group: dict) -> Layout:
        """The layout of a parameter of `shape` in `group` (its GaLore settings) under `world_size` ranks."""
        if group["rank"] == 0:
            return cls(shape, world_size, shape, True)
        rank, proj_type = group["rank"], group["proj_type"]
        return cls(
            shape,
            world_size,
            galore.low_rank_shape(shape, rank, proj_type),
            galore.projection_side(shape, proj_type) == "right",
            galore.projector_shapes(shape, rank, proj_type),
        )

    @property
    def rows(self) -> list[tuple[int, int]]:
        """(start, rows) of each rank's rows (FSDP2 shards a 0-dim parameter as 1 row: cramming.train.parallel)."""
        return chunk_rows(self.shape[0] if self.shape else 1, self.world_size)

    @property
    def row_numel(self) -> int:
        """Elements per row of the moments."""
        return math.prod(self.moment_shape[1:])

    def moment_piece_shape(self, rank: int) -> tuple[int, ...]:
        return (self.rows[rank][1], *self.moment_shape[1:])

    def offsets(self) -> list[tuple[int, int]]:
        """(first element, elements) of each rank's moments in the flattened whole moments."""
        return [(start * self.row_numel, rows * self.row_numel) for start, rows in self.rows]


def _aligned(layout: Layout, block: int) -> bool:
    """Whether every rank's moments start on a block boundary of the whole (ranks holding none aside)."""
    return all(start % block == 0 for start, numel in layout.offsets() if numel)


@functools.cache
def _maps_8bit(v_map: str) -> tuple[QuantMap, QuantMap]:
    """The 8-bit (first-moment, second-moment) maps of a state whose `v_map` is that, built once."""
    return first_moment_map(8, "cpu"), second_moment_map(v_map, "cpu")


@functools.cache
def _maps_4bit() -> Maps4bit:
    return Maps4bit.build("cpu")


# ---------------------------------------------------------------------------------------- pieces -> whole


def merge(pieces: list[dict], layout: Layout) -> tuple[dict, list[str]]:
    """The whole state of one parameter from each rank's (CPU) state; and the names of the moments that
    were re-quantized ("m", "v"; empty when every entry moved exactly)."""
    first = pieces[0]
    whole = {key: value for key, value in first.items() if key in SHARED}
    requantized: list[str] = []
    for key in first:
        if key in SHARED or key in QUANTIZED:
            continue
        if key == "galore_left":
            whole[key] = torch.cat([p[key] for p in pieces])
        elif key == "galore_right":
            shape = layout.projectors[key]
            whole[key] = torch.cat([p[key] for p in pieces])[: math.prod(shape)].view(shape).clone()
        elif key in ROW_MOMENTS:
            if layout.moments_sharded:  # row-major: the rows of the pieces, one after the other
                whole[key] = torch.cat([p[key].reshape(-1) for p in pieces]).reshape(_row_shape(key, layout))
            else:
                whole[key] = first[key]
        else:
            raise ValueError(f"the optimizer state entry {key!r} has no known layout over FSDP2 ranks")
    if "m_codes" in first:
        if not layout.moments_sharded:
            whole.update({key: first[key] for key in QUANTIZED if key in first})
        elif saved_format(first) == RANK1_DYNAMIC4:
            requantized = _merge_4bit(pieces, layout, whole)
        else:
            requantized = _merge_8bit(pieces, layout, whole)
    return whole, requantized


def _row_shape(key: str, layout: Layout, rank: int | None = None) -> tuple[int, ...]:
    """The shape of a row-sharded fp32 entry, whole or of `rank`'s rows: Adafactor's row statistic holds
    one value per row, a moment the moments' shape."""
    shape = layout.moment_shape if rank is None else layout.moment_piece_shape(rank)
    return shape[:1] if key == "exp_avg_sq_row" else shape


def _merge_8bit(pieces: list[dict], layout: Layout, whole: dict) -> list[str]:
    if _aligned(layout, QBLOCK):
        for key in ("m_codes", "m_absmax", "v_codes", "v_absmax"):
            whole[key] = torch.cat([p[key] for p in pieces])
        return []
    for name, qmap in zip(("m", "v"), _maps_8bit(saved_format(pieces[0])), strict=True):
        values = torch.cat(
            [dequantize_blockwise(p[f"{name}_codes"], p[f"{name}_absmax"], qmap) for p in pieces]
        )
        whole[f"{name}_codes"], whole[f"{name}_absmax"] = quantize_blockwise(values, qmap)
    return ["m", "v"]


def _merge_4bit(pieces: list[dict], layout: Layout, whole: dict) -> list[str]:
    maps = _maps_4bit()
    aligned = _aligned(layout, QBLOCK_4BIT)  # then every piece but the last holds an even count: whole bytes
    shape, m_format = layout.moment_shape, saved_first_moment_format(pieces[0])
    decoded = [decode_4bit(p, layout.moment_piece_shape(r), maps) for r, p in enumerate(pieces)]
    requantized = []
    if aligned and rank1_shape(shape) is None:  # blocks of 128, as the first moment's
        whole.update({key: torch.cat([p[key] for p in pieces]) for key in ("v_codes", "v_absmax")})
    else:
        whole.update(encode_second_moment_4bit(torch.cat([v for _, v in decoded]), shape, maps))
        requantized.append("v")
    if aligned and not (requantized and m_format == "normalized"):  # m / sqrt(v): coded against the old v
        whole.update({key: torch.cat([p[key] for p in pieces]) for key in ("m_codes", "m_absmax")})
    else:
        m = torch.cat([m for m, _ in decoded])
        whole.update(encode_first_moment_4bit(m, whole, shape, maps, m_format))
        requantized.insert(0, "m")
    return requantized


# ---------------------------------------------------------------------------------------- whole -> piece


def cut(whole: dict, layout: Layout, rank: int) -> tuple[dict, list[str]]:
    """Rank `rank`'s state of one parameter from its whole (CPU) state; and the re-quantized moments."""
    start, rows = layout.rows[rank]
    piece = {key: value for key, value in whole.items() if key in SHARED}
    requantized: list[str] = []
    for key, value in whole.items():
        if key in SHARED or key in QUANTIZED:
            continue
        if key == "galore_left":
            piece[key] = value[start : start + rows].clone()
        elif key == "galore_right":
            piece[key] = flat_piece(value, rank, layout.world_size)
        elif key in ROW_MOMENTS:
            if layout.moments_sharded:
                shape = _row_shape(key, layout, rank)
                first = start * math.prod(shape[1:])
                piece[key] = value.reshape(-1)[first : first + math.prod(shape)].reshape(shape).clone()
            else:
                piece[key] = value.clone()
        else:
            raise ValueError(f"the optimizer state entry {key!r} has no known layout over FSDP2 ranks")
    if "m_codes" in whole:
        if not layout.moments_sharded:
            piece.update({key: whole[key].clone() for key in QUANTIZED if key in whole})
        elif saved_format(whole) == RANK1_DYNAMIC4:
            requantized = _cut_4bit(whole, layout, rank, piece)
        else:
            requantized = _cut_8bit(whole, layout, rank, piece)
    return piece, requantized


def _cut_8bit(whole: dict, layout: Layout, rank: int, piece: dict) -> list[str]:
    first, numel = layout.offsets()[rank]
    if _aligned(layout, QBLOCK):
        blocks = slice(first // QBLOCK, -(-(first + numel) // QBLOCK))
        for name in ("m", "v"):
            piece[f"{name}_codes"] = whole[f"{name}_codes"][first : first + numel].clone()
            piece[f"{name}_absmax"] = whole[f"{name}_absmax"][blocks].clone()
        return []
    for name, qmap in zip(("m", "v"), _maps_8bit(saved_format(whole)), strict=True):
        values = dequantize_blockwise(whole[f"{name}_codes"], whole[f"{name}_absmax"], qmap)
        piece[f"{name}_codes"], piece[f"{name}_absmax"] = quantize_blockwise(
            values[first : first + numel], qmap
        )
    return ["m", "v"]


def _slice_packed(packed: torch.Tensor, numel: int, first: int, count: int) -> torch.Tensor:
    """4-bit codes [first, first + count) of `packed` (of numel codes), packed again."""
    return pack_nibbles(unpack_nibbles(packed, numel)[first : first + count])


def _cut_4bit(whole: dict, layout: Layout, rank: int, piece: dict) -> list[str]:
    maps = _maps_4bit()
    shape, piece_shape = layout.moment_shape, layout.moment_piece_shape(rank)
    first, numel = layout.offsets()[rank]
    n, m_format = math.prod(shape), saved_first_moment_format(whole)
    aligned = _aligned(layout, QBLOCK_4BIT)
    blocks = slice(first // QBLOCK_4BIT, -(-(first + numel) // QBLOCK_4BIT))
    requantized = []
    if rank1_shape(shape) is not None:  # the rows' codes and maxima, the whole's column maxima: exact
        start, rows = layout.rows[rank]
        piece["v_codes"] = _slice_packed(whole["v_codes"], n, first, numel)
        piece["v_row"] = whole["v_row"][start : start + rows].clone()
        piece["v_col"] = whole["v_col"].clone()
    elif aligned:
        piece["v_codes"] = _slice_packed(whole["v_codes"], n, first, numel)
        piece["v_absmax"] = whole["v_absmax"][blocks].clone()
    else:
        _, v = decode_4bit(whole, shape, maps)
        piece.update(encode_second_moment_4bit(v[first : first + numel], piece_shape, maps))
        requantized.append("v")
    if aligned and not (requantized and m_format == "normalized"):
        piece["m_codes"] = _slice_packed(whole["m_codes"], n, first, numel)
        piece["m_absmax"] = whole["m_absmax"][blocks].clone()
    else:
        m, _ = decode_4bit(whole, shape, maps)
        piece.update(encode_first_moment_4bit(m[first : first + numel], piece, piece_shape, maps, m_format))
        requantized.insert(0, "m")
    return requantized


# ------------------------------------------------------------------------------------- a whole optimizer


def _indexed(optimizer: torch.optim.Optimizer) -> list[tuple[torch.Tensor, dict]]:
    """(parameter, group) in the optimizer's numbering, that of its state dicts."""
    return [(param, group) for group in optimizer.param_groups for param in group["params"]]


def _convert(index: int, name: str, convert, *args) -> tuple[dict, list[str]]:
    try:
        return convert(*args)
    except (RuntimeError, ValueError, IndexError, KeyError) as err:
        raise ConfigError(
            f"the saved optimizer state of {name} (index {index}) does not fit this optimizer's layout ({err}):"
            " resume with the optimizer settings that saved it, or start the optimizer state afresh"
        ) from err


def merge_rank_states(
    optimizer: torch.optim.Optimizer, rank_states: list[dict], names: list[str]
) -> tuple[dict, dict[str, list[str]]]:
    """The whole-tensor optimizer "state" (by parameter index) of the FSDP2 ranks' `rank_states`; and, by
    parameter name, the moments that were re-quantized. `names`: the parameters' names by index."""
    state, requantized = {}, {}
    for index, (param, group) in enumerate(_indexed(optimizer)):
        pieces = [_on_cpu(ranks_state.get(index, {})) for ranks_state in rank_states]
        if not any(pieces):
            continue
        layout = Layout.of(tuple(param.shape), len(rank_states), group)
        state[index], moments = _convert(index, names[index], merge, pieces, layout)
        if moments:
            requantized[names[index]] = moments
    return state, requantized


def cut_whole_state(
    optimizer: torch.optim.Optimizer, state: dict, rank: int, world_size: int, names: list[str]
) -> tuple[dict, dict[str, list[str]]]:
    """Rank `rank`'s optimizer "state" of `world_size` FSDP2 ranks, cut from the whole-tensor `state`; and
    the moments that were re-quantized, by parameter name."""
    piece, requantized = {}, {}
    for index, (param, group) in enumerate(_indexed(optimizer)):
        if not state.get(index):
            continue
        layout = Layout.of(tuple(param.shape), world_size, group)
        piece[index], moments = _convert(index, names[index], cut, _on_cpu(state[index]), layout, rank)
        if moments:
            requantized[names[index]] = moments
    return piece, requantized


def _on_cpu(entries: dict) -> dict:
    return {k: v.cpu() if torch.is_tensor(v) else v for k, v in entries.items()}
