"""Shared machinery of our optimizers: per-parameter steps, GaLore projection per group, layerwise mode.

A subclass says only how its moments look (`_moment_specs`) and how a gradient becomes a normalized update
(`_direction`); this class allocates the state, projects the 2-D weights of GaLore groups, applies the
decoupled weight decay and the learning rate, and runs either as a normal optimizer or layerwise. Under
FSDP2 each rank updates its own shard of every parameter, with moments of the shard's shape (_step_param);
a GaLore weight's projector comes from the whole gradient, gathered on refresh steps only
(_step_galore_shard, and cramming.optim.galore for which side shards what).

Param-group keys, besides lr and weight_decay:
    rank             0: plain update; > 0: GaLore projection of this group's (2-D) parameters
    update_proj_gap, scale, proj_type   GaLore settings (see cramming.optim.galore)
    optim_bits       8 or 32: state precision (AdamW only; tensors of fewer than min_8bit_size stay 32-bit)

Layerwise mode — the contract with the training loop
----------------------------------------------------
With `layerwise=True` each parameter is updated inside its post-accumulate-grad hook, as soon as its
gradient is complete, and its gradient is freed at once, so full gradients are never all held together.
`optimizer.layerwise` is True; the loop must:
  * with gradient accumulation, set `optimizer.accumulating = True` around every micro-batch's backward but
    an update's last (TrainStep.microbatch does): the hooks then leave the gradients to add up, and step on
    the last. A second stepping backward before `optimizer.step()` raises ConfigError from inside
    `loss.backward()` (each micro-batch would be a step).
  * with several processes, either pass `reduce_group` (the loop's DDP mode; and not wrap the model in DDP):
    each gradient is averaged over the ranks in its hook, then stepped (cramming.optim.layerwise); or give
    it FSDP2's parameters (`fully_shard`, no reduce_group): FSDP2 reduce-scatters each module's gradients
    and then runs the sharded parameters' post-accumulate-grad hooks itself (torch >= 2.5), so each rank
    steps its shard with the averaged gradient. Otherwise a layerwise optimizer refuses to be built when a
    process group of several ranks exists: someone else's DDP would reduce the gradients after the hooks
    had stepped on them. No fp16 GradScaler (the hooks see scaled gradients): the training step
    (cramming.optim.step.TrainStep) checks that at start-up.
  * not clip the model's gradients itself: they are gone by then, and `clip_grad_norm_` would silently
    return 0. Pass the clipping threshold as `max_grad_norm` instead: each parameter's gradient is clipped
    to that norm (per-parameter clipping, not the global-norm clipping of the normal path; under FSDP2 the
    norm of the whole parameter's gradient, summed over the ranks' shards).
    `optimizer.grad_norm` holds the global norm of the last step's gradients (before clipping) for logging.
  * call `optimizer.step()` once per update, as usual: it updates nothing itself, it closes the step (steps
    the parameters whose reductions are still in flight, resets the per-step checks and computes
    `grad_norm`). `zero_grad` closes it too (an update skipped after backward).
  * step its LR scheduler once per `optimizer.step()`, as usual: the hooks read each group's lr when they
    run, so the lr set after step k is the one used by the hooks of step k + 1 — the same count and
    timing as the normal path.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass

import torch
import torch.distributed as dist

from cramming.errors import ConfigError
from cramming.optim import galore
from cramming.optim.layerwise import GradientReducer

StateSpec = dict[str, tuple[tuple[int, ...], torch.dtype]]


def is_sharded(tensor: torch.Tensor) -> bool:
    """Whether `tensor` is a DTensor: FSDP2 (`fully_shard`) hands the optimizer its parameters as DTensors
    sharded on dim 0, and their gradients likewise."""
    return hasattr(tensor, "to_local") and hasattr(tensor, "placements")


def local_part(tensor: torch.Tensor) -> torch.Tensor:
    """The part of `tensor` this process holds and updates: a DTensor's local shard (a view: in-place
    updates of it update the parameter), anything else itself."""
    return tensor.to_local() if is_sharded(tensor) else tensor


@dataclass(frozen=True)
class RowShard:
    """A rank's tensor is rows [start, start + rows) of a whole one of `whole_rows` rows (FSDP2's Shard(0)),
    and `group` holds the ranks with the other rows."""

    group: dist.ProcessGroup
    whole_rows: int
    start: int
    rows: int

    def piece_numel(self, numel: int) -> int:
        """Elements of each rank's equal piece of a flattened tensor of `numel` (the last one zero-padded)."""
        return -(-numel // dist.get_world_size(self.group))

    def piece(self, tensor: torch.Tensor) -> torch.Tensor:
        """This rank's piece of `tensor` (the same on every rank), flattened: a copy of piece_numel elements."""
        return flat_piece(tensor, dist.get_rank(self.group), dist.get_world_size(self.group))

    def whole(self, piece: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
        """The tensor of `shape` whose pieces the ranks hold (all-gather: collective)."""
        out = piece.new_empty(piece.numel() * dist.get_world_size(self.group))
        dist.all_gather_single(out, piece, group=self.group)
        return out[: math.prod(shape)].view(shape)

    def sum_(self, tensor: torch.Tensor) -> torch.Tensor:
        """`tensor` summed over the ranks, in place (collective)."""
        dist.all_reduce(tensor, group=self.group)
        return tensor

    def broadcast_(self, tensor: torch.Tensor) -> torch.Tensor:
        """The group's first rank's `tensor`, in place on every rank (collective)."""
        dist.broadcast(tensor, src=dist.get_global_rank(self.group, 0), group=self.group)
        return tensor


def flat_piece(tensor: torch.Tensor, index: int, count: int) -> torch.Tensor:
    """Piece `index` of `count` equal pieces of `tensor` flattened (ceil(numel / count) elements, the last
    ones zero-padded): a copy."""
    size = -(-tensor.numel() // count)
    flat = tensor.reshape(-1)[index * size : (index + 1) * size]
    return torch.cat([flat, flat.new_zeros(size - flat.numel())])


def chunk_rows(whole_rows: int, count: int) -> list[tuple[int, int]]:
    """(start, rows) of each of `count` ranks' torch.chunk pieces of `whole_rows` rows, as FSDP2's Shard(0)
    cuts them: ceil(whole_rows / count) rows each, the last ones fewer or none."""
    chunk = -(-whole_rows // count)
    starts = [min(i * chunk, whole_rows) for i in range(count)]
    return [(start, min(chunk, whole_rows - start)) for start in starts]


def row_shard(param: torch.Tensor) -> RowShard | None:
    """Which rows of `param` this rank holds: None for a plain tensor; FSDP2's DTensor is sharded on dim 0
    over a 1-D mesh in torch.chunk's pieces (ceil(m / ranks) rows each, the last ones fewer or none)."""
    if not is_sharded(param):
        return None
    from torch.distributed.tensor import Shard

    mesh = param.device_mesh
    if mesh.ndim != 1 or tuple(param.placements) != (Shard(0),):
        raise ConfigError(
            f"our optimizers update FSDP2 shards of dim 0 on one mesh dimension, and got placements "
            f"{tuple(param.placements)} on a {mesh.ndim}-D mesh: use fully_shard on a 1-D mesh (no HSDP)"
        )
    whole_rows = param.shape[0]
    start, expected = chunk_rows(whole_rows, mesh.size())[mesh.get_local_rank()]
    rows = param.to_local().shape[0]
    if rows != expected:
        raise ConfigError(f"an FSDP2 shard of {rows} rows at row {start} is not torch.chunk's: unsupported")
    return RowShard(mesh.get_group(), whole_rows, start, rows)


class LeanOptimizer(torch.optim.Optimizer):
    """Base of AdamW (32/8-bit) and Adafactor: see the module docstring for group keys and layerwise mode."""

    def __init__(
        self,
        params: Iterable,
        defaults: dict,
        *,
        layerwise: bool = False,
        max_grad_norm: float | None = None,
        reduce_group: dist.ProcessGroup | None = None,
        reduce_order: Iterable[torch.Tensor] = (),
    ) -> None:
        """reduce_group: a layerwise optimizer's group of ranks to average each gradient over (module
        docstring); reduce_order: its parameters in the order the model registers them (backward produces
        the gradients in about the reverse order; the optimizer's own order, by group, may be far from it)."""
        if max_grad_norm is not None and not layerwise:
            raise ValueError(
                "max_grad_norm is for layerwise mode; otherwise clip with clip_grad_norm_ as usual"
            )
        self.layerwise = layerwise
        self.max_grad_norm = max_grad_norm
        self.grad_norm: torch.Tensor | None = None  # layerwise: global norm of the last step's gradients
        self._hooks: list = []
        self._stepped: set[int] = set()
        self._sq_norm: torch.Tensor | None = None
        self._group_of: dict[int, int] = {}  # id(param) -> index of its group
        self.accumulating = False  # layerwise: the next backward only accumulates (see the module docstring)
        params = list(params)  # an iterable is read once
        if layerwise and reduce_group is None and not _all_sharded(params):
            self._refuse_distributed()  # FSDP2's shards: FSDP2 reduces, then runs the hooks (module docstring)
        defaults = {"rank": 0, "update_proj_gap": 200, "scale": 1.0, "proj_type": "std", **defaults}
        super().__init__(params, defaults)  # calls add_param_group, which hooks layerwise parameters
        self._reducer = None
        if layerwise and reduce_group is not None and dist.get_world_size(reduce_group) > 1:
            params = [p for group in self.param_groups for p in group["params"]]
            mine = {id(p) for p in params}
            ordered = list({id(p): p for p in reduce_order if id(p) in mine}.values())  # once each
            placed = {id(p) for p in ordered}
            ordered += [p for p in params if id(p) not in placed]
            if any(is_sharded(p) for p in params):
                raise ConfigError(
                    "a layerwise optimizer got FSDP2 shards and a reduce_group: FSDP2 reduce-scatters the "
                    "gradients itself before the hooks run; pass no reduce_group under FSDP2"
                )
            self._reducer = GradientReducer(ordered, self._step_layer, reduce_group)

    def add_param_group(self, param_group: dict) -> None:
        super().add_param_group(param_group)
        group = self.param_groups[-1]
        if group["rank"] > 0 and any(p.ndim != 2 for p in group["params"]):
            raise ValueError("GaLore groups (rank > 0) may hold 2-D parameters only")
        if self.layerwise:
            group_index = len(self.param_groups) - 1
            self._group_of.update({id(p): group_index for p in group["params"]})
            self._hooks += [
                p.register_post_accumulate_grad_hook(self._layerwise_hook) for p in group["params"]
            ]

    # --- what a subclass provides -------------------------------------------------------------------

    def _moment_specs(self, shape: tuple[int, ...], group: dict, whole_numel: int | None = None) -> StateSpec:
        """The state tensors (besides projectors) for moments of `shape`: name -> (shape, dtype).

        whole_numel: when `shape` is one rank's shard (FSDP2), the element count of the whole tensor, so that
        any choice made by size (AdamW's min_8bit_size) is the same on every rank and as in one process."""
        raise NotImplementedError

    def _state_tags(self, shape: tuple[int, ...], group: dict, whole_numel: int | None = None) -> dict:
        """Plain (non-tensor) entries a fresh state of moments of `shape` starts with, e.g. its format
        (whole_numel as for _moment_specs)."""
        return {}

    def _direction(
        self, grad: torch.Tensor, state: dict, group: dict, step: int, rows: RowShard | None = None
    ) -> torch.Tensor:
        """Update the moments with the fp32 `grad` and return the normalized update (p -= lr · direction).
        rows: set when `grad` is one rank's rows of a whole tensor, for updates that reduce over rows."""
        raise NotImplementedError

    def _update_full(
        self,
        param: torch.Tensor,
        grad: torch.Tensor,
        state: dict,
        group: dict,
        step: int,
        rows: RowShard | None = None,
    ) -> None:
        """The plain (unprojected) update of `param`; a subclass may fuse it."""
        direction = self._direction(grad.float(), state, group, step, rows)
        work = param if param.dtype == torch.float32 else param.float()
        work.mul_(1.0 - group["lr"] * group["weight_decay"]).add_(direction, alpha=-group["lr"])
        if work is not param:
            param.copy_(work)

    # --- the step -------------------------------------------------------------------------------------

    @staticmethod
    def moment_shape(param: torch.Tensor, group: dict) -> tuple[int, ...]:
        """The shape of this parameter's moments as this rank holds them: its own (its shard's under FSDP2),
        or its low-rank shape in a GaLore group (see cramming.optim.galore for FSDP2's)."""
        shard = row_shard(param)
        if group["rank"] > 0:
            rows = None if shard is None else shard.rows
            return galore.low_rank_shape(tuple(param.shape), group["rank"], group["proj_type"], rows)
        return tuple(local_part(param).shape)

    @staticmethod
    def _whole_moment_numel(param: torch.Tensor, group: dict) -> int:
        """Elements of the moments one process would hold: any choice made by size (AdamW's min_8bit_size)
        is made on this, so it is the same on every rank and as in one process."""
        if group["rank"] > 0:
            return math.prod(galore.low_rank_shape(tuple(param.shape), group["rank"], group["proj_type"]))
        return param.numel()

    def state_spec(self, param: torch.Tensor, group: dict) -> StateSpec:
        """Every state tensor this parameter will have, predicted without a step (for the memory report).
        A sharded parameter's state is what its rank holds (see _step_param)."""
        shard = row_shard(param)
        whole_numel = None if shard is None else self._whole_moment_numel(param, group)
        spec = self._moment_specs(self.moment_shape(param, group), group, whole_numel)
        if group["rank"] > 0:
            rows = None if shard is None else shard.rows
            shapes = galore.projector_shapes(tuple(param.shape), group["rank"], group["proj_type"], rows)
            if shard is not None and "galore_right" in shapes:  # a piece of it: see _step_galore_shard
                shapes["galore_right"] = (shard.piece_numel(math.prod(shapes["galore_right"])),)
            spec.update({key: (shape, torch.float32) for key, shape in shapes.items()})
        return spec

    def _step_param(self, param: torch.Tensor, grad: torch.Tensor, group: dict) -> None:
        """One parameter's update. Under FSDP2 (a DTensor `param`) each rank updates its own shard with
        moments of the shard's shape, held as plain local tensors: the update is elementwise, and quantized
        moments take their block scales over the shard (blocks end at the shard's boundary). GaLore weights:
        _step_galore_shard."""
        state = self.state[param]
        shard = row_shard(param)
        if not state:
            state["step"] = 0
            for key, (shape, dtype) in self.state_spec(param, group).items():
                if not key.startswith("galore_"):  # projectors come from the first SVD
                    state[key] = torch.zeros(shape, dtype=dtype, device=param.device)
            whole_numel = None if shard is None else self._whole_moment_numel(param, group)
            state.update(self._state_tags(self.moment_shape(param, group), group, whole_numel))
        state["step"] += 1
        step = state["step"]
        if shard is not None and group["rank"] > 0:
            self._step_galore_shard(param, grad, state, group, shard)
            return
        if shard is not None:
            param, grad = local_part(param), local_part(grad)
            # a tensor of fewer rows than ranks: this rank holds none of it (and joins no collective)
            if param.numel() == 0 and not self.reduces_over_rows:
                return
        if group["rank"] == 0:
            self._update_full(param, grad, state, group, step, shard)
            return
        low = galore.project(grad, state, step, group["rank"], group["proj_type"], group["update_proj_gap"])
        direction = self._direction(low, state, group, step)
        self._apply_low_rank(param, direction, state, group, tuple(param.shape))

    def _step_galore_shard(
        self, param: torch.Tensor, grad: torch.Tensor, state: dict, group: dict, shard: RowShard
    ) -> None:
        """A GaLore weight's update on this rank's rows (collective: every rank calls it in the same order).

        On refresh steps the whole gradient is gathered (all-gather) and the first rank's SVD projectors are
        broadcast, so every rank projects with the same bits. A rank keeps its rows of a left projector, and
        a 1/ranks piece of a right projector, which every step gathers (all-gather of r×n: the weight's
        all-gather that FSDP2 does anyway is m/r times larger). The right side then needs no other
        communication and its moments are this rank's rows; the left and full sides sum the ranks' partial
        projections (all-reduce of the low-rank gradient) and every rank holds the same moments."""
        whole_shape, step = tuple(param.shape), state["step"]
        projectors = {}
        if galore.needs_projectors(state, step, group["update_proj_gap"]):
            whole_grad = grad.full_tensor()  # (m, n) on every rank
            projectors = galore.svd_projectors(whole_grad, group["rank"], group["proj_type"])
            projectors = {key: shard.broadcast_(value) for key, value in projectors.items()}
            if "galore_left" in projectors:  # (m, r): this rank's rows
                left = projectors["galore_left"][shard.start : shard.start + shard.rows].contiguous()
                state["galore_left"] = projectors["galore_left"] = left
            if "galore_right" in projectors:  # (r, n): a piece
                state["galore_right"] = shard.piece(projectors["galore_right"])
        elif "galore_right" in state:
            shape = galore.projector_shapes(whole_shape, group["rank"], group["proj_type"])["galore_right"]
            projectors["galore_right"] = shard.whole(state["galore_right"], shape)
        if "galore_left" in state:
            projectors["galore_left"] = state["galore_left"]
        side = galore.projection_side(whole_shape, group["proj_type"])
        low = galore.apply_projection(local_part(grad), projectors, side)
        if side == "right":  # (rows, r): this rank's rows of the low-rank gradient
            direction = self._direction(low, state, group, step, shard)
        else:
            direction = self._direction(shard.sum_(low), state, group, step)  # the whole, on every rank
        self._apply_low_rank(local_part(param), direction, projectors, group, whole_shape)

    @staticmethod
    def _apply_low_rank(
        param: torch.Tensor,
        direction: torch.Tensor,
        projectors: dict,
        group: dict,
        whole_shape: tuple[int, int],
    ) -> None:
        """Decay `param` (a whole weight or a rank's rows) and add the projected-back low-rank `direction`."""
        update = galore.project_back(direction, projectors, group["proj_type"], whole_shape)  # (rows, n)
        param.mul_(1.0 - group["lr"] * group["weight_decay"])
        param.add_(update.to(param.dtype), alpha=-group["lr"] * group["scale"])

    # whether _direction reduces over a row-sharded tensor's ranks (Adafactor's factored statistics): then
    # a rank that holds no rows of a tensor still joins its collectives
    reduces_over_rows = False

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        if self.layerwise:
            self._close_layerwise_step()
            return loss
        for group in self.param_groups:
            for param in group["params"]:
                if param.grad is not None:
                    self._step_param(param, param.grad, group)
        return loss

    # --- layerwise --------------------------------------------------------------------------------------

    @staticmethod
    def _refuse_distributed() -> None:
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            raise ConfigError(
                "layerwise optimizers update inside gradient hooks, before a DDP wrapper's all-reduce: with "
                "several processes pass reduce_group (cramming's loop does, under impl.distributed=ddp), or "
                "FSDP2's parameters (impl.distributed=fsdp2), or use the optimizer name without `_layerwise`"
            )

    @torch.no_grad()
    def _layerwise_hook(self, param: torch.Tensor) -> None:
        if self.accumulating:  # a micro-batch before the update's last: its gradient adds up in param.grad
            return
        if id(param) in self._stepped:
            raise ConfigError(
                "a layerwise optimizer got a second stepping backward before optimizer.step(): with gradient "
                "accumulation set `optimizer.accumulating = True` for every micro-batch but the last "
                "(TrainStep.microbatch), or use the optimizer name without `_layerwise`"
            )
        self._stepped.add(id(param))
        if self._reducer is None:
            self._step_layer(param)
        else:
            self._reducer.ready(param)  # steps it once its gradient is averaged over the ranks

    @torch.no_grad()
    def _step_layer(self, param: torch.Tensor) -> None:
        """Clip `param`'s (complete, reduced) gradient, step it, free it. Under FSDP2 the gradient is this
        rank's shard, and the norm is the whole gradient's (collective: every rank runs the hooks in the
        same order)."""
        grad = local_part(param.grad)
        norm = torch.linalg.vector_norm(grad.float())
        shard = row_shard(param)
        if shard is not None:
            norm = shard.sum_(norm.square()).sqrt()
        self._sq_norm = norm.square() if self._sq_norm is None else self._sq_norm + norm.square()
        if self.max_grad_norm is not None:
            # torch.nn.utils.clip_grad_norm_'s rule, applied to this parameter alone
            grad.mul_((self.max_grad_norm / (norm + 1e-6)).clamp(max=1.0).to(grad.dtype))
        self._step_param(param, param.grad, self.param_groups[self._group_of[id(param)]])
        param.grad = None

    def _close_layerwise_step(self) -> None:
        """Step what is still being reduced; then the step's gradient norm, and the checks start afresh."""
        if not self._stepped:  # nothing stepped since the last close (e.g. zero_grad after step)
            if any(is_sharded(p) and p.grad is not None for g in self.param_groups for p in g["params"]):
                raise ConfigError(
                    f"FSDP2 in torch {torch.__version__} left the gradients without running the parameters'"
                    " post-accumulate-grad hooks, in which a layerwise optimizer steps: nothing was updated."
                    " Use torch >= 2.5, impl.distributed=ddp, or the optimizer name without `_layerwise`"
                )
            return
        if self._reducer is not None:
            with torch.no_grad():
                self._reducer.finish()
        self.grad_norm = None if self._sq_norm is None else self._sq_norm.sqrt()
        self._sq_norm = None
        self._stepped.clear()

    def zero_grad(self, set_to_none: bool = True) -> None:
        if self.layerwise:  # an update skipped after its backward: its steps are done, close them
            self._close_layerwise_step()
        super().zero_grad(set_to_none)

    # --- state dict -------------------------------------------------------------------------------------

    def load_state_dict(self, state_dict: dict) -> None:
        """As torch's, but keeps each state tensor's dtype (torch would cast uint8 codes and fp32
        projectors to the parameter's dtype); only the device follows the parameter."""
        saved = state_dict["state"]
        super().load_state_dict(state_dict)
        params = [p for group in self.param_groups for p in group["params"]]  # torch's numbering
        for index, param in enumerate(params):
            if index in saved:
                self.state[param] = {
                    key: value.to(param.device, copy=True) if torch.is_tensor(value) else value
                    for key, value in saved[index].items()
                }


def _all_sharded(params: list) -> bool:
    """Whether `params` (tensors or param-group dicts) are all FSDP2 shards (DTensors), and there are some."""
    tensors = [p for item in params for p in (item["params"] if isinstance(item, dict) else [item])]
    return bool(tensors) and all(is_sharded(p) for p in tensors)
