"""Hugging Face transformers export (crammed BERT as remote code, BERT natively, classifiers) and import
(any local encoder folder as a fine-tuning Backbone). Skipped when transformers is not installed."""

from __future__ import annotations

import dataclasses
import json
import os
import re
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest
import torch
import yaml
from hydra import compose, initialize_config_dir
from kernel_checks import sum_rtol
from omegaconf import OmegaConf
from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, processors

transformers = pytest.importorskip("transformers")

from cramming.config import CONF_DIR, register_configs  # noqa: E402
from cramming.data.config import NormalizerConfig, TokenizerConfig  # noqa: E402
from cramming.data.tokenizer import SpecialTokens, build_normalizer, train_tokenizer  # noqa: E402
from cramming.errors import ConfigError  # noqa: E402
from cramming.eval.backbone import Backbone  # noqa: E402
from cramming.eval.config import EvalConfig, EvalRunConfig, HeadConfig  # noqa: E402
from cramming.eval.finetune import GlueRuns  # noqa: E402
from cramming.eval.head import SequenceClassifier  # noqa: E402
from cramming.eval.run import RESULTS_JSON, glue_report  # noqa: E402
from cramming.eval.scores import summarize  # noqa: E402
from cramming.eval.tasks import GLUE_TASKS  # noqa: E402
from cramming.hf import AUTO_CLASSES, CrammedBertForMaskedLM, CrammedBertModel  # noqa: E402
from cramming.hf.export import (  # noqa: E402
    ExportError,
    classifier_to_transformers,
    crammed_config,
    to_transformers,
)
from cramming.hf.export import main as export_main  # noqa: E402
from cramming.hf.load import load_hf_backbone  # noqa: E402
from cramming.job.runcard import RunCard  # noqa: E402
from cramming.model import ArchConfig, BertForMLM, bert, build_model, modeling_crammed_bert  # noqa: E402
from cramming.model.checkpoint import TOKENIZER, save_pretrained  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
# fp32 on the CPU, the same operations in the same order on both sides: what is left is the summation order
# inside library kernels (another batch shape, thread count or CPU picks other blocking and FMA paths). Values
# are of order 1; each of the DEPTH sequential reductions (per layer: two norms, attention's two matmuls, the
# projections; then the head) sums at most WIDEST terms, each order allowed kernel_checks.sum_rtol
DEPTH, WIDEST = 2 * 5 + 2, 300  # the test models: 2 layers, intermediate_size <= 256, vocabulary <= 300
ATOL = DEPTH * sum_rtol(WIDEST)
TEXTS = [
    "The capital of France is Paris, and the capital of Germany is Berlin.",
    "Paris is a large city on the river Seine in the north of France.",
    "Berlin is the largest city of Germany and lies on the river Spree.",
    "The river flows through the city and into the sea.",
    "A small model is trained on one GPU in a single day.",
    "The model reads a sentence and predicts the missing word.",
    "Many people live in the city, and many more visit it every year.",
    "The north of the country is cold, the south is warm.",
] * 4
SENTENCE = "The capital of France is [MASK]."


def arch(name: str, **overrides) -> ArchConfig:
    cfg = OmegaConf.merge(
        OmegaConf.structured(ArchConfig), OmegaConf.load(REPO / "conf" / "arch" / f"{name}.yaml"), overrides
    )
    return OmegaConf.to_object(cfg)


TINY = {"max_seq_length": 64}
SMALL_BERT_BASE = {
    "num_layers": 2,
    "hidden_size": 32,
    "num_heads": 4,
    "intermediate_size": 64,
    "max_seq_length": 64,
}


def make_checkpoint(folder: Path, arch_config: ArchConfig) -> tuple[BertForMLM, Path]:
    """A checkpoint as pretraining writes it: our tokenizer pipeline on TEXTS, and a model whose every weight
    (LayerNorm gains and biases included, zero or one at initialization) is random, so a misplaced one shows."""
    norm_cfg = NormalizerConfig()
    norm = build_normalizer(norm_cfg)
    tokenizer = train_tokenizer(
        [[norm.normalize_str(t) for t in TEXTS]], TokenizerConfig(vocab_size=300, min_frequency=1), norm_cfg
    )
    model = build_model(arch_config, tokenizer.get_vocab_size())
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    directory = save_pretrained(
        model, folder / "checkpoint", tokenizer, seq_length=64, special=SpecialTokens(), info={"updates": 0}
    )
    return model.eval(), directory


def all_logits(model: BertForMLM, ids, mask=None, types=None) -> torch.Tensor:
    with torch.no_grad():
        return model.head(model.encoder(ids, mask, types))  # (batch, seq, vocab)


