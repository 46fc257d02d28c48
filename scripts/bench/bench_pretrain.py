"""Throughput, FLOP/s and MFU of full training steps: our model against Hugging Face BertForMaskedLM.

    python scripts/bench/bench_pretrain.py --data outputs/data/local-<hash>           # CPU, a small crammed shape
    python scripts/bench/bench_pretrain.py --arch crammed-bert --microbatch 128 --compile  # CUDA, bf16
    python scripts/bench/bench_pretrain.py --data outputs/data/local-<hash> --arch bert-tiny \
        --set attention_bias=alibi --microbatch 64 --threads 1 --workers 0 \
        --precision fp32,bf16 --baseline                 # the CPU study's step, in both precisions

One step is what the training loop does for an update of one micro-batch: take the next micro-batch from
the real data path (RowStream/DataLoader of cramming.train.batches, then the MLM masking and the copy to
the device), forward, backward, gradient clipping, AdamW step. Reported per model: sequences/s, tokens/s,
model FLOPs per token (cramming.model.flops: matmuls only, the prediction head counted only for the
positions it runs on: the masked ones for our sparse prediction, every position for BertForMaskedLM),
achieved FLOP/s, MFU against the peak measured in the same run (the median of a square matmul in the
training dtype, the best round), peak memory, and the share of step time spent in the data path.

Hugging Face's model gets the closest shape: same depth, width, heads, vocabulary and sequence; a plain GELU
FFN of 3/4 our GLU width (equal FFN FLOPs and parameters); its usual post-LN, biases, token types, learned
positions, head transform and dense prediction; SDPA attention and dropout off like ours. Both models run
the same optimizer settings on the same batches.

`--precision fp32,bf16` measures both models in each precision (bf16: autocast, fp32 master weights, as the
training loop runs it), and the header names the CPU's native bf16 support (cramming.impl.cpu_bf16_support)
and what impl.precision=auto picks there. `--baseline` adds our step as it was before the CPU speed work
(fp32, the ALiBi bias as the 3-D mask that sent SDPA to its unfused math path, the loss on an fp32 copy of
the logits): the reference that speed-ups are reported against, measured in the same rounds. `--ablate`
adds, in each precision, our step with one of the two earlier paths put back, to measure each change alone.
`--with-compiled` adds, in each precision, our step under torch.compile (compiled in the warm-up steps), for
`impl.compile` on a CPU, where `auto` leaves it off.

The machine may be shared: the models and the peak matmul are measured in interleaved rounds, and the
ratio ours / HF is taken per round (the median over rounds is reported), so load that comes and goes hits
both alike. Rows come from a processed data folder (--data) when `datasets` is installed, else from random
token rows with the same interface (the GPU machine has no `datasets`). Peak memory: on CUDA the
allocator's peak during a model's steps, less what the other model holds; on CPU the peak resident memory
of a child process that builds the one model and runs two steps, less the same process before building it.
The data-path share is host time: exact on CPU; on CUDA the GPU works through queued kernels meanwhile, so
it is an upper bound there.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path

import numpy as np
import torch

from cramming.config import arch_preset
from cramming.impl import ImplConfig, cpu_bf16_support
from cramming.model import ArchConfig, build_model, count_parameters
from cramming.model.flops import forward_flops_per_token, train_flops_per_token
from cramming.model.ops import ATTENTION, alibi_bias
from cramming.optim import OptimConfig, build_optimizer
from cramming.optim.step import TrainStep
from cramming.train.batches import microbatches
from cramming.train.config import MLMConfig
from cramming.train.mlm import MLMMasker, MLMObjective

REPO = Path(__file__).resolve().parents[2]

SPECIAL = (0, 1, 2, 3, 4)  # [PAD] [UNK] [CLS] [SEP] [MASK], as every tokenizer of the pipeline places them
MASK_ID = 4
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def closest_hf_shape(arch: ArchConfig) -> ArchConfig:
    """Our ArchConfig describing BertForMaskedLM of the closest shape (for its FLOP count)."""
    width = arch.intermediate_size * 3 // 4 if arch.ffn == "glu" else arch.intermediate_size
    return replace(
        arch,
        name="hf-bert",
        intermediate_size=width,
        ffn="gelu",
        norm_scheme="post",
        bias=True,
        position_embedding="learned",
        type_vocab_size=2,
        final_norm=False,
        head_transform=True,
        decoder_bias=True,
        sparse_prediction=False,
    )


class TokenRows:
    """Random token rows with the interface RowStream reads from a datasets.Dataset."""

    def __init__(self, num_rows: int, seq_length: int, vocab_size: int, seed: int = 0):
        rng = np.random.default_rng(seed)
        self.ids = rng.integers(len(SPECIAL), vocab_size, size=(num_rows, seq_length), dtype=np.int32)

    def with_format(self, *args, **kwargs) -> TokenRows:
        return self

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, indices) -> dict:
        return {"input_ids": self.ids[indices]}


def load_rows(args: argparse.Namespace) -> tuple[object, int, str]:
    """(training rows, vocabulary size, description)."""
    if args.data:
        from cramming.data import load_pretraining_data

        data = load_pretraining_data(args.data)
        if data.seq_length != args.seq:
            raise SystemExit(f"--data has rows of {data.seq_length} tokens; pass --seq {data.seq_length}")
        return data.train, data.vocab_size, f"`{args.data}` ({len(data.train):,} rows)"
    return TokenRows(8192, args.seq, args.vocab), args.vocab, "random token rows"


@dataclass
class Candidate:
    name: str
    kind: str  # ours | hf | baseline (both earlier paths, fp32) | old-attention | old-loss (one earlier path)
    precision: str  # fp32 | bf16 | fp16
    params: int
    flops_per_token: float  # training step
    step: Callable[[torch.Tensor, torch.Tensor], None]  # (corrupted ids, labels) on the device
    optimizer: torch.optim.Optimizer
    own_bytes: int = 0  # parameters, gradients and optimizer state
    seconds: list[float] = field(default_factory=list)  # per round: seconds per step
    data_seconds: list[float] = field(default_factory=list)  # per round: seconds per step in the data path
    peak_bytes: float | None = None


def make_step(model, optimizer, device: torch.device, dtype: torch.dtype, forward) -> Callable:
    """One update of the training loop's own step (cramming.optim.step), clipping at the recipe's 0.5."""
    train_step = TrainStep(model, optimizer, device_type=device.type, dtype=dtype, grad_clip=0.5)

    def step(corrupted: torch.Tensor, labels: torch.Tensor) -> None:
        train_step.begin()
        train_step.microbatch(lambda: (forward(corrupted, labels),))
        train_step.apply()

    return step


def build_ours(
    arch: ArchConfig, vocab: int, args: argparse.Namespace, device: torch.device, dtype, kind="ours"
) -> Candidate:
    model = build_model(
        arch, vocab, device=device, attention=args.attention, layernorm=args.layernorm,
        ffn_activation=args.ffn_activation, loss=args.loss, dropout=0.0,
    )  # fmt: skip
    use_earlier_paths(
        model, attention=kind in ("baseline", "old-attention"), loss=kind in ("baseline", "old-loss")
    )
    optimizer = build_optimizer(model, OptimConfig())
    runner = torch.compile(model) if args.compile or kind == "compiled" else model
    k = MLMMasker(MLMConfig(), 10, SPECIAL, MASK_ID).predicted_per_row(args.seq)  # static sparse prediction
    step = make_step(
        model, optimizer, device, dtype, lambda ids, labels: runner(ids, labels, predicted_per_row=k).loss
    )
    flops = train_flops_per_token(arch, vocab, args.seq, predicted_fraction=masked_fraction(args.seq))
    precision = PRECISION_NAMES[dtype]
    name = {
        "ours": f"ours ({arch.name})",
        "baseline": f"ours before the CPU speed work ({arch.name})",
        "old-attention": f"ours, ALiBi as a 3-D mask as before ({arch.name})",
        "old-loss": f"ours, the loss on an fp32 copy as before ({arch.name})",
        "compiled": f"ours, torch.compile ({arch.name})",
    }[kind]
    return Candidate(name, kind, precision, count_parameters(model), flops, step, optimizer)


def baseline_sdpa(q, k, v, key_padding_mask=None, dropout_p: float = 0.0, alibi_slopes=None):
    """cramming.model.ops.sdpa_attention as it was: the ALiBi bias as a 3-D (heads, seq, seq) mask."""
    mask = None if key_padding_mask is None else key_padding_mask[:, None, None, :]
    if alibi_slopes is not None:
        bias = alibi_bias(alibi_slopes, q.shape[-2]).to(q.dtype)
        mask = bias if mask is None else bias.masked_fill(~mask, torch.finfo(q.dtype).min)
    return torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout_p)


def baseline_cross_entropy(logits, labels, ignore_index: int = -100):
    """The loss as it was: F.cross_entropy on an fp32 copy of the logits, also on CPU."""
    return torch.nn.functional.cross_entropy(logits.float(), labels, ignore_index=ignore_index)


def use_earlier_paths(model: torch.nn.Module, attention: bool, loss: bool) -> None:
    """Our model with code paths from before the CPU speed work put back (the same function, same weights)."""
    for module in model.modules():
        if attention and getattr(module, "fn", None) is ATTENTION["sdpa"]:
            module.fn = baseline_sdpa
    if loss:
        model.loss_fn = baseline_cross_entropy


def build_hf(
    arch: ArchConfig, vocab: int, args: argparse.Namespace, device: torch.device, dtype
) -> Candidate:
    from transformers import BertConfig, BertForMaskedLM

    shape = closest_hf_shape(arch)
    config = BertConfig(
        vocab_size=vocab,
        hidden_size=shape.hidden_size,
        num_hidden_layers=shape.num_layers,
        num_attention_heads=shape.num_heads,
        intermediate_size=shape.intermediate_size,
        hidden_act="gelu",
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
        max_position_embeddings=max(args.seq, 512),
        layer_norm_eps=shape.norm_eps,
    )
    config._attn_implementation = "sdpa"
    model = BertForMaskedLM(config).to(device)
    optimizer = build_optimizer(model, OptimConfig())  # the same AdamW settings and parameter groups
    runner = torch.compile(model) if args.compile else model
    step = make_step(
        model, optimizer, device, dtype, lambda ids, labels: runner(input_ids=ids, labels=labels).loss
    )
    flops = train_flops_per_token(shape, vocab, args.seq, predicted_fraction=1.0)
    precision = PRECISION_NAMES[dtype]
    return Candidate("HF BertForMaskedLM", "hf", precision, count_parameters(model), flops, step, optimizer)


PRECISION_NAMES = {dtype: name for name, dtype in DTYPES.items()}
BUILDERS = {
    "ours": build_ours,
    "hf": build_hf,
    "baseline": lambda *a: build_ours(*a, kind="baseline"),
    "old-attention": lambda *a: build_ours(*a, kind="old-attention"),
    "old-loss": lambda *a: build_ours(*a, kind="old-loss"),
    "compiled": lambda *a: build_ours(*a, kind="compiled"),
}


def precisions(args: argparse.Namespace) -> list[str]:
    chosen = [p.strip() for p in args.precision.split(",") if p.strip()]
    unknown = [p for p in chosen if p not in DTYPES]
    if not chosen or unknown:
        raise SystemExit(
            f"--precision {args.precision}: use one or more of {', '.join(DTYPES)}, comma-separated"
        )
    return chosen


def masked_fraction(seq: int) -> float:
    return MLMMasker(MLMConfig(), 10, SPECIAL, MASK_ID).num_masked(seq) / seq


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def run_steps(candidate: Candidate, batches, masker, device, steps: int) -> tuple[float, float]:
    """(seconds per step, seconds per step in the data path) over `steps` steps."""
    sync(device)
    data_seconds = 0.0
    start = time.perf_counter()
    for _ in range(steps):
        fetch = time.perf_counter()
        ids = next(batches)
        corrupted, labels = masker(ids, torch.arange(ids.shape[0]))
        if device.type == "cuda":
            corrupted, labels = corrupted.pin_memory(), labels.pin_memory()
        corrupted = corrupted.to(device, non_blocking=True)
        labels = labels.to(device, non_blocking=True)
        data_seconds += time.perf_counter() - fetch
        candidate.step(corrupted, labels)
    sync(device)
    return (time.perf_counter() - start) / steps, data_seconds / steps


def peak_matmul(device: torch.device, dtype: torch.dtype, size: int, reps: int = 5) -> float:
    """FLOP/s of a size x size matmul in the training dtype (median of reps)."""
    a = torch.randn(size, size, device=device).to(dtype)
    b = torch.randn(size, size, device=device).to(dtype)
    times = []
    for _ in range(reps + 1):
        sync(device)
        start = time.perf_counter()
        a @ b
        sync(device)
        times.append(time.perf_counter() - start)
    return 2 * size**3 / statistics.median(times[1:])


def memory_status(field: str) -> int:
    """A field of /proc/self/status in bytes: VmRSS (resident now) or VmHWM (peak resident)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise KeyError(field)


