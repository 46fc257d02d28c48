"""The fine-tuning heads an export serves beside the masked LM and the sequence classifier: token
classification, question answering and multiple choice. Each is built from an export of a tiny checkpoint,
trained a few steps on data written here, saved and loaded back (by the classes cramming.hf registers, and by
transformers alone through the folder's remote code), and computes what transformers' own BERT heads compute.
Skipped when transformers is not installed."""

from __future__ import annotations

import copy
import subprocess
import sys
import sysconfig
from dataclasses import dataclass

import pytest
import torch
from tokenizers import Tokenizer

transformers = pytest.importorskip("transformers")

from test_hf import ATOL, SMALL_BERT_BASE, TEXTS, TINY, arch, encode_batch, make_checkpoint  # noqa: E402

from cramming.hf import (  # noqa: E402
    CrammedBertForMultipleChoice,
    CrammedBertForQuestionAnswering,
    CrammedBertForTokenClassification,
)
from cramming.hf.export import to_transformers  # noqa: E402
from cramming.model.checkpoint import TOKENIZER  # noqa: E402
from cramming.utils import seed_everything  # noqa: E402

# (question, context, the answer as it is written in the context)
QUESTIONS = [
    ("Where is Paris?", TEXTS[1], "on the river Seine"),
    ("What is the capital of Germany?", TEXTS[0], "Berlin"),
    ("What lies on the river Spree?", TEXTS[2], "Berlin"),
    ("What does the model predict?", TEXTS[5], "the missing word"),
]
# (prompt, choices, the right choice's index)
CHOICES = [
    ("The capital of France is", ["Paris.", "Berlin.", "the sea."], 0),
    ("Berlin lies on the river", ["Seine.", "Spree.", "north."], 1),
    ("A small model is trained on one", ["city.", "river.", "GPU."], 2),
]


def token_batch(tokenizer: Tokenizer) -> dict[str, torch.Tensor]:
    """Single sentences, each real token labelled by its id modulo 3; [CLS], [SEP] and padding: -100."""
    batch = encode_batch(tokenizer, TEXTS[:4])
    labels = batch["input_ids"] % 3
    special = (batch["input_ids"] <= 4) | (batch["attention_mask"] == 0)  # pad, unk, cls, sep, mask ids
    labels[special] = -100
    return batch | {"labels": labels}


def qa_batch(tokenizer: Tokenizer) -> dict[str, torch.Tensor]:
    """(question, context) pairs; start and end positions: the tokens of the answer's first and last
    character in the context (the second sequence of the pair)."""
    batch = encode_batch(tokenizer, [(q, c) for q, c, _ in QUESTIONS])
    starts, ends = [], []
    for (_, context, answer), encoding in zip(
        QUESTIONS, tokenizer.encode_batch([(q, c) for q, c, _ in QUESTIONS]), strict=True
    ):
        first = context.index(answer)
        starts.append(encoding.char_to_token(first, 1))
        ends.append(encoding.char_to_token(first + len(answer) - 1, 1))
    assert None not in starts + ends, "an answer's characters map to no token"
    return batch | {"start_positions": torch.tensor(starts), "end_positions": torch.tensor(ends)}


def mc_batch(tokenizer: Tokenizer) -> dict[str, torch.Tensor]:
    """(prompt, choice) pairs, padded to one length: inputs (questions, choices, seq), labels (questions,)."""
    pairs = [(prompt, choice) for prompt, choices, _ in CHOICES for choice in choices]
    flat = encode_batch(tokenizer, pairs)
    shape = (len(CHOICES), len(CHOICES[0][1]), -1)
    return {key: value.view(shape) for key, value in flat.items()} | {
        "labels": torch.tensor([right for _, _, right in CHOICES])
    }


@dataclass(frozen=True)
class Head:
    factory: str  # the Auto* class of transformers
    model_class: type
    make_batch: object  # tokenizer -> the batch, labels included
    kwargs: dict


HEADS = {
    "token-classification": Head(
        "AutoModelForTokenClassification", CrammedBertForTokenClassification, token_batch, {"num_labels": 3}
    ),
    "question-answering": Head(
        "AutoModelForQuestionAnswering", CrammedBertForQuestionAnswering, qa_batch, {}
    ),
    "multiple-choice": Head("AutoModelForMultipleChoice", CrammedBertForMultipleChoice, mc_batch, {}),
}


def evaluated(model, batch: dict) -> dict[str, torch.Tensor]:
    """The loss and every output, in eval mode (no dropout): a deterministic function of the weights."""
    model.eval()
    with torch.no_grad():
        out = model(**batch)
    return dict(out.items())  # the loss and the outputs that are set (hidden states are not asked for)


