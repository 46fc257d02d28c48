"""Time the Triton kernels against PyTorch at BERT shapes and write a markdown table.

    python scripts/bench/bench_kernels.py              # GPU: batch 128, 12 heads, seq 128 and 512, head_dim 64, bf16
    python scripts/bench/bench_kernels.py --sweep      # also time a few attention tile sizes
    python scripts/bench/bench_kernels.py --smoke      # CPU: tiny shapes in the Triton interpreter (timings meaningless)

Attention: ours (with and without a key-padding mask) against SDPA's flash backend (the reference; it
takes no mask), SDPA's memory-efficient backend with the mask, and eager PyTorch. Attention with ALiBi
(arch.attention_bias=alibi, slopes 4^-h): ours, the bias computed in the kernel from the slopes, against
the model's SDPA path, which builds the dense (heads, seq, seq) float bias on every call (the reference). LayerNorm against
F.layer_norm; gated GELU against `gate * F.gelu(value)`; cross-entropy against
`F.cross_entropy(logits.float(), labels)` at the sparse MLM head's shape (batch x 32 masked rows, vocab 32768).

Times are medians of CUDA-event timings after warm-up, forward alone and forward + backward; speed-ups are
against the reference measured in the same run. Peak memory is the allocator's peak during one forward +
backward above what was allocated before it. Attention FLOPs count 4·B·H·S²·D forward and 2.5× that
backward (five matmuls), the usual convention whatever a kernel recomputes; the other kernels are rated
by the bytes they must move.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import torch
import torch.nn.functional as F

REPO = Path(__file__).resolve().parents[2]
CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"
if not CUDA:
    # must precede the first import of a kernel module: triton reads it then
    os.environ.setdefault("TRITON_INTERPRET", "1")

from cramming.kernels import triton_status  # noqa: E402

INTERPRETER_WARNING = (
    "NO GPU: this ran in the Triton interpreter on CPU at tiny shapes, as a smoke check of the script. "
    "Its timings mean nothing."
)
Row = list  # [name, fwd seconds, fwd+bwd seconds, fwd rate, fwd+bwd rate, peak MiB]


def timeit(fn: Callable[[], object], reps: int, warmup: int) -> float:
    """Median seconds of one call of fn."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        if CUDA:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        else:
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


def peak_memory(fn: Callable[[], object]) -> float:
    """MiB allocated at the peak of one call above what was allocated before it (0 on CPU)."""
    if not CUDA:
        return 0.0
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    fn()
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - before) / 2**20


def measure(name: str, forward, inputs, grad_out, work: tuple[float, float], args) -> Row | None:
    """Time forward() alone and with the backward to `inputs`; work = (forward, forward+backward) units."""

    def fwd():
        with torch.no_grad():
            return forward()

    def fwd_bwd():
        return torch.autograd.grad(forward(), inputs, grad_out)

    try:
        t_fwd, t_all = timeit(fwd, args.reps, args.warmup), timeit(fwd_bwd, args.reps, args.warmup)
        mem = peak_memory(fwd_bwd)
    except Exception as err:  # a backend that refuses the shape, a tile that does not compile: report, go on
        print(
            f"  {name}: skipped ({type(err).__name__}: {str(err).splitlines()[0][:160] if str(err) else ''})"
        )
        return None
    print(f"  {name}: fwd {t_fwd * 1e3:.3f} ms, fwd+bwd {t_all * 1e3:.3f} ms, peak {mem:.0f} MiB")
    return [name, t_fwd, t_all, work[0] / t_fwd, work[1] / t_all, mem]