def probe_memory(args: argparse.Namespace) -> None:
    """Child process (CPU): build one model, run two steps, print its peak resident memory above the start."""
    kind, _, precision = args.probe.partition(":")
    device, dtype = torch.device("cpu"), DTYPES[precision]
    rows, vocab, _ = load_rows(args)
    arch = arch_preset(args.arch, args.set)
    base = memory_status("VmRSS")
    Path("/proc/self/clear_refs").write_text("5")  # resets VmHWM to the current resident size
    candidate = BUILDERS[kind](arch, vocab, args, device, dtype)
    masker = MLMMasker(MLMConfig(), vocab, SPECIAL, MASK_ID)
    batches = iter(microbatches(rows, args.microbatch, 0, 0, num_workers=0, pin_memory=False))
    run_steps(candidate, batches, masker, device, 2)
    print(json.dumps({"peak_bytes": memory_status("VmHWM") - base}))


def cpu_peak_memory(which: str) -> float | None:
    """which: kind:precision of one candidate."""
    command = [sys.executable, *sys.argv, "--probe", which]
    done = subprocess.run(command, capture_output=True, text=True, cwd=REPO)
    if done.returncode != 0:
        print(f"memory probe of {which} failed:\n{done.stderr[-2000:]}", file=sys.stderr)
        return None
    return json.loads(done.stdout.strip().splitlines()[-1])["peak_bytes"]