def train(model, batch: dict, steps: int = 10, lr: float = 1e-3) -> list[float]:
    """A few AdamW steps on the one batch, with dropout on, as fine-tuning runs; the training losses."""
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
    losses = []
    for _ in range(steps):
        loss = model(**batch).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    """A tiny crammed-bert checkpoint, its export and its tokenizer."""
    root = tmp_path_factory.mktemp("heads")
    model, checkpoint = make_checkpoint(root / "run", arch("tiny", **TINY))
    return model, to_transformers(checkpoint, root / "hf"), Tokenizer.from_file(str(checkpoint / TOKENIZER))


@pytest.fixture(scope="module")
def fine_tuned(exported, tmp_path_factory) -> dict:
    """Each head built from the export, evaluated, trained, evaluated again and saved with save_pretrained."""
    _, out, tokenizer = exported
    root = tmp_path_factory.mktemp("fine_tuned")
    done = {}
    for name, head in HEADS.items():
        seed_everything(0)  # the new head's initialization and the dropout masks: the same every run
        model = getattr(transformers, head.factory).from_pretrained(out, **head.kwargs)
        batch = head.make_batch(tokenizer)
        before = evaluated(model, batch)
        weights = copy.deepcopy(model.state_dict())
        losses = train(model, batch)
        after = evaluated(model, batch)
        model.save_pretrained(root / name)
        done[name] = {"model": model, "batch": batch, "before": before, "after": after,
                      "weights": weights, "losses": losses, "folder": root / name}  # fmt: skip
    return done


@pytest.mark.parametrize("name", HEADS)
def test_head_built_from_an_export_fine_tunes(exported, fine_tuned, name):
    checkpoint_model, _, _ = exported
    run = fine_tuned[name]
    model, weights = run["model"], run["weights"]
    assert type(model) is HEADS[name].model_class  # the class cramming.hf registered for the Auto* factory
    for key, value in checkpoint_model.encoder.state_dict().items():  # the pretrained encoder, unchanged
        assert torch.equal(weights[f"encoder.{key}"], value), key
    before, after = run["before"], run["after"]
    print(f"{name}: loss {before['loss']:.4f} -> {after['loss']:.4f}; training losses {run['losses']}")
    assert all(torch.isfinite(value).all() for value in after.values())
    assert after["loss"] < before["loss"]
    changed = {key for key, value in model.state_dict().items() if not torch.equal(value, weights[key])}
    assert any(key.startswith("encoder.") for key in changed) and any(
        not key.startswith("encoder.") for key in changed
    ), "both the encoder and the new head are trained"


@pytest.mark.parametrize("name", HEADS)
def test_fine_tuned_head_saves_and_reloads_with_the_same_outputs(fine_tuned, name):
    run, head = fine_tuned[name], HEADS[name]
    folder = run["folder"]
    # a model built in a process with cramming saves the code beside the weights, as an export does
    for module in ("modeling_crammed_bert.py", "bert.py"):
        assert (folder / module).is_file()
    reloaded = getattr(transformers, head.factory).from_pretrained(folder)
    assert type(reloaded) is head.model_class
    saved = run["model"].state_dict()
    for key, value in reloaded.state_dict().items():  # every weight, bit for bit
        assert torch.equal(value, saved[key]), key
    # The outputs agree to ATOL (tests/test_hf.py), not always bit for bit: the loaded weights are views into
    # the safetensors file, at addresses aligned otherwise than torch's own allocations, and the CPU's
    # vectorized kernels split a sum by alignment (measured: 1.5e-8 apart). The same weights copied into
    # fresh memory give exactly the outputs saved: nothing but their placement differs
    for key, value in evaluated(reloaded, run["batch"]).items():
        torch.testing.assert_close(value, run["after"][key], rtol=0, atol=ATOL, msg=f"{name}: {key}")
    with torch.no_grad():
        for parameter in reloaded.parameters():
            parameter.data = parameter.data.clone()
    for key, value in evaluated(reloaded, run["batch"]).items():
        torch.testing.assert_close(value, run["after"][key], rtol=0, atol=0, msg=f"{name}: {key}")


# Run where cramming cannot be imported (as tests/test_hf.py's FRESH_SCRIPT): transformers loads each saved
# head through the folder's remote code alone
RELOAD_SCRIPT = """
import sys
sys.path.append({site!r})
try:
    import cramming
    raise SystemExit("cramming is importable: the test would prove nothing")
except ModuleNotFoundError:
    pass
import torch
import transformers

runs = torch.load({runs!r})
got = {{}}
for name, run in runs.items():
    factory = getattr(transformers, run["factory"])
    model = factory.from_pretrained(run["folder"], trust_remote_code=True).eval()
    with torch.no_grad():
        out = model(**run["batch"])
    got[name] = {{"class": type(model).__name__, "module": type(model).__module__, **dict(out.items())}}
torch.save(got, {result!r})
"""


