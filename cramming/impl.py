"""Typed configuration of the `impl` group: how fast, never what.

An `impl` setting may change rounding (precision, kernels) but never what is computed: a run with another
`impl` is the same experiment. That is why none of it feeds the data-cache hash or the run's identity.
"""

from __future__ import annotations

import ctypes
import logging
import os
import platform
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from cramming.errors import check_choice, config_error
from cramming.model.ops import ATTENTION, FFN_ACTIVATION, LAYERNORM, LOSS

log = logging.getLogger("cramming")

DEVICES = ("auto", "cpu", "cuda")
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def dtype_name(dtype: torch.dtype) -> str:
    """How logs, run cards and calibration files write a dtype: float32, bfloat16, float16."""
    return str(dtype).removeprefix("torch.")


# how the processes of a torchrun launch share the model (cramming.train.parallel.Parallel implements both)
PARALLEL_MODES = ("ddp", "fsdp2")


@dataclass
class ImplConfig:
    """The `impl` group: device, precision, compilation, kernels, micro-batch and workers; speed only."""

    # auto: cuda when available, else cpu; "cuda:1" picks a GPU
    device: str = "auto"
    # auto: bf16 on GPUs that support it, else fp16 with a loss scaler; on CPU bf16 where the CPU computes it
    # natively (AVX-512 BF16 or AMX, see cpu_bf16_support), else fp32. fp32 master weights, optimizer and loss
    precision: str = "auto"
    # torch.compile the model: true, false, or auto (on for CUDA, off on CPU); compile time counts against
    # the budget. (Typed Any to take a bool or the word auto: OmegaConf has no unions; __post_init__ checks it)
    compile: Any = "auto"
    # the attention kernel: sdpa (PyTorch's scaled_dot_product_attention), eager (the plain formula, the
    # reference), or triton (the fused kernel of cramming.kernels; ALiBi inside it)
    attention: str = "sdpa"
    # the LayerNorm: torch, or triton (the fused kernel of cramming.kernels)
    layernorm: str = "torch"
    # the gated FFN's gate * gelu(value) (arch.ffn=glu only): PyTorch, or one fused Triton kernel each way
    ffn_activation: str = "torch"
    # the MLM cross-entropy: PyTorch on an fp32 copy of the logits, or the Triton kernel reading them as they are
    loss: str = "torch"
    # fail instead of falling back to PyTorch when a Triton kernel cannot launch
    strict_kernels: bool = False
    # sequences per forward/backward pass; the recipe's batch size is reached by accumulation. auto: searched
    # at start-up for the most tokens/s that fits, on the budget's clock, cached per device and model shape
    # in {base_dir}/autobatch.json (cramming.train.autobatch); set-up uses the number chosen and never writes
    # it back here. (Typed Any to take a number or the word auto; __post_init__ checks it)
    microbatch_size: Any = 128
    # DataLoader worker processes during training
    num_workers: int = 2
    # PyTorch intra-op threads when training on CPU (None: PyTorch's default, one per core); on a CPU shared
    # with other jobs, 1 can be several times faster than contending for every core
    cpu_threads: int | None = None
    # processes for preprocessing maps (None: all cores)
    num_proc: int | None = None
    # how the processes of a torchrun launch share the model (ignored in a single process): ddp replicates
    # it and all-reduces gradients; fsdp2 shards parameters, gradients and optimizer state (fully_shard), with
    # every optimizer
    distributed: str = "ddp"
    # on CPU, have glibc's malloc keep the memory a process frees instead of handing it back to the kernel. A
    # step frees and reallocates the same tensors every time; glibc maps each large one afresh and the kernel
    # zeroes every page of it again: about 30,000 page faults per bert-tiny update, 8-19% of its time in the
    # kernel; kept, a step is 1.12-1.16x as fast (results/step-speed/cpu-malloc.md). The process keeps its peak
    # memory instead. No effect elsewhere
    keep_freed_memory: bool = True

    def __post_init__(self) -> None:
        check_choice("impl.device", self.device.split(":")[0], DEVICES)
        self.check_device_present()
        check_choice("impl.precision", self.precision, ("auto", *DTYPES))
        check_choice("impl.attention", self.attention, ATTENTION)
        check_choice("impl.layernorm", self.layernorm, LAYERNORM)
        check_choice("impl.distributed", self.distributed, PARALLEL_MODES)
        check_choice("impl.ffn_activation", self.ffn_activation, FFN_ACTIVATION)
        check_choice("impl.loss", self.loss, LOSS)
        if isinstance(self.microbatch_size, str) and self.microbatch_size.isdigit():
            self.microbatch_size = int(self.microbatch_size)
        if self.microbatch_size != "auto" and (
            type(self.microbatch_size) is not int or self.microbatch_size < 1
        ):
            raise config_error(
                "impl.microbatch_size",
                self.microbatch_size,
                "use a positive number of sequences, or auto to search for the fastest at start-up",
            )
        if self.compile not in (True, False, "auto"):
            raise config_error("impl.compile", self.compile, "use true, false or auto (on for CUDA only)")
        if self.num_workers < 0:
            raise config_error(
                "impl.num_workers", self.num_workers, "use 0 (load in the main process) or more"
            )
        if self.cpu_threads is not None and self.cpu_threads < 1:
            raise config_error(
                "impl.cpu_threads", self.cpu_threads, "use a positive count or null for the default"
            )
        if self.num_proc is not None and self.num_proc < 1:
            raise config_error("impl.num_proc", self.num_proc, "use a positive count or null for all cores")

    def check_device_present(self) -> None:
        """impl.device=cuda[:N] on a machine without that GPU fails here, naming the choices, not in torch."""
        if not self.device.startswith("cuda"):
            return
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        index = self.device.partition(":")[2]
        if not index.isdigit() and index:
            raise config_error("impl.device", self.device, "use cuda, cuda:<index>, cpu or auto")
        if count == 0 or int(index or 0) >= count:
            found = f"{count} CUDA GPU(s)" if count else "no CUDA GPU (or a CPU-only build of torch)"
            raise config_error(
                "impl.device",
                self.device,
                f"this machine has {found}. Use impl.device=cpu, or auto (a GPU when there is one)",
            )

    @property
    def preprocessing_procs(self) -> int:
        return self.num_proc or os.cpu_count() or 1

    def kernel_choices(self) -> dict:
        """The backend settings build_model takes (attention, layernorm, ffn_activation, loss, strict)."""
        return {
            "attention": self.attention,
            "layernorm": self.layernorm,
            "ffn_activation": self.ffn_activation,
            "loss": self.loss,
            "strict_kernels": self.strict_kernels,
        }

    def apply_threads(self) -> None:
        """impl.cpu_threads for this process's PyTorch (every entry point calls this; no-op when unset)."""
        if self.cpu_threads is not None:
            torch.set_num_threads(self.cpu_threads)

    def apply_to_process(self, device: torch.device) -> None:
        """What this process runs with: impl.cpu_threads, and on CPU impl.keep_freed_memory. Every entry point
        calls it before building a model; the tensors allocated before it are not affected."""
        self.apply_threads()
        if device.type == "cpu" and self.keep_freed_memory:
            kept, how = keep_freed_memory()
            log.info("CPU allocator: %s", how if kept else f"left as it is ({how})")

    def torch_device(self) -> torch.device:
        """The device to run on: `auto` is the first GPU when there is one, else the CPU."""
        if self.device == "auto":
            return torch.device("cuda" if torch.cuda.is_available() else "cpu")
        return torch.device(self.device)

    def compile_on(self, device: torch.device) -> bool:
        """Whether to torch.compile: `auto` compiles on CUDA (a minute or two of the budget, repaid within
        minutes) and not on CPU (little gain for the time it takes)."""
        return device.type == "cuda" if self.compile == "auto" else bool(self.compile)

    def compute_dtype(self, device: torch.device) -> torch.dtype:
        """The autocast dtype: `auto` is bf16 on GPUs that support it, else fp16 (with a loss scaler); on CPU
        bf16 where the CPU has native bf16 dot products, else fp32 (emulated bf16 is slower than fp32)."""
        return self.precision_choice(device)[0]

    def precision_choice(self, device: torch.device) -> tuple[torch.dtype, str]:
        """(autocast dtype, why): what the run logs and its run card records."""
        if self.precision != "auto":
            return DTYPES[self.precision], f"impl.precision={self.precision}"
        if device.type == "cuda":
            if torch.cuda.is_bf16_supported():
                return torch.bfloat16, "auto: the GPU supports bf16"
            return torch.float16, "auto: the GPU has no bf16, fp16 with a loss scaler"
        native, how = cpu_bf16_support()
        if native:
            return torch.bfloat16, f"auto: the CPU computes bf16 natively ({how})"
        return torch.float32, f"auto: the CPU has no native bf16 ({how}), where bf16 is slower than fp32"


