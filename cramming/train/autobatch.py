"""The micro-batch: impl.microbatch_size checked against train.batch_size, or with `auto` the micro-batch with
the most tokens per second that fits in memory.

Cramming users report that the micro-batch size alone moved GLUE from 73 to 80: in a wall-clock budget,
throughput is quality. The search runs at start-up, after the budget clock has started (its time is
charged to the budget), and is bounded twice: by a list of candidates (powers of two, capped by the
device's memory and by train.batch_size) and by a time limit, after which the best size so far is kept.
The result is cached in {base_dir}/autobatch.json per device and model shape, so the next run of the same
shape on the same device starts at once.

Each candidate runs the loop's own micro-batch (the train step's forward and backward of the MLM objective,
cramming.train.mlm) on random rows of the real shape and masking, with a generator of its own, and discards
the update: the training data, the masks, the weights (no optimizer step) and the random streams are
untouched. The eager model is measured even when training compiles it; the compiled model ranks sizes alike
and needs less memory, so a size that fits eagerly fits compiled.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from torch import nn

from cramming.errors import ConfigError, config_error
from cramming.model import ArchConfig
from cramming.optim.step import TrainStep
from cramming.train.mlm import MLMObjective
from cramming.utils import atomic_write_text

log = logging.getLogger("cramming")

CACHE_FILE = "autobatch.json"
# the search may spend this share of the budget, and never more than MAX_SECONDS
BUDGET_SHARE = 0.05
MAX_SECONDS = 300.0
# sizes within this share of the best throughput count as equal: the smallest of them is chosen (a finer
# batch-size ramp, more memory to spare)
TOLERANCE = 0.03
CPU_MAX = 512
CUDA_MAX = 4096


def largest_divisor(number: int, at_most: int) -> int:
    """The largest divisor of `number` that is at most `at_most` (1 at least): the micro-batch that forms a
    batch of `number` sequences exactly."""
    return max(d for d in range(1, max(1, min(number, at_most)) + 1) if number % d == 0)


def nearest_microbatches(per_process: int, microbatch_size: int) -> str:
    """The micro-batch sizes nearest to the one asked for that form `per_process` sequences exactly: the nearest
    first, then the one on the other side of it (a smaller one fits in less memory)."""
    below = largest_divisor(per_process, microbatch_size)
    above = next((d for d in range(microbatch_size + 1, per_process + 1) if per_process % d == 0), None)
    if above is None:
        return f"impl.microbatch_size={below}"
    near, other = (above, below) if above - microbatch_size < microbatch_size - below else (below, above)
    return f"impl.microbatch_size={near} (the nearest that divides it) or {other}"


def check_batch_division(batch_size: int, microbatch_size: int | str, world_size: int = 1) -> None:
    """train.batch_size must be formed exactly from micro-batches of impl.microbatch_size on each of
    `world_size` processes: a batch the micro-batch does not divide would train another batch size than the
    run records. (The ramp's smaller batches are whole micro-batches by definition: schedules.py.)"""
    if microbatch_size == "auto":
        return  # the search only tries divisors (train/autobatch.py)
    per_update = microbatch_size * world_size
    if batch_size % per_update == 0:
        return
    fits = batch_size % world_size == 0  # else no micro-batch forms it on every process alike
    where = f" on each of {world_size} processes" if world_size > 1 else ""
    hint = (
        nearest_microbatches(batch_size // world_size, microbatch_size)
        if fits
        else "another train.batch_size"
    )
    raise config_error(
        "train.batch_size",
        batch_size,
        f"it is not a whole number of micro-batches of impl.microbatch_size={microbatch_size}{where}, so the"
        f" run would train another batch than it records. Use a batch size divisible by {per_update}, or {hint}",
    )


class TooLarge(Exception):
    """A candidate micro-batch does not fit in memory."""


@dataclass
class Trial:
    microbatch: int
    seq_per_s: float | None  # None: did not fit
    note: str = ""


def powers_of_two(most: int, least: int = 1) -> list[int]:
    """least, 2 least, 4 least, ... up to `most`."""
    sizes, size = [], least
    while size <= most:
        sizes.append(size)
        size *= 2
    return sizes


def search(
    measure: Callable[[int], float],
    candidates: Sequence[int],
    time_limit: float,
    clock: Callable[[], float] = time.monotonic,
) -> tuple[int, list[Trial]]:
    """Measure candidates in increasing order; returns (chosen size, trials).

    measure(size) -> sequences per second, or raises TooLarge. The search stops at the first size that does
    not fit, after two sizes in a row slower than the best one, or before a size whose measurement would
    end past `time_limit` seconds (its duration predicted from the last one, in proportion to the size).
    The first size is always measured. The choice is the smallest size within TOLERANCE of the fastest.
    """
    start = clock()
    trials: list[Trial] = []
    slower_in_a_row, last_size, last_seconds = 0, 0, 0.0
    for size in sorted(candidates):
        predicted_end = clock() - start + (last_seconds * size / last_size if last_size else 0.0)
        if trials and predicted_end > time_limit:
            trials.append(Trial(size, None, "not measured: time limit"))
            break
        began = clock()
        try:
            rate = measure(size)
        except TooLarge as err:
            trials.append(Trial(size, None, f"too large: {err}"))
            break
        last_size, last_seconds = size, clock() - began
        best = max((t.seq_per_s for t in trials if t.seq_per_s is not None), default=0.0)
        slower_in_a_row = slower_in_a_row + 1 if rate < best else 0
        trials.append(Trial(size, rate))
        if slower_in_a_row == 2:
            break
    fitted = [t for t in trials if t.seq_per_s is not None]
    if not fitted:
        raise TooLarge(
            f"impl.microbatch_size=auto: not even {min(candidates)} sequences fit ({trials[-1].note});"
            " use a smaller model or another device"
        )
    best = max(t.seq_per_s for t in fitted)
    chosen = min(t.microbatch for t in fitted if t.seq_per_s >= (1.0 - TOLERANCE) * best)
    return chosen, trials


# ------------------------------------------------------------------------------------------ the device side


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"cpu x{torch.get_num_threads()} threads"


def cpu_max_microbatch(arch: ArchConfig, seq_length: int, available_bytes: int) -> int:
    """The largest power of two whose activations (a generous estimate, fp32) take at most a quarter of the
    free memory; never above CPU_MAX. Per token and layer about 10 hidden-wide tensors, two FFN-wide ones
    and a row of attention probabilities per head are saved for the backward pass."""
    per_token = arch.num_layers * (
        10 * arch.hidden_size + 2 * arch.intermediate_size + arch.num_heads * seq_length
    )
    per_sequence = 2 * 4 * seq_length * per_token  # fp32 bytes, times two for the backward's temporaries
    fitting = max(1, available_bytes // 4 // per_sequence)
    return min(CPU_MAX, 1 << (fitting.bit_length() - 1))


def available_cpu_bytes() -> int:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")


def check_peak_memory(device: torch.device, reserve_bytes: int) -> None:
    """Raise TooLarge when the peak so far plus `reserve_bytes` exceeds 90% of the GPU's memory."""
    peak = torch.cuda.max_memory_allocated(device)
    limit = 0.9 * torch.cuda.get_device_properties(device).total_memory
    if peak + reserve_bytes > limit:
        raise TooLarge(
            f"peak {peak / 2**30:.1f} GiB + {reserve_bytes / 2**30:.1f} GiB optimizer state > 90% of memory"
        )


def timed_steps(
    one_step: Callable[[], None], device: torch.device, min_steps: int, min_seconds: float, max_steps: int
) -> tuple[int, float]:
    """(steps, seconds) of at least min_steps and min_seconds, at most max_steps, after one warm-up step."""
    cuda = device.type == "cuda"
    one_step()  # warm-up
    if cuda:
        torch.cuda.synchronize(device)
    start, steps = time.perf_counter(), 0
    while steps < max_steps and (steps < min_steps or time.perf_counter() - start < min_seconds):
        one_step()
        steps += 1
        if cuda:
            torch.cuda.synchronize(device)
    return steps, time.perf_counter() - start


def timed_within_memory(
    one_step: Callable[[], None],
    model: nn.Module,
    device: torch.device,
    reserve_bytes: int,
    timing: tuple[int, float, int],
) -> tuple[int, float]:
    """timed_steps(one_step, device, *timing) with the gradients cleared after; on CUDA raises TooLarge when
    it runs out of memory or its peak leaves less than `reserve_bytes` of 90% of the device's memory."""
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
    out_of_memory = False
    try:
        steps, seconds = timed_steps(one_step, device, *timing)
    except torch.cuda.OutOfMemoryError:
        out_of_memory = True  # raised below, once the failed step's tensors are released with its frames
    finally:
        model.zero_grad(set_to_none=True)
    if out_of_memory:
        torch.cuda.empty_cache()
        raise TooLarge("out of memory")
    if cuda:
        check_peak_memory(device, reserve_bytes)
    return steps, seconds


def step_measure(
    model: nn.Module,
    objective: MLMObjective,
    dtype: torch.dtype,
    seq_length: int,
    reserve_bytes: int = 0,
    min_steps: int = 2,
    min_seconds: float = 0.5,
    max_steps: int = 20,
) -> Callable[[int], float]:
    """measure(size): sequences per second of the loop's micro-batch at size `size`, after one warm-up step,
    over at least `min_steps` steps and `min_seconds` seconds (small sizes are noisy), at most `max_steps`.

    On CUDA, running out of memory, or a peak that leaves less than `reserve_bytes` (the optimizer state
    still to come) of 90% of the device's memory, raises TooLarge.
    """
    generator, masker, device = torch.Generator().manual_seed(0), objective.masker, objective.device

    def measure(size: int) -> float:
        rows = torch.randint(
            masker.first_ordinary, masker.vocab_size, (size, seq_length), generator=generator
        )
        step = TrainStep(model, None, device_type=device.type, dtype=dtype, grad_clip=None)  # never applies

        def one_step() -> None:
            step.begin()
            step.microbatch(objective, model, (torch.arange(size), rows))
            step.discard()  # gradients dropped, the random streams rewound

        steps, seconds = timed_within_memory(
            one_step, model, device, reserve_bytes, (min_steps, min_seconds, max_steps)
        )
        return steps * size / seconds

    return measure


# ----------------------------------------------------------------------------------------------- the cache


def cache_key(
    device: torch.device,
    arch: ArchConfig,
    vocab_size: int,
    seq_length: int,
    dtype: torch.dtype,
    model: nn.Module,
) -> str:
    """Device + model shape + what changes its speed (dtype, kernel backends as built, torch version)."""
    backends = sorted(
        {type(m).__name__ + ":" + getattr(m.fn, "__name__", "") for m in model.modules() if hasattr(m, "fn")}
    )
    shape = json.dumps(
        {"arch": asdict(arch), "vocab": vocab_size, "seq": seq_length, "backends": backends}, sort_keys=True
    )
    digest = hashlib.sha256(shape.encode()).hexdigest()[:12]
    return f"{device_name(device)} | {arch.name}-{digest} | {str(dtype).removeprefix('torch.')} | torch {torch.__version__}"


def read_cache(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        return {}


def write_cache(path: Path, key: str, record: dict) -> None:
    entries = read_cache(path)
    entries[key] = record
    atomic_write_text(path, json.dumps(entries, indent=2, sort_keys=True) + "\n")


# ------------------------------------------------------------------------------------------------ the entry


def choose_microbatch(
    model: nn.Module,
    objective: MLMObjective,
    dtype: torch.dtype,
    seq_length: int,
    *,
    cache_path: Path,
    most: int,
    time_limit: float,
    search_allowed: bool = True,
) -> int:
    """The cached choice for this device and model shape, or a fresh search (logged and cached).

    most: the largest useful size (train.batch_size); time_limit: seconds the search may take;
    search_allowed: False under several processes, whose separate searches could choose differently."""
    arch: ArchConfig = model.arch
    device = objective.device
    key = cache_key(device, arch, objective.masker.vocab_size, seq_length, dtype, model)
    cached = read_cache(cache_path).get(key)
    if cached is not None:
        size = largest_divisor(most, int(cached["microbatch_size"]))  # the cache is per model, not per batch
        log.info("micro-batch %d for %s, cached in %s (%d)", size, key, cache_path, cached["microbatch_size"])
        return size
    if not search_allowed:
        raise ConfigError(
            f"impl.microbatch_size=auto under several processes needs a cached choice ({key} is not in"
            f" {cache_path}): run once in a single process to search, or give a number"
        )
    reserve, candidates = search_space(model, device, seq_length, most)
    started = time.monotonic()
    chosen, trials = search(
        step_measure(model, objective, dtype, seq_length, reserve), candidates, time_limit
    )
    seconds = time.monotonic() - started
    table = ", ".join(
        f"{t.microbatch}: {t.seq_per_s * seq_length:,.0f} tok/s"
        if t.seq_per_s
        else f"{t.microbatch}: {t.note}"
        for t in trials
    )
    log.info(
        "micro-batch search (%.1f s of budget): %s -> %d; cached in %s", seconds, table, chosen, cache_path
    )
    record = {
        "microbatch_size": chosen,
        "search_seconds": round(seconds, 2),
        "trials": [asdict(t) for t in trials],
    }
    write_cache(
        cache_path, key, record | {"searched_at": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())}
    )
    return chosen


def search_space(model: nn.Module, device: torch.device, seq_length: int, most: int) -> tuple[int, list[int]]:
    """(bytes to keep free for what is not allocated yet, the sizes to try): powers of two up to `most` and
    what fits, only those that form the batch `most` exactly (a micro-batch never changes the batch trained)."""
    if device.type == "cuda":
        reserve = 8 * sum(p.numel() for p in model.parameters())  # fp32 AdamW moments, not yet allocated
        candidates = powers_of_two(min(most, CUDA_MAX), least=min(8, most))
    else:
        reserve = 0
        cap = cpu_max_microbatch(model.arch, seq_length, available_cpu_bytes())
        candidates = powers_of_two(min(most, cap), least=1)
    return reserve, [size for size in candidates if most % size == 0] or [
        largest_divisor(most, candidates[0])
    ]


def time_limit_for(budget_hours: float) -> float:
    """Seconds the search may spend: BUDGET_SHARE of the budget, at most MAX_SECONDS."""
    return min(BUDGET_SHARE * budget_hours * 3600.0, MAX_SECONDS)


def microbatch_size_for(
    requested: int | str,
    model: nn.Module,
    objective: MLMObjective,
    dtype: torch.dtype,
    seq_length: int,
    *,
    base_dir: Path,
    batch_size: int,
    budget_hours: float,
    world_size: int,
) -> int:
    """impl.microbatch_size (`requested`), checked to form train.batch_size exactly on this many processes, or
    with `auto` the searched one (only sizes that form it are tried): at set-up, on the budget's clock, before
    any optimizer hook. Returned, never written back into the config."""
    if requested != "auto":
        check_batch_division(batch_size, requested, world_size)
        return requested
    return choose_microbatch(
        model,
        objective,
        dtype,
        seq_length,
        cache_path=base_dir / CACHE_FILE,
        most=batch_size,
        time_limit=time_limit_for(budget_hours),
        search_allowed=world_size == 1,
    )
