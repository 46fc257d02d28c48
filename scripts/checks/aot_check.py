"""Compile every Triton kernel for real NVIDIA GPUs without one: registers, spills, shared memory.

    python scripts/checks/aot_check.py                       # full grid -> results/kernels/aot.md (~15 min, 1 core)
    python scripts/checks/aot_check.py --subset              # the part tests/test_kernels_aot.py checks
    python scripts/checks/aot_check.py --targets 86 --kernels attention --dtypes bf16 --out -

Each kernel is compiled (`triton.compile` of an `ASTSource`, for a `GPUTarget`) with exactly the tiles,
warps and stages its launcher picks for the shapes our configs use, through the same pure functions the
launchers call (`attention_tiles`, `layer_norm_tiles`, `glu_tiles`, `cross_entropy_tiles`), and with the
argument specialization the JIT would give the model's tensors (pointer alignment, integers divisible by
16, integers equal to 1). ptxas from the triton wheel reports registers and spill stores per kernel; the
shared memory is Triton's own allocation (`metadata.shared`), compared with the per-block opt-in limit.

Identical compiles (e.g. a forward kernel whose tiles do not depend on the sequence length) are done once
and reported on every row that uses them. Exit status 1 when any kernel spills or exceeds shared memory.
Needs triton with its NVIDIA backend, and torch (CPU is enough) to import the kernel modules.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import os
import re
import sys
import tempfile
import time
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

# Maximum shared memory per block (opt-in), bytes: CUDA C++ Programming Guide, "Technical Specifications per
# Compute Capability" (8.0: 163 KB, 8.6: 99 KB, 8.9: 99 KB, 9.0: 227 KB).
SHARED_LIMIT = {80: 163 * 1024, 86: 99 * 1024, 89: 99 * 1024, 90: 227 * 1024}
TARGET_NAMES = {80: "sm_80 (A100)", 86: "sm_86 (A10/3090)", 89: "sm_89 (L4/4090)", 90: "sm_90 (H100/H200)"}
DTYPES = ("bf16", "fp16", "fp32")

# Attention shapes: (hidden, heads); head_dim = hidden / heads. Crammed BERT is 768/12 (head_dim 64);
# 1024/8 covers head_dim 128. Other hidden sizes with the same head_dim give the same compile unless the
# head count becomes a multiple of 16 (then H is specialized as divisible by 16).
ATTENTION_SHAPES = ((768, 12), (1024, 8))
SEQS = (128, 512)
HIDDENS = (768, 1024)  # LayerNorm widths; the GLU's output is 2 * hidden (intermediate 4 * hidden, halved)
VOCAB = 32768
SUBSET = dict(targets=(86, 90), dtypes=("bf16",))


@dataclass
class Compile:
    """One kernel launch as the launcher makes it: the values it passes and the options it sets."""

    kernel: str
    shape: str
    fn: object  # triton JITFunction
    args: dict[str, object]  # every non-constexpr argument by name: a torch tensor, int or float
    constexprs: dict[str, object]
    options: dict[str, object] = field(default_factory=dict)


@dataclass
class Result:
    kernel: str
    target: int
    dtype: str
    shape: str
    tiles: str
    registers: int | None = None
    spill_stores: int | None = None
    spill_loads: int | None = None
    shared: int | None = None
    seconds: float | None = None
    error: str | None = None
    function: str = ""  # the @triton.jit function's name, to match the kernels a real GPU run compiles
    warps: int = 4
    stages: int = 3

    @property
    def ok(self) -> bool:
        return (
            self.error is None
            and self.spill_stores == 0
            and self.spill_loads == 0
            and self.shared is not None
            and self.shared <= SHARED_LIMIT[self.target]
        )


# ----------------------------------------------------------------------------------------------------
# The launches, kernel by kernel


def _torch_dtype(name: str):
    import torch

    return {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[name]


def attention_launches(dtype: str, cc: int) -> Iterator[Compile]:
    """The forward, preprocess, dK/dV and dQ launches of `kernels/attention.py` for the model's layout:
    q, k, v views into a fused (batch, seq, 3, heads, head_dim) projection; outputs (batch, seq, heads, d);
    with and without a padding mask, dropout and the ALiBi slopes (arch.attention_bias=alibi)."""
    import torch

    tdtype = _torch_dtype(dtype)
    for hidden, heads in ATTENTION_SHAPES:
        head_dim = hidden // heads
        for seq in SEQS:
            qkv = torch.empty(2, seq, 3, heads, head_dim, dtype=tdtype)
            q, k, v = qkv.permute(2, 0, 3, 1, 4).unbind(0)  # (batch, heads, seq, head_dim) views
            out = torch.empty(2, seq, heads, head_dim, dtype=tdtype).transpose(1, 2)
            lse = torch.empty(2, heads, seq, dtype=torch.float32)
            kpm = torch.ones(2, seq, dtype=torch.uint8)
            slopes = torch.ones(heads, dtype=torch.float32)
            tensors = dict(
                Q=q, K=k, V=v, KPM=kpm, OUT=out, DO=out, DQ=out, DK=out, DV=out, LSE=lse, DELTA=lse
            )
            for alibi in (False, True):
                for has_kpm in (False, True):
                    for dropout in (False, True):
                        case = {**tensors, "KPM": kpm if has_kpm else q, "SLOPES": slopes if alibi else q}
                        yield from _attention_case(
                            dtype, cc, case, seq, heads, head_dim, has_kpm, dropout, alibi
                        )


def _attention_strides(tensors: dict, seq: int, has_kpm: bool) -> dict[str, int]:
    """The launchers' stride arguments: (batch, head, seq) strides of q, k, v, out (dO, dQ, dK, dV alike)."""
    strides = {}
    for prefix, name in (("sq", "Q"), ("sk", "K"), ("sv", "V"), ("so", "OUT"), ("sdo", "DO")):
        t = tensors[name]
        strides.update({f"{prefix}_b": t.stride(0), f"{prefix}_h": t.stride(1), f"{prefix}_s": t.stride(2)})
    for prefix in ("sdq", "sdk", "sdv"):
        strides.update({f"{prefix}_{x}": strides[f"so_{x}"] for x in "bhs"})
    strides["skpm_b"] = seq if has_kpm else 0
    return strides