def cpu_bf16_support() -> tuple[bool, str]:
    """(whether this CPU has native bf16 dot products, which instructions), as PyTorch's CPU dispatch sees
    them: AVX-512 BF16 or AMX tiles on x86-64, the BF16 extension on Arm. Without them PyTorch emulates bf16
    through fp32, which makes a training step slower than plain fp32 (results/step-speed/cpu-tiny.md)."""
    found = []
    cpu = getattr(torch, "cpu", None)
    for name, probe in (("avx512_bf16", "_is_avx512_bf16_supported"), ("amx", "_is_amx_tile_supported")):
        check = getattr(cpu, probe, None)
        try:
            if check is not None and check():
                found.append(name)
        except RuntimeError:  # a build without the probe's backend
            pass
    arm = platform.machine().lower() in ("aarch64", "arm64")
    if not found and arm and arm_bf16_flag():
        found.append("bf16")
    if found:
        return True, ", ".join(found)
    return False, "neither avx512_bf16 nor amx" + (", nor Arm bf16" if arm else "")


def arm_bf16_flag() -> bool:
    """Whether /proc/cpuinfo lists Arm's BF16 extension (Linux)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.lower().startswith("features") and "bf16" in line.split(":", 1)[1].split():
                return True
    except OSError:
        pass
    return False


# glibc's mallopt parameters (malloc.h)
M_TRIM_THRESHOLD = -1
M_MMAP_MAX = -4


def keep_freed_memory() -> tuple[bool, str]:
    """(whether it applied, what it did or why not): glibc's malloc told to serve every block from its heap
    (M_MMAP_MAX 0: no block gets a mapping of its own, which free() would unmap and the next malloc() map and
    fault in again) and to give back no heap top under 2 GiB (M_TRIM_THRESHOLD). Freed blocks are then reused
    as they are. Other C libraries (musl, macOS) are left alone. Idempotent."""
    name, version = platform.libc_ver()
    if name != "glibc":
        return False, f"the C library is {name}, not glibc" if name else "the C library is not glibc"
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return False, "glibc's mallopt could not be loaded"
    mallopt.argtypes, mallopt.restype = (ctypes.c_int, ctypes.c_int), ctypes.c_int
    if mallopt(M_MMAP_MAX, 0) != 1 or mallopt(M_TRIM_THRESHOLD, 2**31 - 1) != 1:
        return False, f"glibc {version} refused the settings"
    return True, f"glibc {version} keeps freed memory for reuse (impl.keep_freed_memory)"
