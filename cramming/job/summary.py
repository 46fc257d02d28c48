"""The few lines a finished pretraining run ends with: what was learned, in words a newcomer can read, where the
model is, and the commands that take it further (GLUE, a transformers folder, the real run)."""

from __future__ import annotations

import math
import shlex
from pathlib import Path

from cramming.train.validation import USES_CONTEXT_GAIN

# the project-local GLUE copy that `python scripts/get_data.py glue` writes (docs/evaluation.md)
LOCAL_GLUE = Path("data/glue")
# GLUE-sane's learning rate is tuned for BERT-base's width (crammed-bert, the real run); narrower models
# (bert-tiny, bert-mini, bert-small) need glue-small's larger rates (docs/evaluation.md)
GLUE_SANE_WIDTH = 768


def glue_recipe(hidden_size: int) -> str:
    """The eval recipe the summary proposes for a model of this width."""
    return "glue-sane" if hidden_size >= GLUE_SANE_WIDTH else "glue-small"


def learned(validation: dict | None, vocab_size: int) -> list[str]:
    """The validation numbers as sentences: the loss against two baselines, and the context gain."""
    if not validation:
        return ["learned: not measured (no validation rows in this data)"]
    lines = [
        f"learned: masked-word loss {validation['loss']:.2f} nats on held-out rows, {validation['mlm_acc']:.1%}"
        f" of masked words right (a uniform guess over the {vocab_size} tokens: {math.log(vocab_size):.2f})"
    ]
    gain = validation.get("context_gain")
    if gain is None or not math.isfinite(gain):
        return lines
    real, shuffled = validation["context_loss_real"], validation["context_loss_shuffled"]
    entropy = validation["context_unigram_entropy"]
    if gain >= USES_CONTEXT_GAIN:
        verdict = f"it reads the words around a gap: {gain:.2f} nats better with them in their real order"
    else:
        verdict = (
            f"it does not use context yet (gain {gain:.2f}). Small models first learn how frequent each word is"
            " and can sit on that plateau for long; results/cpu-study/ shows what moved ours off it"
        )
    lines.append(
        f"         masked loss {real:.2f} on the rows as written, {shuffled:.2f} with each row's words shuffled"
        f" (word frequency alone: {entropy:.2f}): {verdict}"
    )
    return lines


def next_commands(name: str, base_dir: str, checkpoint: Path, hidden_size: int) -> list[str]:
    """GLUE fine-tuning (the recipe for the model's width), the transformers export and the real run, for this
    run's name."""
    where = [] if base_dir == "outputs" else [f"base_dir={base_dir}"]
    glue = [f"eval.glue_dir={LOCAL_GLUE}"] if LOCAL_GLUE.is_dir() else []
    recipe = f"eval={glue_recipe(hidden_size)}"
    evaluate = shlex.join(["python", "eval.py", f"checkpoint={name}", *where, recipe, *glue])
    export = shlex.join(
        ["python", "scripts/export_hf.py", name, f"exported/{name}"]
        + ([] if base_dir == "outputs" else ["--base-dir", base_dir])
    )
    source = (
        "" if glue else f" (from the hub; offline: eval.glue_dir={LOCAL_GLUE}, from scripts/get_data.py glue)"
    )
    return [
        "next:",
        f"  {evaluate}",
        f"      fine-tune and score it on GLUE{source}",
        f"  {export}",
        "      a transformers folder (AutoModelForMaskedLM, trust_remote_code=True)",
        "  python pretrain.py budget=24",
        "      the real run: cramming's recipe and data on one GPU for a day (docs/pretraining.md)",
    ]


def shown(path: Path) -> str:
    """A path as a user types it: relative to the current directory when it lies below it."""
    try:
        return str(path.resolve().relative_to(Path.cwd().resolve()))
    except ValueError:
        return str(path)


def summary(
    *,
    arch: str,
    hidden_size: int,
    updates: int,
    tokens: int,
    minutes: float,
    validation: dict | None,
    vocab_size: int,
    checkpoint: Path,
    name: str,
    base_dir: str,
) -> str:
    amount = f"{tokens / 1e6:.1f}M" if tokens >= 1e6 else f"{tokens / 1e3:.0f}k"
    head = f"done: {arch} pretrained for {updates} updates ({amount} tokens) in {minutes:.1f} minutes"
    return "\n".join(
        [
            head,
            *learned(validation, vocab_size),
            f"checkpoint: {shown(checkpoint)}",
            *next_commands(name, base_dir, checkpoint, hidden_size),
        ]
    )