def encode_batch(tokenizer: Tokenizer, pairs) -> dict[str, torch.Tensor]:
    """Pairs and single sentences padded to the longest: real inputs with a padding mask."""
    encodings = tokenizer.encode_batch(pairs)
    longest = max(len(e.ids) for e in encodings)
    ids = torch.zeros(len(pairs), longest, dtype=torch.long)
    types = torch.zeros_like(ids)
    mask = torch.zeros_like(ids)
    for row, e in enumerate(encodings):
        ids[row, : len(e.ids)] = torch.tensor(e.ids)
        types[row, : len(e.ids)] = torch.tensor(e.type_ids)
        mask[row, : len(e.ids)] = 1
    return {"input_ids": ids, "attention_mask": mask, "token_type_ids": types}


PAIRS = [(TEXTS[0], TEXTS[1]), (TEXTS[3], TEXTS[6]), (TEXTS[4], TEXTS[7])]  # of three lengths: padding


@pytest.fixture(scope="module")
def crammed(tmp_path_factory):
    """A tiny crammed-bert checkpoint and its export."""
    root = tmp_path_factory.mktemp("crammed")
    model, checkpoint = make_checkpoint(root / "run", arch("tiny", **TINY))
    out = to_transformers(checkpoint, root / "hf")
    return model, checkpoint, out


# Run in a fresh interpreter that cannot import cramming: -I (no cwd, no PYTHON* variables) and -S (no site:
# the editable install's finder is a .pth hook), with site-packages put back by hand. cwd is outside the repo.
# AutoTokenizer is called as a user would, without trust_remote_code: transformers 5 reads config.json first
# and, finding remote code there, asks whether to run it; with no terminal (stdin closed) it takes "no" and
# falls back to the plain tokenizer, which needs nothing from the remote code.
FRESH_SCRIPT = """
import json, sys
sys.path.append({site!r})
try:
    import cramming
    raise SystemExit("cramming is importable: the test would prove nothing")
except ModuleNotFoundError:
    pass
import torch
from transformers import AutoModel, AutoModelForMaskedLM, AutoTokenizer, pipeline

out = {out!r}
tokenizer = AutoTokenizer.from_pretrained(out)
batch = tokenizer({firsts!r}, {seconds!r}, padding=True, return_tensors="pt")
mlm = AutoModelForMaskedLM.from_pretrained(out, trust_remote_code=True).eval()
base = AutoModel.from_pretrained(out, trust_remote_code=True).eval()
with torch.no_grad():
    logits = mlm(**batch).logits
    hidden = base(**batch).last_hidden_state
fill = pipeline("fill-mask", model=out, trust_remote_code=True, top_k=5)
torch.save(
    {{
        "batch": dict(batch),
        "logits": logits,
        "hidden": hidden,
        "class": type(mlm).__name__,
        "tokenizer": type(tokenizer).__name__,
        "fill": fill({sentence!r}),
    }},
    {result!r},
)
"""