def _attention_case(
    dtype: str,
    cc: int,
    tensors: dict,
    seq: int,
    heads: int,
    head_dim: int,
    has_kpm: bool,
    dropout: bool,
    alibi: bool,
) -> Iterator[Compile]:
    """The kernels one attention call launches (forward and backward) with the launcher's tiles."""
    from cramming.kernels import attention as A

    tiles = A.attention_tiles(seq, head_dim, _torch_dtype(dtype), divmod(cc, 10), dropout, alibi)
    shape = f"seq {seq}, d {head_dim}, {heads} heads" + (", padding mask" if has_kpm else "")
    shape += (", dropout" if dropout else "") + (", ALiBi" if alibi else "")
    flags = dict(
        HAS_KPM=has_kpm, HAS_ALIBI=alibi, DROPOUT=dropout, IEEE=dtype == "fp32", BLOCK_D=A.block_d(head_dim)
    )
    scalars = dict(H=heads, S=seq, D=head_dim, dropout_p=0.1 if dropout else 0.0, seed=12345)
    values = {**tensors, **_attention_strides(tensors, seq, has_kpm), **scalars}
    yield Compile(
        "attention fwd",
        shape,
        A._attention_fwd_kernel,
        _pick(A._attention_fwd_kernel, {**values, "qk_scale": 0.18}),
        {**flags, "BLOCK_M": tiles.fwd_m, "BLOCK_N": tiles.fwd_n},
        dict(num_warps=tiles.fwd_warps, num_stages=tiles.stages),
    )
    if not has_kpm and not dropout and not alibi:  # the preprocess kernel takes none of them
        yield Compile(
            "attention bwd preprocess",
            f"seq {seq}, d {head_dim}, {heads} heads",
            A._attention_bwd_preprocess_kernel,
            _pick(A._attention_bwd_preprocess_kernel, values),
            dict(BLOCK_M=A.PREPROCESS_BLOCK_M, BLOCK_D=A.block_d(head_dim)),
        )
    fused_dq = seq <= tiles.bwd_n
    bwd_values = {**values, "sm_scale": 0.125, "qk_scale": 0.18}
    yield Compile(
        "attention bwd dK/dV" + (" (+dQ)" if fused_dq else ""),
        shape,
        A._attention_bwd_dkdv_kernel,
        _pick(A._attention_bwd_dkdv_kernel, bwd_values),
        {**flags, "FUSED_DQ": fused_dq, "BLOCK_M": tiles.bwd_m, "BLOCK_N": tiles.bwd_n},
        dict(num_warps=tiles.bwd_warps, num_stages=tiles.stages),
    )
    if not fused_dq:
        yield Compile(
            "attention bwd dQ",
            shape,
            A._attention_bwd_dq_kernel,
            _pick(A._attention_bwd_dq_kernel, bwd_values),
            {**flags, "BLOCK_M": tiles.dq_m, "BLOCK_N": tiles.dq_n},
            dict(num_warps=tiles.dq_warps, num_stages=tiles.stages),
        )


