"""The model card an export writes beside the weights: README.md, which the Hugging Face Hub shows as the
model's page. YAML front matter (library, license, pipeline, tags, the hub datasets it was trained on), then
what the model is, how to load it, how it was trained and its GLUE scores.

Everything it says is read from files a run leaves, never typed in: the checkpoint's model_config.json (arch,
vocabulary, updates, budget spent, validation MLM loss), the run card of the run that wrote the checkpoint
(run_card.json beside checkpoint/: data, tokens, budget, optimizer, device, code version, command) and an
evaluation of the same checkpoint by eval.py (its glue_results.json). What none of them records, the card says
is not recorded.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from cramming.errors import ConfigError
from cramming.eval.run import RESULTS_JSON
from cramming.job.runcard import RUN_CARD
from cramming.model.checkpoint import MODEL_CONFIG

CARD = "README.md"
# cramming's license (pyproject.toml): the model code an export carries is under it. The training data's own
# terms (Wikipedia's CC BY-SA, ...) are for whoever shares the weights to check
LICENSE = "mit"
# Geiping & Goldstein, Cramming: Training a Language Model on a Single GPU in One Day
PAPER = "https://arxiv.org/abs/2212.14034"
NOT_RECORDED = "not recorded"
# override keys whose values are folders of the machine that trained, meaningless elsewhere: left off the
# command the card shows, as is any override whose value is an absolute or home path
LOCAL_KEYS = ("base_dir",)


@dataclass
class Provenance:
    """What is known about one checkpoint: its model_config.json, the run card of its run ({} when the run
    left none), and a GLUE evaluation of it (glue_results.json's content, None when none is known) with
    where that was found."""

    checkpoint: Path
    model_config: dict
    run_card: dict
    glue: dict | None = None
    glue_source: str | None = None


def read_provenance(
    checkpoint: Path, base_dir: str | Path = "outputs", glue: str | Path | None = None
) -> Provenance:
    """The provenance of `checkpoint` (a checkpoint folder). glue: an evaluation folder of it (or its
    glue_results.json); None: the newest evaluation of it under base_dir, if any."""
    checkpoint = Path(checkpoint)
    config = json.loads((checkpoint / MODEL_CONFIG).read_text())
    card_path = checkpoint.parent / RUN_CARD
    try:
        run_card = json.loads(card_path.read_text()) if card_path.is_file() else {}
    except ValueError:  # a damaged card: the card says what model_config.json says, as without one
        run_card = {}
    found = Provenance(checkpoint, config, run_card)
    path = explicit_glue(glue, found) if glue is not None else find_glue_results(found, Path(base_dir))
    if path is not None:
        found.glue = json.loads(path.read_text())
        found.glue_source = _relative(path.parent, Path(base_dir))
    return found


def same_checkpoint(report: dict, provenance: Provenance) -> bool:
    """Whether a glue_results.json evaluated this checkpoint: the same folder, or (runs copied to another
    machine or folder) a folder of the same run name and start time whose pretraining record is this one's."""
    named = Path(report.get("checkpoint") or "")
    if named.resolve() == provenance.checkpoint.resolve():
        return True
    tail = provenance.checkpoint.resolve().parts[-3:]  # name / start time / checkpoint
    return named.parts[-3:] == tail and report.get("pretraining") == provenance.model_config.get("training")


def find_glue_results(provenance: Provenance, base_dir: Path) -> Path | None:
    """The newest glue_results.json under base_dir ({name}/{start time}/, or a multirun's
    {name}/multirun_*/{n}/) that evaluated this checkpoint; None when there is none."""
    candidates = [*base_dir.glob(f"*/*/{RESULTS_JSON}"), *base_dir.glob(f"*/multirun_*/*/{RESULTS_JSON}")]
    matching = []
    for path in candidates:
        try:
            report = json.loads(path.read_text())
        except (OSError, ValueError):  # an evaluation being written, or a damaged file: not this card's
            continue
        if same_checkpoint(report, provenance):
            matching.append(path)
    return max(matching, key=lambda p: p.stat().st_mtime, default=None)


def explicit_glue(glue: str | Path, provenance: Provenance) -> Path:
    """The glue_results.json the user named (the file or its folder); refused when it evaluated another
    checkpoint, so a card never shows another model's scores."""
    path = Path(glue)
    path = path / RESULTS_JSON if path.is_dir() else path
    if not path.is_file():
        raise ConfigError(f"glue={glue}: no {RESULTS_JSON} there; give the folder an eval.py run wrote")
    report = json.loads(path.read_text())
    if not same_checkpoint(report, provenance):
        raise ConfigError(
            f"glue={glue}: that evaluation is of {report.get('checkpoint')}, not of {provenance.checkpoint}"
        )
    return path


def _relative(path: Path, base: Path) -> str:
    """`path` under `base` as `name/start time`, else the folder's own name: no path of this machine."""
    try:
        return str(path.resolve().relative_to(base.resolve()))
    except ValueError:
        return path.name


def _get(values: dict, dotted: str):
    """values["a"]["b"] for "a.b"; None where a key is missing."""
    for key in dotted.split("."):
        if not isinstance(values, dict):
            return None
        values = values.get(key)
    return values


def hub_datasets(run_card: dict) -> list[str]:
    """The hub datasets the run read (data sources of kind `hub`), as the Hub's `datasets:` metadata."""
    sources = _get(run_card, "config.data.sources") or {}
    return [
        s["path"]
        for s in sources.values()
        if isinstance(s, dict) and s.get("kind") == "hub" and s.get("path")
    ]


def front_matter(pipeline_tag: str, remote_code: bool, provenance: Provenance) -> str:
    """The Hub's metadata block: the library that loads the folder, the license, the pipeline and the tags."""
    model_type = "crammed_bert" if remote_code else "bert"
    tags = ["cramming", "bert", model_type, *(["custom_code"] if remote_code else [])]
    lines = [
        "---",
        "library_name: transformers",
        f"license: {LICENSE}",
        f"pipeline_tag: {pipeline_tag}",
        "tags:",
    ]
    lines += [f"- {tag}" for tag in dict.fromkeys(tags)]
    datasets = hub_datasets(provenance.run_card)
    if datasets:
        lines += ["datasets:", *(f"- {name}" for name in datasets)]
    return "\n".join([*lines, "---", ""])


def usage(auto_class: str, remote_code: bool) -> str:
    """How to load the folder, from the Hub or a local copy."""
    flag = ", trust_remote_code=True" if remote_code else ""
    heads = (
        "AutoModel (the encoder), AutoModelForMaskedLM, AutoModelForSequenceClassification,"
        " AutoModelForTokenClassification, AutoModelForQuestionAnswering and AutoModelForMultipleChoice"
    )
    code = (
        "The model code comes with the weights (`modeling_crammed_bert.py` and the `bert.py` it wraps, which"
        " imports only torch): pass `trust_remote_code=True`, to the tokenizer too."
        if remote_code
        else "The folder is a standard BERT: transformers' own classes load it."
    )
    return "\n".join([
        "## How to use",
        "",
        "```python",
        f"from transformers import {auto_class}, AutoTokenizer",
        "",
        'name = "<this repository, or the exported folder>"',
        f"tokenizer = AutoTokenizer.from_pretrained(name{flag})",
        f"model = {auto_class}.from_pretrained(name{flag})",
        "```",
        "",
        f"{code} It serves {heads}; a head the folder does not hold starts at random, to be fine-tuned.",
        "",
    ])  # fmt: skip


def _command(run_card: dict) -> str | None:
    """The command that replays the run, less the overrides naming folders of the machine that ran it."""
    overrides = _get(run_card, "job.overrides")
    if overrides is None:
        return None
    kept = []
    for override in overrides:
        key, _, value = override.partition("=")
        if key.lstrip("+~") not in LOCAL_KEYS and not value.strip("'\"").startswith(("/", "~")):
            kept.append(override)
    return " ".join(["python pretrain.py", *kept])


def _number(value, template: str) -> str:
    return NOT_RECORDED if value is None else template.format(value)


def _data(run_card: dict) -> str:
    """The data config's name and where its sources came from (hub dataset ids; local files unnamed)."""
    data = _get(run_card, "config.data") or {}
    if not data:
        return NOT_RECORDED
    where = []
    for name, source in (data.get("sources") or {}).items():
        kind = source.get("kind")
        if kind == "hub":
            subset = f" ({source['subset']})" if source.get("subset") else ""
            revision = f" at revision {source['revision']}" if source.get("revision") else ""
            where.append(f"{source.get('path')}{subset}{revision}")
        else:
            where.append(f"{name} ({kind} files)")
    rows, length = _get(run_card, "data.train_rows"), _get(run_card, "data.seq_length")
    size = f"; {rows:,} training rows of {length} tokens" if rows and length else ""
    return f"`data={data.get('name')}`: " + ", ".join(where) + size


def _architecture(model_config: dict, parameters: int) -> str:
    a = model_config["arch"]
    return (
        f"`arch={a['name']}`: {a['num_layers']} layers, hidden size {a['hidden_size']},"
        f" {a['num_heads']} attention heads, feed-forward {a['intermediate_size']} ({a['ffn']}),"
        f" {a['norm_scheme']}-norm, {a['position_embedding']} positions; {parameters / 1e6:.2f}M parameters"
    )


def _trained(provenance: Provenance) -> str:
    training = provenance.model_config.get("training") or {}
    updates, tokens = training.get("updates"), _get(provenance.run_card, "metrics.tokens")
    done = _number(updates, "{:,} updates")
    if tokens:
        done = f"{tokens:,} tokens in {done}"
    reason = training.get("stop_reason")
    return done + (f" (stopped by: {reason})" if reason else "")


def _budget(provenance: Provenance) -> str:
    allowed = _get(provenance.run_card, "config.budget")
    spent = (provenance.model_config.get("training") or {}).get("elapsed_h")
    if spent is None:
        spent = _get(provenance.run_card, "metrics.budget_hours_spent")
    if allowed is None and spent is None:
        return NOT_RECORDED
    return f"{_number(allowed, '{:g} h')} allowed, {_number(spent, '{:.3g} h')} spent"


def _validation(model_config: dict) -> str:
    validation = (model_config.get("training") or {}).get("validation") or {}
    loss, accuracy = validation.get("loss"), validation.get("mlm_acc")
    if loss is None:
        return NOT_RECORDED
    return f"{loss:.4f}" + (f" (masked-token accuracy {100 * accuracy:.1f}%)" if accuracy is not None else "")


def _machine_and_code(run_card: dict) -> tuple[str, str]:
    device = run_card.get("device") or {}
    machine = device.get("gpu") or device.get("cpu") or NOT_RECORDED
    dtype = _get(device, "precision.dtype")
    machine += f", {dtype}" if dtype and machine != NOT_RECORDED else ""
    git = run_card.get("git") or {}
    code = NOT_RECORDED
    if git.get("commit"):
        code = f"cramming at commit {git['commit'][:12]}" + (
            " with uncommitted changes" if git.get("dirty") else ""
        )
    torch_version = _get(run_card, "packages.torch")
    code += f", torch {torch_version}" if torch_version and code != NOT_RECORDED else ""
    return machine, code


def training(provenance: Provenance, parameters: int) -> str:
    """How the checkpoint was made, one table row per fact."""
    card, config = provenance.run_card, provenance.model_config
    tokenizer = _get(card, "config.data.tokenizer.kind")
    machine, code = _machine_and_code(card)
    rows = [
        ("Architecture", _architecture(config, parameters)),
        ("Tokenizer", f"{config['vocab_size']:,} tokens" + (f" ({tokenizer})" if tokenizer else "")),
        ("Sequence length", f"{config.get('seq_length', config['arch']['max_seq_length'])} tokens"),
        ("Data", _data(card)),
        ("Trained", _trained(provenance)),
        ("Budget", _budget(provenance)),
        ("Optimizer", _get(card, "config.train.optim.name") or NOT_RECORDED),
        ("Validation MLM loss", _validation(config)),
        ("Hardware", machine),
        ("Code", code),
    ]
    command = _command(card)
    if command:
        rows.append(("Command", f"`{command}`"))
    table = ["| | |", "|---|---|", *(f"| {name} | {value} |" for name, value in rows)]
    source = "the checkpoint's model_config.json" + (
        " and its run's run_card.json" if card else "; its run left no run card"
    )
    return "\n".join(
        [
            "## Training",
            "",
            f"Pretrained from scratch with cramming ({PAPER}); from {source}.",
            "",
            *table,
            "",
        ]
    )


def _glue_caveats(report: dict) -> list[str]:
    """What limits the scores: fewer examples than the full tasks, tasks left out."""
    recipe = _get(report, "config.eval") or {}
    notes = []
    limits = {key: recipe.get(key) for key in ("max_train_examples", "max_eval_examples")}
    if any(limits.values()):
        shown = ", ".join(f"{key}={value}" for key, value in limits.items() if value)
        notes.append(f"Fine-tuned and scored on subsets ({shown}): not comparable with full-task scores.")
    if report.get("skipped_no_data"):
        notes.append(f"Skipped for lack of data: {', '.join(report['skipped_no_data'])}.")
    if report.get("not_run_budget"):
        notes.append(f"Not run (the evaluation's budget ran out): {', '.join(report['not_run_budget'])}.")
    return notes


def glue(provenance: Provenance) -> str:
    """The GLUE scores of the checkpoint's evaluation, or a line saying none is recorded."""
    report = provenance.glue
    if report is None:
        return "\n".join([
            "## Evaluation",
            "",
            "No GLUE evaluation is recorded for this checkpoint. cramming's `python eval.py checkpoint=<run>`"
            " fine-tunes and scores it; exported again afterwards, the card shows its scores.",
            "",
        ])  # fmt: skip
    recipe = _get(report, "config.eval.name") or NOT_RECORDED
    seeds = sorted({len(score.get("per_seed") or [0]) for score in report["scores"].values()}) or [0]
    rows = [
        f"| {entry} | {score['metric']} | {100 * score['median']:.1f} |"
        for entry, score in report["scores"].items()
    ]
    average = report.get("glue_average")
    used = report.get("average_entries") or []
    summary = (
        f"Average over {len(used)} entries (WNLI never counts): {100 * average:.1f}."
        if average is not None
        else "No average: no entry that counts was scored."
    )
    return "\n".join([
        "## Evaluation",
        "",
        f"GLUE dev sets, fine-tuned by cramming's eval.py (recipe `{recipe}`, optimizer"
        f" `{report.get('optimizer', NOT_RECORDED)}`), median over {'/'.join(map(str, seeds))} seed(s), x100;"
        f" from the evaluation `{provenance.glue_source}`.",
        "",
        "| Task | Metric | Score |",
        "|---|---|---|",
        *rows,
        "",
        summary,
        *_glue_caveats(report),
        "",
    ])  # fmt: skip


def model_card(
    provenance: Provenance, *, parameters: int, remote_code: bool, labels: list[str] | None = None
) -> str:
    """README.md of an exported folder: a masked LM (labels None) or a fine-tuned sequence classifier."""
    name = _get(provenance.run_card, "config.name") or provenance.checkpoint.resolve().parent.parent.name
    arch = provenance.model_config["arch"]["name"]
    if labels is None:
        pipeline_tag, auto_class = "fill-mask", "AutoModelForMaskedLM"
        what = f"A BERT-style masked language model (`arch={arch}`), pretrained by cramming on a time budget."
    else:
        pipeline_tag, auto_class = "text-classification", "AutoModelForSequenceClassification"
        what = (
            f"A sequence classifier (labels: {', '.join(labels)}) fine-tuned from a BERT-style encoder"
            f" (`arch={arch}`) that cramming pretrained; the training below is the encoder's pretraining."
        )
    return "\n".join([
        front_matter(pipeline_tag, remote_code, provenance),
        f"# {name}",
        "",
        what,
        "",
        usage(auto_class, remote_code),
        training(provenance, parameters),
        glue(provenance),
        "## License",
        "",
        f"The model code in this folder is cramming's, under the {LICENSE.upper()} license. The weights were"
        " trained on the data named above: check its terms before you share them.",
        "",
    ])  # fmt: skip