@pytest.mark.slow  # a second Python process importing torch and transformers
def test_fine_tuned_heads_reload_in_transformers_alone(fine_tuned, tmp_path):
    runs = {
        name: {"factory": HEADS[name].factory, "folder": str(run["folder"]), "batch": run["batch"]}
        for name, run in fine_tuned.items()
    }  # fmt: skip
    torch.save(runs, tmp_path / "runs.pt")
    script = RELOAD_SCRIPT.format(
        site=sysconfig.get_paths()["purelib"], runs=str(tmp_path / "runs.pt"), result=str(tmp_path / "got.pt")
    )
    env = {"HF_HOME": str(tmp_path / "hf_home"), "HF_HUB_OFFLINE": "1", "PATH": "/usr/bin:/bin"}
    done = subprocess.run(
        [sys.executable, "-I", "-S", "-c", script], cwd=tmp_path, env=env, stdin=subprocess.DEVNULL,
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    got = torch.load(tmp_path / "got.pt")
    for name, run in fine_tuned.items():
        assert got[name]["class"] == HEADS[name].model_class.__name__
        assert got[name]["module"].startswith("transformers_modules")  # the folder's code, not cramming's
        # another process, with its own thread count: the kernels may sum in another order (ATOL, test_hf.py)
        for key, value in run["after"].items():
            torch.testing.assert_close(got[name][key], value, rtol=0, atol=ATOL, msg=f"{name}: {key}")


@pytest.fixture(scope="module")
def bert_exports(tmp_path_factory):
    """A bert-base-shaped checkpoint exported twice: as a native BERT and as crammed_bert."""
    root = tmp_path_factory.mktemp("bert_heads")
    _, checkpoint = make_checkpoint(root / "run", arch("bert-base", **SMALL_BERT_BASE))
    native = to_transformers(checkpoint, root / "native", format="bert")
    crammed = to_transformers(checkpoint, root / "crammed", format="crammed_bert")
    return native, crammed, Tokenizer.from_file(str(checkpoint / TOKENIZER))


# the native BERT head's weights -> ours (transformers' names where a head has no pooler)
HEAD_WEIGHTS = {
    "token-classification": {"classifier.": "classifier."},
    "question-answering": {"qa_outputs.": "qa_outputs."},
    "multiple-choice": {"classifier.": "classifier.", "bert.pooler.dense.": "pooler.0."},
}


def with_cut_off_answer(batch: dict) -> dict:
    """QA: the first answer beyond the sequence (truncated away): clamped to its length, then ignored."""
    if "start_positions" not in batch:
        return batch
    starts, ends = batch["start_positions"].clone(), batch["end_positions"].clone()
    starts[0], ends[0] = 999, 999
    return batch | {"start_positions": starts, "end_positions": ends}


@pytest.mark.parametrize("name", HEADS)
def test_head_computes_what_transformers_bert_computes(bert_exports, name):
    """Our head on the crammed_bert export against transformers' BertFor* on the native export of the same
    checkpoint, with the same (random) head weights: the same outputs and the same loss."""
    native_folder, crammed_folder, tokenizer = bert_exports
    head = HEADS[name]
    factory = getattr(transformers, head.factory)
    native = factory.from_pretrained(native_folder, **head.kwargs).eval()
    assert type(native).__name__ == head.model_class.__name__.replace("CrammedBert", "Bert")
    pooled = {"classifier_head_dim": SMALL_BERT_BASE["hidden_size"]} if name == "multiple-choice" else {}
    ours = factory.from_pretrained(crammed_folder, **head.kwargs, **pooled).eval()
    copied = {
        mine + key.removeprefix(theirs): value
        for theirs, mine in HEAD_WEIGHTS[name].items()
        for key, value in native.state_dict().items()
        if key.startswith(theirs)
    }
    missing, unexpected = ours.load_state_dict(copied, strict=False)
    assert not unexpected and all(key.startswith("encoder.") for key in missing)
    batch = with_cut_off_answer(head.make_batch(tokenizer))
    if name != "token-classification":  # pairs: the token types count
        assert batch["token_type_ids"].any()
    expected, got = evaluated(native, batch), evaluated(ours, batch)
    for key, value in expected.items():
        torch.testing.assert_close(got[key], value, rtol=0, atol=ATOL, msg=f"{name}: {key}")