@pytest.fixture(scope="module")
def fresh(crammed, tmp_path_factory) -> dict:
    """The export loaded by transformers alone, in another process."""
    _, _, out = crammed
    work = tmp_path_factory.mktemp("fresh")
    script = FRESH_SCRIPT.format(
        site=sysconfig.get_paths()["purelib"],
        out=str(out),
        firsts=[a for a, _ in PAIRS],
        seconds=[b for _, b in PAIRS],
        result=str(work / "result.pt"),
        sentence=SENTENCE,
    )
    env = {"HF_HOME": str(work / "hf_home"), "HF_HUB_OFFLINE": "1", "PATH": "/usr/bin:/bin"}
    done = subprocess.run(
        [sys.executable, "-I", "-S", "-c", script],
        cwd=work,
        env=env,
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return torch.load(work / "result.pt")


@pytest.mark.slow  # a second Python process importing torch and transformers
def test_crammed_export_runs_in_transformers_alone(crammed, fresh):
    model, checkpoint, out = crammed
    result = fresh
    assert result["class"] == "CrammedBertForMaskedLM"
    assert sorted(p.name for p in out.iterdir()) == [
        "README.md",
        "bert.py",
        "config.json",
        "model.safetensors",
        "modeling_crammed_bert.py",
        "special_tokens_map.json",
        "tokenizer.json",
        "tokenizer_config.json",
    ]
    for module in (bert, modeling_crammed_bert):  # the code that trained, not a copy kept in step by hand
        assert (out / Path(module.__file__).name).read_bytes() == Path(module.__file__).read_bytes()
    ours = encode_batch(Tokenizer.from_file(str(checkpoint / TOKENIZER)), PAIRS)
    batch = result["batch"]
    for key in ("input_ids", "token_type_ids", "attention_mask"):  # the exported tokenizer is ours
        torch.testing.assert_close(batch[key], ours[key], rtol=0, atol=0, msg=f"tokenizer: {key} differ")
    expected = all_logits(model, batch["input_ids"], batch["attention_mask"])
    difference = (result["logits"] - expected).abs().max().item()
    print(f"crammed export, fresh process: max |logits - ours| = {difference:.3g}")
    assert difference <= ATOL, (
        f"max abs difference {difference:.3g} at {(result['logits'] - expected).abs().argmax()}"
    )
    with torch.no_grad():
        hidden = model.encoder(batch["input_ids"], batch["attention_mask"])
    torch.testing.assert_close(result["hidden"], hidden, rtol=0, atol=ATOL)


# AutoTokenizer as docs/export.md gives it, in a terminal whose standard input is open (a closed one answers a
# question "no" at once, hiding it): transformers 5 reads config.json first, and without trust_remote_code=True
# asks whether to run the folder's code and waits for an answer. Prints LOADED and the class on success.
TERMINAL_SCRIPT = """
import sys
sys.path.append({site!r})
from transformers import AutoTokenizer
tokenizer = AutoTokenizer.from_pretrained({out!r}, trust_remote_code=True)
print("LOADED", type(tokenizer).__name__, tokenizer("a small model")["input_ids"][:1])
"""


def in_a_terminal(argv: list[str], env: dict, seconds: float = 120) -> tuple[str, bool]:
    """(what a command printed in a pseudo-terminal with its standard input open, whether it asked [y/N]): a
    question is answered by nobody, so the command is ended as soon as one shows."""
    import pty
    import select
    import time

    pid, fd = pty.fork()
    if pid == 0:  # the child: the terminal is its stdin, stdout and stderr
        os.execve(argv[0], argv, env)
    output, asked, deadline = b"", False, time.monotonic() + seconds
    while time.monotonic() < deadline and not asked:
        if select.select([fd], [], [], 0.5)[0]:
            try:
                chunk = os.read(fd, 4096)
            except OSError:  # the child closed the terminal: it ended
                break
            if not chunk:
                break
            output += chunk
            asked = b"[y/N]" in output
    if asked or time.monotonic() >= deadline:
        os.kill(pid, 9)
    os.waitpid(pid, 0)
    os.close(fd)
    return output.decode(errors="replace"), asked


@pytest.mark.slow  # a second Python process importing transformers
def test_the_exported_tokenizer_loads_in_a_terminal_without_a_question(crammed, tmp_path):
    _, _, out = crammed
    script = TERMINAL_SCRIPT.format(site=sysconfig.get_paths()["purelib"], out=str(out))
    env = {
        "HF_HOME": str(tmp_path / "hf_home"),
        "HF_HUB_OFFLINE": "1",
        "PATH": "/usr/bin:/bin",
        "TERM": "dumb",
    }
    output, asked = in_a_terminal([sys.executable, "-I", "-S", "-c", script], env)
    assert not asked, f"it asked whether to run the folder's code:\n{output[-2000:]}"
    assert "LOADED" in output and "model of type" not in output, output[-2000:]


@pytest.mark.slow  # a second Python process importing torch and transformers
def test_fill_mask_pipeline_ranks_as_our_model(crammed, fresh):
    model, checkpoint, _ = crammed
    answer = fresh
    assert answer["tokenizer"] in ("PreTrainedTokenizerFast", "TokenizersBackend")
    tokenizer = Tokenizer.from_file(str(checkpoint / TOKENIZER))
    encoding = tokenizer.encode(SENTENCE)
    position = encoding.ids.index(SpecialTokens().mask)
    probs = all_logits(model, torch.tensor([encoding.ids]))[0, position].softmax(-1)
    top = probs.topk(5)
    assert [r["token"] for r in answer["fill"]] == top.indices.tolist()
    torch.testing.assert_close(
        torch.tensor([r["score"] for r in answer["fill"]]), top.values, rtol=0, atol=ATOL
    )
    for r in answer["fill"]:  # the sentence with the mask filled in, decoded
        assert r["sequence"].startswith("the capital of france is") and "[MASK]" not in r["sequence"]


def test_registered_in_process_without_remote_code(crammed):
    model, checkpoint, out = crammed
    config = json.loads((out / "config.json").read_text())
    assert config["model_type"] == "crammed_bert"
    # the folder's remote code serves every class this process registers, under the same factory
    assert config["auto_map"] == {"AutoConfig": "modeling_crammed_bert.CrammedBertConfig"} | {
        factory: f"modeling_crammed_bert.{model_class.__name__}"
        for factory, model_class in AUTO_CLASSES.items()
    }
    mlm = transformers.AutoModelForMaskedLM.from_pretrained(out).eval()
    base = transformers.AutoModel.from_pretrained(out).eval()
    assert isinstance(mlm, CrammedBertForMaskedLM) and isinstance(base, CrammedBertModel)
    assert mlm.head.decoder.weight is mlm.encoder.embeddings.word.weight
    batch = encode_batch(Tokenizer.from_file(str(checkpoint / TOKENIZER)), PAIRS)
    with torch.no_grad():
        got = mlm(**batch).logits
        hidden = base(**batch).last_hidden_state
        expected_hidden = model.encoder(batch["input_ids"], batch["attention_mask"])
    torch.testing.assert_close(
        got, all_logits(model, batch["input_ids"], batch["attention_mask"]), rtol=0, atol=ATOL
    )
    torch.testing.assert_close(hidden, expected_hidden, rtol=0, atol=ATOL)
    # a new head on the pretrained encoder: transformers initializes what the folder lacks, and only that
    fresh_head = transformers.AutoModelForSequenceClassification.from_pretrained(out, num_labels=2).eval()
    assert fresh_head.classifier.weight.std() > 0
    with torch.no_grad():
        torch.testing.assert_close(
            fresh_head.encoder(**batch).last_hidden_state, expected_hidden, rtol=0, atol=ATOL
        )


def test_bert_base_exports_as_native_bert(tmp_path):
    model, checkpoint = make_checkpoint(tmp_path / "run", arch("bert-base", **SMALL_BERT_BASE))
    out = to_transformers(checkpoint, tmp_path / "hf")
    config = json.loads((out / "config.json").read_text())
    assert config["model_type"] == "bert" and "auto_map" not in config
    assert not (out / "modeling_crammed_bert.py").exists() and not (out / "bert.py").exists()
    metadata, card = read_card(out)  # transformers' own BERT: no remote code to trust
    assert metadata["tags"] == ["cramming", "bert"] and "trust_remote_code" not in card
    hf = transformers.BertForMaskedLM.from_pretrained(out).eval()
    batch = encode_batch(Tokenizer.from_file(str(checkpoint / TOKENIZER)), PAIRS)
    assert batch["token_type_ids"].any()  # the token-type embeddings are exercised
    with torch.no_grad():
        got = hf(**batch).logits
    expected = all_logits(model, batch["input_ids"], batch["attention_mask"], batch["token_type_ids"])
    difference = (got - expected).abs().max().item()
    print(f"bert-base export, native BertForMaskedLM: max |logits - ours| = {difference:.3g}")
    assert difference <= ATOL


@pytest.mark.parametrize(
    ("name", "overrides"),
    [
        # BERT's options through the crammed_bert file: post-LN, learned positions, token types, biases,
        # plain GELU FFN, head transform, decoder bias
        ("bert-base", SMALL_BERT_BASE),
        # the switches neither preset flips: no LayerNorm bias, untied decoder, no embedding/final norm
        (
            "tiny",
            {
                **TINY,
                "norm_bias": False,
                "tie_embeddings": False,
                "embedding_norm": False,
                "final_norm": False,
                "head_transform": True,
                "decoder_bias": True,
                "type_vocab_size": 2,
            },
        ),
        # the ALiBi distance bias, with the default slopes and with given ones
        ("tiny", {**TINY, "attention_bias": "alibi"}),
        ("tiny", {**TINY, "attention_bias": "alibi", "alibi_slopes": [0.5, 0.0]}),
    ],
)
def test_every_arch_option_exports_as_crammed_bert(tmp_path, name, overrides):
    model, checkpoint = make_checkpoint(tmp_path / "run", arch(name, **overrides))
    out = to_transformers(checkpoint, tmp_path / "hf", format="crammed_bert")
    hf = transformers.AutoModelForMaskedLM.from_pretrained(out).eval()
    assert isinstance(hf, CrammedBertForMaskedLM)
    tied = hf.head.decoder.weight is hf.encoder.embeddings.word.weight
    assert tied == model.arch.tie_embeddings
    batch = encode_batch(Tokenizer.from_file(str(checkpoint / TOKENIZER)), PAIRS)
    with torch.no_grad():
        got = hf(**batch).logits
    expected = all_logits(model, batch["input_ids"], batch["attention_mask"], batch["token_type_ids"])
    torch.testing.assert_close(got, expected, rtol=0, atol=ATOL)


@pytest.mark.parametrize(
    ("name", "pooler_width", "model_type"),
    [
        ("tiny", 0, "crammed_bert"),  # the bare linear head: dropout -> Linear on the first token
        # cramming's GLUE head (eval.head default, narrower): Linear(hidden, 48) -> Tanh -> dropout -> Linear
        ("tiny", 48, "crammed_bert"),
        ("bert-base", 32, "bert"),  # BERT's own pooler: a native BertForSequenceClassification
        ("bert-base", 0, "crammed_bert"),  # BERT cannot skip its pooler: remote code
    ],
)
def test_sequence_classifier_export(tmp_path, name, pooler_width, model_type):
    overrides = SMALL_BERT_BASE if name == "bert-base" else TINY
    model, checkpoint = make_checkpoint(tmp_path / "run", arch(name, **overrides))
    hidden_size = model.arch.hidden_size
    # our fine-tuning classifier itself (cramming.eval.head), with every head weight random
    ours = SequenceClassifier(model.encoder, hidden_size, 3, dropout=0.1, head=HeadConfig(dim=pooler_width))
    pooler, classifier = ours.dense, ours.head
    with torch.no_grad():
        for p in [*classifier.parameters(), *(pooler.parameters() if pooler is not None else [])]:
            p.normal_()
    out = classifier_to_transformers(
        checkpoint, ours.encoder, classifier, tmp_path / "hf", pooler=pooler, labels=["a", "b", "c"]
    )
    config = json.loads((out / "config.json").read_text())
    assert config["model_type"] == model_type and config["id2label"] == {"0": "a", "1": "b", "2": "c"}
    metadata, card = read_card(out)
    assert metadata["pipeline_tag"] == "text-classification" and "(labels: a, b, c)" in card
    hf = transformers.AutoModelForSequenceClassification.from_pretrained(out).eval()
    batch = encode_batch(Tokenizer.from_file(str(checkpoint / TOKENIZER)), PAIRS)
    ours.eval()
    with torch.no_grad():
        expected = ours(batch["input_ids"], batch["attention_mask"], batch["token_type_ids"])
        got = hf(**batch).logits
    assert got.shape == (len(PAIRS), 3)
    torch.testing.assert_close(got, expected, rtol=0, atol=ATOL)
    labels = torch.tensor([0, 2, 1])
    with torch.no_grad():
        loss = hf(**batch, labels=labels).loss
    torch.testing.assert_close(loss, torch.nn.functional.cross_entropy(expected, labels), rtol=0, atol=ATOL)


def test_the_config_carries_every_arch_field_that_changes_the_output():
    ours = arch("bert-base", **SMALL_BERT_BASE, attention_bias="alibi", alibi_slopes=[0.5, 0.0, 1.0, 0.25])
    back = crammed_config(ours, 100, SpecialTokens()).to_arch()
    for field in dataclasses.fields(ours):
        if field.name not in modeling_crammed_bert.NOT_EXPORTED:
            assert getattr(back, field.name) == getattr(ours, field.name), field.name
    assert back.padding_idx is None  # transformers fine-tunes the [PAD] row as any other


def test_export_errors_name_the_problem(crammed, tmp_path):
    _, checkpoint, _ = crammed
    with pytest.raises(ExportError, match="not empty"):
        to_transformers(checkpoint, checkpoint)
    with pytest.raises(ExportError, match=r"arch.ffn='glu' \(BERT: 'gelu'\).*arch.norm_scheme"):
        to_transformers(checkpoint, tmp_path / "bert", format="bert")
    incomplete = tmp_path / "incomplete"
    incomplete.mkdir()
    for name in ("model.safetensors", "model_config.json"):
        (incomplete / name).write_bytes((checkpoint / name).read_bytes())
    with pytest.raises(ExportError, match="has no tokenizer.json"):
        to_transformers(incomplete, tmp_path / "out")
    odd = arch("tiny")
    odd.ffn = "swiglu"  # an option a later cramming might add and the modeling file does not know
    with pytest.raises(ExportError, match="ffn='swiglu'"):
        crammed_config(odd, 100, SpecialTokens())


def test_missing_transformers_says_how_to_install(monkeypatch):
    import importlib

    monkeypatch.setitem(sys.modules, "transformers", None)  # None in sys.modules: the import fails
    monkeypatch.delitem(sys.modules, "cramming.hf")
    with pytest.raises(ImportError, match=r"pip install -e '\.\[hf\]'"):
        importlib.import_module("cramming.hf")


@pytest.mark.slow  # a second Python process importing torch and transformers
def test_export_script_finds_a_run_by_name(crammed, tmp_path, capsys):
    _, checkpoint, _ = crammed
    run = tmp_path / "outputs" / "demo" / "2026-01-01_00-00-00"  # {base_dir}/{name}/{start time}/checkpoint
    shutil.copytree(checkpoint, run / "checkpoint")
    command = [sys.executable, str(REPO / "scripts" / "export_hf.py"), "demo", str(tmp_path / "hf")]
    done = subprocess.run(
        [*command, "--base-dir", str(tmp_path / "outputs")], capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert (tmp_path / "hf" / "config.json").is_file()
    assert "trust_remote_code=True" in done.stdout and "checkpoint=hf:" in done.stdout
    with pytest.raises(SystemExit) as ended:  # one clear line, the exit code of a user's error
        export_main(["nosuch", str(tmp_path / "hf2"), "--base-dir", str(tmp_path / "outputs")])
    assert ended.value.code == 2
    assert "export failed: no checkpoint at nosuch" in capsys.readouterr().err


def tiny_bert_folder(folder: Path) -> Path:
    """A randomly initialized BertForMaskedLM and a WordPiece tokenizer built here, saved as transformers does."""
    words = sorted({w.strip(".,").lower() for t in TEXTS for w in t.split()})
    vocab = {token: i for i, token in enumerate(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *words])}
    tok = Tokenizer(models.WordPiece(vocab, unk_token="[UNK]"))
    tok.normalizer = normalizers.BertNormalizer(lowercase=True)
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tok.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]",
        pair="[CLS] $A [SEP] $B:1 [SEP]:1",
        special_tokens=[("[CLS]", 2), ("[SEP]", 3)],
    )
    config = transformers.BertConfig(
        vocab_size=len(vocab), hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
        max_position_embeddings=64, hidden_dropout_prob=0.15,
    )  # fmt: skip
    transformers.BertForMaskedLM(config).save_pretrained(folder)
    fast = transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok, cls_token="[CLS]", sep_token="[SEP]", pad_token="[PAD]", unk_token="[UNK]",
        mask_token="[MASK]",
    )  # fmt: skip
    fast.save_pretrained(folder)
    return folder