def own_bytes(optimizer: torch.optim.Optimizer) -> int:
    """Parameters, gradients and optimizer state of the model an optimizer trains."""
    total = 0
    for group in optimizer.param_groups:
        for p in group["params"]:
            total += 2 * p.numel() * p.element_size()
            total += sum(
                t.numel() * t.element_size() for t in optimizer.state[p].values() if torch.is_tensor(t)
            )
    return total


def build_candidates(arch: ArchConfig, vocab: int, args: argparse.Namespace, device) -> list[Candidate]:
    """The baseline (with --baseline), then per precision: ours, ours compiled (--with-compiled), the
    ablations (--ablate) and HF."""
    candidates = [BUILDERS["baseline"](arch, vocab, args, device, torch.float32)] if args.baseline else []
    for precision in precisions(args):
        dtype = DTYPES[precision]
        candidates.append(build_ours(arch, vocab, args, device, dtype))
        if args.with_compiled:
            candidates.append(BUILDERS["compiled"](arch, vocab, args, device, dtype))
        if args.ablate:
            candidates += [
                BUILDERS[k](arch, vocab, args, device, dtype) for k in ("old-attention", "old-loss")
            ]
        if not args.no_hf:
            candidates.append(build_hf(arch, vocab, args, device, dtype))
    return candidates