def layer_norm_launches(dtype: str, cc: int) -> Iterator[Compile]:
    import torch
    import triton

    from cramming.kernels import layernorm as L

    tdtype = _torch_dtype(dtype)
    for width in HIDDENS:
        block_m, block_n, warps = L.layer_norm_tiles(width, on_gpu=True)
        x = torch.empty(4, width, dtype=tdtype)
        weight = torch.empty(width, dtype=torch.float32)  # fp32 master weights under autocast
        stats = torch.empty(4, dtype=torch.float32)
        for has_bias in (False, True):
            shape = f"hidden {width}" + (", bias" if has_bias else "")
            # 128 x 128 rows, split over 4 programs per SM of a 132-SM H100 as the backward's launcher does
            rows = 128 * 128
            rows_per_program = block_m * triton.cdiv(triton.cdiv(rows, 4 * 132), block_m)
            common = dict(X=x, W=weight, B=weight, Y=x, DX=x, DY=x, MEAN=stats, RSTD=stats, M=rows)
            common.update(sx_m=width, sdy_m=width, N=width, eps=1e-12, rows_per_program=rows_per_program)
            common.update(DW_PART=stats, DB_PART=stats)
            constexprs = dict(HAS_BIAS=has_bias, BLOCK_M=block_m, BLOCK_N=block_n)
            for name, fn in (
                ("layernorm fwd", L._layer_norm_fwd_kernel),
                ("layernorm bwd", L._layer_norm_bwd_kernel),
            ):
                yield Compile(name, shape, fn, _pick(fn, common), constexprs, dict(num_warps=warps))


def glu_launches(dtype: str, cc: int) -> Iterator[Compile]:
    import torch

    from cramming.kernels import glu as G

    tdtype = _torch_dtype(dtype)
    for hidden in HIDDENS:
        width = 2 * hidden  # intermediate 4 * hidden = [gate | value]
        block, warps = G.glu_tiles(width)
        h = torch.empty(4, 2 * width, dtype=tdtype)
        args = dict(H=h, Y=h, DY=h, DH=h, sh_m=2 * width, sdy_m=width, F=width)
        for name, fn in (("gated GELU fwd", G._glu_fwd_kernel), ("gated GELU bwd", G._glu_bwd_kernel)):
            yield Compile(
                name,
                f"intermediate {2 * width}",
                fn,
                _pick(fn, args),
                dict(BLOCK=block),
                dict(num_warps=warps),
            )


