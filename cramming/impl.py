"""Typed configuration of the `impl` group: how fast, never what.

An `impl` setting may change rounding (precision, kernels) but never what is computed: a run with another
`impl` is the same experiment. That is why none of it feeds the data-cache hash or the run's identity.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import torch

from cramming.errors import check_choice, config_error
from cramming.model.ops import ATTENTION, FFN_ACTIVATION, LAYERNORM, LOSS

DEVICES = ("auto", "cpu", "cuda")
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


@dataclass
class ImplConfig:
    # auto: cuda when available, else cpu; "cuda:1" picks a GPU
    device: str = "auto"
    # auto: bf16 on GPUs that support it, else fp16 with a loss scaler; fp32 on CPU
    precision: str = "auto"
    # torch.compile the model: true, false, or auto (on for CUDA, off on CPU); compile time counts against
    # the budget. Typed Any so it takes a bool or "auto" (OmegaConf has no unions); checked below
    compile: Any = "auto"
    attention: str = "sdpa"
    layernorm: str = "torch"
    # the gated FFN's gate * gelu(value) (arch.ffn=glu only): PyTorch, or one fused Triton kernel each way
    ffn_activation: str = "torch"
    # the MLM cross-entropy: PyTorch on an fp32 copy of the logits, or the Triton kernel reading them as they are
    loss: str = "torch"
    # fail instead of falling back to PyTorch when a Triton kernel cannot launch
    strict_kernels: bool = False
    # sequences per forward/backward pass; the recipe's batch size is reached by accumulation. auto: searched
    # at start-up for the most tokens/s that fits, on the budget's clock, cached per device and model shape
    # in {base_dir}/autobatch.json (cramming.train.autobatch); set-up replaces it by the number chosen.
    # Typed Any so it takes a number or "auto"; checked below
    microbatch_size: Any = 128
    # DataLoader worker processes during training
    num_workers: int = 2
    # PyTorch intra-op threads when training on CPU (None: PyTorch's default, one per core); on a CPU shared
    # with other jobs, 1 can be several times faster than contending for every core
    cpu_threads: int | None = None
    # processes for preprocessing maps (None: all cores)
    num_proc: int | None = None
    # how the processes of a torchrun launch share the model (ignored in a single process): ddp replicates
    # it and all-reduces gradients; fsdp2 shards parameters, gradients and optimizer state (fully_shard;
    # train.optim.name=adamw only)
    distributed: str = "ddp"

    def __post_init__(self) -> None:
        check_choice("impl.device", self.device.split(":")[0], DEVICES)
        check_choice("impl.precision", self.precision, ("auto", *DTYPES))
        check_choice("impl.attention", self.attention, ATTENTION)
        check_choice("impl.layernorm", self.layernorm, LAYERNORM)
        # impl.distributed is checked against the parallelism registry by PretrainConfig (cramming/config.py):
        # this low-level module does not import the training stack
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
        """The autocast dtype: `auto` is bf16 on GPUs that support it, else fp16 (with a loss scaler); fp32 on CPU."""
        if self.precision != "auto":
            return DTYPES[self.precision]
        if device.type != "cuda":
            return torch.float32
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