def run_rounds(candidates: list[Candidate], batches, masker, device, args: argparse.Namespace) -> dict:
    """Interleaved rounds of the peak matmul in each precision and each candidate's steps (with its CUDA
    peak memory); returns precision -> the peak FLOP/s of each round."""
    peaks = {p: [] for p in {c.precision for c in candidates}}
    for _ in range(args.rounds):
        for precision, measured in peaks.items():
            measured.append(peak_matmul(device, DTYPES[precision], args.matmul))
        for c in candidates:
            if device.type == "cuda":
                before = torch.cuda.memory_allocated(device)
                torch.cuda.reset_peak_memory_stats(device)
            seconds, data_seconds = run_steps(c, batches, masker, device, args.steps)
            c.seconds.append(seconds)
            c.data_seconds.append(data_seconds)
            if (
                device.type == "cuda"
            ):  # its own persistent memory (and the batch), plus its step's transient peak
                resident = before - sum(o.own_bytes for o in candidates if o is not c)
                c.peak_bytes = max(
                    c.peak_bytes or 0, torch.cuda.max_memory_allocated(device) - before + resident
                )
    return peaks


def profile_ours(candidates: list[Candidate], batches, masker, device, steps: int) -> tuple[str, Candidate]:
    """A torch.profiler table of `steps` of our steps in the last precision asked for, and that candidate."""
    activities = [torch.profiler.ProfilerActivity.CPU]
    if device.type == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    profiled = [c for c in candidates if c.kind == "ours"][-1]  # the last precision asked for
    with torch.profiler.profile(activities=activities) as prof:
        run_steps(profiled, batches, masker, device, steps)
    sort = "self_device_time_total" if device.type == "cuda" else "self_cpu_time_total"
    return prof.key_averages().table(sort_by=sort, row_limit=15, max_name_column_width=60), profiled