def test_load_hf_backbone_wraps_a_bert_folder(tmp_path):
    folder = tiny_bert_folder(tmp_path / "bert")
    backbone = load_hf_backbone(folder, "cpu")
    assert (backbone.hidden_size, backbone.dropout, backbone.pad_id) == (32, 0.15, 0)
    assert backbone.info["model_type"] == "bert" and backbone.info["architectures"] == ["BertForMaskedLM"]
    pair = backbone.tokenizer.encode("Paris is a city", "Berlin is a city")
    assert pair.tokens[0] == "[CLS]" and pair.tokens[-1] == "[SEP]" and pair.type_ids[-1] == 1
    reference = transformers.BertModel.from_pretrained(folder, add_pooling_layer=False).eval()
    batch = encode_batch(backbone.tokenizer, PAIRS)
    mask = batch["attention_mask"].bool()  # fine-tuning passes a bool mask
    backbone.encoder.eval()
    with torch.no_grad():
        got = backbone.encoder(batch["input_ids"], mask, batch["token_type_ids"])
        expected = reference(**batch).last_hidden_state
    assert got.shape == (len(PAIRS), batch["input_ids"].shape[1], 32)
    torch.testing.assert_close(got, expected, rtol=0, atol=ATOL)


def test_load_hf_backbone_refuses_a_tokenizer_without_special_tokens(tmp_path):
    folder = tiny_bert_folder(tmp_path / "bert")
    tok = Tokenizer.from_file(str(folder / "tokenizer.json"))
    tok.post_processor = None
    tok.save(str(folder / "tokenizer.json"))
    with pytest.raises(ValueError, match=r"post-processor does not put special tokens around"):
        load_hf_backbone(folder, "cpu")
    (folder / "tokenizer.json").unlink()
    with pytest.raises(FileNotFoundError, match="has no tokenizer.json"):
        load_hf_backbone(folder, "cpu")


