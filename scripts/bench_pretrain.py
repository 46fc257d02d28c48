"""Throughput, FLOP/s and MFU of full training steps: our model against Hugging Face BertForMaskedLM.

    python scripts/bench_pretrain.py --data outputs/data/local-<hash>           # CPU, a small crammed shape
    python scripts/bench_pretrain.py --arch crammed-bert --microbatch 128 --compile  # CUDA, bf16

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
import importlib.util
import json
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field, fields, replace
from pathlib import Path

import numpy as np
import torch
import yaml

REPO = Path(__file__).resolve().parent.parent
if importlib.util.find_spec("cramming") is None:  # a plain checkout (the GPU machine installs nothing)
    sys.path.append(str(REPO))

from cramming.model import ArchConfig, build_model, count_parameters  # noqa: E402
from cramming.model.flops import forward_flops_per_token, train_flops_per_token  # noqa: E402
from cramming.optim import OptimConfig, build_optimizer  # noqa: E402
from cramming.train.batches import microbatches  # noqa: E402
from cramming.train.config import MLMConfig  # noqa: E402
from cramming.train.mlm import MLMMasker  # noqa: E402
from cramming.train.step import TrainStep  # noqa: E402

SPECIAL = (0, 1, 2, 3, 4)  # [PAD] [UNK] [CLS] [SEP] [MASK], as every tokenizer of the pipeline places them
MASK_ID = 4
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def load_arch(name: str, overrides: list[str]) -> ArchConfig:
    """conf/arch/<name>.yaml with key=value overrides, read with plain YAML (no Hydra needed)."""
    values = yaml.safe_load((REPO / "conf" / "arch" / f"{name}.yaml").read_text())
    types = {f.name: f.type for f in fields(ArchConfig)}
    for item in overrides:
        key, _, value = item.partition("=")
        if key not in types:
            raise SystemExit(f"--set {item}: ArchConfig has no field {key!r}")
        values[key] = yaml.safe_load(value)
    return ArchConfig(**values)


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
    params: int
    flops_per_token: float  # training step
    step: Callable[[torch.Tensor, torch.Tensor], None]  # (corrupted ids, labels) on the device
    optimizer: torch.optim.Optimizer
    own_bytes: int = 0  # parameters, gradients and optimizer state
    seconds: list[float] = field(default_factory=list)  # per round: seconds per step
    data_seconds: list[float] = field(default_factory=list)  # per round: seconds per step in the data path
    peak_bytes: float | None = None


def make_step(model, optimizer, device: torch.device, dtype: torch.dtype, forward) -> Callable:
    """One update of the training loop's own step (cramming.train.step), clipping at the recipe's 0.5."""
    train_step = TrainStep(model, optimizer, device_type=device.type, dtype=dtype, grad_clip=0.5)

    def step(corrupted: torch.Tensor, labels: torch.Tensor) -> None:
        train_step.begin()
        with train_step.autocast():
            loss = forward(corrupted, labels)
        train_step.backward(loss)
        train_step.apply(loss.detach())

    return step


def build_ours(
    arch: ArchConfig, vocab: int, args: argparse.Namespace, device: torch.device, dtype
) -> Candidate:
    model = build_model(
        arch, vocab, device=device, attention=args.attention, layernorm=args.layernorm,
        ffn_activation=args.ffn_activation, loss=args.loss, dropout=0.0,
    )  # fmt: skip
    optimizer = build_optimizer(model, OptimConfig())
    runner = torch.compile(model) if args.compile else model
    k = MLMMasker(MLMConfig(), 10, SPECIAL, MASK_ID).predicted_per_row(args.seq)  # static sparse prediction
    step = make_step(
        model, optimizer, device, dtype, lambda ids, labels: runner(ids, labels, predicted_per_row=k).loss
    )
    flops = train_flops_per_token(arch, vocab, args.seq, predicted_fraction=masked_fraction(args.seq))
    return Candidate(f"ours ({arch.name})", count_parameters(model), flops, step, optimizer)


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
    return Candidate("HF BertForMaskedLM", count_parameters(model), flops, step, optimizer)


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
    device, dtype = torch.device("cpu"), DTYPES[args.precision]
    rows, vocab, _ = load_rows(args)
    arch = load_arch(args.arch, args.set)
    base = memory_status("VmRSS")
    Path("/proc/self/clear_refs").write_text("5")  # resets VmHWM to the current resident size
    candidate = (build_ours if args.probe == "ours" else build_hf)(arch, vocab, args, device, dtype)
    masker = MLMMasker(MLMConfig(), vocab, SPECIAL, MASK_ID)
    batches = iter(microbatches(rows, args.microbatch, 0, 0, num_workers=0, pin_memory=False))
    run_steps(candidate, batches, masker, device, 2)
    print(json.dumps({"peak_bytes": memory_status("VmHWM") - base}))


def cpu_peak_memory(which: str) -> float | None:
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


def measure(args: argparse.Namespace) -> dict:
    device = torch.device(args.device)
    dtype = DTYPES[args.precision]
    rows, vocab, rows_note = load_rows(args)
    arch = load_arch(args.arch, args.set)
    candidates = [build_ours(arch, vocab, args, device, dtype)]
    if not args.no_hf:
        candidates.append(build_hf(arch, vocab, args, device, dtype))
    masker = MLMMasker(MLMConfig(), vocab, SPECIAL, MASK_ID)
    batches = iter(
        microbatches(rows, args.microbatch, 0, 0, num_workers=args.workers, pin_memory=device.type == "cuda")
    )
    for c in candidates:  # warm-up: lazy optimizer state, compilation, loader workers
        run_steps(c, batches, masker, device, args.warmup)
        c.own_bytes = own_bytes(c.optimizer)
    peaks = []
    for _ in range(args.rounds):
        peaks.append(peak_matmul(device, dtype, args.matmul))
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
    if device.type == "cpu" and not args.no_memory:
        for c, which in zip(candidates, ("ours", "hf"), strict=False):
            c.peak_bytes = cpu_peak_memory(which)
    profile = None
    if args.profile:
        activities = [torch.profiler.ProfilerActivity.CPU]
        if device.type == "cuda":
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        with torch.profiler.profile(activities=activities) as prof:
            run_steps(candidates[0], batches, masker, device, args.profile)
        sort = "self_device_time_total" if device.type == "cuda" else "self_cpu_time_total"
        profile = prof.key_averages().table(sort_by=sort, row_limit=15, max_name_column_width=60)
    return {
        "candidates": candidates,
        "peak": max(peaks),
        "rows": rows_note,
        "arch": arch,
        "vocab": vocab,
        "profile": profile,
    }


def report(result: dict, args: argparse.Namespace) -> str:
    candidates, peak, arch = result["candidates"], result["peak"], result["arch"]
    tokens = args.microbatch * args.seq
    device_name = (
        torch.cuda.get_device_name()
        if args.device.startswith("cuda")
        else f"CPU, {torch.get_num_threads()} thread(s)"
    )
    parts = forward_flops_per_token(arch, result["vocab"], args.seq, masked_fraction(args.seq))
    lines = [
        f"# Training-step throughput: {device_name}",
        "",
        f"`python scripts/bench_pretrain.py {' '.join(sys.argv[1:])}`, {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())},"
        f" torch {torch.__version__}. Arch `{args.arch}`{' with ' + ', '.join(args.set) if args.set else ''}:"
        f" {arch.num_layers} layers, hidden {arch.hidden_size}, {arch.num_heads} heads, FFN {arch.intermediate_size}"
        f" ({arch.ffn}); vocabulary {result['vocab']}, micro-batch {args.microbatch} x {args.seq} tokens,"
        f" {args.precision}, compile {'on' if args.compile else 'off'}, attention {args.attention},"
        f" LayerNorm {args.layernorm}, FFN activation {args.ffn_activation}, loss {args.loss},"
        f" {args.workers} loader worker(s); rows: {result['rows']}."
        f" {args.rounds} interleaved rounds of {args.steps} steps after {args.warmup} warm-up steps; medians over"
        f" rounds. Peak: a {args.matmul}x{args.matmul} {args.precision} matmul, best round: {peak / 1e12:.3f} TFLOP/s.",
        "",
        "| model | parameters | seq/s | tokens/s | model GFLOP/token | achieved TFLOP/s | MFU | peak memory | data path |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for c in candidates:
        seconds = statistics.median(c.seconds)
        flops = c.flops_per_token * tokens / seconds
        memory = f"{c.peak_bytes / 2**20:,.0f} MiB" if c.peak_bytes else "n/a"
        data_share = statistics.median(d / s for d, s in zip(c.data_seconds, c.seconds, strict=True))
        lines.append(
            f"| {c.name} | {c.params / 1e6:.1f}M | {args.microbatch / seconds:,.1f} | {tokens / seconds:,.0f} |"
            f" {c.flops_per_token / 1e9:.4f} | {flops / 1e12:.4f} | {100 * flops / peak:.1f}% | {memory} |"
            f" {100 * data_share:.2f}% |"
        )
    if len(candidates) == 2:
        ours, hf = candidates
        tok_ratio = statistics.median(h / o for o, h in zip(ours.seconds, hf.seconds, strict=True))
        flop_ratio = tok_ratio * ours.flops_per_token / hf.flops_per_token
        lines += [
            "",
            f"Ours / HF, median of per-round ratios: **tokens/s {tok_ratio:.2f}x**, **FLOP/s {flop_ratio:.2f}x**"
            f" (per-round tokens/s ratios: {', '.join(f'{h / o:.2f}' for o, h in zip(ours.seconds, hf.seconds, strict=True))}).",
        ]
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
            f"## torch.profiler: {args.profile} of our steps, top operators by self time",
            "",
            "```",
        ]
        lines += [result["profile"].rstrip(), "```"]
    return "\n".join(lines) + "\n"


def autobatch_report(args: argparse.Namespace) -> str:
    """What impl.microbatch_size=auto does for this arch here: its trials and its choice (a fresh search)."""
    import tempfile

    from cramming.train import autobatch

    device, dtype = torch.device(args.device), DTYPES[args.precision]
    arch = load_arch(args.arch, args.set)
    model = build_model(
        arch, args.vocab, device=device, attention=args.attention, layernorm=args.layernorm, dropout=0.0
    )
    masker = MLMMasker(MLMConfig(), args.vocab, SPECIAL, MASK_ID)
    with tempfile.TemporaryDirectory() as tmp:
        cache = Path(tmp) / autobatch.CACHE_FILE
        chosen = autobatch.choose_microbatch(
            model,
            masker,
            device,
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
        f"`python scripts/bench_pretrain.py {' '.join(sys.argv[1:])}`, {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}:"
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


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    cuda = torch.cuda.is_available()
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
    parser.add_argument("--precision", choices=list(DTYPES), default="bf16" if cuda else "fp32")
    parser.add_argument("--compile", action="store_true", help="torch.compile both models")
    parser.add_argument("--attention", default="sdpa")
    parser.add_argument("--layernorm", default="torch")
    parser.add_argument("--ffn-activation", default="torch", help="torch | triton (fused gated GELU)")
    parser.add_argument("--loss", default="torch", help="torch | triton (fused cross-entropy)")
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
        "--out", type=Path, default=None, help="markdown file (default: results/step-<device>.md)"
    )
    parser.add_argument(
        "--autobatch", action="store_true", help="run the impl.microbatch_size=auto search instead"
    )
    parser.add_argument("--search-seconds", type=float, default=60.0, help="time limit of --autobatch")
    parser.add_argument("--probe", choices=["ours", "hf"], help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.set is None:
        args.set = (
            [] if cuda else ["num_layers=4", "hidden_size=256", "num_heads=4", "intermediate_size=1024"]
        )
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
    out = args.out or REPO / "results" / f"{'autobatch' if args.autobatch else 'step'}-{kind}.md"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(text)
    print(text)


if __name__ == "__main__":
    main()