def measure(args: argparse.Namespace) -> dict:
    device = torch.device(args.device)
    rows, vocab, rows_note = load_rows(args)
    arch = arch_preset(args.arch, args.set)
    candidates = build_candidates(arch, vocab, args, device)
    masker = MLMMasker(MLMConfig(), vocab, SPECIAL, MASK_ID)
    batches = iter(
        microbatches(rows, args.microbatch, 0, 0, num_workers=args.workers, pin_memory=device.type == "cuda")
    )
    for c in candidates:  # warm-up: lazy optimizer state, compilation, loader workers
        run_steps(c, batches, masker, device, args.warmup)
        c.own_bytes = own_bytes(c.optimizer)
    peaks = run_rounds(candidates, batches, masker, device, args)
    if device.type == "cpu" and not args.no_memory:
        for c in candidates:
            c.peak_bytes = cpu_peak_memory(f"{c.kind}:{c.precision}")
    profile = profiled = None
    if args.profile:
        profile, profiled = profile_ours(candidates, batches, masker, device, args.profile)
    return {
        "candidates": candidates,
        "peak": {precision: max(measured) for precision, measured in peaks.items()},
        "rows": rows_note,
        "arch": arch,
        "vocab": vocab,
        "profile": profile,
        "profiled": profiled.precision if profile else None,
    }


def per_round_ratio(faster: Candidate, slower: Candidate) -> tuple[float, list[float]]:
    """tokens/s of `faster` over `slower`: the median of per-round ratios, and the ratios."""
    ratios = [b / a for a, b in zip(faster.seconds, slower.seconds, strict=True)]
    return statistics.median(ratios), ratios


def cpu_bf16_line(device: torch.device) -> str:
    native, how = cpu_bf16_support()
    auto, why = ImplConfig(precision="auto").precision_choice(device)
    support = f"native bf16 ({how})" if native else f"no native bf16 ({how})"
    return f" CPU: {support}; impl.precision=auto picks {PRECISION_NAMES[auto]} here ({why})."


