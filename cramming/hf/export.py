"""Write a cramming checkpoint as a Hugging Face `transformers` folder.

out/
    config.json              BertConfig (model_type bert), or CrammedBertConfig (crammed_bert) with auto_map
    modeling_crammed_bert.py the remote code of a crammed_bert folder: the transformers classes, and
    bert.py                  the model they wrap; both copied from cramming/model/ as they are
    model.safetensors        the weights under the transformers model's key names
    tokenizer.json, tokenizer_config.json, special_tokens_map.json
                             the checkpoint's tokenizer as a plain PreTrainedTokenizerFast
    README.md                the model card, the Hub's page of the model (cramming.hf.card): how it was
                             trained and its GLUE scores, read from the run's files

Format `bert` is a native BertForMaskedLM / BertForSequenceClassification: only for an arch that computes
what BERT computes (conf/arch/bert-base.yaml at any size). Format `crammed_bert` expresses every ArchConfig
option through cramming's own model code. `auto` picks `bert` where it applies.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
from dataclasses import asdict
from pathlib import Path

import torch
from tokenizers import Tokenizer
from torch import nn
from transformers import BertConfig, BertForMaskedLM, BertForSequenceClassification, PreTrainedModel

from cramming.data.tokenizer import SpecialTokens
from cramming.errors import ConfigError, WriteFailed
from cramming.hf import AUTO_CLASSES, card
from cramming.model import bert as core
from cramming.model import modeling_crammed_bert as crammed
from cramming.model.checkpoint import (
    MODEL_CONFIG,
    TOKENIZER,
    WEIGHTS,
    load_pretrained,
    resolve_checkpoint,
    unwrap,
)
from cramming.model.config import ArchConfig

FORMATS = ("auto", "bert", "crammed_bert")
# the remote code of a crammed_bert folder: the wrapper first (config.json's auto_map names it), then the model
# code it imports relatively
MODELING_FILES = (Path(crammed.__file__), Path(core.__file__))

# What BERT computes, as ArchConfig values; type_vocab_size must also be at least 1
BERT_ARCH = {
    "ffn": "gelu",
    "norm_scheme": "post",
    "bias": True,
    "norm_bias": True,
    "position_embedding": "learned",
    "attention_bias": "none",
    "embedding_norm": True,
    "final_norm": False,
    "head_transform": True,
    "decoder_bias": True,
}


class ExportError(ConfigError):
    """The checkpoint or the requested format cannot be written as a transformers folder; says why."""


def bert_mismatches(arch: ArchConfig) -> list[str]:
    """The arch options a native BERT cannot express, as `arch.key=value (BERT: value)`; empty when none."""
    found = [
        f"arch.{key}={getattr(arch, key)!r} (BERT: {value!r})"
        for key, value in BERT_ARCH.items()
        if getattr(arch, key) != value
    ]
    if arch.type_vocab_size < 1:
        found.append(f"arch.type_vocab_size={arch.type_vocab_size} (BERT: at least 1)")
    return found


def choose_format(arch: ArchConfig, format: str = "auto") -> str:
    if format not in FORMATS:
        raise ExportError(f"format={format!r}: use one of {FORMATS}")
    mismatches = bert_mismatches(arch)
    if format == "bert" and mismatches:
        raise ExportError(
            "a native BERT cannot express this arch: " + "; ".join(mismatches) + ". Use format crammed_bert."
        )
    if format == "auto":
        return "crammed_bert" if mismatches else "bert"
    return format


def crammed_config(
    arch: ArchConfig, vocab_size: int, special: SpecialTokens, **head
) -> crammed.CrammedBertConfig:
    """The CrammedBertConfig of `arch`; head: classifier keywords (num_labels, classifier_head_dim, ...)."""
    values = asdict(arch)
    known = {field.name for field in crammed.ARCH_FIELDS.values()} | set(crammed.NOT_EXPORTED)
    unknown = sorted(set(values) - known)
    if unknown:
        raise ExportError(
            f"arch option(s) {', '.join(f'arch.{k}' for k in unknown)} unknown to the exporter: the model"
            " code an export carries is cramming/model/bert.py, and its Arch has no such field"
        )
    kwargs = {name: values[field.name] for name, field in crammed.ARCH_FIELDS.items()}
    kwargs["attention_probs_dropout_prob"] = arch.dropout
    try:
        return crammed.CrammedBertConfig(
            vocab_size=vocab_size,
            pad_token_id=special.pad,
            # transformers 4's pipeline() loads a tokenizer for a model type it does not know only when the
            # config names the tokenizer's class
            tokenizer_class="PreTrainedTokenizerFast",
            cramming_arch=arch.name,
            **kwargs,
            **head,
        )
    except ValueError as err:  # an option value the modeling file does not implement
        raise ExportError(f"cannot export arch {arch.name!r}: {err}") from err


def bert_config(arch: ArchConfig, vocab_size: int, special: SpecialTokens, **head) -> BertConfig:
    return BertConfig(
        vocab_size=vocab_size,
        hidden_size=arch.hidden_size,
        num_hidden_layers=arch.num_layers,
        num_attention_heads=arch.num_heads,
        intermediate_size=arch.intermediate_size,
        hidden_act="gelu",  # exact (erf) GELU, as torch's F.gelu
        hidden_dropout_prob=arch.dropout,
        attention_probs_dropout_prob=arch.dropout,
        max_position_embeddings=arch.max_seq_length,
        type_vocab_size=arch.type_vocab_size,
        initializer_range=arch.init_std,
        layer_norm_eps=arch.norm_eps,
        pad_token_id=special.pad,
        tie_word_embeddings=arch.tie_embeddings,
        **head,
    )


def bert_encoder_state(state: dict[str, torch.Tensor], num_layers: int) -> dict[str, torch.Tensor]:
    """Our Encoder's state dict (keys without `encoder.`) under BertModel's names (without `bert.`)."""
    out = {
        "embeddings.word_embeddings.weight": state["embeddings.word.weight"],
        "embeddings.position_embeddings.weight": state["embeddings.position.table.weight"],
        "embeddings.token_type_embeddings.weight": state["embeddings.token_type.weight"],
        "embeddings.LayerNorm.weight": state["embeddings.norm.weight"],
        "embeddings.LayerNorm.bias": state["embeddings.norm.bias"],
    }
    for i in range(num_layers):
        ours, hf = f"blocks.{i}.", f"encoder.layer.{i}."
        for kind in ("weight", "bias"):
            # qkv: (3 * hidden, ...), the rows of q, then k, then v
            query, key, value = state[ours + f"attention.qkv.{kind}"].chunk(3)
            out[hf + f"attention.self.query.{kind}"] = query
            out[hf + f"attention.self.key.{kind}"] = key
            out[hf + f"attention.self.value.{kind}"] = value
            out[hf + f"attention.output.dense.{kind}"] = state[ours + f"attention.out.{kind}"]
            out[hf + f"attention.output.LayerNorm.{kind}"] = state[ours + f"norm1.{kind}"]
            out[hf + f"intermediate.dense.{kind}"] = state[ours + f"ffn.up.{kind}"]
            out[hf + f"output.dense.{kind}"] = state[ours + f"ffn.down.{kind}"]
            out[hf + f"output.LayerNorm.{kind}"] = state[ours + f"norm2.{kind}"]
    return out


def bert_mlm_head_state(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Our PredictionHead's state dict (keys without `head.`) under BertForMaskedLM's `cls.` names."""
    return {
        "cls.predictions.transform.dense.weight": state["transform.0.weight"],
        "cls.predictions.transform.dense.bias": state["transform.0.bias"],
        "cls.predictions.transform.LayerNorm.weight": state["transform.2.weight"],
        "cls.predictions.transform.LayerNorm.bias": state["transform.2.bias"],
        "cls.predictions.decoder.weight": state["decoder.weight"],
        "cls.predictions.decoder.bias": state["decoder.bias"],
        "cls.predictions.bias": state["decoder.bias"],
    }