def cross_entropy_launches(dtype: str, cc: int) -> Iterator[Compile]:
    import torch

    from cramming.kernels import cross_entropy as C

    tdtype = _torch_dtype(dtype)
    block_v, warps = C.cross_entropy_tiles(VOCAB)
    logits = torch.empty(4, VOCAB, dtype=tdtype)
    rows = torch.empty(4, dtype=torch.float32)
    args = dict(LOGITS=logits, DLOGITS=logits, LABELS=torch.empty(4, dtype=torch.int64), LOSS=rows, LSE=rows)
    args.update(SCALE=rows, sl_n=VOCAB, V=VOCAB, ignore_index=-100)
    for name, fn in (
        ("cross-entropy fwd", C._cross_entropy_fwd_kernel),
        ("cross-entropy bwd", C._cross_entropy_bwd_kernel),
    ):
        yield Compile(
            name, f"vocab {VOCAB}", fn, _pick(fn, args), dict(BLOCK_V=block_v), dict(num_warps=warps)
        )


def adamw8bit_launches(dtype: str, cc: int) -> Iterator[Compile]:
    """The 8-bit AdamW update, with its launcher's own options (cramming.kernels.adamw8bit.LAUNCH)."""
    import torch

    from cramming.kernels import adamw8bit as Q

    tdtype = _torch_dtype(dtype)
    param = torch.empty(4096, dtype=tdtype)
    codes = torch.empty(4096, dtype=torch.uint8)
    fp32 = torch.empty(256, dtype=torch.float32)
    args = dict(param_ptr=param, grad_ptr=param, m_codes_ptr=codes, v_codes_ptr=codes, n=768 * 3072)
    args.update({name: fp32 for name in ("m_absmax_ptr", "v_absmax_ptr", "m_map_ptr", "v_map_ptr")})
    scalars = (
        "beta1",
        "one_minus_beta1",
        "beta2",
        "one_minus_beta2",
        "eps",
        "decay",
        "step_size",
        "bias2_sqrt",
    )
    args.update({name: 0.5 for name in scalars})
    fn = Q._adamw8bit_update_kernel
    for sqrt_v in (True, False):  # the default second-moment map (sqrt) and the v maps (nonzero, dynamic)
        constexprs = dict(QBLOCK=Q.QBLOCK, BLOCKS_PER_PROGRAM=Q.BLOCKS_PER_PROGRAM, SQRT_V=sqrt_v)
        yield Compile(
            "8-bit AdamW",
            f"768 x 3072 weight, {'sqrt(v)' if sqrt_v else 'v'} codes",
            fn,
            _pick(fn, args),
            constexprs,
            dict(Q.LAUNCH),
        )


KERNELS: dict[str, Callable[[str, int], Iterator[Compile]]] = {
    "attention": attention_launches,
    "layernorm": layer_norm_launches,
    "glu": glu_launches,
    "cross_entropy": cross_entropy_launches,
    "adamw8bit": adamw8bit_launches,
}


def _pick(fn, values: dict[str, object]) -> dict[str, object]:
    """The kernel's non-constexpr arguments, in order, from a pool of values by name."""
    return {p.name: values[p.name] for p in fn.params if not p.is_constexpr}


# ----------------------------------------------------------------------------------------------------
# Compiling


def _specialize(launch: Compile):
    """(signature, constexprs, attrs) as the JIT builds them for these argument values."""
    from triton._C.libtriton import native_specialize_impl
    from triton.backends.compiler import BaseBackend

    signature, constexprs, attrs = {}, {}, {}
    for index, param in enumerate(launch.fn.params):
        if param.is_constexpr:
            signature[param.name] = "constexpr"
            constexprs[param.name] = launch.constexprs[param.name]
            continue
        value = launch.args[param.name]
        kind, spec = native_specialize_impl(
            BaseBackend, value, False, not param.do_not_specialize, not param.do_not_specialize_on_alignment
        )
        signature[param.name] = kind
        if kind == "constexpr":  # an integer equal to 1
            constexprs[param.name] = spec
        elif isinstance(spec, str) and spec:
            attrs[(index,)] = BaseBackend.parse_attr(spec)
    return signature, constexprs, attrs


_PTXAS = {
    "registers": re.compile(r"Used (\d+) registers"),
    "spill_stores": re.compile(r"(\d+) bytes spill stores"),
    "spill_loads": re.compile(r"(\d+) bytes spill loads"),
}