def table(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    return "\n".join(lines + ["| " + " | ".join(row) + " |" for row in rows])


def section(title: str, note: str, rows: list[Row], reference: str, unit: str) -> list[str]:
    ref = next((r for r in rows if r[0].startswith(reference)), None)
    header = ["implementation", "fwd ms", "fwd+bwd ms", f"fwd {unit}", f"fwd+bwd {unit}", "peak MiB"]
    header += ["fwd speed-up vs reference", "fwd+bwd speed-up vs reference"]
    body = []
    for name, t_fwd, t_all, r_fwd, r_all, mem in rows:
        cells = [
            name,
            f"{t_fwd * 1e3:.3f}",
            f"{t_all * 1e3:.3f}",
            f"{r_fwd:.1f}",
            f"{r_all:.1f}",
            f"{mem:.0f}",
        ]
        body.append(cells + ([f"{ref[1] / t_fwd:.2f}×", f"{ref[2] / t_all:.2f}×"] if ref else ["n/a", "n/a"]))
    return [f"## {title}", "", note, "", table(header, body), ""]


# ---------------------------------------------------------------------------------------------------
# The benchmarks


def eager_attention(q, k, v, mask):
    """Attention as a model writes it without a fused kernel: matmuls in the input dtype, softmax in fp32."""
    scores = (q @ k.transpose(-1, -2)) * q.shape[-1] ** -0.5  # (batch, heads, seq, seq)
    scores = scores.masked_fill(~mask[:, None, None, :], torch.finfo(scores.dtype).min)
    return torch.softmax(scores.float(), dim=-1).to(q.dtype) @ v


def attention_inputs(seq: int, args) -> tuple[torch.Tensor, ...]:
    """q, k, v (batch, heads, seq, head_dim) with gradients, an upstream gradient, and the padding mask of a
    fine-tuning batch: lengths spread between a quarter of the sequence and all of it."""
    shape = (args.batch, args.heads, seq, args.head_dim)
    q, k, v = (
        torch.randn(shape, device=DEVICE, dtype=args.torch_dtype, requires_grad=True) for _ in range(3)
    )
    do = torch.randn_like(q)
    lengths = torch.randint(seq // 4 + 1, seq + 1, (args.batch,), device=DEVICE)
    mask = torch.arange(seq, device=DEVICE)[None, :] < lengths[:, None]
    return q, k, v, do, mask


def bench_attention(seq: int, args) -> list[Row]:
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from cramming.kernels.attention import flash_attention

    q, k, v, do, mask = attention_inputs(seq, args)

    def sdpa(backend, attn_mask=None):
        def run():
            with sdpa_kernel(backend):
                return F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask)

        return run

    impls = {}
    if CUDA:
        impls["SDPA flash, no mask (reference)"] = sdpa(SDPBackend.FLASH_ATTENTION)
        impls["SDPA mem-efficient, padding mask"] = sdpa(
            SDPBackend.EFFICIENT_ATTENTION, mask[:, None, None, :]
        )
    impls["triton (ours), no mask"] = lambda: flash_attention(q, k, v)
    impls["triton (ours), padding mask"] = lambda: flash_attention(q, k, v, mask)
    impls["eager PyTorch, padding mask"] = lambda: eager_attention(q, k, v, mask)
    flops = 4 * args.batch * args.heads * seq * seq * args.head_dim / 1e12
    rows = [measure(name, fn, (q, k, v), do, (flops, 3.5 * flops), args) for name, fn in impls.items()]
    return [r for r in rows if r is not None]


def bench_attention_alibi(seq: int, args) -> list[Row]:
    """ALiBi as the model runs it: `ops.sdpa_attention` (dense float bias, built per call) against the
    fused kernel given the slopes, without and with a padding mask."""
    from cramming.kernels.attention import flash_attention
    from cramming.model.ops import sdpa_attention

    q, k, v, do, mask = attention_inputs(seq, args)
    slopes = torch.tensor([4.0**-h for h in range(args.heads)], device=DEVICE)
    impls = {
        "SDPA, ALiBi float bias (reference)": lambda: sdpa_attention(q, k, v, None, 0.0, slopes),
        "SDPA, ALiBi float bias + padding mask": lambda: sdpa_attention(q, k, v, mask, 0.0, slopes),
        "triton (ours), ALiBi": lambda: flash_attention(q, k, v, alibi_slopes=slopes),
        "triton (ours), ALiBi + padding mask": lambda: flash_attention(q, k, v, mask, alibi_slopes=slopes),
    }
    flops = 4 * args.batch * args.heads * seq * seq * args.head_dim / 1e12
    rows = [measure(name, fn, (q, k, v), do, (flops, 3.5 * flops), args) for name, fn in impls.items()]
    return [r for r in rows if r is not None]


def sweep_attention(seq: int, args) -> list[list[str]]:
    """Forward + backward time of a few tile configurations (no mask), best first."""
    from cramming.kernels.attention import _FlashAttention, attention_tiles

    shape = (args.batch, args.heads, seq, args.head_dim)
    q, k, v = (
        torch.randn(shape, device=DEVICE, dtype=args.torch_dtype, requires_grad=True) for _ in range(3)
    )
    do = torch.randn_like(q)
    cc = torch.cuda.get_device_capability() if CUDA else None
    base = attention_tiles(seq, args.head_dim, args.torch_dtype, cc, dropout=False)
    cap = max(16, 1 << (seq - 1).bit_length())
    candidates = [base]
    for fwd_m, fwd_n, warps in ((64, 64, 4), (128, 64, 8), (128, 128, 8)):
        candidates.append(replace(base, fwd_m=min(fwd_m, cap), fwd_n=min(fwd_n, cap), fwd_warps=warps))
    for bwd_m, bwd_n, warps in ((32, 128, 4), (64, 128, 4), (32, 64, 4), (64, 64, 4)):
        candidates.append(replace(base, bwd_m=min(bwd_m, cap), bwd_n=min(bwd_n, cap), bwd_warps=warps))
    candidates += [replace(base, stages=1), replace(base, stages=3)]
    results = []
    for blocks in dict.fromkeys(candidates):  # in order, without repeats
        label = (
            f"fwd {blocks.fwd_m}×{blocks.fwd_n} w{blocks.fwd_warps}, dK/dV {blocks.bwd_m}×{blocks.bwd_n} "
            f"w{blocks.bwd_warps}, dQ {blocks.dq_m}×{blocks.dq_n} w{blocks.dq_warps}, stages {blocks.stages}"
        )
        fn = lambda blocks=blocks: _FlashAttention.apply(q, k, v, None, 0.0, args.head_dim**-0.5, blocks)  # noqa: E731
        row = measure(label + (" (default)" if blocks == base else ""), fn, (q, k, v), do, (1, 1), args)
        if row is not None:
            results.append(row)
    results.sort(key=lambda r: r[2])
    return [[r[0], f"{r[1] * 1e3:.3f}", f"{r[2] * 1e3:.3f}"] for r in results]


def bench_layernorm(rows_count: int, args) -> list[Row]:
    from cramming.kernels.layernorm import layer_norm

    x = torch.randn(rows_count, args.hidden, device=DEVICE, dtype=args.torch_dtype, requires_grad=True)
    dy = torch.randn_like(x)
    w_low = torch.ones(args.hidden, device=DEVICE, dtype=args.torch_dtype, requires_grad=True)
    w_fp32 = torch.ones(args.hidden, device=DEVICE, dtype=torch.float32, requires_grad=True)
    low = str(args.torch_dtype).removeprefix("torch.")
    # forward reads x and writes y; backward reads x and dy and writes dx
    gb = rows_count * args.hidden * x.element_size() / 1e9
    impls = {  # F.layer_norm wants one dtype (under autocast it runs in fp32 instead)
        f"F.layer_norm (reference), weight {low}": (
            lambda: F.layer_norm(x, (args.hidden,), w_low, None, 1e-12),
            w_low,
        ),
        f"triton (ours), weight {low}": (lambda: layer_norm(x, w_low), w_low),
        "triton (ours), weight float32": (lambda: layer_norm(x, w_fp32), w_fp32),
    }
    rows = [measure(name, fn, (x, w), dy, (2 * gb, 5 * gb), args) for name, (fn, w) in impls.items()]
    return [r for r in rows if r is not None]


def bench_glu(rows_count: int, args) -> list[Row]:
    from cramming.kernels.glu import gated_gelu

    width = 4 * args.hidden  # the up-projection's 2 x 1536 for hidden 768
    h = torch.randn(rows_count, width, device=DEVICE, dtype=args.torch_dtype, requires_grad=True)
    dy = torch.randn(rows_count, width // 2, device=DEVICE, dtype=args.torch_dtype)

    def eager():
        gate, value = h.chunk(2, dim=-1)
        return gate * F.gelu(value)

    # forward reads 2F and writes F; backward reads 2F and dy (F) and writes 2F
    gb = rows_count * width // 2 * h.element_size() / 1e9
    impls = {"gate * F.gelu(value) (reference)": eager, "triton (ours)": lambda: gated_gelu(h)}
    rows = [measure(name, fn, (h,), dy, (3 * gb, 8 * gb), args) for name, fn in impls.items()]
    return [r for r in rows if r is not None]


def bench_cross_entropy(rows_count: int, args) -> list[Row]:
    from cramming.kernels.cross_entropy import cross_entropy

    logits = torch.randn(rows_count, args.vocab, device=DEVICE, dtype=args.torch_dtype, requires_grad=True)
    labels = torch.randint(0, args.vocab, (rows_count,), device=DEVICE)
    # forward reads the logits; backward reads them and writes their gradient
    gb = rows_count * args.vocab * logits.element_size() / 1e9
    impls = {
        "F.cross_entropy(logits.float()) (reference)": lambda: F.cross_entropy(logits.float(), labels),
        "triton (ours)": lambda: cross_entropy(logits, labels),
    }
    rows = [measure(name, fn, (logits,), None, (gb, 3 * gb), args) for name, fn in impls.items()]
    return [r for r in rows if r is not None]


# ---------------------------------------------------------------------------------------------------


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--batch", type=int, default=128)
    parser.add_argument("--heads", type=int, default=12)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--seqs", type=int, nargs="+", default=[128, 512])
    parser.add_argument("--hidden", type=int, default=768, help="LayerNorm width; the GLU input is 4x")
    parser.add_argument("--vocab", type=int, default=32768)
    parser.add_argument(
        "--masked-per-seq", type=int, default=32, help="rows of the sparse MLM head per sequence"
    )
    parser.add_argument("--dtype", choices=["bf16", "fp16", "fp32"], default="bf16")
    parser.add_argument("--reps", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--sweep", action="store_true", help="also time a few attention tile sizes")
    parser.add_argument("--smoke", action="store_true", help="tiny shapes, few repetitions (the CPU default)")
    parser.add_argument(
        "--out", type=Path, default=None, help="markdown file (default results/kernels/<gpu>.md)"
    )
    return parser.parse_args()


def smoke_shapes(args: argparse.Namespace) -> None:
    """--smoke, or no GPU: tiny shapes and few repetitions."""
    args.batch, args.heads, args.head_dim, args.seqs = 2, 2, 32, [33]
    args.hidden, args.vocab, args.masked_per_seq, args.reps, args.warmup = 96, 1000, 4, 2, 1
    args.dtype = "fp16" if args.dtype == "bf16" else args.dtype  # the interpreter gets bf16 wrong


def header(gpu: str, args: argparse.Namespace) -> list[str]:
    import triton

    lines = [f"# Kernel benchmarks: {gpu}", ""]
    if not CUDA:
        print(INTERPRETER_WARNING)
        lines += [f"**{INTERPRETER_WARNING}**", ""]
    lines += [
        f"torch {torch.__version__}, triton {triton.__version__}, {args.dtype}; medians of {args.reps} runs "
        f"after {args.warmup} warm-up runs; written by `scripts/bench/bench_kernels.py`.",
        "",
    ]
    return lines


def attention_sections(seq: int, args: argparse.Namespace) -> list[str]:
    """Attention without and with ALiBi at one sequence length, and the tile sweep with --sweep."""
    attention_ref = "SDPA flash" if CUDA else "eager"
    title = f"Attention, batch {args.batch}, {args.heads} heads, seq {seq}, head_dim {args.head_dim}"
    print(title)
    note = "The padding mask gives each sequence a random length between a quarter and all of the sequence."
    lines = section(title, note, bench_attention(seq, args), attention_ref, "TFLOP/s")
    title = (
        f"Attention with ALiBi, batch {args.batch}, {args.heads} heads, seq {seq}, head_dim {args.head_dim}"
    )
    print(title)
    note = (
        "Slopes 4^-h (the default). SDPA gets the dense (heads, seq, seq) bias as a float mask (with padding "
        "also the most negative float on padded keys), built on every call as in the model; the kernel "
        "gets the slopes. Same random lengths as above."
    )
    lines += section(title, note, bench_attention_alibi(seq, args), "SDPA, ALiBi", "TFLOP/s")
    if args.sweep:
        print(f"attention tile sweep, seq {seq}")
        lines += [f"### Tile sweep, seq {seq}, no mask, fastest forward + backward first", ""]
        lines += [table(["tiles", "fwd ms", "fwd+bwd ms"], sweep_attention(seq, args)), ""]
    return lines


def row_kernel_sections(args: argparse.Namespace) -> list[str]:
    """LayerNorm at each sequence length, gated GELU at the first, cross-entropy at the MLM head's rows."""
    lines = []
    for seq in args.seqs:
        rows_count = args.batch * seq
        title = f"LayerNorm, {rows_count} rows (batch {args.batch} × seq {seq}) × {args.hidden}, no bias"
        print(title)
        lines += section(
            title, "Rated by the bytes moved.", bench_layernorm(rows_count, args), "F.layer_norm", "GB/s"
        )
    rows_count = args.batch * args.seqs[0]
    title = f"Gated GELU, {rows_count} rows × {4 * args.hidden} → {2 * args.hidden}"
    print(title)
    lines += section(title, "Rated by the bytes moved.", bench_glu(rows_count, args), "gate", "GB/s")
    rows_count = args.batch * args.masked_per_seq
    title = f"Cross-entropy, {rows_count} rows (batch {args.batch} × {args.masked_per_seq} masked) × vocab {args.vocab}"
    print(title)
    note = "The logits are a leaf here; in the model they come from the decoder matmul in the same dtype."
    lines += section(title, note, bench_cross_entropy(rows_count, args), "F.cross_entropy", "GB/s")
    return lines


def main() -> int:
    args = parse_args()
    ok, why = triton_status()
    if not ok:
        print(f"Triton cannot launch here: {why}", file=sys.stderr)
        return 1
    if args.smoke or not CUDA:
        smoke_shapes(args)
    args.torch_dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[args.dtype]
    gpu = torch.cuda.get_device_name() if CUDA else "cpu-interpreter"

    lines = header(gpu, args)
    for seq in args.seqs:
        lines += attention_sections(seq, args)
    lines += row_kernel_sections(args)

    if not CUDA and args.out is None:  # a smoke check: nothing worth keeping under results/
        print("\n".join(lines))
        return 0
    out_path = args.out or REPO / "results" / "kernels" / f"{gpu.lower().replace(' ', '-')}.md"
    out_path.parent.mkdir(parents=True, exist_ok=True)
    out_path.write_text("\n".join(lines))
    print(f"wrote {out_path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