def _prefixed(prefix: str, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {prefix + key: value for key, value in state.items()}


def _submodule_state(module: nn.Module) -> dict[str, torch.Tensor]:
    return {key: value.detach().float().cpu() for key, value in unwrap(module).state_dict().items()}


def _strip(prefix: str, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {key.removeprefix(prefix): value for key, value in state.items() if key.startswith(prefix)}


def check_checkpoint_files(directory: Path) -> None:
    for name in (WEIGHTS, MODEL_CONFIG, TOKENIZER):
        if not (directory / name).is_file():
            raise ExportError(
                f"checkpoint folder {directory} has no {name}: it is incomplete, export needs it"
            )


def _fill(model: PreTrainedModel, state: dict[str, torch.Tensor]) -> PreTrainedModel:
    """Load every weight of `model` from `state`; a weight missing or left over is an error (a mapping bug)."""
    missing, unexpected = model.load_state_dict(state, strict=False)
    if missing or unexpected:
        raise ExportError(
            f"weights do not map onto {type(model).__name__}: missing {missing}, unmapped {unexpected}"
        )
    model.tie_weights()
    return model.eval()


def _write_tokenizer(tokenizer: Tokenizer, special: SpecialTokens, out: Path, max_length: int) -> None:
    """A plain PreTrainedTokenizerFast: the tokenizers file as is (normalizer, [CLS]/[SEP] template) and the
    special-token names. The tokenizer runs no remote code; but transformers 5's AutoTokenizer reads
    config.json first and, for a crammed_bert folder, asks whether to trust its code: pass
    trust_remote_code=True there too (or use PreTrainedTokenizerFast.from_pretrained)."""
    # a copy without truncation or padding: transformers sets those per call
    tokenizer = Tokenizer.from_str(tokenizer.to_str())
    tokenizer.no_truncation()
    tokenizer.no_padding()
    tokenizer.save(str(out / "tokenizer.json"))
    names = {
        f"{kind}_token": tokenizer.id_to_token(getattr(special, kind))
        for kind in ("cls", "sep", "mask", "pad", "unk")
    }
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        **names,
        "model_max_length": max_length,
        "model_input_names": ["input_ids", "token_type_ids", "attention_mask"],
        "clean_up_tokenization_spaces": False,
    }
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
    (out / "special_tokens_map.json").write_text(json.dumps(names, indent=2) + "\n")


def _save(
    model: PreTrainedModel,
    tokenizer: Tokenizer,
    special: SpecialTokens,
    out: Path,
    max_length: int,
    readme: str,
) -> Path:
    """Write the folder; refuses a non-empty `out` rather than mixing two models' files. Written into a
    temporary sibling folder and renamed, so a failed export (a full disk) leaves no half-written model."""
    out = Path(out)
    if out.exists() and not out.is_dir():
        raise ExportError(f"{out} is a file, not a folder: give a folder path (new or empty) to export into")
    if out.exists() and any(out.iterdir()):
        raise ExportError(f"output folder {out} is not empty: remove it or choose another")
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        partial = Path(tempfile.mkdtemp(dir=out.parent, prefix=f".{out.name}.", suffix=".partial"))
    except OSError as err:
        raise ExportError(
            f"cannot create the output folder {out} ({err.strerror}): choose another path"
        ) from err
    try:
        _write_folder(model, tokenizer, special, partial, max_length)
        (partial / card.CARD).write_text(readme)
        partial.chmod(0o755)  # mkdtemp's folder is private
        os.replace(partial, out)  # onto a missing or empty folder
    except OSError as err:
        raise WriteFailed(f"could not write the export to {out}: {err}. Nothing was left there") from err
    finally:
        shutil.rmtree(partial, ignore_errors=True)
    return out


def _write_folder(
    model: PreTrainedModel, tokenizer: Tokenizer, special: SpecialTokens, out: Path, max_length: int
) -> None:
    if isinstance(model.config, crammed.CrammedBertConfig):
        module = MODELING_FILES[0].stem
        # the classes cramming.hf registers, under the same factories: trust_remote_code loads the same heads
        model.config.auto_map = {"AutoConfig": f"{module}.CrammedBertConfig"} | {
            factory: f"{module}.{model_class.__name__}" for factory, model_class in AUTO_CLASSES.items()
        }
        for path in MODELING_FILES:
            shutil.copyfile(path, out / path.name)
    model.save_pretrained(out)
    _write_tokenizer(tokenizer, special, out, max_length)


def model_card(
    model: PreTrainedModel,
    directory: Path,
    base_dir: str | Path,
    glue: str | Path | None,
    labels: list[str] | None = None,
) -> str:
    """The README.md of the folder of `model`, exported from the checkpoint folder `directory` (see
    cramming.hf.card): glue, an evaluation folder of it; None looks for the newest under base_dir."""
    provenance = card.read_provenance(directory, base_dir, glue)
    remote = isinstance(model.config, crammed.CrammedBertConfig)
    return card.model_card(provenance, parameters=model.num_parameters(), remote_code=remote, labels=labels)


def to_transformers(
    checkpoint: str | Path,
    out: str | Path,
    *,
    base_dir: str | Path = "outputs",
    format: str = "auto",
    glue: str | Path | None = None,
) -> Path:
    """Export a checkpoint (run folder, checkpoint folder or run name) as a masked-LM transformers folder,
    with a model card; glue: the eval.py folder whose scores it shows (None: the newest evaluation of this
    checkpoint under base_dir, if any)."""
    directory = resolve_checkpoint(checkpoint, base_dir)
    check_checkpoint_files(directory)
    pretrained = load_pretrained(directory, attention="eager")
    arch, vocab = pretrained.model.arch, pretrained.model.vocab_size
    special = SpecialTokens(**pretrained.config["special_tokens"])
    state = _submodule_state(pretrained.model)
    if choose_format(arch, format) == "bert":
        hf_state = _prefixed("bert.", bert_encoder_state(_strip("encoder.", state), arch.num_layers))
        hf_state |= bert_mlm_head_state(_strip("head.", state))
        model = _fill(BertForMaskedLM(bert_config(arch, vocab, special)), hf_state)
    else:  # the crammed modules carry cramming's names: the state dict loads as is
        model = _fill(crammed.CrammedBertForMaskedLM(crammed_config(arch, vocab, special)), state)
    readme = model_card(model, directory, base_dir, glue)
    return _save(model, pretrained.tokenizer, special, Path(out), arch.max_seq_length, readme)


def _classifier_head(num_labels: int, dropout: float | None, labels: list[str] | None) -> dict:
    """The classification keywords of the exported config; `labels` (if any) names each output."""
    head = {
        "num_labels": num_labels,
        "classifier_dropout": dropout,
        "problem_type": "regression" if num_labels == 1 else "single_label_classification",
    }
    if labels is not None:
        if len(labels) != num_labels:
            raise ExportError(f"{len(labels)} label names for a classifier with {num_labels} outputs")
        head["id2label"] = dict(enumerate(labels))
        head["label2id"] = {name: i for i, name in enumerate(labels)}
    return head


def _classifier_format(arch: ArchConfig, format: str, pooler: nn.Linear | None) -> str:
    """choose_format for a classifier: BERT always pools through Linear(hidden, hidden) -> Tanh, so a head
    without such a pooler falls back from `auto`'s bert to crammed_bert, and an explicit bert is refused."""
    chosen = choose_format(arch, format)
    native_pooler = pooler is not None and pooler.out_features == arch.hidden_size
    if chosen != "bert" or native_pooler:
        return chosen
    if format == "bert":
        raise ExportError(
            "a native BertForSequenceClassification pools through Linear(hidden, hidden) -> Tanh: this"
            " classifier has "
            + ("no pooler" if pooler is None else f"a {pooler.out_features}-wide one")
            + ". Use format crammed_bert."
        )
    return "crammed_bert"


def _bert_classifier(
    config: BertConfig, state: dict[str, torch.Tensor], head_state: dict[str, torch.Tensor]
) -> PreTrainedModel:
    """A native BertForSequenceClassification filled with our encoder's `state` and the head's `head_state`
    (classifier.*, and pooler.0.* as BERT's pooler)."""
    hf_state = _prefixed("bert.", bert_encoder_state(state, config.num_hidden_layers))
    hf_state |= {key.replace("pooler.0.", "bert.pooler.dense."): v for key, v in head_state.items()}
    return _fill(BertForSequenceClassification(config), hf_state)


def classifier_to_transformers(
    checkpoint: str | Path,
    encoder: nn.Module,
    classifier: nn.Linear,
    out: str | Path,
    *,
    pooler: nn.Linear | None = None,
    dropout: float | None = None,
    labels: list[str] | None = None,
    base_dir: str | Path = "outputs",
    format: str = "auto",
    glue: str | Path | None = None,
) -> Path:
    """Export a fine-tuned sequence classifier: `encoder` (our Encoder, fine-tuned from `checkpoint`, which
    supplies arch, tokenizer and special tokens) and its head on the first token's hidden state:
    [pooler -> Tanh] -> Dropout(dropout, None = the arch's) -> classifier. One output means regression.

    A native BertForSequenceClassification always pools (Linear -> Tanh), so format `bert` needs a pooler
    of the hidden width; without one, `auto` writes crammed_bert.
    """
    directory = resolve_checkpoint(checkpoint, base_dir)
    check_checkpoint_files(directory)
    config = json.loads((directory / MODEL_CONFIG).read_text())
    arch, vocab = ArchConfig(**config["arch"]), config["vocab_size"]
    special = SpecialTokens(**config["special_tokens"])
    head = _classifier_head(classifier.out_features, dropout, labels)
    state = _submodule_state(encoder)
    head_state = _prefixed("classifier.", _submodule_state(classifier))
    if pooler is not None:
        head_state |= _prefixed("pooler.0.", _submodule_state(pooler))
    if _classifier_format(arch, format, pooler) == "bert":
        model = _bert_classifier(bert_config(arch, vocab, special, **head), state, head_state)
    else:
        head_dim = {} if pooler is None else {"classifier_head_dim": pooler.out_features}
        hf_config = crammed_config(arch, vocab, special, **head, **head_dim)
        model = _fill(
            crammed.CrammedBertForSequenceClassification(hf_config), _prefixed("encoder.", state) | head_state
        )
    tokenizer = Tokenizer.from_file(str(directory / TOKENIZER))
    names = [model.config.id2label[i] for i in range(classifier.out_features)]
    readme = model_card(model, directory, base_dir, glue, labels=names)
    return _save(model, tokenizer, special, Path(out), arch.max_seq_length, readme)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "checkpoint", help="a run folder, its checkpoint/ folder, or a run name under --base-dir"
    )
    parser.add_argument("out", help="the folder to write (new or empty)")
    parser.add_argument("--base-dir", default="outputs", help="where runs are looked up by name")
    parser.add_argument(
        "--format", default="auto", choices=FORMATS, help="auto: native BERT where it applies"
    )
    parser.add_argument(
        "--glue",
        help="the eval.py folder whose GLUE scores the model card shows (default: the newest evaluation of"
        " this checkpoint under --base-dir)",
    )
    args = parser.parse_args(argv)
    try:
        out = to_transformers(
            args.checkpoint, args.out, base_dir=args.base_dir, format=args.format, glue=args.glue
        )
    except Exception as err:
        from cramming.job import exits  # the command line's exit codes, those of pretrain.py and eval.py

        code = exits.exit_code(err)
        if code is None:  # a bug: its traceback
            raise
        print(f"export failed: {err}", file=sys.stderr)
        sys.exit(code)
    remote = (out / MODELING_FILES[0].name).is_file()
    flag = ", trust_remote_code=True" if remote else ""
    print(f"wrote {out}")
    print(f"load it:  AutoModelForMaskedLM.from_pretrained({str(out)!r}{flag})")
    if remote:
        print("          (no trust_remote_code needed in a process that has imported cramming.hf)")
    print(f"GLUE:     python eval.py checkpoint=hf:{out}")
    print(f"share it: hf upload <user>/<model> {out}   (the model card is {out / card.CARD})")