def report_header(result: dict, args: argparse.Namespace) -> list[str]:
    """The title, the settings paragraph and the head of the table."""
    peaks, arch = result["peak"], result["arch"]
    device = torch.device(args.device)
    device_name = (
        torch.cuda.get_device_name()
        if args.device.startswith("cuda")
        else f"CPU, {torch.get_num_threads()} thread(s)"
    )
    peak_text = ", ".join(f"{p} {v / 1e12:.3f} TFLOP/s" for p, v in sorted(peaks.items()))
    return [
        f"# Training-step throughput: {device_name}",
        "",
        f"`python scripts/bench/bench_pretrain.py {' '.join(sys.argv[1:])}`, {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())},"
        f" torch {torch.__version__}. Arch `{args.arch}`{' with ' + ', '.join(args.set) if args.set else ''}:"
        f" {arch.num_layers} layers, hidden {arch.hidden_size}, {arch.num_heads} heads, FFN {arch.intermediate_size}"
        f" ({arch.ffn}); vocabulary {result['vocab']}, micro-batch {args.microbatch} x {args.seq} tokens,"
        f" {args.precision}, compile {'on' if args.compile else 'off'}, attention {args.attention},"
        f" LayerNorm {args.layernorm}, FFN activation {args.ffn_activation}, loss {args.loss},"
        f" {args.workers} loader worker(s); rows: {result['rows']}."
        f" {args.rounds} interleaved rounds of {args.steps} steps after {args.warmup} warm-up steps; medians over"
        f" rounds. Peak: a {args.matmul}x{args.matmul} matmul in each precision, best round: {peak_text}."
        + (cpu_bf16_line(device) if device.type == "cpu" else ""),
        "",
        "| model | precision | parameters | seq/s | tokens/s | model GFLOP/token | achieved TFLOP/s | MFU | peak memory | data path |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]


def report_row(c: Candidate, peaks: dict[str, float], args: argparse.Namespace) -> str:
    tokens = args.microbatch * args.seq
    seconds = statistics.median(c.seconds)
    flops = c.flops_per_token * tokens / seconds
    memory = f"{c.peak_bytes / 2**20:,.0f} MiB" if c.peak_bytes else "n/a"
    data_share = statistics.median(d / s for d, s in zip(c.data_seconds, c.seconds, strict=True))
    return (
        f"| {c.name} | {c.precision} | {c.params / 1e6:.1f}M | {args.microbatch / seconds:,.1f} |"
        f" {tokens / seconds:,.0f} | {c.flops_per_token / 1e9:.4f} | {flops / 1e12:.4f} |"
        f" {100 * flops / peaks[c.precision]:.1f}% | {memory} | {100 * data_share:.2f}% |"
    )


def ratio_line(label: str, faster: Candidate, slower: Candidate, flops: bool = False) -> str:
    ratio, ratios = per_round_ratio(faster, slower)
    text = f"- {label}, median of per-round ratios: **tokens/s {ratio:.2f}x**"
    if flops:
        text += f", **FLOP/s {ratio * faster.flops_per_token / slower.flops_per_token:.2f}x**"
    return text + f" (per round: {', '.join(f'{r:.2f}' for r in ratios)})."


def ratio_lines(candidates: list[Candidate], args: argparse.Namespace) -> list[str]:
    """Ours / HF, bf16 / fp32, compiled / eager, each earlier path alone, and ours against the baseline, where
    measured."""
    lines = []
    by = {(c.kind, c.precision): c for c in candidates}
    for precision in precisions(args):
        if ("hf", precision) in by:
            lines.append(
                ratio_line(f"Ours / HF in {precision}", by["ours", precision], by["hf", precision], True)
            )
    for kind, label in (("ours", "Ours"), ("hf", "HF")):
        if (kind, "bf16") in by and (kind, "fp32") in by:
            lines.append(ratio_line(f"{label} bf16 / {label} fp32", by[kind, "bf16"], by[kind, "fp32"]))
    for precision in precisions(args):
        if ("compiled", precision) in by:
            lines.append(
                ratio_line(
                    f"Ours compiled / ours in {precision}", by["compiled", precision], by["ours", precision]
                )
            )
        for kind, change in (("old-attention", "the 4-D ALiBi mask"), ("old-loss", "the block-wise loss")):
            if (kind, precision) in by:
                lines.append(
                    ratio_line(f"{change} alone, in {precision}", by["ours", precision], by[kind, precision])
                )
    if ("baseline", "fp32") in by:
        for precision in precisions(args):
            lines.append(
                ratio_line(
                    f"Ours in {precision} / ours before the CPU speed work (fp32)",
                    by["ours", precision],
                    by["baseline", "fp32"],
                )
            )
    return lines


def report(result: dict, args: argparse.Namespace) -> str:
    candidates, peaks, arch = result["candidates"], result["peak"], result["arch"]
    parts = forward_flops_per_token(arch, result["vocab"], args.seq, masked_fraction(args.seq))
    lines = report_header(result, args)
    lines += [report_row(c, peaks, args) for c in candidates]
    lines.append("")
    lines += ratio_lines(candidates, args)
    lines += [
        "",
        f"Model FLOPs per token of ours, forward: attention {parts['attention'] / 1e6:.2f}M (projections and the"
        f" two S x S products), FFN {parts['ffn'] / 1e6:.2f}M, head {parts['head'] / 1e6:.2f}M (on the"
        f" {100 * masked_fraction(args.seq):.0f}% masked positions only: sparse prediction); a training step counts"
        " 3x the forward. HF's head runs on every position. Matmuls only (cramming/model/flops.py).",
    ]
    if result["profile"]:
        lines += [
            "",
            f"## torch.profiler: {args.profile} of our steps in {result['profiled']}, top operators by self time",
            "",
            "```",
        ]
        lines += [result["profile"].rstrip(), "```"]
    return "\n".join(lines) + "\n"


def autobatch_report(args: argparse.Namespace) -> str:
    """What impl.microbatch_size=auto does for this arch here: its trials and its choice (a fresh search)."""
    import tempfile

    from cramming.train import autobatch

    device, dtype = torch.device(args.device), DTYPES[precisions(args)[0]]
    arch = arch_preset(args.arch, args.set)
    model = build_model(
        arch, args.vocab, device=device, attention=args.attention, layernorm=args.layernorm, dropout=0.0
    )
    masker = MLMMasker(MLMConfig(), args.vocab, SPECIAL, MASK_ID)
    with tempfile.TemporaryDirectory() as tmp:
        cache = Path(tmp) / autobatch.CACHE_FILE
        chosen = autobatch.choose_microbatch(
            model,
            MLMObjective(masker, device, masker.predicted_per_row(args.seq)),
            dtype,
            args.seq,
            cache_path=cache,
            most=8192,
            time_limit=args.search_seconds,
        )
        ((key, record),) = json.loads(cache.read_text()).items()
    lines = [
        f"# impl.microbatch_size=auto: {key}",
        "",
        f"`python scripts/bench/bench_pretrain.py {' '.join(sys.argv[1:])}`, {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}:"
        f" forward + backward (eager) at seq {args.seq}, vocabulary {args.vocab}; search {record['search_seconds']} s"
        f" (limit {args.search_seconds:g} s). Chosen: **{chosen}**.",
        "",
        "| micro-batch | tokens/s | note |",
        "|---:|---:|---|",
    ]
    for t in record["trials"]:
        rate = f"{t['seq_per_s'] * args.seq:,.0f}" if t["seq_per_s"] else ""
        lines.append(f"| {t['microbatch']} | {rate} | {t['note']} |")
    return "\n".join(lines) + "\n"


def add_model_arguments(parser: argparse.ArgumentParser, cuda: bool) -> None:
    """What is timed: the shape, the data, the precisions, the candidates beside ours and the kernels."""
    parser.add_argument("--arch", default="crammed-bert", help="a name in conf/arch")
    parser.add_argument(
        "--set", nargs="*", default=None, help="arch overrides key=value (CPU default: a small shape)"
    )
    parser.add_argument("--microbatch", type=int, default=128 if cuda else 32)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--vocab", type=int, default=32768, help="with random rows; --data sets its own")
    parser.add_argument(
        "--data", default=None, help="a processed data folder, e.g. outputs/data/local-<hash>"
    )
    parser.add_argument("--device", default="cuda" if cuda else "cpu")
    parser.add_argument(
        "--precision",
        default="bf16" if cuda else "fp32",
        help="fp32, bf16 or fp16, or several comma-separated (fp32,bf16): each model in each",
    )
    parser.add_argument(
        "--baseline", action="store_true", help="also our step as it was before the CPU speed work (fp32)"
    )
    parser.add_argument(
        "--ablate", action="store_true", help="also ours with one earlier path put back, each precision"
    )
    parser.add_argument("--compile", action="store_true", help="torch.compile both models")
    parser.add_argument(
        "--with-compiled",
        action="store_true",
        help="add our model under torch.compile beside the eager one, in the same interleaved rounds (its"
        " compilation runs in the warm-up steps)",
    )
    parser.add_argument("--attention", default="sdpa")
    parser.add_argument("--layernorm", default="torch")
    parser.add_argument("--ffn-activation", default="torch", help="torch | triton (fused gated GELU)")
    parser.add_argument("--loss", default="torch", help="torch | triton (fused cross-entropy)")


def parse_args() -> argparse.Namespace:
    """The command line; the defaults differ with and without CUDA."""
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    cuda = torch.cuda.is_available()
    add_model_arguments(parser, cuda)
    parser.add_argument("--workers", type=int, default=2, help="DataLoader workers (impl.num_workers)")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=3 if not cuda else 10)
    parser.add_argument("--warmup", type=int, default=2 if not cuda else 5)
    parser.add_argument("--matmul", type=int, default=8192 if cuda else 1024, help="size of the peak matmul")
    parser.add_argument("--threads", type=int, default=None, help="torch threads on CPU")
    parser.add_argument("--no-hf", action="store_true", help="only our model")
    parser.add_argument("--no-memory", action="store_true", help="skip the CPU memory probes")
    parser.add_argument(
        "--profile", type=int, default=0, help="append a torch.profiler table of N of our steps"
    )
    parser.add_argument(
        "--out", type=Path, default=None, help="markdown file (default: results/step-speed/<device>.md)"
    )
    parser.add_argument(
        "--autobatch", action="store_true", help="run the impl.microbatch_size=auto search instead"
    )
    parser.add_argument("--search-seconds", type=float, default=60.0, help="time limit of --autobatch")
    parser.add_argument("--probe", help=argparse.SUPPRESS)  # kind:precision, a memory probe child
    args = parser.parse_args()
    if args.compile and args.with_compiled:
        parser.error(
            "--compile already compiles our model, so --with-compiled would time it against itself:"
            " give --with-compiled alone to compare compiled with eager"
        )
    if args.set is None:
        args.set = (
            [] if cuda else ["num_layers=4", "hidden_size=256", "num_heads=4", "intermediate_size=1024"]
        )
    return args


def main() -> None:
    args = parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    if args.device.startswith("cuda"):
        torch.set_float32_matmul_precision("high")
    if args.probe:
        probe_memory(args)
        return
    text = autobatch_report(args) if args.autobatch else report(measure(args), args)
    kind = (
        "cuda-" + torch.cuda.get_device_name().lower().replace(" ", "-")
        if args.device.startswith("cuda")
        else "cpu"
    )
    out = args.out or REPO / "results" / "step-speed" / f"{'autobatch-' if args.autobatch else ''}{kind}.md"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(text)
    print(text)


if __name__ == "__main__":
    main()