def compile_one(launch: Compile, cc: int, dtype: str) -> Result:
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    tiles = ", ".join(f"{k} {v}" for k, v in launch.constexprs.items() if k.startswith("BLOCK"))
    tiles += f", warps {launch.options.get('num_warps', 4)}, stages {launch.options.get('num_stages', 3)}"
    result = Result(launch.kernel, cc, dtype, launch.shape, tiles, function=launch.fn.__name__)
    result.warps, result.stages = launch.options.get("num_warps", 4), launch.options.get("num_stages", 3)
    signature, constexprs, attrs = _specialize(launch)
    source = ASTSource(fn=launch.fn, signature=signature, constexprs=constexprs, attrs=attrs)
    log = io.StringIO()
    start = time.perf_counter()
    try:
        with contextlib.redirect_stdout(log):  # triton prints the ptxas log with dump_ptxas_log on
            compiled = triton.compile(source, target=GPUTarget("cuda", cc, 32), options=dict(launch.options))
    except Exception as err:  # a compile error is a result to report, not a crash of the whole grid
        result.error = f"{type(err).__name__}: {str(err).strip().splitlines()[0] if str(err).strip() else ''}"
        return result
    result.seconds = time.perf_counter() - start
    result.shared = int(compiled.metadata.shared)
    text = log.getvalue()
    for name, pattern in _PTXAS.items():
        found = pattern.findall(text)
        setattr(result, name, max(int(x) for x in found) if found else None)
    if result.registers is None:
        result.error = "no ptxas report (was the kernel cached? run with a fresh TRITON_CACHE_DIR)"
    return result


def run(kernels: list[str], targets: list[int], dtypes: list[str], progress=None) -> list[Result]:
    """Compile the grid; identical launches are compiled once and their result copied to each row."""
    from triton import knobs

    knobs.nvidia.dump_ptxas_log = True  # read back from stdout by compile_one
    results, done = [], {}
    for cc in targets:
        for dtype in dtypes:
            for kernel in kernels:
                if kernel == "adamw8bit" and dtype == "fp16":
                    continue  # the optimizer keeps fp32 or bf16 parameters
                for launch in KERNELS[kernel](dtype, cc):
                    signature, constexprs, attrs = _specialize(launch)
                    key = (launch.fn.__name__, cc, repr(sorted(signature.items())), repr(sorted(constexprs.items())),
                           repr(sorted(attrs.items())), repr(sorted(launch.options.items())))  # fmt: skip
                    if key in done:
                        cached = done[key]
                        row = replace(
                            cached, kernel=launch.kernel, dtype=dtype, shape=launch.shape, seconds=None
                        )
                    else:
                        row = done[key] = compile_one(launch, cc, dtype)
                        if progress:
                            progress(row)
                    results.append(row)
    knobs.nvidia.dump_ptxas_log = False
    return results


# ----------------------------------------------------------------------------------------------------
# Report


