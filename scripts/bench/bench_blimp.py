"""BLiMP scoring speed: cramming's scorer (cramming.eval.blimp) against a plain transformers loop on the export
of the same checkpoint, in one process, interleaved, on one thread.

    python scripts/bench/bench_blimp.py --checkpoint <run or checkpoint folder> --blimp-dir <BLiMP data/ folder>

The plain loop is the usual way to write pseudo-log-likelihood scoring: for each sentence, its masked copies in
one batch through AutoModelForMaskedLM, the logits of every position computed. Both score the same pairs (the
first --pairs of each paradigm) with plain PLL in fp32; the script checks that their accuracies agree, and prints
pairs/s of each and the ratio. With --precision bf16, ours runs under bf16 autocast (fast only on a CPU with native
bf16: AVX-512 BF16 or AMX; cramming.impl.cpu_bf16_support says which).
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import torch

from cramming.eval import blimp
from cramming.hf.export import to_transformers
from cramming.impl import cpu_bf16_support
from cramming.model.checkpoint import load_pretrained, resolve_checkpoint


class PlainLoop(blimp.MaskedLM):
    """One sentence at a time: its masked copies in one batch, the full (rows, seq, vocab) logits."""

    def __init__(self, model, tokenizer, mask_id: int):
        super().__init__(tokenizer, mask_id, torch.device("cpu"))
        self.model = model.eval()

    @torch.no_grad()
    def sentence_pll(self, sentence: str) -> float:
        encoding = self.tokenizer.encode(sentence)
        positions = [i for i, special in enumerate(encoding.special_tokens_mask) if not special]
        ids = torch.tensor([encoding.ids] * len(positions))
        ids[torch.arange(len(positions)), positions] = self.mask_id
        logits = self.model(input_ids=ids).logits  # (copies, seq, vocab)
        log_probs = torch.log_softmax(logits[torch.arange(len(positions)), positions].double(), dim=-1)
        return log_probs[torch.arange(len(positions)), [encoding.ids[i] for i in positions]].sum().item()


def accuracy_and_seconds(score, pairs: dict[str, list[dict]]) -> tuple[float, float]:
    start = time.perf_counter()
    per_uid = []
    for rows in pairs.values():
        records = score(rows)
        per_uid.append(100.0 * sum(map(blimp.passed, records)) / len(records))
    return sum(per_uid) / len(per_uid), time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--checkpoint", required=True, help="a run folder, its checkpoint/ folder or a run name"
    )
    parser.add_argument("--blimp-dir", required=True, help="a folder of BLiMP's <UID>.jsonl(.gz) files")
    parser.add_argument("--pairs", type=int, default=20, help="the first N pairs of each paradigm")
    parser.add_argument("--precision", choices=("fp32", "bf16"), default="fp32")
    args = parser.parse_args()
    torch.set_num_threads(1)
    pairs = blimp.load_pairs(blimp.BlimpConfig(dir=args.blimp_dir, pairs_per_paradigm=args.pairs))
    checkpoint = resolve_checkpoint(args.checkpoint, "outputs")
    pretrained = load_pretrained(checkpoint, device="cpu")
    mask_id = pretrained.config["special_tokens"]["mask"]
    dtype = torch.bfloat16 if args.precision == "bf16" else torch.float32
    ours = blimp.CrammedMaskedLM(
        pretrained.model,
        pretrained.tokenizer,
        mask_id,
        autocast=lambda: torch.autocast("cpu", dtype=dtype, enabled=dtype != torch.float32),
    )
    from transformers import AutoModelForMaskedLM

    with tempfile.TemporaryDirectory() as tmp:
        folder = to_transformers(checkpoint, Path(tmp) / "hf")
        plain = PlainLoop(
            AutoModelForMaskedLM.from_pretrained(folder, trust_remote_code=True), ours.tokenizer, mask_id
        )

        def plain_score(rows: list[dict]) -> list[dict]:
            return [
                {
                    "pll_good": plain.sentence_pll(r["sentence_good"]),
                    "pll_bad": plain.sentence_pll(r["sentence_bad"]),
                }
                for r in rows
            ]

        def our_score(rows: list[dict]) -> list[dict]:
            return blimp.score_paradigm(ours, rows, "pll", batch_rows=512)

        ours_acc, ours_s = accuracy_and_seconds(our_score, pairs)  # interleaved: ours, plain, ours again
        plain_acc, plain_s = accuracy_and_seconds(plain_score, pairs)
        again_acc, again_s = accuracy_and_seconds(our_score, pairs)
    n = sum(len(rows) for rows in pairs.values())
    bf16, how = cpu_bf16_support()
    print(
        f"{n} pairs ({args.pairs} per paradigm), 1 thread, ours in {args.precision}; native bf16: {bf16} ({how})"
    )
    print(f"accuracy: ours {ours_acc:.2f} / {again_acc:.2f}, plain loop {plain_acc:.2f}")
    ours_best = min(ours_s, again_s)
    print(
        f"pairs/s: ours {n / ours_best:.0f} (best of 2), plain loop {n / plain_s:.0f}: {plain_s / ours_best:.1f}x"
    )
    print(
        f"all 67,000 pairs would take: ours {67000 / (n / ours_best) / 60:.1f} min, plain {67000 / (n / plain_s) / 60:.1f} min"
    )


if __name__ == "__main__":
    main()