def test_exported_crammed_model_round_trips_as_a_backbone(crammed):
    model, checkpoint, out = crammed
    backbone = load_hf_backbone(out, "cpu")
    assert (backbone.hidden_size, backbone.dropout, backbone.pad_id) == (64, 0.1, 0)
    assert backbone.tokenizer.to_str() == Tokenizer.from_file(str(checkpoint / TOKENIZER)).to_str()
    batch = encode_batch(backbone.tokenizer, PAIRS)
    backbone.encoder.eval()
    with torch.no_grad():
        got = backbone.encoder(batch["input_ids"], batch["attention_mask"].bool(), batch["token_type_ids"])
        expected = model.encoder(batch["input_ids"], batch["attention_mask"].bool(), batch["token_type_ids"])
    torch.testing.assert_close(got, expected, rtol=0, atol=ATOL)


@pytest.mark.slow
def test_eval_py_fine_tunes_a_transformers_folder(tmp_path, glue_dir):
    """`python eval.py checkpoint=hf:<folder>`: the same GLUE runner on any local transformers encoder."""
    folder = tiny_bert_folder(tmp_path / "bert")
    done = subprocess.run(
        [
            sys.executable, "eval.py", f"checkpoint=hf:{folder}", f"base_dir={tmp_path / 'out'}", "name=hf",
            f"eval.glue_dir={glue_dir}", "eval.tasks=[RTE]", "eval.epochs=1", "eval.max_train_examples=32",
            "eval.max_eval_examples=32", "impl.device=cpu", "impl.cpu_threads=1",
        ],
        cwd=REPO, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    (results,) = (tmp_path / "out" / "hf").glob("*/glue_results.json")
    report = json.loads(results.read_text())
    assert set(report["scores"]) == {"RTE"} and report["checkpoint"] == str(folder.resolve())
    assert report["runs"][0]["steps"] == 2  # 32 examples, batch 16, one epoch


# ------------------------------------------------------------------------------------------ the model card


def read_card(folder: Path) -> tuple[dict, str]:
    """The README.md of an exported folder: its YAML front matter, and the text below it."""
    text = (folder / "README.md").read_text()
    assert text.startswith("---\n"), text[:200]
    front, body = text.removeprefix("---\n").split("\n---\n", 1)
    return yaml.safe_load(front), body


def project_license() -> str:
    found = re.search(r'^license = \{ text = "([^"]+)" \}', (REPO / "pyproject.toml").read_text(), re.M)
    return found.group(1).lower()


def test_model_card_without_a_run_card_or_glue(crammed):
    _, _, out = crammed
    metadata, body = read_card(out)
    assert metadata == {
        "library_name": "transformers",
        "license": project_license(),
        "pipeline_tag": "fill-mask",
        "tags": ["cramming", "bert", "crammed_bert", "custom_code"],
    }
    assert "`arch=tiny`: 2 layers, hidden size 64, 2 attention heads" in body
    assert "trust_remote_code=True" in body and "AutoModelForQuestionAnswering" in body
    assert "its run left no run card" in body and "| Data | not recorded |" in body
    assert "No GLUE evaluation is recorded for this checkpoint." in body


def pretraining_run_card(run_dir: Path, overrides: list[str], training: dict) -> dict:
    """The run card pretrain.py leaves beside its checkpoint, written by cramming's RunCard from the config
    these overrides compose: 40,000 rows of 128 tokens trained."""
    register_configs()
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        config = OmegaConf.to_container(compose("pretrain", overrides=overrides), resolve=True)
    card = RunCard(run_dir, "pretrain", config, {"overrides": overrides})
    stats = {"cache_key": "wikibooks-0123", "train_rows": 5000, "seq_length": 128}
    card.record_pretraining_data(run_dir / "data", stats, vocab_size=300)
    card.record_pretraining(
        stop_reason=training["stop_reason"], updates=training["updates"], rows=40_000,
        elapsed=training["elapsed_h"] * 3600, elapsed_before=0.0, validation=training["validation"],
        finished=True,
    )  # fmt: skip
    card.end("ok")
    return config


def glue_evaluation(folder: Path, checkpoint: str, training: dict, scores: dict[str, float]) -> Path:
    """An evaluation folder as eval.py leaves it: glue_results.json, made by cramming's glue_report from one
    seed's main metric per task."""
    per_entry = {task: [{GLUE_TASKS[task].metrics[0]: score}] for task, score in scores.items()}
    backbone = Backbone(
        torch.nn.Identity(), 64, 0.1, None, 0, info={"checkpoint": checkpoint, "pretraining": training}
    )
    config = EvalRunConfig(eval=EvalConfig(), checkpoint=checkpoint)
    report = glue_report(config, backbone, GlueRuns(per_entry), summarize(per_entry), [], {}, 0.0)
    folder.mkdir(parents=True)
    (folder / RESULTS_JSON).write_text(json.dumps(report, indent=2))
    return folder


TRAINING = {"updates": 1234, "elapsed_h": 23.9, "stop_reason": "budget",
            "validation": {"loss": 2.3456, "mlm_acc": 0.55}}  # fmt: skip


def provenance_checkpoint(base: Path) -> tuple[Path, Path, dict]:
    """A finished pretraining run under base/demo/ (a tiny model recorded as a 24-hour wikibooks run),
    its checkpoint folder and its run card's config."""
    run_dir = base / "demo" / "2026-01-01_00-00-00"
    _, checkpoint = make_checkpoint(run_dir, arch("tiny", **TINY))
    config = json.loads((checkpoint / "model_config.json").read_text())
    (checkpoint / "model_config.json").write_text(json.dumps(config | {"training": TRAINING}))
    overrides = ["arch=tiny", "data=wikibooks", "budget=24", "name=demo", f"base_dir={base}",
                 f"anytime.recipe.glue_dir={base}/glue-data"]  # fmt: skip
    return run_dir, checkpoint, pretraining_run_card(run_dir, overrides, TRAINING)


def test_model_card_holds_the_runs_provenance_and_its_glue_scores(tmp_path):
    base = tmp_path / "outputs"
    run_dir, checkpoint, config = provenance_checkpoint(base)
    scores = {"MRPC": 0.8125, "RTE": 0.6, "WNLI": 0.5}
    older = glue_evaluation(base / "glue" / "2026-01-01_12-00-00", str(checkpoint), TRAINING, {"RTE": 0.1})
    os.utime(older / RESULTS_JSON, (1, 1))
    # the newest evaluation of it names it where the runs lay on the machine that evaluated them
    moved = str(Path("/elsewhere") / checkpoint.relative_to(tmp_path))
    glue_evaluation(base / "glue" / "2026-01-02_00-00-00", moved, TRAINING, scores)
    # the same path's tail with another pretraining record: another checkpoint
    other = TRAINING | {"updates": 99}
    glue_evaluation(base / "glue" / "2026-01-03_00-00-00", moved, other, {"RTE": 0.99})
    out = to_transformers(run_dir, tmp_path / "hf", base_dir=base)
    metadata, body = read_card(out)
    assert metadata["datasets"] == ["wikimedia/wikipedia", "bookcorpus/bookcorpus"]
    assert metadata["pipeline_tag"] == "fill-mask" and metadata["license"] == project_license()
    print(body)
    for row in [
        "| Data | `data=wikibooks`: wikimedia/wikipedia (20231101.en), bookcorpus/bookcorpus at revision"
        " refs/convert/parquet; 5,000 training rows of 128 tokens |",
        "| Trained | 5,120,000 tokens in 1,234 updates (stopped by: budget) |",
        "| Budget | 24 h allowed, 23.9 h spent |",
        f"| Optimizer | {config['train']['optim']['name']} |",
        "| Validation MLM loss | 2.3456 (masked-token accuracy 55.0%) |",
        "| Command | `python pretrain.py arch=tiny data=wikibooks budget=24 name=demo` |",
    ]:
        assert row in body
    assert body.startswith("\n# demo\n") and "`arch=tiny`" in body
    assert "glue-sane" in body and "from the evaluation `glue/2026-01-02_00-00-00`" in body
    assert "| MRPC | f1 | 81.2 |" in body and "| RTE | accuracy | 60.0 |" in body
    assert "Average over 2 entries (WNLI never counts): 70.6." in body
    assert "| 10.0 |" not in body and "| 99.0 |" not in body
    assert str(tmp_path) not in body  # no path of this machine on the model's public page


def test_model_card_takes_the_evaluation_it_is_given(tmp_path):
    base = tmp_path / "outputs"
    run_dir, checkpoint, _ = provenance_checkpoint(base)
    chosen = glue_evaluation(tmp_path / "evals" / "rte-only", str(checkpoint), TRAINING, {"RTE": 0.625})
    out = to_transformers(run_dir, tmp_path / "hf", base_dir=base, glue=chosen)
    _, body = read_card(out)
    assert "| RTE | accuracy | 62.5 |" in body and "from the evaluation `rte-only`" in body
    stranger = glue_evaluation(tmp_path / "evals" / "other", "/runs/x/checkpoint", TRAINING, {"RTE": 0.5})
    with pytest.raises(ConfigError, match=r"that evaluation is of /runs/x/checkpoint, not of"):
        to_transformers(run_dir, tmp_path / "hf2", base_dir=base, glue=stranger)
    with pytest.raises(ConfigError, match="no glue_results.json there"):
        to_transformers(run_dir, tmp_path / "hf3", base_dir=base, glue=tmp_path / "evals")