def markdown(results: list[Result], command: str, versions: str, wall: float) -> str:
    bad = [r for r in results if not r.ok]
    compiles = [r for r in results if r.seconds is not None]
    lines = [
        "# Ahead-of-time kernel compilation (no GPU)",
        "",
        f"`{command}` with {versions}: {len(results)} rows, {len(compiles)} distinct compiles in {wall:.0f} s.",
        "Registers and spill bytes are ptxas's report (`-v`) for the cubin Triton builds; shared memory is",
        "Triton's allocation per block against the target's opt-in limit "
        + ", ".join(f"{TARGET_NAMES[cc]} {lim // 1024} KB" for cc, lim in SHARED_LIMIT.items())
        + ". Compile time is blank where the row reuses an identical compile.",
        "",
        f"**{len(bad)} of {len(results)} rows spill, exceed shared memory or fail to compile.**",
        "",
        "| kernel | target | dtype | shape | tiles | registers | spill st/ld (B) | shared (KB) | compile (s) |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        if r.error:
            lines.append(
                f"| {r.kernel} | sm_{r.target} | {r.dtype} | {r.shape} | {r.tiles} | **{r.error}** | | | |"
            )
            continue
        spill = f"{r.spill_stores}/{r.spill_loads}"
        shared = f"{r.shared / 1024:.1f} / {SHARED_LIMIT[r.target] // 1024}"
        mark = lambda text, bad: f"**{text}**" if bad else text  # noqa: E731
        lines.append(
            f"| {r.kernel} | sm_{r.target} | {r.dtype} | {r.shape} | {r.tiles} | {r.registers} | "
            f"{mark(spill, r.spill_stores or r.spill_loads)} | {mark(shared, r.shared > SHARED_LIMIT[r.target])} | "
            f"{'' if r.seconds is None else f'{r.seconds:.1f}'} |"
        )
    return "\n".join(lines) + "\n"


def launch_every_kernel_on_gpu() -> None:
    """Run every launcher forward and backward on the GPU at the shapes above (bf16), so each kernel the
    model would use is compiled by the real toolchain."""
    import torch

    from cramming.kernels import attention as A
    from cramming.kernels import cross_entropy as C
    from cramming.kernels import glu as G
    from cramming.kernels import layernorm as L

    device = torch.device("cuda")
    dtype = torch.bfloat16
    for hidden, heads in ATTENTION_SHAPES:
        for seq in SEQS:
            qkv = torch.randn(
                2, seq, 3, heads, hidden // heads, device=device, dtype=dtype, requires_grad=True
            )
            q, k, v = qkv.permute(2, 0, 3, 1, 4).unbind(0)
            slopes = torch.tensor([4.0**-h for h in range(heads)], device=device)
            for alibi in (None, slopes):
                for mask in (None, torch.ones(2, seq, device=device, dtype=torch.bool)):
                    for dropout in (0.0, 0.1):
                        out = A.flash_attention(q, k, v, mask, dropout, alibi_slopes=alibi)
                        out.transpose(1, 2).reshape(2, seq, hidden).sum().backward()
    for width in HIDDENS:
        x = torch.randn(128 * 128, width, device=device, dtype=dtype, requires_grad=True)
        weight = torch.ones(width, device=device, requires_grad=True)
        for bias in (None, torch.zeros(width, device=device, requires_grad=True)):
            L.layer_norm(x, weight, bias).sum().backward()
        h = torch.randn(256, 4 * width, device=device, dtype=dtype, requires_grad=True)
        G.gated_gelu(h).sum().backward()
    logits = torch.randn(64, VOCAB, device=device, dtype=dtype, requires_grad=True)
    C.cross_entropy(logits, torch.randint(0, VOCAB, (64,), device=device)).backward()
    torch.cuda.synchronize()


def gpu_comparison(aot: list[Result]) -> str:
    """On a CUDA device: run the real launchers (bf16, the shapes above), read the registers and spills the
    driver reports for every kernel Triton compiled (`n_regs`, `n_spills` = local memory bytes per
    thread), and set them beside the AOT rows of the same function, warps, stages and shared memory."""
    import torch

    from cramming.kernels import attention as A
    from cramming.kernels import cross_entropy as C
    from cramming.kernels import glu as G
    from cramming.kernels import layernorm as L

    launch_every_kernel_on_gpu()

    functions = [
        A._attention_fwd_kernel, A._attention_bwd_preprocess_kernel, A._attention_bwd_dkdv_kernel,
        A._attention_bwd_dq_kernel, L._layer_norm_fwd_kernel, L._layer_norm_bwd_kernel,
        G._glu_fwd_kernel, G._glu_bwd_kernel, C._cross_entropy_fwd_kernel, C._cross_entropy_bwd_kernel,
    ]  # fmt: skip
    cc = torch.cuda.get_device_capability()
    lines = [
        f"## AOT against the real build: {torch.cuda.get_device_name()} (sm_{cc[0]}{cc[1]}), bf16",
        "",
        "Every kernel the launchers compiled on this GPU at the shapes above; registers and local (spill)",
        "bytes per thread as the driver reports them, beside the AOT rows of the same function, warps,",
        "stages and shared memory (blank: no AOT row has that configuration: the launcher picked tiles",
        "aot_check does not know).",
        "",
        "| function | warps | stages | shared (B) | GPU registers | GPU spill (B) | AOT registers | AOT spill st/ld (B) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for fn in functions:
        seen = set()
        for cache in fn.device_caches.values():
            for compiled in cache[0].values():
                meta = compiled.metadata
                key = (fn.__name__, meta.num_warps, meta.num_stages, meta.shared)
                if key in seen:
                    continue
                seen.add(key)
                same = [r for r in aot if (r.function, r.warps, r.stages, r.shared) == key and not r.error]
                regs = "/".join(sorted({str(r.registers) for r in same}))
                spills = "/".join(sorted({f"{r.spill_stores}/{r.spill_loads}" for r in same}))
                flag = "**" if compiled.n_spills or not same else ""
                lines.append(
                    f"| {fn.__name__} | {meta.num_warps} | {meta.num_stages} | {meta.shared} | {compiled.n_regs} | "
                    f"{flag}{compiled.n_spills}{flag} | {regs} | {spills} |"
                )
    return "\n".join(lines) + "\n"


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--kernels", nargs="+", choices=list(KERNELS), default=list(KERNELS))
    parser.add_argument(
        "--targets", nargs="+", type=int, choices=list(SHARED_LIMIT), default=list(SHARED_LIMIT)
    )
    parser.add_argument("--dtypes", nargs="+", choices=DTYPES, default=list(DTYPES))
    parser.add_argument("--subset", action="store_true", help=f"only {SUBSET} (what the test compiles)")
    parser.add_argument(
        "--out", default=str(REPO / "results" / "kernels" / "aot.md"), help="markdown path, - for stdout"
    )
    parser.add_argument("--quiet", action="store_true")
    parser.add_argument(
        "--compare-gpu",
        action="store_true",
        help="also run the launchers on this CUDA device and compare its compiled kernels with the AOT rows",
    )
    args = parser.parse_args(argv)
    if args.subset:
        args.targets, args.dtypes = list(SUBSET["targets"]), list(SUBSET["dtypes"])
    return args


def print_progress(r: Result) -> None:
    """One line per distinct compile, as it finishes."""
    status = r.error or f"{r.registers} regs, spill {r.spill_stores}/{r.spill_loads} B, {r.shared} B shared"
    print(
        f"sm_{r.target} {r.dtype} {r.kernel} [{r.shape}] {r.tiles}: {status} ({r.seconds or 0:.1f} s)",
        flush=True,
    )


def write_report(text: str, out: str) -> None:
    if out == "-":
        print(text)
    else:
        Path(out).parent.mkdir(parents=True, exist_ok=True)
        Path(out).write_text(text)
        print(f"wrote {out}")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)

    # A compile found in Triton's cache runs no ptxas, so no report: compile into a fresh cache. The
    # interpreter would replace the kernels by Python functions that cannot be compiled.
    cache = tempfile.TemporaryDirectory(prefix="aot-check-")
    os.environ["TRITON_CACHE_DIR"] = cache.name
    os.environ["TRITON_INTERPRET"] = "0"
    warnings.filterwarnings("ignore", message="TRITON_DEFAULT_FP_FUSION")
    import torch
    import triton

    start = time.perf_counter()
    with cache:
        results = run(args.kernels, args.targets, args.dtypes, None if args.quiet else print_progress)
        wall = time.perf_counter() - start
        comparison = gpu_comparison(results) if args.compare_gpu else ""
    command = "python scripts/checks/aot_check.py " + " ".join(argv if argv is not None else sys.argv[1:])
    versions = f"triton {triton.__version__}, torch {torch.__version__}"
    text = markdown(results, command.strip(), versions, wall)
    if comparison:
        text += "\n" + comparison
    write_report(text, args.out)
    bad = [r for r in results if not r.ok]
    print(f"{len(bad)} of {len(results)} rows spill, exceed shared memory or fail")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
